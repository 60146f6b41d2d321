"""Decoding Wan latents block by block with the VAE's causal feature cache.

diffusers' `AutoencoderKLWan.decode` runs its causal decoder one latent frame at a time,
carrying each causal convolution's last input frames in a feature cache it clears per call.
`StreamingDecoder` keeps its own such cache across calls, so decoding a video's latent blocks
one after another gives the frames of the one-shot `decode` (test), each block as soon as it
is committed. The latents the transformer sees are normalised per channel by the VAE config's
`latents_mean` / `latents_std` (as diffusers' WanPipeline does); `to_vae` / `from_vae` convert.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify


def _stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=like.dtype, device=like.device).view(shape)
    std = torch.tensor(vae.config.latents_std, dtype=like.dtype, device=like.device).view(shape)
    return mean, std


def to_vae(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents (what the transformer denoises) -> the VAE's own latent scale."""
    mean, std = _stats(vae, latents)
    return latents * std + mean


def from_vae(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's latents (e.g. an encoder posterior's mode) -> normalised latents."""
    mean, std = _stats(vae, latents)
    return (latents - mean) / std


@torch.no_grad()
def encode_video(vae: Any, video: torch.Tensor) -> torch.Tensor:
    """Video [B, 3, T, H, W] in [-1, 1] -> normalised latents (the posterior's mode)."""
    return from_vae(vae, vae.encode(video.to(vae.dtype)).latent_dist.mode())


@torch.no_grad()
def decode_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """One-shot decode of normalised latents [B, C, f, h, w] -> video [B, 3, T, H, W] in [-1, 1]."""
    return vae.decode(to_vae(vae, latents).to(vae.dtype), return_dict=False)[0]


class StreamingDecoder:
    """Decode a video's latents in consecutive pieces; the concatenated outputs equal the
    one-shot decode of the whole. `reset()` starts a new video."""

    def __init__(self, vae: Any):
        self.vae = vae
        self.num_convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.reset()

    def reset(self) -> None:
        self.features: list = [None] * self.num_convs
        self.first = True

    @property
    def nbytes(self) -> int:
        """Bytes of the feature cache (each causal convolution's last input frames: fixed after
        the first latent frame, however long the video runs)."""
        return sum(f.nbytes for f in self.features if isinstance(f, torch.Tensor))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The next latent frames [B, C, f, h, w] (normalised) -> their video frames [B, 3, T, H, W]."""
        vae = self.vae
        x = vae.post_quant_conv(to_vae(vae, latents).to(vae.dtype))
        frames = []
        for i in range(x.shape[2]):
            index = [0]
            frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=self.features, feat_idx=index, first_chunk=self.first))
            self.first = False
        out = torch.cat(frames, 2)
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        return out.clamp(-1.0, 1.0)


def video_frames(latent_frames: int, temporal_ratio: int = 4) -> int:
    """Video frames the Wan VAE decodes from `latent_frames` (the first latent is one frame)."""
    return 1 + temporal_ratio * (latent_frames - 1)
