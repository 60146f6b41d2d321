"""Block-diffusion (semi-autoregressive) video on diffusers' Wan components.

`BlockDiffusionVideoPipeline` makes a video block by block with diffusers'
`WanTransformer3DModel` (a cached block-causal decode through attention processors),
`AutoencoderKLWan` (streaming decode) and transformers' `UMT5EncoderModel`, under the core's
block-diffusion decoders (plain, collaborative large/small). A video family is its pipeline
class (the `_class_name` its folders' model_index.json names), registered below once
(`mmgen.registry.register_family`) as "module:Class", so that its module loads on first use.
"""

from mmgen.registry import register_family

register_family("video", pipeline="mmgen.video.pipeline:BlockDiffusionVideoPipeline")

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
