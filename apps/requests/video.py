"""Video requests: check a request's inputs, make the video block by block with the
block-diffusion pipeline, streaming each block's frames as it is committed, and return the
frames with the call's profile. Shared by the video demo and `mmgen serve`'s `/v1/videos`;
importing it needs neither gradio nor diffusers. Live streams (`check_stream`, `LiveVideo`: a
video that runs for as long as it is read and follows new prompts, on the pipeline's `stream`)
serve `/v1/videos/stream` and the demo's live player.

The bundled `emoji-motion` (with its small model `emoji-motion-small`) is served unless given
--model: bundled names or pipeline folders of a registered video family
(`BlockDiffusionVideoPipeline`, ...: `mmgen.registry.families("video")`), as `mmgen generate
video` reads them. A folder `X-small` beside a folder `X` is X's small model, for collaborative
denoising (the large model takes the first denoising steps of each block, the small one the rest).
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from mmgen import registry
from mmgen.sampling import make_generator
from mmgen.streaming import stream_from_thread

from .bounds import LIMITS, MAX_SEED, checked_text, integer, number, shown
from .catalog import Catalog, folder_field, model_folder
from .runs import finish, relay
from .service import ModalityService, family_call, register_service

#: The bundled model the demo serves when given none (its small model comes along).
DEFAULT_MODEL = "emoji-motion"
SMALL_SUFFIX = "-small"
MAX_FRAMES = LIMITS.video_frames  # hard cap of a video's frames, whatever --max-frames says (20 s at 16 fps)
DEFAULT_MAX_FRAMES = 81  # --max-frames' default: Wan's 5 s at 16 fps
MAX_PROMPT_CHARS = 500
MAX_POLICY_CHARS = 40
MAX_CACHE_FRAMES = 128  # a cache window's or sink's latent frames, at most
MAX_CACHE_THRESHOLD = 1.0  # First Block Cache: a relative change; 1 already reuses nearly every step
MAX_DROP_THRESHOLD = 1.0  # static-token dropping: a relative change likewise
#: Cache policies (`CachePolicy`, in latent frames) and the no-cache reference that recomputes
#: the committed frames at every forward.
NO_CACHE = "none"
WORKER = "mmgen-video"  # names the thread that runs the pipeline
COLLABORATIVE = "collaborative"


class VideoCatalog(Catalog):
    """The block-diffusion video models a surface offers (`Catalog`): main models and their
    small models (names ending in -small)."""

    modality = "video"

    @classmethod
    def discover(cls, models: Optional[Sequence[str]] = None, device: str = "cpu") -> "VideoCatalog":
        """The given bundled names and pipeline folders (default: the bundled `emoji-motion`);
        a model's small model `<model>-small` comes along: the bundled one of a bundled name, a
        folder X-small beside a folder X."""
        bundled = registry.bundled_models()
        entries = [_checked_entry(str(entry), bundled) for entry in (models or [DEFAULT_MODEL])]
        for entry in list(entries):
            if entry.endswith(SMALL_SUFFIX):
                continue
            small = entry + SMALL_SUFFIX if entry in bundled else str(Path(entry).parent / (Path(entry).name + SMALL_SUFFIX))
            if _is_video_folder(bundled.get(small, small)):
                entries.append(small)
        return cls.from_entries(entries, bundled, device)

    def load(self, source: str) -> Any:
        from mmgen.loading import load_pipeline
        from mmgen.video.cli import quiet_loaders
        from mmgen.video.pipeline import BlockDiffusionVideoPipeline

        quiet_loaders()  # no loading bars or cast warnings in the server's log
        pipe = load_pipeline(source, device=self.device)
        if not isinstance(pipe, BlockDiffusionVideoPipeline):
            raise ValueError(f"{Path(str(source)).name} holds a {type(pipe).__name__}; the video demo serves "
                             "block-diffusion video models")
        return pipe


def _is_video_folder(folder: Any) -> bool:
    return registry.family("video", folder_field(folder, "model_index.json", "_class_name")) is not None


def _checked_entry(entry: str, bundled: dict) -> str:
    """A bundled name present in this installation, or a video pipeline folder (no Hub ids:
    the demo never downloads). Folders are named by their normalised path."""
    if entry in bundled or entry == DEFAULT_MODEL:
        if entry not in bundled or not model_folder(bundled[entry], "model_index.json"):
            raise ValueError(f"the bundled model {entry!r} is missing from this installation; pass --model FOLDER")
        if not _is_video_folder(bundled[entry]):
            raise ValueError(f"the bundled model {entry!r} is not a block-diffusion video model")
        return entry
    if not model_folder(entry, "model_index.json"):
        raise ValueError(f"--model {entry!r} is neither a bundled video model nor a pipeline folder with a "
                         "model_index.json (`mmgen convert self-forcing` writes one)")
    if not _is_video_folder(entry):
        raise ValueError(f"--model {entry!r} is not a block-diffusion video model: its model_index.json names "
                         f"no {' or '.join(registry.families('video'))}")
    return str(Path(entry))


# --------------------------------------------------------------------------------------------
# What the UI offers for a model
# --------------------------------------------------------------------------------------------


def lengths(pipe: Any, max_frames: int = DEFAULT_MAX_FRAMES) -> list[int]:
    """The video lengths (frames) the model makes at its block size, up to `max_frames`: the
    VAE keeps the first frame and compresses time by r (1 + r·k frames), and a video is whole
    blocks of latent frames: 1 + r·(n·b − 1) for n blocks of b latent frames."""
    r, b = pipe.temporal_ratio, pipe.block_frames
    limit = max(1, min(int(max_frames), MAX_FRAMES))
    out, n = [], 1
    while 1 + r * (n * b - 1) <= limit:
        out.append(1 + r * (n * b - 1))
        n += 1
    return out


def default_length(pipe: Any, offered: Sequence[int]) -> Optional[int]:
    """The model's own length where offered, else the longest offered below it, else the first."""
    if not offered:
        return None
    if pipe.num_frames in offered:
        return pipe.num_frames
    below = [n for n in offered if n <= pipe.num_frames]
    return below[-1] if below else offered[0]


