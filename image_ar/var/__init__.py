"""VAR next-scale image generation (Tian et al. 2024, arXiv 2404.02905) on the shared core."""

from mmgen.image_ar.var.pipeline import VAR_PRESETS, VARPipeline
from mmgen.image_ar.var.scale_model import MoreSmooth, VARScaleModel
from mmgen.image_ar.var.transformer import VARConfig, VARTransformer
from mmgen.image_ar.var.vqvae import MultiScaleVQVAE, VQVAEConfig

__all__ = [
    "MoreSmooth",
    "MultiScaleVQVAE",
    "VAR_PRESETS",
    "VARConfig",
    "VARPipeline",
    "VARScaleModel",
    "VARTransformer",
    "VQVAEConfig",
]
