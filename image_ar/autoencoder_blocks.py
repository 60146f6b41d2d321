"""The LDM / taming-transformers convolutional encoder and decoder, shared by the image tokenizers.

VAR's multi-scale VQVAE and MAR's KL-16 VAE use the same skeleton: `conv_in`, one level per
entry of `ch_mult` (`down.i` / `up.i`, each with `block.j` resnet blocks, optional `attn.j`
self-attention after each block, and a `downsample` / `upsample`), a middle (`mid.block_1`,
`mid.attn_1`, `mid.block_2`), `norm_out` and `conv_out`. They differ only in which levels attend,
in the attention block's parameters (VAR: one fused `qkv` 1x1 conv; LDM: separate `q`, `k`, `v`)
and in the encoder's output width (the KL VAE outputs mean and log-variance). Module names
follow the official checkpoints so that they load strictly.
"""

from __future__ import annotations

from typing import Callable, Collection, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

AttentionFactory = Callable[[int], nn.Module]


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, dropout: float):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = group_norm(out_channels)
        self.dropout = nn.Dropout(dropout) if dropout > 1e-6 else nn.Identity()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.nin_shortcut(x) + h


def pixel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Single-head attention of q, k, v [B, C, N] (N pixels, scale C^-1/2) -> [B, C, N]."""
    weights = torch.softmax(torch.bmm(q.transpose(1, 2), k) * q.shape[1] ** -0.5, dim=2)  # [B, query, key]
    return torch.bmm(v, weights.transpose(1, 2))


class FusedQKVAttention(nn.Module):
    """Self-attention over the pixels of a feature map, q/k/v from one 1x1 conv (VAR's `qkv`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        return x + self.proj_out(pixel_attention(q, k, v).view(b, c, h, w))


class SeparateQKVAttention(nn.Module):
    """The same attention with separate `q`, `k`, `v` 1x1 convs (LDM's `AttnBlock`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        hn = self.norm(x)
        q, k, v = (proj(hn).reshape(b, c, h * w) for proj in (self.q, self.k, self.v))
        return x + self.proj_out(pixel_attention(q, k, v).view(b, c, h, w))


class Downsample2x(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric padding, as taming-transformers


class Upsample2x(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class Level(nn.Module):
    """One resolution of the encoder or decoder (the official `down.i` / `up.i` containers)."""

    def __init__(self, blocks: list[nn.Module], attns: list[nn.Module], resample: Optional[nn.Module], resample_name: str):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList(attns)
        if resample is not None:
            setattr(self, resample_name, resample)

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[i](h)
        return h


class Middle(nn.Module):
    def __init__(self, channels: int, dropout: float, attention: Optional[AttentionFactory]):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, dropout)
        self.attn_1 = attention(channels) if attention is not None else nn.Identity()
        self.block_2 = ResnetBlock(channels, channels, dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


def _level(in_channels: int, out_channels: int, num_blocks: int, dropout: float, attention: Optional[AttentionFactory],
           resample: Optional[nn.Module], resample_name: str) -> Level:
    blocks = [ResnetBlock(in_channels if j == 0 else out_channels, out_channels, dropout) for j in range(num_blocks)]
    attns = [attention(out_channels) for _ in range(num_blocks)] if attention is not None else []
    return Level(blocks, attns, resample, resample_name)


class Encoder(nn.Module):
    """Image [B, in_channels, H, W] -> [B, out_channels, H / 2^(L-1), W / 2^(L-1)], L = len(ch_mult).

    `attn_levels`: indices of the levels whose blocks are followed by `attention` (level i runs
    at H / 2^i); `mid_attention`: whether the middle attends."""

    def __init__(self, *, in_channels: int, ch: int, ch_mult: Sequence[int], num_res_blocks: int, out_channels: int,
                 dropout: float, attention: AttentionFactory, attn_levels: Collection[int], mid_attention: bool):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        levels, block_in = [], ch
        for i, mult in enumerate(ch_mult):
            last = i == len(ch_mult) - 1
            block_out = ch * mult
            levels.append(_level(block_in, block_out, num_res_blocks, dropout, attention if i in attn_levels else None,
                                 None if last else Downsample2x(block_out), "downsample"))
            block_in = block_out
        self.down = nn.ModuleList(levels)
        self.mid = Middle(block_in, dropout, attention if mid_attention else None)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = level.run_blocks(h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    """[B, z_channels, h, w] -> [B, out_channels, h * 2^(L-1), w * 2^(L-1)]; num_res_blocks + 1
    blocks per level, `attn_levels` / `mid_attention` as in `Encoder` (level i runs at h * 2^(L-1-i))."""

    def __init__(self, *, z_channels: int, ch: int, ch_mult: Sequence[int], num_res_blocks: int, out_channels: int,
                 dropout: float, attention: AttentionFactory, attn_levels: Collection[int], mid_attention: bool):
        super().__init__()
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = Middle(block_in, dropout, attention if mid_attention else None)
        levels: list[Level] = []
        for i in reversed(range(len(ch_mult))):
            block_out = ch * ch_mult[i]
            levels.insert(0, _level(block_in, block_out, num_res_blocks + 1, dropout, attention if i in attn_levels else None,
                                    Upsample2x(block_out) if i != 0 else None, "upsample"))
            block_in = block_out
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            h = level.run_blocks(h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))
