"""Speech requests: check a text-to-speech request's inputs, speak the text with the chosen
decoding method (and, in compare mode, with plain autoregressive decoding on the same seed
first), streaming each run's waveform as its frames commit. Shared by the speech demo and
`mmgen serve`'s `/v1/audio/speech`; importing it needs no gradio.

The bundled `speech-tts` (with its drafter `speech-tts-draft`) is served unless given --model:
bundled names or transformers folders of a registered speech family (Dia, CSM, VibeVoice, ...:
`mmgen.registry.families("speech")`), as `mmgen generate speech` reads them. A folder `X-draft`
beside a folder `X` is X's drafter, for the methods that pair a second model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from mmgen import registry
from mmgen.decoding import DecodeStats
from mmgen.sampling import make_generator

from .bounds import LIMITS, MAX_SEED, check_plain_text, checked_text, integer, sampler, shown
from .catalog import Catalog, folder_field, model_folder
from .runs import BASELINE_LABEL, PerUnit, Result, finish, relay
from .service import ModalityService, family_call, register_service

DRAFT_SUFFIX = "-draft"
MAX_NEW_FRAMES = LIMITS.new_frames  # hard cap of a run's decoder frames, whatever --max-new-frames says
DEFAULT_MAX_NEW_FRAMES = 1024  # --max-new-frames' default: about 12 s of Dia's 86 frames a second
MAX_TEXT_CHARS = 1000
MAX_VOICE_BYTES = LIMITS.upload_bytes  # a voice upload larger than this is refused before it is read
MAX_VOICE_SECONDS = LIMITS.audio_seconds  # a voice prompt is a few seconds of the voice to continue
MAX_TOP_K = 65536  # when a model does not say its codebook size
#: How soundfile names an in-memory file in its errors ("Error opening <_io.BytesIO object at 0x...>: ").
IN_MEMORY_FILE = re.compile(r"Error opening <_io\.BytesIO object at 0x[0-9a-fA-F]+>: ")
#: The bundled model the demo serves when given none (its drafter comes along).
DEFAULT_MODEL = "speech-tts"


class SpeechCatalog(Catalog):
    """The text-to-speech models a surface offers (`Catalog`): main models and their drafters
    (names ending in -draft)."""

    modality = "speech"

    @classmethod
    def discover(cls, models: Optional[Sequence[str]] = None, device: str = "cpu") -> "SpeechCatalog":
        """The given bundled names and model folders (default: the bundled `speech-tts`); a folder
        X-draft beside a given folder X comes along as its drafter."""
        bundled = registry.bundled_models()
        entries = [_checked_folder(str(bundled.get(str(entry), entry))) for entry in (models or [DEFAULT_MODEL])]
        for entry in list(entries):
            sibling = Path(entry).parent / (Path(entry).name + DRAFT_SUFFIX)
            if not entry.endswith(DRAFT_SUFFIX) and _is_speech_folder(sibling):
                entries.append(str(sibling))
        named: dict[str, str] = {}
        for entry in dict.fromkeys(str(Path(e)) for e in entries):
            name = Path(entry).name
            named[entry if name in named else name] = entry  # two folders of one name: the second goes by its path
        main = {n: s for n, s in named.items() if not n.endswith(DRAFT_SUFFIX)}
        companions = {n: s for n, s in named.items() if n not in main}
        if not main:  # only drafters were given: offer them as models
            main, companions = companions, {}
        return cls(main, companions, device)

    def load(self, source: str) -> Any:
        import transformers

        from mmgen.loading import load_pipeline

        transformers.utils.logging.disable_progress_bar()  # no loading bars in the server's log
        from mmgen.audio.pipeline import TTSPipeline

        pipe = load_pipeline(source, device=self.device)
        if not isinstance(pipe, TTSPipeline):
            raise ValueError(f"{Path(source).name} holds a {type(pipe).__name__}; the speech demo serves text-to-speech models")
        return pipe


def _is_speech_folder(folder: Path) -> bool:
    return registry.family("speech", folder_field(folder, "config.json", "model_type")) is not None


def _checked_folder(entry: str) -> str:
    """A folder with the config.json of a speech model (no Hub ids: the demo never downloads)."""
    if not model_folder(entry):
        raise ValueError(f"--model {entry!r} is neither a bundled speech model present in this installation nor a "
                         "model folder with a config.json (a transformers Dia, CSM or VibeVoice folder)")
    if not _is_speech_folder(Path(entry)):
        raise ValueError(f"--model {entry!r} is not a text-to-speech model: its config.json's model_type is not one of "
                         f"{list(registry.families('speech'))}")
    return entry


# --------------------------------------------------------------------------------------------
# What the UI offers for a model
# --------------------------------------------------------------------------------------------


def sampling_defaults(catalog: SpeechCatalog, model: str) -> dict[str, Any]:
    """The model's own sampler (its generation config: greedy when it does not sample), and the
    top-k bound: what the UI's controls start at."""
    pipe = catalog.pipeline(model)
    config = pipe.sampling(None, None, None)
    return {"temperature": float(config.temperature), "top_k": int(config.top_k), "top_p": float(config.top_p),
            "max_top_k": _vocab_size(pipe), "max_new_frames": int(pipe.adapter.default_max_frames())}


