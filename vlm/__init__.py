"""Vision-language models on the shared decoding core, through transformers' own models.

`VLMPipeline` answers prompts about images with any token decoder of the core (the families
in `MODEL_TYPES`). The index below is what `mmgen.registry` reads to import the pipeline on first
use, so importing this package stays cheap.
"""

#: Pipeline class name -> the module that defines and registers it.
PIPELINE_MODULES = {"VLMPipeline": "mmgen.vlm.pipeline"}
#: transformers `model_type` -> the pipeline that opens plain transformers folders of it.
#: PaliGemma 2 is `paligemma`; Mistral3 carries Pixtral's vision tower.
MODEL_TYPES = {name: "VLMPipeline" for name in (
    "llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3",
    "paligemma", "internvl", "mistral3", "aya_vision")}
#: Bundled trained models (package data): name -> folder relative to this package.
BUNDLED_MODELS = {"emoji-vlm": "assets/emoji-vlm", "emoji-vlm-draft": "assets/emoji-vlm-draft"}
#: `mmgen batch` job files whose jobs carry a `prompt` run here (answers about images).
BATCH_JOBS = {"prompt": "mmgen.vlm.batch"}


def __getattr__(name: str):
    # `from mmgen.vlm import VLMPipeline`: the pipeline module (and transformers) loads on first use.
    from mmgen import registry

    return registry.listed_pipeline(__name__, name)