def cache_policies(pipe: Any) -> list[str]:
    """Cache policies to pick from (any other `window:N` / `sink:S,window:N` may be typed):
    every committed frame, a window of two blocks, that window with the first block as a sink,
    and the no-cache reference."""
    b = pipe.block_frames
    return ["global", f"window:{2 * b}", f"sink:{b},window:{2 * b}", NO_CACHE]


def model_settings(catalog: VideoCatalog, model: str, max_frames: int = DEFAULT_MAX_FRAMES) -> dict[str, Any]:
    """What the UI's controls offer and start at for `model`."""
    pipe = catalog.pipeline(model)
    offered = lengths(pipe, max_frames)
    steps = len(pipe.schedule.timesteps)
    return {"methods": catalog.methods(model), "lengths": offered, "length": default_length(pipe, offered),
            "policies": cache_policies(pipe), "steps": steps, "large_steps": max(1, steps // 2),
            "block_frames": pipe.block_frames, "fps": float(pipe.fps), "size": (pipe.height, pipe.width)}


# --------------------------------------------------------------------------------------------
# Requests and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoRequest:
    """One press of Generate. None takes the model's own value (length) or turns a feature off
    (First Block Cache)."""

    model: str
    prompt: str
    num_frames: Optional[int] = None
    cache_policy: str = "global"  # global, window:N, sink:S,window:N (latent frames) or none
    decode_per_block: bool = True  # decode (and stream) each block as it is made, else the whole video at the end
    method: str = "block"  # or collaborative (with the model's small model)
    large_steps: int = 1  # collaborative: the large model's denoising steps of each block
    cache_threshold: Optional[float] = None  # First Block Cache; None or 0: off
    drop_threshold: Optional[float] = None  # static-token dropping; None or 0: off
    seed: int = 0
    family_options: dict = field(default_factory=dict)  # its family's own options (`registry.family_options`)


@dataclass(frozen=True)
class BlockUpdate:
    """A streamed update: block `index` (0-based) of `num_blocks` is committed, `seconds` after
    the call started; `frames` [T, H, W, 3] uint8 are its video frames `start` … `start + T − 1`
    (None when the video is decoded at the end)."""

    index: int
    num_blocks: int
    start: int
    frames: Optional[np.ndarray]
    seconds: float


@dataclass
class VideoResult:
    """The video (frames [T, H, W, 3] uint8 at `fps`), its blocks' frame ranges [start, end)
    and the pipeline's numbers (`VideoProfile`, `BlockStats`)."""

    label: str
    frames: np.ndarray
    fps: float
    spans: list[tuple[int, int]]
    profile: Any
    stats: Any

    def mp4(self) -> bytes:
        """The video as an H.264 MP4 (`mmgen.video.export.mp4_bytes`)."""
        from mmgen.video.export import mp4_bytes

        return mp4_bytes(self.frames, self.fps)

    def blocks(self) -> list[np.ndarray]:
        """The frames of each block, in order."""
        return [self.frames[start:end] for start, end in self.spans]

    def profile_row(self) -> dict[str, Any]:
        """What a streaming viewer waits for: the first block's latency, the frames made per
        second over the whole call, the K/V cache held, the memory the call added (CUDA's peak
        allocation on a GPU), the denoising forwards per model and, with token dropping, the
        share of token-layers each model computed."""
        p, s = self.profile, self.stats
        return {"method": self.label, "frames": int(self.frames.shape[0]), "blocks": s.blocks,
                "first block (s)": round(p.first_block_s, 3), "total (s)": round(p.total_s, 3),
                "frames/s": round(p.frames_per_second, 2), "cache": size_text(p.cache_bytes),
                "peak memory": size_text(p.peak_memory_bytes),
                "denoise forwards": " · ".join(f"{role} {n}" for role, n in s.denoise_forwards.items()),
                "tokens computed": " · ".join(f"{role} {f:.0%}" for role, f in s.computed_fraction.items()) or "all"}

    def block_rows(self) -> list[dict[str, Any]]:
        """(block, its frames, its latency) per block: seconds from the previous block's end,
        its decode included."""
        return [{"block": i + 1, "frames": f"{start}–{end - 1}", "latency (s)": round(seconds, 4)}
                for i, ((start, end), seconds) in enumerate(zip(self.spans, self.profile.block_s))]


def size_text(size: int) -> str:
    """Bytes in the largest unit that keeps the number at 1 or more: '9.0 KiB'."""
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


@dataclass(frozen=True)
class CheckedVideo:
    """A video request whose every input passed its checks (`check_request`), in the model's
    terms. Making one loads the model's pipeline if needed, and runs nothing."""

    request: VideoRequest
    pipe: Any
    prompt: str
    num_frames: int
    cache_policy: str
    label: str
    options: dict  # the decoder's options (collaborative: large_steps)
    thresholds: dict  # cache_threshold, drop_threshold
    seed: int
    small: Optional[str]  # the small model's name, for collaborative denoising
    family: dict  # the family's own options, as call keywords (`family_call`)


def check_request(request: VideoRequest, catalog: VideoCatalog, max_frames: int = DEFAULT_MAX_FRAMES) -> CheckedVideo:
    """Every check of `request` (ValueError with a one-line message), before any work: the server
    calls it before the job waits for its model."""
    pipe = catalog.main_pipeline(request.model)
    prompt = checked_text("the prompt", request.prompt, MAX_PROMPT_CHARS, empty="type a prompt (the prompt is empty)")
    limit = max(1, min(int(max_frames), MAX_FRAMES))
    frames = integer("length (frames)", pipe.num_frames if request.num_frames is None else request.num_frames, 1, limit)
    pipe.check_geometry(frames, pipe.block_frames, pipe.height, pipe.width)
    policy = _cache_policy(request.cache_policy)
    family = family_call("video", pipe, request.family_options)
    if not isinstance(request.decode_per_block, bool):
        raise ValueError(f"decode per block must be true or false, got {shown(request.decode_per_block)}")
    offered = catalog.methods(request.model)
    if request.method == COLLABORATIVE and COLLABORATIVE not in offered:
        raise ValueError(f"collaborative denoising needs a small model: start with a folder "
                         f"{request.model}{SMALL_SUFFIX} beside the model")
    if not isinstance(request.method, str) or request.method not in offered:
        raise ValueError(f"unknown method {shown(request.method)} for this model; choose one of {offered}")
    steps = len(pipe.schedule.timesteps)
    options, label = {}, request.method
    large_steps = integer("large-model steps", request.large_steps, 1, steps)  # checked whichever method runs
    if request.method == COLLABORATIVE:
        options["large_steps"] = large_steps
        label = f"{COLLABORATIVE} (large {large_steps}/{steps} steps)"
    thresholds = dict(cache_threshold=_threshold("First Block Cache threshold", request.cache_threshold, MAX_CACHE_THRESHOLD),
                      drop_threshold=_threshold("token dropping threshold", request.drop_threshold, MAX_DROP_THRESHOLD))
    if policy == NO_CACHE and any(v is not None for v in thresholds.values()):
        raise ValueError("First Block Cache and token dropping need the K/V cache: set their thresholds to 0 with the "
                         "cache policy 'none'")
    seed = integer("seed", request.seed, 0, MAX_SEED)
    small = catalog.companion_of(request.model, SMALL_SUFFIX) if request.method == COLLABORATIVE else None
    return CheckedVideo(request, pipe, prompt, frames, policy, label, options, thresholds, seed, small, family)


def run_request(request: VideoRequest, catalog: VideoCatalog, max_frames: int = DEFAULT_MAX_FRAMES) -> VideoResult:
    """Check `request` (ValueError with a one-line message), make the video and return it."""
    return finish(stream_request(request, catalog, max_frames))


def stream_request(request: VideoRequest, catalog: VideoCatalog,
                   max_frames: int = DEFAULT_MAX_FRAMES) -> Iterator[BlockUpdate]:
    """`run_request`, yielding a `BlockUpdate` per block as it is committed (the pipeline runs in a
    thread); returns the `VideoResult` (the generator's return value). Every input is checked
    before any work. Closed early (the page went away), the run stops after its current block."""
    return (yield from stream_checked(check_request(request, catalog, max_frames), catalog))


def stream_checked(checked: CheckedVideo, catalog: VideoCatalog) -> Iterator[BlockUpdate]:
    """`stream_request` of a request `check_request` passed."""
    request, pipe, options = checked.request, checked.pipe, dict(checked.options)
    with catalog.using([request.model, *filter(None, [checked.small])]):
        from mmgen.loading import decoder_from_spec

        if checked.small is not None:
            options["small"] = catalog.pipeline(checked.small)
        decoder = decoder_from_spec(request.method, pipe, catalog.main[request.model], catalog.device, **options)
        # block b's latent frames [b, b + block) decode to video frames [first_frame(b), first_frame(b + block))
        spans = [(pipe.first_frame(b), pipe.first_frame(b + pipe.block_frames))
                 for b in range(0, pipe.latent_frames(checked.num_frames), pipe.block_frames)]
        call = dict(prompt=checked.prompt, num_frames=checked.num_frames, decoding=decoder, cache_policy=checked.cache_policy,
                    decode="block" if request.decode_per_block else "end",
                    generator=make_generator(checked.seed, catalog.device), **checked.thresholds, **checked.family)
        started = time.perf_counter()

        def block(item: tuple) -> BlockUpdate:
            index, frames = item
            return BlockUpdate(index, len(spans), spans[index][0], frames, time.perf_counter() - started)

        # The pipeline's block callback feeds the stream; closed early, the run stops at its next block.
        stream = stream_from_thread(lambda emit: pipe(**call, callback=lambda index, latents, frames: emit(
            (index, None if frames is None else frames[0].numpy()))), name=WORKER)
        output = yield from relay(stream, block)
    return VideoResult(checked.label, output.frames[0].numpy(), float(output.fps), spans, output.profile, output.stats)


class VideoService(ModalityService):
    """The video modality's request layer (`mmgen.apps.requests.service`): block-diffusion video,
    each block streamed as it commits (`BlockUpdate`); a live stream is `LiveVideo`'s."""

    noun, unit = "video", "frame"
    catalog, request = VideoCatalog, VideoRequest
    check, stream = staticmethod(check_request), staticmethod(stream_checked)


SERVICE = register_service(VideoService())


def _threshold(what: str, value: Any, high: float) -> Optional[float]:
    """A feature's threshold in [0, high]; None or 0 turn the feature off (None)."""
    return None if value is None else number(what, value, 0.0, high) or None


def _cache_policy(spec: Any) -> str:
    """A cache policy spec (`CachePolicy.parse`), its window and sink bounded, or 'none'."""
    from mmgen.cache import CachePolicy

    if not isinstance(spec, str) or len(spec) > MAX_POLICY_CHARS:
        raise ValueError(f"the cache policy must be global, window:N, sink:S,window:N or none, got {shown(spec)}")
    spec = spec.strip()
    if spec == NO_CACHE:
        return spec
    try:
        policy = CachePolicy.parse(spec)
        if policy.window is not None:
            integer("cache window", policy.window, 1, MAX_CACHE_FRAMES)
            integer("cache sink", policy.sink, 0, MAX_CACHE_FRAMES)
    except ValueError as error:  # named as typed: "cache policy 'window:0': cache window must be ..."
        message = str(error)
        raise ValueError(message if message.startswith("cache policy") else f"cache policy {shown(spec)}: {message}") from None
    return str(policy)


# --------------------------------------------------------------------------------------------
# Live streams: a video that runs for as long as it is read, steered by new prompts
# --------------------------------------------------------------------------------------------

#: Blocks one live stream makes, at most, whatever a surface allows (at 16 fps, blocks of 3
#: latent frames of Wan's 4 video frames each: about two hours of video).
MAX_STREAM_BLOCKS = 10_000
DEFAULT_STREAM_BLOCKS = 1_000


@dataclass(frozen=True)
class StreamRequest:
    """A live stream: `VideoRequest`'s settings without a length (it runs until closed or its
    `max_blocks`); `cache_policy` must roll ("window:N" or "sink:S,window:N"; None: the
    pipeline's default stream policy), so that memory stays flat however long it runs."""

    model: str
    prompt: str
    cache_policy: Optional[str] = None
    method: str = "block"
    large_steps: int = 1
    cache_threshold: Optional[float] = None
    drop_threshold: Optional[float] = None
    seed: int = 0
    max_blocks: Optional[int] = None  # None: the surface's limit


@dataclass(frozen=True)
class CheckedStream:
    """A `StreamRequest` that passed every check (`check_stream`): the checked video settings
    (`CheckedVideo`; its `num_frames` unused) and the blocks it may make."""

    video: CheckedVideo
    max_blocks: int


@dataclass(frozen=True)
class LiveBlock:
    """One committed block of a live stream: its `index`, its video frames `start` … `start + T − 1`
    (`frames` [T, H, W, 3] uint8), the prompt it followed and `seconds` since the stream opened."""

    index: int
    start: int
    frames: np.ndarray
    prompt: str
    seconds: float


def check_stream(request: StreamRequest, catalog: VideoCatalog, max_blocks: int = DEFAULT_STREAM_BLOCKS) -> CheckedStream:
    """Every check of a live stream's request (ValueError with a one-line message), before any
    work: the video settings as `check_request` checks them, a rolling cache policy within the
    model's rotary table, and at most `max_blocks` blocks (the surface's limit)."""
    from mmgen.video.model import check_rotary_table

    pipe = catalog.main_pipeline(request.model)
    policy = request.cache_policy
    if policy is None:
        policy = str(pipe.default_stream_policy(pipe.block_frames))
    checked = check_request(VideoRequest(request.model, request.prompt, cache_policy=policy, method=request.method,
                                         large_steps=request.large_steps, cache_threshold=request.cache_threshold,
                                         drop_threshold=request.drop_threshold, seed=request.seed), catalog, MAX_FRAMES)
    rolling = pipe.stream_policy(checked.cache_policy, pipe.block_frames)  # global and none grow with the stream
    held = rolling.sink + rolling.window + pipe.block_frames
    check_rotary_table(pipe.transformer.config, held, held, str(rolling), "use a smaller window")
    limit = max(1, min(int(max_blocks), MAX_STREAM_BLOCKS))
    blocks = integer("max_blocks", limit if request.max_blocks is None else request.max_blocks, 1, limit)
    return CheckedStream(checked, blocks)


class LiveVideo:
    """A checked live stream, running: it holds its models' locks from `open` to `close`, so a
    video request of the same model waits for it (the pipeline makes nothing else while one of
    its streams is open). `next()` makes one block (None once `max_blocks` are made or the
    stream is closed); `set_prompt` (any thread) steers the next block not yet started; `close`
    (any thread, any number of times) waits for a running block, frees the stream's caches and
    then the models. Shared by `mmgen serve`'s `/v1/videos/stream` and the demo's live player."""

    def __init__(self, checked: CheckedStream, catalog: VideoCatalog):
        self.checked, self.catalog = checked, catalog
        video = checked.video
        self.pipe, self.prompt, self.max_blocks = video.pipe, video.prompt, checked.max_blocks
        self.blocks = 0
        self._closing = threading.Lock()
        self._models = ExitStack()
        self._models.enter_context(catalog.using([video.request.model, *filter(None, [video.small])]))
        try:
            from mmgen.loading import decoder_from_spec

            options = dict(video.options)
            if video.small is not None:
                options["small"] = catalog.pipeline(video.small)
            decoder = decoder_from_spec(video.request.method, self.pipe, catalog.main[video.request.model], catalog.device,
                                        **options)
            self.stream = self.pipe.stream(video.prompt, decoding=decoder, cache_policy=video.cache_policy,
                                           generator=make_generator(video.seed, catalog.device), **video.thresholds)
        except BaseException:
            self._models.close()
            raise
        self.started = time.perf_counter()

    @classmethod
    def open(cls, request: StreamRequest, catalog: VideoCatalog, max_blocks: int = DEFAULT_STREAM_BLOCKS) -> "LiveVideo":
        """Check `request` (ValueError, before any work) and open its stream (waits for the models)."""
        return cls(check_stream(request, catalog, max_blocks), catalog)

    @property
    def closed(self) -> bool:
        return self.stream.closed

    @property
    def fps(self) -> float:
        return float(self.pipe.fps)

    def next(self) -> Optional[LiveBlock]:
        """The next committed block, or None when the stream has made its `max_blocks` or was closed."""
        if self.blocks >= self.max_blocks:
            return None
        block = next(self.stream, None)
        if block is None:
            return None
        self.blocks = block.index + 1
        return LiveBlock(block.index, block.first_frame, block.frames[0].numpy(), block.prompts[0],
                         time.perf_counter() - self.started)

    def set_prompt(self, prompt: Any) -> str:
        """Follow `prompt` from the next block not yet started (checked as the first prompt is:
        ValueError, and the stream runs on with its prompt); returns the prompt as taken."""
        text = self.checked_prompt(prompt)
        self.stream.set_prompt(text)
        return text

    @staticmethod
    def checked_prompt(prompt: Any) -> str:
        """A new prompt, checked as a request's is (ValueError)."""
        return checked_text("the prompt", prompt, MAX_PROMPT_CHARS, empty="type a prompt (the prompt is empty)")

    def close(self) -> None:
        with self._closing:
            self.stream.close()
            self._models.close()  # once: an ExitStack closed again does nothing
