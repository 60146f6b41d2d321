"""Text-to-speech on the shared decoding core, through transformers' own speech models.

`TTSPipeline` speaks text with Dia (DAC codes with a delay pattern) and CSM (Mimi codes: a
backbone for codebook 0, a depth decoder for the rest) under any frame decoder of the core;
`LatentTTSPipeline` speaks with VibeVoice (continuous latents, next-token diffusion) under the
cached causal continuous decoders (plain, or continuous speculative decoding with a drafter).
The index below is what `mmgen.registry` reads to import the pipeline on first use.
"""

#: Pipeline class name -> the module that defines and registers it.
PIPELINE_MODULES = {"TTSPipeline": "mmgen.audio.pipeline", "LatentTTSPipeline": "mmgen.audio.latent_pipeline"}
#: transformers `model_type` -> the pipeline that opens plain transformers folders of it.
MODEL_TYPES = {"dia": "TTSPipeline", "csm": "TTSPipeline", "vibevoice": "LatentTTSPipeline"}
#: Bundled trained models (package data; see assets/speech-tts/MODEL_CARD.md): name -> folder
#: relative to this package.
BUNDLED_MODELS = {"speech-tts": "assets/speech-tts", "speech-tts-draft": "assets/speech-tts-draft"}
#: `mmgen batch` job files whose jobs carry a `text` run here (speech).
BATCH_JOBS = {"text": "mmgen.audio.batch"}


def __getattr__(name: str):
    # `from mmgen.audio import TTSPipeline`: the pipeline's module loads on first use, not with this package.
    from mmgen.registry import listed_pipeline

    return listed_pipeline(__name__, name)
