"""LlamaGen VQ image tokenizer.

A convolutional VQ autoencoder (taming-transformers style encoder/decoder with a
low-dimensional, l2-normalised codebook) as described in LlamaGen: "Autoregressive Model
Beats Diffusion: Llama for Scalable Image Generation", Sun et al. 2024, arXiv 2406.06525.

Module names and parameter shapes match the official release, so official checkpoints load
with ``load_state_dict(strict=True)``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mmgen.modeling import normalised_rows

# Length of the rolling window of recent code indices used to report codebook usage.
CODEBOOK_USAGE_WINDOW = 65536


@dataclass
class VQConfig:
    """Hyper-parameters of the VQ tokenizer (defaults: LlamaGen VQ-16)."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    codebook_show_usage: bool = True
    commit_loss_beta: float = 0.25
    entropy_loss_ratio: float = 0.0
    encoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    decoder_ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    z_channels: int = 256
    dropout_p: float = 0.0
    base_channels: int = 128
    num_res_blocks: int = 2

    def __post_init__(self) -> None:
        self.encoder_ch_mult = tuple(self.encoder_ch_mult)
        self.decoder_ch_mult = tuple(self.decoder_ch_mult)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.encoder_ch_mult) - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["encoder_ch_mult"] = list(self.encoder_ch_mult)
        d["decoder_ch_mult"] = list(self.decoder_ch_mult)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VQConfig":
        return cls(**d)


VQ_CONFIGS: dict[str, VQConfig] = {
    "VQ-16": VQConfig(),
    "VQ-8": VQConfig(encoder_ch_mult=(1, 2, 2, 4), decoder_ch_mult=(1, 2, 2, 4)),
}


class VQLosses(NamedTuple):
    """Quantizer losses; the three losses are None outside training, as in LlamaGen."""

    vq_loss: Optional[Tensor]
    commit_loss: Optional[Tensor]
    entropy_loss: Optional[Tensor]
    codebook_usage: float


# ----------------------------------------------------------------------------- building blocks


def Normalize(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


def swish(x: Tensor) -> Tensor:
    # Written out rather than F.silu so outputs match the official model bit-for-bit.
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = Normalize(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
        self.norm2 = Normalize(out_channels)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.nin_shortcut = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1) if in_channels != out_channels else None
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(self.dropout(swish(self.norm2(h))))
        if self.nin_shortcut is not None:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head spatial self-attention with 1x1-conv projections."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = Normalize(channels)
        self.q = nn.Conv2d(channels, channels, kernel_size=1)
        self.k = nn.Conv2d(channels, channels, kernel_size=1)
        self.v = nn.Conv2d(channels, channels, kernel_size=1)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, height, width = x.shape
        h = self.norm(x)
        q = self.q(h).flatten(2).transpose(1, 2)  # [b, hw, c]
        k = self.k(h).flatten(2)  # [b, c, hw]
        v = self.v(h).flatten(2)  # [b, c, hw]
        attn = torch.softmax(torch.bmm(q, k) * c**-0.5, dim=2)  # [b, hw_q, hw_k]
        h = torch.bmm(v, attn.transpose(1, 2)).reshape(b, c, height, width)
        return x + self.proj_out(h)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        # Asymmetric padding (right/bottom only), as in taming-transformers.
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Stage(nn.Module):
    """Residual blocks at one resolution, each followed by self-attention if `with_attn`."""

    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, with_attn: bool, dropout: float):
        super().__init__()
        self.res = nn.ModuleList(
            ResnetBlock(in_channels if i == 0 else out_channels, out_channels, dropout) for i in range(num_blocks)
        )
        self.attn = nn.ModuleList(AttnBlock(out_channels) for _ in range(num_blocks if with_attn else 0))

    def forward(self, x: Tensor) -> Tensor:
        for i, res in enumerate(self.res):
            x = res(x)
            if len(self.attn) > 0:
                x = self.attn[i](x)
        return x


class EncoderStage(Stage):
    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, with_attn: bool,
                 downsample: bool, dropout: float):
        super().__init__(in_channels, out_channels, num_blocks, with_attn, dropout)
        self.downsample = Downsample(out_channels) if downsample else None

    def forward(self, x: Tensor) -> Tensor:
        x = super().forward(x)
        return self.downsample(x) if self.downsample is not None else x


class DecoderStage(Stage):
    def __init__(self, in_channels: int, out_channels: int, num_blocks: int, with_attn: bool,
                 upsample: bool, dropout: float):
        super().__init__(in_channels, out_channels, num_blocks, with_attn, dropout)
        self.upsample = Upsample(out_channels) if upsample else None

    def forward(self, x: Tensor) -> Tensor:
        x = super().forward(x)
        return self.upsample(x) if self.upsample is not None else x


