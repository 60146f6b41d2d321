"""Vision-language models on the shared decoding core, through transformers' own models.

`VLMPipeline` answers prompts about images with any token decoder of the core. Every family it
serves is a transformers image-text-to-text model whose layout `VLMTokenModel` reads, and is
registered below by its model_type, once, as a family of the "text" modality
(`mmgen.registry.register_family`; `MODEL_TYPES` is the registry's view). The pipeline is named
as "module:Class", so importing this package stays cheap.
"""

from mmgen.registry import register_family

#: The families whose video tokens mmgen places (tested against their own `generate`), and how a
#: call's videos reach the model: "separate" (Qwen's M-RoPE families), or "stacked" into one
#: [videos, frames, ...] tensor (LLaVA-OneVision: a call's videos then share a frame count).
_VIDEO_INPUT = {"llava_onevision": "stacked", "qwen2_vl": "separate", "qwen2_5_vl": "separate", "qwen3_vl": "separate"}

# PaliGemma 2 is `paligemma`; Mistral3 carries Pixtral's vision tower.
for _model_type in ("llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm",
                    "gemma3", "paligemma", "internvl", "mistral3", "aya_vision"):
    register_family("text", _model_type, pipeline="mmgen.vlm.pipeline:VLMPipeline",
                    capabilities={"video": _VIDEO_INPUT[_model_type]} if _model_type in _VIDEO_INPUT else None)
del _model_type

#: Bundled trained models (package data): name -> folder relative to this package.
BUNDLED_MODELS = {"emoji-vlm": "assets/emoji-vlm", "emoji-vlm-draft": "assets/emoji-vlm-draft"}
#: `mmgen batch`: job files of modality "text" (answers about images and videos, as `mmgen
#: generate text`) run here.
BATCH_JOBS = {"text": "mmgen.vlm.batch"}
#: A job line without a "modality" field that carries a `prompt` is a text job.
BATCH_MARKERS = {"prompt": "text"}


def __getattr__(name: str):
    from mmgen import registry

    if name == "MODEL_TYPES":  # transformers model_type -> its pipeline, every registered VLM family
        return {model_type: family.pipeline for model_type, family in registry.families("text").items()}
    # `from mmgen.vlm import VLMPipeline`: the pipeline module (and transformers) loads on first use.
    return registry.listed_pipeline(__name__, name)
