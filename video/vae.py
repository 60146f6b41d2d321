"""Decoding Wan latents block by block with the VAE's causal feature cache.

diffusers' `AutoencoderKLWan.decode` runs its causal decoder one latent frame at a time,
carrying each causal convolution's last input frames in a feature cache it clears per call.
`StreamingDecoder` keeps its own such cache across calls, so decoding a video's latent blocks
one after another gives the frames of the one-shot `decode` (test), each block as soon as it
is committed. The latents the transformer sees are normalised per channel by the VAE config's
`latents_mean` / `latents_std` (as diffusers' WanPipeline does); `to_vae` / `from_vae` convert.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanRMS_norm, unpatchify


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


def use_onednn_convolutions(module: torch.nn.Module) -> torch.nn.Module:
    """Run `module`'s zero-padded 2-D and 3-D convolutions on oneDNN on the CPU in float32 when
    no gradient is needed, at every batch size; returns `module`.

    PyTorch's own dispatch sends a batch of one with 3x3(x3) kernels on a small input (batch x
    channels x depth x height under 20,480 elements, every call a Wan VAE decoder makes for one
    64x64 clip) to its unvectorised `slow_conv3d`, which measured 3.4-9.4x slower than oneDNN on
    the same call (one thread: 32 channels, 3 frames of 66x66, 4.8 ms against 1.1 ms) and was 69% of
    a bundled emoji-motion clip's time. Outputs agree to float32 rounding (about 2e-6); everything
    else (another device or dtype, training, `torch.backends.mkldnn` turned off) runs the
    module's own `_conv_forward`. Idempotent; survives `copy.deepcopy`."""
    for conv in module.modules():
        if (isinstance(conv, (torch.nn.Conv2d, torch.nn.Conv3d)) and conv.padding_mode == "zeros"
                and not isinstance(conv.padding, str) and "_conv_forward" not in vars(conv)):
            conv._conv_forward = types.MethodType(_onednn_conv_forward, conv)
    return module


def _onednn_conv_forward(conv: torch.nn.Module, input: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
    if (input.device.type == "cpu" and input.dtype == weight.dtype == torch.float32 and input.dim() == weight.dim()
            and not torch.is_grad_enabled() and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return torch.ops.aten.mkldnn_convolution(input, weight, bias, conv.padding, conv.stride, conv.dilation, conv.groups)
    return type(conv)._conv_forward(conv, input, weight, bias)


def use_sum_of_squares_rms_norm(module: torch.nn.Module) -> torch.nn.Module:
    """Run `module`'s channel-first `WanRMS_norm`s as x * rsqrt(sum of squares over channels) on
    the CPU in float32 when no gradient is needed; returns `module`.

    diffusers' form, `F.normalize` over the channel dimension, goes through a strided vector norm,
    the slow part of the norm on the CPU (a profile of a bundled clip); this form gives the same
    numbers to float32 rounding (the same epsilon: `F.normalize` divides by max(norm, 1e-12)).
    Everything else runs the module's own `forward`. Idempotent; survives `copy.deepcopy`."""
    for norm in module.modules():
        if isinstance(norm, WanRMS_norm) and norm.channel_first and "forward" not in vars(norm):
            norm.forward = types.MethodType(_sum_of_squares_rms_norm, norm)
    return module


def _sum_of_squares_rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled():
        return x * torch.rsqrt((x * x).sum(1, keepdim=True).clamp_min(1e-24)) * (norm.scale * norm.gamma) + norm.bias
    return type(norm).forward(norm, x)


def video_frames(latent_frames: int, temporal_ratio: int = 4) -> int:
    """Video frames the Wan VAE decodes from `latent_frames` (the first latent is one frame)."""
    return 1 + temporal_ratio * (latent_frames - 1)
