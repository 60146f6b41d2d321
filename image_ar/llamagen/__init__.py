"""LlamaGen class- and text-conditional image generation (arXiv 2406.06525) on the shared core."""

from mmgen.image_ar.llamagen.gpt import GPT_PRESETS, LlamaGenConfig, LlamaGenTransformer
from mmgen.image_ar.llamagen.pipeline import LlamaGenPipeline, LlamaGenPipelineBase
from mmgen.image_ar.llamagen.token_model import CaptionConditions, LlamaGenTokenModel
from mmgen.image_ar.llamagen.vq import VQ_CONFIGS, VQConfig, VQModel

__all__ = [
    "GPT_PRESETS",
    "CaptionConditions",
    "LlamaGenConfig",
    "LlamaGenPipeline",
    "LlamaGenPipelineBase",
    "LlamaGenText2ImagePipeline",
    "LlamaGenTokenModel",
    "LlamaGenTransformer",
    "VQ_CONFIGS",
    "VQConfig",
    "VQModel",
]


def __getattr__(name: str):
    # The t2i pipeline imports transformers (seconds); load it only when asked for.
    if name == "LlamaGenText2ImagePipeline":
        from mmgen.image_ar.llamagen.pipeline_t2i import LlamaGenText2ImagePipeline

        return LlamaGenText2ImagePipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