def _vocab_size(pipe: Any) -> int:
    layout = pipe.adapter.frame_layout()
    size = layout[2] if len(layout) > 2 else None
    return int(size) if isinstance(size, int) and size > 0 else MAX_TOP_K


# --------------------------------------------------------------------------------------------
# Requests and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeechRequest:
    """One press of Generate. None sampler values take the model's generation config."""

    model: str
    text: str
    voice: Any = None  # a voice prompt: an audio file's path (an upload) or its bytes
    voice_text: Optional[str] = None  # the voice prompt's transcript
    method: str = "ar"
    max_new_frames: int = 256
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    compare: bool = False  # also speak with plain autoregressive decoding, same seed, first
    family_options: dict = field(default_factory=dict)  # its family's own options (`registry.family_options`)


@dataclass
class SpeechRun(PerUnit):
    """One decoding of the request: its label ("sjd", "ar (baseline)"), waveform (mono float32 at
    `sampling_rate`) and the pipeline's numbers."""

    label: str
    audio: np.ndarray
    sampling_rate: int
    frames: int  # decoder frames of the row, its end included
    stats: DecodeStats
    decode_s: float
    real_time_factor: float

    @property
    def audio_seconds(self) -> float:
        return self.audio.size / self.sampling_rate

    @property
    def units(self) -> int:
        return self.frames

    @property
    def seconds(self) -> float:
        """Seconds decoding took (the codec's included)."""
        return self.decode_s


    @property
    def frames_per_forward(self) -> float:
        return self.frames / self.stats.forwards if self.stats.forwards else 0.0


@dataclass
class SpeechResult(Result):
    """The runs of one request, the autoregressive baseline first in compare mode."""

    runs: list[SpeechRun]
    unit = "frame"

    def stats_rows(self) -> list[dict[str, Any]]:
        """One row per run: frames, seconds of audio, forwards (the prefill included), frames per
        forward, decode seconds, real-time factor (decode seconds over audio seconds: below 1 is
        faster than real time), time per frame and, in compare mode, the speedup per frame over
        the baseline (a run that stops early is not faster for it)."""
        return [{"run": run.label, "frames": run.frames, "audio (s)": round(run.audio_seconds, 3),
                 "forwards": run.stats.forwards, "frames/forward": round(run.frames_per_forward, 2),
                 "decode (s)": round(run.decode_s, 3), "real-time factor": round(run.real_time_factor, 3),
                 **self.speed_columns(run)} for run in self.runs]


@dataclass(frozen=True)
class AudioUpdate:
    """A streamed update: run `index` of the request (0 is the baseline in compare mode) has a new
    chunk of waveform (mono float32 at `sampling_rate`); `seconds` of its audio are out so far."""

    index: int
    label: str
    chunk: np.ndarray
    sampling_rate: int
    seconds: float


