"""`TTSPipeline`: text (and an optional voice prompt) in, waveform out, through transformers'
own speech models on the shared decoding core.

The model, tokenizer and codec are transformers' (Dia with DAC; CSM with Mimi); mmgen adds the
core, so one checkpoint decodes with any frame decoder (autoregressive, speculative Jacobi over
frames, a draft model, ...), with per-row ends, batches and streaming audio. A family adapter
(`DiaSpeech`, `CsmSpeech`) turns texts and voices into the model's conditions and generated
frames back into codec codes; the codec (`Codec`) turns codes into audio, streamed exactly
(`CodecStream`).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator, Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from mmgen import registry
from mmgen.decoding import DecodeStats, Decoder, Stopping
from mmgen.decoding.base import check_int
from mmgen.decoding.batching import ContinuousServer, Finished, Request, check_continuous, continuous_decode
from mmgen.hub import CheckpointError, loading_folder, looks_like_path, read_json
from mmgen.inference import inference, ordinary
from mmgen.pipeline import Companion, Pipeline, load_dtype
from mmgen.registry import register_pipeline
from mmgen.sampling import SamplingConfig, takes_sampling
from mmgen.streaming import CallbackStreamer, stream_from_thread

from mmgen.audio.codec import Codec, CodecStream, StreamChunking
from mmgen.audio.waveform import read_audio

#: Longest text accepted, in characters (Dia reads bytes; long texts are split by callers).
MAX_TEXT_CHARS = 2000
#: Dia's speaker tags ("[S1]"), which are not speech.
SPEAKER_TAG = re.compile(r"\[S\d+\]")
#: transformers' `generate` top-k when a generation config leaves it unset (Dia also takes it as
#: its guidance filter's k).
GENERATE_TOP_K = 50
#: Where a pipeline folder keeps its codec when the model's processor does not name one.
CODEC_FOLDER = "codec"


@dataclass
class TTSOutput:
    """`audio`: one mono float32 waveform per row at `sampling_rate`; `codes`: its codec codes
    [C, T]; `frames` [B, N, C] the decoder's frames (padded after each row's end) and
    `lengths` [B]; `stats` the decoder's. `decode_s`: seconds from conditions to the last frame;
    `real_time_factor`: decode_s over the seconds of audio of the longest row."""

    audio: list[torch.Tensor]
    sampling_rate: int
    codes: list[torch.Tensor]
    frames: torch.Tensor
    lengths: torch.Tensor
    stats: DecodeStats
    decode_s: float = 0.0
    real_time_factor: float = 0.0


@register_pipeline
class TTSPipeline(Pipeline):
    """A text-to-speech model over codec frames (greedy or sampled as its generation config says)."""

    component_types = {}  # transformers' own folders
    conditions = "prompt"
    default_decoding = "ar"
    companions = {"draft": Companion("drafter", "-draft", "a smaller model of the same codec"),
                  "entropy-switch": Companion("small", "-draft", "a smaller model of the same codec")}

    @classmethod
    def decoders(cls) -> dict[str, Any]:
        """Frame decoders: LANTERN needs a latent codebook per token, which a frame of codebooks
        does not offer. Grouped acceptance (gsd) groups codes by each codebook's embedding table;
        entropy switching measures a frame's entropy as the mean of its codebooks'; prompt lookup
        copies whole frames (pauses, loops)."""
        return {name: make for name, make in super().decoders().items() if name not in ("lantern", "lantern++")}

    def __init__(self, model: Any, tokenizer: Any, codec: Any):
        super().__init__(model=model)
        self.tokenizer, self.codec = tokenizer, Codec(codec)
        # The family's adapter (`DiaSpeech`, `CsmSpeech`, ...): "family" names the registered kind,
        # the adapter is this pipeline's object of it.
        self.adapter = _adapter(model.config.model_type)(model, tokenizer, self.codec)

    @property
    def family(self) -> Any:
        """Deprecated name of `adapter` (kept for one release)."""
        warnings.warn("TTSPipeline.family is now TTSPipeline.adapter", DeprecationWarning, stacklevel=2)
        return self.adapter

    @property
    def sampling_rate(self) -> int:
        return self.codec.sampling_rate

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, repo_or_path: Union[str, os.PathLike], torch_dtype: Optional[torch.dtype] = None,
                        device: Union[str, torch.device, None] = None, **kwargs) -> "TTSPipeline":
        """A transformers speech checkpoint (Hub id or folder) of a registered speech family,
        whose adapter loads the model, tokenizer and codec (`DiaSpeech.load`: the codec is the
        folder's `codec/` subfolder, else the one its processor config names). A family that
        another pipeline opens opens as it (VibeVoice: a `LatentTTSPipeline`)."""
        from transformers import AutoConfig

        source = os.fspath(repo_or_path)
        # Never a folder's own code (transformers' `auto_map`): the Auto classes would ask on a
        # terminal, and a "y" would run it. The caller may pass trust_remote_code in `kwargs`.
        kwargs.setdefault("trust_remote_code", False)
        with loading_folder(source):  # no link out of a local folder, sizes within bounds, one-line errors
            config = AutoConfig.from_pretrained(source, trust_remote_code=False)
            family = registry.family("speech", config.model_type)
            if family is None:
                raise ValueError(f"{source}: model type {config.model_type!r} is not a speech model mmgen serves "
                                 f"({', '.join(registry.families('speech'))})")
            opener = family.pipeline_class()
            if not issubclass(cls, opener):  # a family another pipeline opens (VibeVoice: LatentTTSPipeline)
                return opener.from_pretrained(source, torch_dtype, device, **kwargs)
            model, tokenizer, codec = _adapter(config.model_type).load(source, load_dtype(torch_dtype, device), **kwargs)
        pipe = cls(model.eval(), tokenizer, codec.eval())
        pipe.name_or_path = source
        return pipe.to(device) if device is not None else pipe

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """transformers' layout: the model (and its tokenizer files) in one folder, the codec in
        `codec/` unless the model owns it (CSM)."""
        self.model.save_pretrained(path)
        if hasattr(self.tokenizer, "save_pretrained") and self.adapter.saves_tokenizer:
            self.tokenizer.save_pretrained(path)
        if getattr(self.model, "codec_model", None) is not self.codec.model:
            self.codec.model.save_pretrained(Path(path) / CODEC_FOLDER)

    def to(self, device=None, dtype=None) -> "TTSPipeline":
        super().to(device, dtype)
        if getattr(self.model, "codec_model", None) is not self.codec.model:
            self.codec.model.to(device=device)
        return self

    def check_companion(self, other: Pipeline, companion: Companion) -> None:
        """A drafter must speak the same codec frames: same family, codebooks and vocabulary."""
        mine, theirs = self.adapter.frame_layout(), getattr(getattr(other, "adapter", None), "frame_layout", lambda: None)()
        if mine != theirs:
            raise ValueError(f"the {companion.option} has another codec layout than the model ({theirs} against {mine}): "
                             "its drafts must be this model's frames")

    def token_model(self) -> Any:
        """The core's view of the model."""
        return self.adapter.token_model()

    # ---------------------------------------------------------------- generation
    def sampling(self, temperature: Optional[float], top_k: Optional[int], top_p: Optional[float]) -> SamplingConfig:
        """The sampler: arguments given, else the model's generation config (greedy when it does not sample)."""
        config = self.model.generation_config
        sample = bool(getattr(config, "do_sample", False))
        if temperature is None:
            temperature = float(config.temperature or 1.0) if sample else 0.0
        if top_k is None:
            top_k = _generate_top_k(config) if sample else 0
        if top_p is None:
            top_p = float(config.top_p or 1.0) if sample else 1.0
        return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)

    def prepare(self, text: Union[str, Sequence[str]], voice: Any = None, voice_text: Union[str, Sequence[str], None] = None,
                max_new_frames: Optional[int] = None, guidance_scale: Optional[float] = None) -> tuple[Any, int]:
        """(the model's conditions, the frame budget) for texts and optional voice prompts; every
        input check happens here, before any forward."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
            raise ValueError("text must be a non-empty string or a list of them")
        long = [len(t) for t in texts if len(t) > MAX_TEXT_CHARS]
        if long:
            raise ValueError(f"a text of {long[0]} characters is too long (at most {MAX_TEXT_CHARS}); split it")
        silent = [t for t in texts if not any(c.isalnum() for c in SPEAKER_TAG.sub("", t))]
        if silent:  # the model would talk until the budget: nothing tells it where speech ends
            raise ValueError(f"text {silent[0][:40]!r} has nothing to speak: no letters or digits")
        voices = _per_row(voice, len(texts), "voice")
        voice_texts = _per_row(voice_text, len(texts), "voice_text")
        if any(v is None and vt is not None for v, vt in zip(voices, voice_texts)):
            raise ValueError("voice_text is the transcript of a voice prompt: give the voice too")
        waves = [None if v is None else read_audio(v, self.sampling_rate) for v in voices]
        budget = self.adapter.default_max_frames() if max_new_frames is None else max_new_frames
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"max_new_frames must be an integer >= 1, got {max_new_frames!r}")
        conditions = self.adapter.conditions(texts, waves, voice_texts, budget, self._guidance(guidance_scale))
        return conditions, budget

    def _guidance(self, scale: Optional[float]) -> tuple[Optional[float], Optional[int]]:
        config = self.model.generation_config
        scale = getattr(config, "guidance_scale", None) if scale is None else scale
        return scale, _generate_top_k(config)

    def calibration_calls(self, count: int) -> list[Callable[[str], Any]]:
        """Held-out texts of the bundled speech corpus (`mmgen.audio.heldout`), 64 frames each, one
        seed each (see `Pipeline.calibration_calls`)."""
        from mmgen.audio.heldout import held_out_texts

        return [lambda spec, i=i, text=text: self(text, decoding=spec, max_new_frames=64,
                                                  generator=torch.Generator().manual_seed(i))
                for i, text in enumerate(held_out_texts(count))]

    @takes_sampling
    @inference
    def __call__(
        self,
        text: Union[str, Sequence[str]],
        voice: Any = None,
        voice_text: Union[str, Sequence[str], None] = None,
        max_new_frames: Optional[int] = None,
        decoding: Union[str, Decoder] = "ar",
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        guidance_scale: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
        streamer: Any = None,
    ) -> TTSOutput:
        """Speak each text.

        Args:
            text: one text or a list (one row each). Dia reads speaker tags ("[S1] ... [S2] ...");
                untagged text is speaker 1.
            voice: a voice prompt to continue from (a path, file bytes, or (array, rate)), one
                for every row or a list; None for the model's own voice.
            voice_text: the transcript of the voice prompt (spoken before the text).
            max_new_frames: per-row budget of decoder frames (default: the model's context).
            decoding: a frame decoder or shortcut ("ar", "sjd", "draft", ...).
            temperature / top_k / top_p: default the model's generation config (greedy if it does
                not sample); 0 temperature is greedy.
            guidance_scale: the model's classifier-free guidance (Dia: default its config's).
            generator: every random draw; None seeds one from OS entropy.
            streamer: a core `Streamer` receiving each row's new frames as they commit.
        """
        decoder = self.decoder(decoding)
        for companion in self.companions.values():
            other = getattr(decoder, companion.option, None)
            if isinstance(other, TTSPipeline):
                self.check_companion(other, companion)
        conditions, budget = self.prepare(text, voice, voice_text, max_new_frames, guidance_scale)
        sampling = self.sampling(temperature, top_k, top_p)
        stopping = self.adapter.stopping(budget)
        begin = time.perf_counter()
        result = decoder.generate(self.token_model(), conditions, budget, sampling, self.generator_for(generator),
                                  stopping=stopping, streamer=streamer)
        decode_s = time.perf_counter() - begin
        codes, audio = zip(*(self._speech(row[:n]) for row, n in zip(result.tokens, result.lengths.tolist())))
        codes, audio = list(codes), list(audio)
        longest = max(a.numel() for a in audio) / self.sampling_rate
        return TTSOutput(audio, self.sampling_rate, codes, result.tokens, result.lengths, result.stats, decode_s,
                         decode_s / longest if longest else 0.0)

    @inference
    def speak_each(
        self,
        text: Union[str, Sequence[str]],
        voice: Any = None,
        voice_text: Union[str, Sequence[str], None] = None,
        generators: Sequence[torch.Generator] = (),
        batch_size: Optional[int] = None,
        on_audio: Optional[Callable[[int, torch.Tensor, torch.Tensor, DecodeStats], None]] = None,
        max_new_frames: Optional[int] = None,
        decoding: Union[str, Decoder] = "ar",
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        guidance_scale: Optional[float] = None,
    ) -> TTSOutput:
        """Each text spoken from its own generator by continuous batching
        (`mmgen.decoding.batching`): at most `batch_size` rows decode at once (default: all), and
        a row whose speech ends takes the next text, prefilled alone. Output i is the one a call
        with text i alone (and its voice) and `generators[i]` gives (the decoder: `ar` or the
        sjd family; under the adaptive window each row chooses its own widths, judged at what
        they cost the batch, as a call with `row_decoder(decoding, batch_size)` does). `on_audio(i, audio, frames, stats)` receives each row's waveform
        as its speech ends, with its frames [n, C] and its own stats (a batch-1 decode's). The
        output's stats are the run's; `decode_s` leaves out the codec decoding of finished rows,
        as `__call__`'s does."""
        decoder = self.decoder(decoding)
        check_continuous(decoder, self.token_model())
        texts = [text] if isinstance(text, str) else list(text)
        if not texts:
            raise ValueError("text must be a non-empty string or a list of them")
        if len(generators) != len(texts):
            raise ValueError(f"{len(generators)} generators for {len(texts)} texts: give one generator per text")
        generators = self.generator_for(list(generators), per_output=True)
        voices, voice_texts = _per_row(voice, len(texts), "voice"), _per_row(voice_text, len(texts), "voice_text")
        prepared = [self.prepare(t, v, vt, max_new_frames, guidance_scale) for t, v, vt in zip(texts, voices, voice_texts)]
        budget = prepared[0][1]
        sampling, stopping = self.sampling(temperature, top_k, top_p), self.adapter.stopping(budget)
        rows: list = [None] * len(texts)
        codec_s = 0.0

        def finished(done: Finished) -> None:
            nonlocal codec_s
            frames, begin = done.checked().tokens, time.perf_counter()
            codes, audio = self._speech(frames)
            codec_s += time.perf_counter() - begin
            rows[done.index] = (frames, codes, audio)
            if on_audio is not None:  # the caller may keep or change them (mmgen.inference)
                on_audio(done.index, *ordinary((audio, frames, done.stats)))

        begin = time.perf_counter()
        requests = [Request(conditions, g) for (conditions, _), g in zip(prepared, generators)]
        _, stats = continuous_decode(decoder, self.token_model(), requests, budget, sampling, batch_size or len(requests),
                                     on_finish=finished, stopping=stopping)
        decode_s = time.perf_counter() - begin - codec_s
        lengths = torch.tensor([len(frames) for frames, _, _ in rows])
        frames = torch.full((len(rows), int(lengths.max()), *rows[0][0].shape[1:]), stopping.pad_token, dtype=torch.long)
        for i, (row, _, _) in enumerate(rows):
            frames[i, : len(row)] = row
        audio = [a for _, _, a in rows]
        longest = max(a.numel() for a in audio) / self.sampling_rate
        return TTSOutput(audio, self.sampling_rate, [c for _, c, _ in rows], frames.to(self.device), lengths.to(self.device),
                         stats, decode_s, decode_s / longest if longest else 0.0)

    def serve(self, decoding: Union[str, Decoder], batch_size: int, max_new_frames: Optional[int] = None,
              temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
              guidance_scale: Optional[float] = None, lock: Any = None) -> "TTSServer":
        """A shared continuous batch for texts from many threads (a demo's queue): requests that
        overlap in time decode together in up to `batch_size` rows, each output the one a call
        with its text alone, its voice, its generator and its frame budget gives (`ar` or the
        sjd family, the adaptive window as `row_decoder(decoding, batch_size)`; one sampling
        and guidance for all). `max_new_frames` caps every request
        (default the model's context); a request may ask for fewer. (A call narrows its window
        to a budget below it; such a request decodes as its text alone at the cap's window.)
        `lock` (a context manager) is held while the batch decodes."""
        decoder = self.decoder(decoding)
        check_continuous(decoder, self.token_model())
        check_int("batch_size", batch_size, 1)
        cap = self.adapter.default_max_frames() if max_new_frames is None else max_new_frames
        check_int("max_new_frames", cap, 1)
        sampling, stopping = self.sampling(temperature, top_k, top_p), self.adapter.stopping(cap)

        def decode(queue) -> None:
            continuous_decode(decoder, self.token_model(), queue, cap, sampling, batch_size, stopping=stopping)

        def result(done: Finished) -> tuple[torch.Tensor, torch.Tensor, DecodeStats]:
            frames = done.checked().tokens
            return self._speech(frames)[1], frames, done.stats

        return TTSServer(self, ContinuousServer(decode, result, lock), cap, guidance_scale)

    def stream(self, text: Union[str, Sequence[str]], chunking: StreamChunking = StreamChunking(),
               **kwargs) -> Generator[tuple[int, torch.Tensor], None, TTSOutput]:
        """(row, waveform chunk) pairs as frames commit (decoding runs in a thread). A row's
        chunks concatenate to its `audio` in `__call__` with the same arguments (up to float
        rounding with the default `chunking`, whose context covers the codec decoder's reach: the
        frames are the same, and each chunk's convolutions run over its own length). The generator's
        return value is that call's `TTSOutput`. Closed early, the decode stops at its next
        frame and the close returns once the model is free (`mmgen.streaming.stream_from_thread`).
        `window=` is the old name of `chunking` (read until the next release)."""
        chunking = _renamed_chunking(kwargs.pop("window", None), chunking)
        frames = stream_from_thread(lambda emit: self(text, streamer=CallbackStreamer(emit), **kwargs),
                                    name="mmgen-tts-stream")
        audio: dict[int, Any] = {}  # row -> its chunker
        finished: set[int] = set()
        with contextlib.closing(frames):
            while True:
                try:
                    row, new = next(frames)
                except StopIteration as end:
                    output = end.value
                    break
                if row in finished:
                    continue
                chunk, ended = audio.setdefault(row, self._row_audio(chunking)).push(new)
                if ended:
                    finished.add(row)
                if chunk.numel():
                    yield row, chunk
        for row, chunker in audio.items():  # rows cut by their budget end without an end frame
            if row not in finished:
                tail = chunker.flush()
                if tail.numel():
                    yield row, tail
        return output

    def _speech(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codec codes [C, T], waveform) of one row's generated frames [n, C]."""
        codes = self.adapter.codes(frames)[0]
        return codes, (self.codec.decode(codes) if codes.shape[1] else torch.zeros(0))

    def _row_audio(self, chunking: StreamChunking) -> "FrameAudio":
        """One row's streaming decoder: frames in, waveform chunks out."""
        return FrameAudio(self.adapter, self.codec, chunking)


class TTSServer:
    """`TTSPipeline.serve`'s shared batch: `submit` a text (checked here, in the caller's thread)
    for a future of `(audio, frames, stats)`, or `stream` it for its waveform chunks."""

    def __init__(self, pipe: TTSPipeline, server: ContinuousServer, max_new_frames: int, guidance_scale: Optional[float]):
        self.pipe, self.server, self.max_new_frames, self.guidance_scale = pipe, server, max_new_frames, guidance_scale

    def submit(self, text: str, voice: Any = None, voice_text: Optional[str] = None, generator: Optional[torch.Generator] = None,
               max_new_frames: Optional[int] = None, streamer: Any = None) -> Future:
        """Speak `text` (optionally continuing `voice`) from `generator` in the shared batch, in at
        most `max_new_frames` frames (default the server's cap); `streamer` receives its frames
        as they commit."""
        budget = self.max_new_frames if max_new_frames is None else max_new_frames
        if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= self.max_new_frames:
            raise ValueError(f"max_new_frames must be an integer in [1, {self.max_new_frames}] (the server's cap), "
                             f"got {budget!r}")
        if not isinstance(text, str):
            raise ValueError("submit takes one text; submit each text of a list on its own")
        conditions, _ = self.pipe.prepare(text, voice, voice_text, budget, self.guidance_scale)
        return self.server.submit(Request(conditions, self.pipe.generator_for(generator), budget, streamer))

    def stream(self, text: str, voice: Any = None, voice_text: Optional[str] = None, generator: Optional[torch.Generator] = None,
               max_new_frames: Optional[int] = None, chunking: StreamChunking = StreamChunking(),
               window: Optional[StreamChunking] = None,
               ) -> Generator[torch.Tensor, None, tuple[torch.Tensor, torch.Tensor, DecodeStats]]:
        """Waveform chunks as the frames commit (they concatenate to the audio exactly with the
        default `chunking`, as `TTSPipeline.stream`'s); the generator's return value is the
        submitted future's result. Closed early (the client went away), the request is
        cancelled: its row is freed at the batch's next forward. `window=` is the old name of
        `chunking` (read until the next release)."""
        chunking = _renamed_chunking(window, chunking)
        from mmgen.decoding import TokenQueueStreamer

        queue = TokenQueueStreamer(timeout=600)
        future = self.submit(text, voice, voice_text, generator, max_new_frames, queue)  # a failed decode ends the queue
        audio, ended = self.pipe._row_audio(chunking), False
        try:
            for _, frames in queue:
                if not ended:
                    chunk, ended = audio.push(frames)
                    if chunk.numel():
                        yield chunk
            if not ended:  # cut by its budget without an end frame
                tail = audio.flush()
                if tail.numel():
                    yield tail
        except BaseException:  # closed early (GeneratorExit), or the reader failed
            future.cancel()
            raise
        return future.result()


class FrameAudio:
    """A row's frames -> codec codes -> audio chunks (`CodecStream`), until its end frame.

    It keeps only the frames from the first audio frame not yet sent, so each push costs the
    frames it completes, not the row so far: an adapter's `codes(frames)` reads frames from any
    audio frame on as it reads the whole row (no end before it), which Dia's delay pattern and
    CSM's frames both do."""

    def __init__(self, adapter: Any, codec: Codec, chunking: StreamChunking):
        self.adapter, self.pending = adapter, []
        self.stream = CodecStream(codec, chunking)

    def push(self, new: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the audio the new frames complete, whether the row's end frame came)."""
        frames = torch.cat([*self.pending, new])
        codes, ended = self.adapter.codes(frames)
        self.pending = [frames[codes.shape[1]:]]
        chunk = self.stream.push(codes)
        return (torch.cat([chunk, self.stream.flush()]), True) if ended else (chunk, False)

    def flush(self) -> torch.Tensor:
        return self.stream.flush()


def _renamed_chunking(window: Optional[StreamChunking], chunking: StreamChunking) -> StreamChunking:
    """`chunking`, or the deprecated `window=` argument that named it until this release."""
    if window is None:
        return chunking
    warnings.warn("the stream's window= argument is now chunking= (a StreamChunking)", DeprecationWarning, stacklevel=3)
    return window


def _generate_top_k(config: Any) -> int:
    top_k = getattr(config, "top_k", None)
    return GENERATE_TOP_K if top_k is None else int(top_k)


def codec_source(source: str) -> str:
    """Where a speech folder's codec is, for a family whose model does not own one: the folder's
    `codec/` (what `save_pretrained` writes), else the audio tokenizer its processor config names:
    a Hub repo id, never a path (a folder's files are read only from inside it)."""
    local = Path(source) / CODEC_FOLDER  # its links were checked with the folder's (`TTSPipeline.from_pretrained`)
    if local.is_dir():
        return str(local)
    from transformers.utils import cached_file

    config = cached_file(source, "processor_config.json", _raise_exceptions_for_missing_entries=False)
    named = read_json(config).get("audio_tokenizer", {}).get("audio_tokenizer_name_or_path") if config else None
    if not named:
        raise ValueError(f"{source}: no codec: neither a {CODEC_FOLDER}/ folder nor an audio tokenizer in processor_config.json")
    if looks_like_path(named):
        raise CheckpointError(f"{source}: processor_config.json names its codec by the path {named!r}; a folder's codec "
                              f"is its {CODEC_FOLDER}/ subfolder or a Hugging Face repo id")
    return named


def _per_row(value: Any, rows: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != rows:
            raise ValueError(f"{rows} texts need {rows} {name} entries (or one for all), got {len(value)}")
        return value
    return [value] * rows


@runtime_checkable
class SpeechAdapter(Protocol):
    """What `TTSPipeline` asks of a speech family (`DiaSpeech`, `CsmSpeech`): registered with
    `register_family("speech", MODEL_TYPE, pipeline="TTSPipeline", adapter=...)`.

    The class loads a folder, `load(source, torch_dtype, **kwargs) -> (model, tokenizer, codec)`,
    and is built from those three, `Adapter(model, tokenizer, codec)`. The object then gives the
    core's token model over codec frames, each request's conditions, the stop rule, the codec
    codes of decoded frames (and whether the row ended), the frame layout that tells drafters
    of the same frames apart, the default frame budget, and whether the tokenizer is saved."""

    saves_tokenizer: bool

    @classmethod
    def load(cls, source: str, torch_dtype: Optional[torch.dtype] = None, **kwargs: Any) -> tuple[Any, Any, Any]: ...

    def token_model(self) -> Any: ...

    def conditions(self, texts: Sequence[str], voices: Sequence[Optional[torch.Tensor]], voice_texts: Sequence[Optional[str]],
                   max_new_frames: int, guidance_scale: Optional[float]) -> Any: ...

    def stopping(self, max_new_frames: int) -> Stopping: ...

    def codes(self, frames: torch.Tensor) -> tuple[torch.Tensor, bool]: ...

    def frame_layout(self) -> tuple: ...

    def default_max_frames(self) -> int: ...


def _adapter(model_type: str) -> type:
    """The adapter class registered for speech family `model_type` (`registry.register_family`),
    checked against `SpeechAdapter` (ValueError naming what it lacks)."""
    family = registry.family("speech", model_type)
    if family is None or family.adapter is None:
        served = [name for name, f in registry.families("speech").items() if f.adapter is not None]
        raise ValueError(f"model type {model_type!r} is not a speech model mmgen serves ({', '.join(served)})")
    adapter = family.adapter_class()
    missing = [name for name in ("load", "saves_tokenizer", *(m for m in SpeechAdapter.__dict__ if not m.startswith("_")))
               if not hasattr(adapter, name)]
    if missing:
        raise ValueError(f"the speech adapter {adapter.__name__} of model type {model_type!r} lacks "
                         f"{', '.join(sorted(set(missing)))} (mmgen.audio.pipeline.SpeechAdapter)")
    return adapter
