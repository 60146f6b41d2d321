"""Image autoregressive models on the shared decoding core: LlamaGen (raster order, class- and
text-conditional), VAR (next-scale), MAR (continuous tokens) and Janus-Pro.

The pipeline index below is what `mmgen.registry` reads: it imports a pipeline's module (which
registers the class) the first time a folder or `from mmgen import ...` names it, so importing
this package stays cheap.
"""

#: Pipeline class name -> the module that defines and registers it.
PIPELINE_MODULES = {
    "LlamaGenPipeline": "mmgen.image_ar.llamagen.pipeline",
    "LlamaGenText2ImagePipeline": "mmgen.image_ar.llamagen.pipeline_t2i",
    "VARPipeline": "mmgen.image_ar.var.pipeline",
    "MARPipeline": "mmgen.image_ar.mar.pipeline",
    "JanusPipeline": "mmgen.image_ar.janus.pipeline",
}
#: Other names of those classes.
PIPELINE_ALIASES = {"LlamaGenT2IPipeline": "LlamaGenText2ImagePipeline"}
#: transformers `model_type` -> the pipeline that opens plain transformers folders of it.
MODEL_TYPES = {"janus": "JanusPipeline"}
#: The models trained here by `training/train*.py` and shipped as package data (`bundled.py`).
BUNDLED_MODELS = {
    "emoji64": "assets/emoji64",
    "emoji64-draft": "assets/emoji64-draft",
    "var-emoji64": "assets/var-emoji64",
    "var-emoji64-small": "assets/var-emoji64-small",
    "mar-emoji64": "assets/mar-emoji64",
    "mar-emoji64-draft": "assets/mar-emoji64-draft",
}
#: `mmgen batch`: job files of modality "image" (class-conditional images) run here.
BATCH_JOBS = {"image": "mmgen.image_ar.batch"}
#: A job line without a "modality" field that names a `class_label` is an image job.
BATCH_MARKERS = {"class_label": "image"}


def __getattr__(name: str):
    # `from mmgen.image_ar import LlamaGenPipeline`: the pipeline's module loads on first use, not with this package.
    from mmgen.registry import listed_pipeline

    return listed_pipeline(__name__, name)