@dataclass(frozen=True)
class CheckedSpeech:
    """A speech request whose every input passed its checks (`check_request`): what the runs
    read, in the model's terms. Making one loads the model's pipeline if needed, and runs
    nothing."""

    request: SpeechRequest
    pipe: Any
    text: str
    frame_limit: int  # the shared batch's frame budget (the server's or the model's cap)
    budget: int
    seed: int
    sampling: dict
    voice: Optional[tuple]
    voice_text: Optional[str]
    plan: tuple  # (label, method) of each run, the baseline first in compare mode
    family: dict  # the family's own options, as call keywords (`family_call`)


def check_request(request: SpeechRequest, catalog: SpeechCatalog,
                  max_new_frames: int = DEFAULT_MAX_NEW_FRAMES) -> CheckedSpeech:
    """Every check of `request` (ValueError with a one-line message), before any decoding: the
    server calls it before the request waits for its model."""
    pipe = catalog.main_pipeline(request.model)
    text = checked_text("the text", request.text, MAX_TEXT_CHARS, empty="type a text to speak (the text is empty)")
    limit = max(1, min(int(max_new_frames), MAX_NEW_FRAMES, int(pipe.adapter.default_max_frames())))
    budget = integer("max new frames", request.max_new_frames, 1, limit)
    seed = integer("seed", request.seed, 0, MAX_SEED)
    sampling = sampler(request.temperature, request.top_k, request.top_p, _vocab_size(pipe))
    family = family_call("speech", pipe, request.family_options)
    offered = catalog.methods(request.model)
    if isinstance(request.method, str) and request.method in pipe.companions and request.method not in offered:
        catalog.decoder(request.method, request.model)  # raises: names the missing drafter
    if not isinstance(request.method, str) or request.method not in offered:
        raise ValueError(f"unknown decoding method {shown(request.method)} for this model; choose one of {offered}")
    voice = _voice(request.voice, pipe.sampling_rate)
    voice_text = _voice_text(request.voice_text, voice)
    plan = ((BASELINE_LABEL, "ar"),) if request.compare else ()
    return CheckedSpeech(request, pipe, text, limit, budget, seed, sampling, voice, voice_text,
                         plan + ((request.method, request.method),), family)


def run_request(request: SpeechRequest, catalog: SpeechCatalog,
                max_new_frames: int = DEFAULT_MAX_NEW_FRAMES) -> SpeechResult:
    """Check `request` (ValueError with a one-line message), speak it and return the runs."""
    return finish(stream_request(request, catalog, max_new_frames))


def stream_request(request: SpeechRequest, catalog: SpeechCatalog,
                   max_new_frames: int = DEFAULT_MAX_NEW_FRAMES) -> Iterator[AudioUpdate]:
    """`run_request`, yielding each run's waveform chunks as frames commit (`TTSPipeline.stream`);
    returns the `SpeechResult` (the generator's return value). Every input is checked before
    any decoding."""
    return (yield from stream_checked(check_request(request, catalog, max_new_frames), catalog))


def stream_checked(checked: CheckedSpeech, catalog: SpeechCatalog) -> Iterator[AudioUpdate]:
    """`stream_request` of a request `check_request` passed."""
    request, pipe, plan = checked.request, checked.pipe, list(checked.plan)
    runs = []
    # Compare mode times its two runs, so it never shares a batch with other requests; nor does a
    # call with its family's own options.
    shared = None if request.compare or checked.family else catalog.server(
        request.model, request.method, catalog.decoder(request.method, request.model), max_new_frames=checked.frame_limit,
        **checked.sampling)
    if shared is not None:  # outside the model's lock, which the shared batch takes while it decodes
        label = f"{request.method} (continuous batch)"
        stream = shared.stream(checked.text, checked.voice, checked.voice_text, make_generator(checked.seed, catalog.device),
                               checked.budget)
        audio, frames, stats = yield from relay(stream, _audio_so_far(0, label, pipe.sampling_rate))
        seconds = audio.numel() / pipe.sampling_rate
        runs.append(SpeechRun(label, audio.float().numpy(), pipe.sampling_rate, len(frames), stats, stats.wall_time_s,
                              stats.wall_time_s / seconds if seconds else 0.0))
        plan = []
    with catalog.using([request.model, *filter(None, [catalog.companion_of(request.model, DRAFT_SUFFIX)])] if plan else []):
        decoders = [catalog.decoder(method, request.model) for _, method in plan]  # all checked before any run
        for index, ((label, _), decoder) in enumerate(zip(plan, decoders)):
            call = dict(voice=checked.voice, voice_text=checked.voice_text, max_new_frames=checked.budget, decoding=decoder,
                        generator=make_generator(checked.seed, catalog.device), **checked.sampling, **checked.family)
            stream = pipe.stream(checked.text, **call)
            output = yield from relay(stream, _audio_so_far(index, label, pipe.sampling_rate, lambda item: item[1]))
            runs.append(SpeechRun(label, output.audio[0].float().numpy(), output.sampling_rate, int(output.lengths[0]),
                                  output.stats, float(output.decode_s), float(output.real_time_factor)))
    return SpeechResult(runs)


