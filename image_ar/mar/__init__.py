"""MAR: masked autoregressive generation of continuous tokens with a diffusion loss head
(Li et al. 2024, arXiv 2406.11838), and its KL-16 VAE."""

from mmgen.image_ar.mar.diffloss import DiffLoss, DiffusionSample, GaussianDiffusion, SimpleMLPAdaLN, space_timesteps
from mmgen.image_ar.mar.continuous_model import MARContinuousModel
from mmgen.image_ar.mar.mar import MAR, MAR_PRESETS, MARConfig, sample_tokens
from mmgen.image_ar.mar.pipeline import MARPipeline
from mmgen.image_ar.mar.vae import MAR_LATENT_SCALE, DiagonalGaussian, KLVAE, KLVAEConfig

__all__ = [
    "DiagonalGaussian",
    "DiffLoss",
    "DiffusionSample",
    "GaussianDiffusion",
    "KLVAE",
    "KLVAEConfig",
    "MAR",
    "MARConfig",
    "MARContinuousModel",
    "MARPipeline",
    "MAR_LATENT_SCALE",
    "MAR_PRESETS",
    "SimpleMLPAdaLN",
    "sample_tokens",
    "space_timesteps",
]
