"""Text-to-speech on the shared decoding core, through transformers' own speech models.

`TTSPipeline` speaks text with Dia (DAC codes with a delay pattern) and CSM (Mimi codes: a
backbone for codebook 0, a depth decoder for the rest) under any frame decoder of the core;
`LatentTTSPipeline` speaks with VibeVoice (continuous latents, next-token diffusion) under the
cached causal continuous decoders (plain, or continuous speculative decoding with a drafter).
Each family registers itself below, once (`mmgen.registry.register_family`): its model_type,
the pipeline that opens its folders and the adapter `TTSPipeline` asks about it, named as
"module:Class" so that importing this package loads neither torch nor transformers.
"""

from mmgen.registry import Option, register_family

register_family("speech", "dia", pipeline="mmgen.audio.pipeline:TTSPipeline", adapter="mmgen.audio.dia:DiaSpeech")
register_family("speech", "csm", pipeline="mmgen.audio.pipeline:TTSPipeline", adapter="mmgen.audio.csm:CsmSpeech")
# VibeVoice's pipeline is its own adapter (continuous latents: no codec frames to adapt).
register_family("speech", "vibevoice", pipeline="mmgen.audio.latent_pipeline:LatentTTSPipeline", options=[
    Option("final_std", float, 0.0, "VibeVoice: standard deviation of the head's last step (default 0, its own sampler; "
                                    "cspd needs > 0)", minimum=0)])

#: Bundled trained models (package data; see assets/speech-tts/MODEL_CARD.md): name -> folder
#: relative to this package.
BUNDLED_MODELS = {"speech-tts": "assets/speech-tts", "speech-tts-draft": "assets/speech-tts-draft"}
#: `mmgen batch`: job files of modality "speech" run here.
BATCH_JOBS = {"speech": "mmgen.audio.batch"}
#: A job line without a "modality" field that carries a `text` is a speech job.
BATCH_MARKERS = {"text": "speech"}


def __getattr__(name: str):
    # `from mmgen.audio import TTSPipeline`: the pipeline's module loads on first use, not with this package.
    from mmgen.registry import listed_pipeline

    return listed_pipeline(__name__, name)
