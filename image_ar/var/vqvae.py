"""VAR's multi-scale residual VQVAE (Tian et al. 2024, arXiv 2404.02905).

An image is encoded once into a feature map f [B, Cvae, h, w]; it is then quantized coarse to
fine: at scale k the remaining residual is area-downsampled to pn_k x pn_k, each vector is
replaced by its nearest code, the codes are bicubic-upsampled back to h x w, refined by a
shared 3x3 convolution phi (`quant_resi`), and subtracted from the residual. The sum of the
refined maps, f_hat, is what the decoder turns back into pixels. VAR generates the K token
maps one scale at a time; the input for scale k + 1 is f_hat so far, area-downsampled.

Parameter names and shapes are the official `vae_ch160v4096z32.pth`'s, so that file loads
strictly; `phi_index` reproduces the official scale -> phi assignment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmgen.image_ar.autoencoder_blocks import Decoder, Encoder, FusedQKVAttention


@dataclass
class VQVAEConfig:
    """Hyper-parameters with the official names (defaults: `vae_ch160v4096z32.pth`)."""

    vocab_size: int = 4096
    z_channels: int = 32
    ch: int = 160
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    using_sa: bool = True
    using_mid_sa: bool = True
    dropout: float = 0.0
    beta: float = 0.25
    using_znorm: bool = False
    quant_conv_ks: int = 3
    quant_resi: float = 0.5
    share_quant_resi: int = 4
    default_qresi_counts: int = 0
    patch_nums: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)

    def __post_init__(self) -> None:
        self.ch_mult = tuple(self.ch_mult)
        self.patch_nums = tuple(self.patch_nums)
        if any(b <= a for a, b in zip(self.patch_nums, self.patch_nums[1:])):
            raise ValueError(f"patch_nums must increase, got {self.patch_nums}")

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def image_size(self) -> int:
        return self.patch_nums[-1] * self.downsample

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ch_mult"], d["patch_nums"] = list(self.ch_mult), list(self.patch_nums)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VQVAEConfig":
        return cls(**d)


# ---------------------------------------------------------------------------- encoder / decoder


def var_encoder(c: VQVAEConfig) -> Encoder:
    """The official `Encoder`: attention (fused `qkv`) in the last level if `using_sa`."""
    return Encoder(in_channels=3, ch=c.ch, ch_mult=c.ch_mult, num_res_blocks=c.num_res_blocks, out_channels=c.z_channels,
                   dropout=c.dropout, attention=FusedQKVAttention,
                   attn_levels={len(c.ch_mult) - 1} if c.using_sa else set(), mid_attention=c.using_mid_sa)


def var_decoder(c: VQVAEConfig) -> Decoder:
    """The official `Decoder`: attention (fused `qkv`) in the last level if `using_sa`."""
    return Decoder(z_channels=c.z_channels, ch=c.ch, ch_mult=c.ch_mult, num_res_blocks=c.num_res_blocks, out_channels=3,
                   dropout=c.dropout, attention=FusedQKVAttention,
                   attn_levels={len(c.ch_mult) - 1} if c.using_sa else set(), mid_attention=c.using_mid_sa)


# ---------------------------------------------------------------------------- quantizer


class Phi(nn.Conv2d):
    """phi(h) = (1 - r) h + r conv3x3(h): the refinement applied to each upsampled scale."""

    def __init__(self, channels: int, ratio: float):
        super().__init__(channels, channels, 3, padding=1)
        self.ratio = abs(ratio)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mul(1 - self.ratio) + super().forward(h).mul(self.ratio)


class SharedPhi(nn.Module):
    """share_quant_resi == 1: one phi for every scale (official key `quant_resi.qresi`)."""

    def __init__(self, phi: nn.Module):
        super().__init__()
        self.qresi = phi


class PartiallySharedPhi(nn.Module):
    """share_quant_resi == K > 1: K phis (official key `quant_resi.qresi_ls.k`)."""

    def __init__(self, phis: list[nn.Module]):
        super().__init__()
        self.qresi_ls = nn.ModuleList(phis)


def phi_ticks(count: int) -> np.ndarray:
    """Where each of `count` phis sits on [0, 1]; scale k of K uses the phi nearest k / (K - 1).
    The official code spaces 4 phis from 1/12 to 11/12 and other counts from 1/(2n) to 1 - 1/(2n)."""
    return np.linspace(1 / 3 / count, 1 - 1 / 3 / count, count) if count == 4 else np.linspace(1 / 2 / count, 1 - 1 / 2 / count, count)


class MultiScaleQuantizer(nn.Module):
    """The official `VectorQuantizer2`: residual quantization over `patch_nums` scales."""

    def __init__(self, c: VQVAEConfig):
        super().__init__()
        self.config = c
        make = lambda: Phi(c.z_channels, c.quant_resi) if abs(c.quant_resi) > 1e-6 else nn.Identity()
        if c.share_quant_resi == 0:  # one phi per scale; the official container is itself the ModuleList
            self.quant_resi = nn.ModuleList([make() for _ in range(c.default_qresi_counts or len(c.patch_nums))])
            self._phis = list(self.quant_resi)
        elif c.share_quant_resi == 1:
            self.quant_resi = SharedPhi(make())
            self._phis = [self.quant_resi.qresi]
        else:
            self.quant_resi = PartiallySharedPhi([make() for _ in range(c.share_quant_resi)])
            self._phis = list(self.quant_resi.qresi_ls)
        # Codebook usage statistics of the official training run; kept so official files load.
        self.register_buffer("ema_vocab_hit_SV", torch.zeros(len(c.patch_nums), c.vocab_size))
        self.embedding = nn.Embedding(c.vocab_size, c.z_channels)

    @property
    def num_scales(self) -> int:
        return len(self.config.patch_nums)

    def phi_index(self, scale: int) -> int:
        """The official scale -> phi assignment (nearest tick to scale / (K - 1))."""
        at = scale / (self.num_scales - 1) if self.num_scales > 1 else 0.0
        if len(self._phis) == 1:
            return 0
        return int(np.argmin(np.abs(phi_ticks(len(self._phis)) - at)))

    def phi(self, scale: int, h: torch.Tensor) -> torch.Tensor:
        """phi of scale `scale` in the weights' dtype; f_hat itself accumulates in float32."""
        dtype = self.embedding.weight.dtype
        return self._phis[self.phi_index(scale)](h.to(dtype)).float()

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Code indices [N] of the vectors z [N, Cvae] (L2, or cosine with `using_znorm`)."""
        codebook = self.embedding.weight.float()
        if self.config.using_znorm:
            return (F.normalize(z, dim=-1) @ F.normalize(codebook, dim=-1).T).argmax(1)
        distance = z.square().sum(1, keepdim=True) + codebook.square().sum(1) - 2 * z @ codebook.T
        return distance.argmin(1)

    def upsampled(self, scale: int, tokens: torch.Tensor, size: int) -> torch.Tensor:
        """Scale `scale`'s token map [B, pn*pn] as phi(bicubic-up(codes)) [B, Cvae, size, size].

        A float map [B, pn*pn, V] holds weights over the codebook (a soft map: VAR's
        `more_smooth` feeds the weighted mean of the codes)."""
        pn = self.config.patch_nums[scale]
        codes = tokens.to(self.embedding.weight.dtype) @ self.embedding.weight if tokens.is_floating_point() else self.embedding(tokens)
        h = codes.transpose(1, 2).reshape(tokens.shape[0], -1, pn, pn).float()
        if scale != self.num_scales - 1:
            h = F.interpolate(h, size=(size, size), mode="bicubic")
        return self.phi(scale, h)

    def quantize(self, f: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Residual quantization of f [B, Cvae, H, W]: token maps [B, pn*pn] per scale, f_hat
        (no gradient to f) and the official VQ loss (commitment on f, codebook/phi on f_hat)."""
        f = f.float()
        b, c, size, _ = f.shape
        if size != self.config.patch_nums[-1]:
            raise ValueError(f"feature map is {size}x{size}; this quantizer's last scale is {self.config.patch_nums[-1]}")
        rest, f_hat = f.detach().clone(), torch.zeros_like(f)
        tokens, loss = [], f.new_zeros(())
        for scale, pn in enumerate(self.config.patch_nums):
            z = rest if scale == self.num_scales - 1 else F.interpolate(rest, size=(pn, pn), mode="area")
            with torch.no_grad():
                index = self.nearest(z.permute(0, 2, 3, 1).reshape(-1, c)).view(b, pn * pn)
            h = self.upsampled(scale, index, size)
            f_hat = f_hat + h
            rest = rest - h.detach()
            tokens.append(index)
            loss = loss + F.mse_loss(f_hat.detach(), f) * self.config.beta + F.mse_loss(f_hat, f.detach())
        return tokens, f_hat, loss / self.num_scales

    def tokens_to_fhat(self, tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """f_hat [B, Cvae, H, W] from the token maps of every scale."""
        f_hat = None
        size = self.config.patch_nums[-1]
        for scale, t in enumerate(tokens):
            h = self.upsampled(scale, t, size)
            f_hat = h if f_hat is None else f_hat + h
        return f_hat

    def add_scale(self, f_hat: Optional[torch.Tensor], scale: int, tokens: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Add scale `scale`'s token map to f_hat (None before scale 0); return the new f_hat
        and the transformer's input for the next scale, [B, pn_next^2, Cvae] (None after the
        last scale): f_hat area-downsampled, as the official `get_next_autoregressive_input`."""
        h = self.upsampled(scale, tokens, self.config.patch_nums[-1])
        f_hat = h if f_hat is None else f_hat + h
        if scale == self.num_scales - 1:
            return f_hat, None
        pn = self.config.patch_nums[scale + 1]
        return f_hat, F.interpolate(f_hat, size=(pn, pn), mode="area").flatten(2).transpose(1, 2)

    def next_scale_inputs(self, tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """Teacher-forcing inputs [B, sum of pn^2 for scales 1..len(tokens), Cvae] from the first
        token maps (VAR training; also a hand-off prefill). Equals chaining `add_scale`."""
        f_hat, inputs = None, []
        for scale, t in enumerate(tokens):
            f_hat, nxt = self.add_scale(f_hat, scale, t)
            if nxt is not None:
                inputs.append(nxt)
        return torch.cat(inputs, 1)


class VQVAEOutput(NamedTuple):
    reconstruction: torch.Tensor
    tokens: list[torch.Tensor]
    vq_loss: torch.Tensor


class MultiScaleVQVAE(nn.Module):
    """The official `VQVAE`: encoder -> quant_conv -> multi-scale quantizer -> post_quant_conv -> decoder."""

    def __init__(self, config: VQVAEConfig):
        super().__init__()
        self.config = config
        self.encoder = var_encoder(config)
        self.decoder = var_decoder(config)
        self.quantize = MultiScaleQuantizer(config)
        ks = config.quant_conv_ks
        self.quant_conv = nn.Conv2d(config.z_channels, config.z_channels, ks, padding=ks // 2)
        self.post_quant_conv = nn.Conv2d(config.z_channels, config.z_channels, ks, padding=ks // 2)

    def forward(self, images: torch.Tensor) -> VQVAEOutput:
        """Training: reconstruction through the straight-through estimator, tokens, VQ loss."""
        f = self.quant_conv(self.encoder(images))
        tokens, f_hat, loss = self.quantize.quantize(f)
        f_hat = f + (f_hat - f).detach()  # straight-through: the decoder's gradient reaches the encoder
        return VQVAEOutput(self.decoder(self.post_quant_conv(f_hat)), tokens, loss)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Images [B, 3, H, W] in [-1, 1] -> token maps [B, pn*pn], coarse to fine."""
        return self.quantize.quantize(self.quant_conv(self.encoder(images)))[0]

    def decode_fhat(self, f_hat: torch.Tensor) -> torch.Tensor:
        """f_hat -> images in [-1, 1]."""
        return self.decoder(self.post_quant_conv(f_hat.to(self.post_quant_conv.weight.dtype))).clamp(-1, 1)

    def decode(self, tokens: Sequence[torch.Tensor]) -> torch.Tensor:
        """Token maps of every scale -> images in [-1, 1]."""
        return self.decode_fhat(self.quantize.tokens_to_fhat(tokens))
