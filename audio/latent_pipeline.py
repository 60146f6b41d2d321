"""`LatentTTSPipeline`: text-to-speech over continuous latents (VibeVoice's next-token
diffusion) on the core's cached causal continuous decoder.

The surface is `TTSPipeline`'s (`from_pretrained`, `pipe(text, voice=...) -> TTSOutput`), with
the decoders of this family: "ar" (VibeVoice's own sampler; with `final_std` 0 it is
`generate`'s) and "cspd" (continuous speculative decoding with a smaller VibeVoice drafting,
exact for the head law with a Gaussian last step, `final_std` > 0).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Optional, Sequence, Union

import torch

from mmgen.decoding import CausalContinuousSpeculative
from mmgen.hub import loading_folder
from mmgen.inference import inference
from mmgen.pipeline import Companion, Pipeline, load_dtype
from mmgen.registry import register_pipeline
from mmgen.sampling import SamplingConfig, takes_sampling

from mmgen.audio.pipeline import TTSOutput, TTSPipeline
from mmgen.audio.vibevoice import VibeVoiceLatentModel, VibeVoiceSpeech


@register_pipeline  # its model_type is registered as a speech family (mmgen.audio)
class LatentTTSPipeline(TTSPipeline):
    """VibeVoice: a processor (tokenizer + chat template + feature extractor) and the model, whose
    σ-VAE decoder turns latents into audio."""

    decoder_family = "causal-continuous"
    companions = {"cspd": Companion("drafter", "-draft", "a smaller VibeVoice of the same acoustic tokenizer")}

    @classmethod
    def decoders(cls) -> dict[str, Any]:
        from mmgen.decoding import FAMILY_DECODERS

        return FAMILY_DECODERS[cls.decoder_family]

    def __init__(self, model: Any, processor: Any):
        Pipeline.__init__(self, model=model)
        self.tokenizer = self.processor = processor
        self.adapter = VibeVoiceSpeech(model, processor)

    @property
    def sampling_rate(self) -> int:
        return self.adapter.sampling_rate

    @classmethod
    def from_pretrained(cls, repo_or_path: Union[str, os.PathLike], torch_dtype: Optional[torch.dtype] = None,
                        device: Union[str, torch.device, None] = None, **kwargs) -> "LatentTTSPipeline":
        """A transformers VibeVoice checkpoint (Hub id or folder) and its processor."""
        from transformers import AutoProcessor, VibeVoiceForConditionalGeneration

        source = os.fspath(repo_or_path)
        kwargs.setdefault("trust_remote_code", False)  # never the folder's own code (`auto_map`)
        with loading_folder(source):  # no link out of a local folder, sizes within bounds, one-line errors
            model = VibeVoiceForConditionalGeneration.from_pretrained(source, dtype=load_dtype(torch_dtype, device), **kwargs)
            pipe = cls(model.eval(), AutoProcessor.from_pretrained(source, trust_remote_code=False))
        return pipe.to(device) if device is not None else pipe

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    def to(self, device=None, dtype=None) -> "LatentTTSPipeline":
        Pipeline.to(self, device, dtype)
        return self

    def latent_model(self, final_std: float = 0.0) -> VibeVoiceLatentModel:
        """The core's view of the model, its head's last step N(ODE solution, final_std^2)."""
        return VibeVoiceLatentModel(self.model, final_std=final_std)

    def token_model(self) -> Any:
        return self.latent_model()

    def sampling(self, temperature: Optional[float], top_k: Optional[int], top_p: Optional[float]) -> SamplingConfig:
        if top_k or (top_p is not None and top_p < 1.0):
            raise ValueError("VibeVoice's latents take no top-k or top-p: its head is a diffusion sampler")
        return SamplingConfig(temperature=1.0 if temperature is None else temperature)

    @takes_sampling
    @inference
    def __call__(
        self,
        text: Union[str, Sequence[str]],
        voice: Any = None,
        voice_text: Union[str, Sequence[str], None] = None,
        max_new_frames: Optional[int] = None,
        decoding: Union[str, CausalContinuousSpeculative] = "ar",
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        guidance_scale: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
        streamer: Any = None,
        final_std: float = 0.0,
    ) -> TTSOutput:
        """Speak each text (see `TTSPipeline.__call__`; `stream` yields audio chunks as latents
        commit). `max_new_frames` counts latents (7.5 per second); `final_std` is the standard
        deviation of the head's last step (0: VibeVoice's deterministic ODE sampler given its
        noise; "cspd" needs it > 0), scaled by `temperature`."""
        decoder = self.decoder(decoding)
        drafter = decoder.drafter
        if isinstance(drafter, TTSPipeline):
            self.check_companion(drafter, self.companions["cspd"])
            drafter = drafter.latent_model(final_std)
        if drafter is not None and not final_std > 0:
            raise ValueError("continuous speculative decoding needs final_std > 0: VibeVoice's ODE sampler is "
                             "deterministic given its noise, so a draft could be kept only if it equalled the target's")
        decoder = replace(decoder, drafter=drafter)
        conditions, budget = self.prepare(text, voice, voice_text, max_new_frames, None)
        sampling = self.sampling(temperature, top_k, top_p)
        scale = guidance_scale if guidance_scale is not None else getattr(self.model.generation_config, "guidance_scale", None)
        sampling = replace(sampling, guidance=1.0 if scale is None else float(scale))
        model = self.latent_model(final_std)
        begin = time.perf_counter()
        result = decoder.generate(model, conditions, budget, sampling, self.generator_for(generator), streamer=streamer)
        decode_s = time.perf_counter() - begin
        latents = [row[:n] for row, n in zip(result.tokens, result.lengths.tolist())]
        audio = [model.decode(x) for x in latents]
        longest = max(a.numel() for a in audio) / self.sampling_rate
        return TTSOutput(audio, self.sampling_rate, latents, result.tokens, result.lengths, result.stats, decode_s,
                         decode_s / longest if longest else 0.0)

    def _row_audio(self, chunking: Any) -> "LatentAudio":
        """One row's streaming decoder (the σ-VAE decoder is causal: no codec chunking applies)."""
        return LatentAudio(self.latent_model())


class LatentAudio:
    """A row's latents -> audio chunks through the causal σ-VAE decoder's streaming cache: the
    chunks concatenate to the one-shot decode up to float rounding."""

    def __init__(self, model: VibeVoiceLatentModel):
        from transformers.models.vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer import (
            VibeVoiceAcousticTokenizerConv1dPaddingCache)

        self.model, self.cache = model, VibeVoiceAcousticTokenizerConv1dPaddingCache()

    def push(self, new: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the audio of the new latents [n, D], False: the decoder stops sending at a row's end)."""
        return self.model.decode(new, self.cache), False

    def flush(self) -> torch.Tensor:
        return torch.zeros(0)
