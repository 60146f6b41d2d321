"""Block-diffusion (semi-autoregressive) video on diffusers' Wan components.

`BlockDiffusionVideoPipeline` makes a video block by block with diffusers'
`WanTransformer3DModel` (a cached block-causal decode through attention processors),
`AutoencoderKLWan` (streaming decode) and transformers' `UMT5EncoderModel`, under the core's
block-diffusion decoders (plain, collaborative large/small). A video family is its pipeline
class (the `_class_name` its folders' model_index.json names), registered below once
(`mmgen.registry.register_family`) as "module:Class", so that its module loads on first use,
with its converters (`mmgen convert self-forcing / causvid`: a causal Wan-2.1 checkpoint + a
diffusers Wan folder -> a pipeline folder, run by `mmgen.video.cli.convert_causal`).
"""

from mmgen.registry import Converter, Option, register_family


def _causal_converter(name: str, what: str) -> Converter:
    """`mmgen convert NAME`: the causal Wan generator of checkpoint `what` (its preset: NAME)."""
    return Converter(name, f"{what} + a diffusers Wan-2.1 folder -> a video pipeline folder", "mmgen.video.cli:convert_causal", [
        Option("checkpoint", str, help=what, positional=True),
        Option("wan", str, help="the diffusers Wan folder it was trained with (VAE, UMT5, tokenizer), "
               "e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers", metavar="FOLDER_OR_REPO", required=True),
        Option("out", str, help="the pipeline folder to write", required=True),
        Option("which", str, None, "the checkpoint entry (default: the EMA when present, else the generator)",
               choices=("ema", "generator")),
        Option("overwrite", bool, False, "write into a non-empty OUT"),
    ], defaults={"preset": name})


register_family("video", pipeline="mmgen.video.pipeline:BlockDiffusionVideoPipeline", converters=[
    _causal_converter("self-forcing", "Self-Forcing's checkpoints/self_forcing_dmd.pt"),
    _causal_converter("causvid", "CausVid's autoregressive_checkpoint/model.pt"),
])

#: Bundled trained models (package data; see assets/emoji-motion/MODEL_CARD.md): name -> folder
#: relative to this package.
BUNDLED_MODELS = {"emoji-motion": "assets/emoji-motion", "emoji-motion-small": "assets/emoji-motion-small"}
#: `mmgen batch`: job files of modality "video" run here. No field marks a video job: it says
#: `"modality": "video"` (its `prompt` alone would make it a text job).
BATCH_JOBS = {"video": "mmgen.video.batch"}
#: The old form of video jobs, read until the next release: the prompt in a `video` field and no
#: "modality" (`mmgen.video.batch` warns once per run).
BATCH_OLD_MARKERS = {"video": "video"}


def __getattr__(name: str):
    # `from mmgen.video import BlockDiffusionVideoPipeline`: the pipeline's module loads on first use, not with this package.
    from mmgen.registry import listed_pipeline

    return listed_pipeline(__name__, name)