def mid_block(channels: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(
        ResnetBlock(channels, channels, dropout), AttnBlock(channels), ResnetBlock(channels, channels, dropout)
    )


# ----------------------------------------------------------------------------- encoder / decoder


class Encoder(nn.Module):
    """Image [B, 3, H, W] -> latent [B, z_channels, H/f, W/f]; attention only at the lowest resolution."""

    def __init__(self, config: VQConfig, in_channels: int = 3):
        super().__init__()
        ch, mult = config.base_channels, config.encoder_ch_mult
        last = len(mult) - 1
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, padding=1)
        in_mult = (1,) + mult
        self.conv_blocks = nn.ModuleList(
            EncoderStage(ch * in_mult[i], ch * mult[i], config.num_res_blocks, with_attn=i == last,
                         downsample=i != last, dropout=config.dropout_p)
            for i in range(len(mult))
        )
        block_in = ch * mult[-1]
        self.mid = mid_block(block_in, config.dropout_p)
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, config.z_channels, kernel_size=3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        for stage in self.conv_blocks:
            h = stage(h)
        h = self.mid(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent [B, z_channels, h, w] -> image [B, 3, h*f, w*f]; stages run from lowest resolution up."""

    def __init__(self, config: VQConfig, out_channels: int = 3):
        super().__init__()
        ch, mult = config.base_channels, config.decoder_ch_mult
        last = len(mult) - 1
        block_in = ch * mult[-1]
        self.conv_in = nn.Conv2d(config.z_channels, block_in, kernel_size=3, padding=1)
        self.mid = mid_block(block_in, config.dropout_p)
        stages = []
        for i in reversed(range(len(mult))):
            stages.append(DecoderStage(block_in, ch * mult[i], config.num_res_blocks + 1, with_attn=i == last,
                                       upsample=i != 0, dropout=config.dropout_p))
            block_in = ch * mult[i]
        self.conv_blocks = nn.ModuleList(stages)
        self.norm_out = Normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, out_channels, kernel_size=3, padding=1)

    @property
    def last_layer(self) -> Tensor:
        return self.conv_out.weight

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for stage in self.conv_blocks:
            h = stage(h)
        return self.conv_out(swish(self.norm_out(h)))


# ----------------------------------------------------------------------------- quantizer


def entropy_loss(affinity: Tensor, temperature: float = 0.01) -> Tensor:
    """Per-sample entropy minus entropy of the mean assignment (encourages confident, diverse codes)."""
    logits = affinity.reshape(-1, affinity.shape[-1]) / temperature
    probs = F.softmax(logits, dim=-1)
    log_probs = F.log_softmax(logits + 1e-5, dim=-1)
    avg_probs = probs.mean(dim=0)
    avg_entropy = -torch.sum(avg_probs * torch.log(avg_probs + 1e-5))
    sample_entropy = -torch.mean(torch.sum(probs * log_probs, dim=-1))
    return sample_entropy - avg_entropy


class VectorQuantizer(nn.Module):
    """Nearest-neighbour codebook lookup with a straight-through gradient estimator."""

    def __init__(self, config: VQConfig):
        super().__init__()
        self.codebook_size = config.codebook_size
        self.embed_dim = config.codebook_embed_dim
        self.beta = config.commit_loss_beta
        self.entropy_loss_ratio = config.entropy_loss_ratio
        self.l2_norm = config.codebook_l2_norm
        self.show_usage = config.codebook_show_usage

        self.embedding = nn.Embedding(config.codebook_size, config.codebook_embed_dim)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / config.codebook_size, 1.0 / config.codebook_size)
            if self.l2_norm:
                self.embedding.weight.copy_(F.normalize(self.embedding.weight, p=2, dim=-1))
        if self.show_usage:
            # Rolling window of recently used indices (stored as floats, as in the official checkpoints).
            self.register_buffer("codebook_used", torch.zeros(CODEBOOK_USAGE_WINDOW))

    def codebook(self) -> Tensor:
        """Codebook vectors [codebook_size, embed_dim], l2-normalised if configured (memoised
        outside autograd, see `mmgen.modeling.normalised_rows`)."""
        return normalised_rows(self.embedding.weight) if self.l2_norm else self.embedding.weight

    def embed_code(self, codes: Tensor) -> Tensor:
        """Look up codes of any shape; returns [*codes.shape, embed_dim] (channel last)."""
        return self.codebook()[codes]

    def forward(self, z: Tensor) -> tuple[Tensor, VQLosses, Tensor]:
        """Quantize z [B, C, h, w]; returns (z_q [B, C, h, w], losses, indices [B, h*w] row-major)."""
        b, _, h, w = z.shape
        z = z.permute(0, 2, 3, 1).reshape(b, h * w, self.embed_dim)
        if self.l2_norm:
            z = F.normalize(z, p=2, dim=-1)
        embedding = self.codebook()

        z_flat = z.reshape(-1, self.embed_dim)
        # Squared distance expanded as |z|^2 + |e|^2 - 2 z.e (same arithmetic as the official code).
        d = (
            torch.sum(z_flat**2, dim=1, keepdim=True)
            + torch.sum(embedding**2, dim=1)
            - 2 * z_flat @ embedding.t()
        )
        indices = torch.argmin(d, dim=1)
        z_q = embedding[indices].view_as(z)

        usage = self._track_usage(indices) if self.show_usage and self.training else 0.0
        if self.training:
            vq_loss = torch.mean((z_q - z.detach()) ** 2)
            commit_loss = self.beta * torch.mean((z_q.detach() - z) ** 2)
            if self.entropy_loss_ratio > 0:
                ent_loss = self.entropy_loss_ratio * entropy_loss(-d)
            else:
                # Skip the [N, codebook_size] softmax when it would be multiplied by zero.
                ent_loss = d.new_zeros(())
            losses = VQLosses(vq_loss, commit_loss, ent_loss, usage)
        else:
            losses = VQLosses(None, None, None, usage)

        z_q = z + (z_q - z).detach()  # straight-through estimator
        z_q = z_q.view(b, h, w, self.embed_dim).permute(0, 3, 1, 2).contiguous()
        return z_q, losses, indices.view(b, h * w)

    @torch.no_grad()
    def _track_usage(self, indices: Tensor) -> float:
        buf, n = self.codebook_used, indices.numel()
        if n >= buf.numel():
            buf.copy_(indices[-buf.numel():])
        else:
            buf[:-n] = buf[n:].clone()
            buf[-n:] = indices
        return len(torch.unique(buf)) / self.codebook_size


# ----------------------------------------------------------------------------- full model


class VQModel(nn.Module):
    """LlamaGen VQ tokenizer: encoder -> quant_conv -> quantize -> post_quant_conv -> decoder."""

    def __init__(self, config: Optional[VQConfig] = None):
        super().__init__()
        self.config = config = config if config is not None else VQConfig()
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = VectorQuantizer(config)
        self.quant_conv = nn.Conv2d(config.z_channels, config.codebook_embed_dim, kernel_size=1)
        self.post_quant_conv = nn.Conv2d(config.codebook_embed_dim, config.z_channels, kernel_size=1)

    @classmethod
    def from_config(cls, config: Union[VQConfig, str, dict[str, Any]]) -> "VQModel":
        """Build from a VQConfig, a name in VQ_CONFIGS ("VQ-16", "VQ-8") or a config dict."""
        if isinstance(config, str):
            config = VQ_CONFIGS[config]
        elif isinstance(config, dict):
            config = VQConfig.from_dict(config)
        return cls(config)

    def encode(self, x: Tensor) -> tuple[Tensor, VQLosses, Tensor]:
        """Images [B, 3, H, W] in [-1, 1] -> (quant [B, C, h, w], losses, indices [B, h*w])."""
        return self.quantize(self.quant_conv(self.encoder(x)))

    def decode(self, quant: Tensor) -> Tensor:
        """Quantized latents [B, C, h, w] -> images [B, 3, H, W] (nominally [-1, 1], not clamped)."""
        return self.decoder(self.post_quant_conv(quant))

    def decode_code(self, codes: Tensor, shape: Optional[Sequence[int]] = None) -> Tensor:
        """Decode code indices to images (nominally [-1, 1], not clamped).

        codes: [B, h, w], or [B, h*w] (a square grid unless `shape` is given).
        shape: (h, w), or the official (B, C, h, w) latent shape.
        """
        if shape is not None:
            h, w = shape[-2:]
            codes = codes.reshape(-1, h, w)
        elif codes.dim() == 2:
            side = math.isqrt(codes.shape[1])
            if side * side != codes.shape[1]:
                raise ValueError(f"cannot infer a square grid from {codes.shape[1]} codes; pass shape=(h, w)")
            codes = codes.reshape(codes.shape[0], side, side)
        elif codes.dim() != 3:
            raise ValueError(f"expected codes of shape [B, h*w] or [B, h, w], got {tuple(codes.shape)}")
        quant = self.quantize.embed_code(codes).permute(0, 3, 1, 2).contiguous()
        return self.decode(quant)

    def forward(self, x: Tensor) -> tuple[Tensor, VQLosses]:
        quant, losses, _ = self.encode(x)
        return self.decode(quant), losses
