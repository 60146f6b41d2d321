"""Vision-language models on the shared decoding core, through transformers' own models.

`VLMPipeline` answers prompts about images with any token decoder of the core (LLaVA-style
models so far). The index below is what `mmgen.registry` reads to import the pipeline on first
use, so importing this package stays cheap.
"""

#: Pipeline class name -> the module that defines and registers it.
PIPELINE_MODULES = {"VLMPipeline": "mmgen.vlm.pipeline"}
#: transformers `model_type` -> the pipeline that opens plain transformers folders of it.
MODEL_TYPES = {"llava": "VLMPipeline", "qwen2_vl": "VLMPipeline", "qwen2_5_vl": "VLMPipeline", "idefics3": "VLMPipeline"}
