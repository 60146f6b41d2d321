"""Image autoregressive models on the shared decoding core: LlamaGen (raster order, class- and
text-conditional), VAR (next-scale), MAR (continuous tokens) and Janus-Pro.

Each family registers itself below, once (`mmgen.registry.register_family`): its pipeline, named
as "module:Class" so that the registry imports the module (which registers the class) the first
time a folder or `from mmgen import ...` names it and importing this package stays cheap, and
the options its call takes that not every image model does (`Option`). `mmgen generate image`
offers each as a flag, `mmgen batch` as a job field, from these records; the options every image
model takes (guidance, temperature, top-k/p, the decoding and its window) are the modality's own.
Its converter (`Converter`: `mmgen convert llamagen / var / mar`, official checkpoints -> a
pipeline folder) is on its record too; the functions that run them are in `mmgen.image_ar.cli`.
"""

from mmgen.registry import Converter, Option, register_family

#: LlamaGen's classifier-free guidance interval (class-conditional and text-to-image).
CFG_INTERVAL = Option("cfg_interval", int, None, "guide tokens t <= N + 1 only (default: the model's)")


def _required(name: str) -> Option:
    """A converter's checkpoint or output flag: a path that must be given."""
    return Option(name, str, required=True)


#: `mmgen convert llamagen`: either LlamaGen family's folder, from the official GPT + VQ files.
CONVERT_LLAMAGEN = Converter("llamagen", "official LlamaGen c2i or t2i GPT + VQ .pt files", "mmgen.image_ar.cli:convert_llamagen", [
    _required("gpt_checkpoint"), _required("vq_checkpoint"),
    Option("t2i", bool, False, "a text-to-image GPT (with a T5 caption encoder)"),
    Option("text_encoder", str, "google/flan-t5-xl", "with --t2i: T5 repo id or folder (and its tokenizer)"),
    Option("gpt_model", str, None, "official preset (default: GPT-B, with --t2i GPT-XL)"),
    Option("vq_model", str, "VQ-16", choices=("VQ-16", "VQ-8")),
    Option("image_size", int, None, "default: 256, with --t2i 512"),
    Option("codebook_size", int, 16384), Option("codebook_embed_dim", int, 8), Option("num_classes", int, 1000),
    _required("out"),
])

register_family("image", pipeline="mmgen.image_ar.llamagen.pipeline:LlamaGenPipeline", options=[CFG_INTERVAL],
                converters=[CONVERT_LLAMAGEN])
register_family("image", pipeline="mmgen.image_ar.llamagen.pipeline_t2i:LlamaGenText2ImagePipeline", options=[CFG_INTERVAL],
                converters=[CONVERT_LLAMAGEN])
register_family("image", pipeline="mmgen.image_ar.var.pipeline:VARPipeline", options=[
    Option("preset", str, None, "VAR: the official sampler settings", choices=("fid", "demo")),
    Option("more_smooth", bool, False, "VAR: Gumbel-softmax soft maps (official visualisation option)"),
    Option("pruning", str, None, "VAR: FastVAR cached token pruning, keep ratios per scale step and optionally the "
           "block range, e.g. '4=0.6,5=0.5' or '5=0.5@0:' (negative steps count from the last: --pruning=-2=0.6,-1=0.5)",
           metavar="STEP=KEEP,...[@START:STOP]"),
    Option("pruning_layers", int, None, "VAR: the block range that prunes (default 3 -4, FastVAR's)", size=2,
           metavar=("START", "STOP")),
], converters=[Converter("var", "official VAR .pth files (var_dN.pth + vae_ch160v4096z32.pth)", "mmgen.image_ar.cli:convert_var", [
    _required("var_checkpoint"), _required("vae_checkpoint"),
    Option("depth", int, 16, "36 is the 512px model", choices=(16, 20, 24, 30, 36)), _required("out"),
])])
register_family("image", pipeline="mmgen.image_ar.mar.pipeline:MARPipeline", options=[
    Option("num_iter", int, None, "MAR: masked steps (default: the model's, officially 64)"),
    Option("cfg_schedule", str, None, "MAR: guidance schedule", choices=("linear", "constant")),
], converters=[Converter("mar", "official MAR checkpoint-last.pth (its model_ema) + kl16.ckpt", "mmgen.image_ar.cli:convert_mar", [
    _required("mar_checkpoint"), _required("vae_checkpoint"),
    Option("model", str, "mar_base", choices=("mar_base", "mar_large", "mar_huge")), _required("out"),
])])
register_family("image", pipeline="mmgen.image_ar.janus.pipeline:JanusPipeline")

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
