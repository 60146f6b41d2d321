"""MAR's KL-16 VAE (Li et al. 2024, arXiv 2406.11838): the LDM `AutoencoderKL` MAR generates in.

An image [B, 3, 256, 256] in [-1, 1] is encoded into a diagonal Gaussian over latents
[B, 16, 16, 16] (16x downsampling); MAR samples it and multiplies by `MAR_LATENT_SCALE` to get
its tokens, and divides by that scale before decoding (the scale is applied by MAR, outside
the VAE, as the official `engine_mar.py` does; `KLVAEConfig.scaling_factor` holds it).

Parameter names and shapes are the official `models/vae.py` `AutoencoderKL(embed_dim=16,
ch_mult=(1, 1, 2, 2, 4))`'s (`encoder.*`, `decoder.*`, `quant_conv`, `post_quant_conv`), so the
released `kl16.ckpt` loads strictly. That file nests the weights under "model", which
`mmgen.hub.load_state_dict` unwraps (reading it with `weights_only=True`). The official
loader is non-strict, so a training checkpoint may also hold the LDM training loss
(`loss.*`: LPIPS and discriminator weights, `loss.logvar`); those keys are dropped
(`OFFICIAL_IGNORED_KEYS`), anything else must match exactly.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from mmgen.hub import load_state_dict, load_strict, resolve_path
from mmgen.image_ar.autoencoder_blocks import Decoder, Encoder, SeparateQKVAttention

#: MAR's latent scale: tokens = posterior.sample() * 0.2325; images = vae.decode(tokens / 0.2325).
MAR_LATENT_SCALE = 0.2325

#: Regexes of checkpoint keys that are not part of the autoencoder (training loss modules).
OFFICIAL_IGNORED_KEYS = (r"loss\..*",)


@dataclass
class KLVAEConfig:
    """Hyper-parameters; defaults are the official `AutoencoderKL(embed_dim=16, ch_mult=(1,1,2,2,4))`
    with its Encoder/Decoder defaults (attention in the encoder's 16x16 level and both middles,
    none in the decoder's levels; levels are placed by the nominal `resolution`, not the input)."""

    embed_dim: int = 16
    z_channels: int = 16  # the official code passes z_channels=embed_dim
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    encoder_attn_resolutions: tuple[int, ...] = (16,)
    decoder_attn_resolutions: tuple[int, ...] = ()
    dropout: float = 0.0
    in_channels: int = 3
    out_ch: int = 3
    resolution: int = 256
    double_z: bool = True
    use_variational: bool = True
    #: MAR's tokens are latents times this (diffusers' `AutoencoderKL.config.scaling_factor`); a
    #: VAE trained elsewhere brings its own (chosen so the tokens have about unit variance).
    scaling_factor: float = MAR_LATENT_SCALE

    def __post_init__(self) -> None:
        self.ch_mult = tuple(self.ch_mult)
        self.encoder_attn_resolutions = tuple(self.encoder_attn_resolutions)
        self.decoder_attn_resolutions = tuple(self.decoder_attn_resolutions)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def latent_size(self) -> int:
        return self.resolution // self.downsample

    def level_resolution(self, level: int) -> int:
        """The nominal resolution level `level` (encoder `down.i`, decoder `up.i`) runs at."""
        return self.resolution // 2**level

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("ch_mult", "encoder_attn_resolutions", "decoder_attn_resolutions"):
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KLVAEConfig":
        return cls(**d)


class DiagonalGaussian:
    """The posterior N(mean, exp(logvar)) from moments [B, 2C, h, w] (mean first); logvar is
    clamped to [-30, 20] as the official `DiagonalGaussianDistribution`."""

    def __init__(self, moments: torch.Tensor):
        self.moments = moments
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)
        self.var = torch.exp(self.logvar)

    def sample(self, generator: Optional[torch.Generator]) -> torch.Tensor:
        """mean + std * eps, eps ~ N(0, 1) drawn from `generator` only (float32, on the
        generator's device, then moved to the mean's). None uses torch's default generator of
        the mean's device. With a CPU generator seeded s this equals the official `sample()`
        after `torch.manual_seed(s)`."""
        device = generator.device if generator is not None else self.mean.device
        eps = torch.randn(self.mean.shape, generator=generator, device=device, dtype=torch.float32)
        return self.mean + self.std * eps.to(self.mean.device, self.mean.dtype)

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self, other: Optional["DiagonalGaussian"] = None) -> torch.Tensor:
        """KL(self || other) per sample, summed over [C, h, w]; other = N(0, 1) if None."""
        if other is None:
            terms = self.mean.square() + self.var - 1.0 - self.logvar
        else:
            terms = (self.mean - other.mean).square() / other.var + self.var / other.var - 1.0 - self.logvar + other.logvar
        return 0.5 * terms.sum(dim=(1, 2, 3))


class KLVAE(nn.Module):
    """The official `AutoencoderKL`: encoder -> quant_conv -> Gaussian; latents ->
    post_quant_conv -> decoder. Images are in [-1, 1]; decode does not clamp (as the official)."""

    def __init__(self, config: Optional[KLVAEConfig] = None):
        super().__init__()
        c = self.config = config or KLVAEConfig()
        self.encoder = Encoder(
            in_channels=c.in_channels, ch=c.ch, ch_mult=c.ch_mult, num_res_blocks=c.num_res_blocks,
            out_channels=2 * c.z_channels if c.double_z else c.z_channels, dropout=c.dropout,
            attention=SeparateQKVAttention, mid_attention=True,
            attn_levels={i for i in range(len(c.ch_mult)) if c.level_resolution(i) in c.encoder_attn_resolutions},
        )
        self.decoder = Decoder(
            z_channels=c.z_channels, ch=c.ch, ch_mult=c.ch_mult, num_res_blocks=c.num_res_blocks, out_channels=c.out_ch,
            dropout=c.dropout, attention=SeparateQKVAttention, mid_attention=True,
            attn_levels={i for i in range(len(c.ch_mult)) if c.level_resolution(i) in c.decoder_attn_resolutions},
        )
        moments = 2 * c.embed_dim if c.use_variational else c.embed_dim
        self.quant_conv = nn.Conv2d(2 * c.z_channels if c.double_z else c.z_channels, moments, 1)
        self.post_quant_conv = nn.Conv2d(c.embed_dim, c.z_channels, 1)

    @classmethod
    def from_official(cls, path_or_repo: Union[str, os.PathLike], filename: Optional[str] = None,
                        config: Optional[KLVAEConfig] = None) -> "KLVAE":
        """Load the official `kl16.ckpt` (or a safetensors export of it) strictly, in eval mode."""
        path = resolve_path(path_or_repo, filename)
        model = cls(config)
        load_strict(model, load_state_dict(path), ignore=OFFICIAL_IGNORED_KEYS, source=str(path))
        return model.eval()

    def encode(self, images: torch.Tensor) -> DiagonalGaussian:
        """Images [B, 3, H, W] in [-1, 1] -> posterior over latents [B, embed_dim, H/16, W/16]."""
        moments = self.quant_conv(self.encoder(images))
        if not self.config.use_variational:
            moments = torch.cat([moments, torch.ones_like(moments)], dim=1)  # logvar 1, as the official
        return DiagonalGaussian(moments)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, embed_dim, h, w] (unscaled: MAR tokens / config.scaling_factor) -> images."""
        return self.decoder(self.post_quant_conv(latents))
