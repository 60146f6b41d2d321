"""LlamaGen class-conditional image generation (arXiv 2406.06525) on the shared core."""

from mmgen.image_ar.llamagen.gpt import GPT_PRESETS, LlamaGenConfig, LlamaGenTransformer
from mmgen.image_ar.llamagen.pipeline import LlamaGenPipeline
from mmgen.image_ar.llamagen.token_model import LlamaGenTokenModel
from mmgen.image_ar.llamagen.vq import VQ_CONFIGS, VQConfig, VQModel

__all__ = [
    "GPT_PRESETS",
    "LlamaGenConfig",
    "LlamaGenPipeline",
    "LlamaGenTokenModel",
    "LlamaGenTransformer",
    "VQ_CONFIGS",
    "VQConfig",
    "VQModel",
]
