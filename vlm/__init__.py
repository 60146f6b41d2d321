"""Vision-language models on the shared decoding core, through transformers' own models.

`VLMPipeline` answers prompts about images with any token decoder of the core (LLaVA-style
models so far). The index below is what `mmgen.registry` reads to import the pipeline on first
use, so importing this package stays cheap.
"""

#: Pipeline class name -> the module that defines and registers it.
PIPELINE_MODULES = {"VLMPipeline": "mmgen.vlm.pipeline"}
#: transformers `model_type` -> the pipeline that opens plain transformers folders of it.
MODEL_TYPES = {"llava": "VLMPipeline", "llava_next": "VLMPipeline", "qwen2_vl": "VLMPipeline", "qwen2_5_vl": "VLMPipeline", "idefics3": "VLMPipeline"}
#: Bundled trained models (package data): name -> folder relative to this package.
BUNDLED_MODELS = {"emoji-vlm": "assets/emoji-vlm", "emoji-vlm-draft": "assets/emoji-vlm-draft"}
#: `mmgen batch` job files whose jobs carry a `prompt` run here (answers about images).
BATCH_JOBS = {"prompt": "mmgen.vlm.batch"}