class SpeechService(ModalityService):
    """The speech modality's request layer (`mmgen.apps.requests.service`): text to speech, each
    run's waveform streamed as its frames commit (`AudioUpdate`)."""

    noun, unit = "speech", SpeechResult.unit
    catalog, request = SpeechCatalog, SpeechRequest
    check, stream = staticmethod(check_request), staticmethod(stream_checked)


SERVICE = register_service(SpeechService())


def _audio_so_far(index: int, label: str, rate: int, chunk_of: Any = lambda item: item):
    """A `relay` progress function: each streamed waveform chunk (`chunk_of(item)`) with the
    seconds of audio out so far."""
    samples = 0

    def progress(item: Any) -> AudioUpdate:
        nonlocal samples
        chunk = chunk_of(item)
        samples += chunk.numel()
        return AudioUpdate(index, label, chunk.float().numpy(), rate, samples / rate)

    return progress


def _voice(voice: Any, sampling_rate: int) -> Optional[tuple]:
    """The voice prompt as (waveform, rate) at the model's rate, or None. A file is bounded in
    bytes before it is read and in seconds once decoded (`read_audio`); messages name it
    "the voice prompt", never by its (server-side, temporary) path."""
    from mmgen.audio.waveform import AudioError, read_audio

    if voice is None or (isinstance(voice, str) and not voice):
        return None
    if isinstance(voice, (str, os.PathLike)):
        path = Path(voice)
        if not path.is_file():  # not a regular file: a device, a folder or nothing
            raise ValueError("the voice prompt is not an audio file")
        if path.stat().st_size > MAX_VOICE_BYTES:
            raise ValueError(f"the voice prompt is {path.stat().st_size} bytes; at most {MAX_VOICE_BYTES} are accepted")
        with path.open("rb") as file:
            data = file.read(MAX_VOICE_BYTES + 1)
    elif isinstance(voice, (bytes, bytearray)):
        data = bytes(voice)
    else:
        raise ValueError(f"the voice prompt must be an audio file, got {shown(voice)}")
    if len(data) > MAX_VOICE_BYTES:
        raise ValueError(f"the voice prompt is over {MAX_VOICE_BYTES} bytes; at most {MAX_VOICE_BYTES} are accepted")
    try:
        wave = read_audio(data, sampling_rate, max_seconds=MAX_VOICE_SECONDS)
    except AudioError as error:  # one line; soundfile names the in-memory file by its repr: dropped
        raise AudioError(IN_MEMORY_FILE.sub("", str(error))) from None
    return wave.numpy(), sampling_rate


def _voice_text(text: Any, voice: Optional[tuple]) -> Optional[str]:
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if not isinstance(text, str):
        raise ValueError(f"the voice transcript must be text, got {shown(text)}")
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"the voice transcript must be at most {MAX_TEXT_CHARS} characters, got {len(text)}")
    if voice is None:
        raise ValueError("the voice transcript is the transcript of a voice prompt: upload the voice too")
    check_plain_text("the voice transcript", text)
    return text.strip()
