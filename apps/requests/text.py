"""Vision-language requests (the "text" modality): check a chat turn's inputs (text, images,
videos), answer the conversation so far with the chosen decoding method and token dropping (and,
in compare mode, with plain autoregressive decoding and no dropping on the same seed first),
streaming each answer as its tokens commit.
Shared by the VLM demo and `mmgen serve`'s `/v1/chat/completions`; importing it needs no gradio.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from mmgen import registry
from mmgen.decoding import DecodeStats
from mmgen.sampling import make_generator
from mmgen.vlm.cli import read_image
from mmgen.vlm.videos import as_video, read_video, video_family_check

from .bounds import LIMITS, MAX_SEED, MAX_TEMPERATURE, check_pixels, checked_text, integer, items, number, shown
from .catalog import COMPANION_SUFFIXES, Catalog, folder_field, model_folder
from .runs import BASELINE_LABEL, PerUnit, Result, finish, relay
from .service import ModalityService, family_call, register_service

#: The bundled model the demo serves when given none (its drafter `emoji-vlm-draft` comes along).
DEFAULT_MODEL = "emoji-vlm"
MAX_NEW_TOKENS = LIMITS.new_tokens  # hard cap of an answer's length, whatever --max-new-tokens says
MAX_IMAGES = 8  # hard cap of a conversation's images, whatever --max-images says
MAX_IMAGE_PIXELS = LIMITS.image_pixels  # an upload larger than this is refused before it is decoded
MAX_VIDEOS = LIMITS.videos  # hard cap of a conversation's videos
MAX_VIDEO_BYTES = LIMITS.upload_bytes  # a video file larger than this is refused before it is read
MAX_VIDEO_FRAMES = LIMITS.video_frames  # a video's frames and pixels: past either, its decoding stops with a refusal
MAX_VIDEO_PIXELS = LIMITS.video_pixels
MAX_MESSAGE_CHARS = LIMITS.text_chars
MAX_TURNS = LIMITS.turns  # user turns in one conversation
NO_DROPPING = "none"


class VLMCatalog(Catalog):
    """The vision-language models a surface offers (`Catalog`): main models and their drafter
    companions (names ending in -draft)."""

    modality = "text"

    @classmethod
    def discover(cls, models: Optional[Sequence[str]] = None, device: str = "cpu") -> "VLMCatalog":
        """The given bundled names and folders (default: the bundled `emoji-vlm`); a bundled
        main model brings its bundled drafter along."""
        bundled = registry.bundled_models()
        entries = [_checked_entry(str(entry), bundled) for entry in (models or [DEFAULT_MODEL])]
        for entry in list(entries):
            for suffix in COMPANION_SUFFIXES:
                if entry + suffix in bundled and _is_model_folder(bundled[entry + suffix]):
                    entries.append(entry + suffix)
        return cls.from_entries(entries, bundled, device)

    def load(self, source: str) -> Any:
        import mmgen

        pipe = mmgen.load_pipeline(source, device=self.device)
        if getattr(pipe, "conditions", None) != "prompt" or not hasattr(pipe, "processor"):
            raise ValueError(f"{source} holds a {type(pipe).__name__}; the VLM demo serves vision-language models")
        return pipe


def _is_model_folder(folder: Path) -> bool:
    return model_folder(folder) or model_folder(folder, "model_index.json")


def _is_vlm_folder(folder: Path) -> bool:
    return registry.family("text", folder_field(folder, "config.json", "model_type")) is not None


def _checked_entry(entry: str, bundled: dict) -> str:
    """A bundled name present in this installation, or the folder of a registered
    vision-language family (`mmgen.registry.families("text")`; no Hub ids: the demo never downloads)."""
    if entry in bundled or entry == DEFAULT_MODEL:
        if entry not in bundled or not _is_model_folder(bundled[entry]):
            raise ValueError(f"the bundled model {entry!r} is missing from this installation; pass --model FOLDER")
        if not _is_vlm_folder(bundled[entry]):
            raise ValueError(f"the bundled model {entry!r} is not a vision-language model")
        return entry
    if not model_folder(Path(entry)):
        raise ValueError(f"--model {entry!r} is neither a bundled model nor a folder with a config.json "
                         "(a transformers image-text-to-text model)")
    if not _is_vlm_folder(Path(entry)):
        raise ValueError(f"--model {entry!r} is not a vision-language model: its config.json's model_type is not one of "
                         f"{list(registry.families('text'))}")
    return entry


# --------------------------------------------------------------------------------------------
# What the UI offers for a model
# --------------------------------------------------------------------------------------------


def dropping_policies() -> list[str]:
    """The token-dropping policies the UI offers (`mmgen.vlm.dropping`)."""
    from mmgen.vlm.dropping import DROPPING_POLICIES  # imports diffusers' hooks: not when the CLI parser is built

    return list(DROPPING_POLICIES)


# --------------------------------------------------------------------------------------------
# Requests and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    """One press of Send: the new user turn, the conversation before it, and the settings.

    `history` is transformers' chat format ([{"role": "user", "content": [{"type": "image"},
    {"type": "video"}, {"type": "text", "text": ...}]}, {"role": "assistant", "content": [...]},
    ...]) and `history_images` / `history_videos` the images and videos of its placeholders, in
    order. A video is a file's path (an upload), a file's bytes (a data: URL's) or what the
    pipeline takes (a [T, H, W, 3] uint8 array, a list of frames); only the families that take
    video (a registered "video" capability: `mmgen.vlm.videos.video_families`) accept one."""

    model: str
    message: str
    images: Sequence[Any] = ()  # this turn's images: PIL images or file paths
    history: Sequence[dict] = ()
    history_images: Sequence[Any] = ()
    videos: Sequence[Any] = ()  # this turn's videos (after its images)
    history_videos: Sequence[Any] = ()
    method: str = "ar"
    dropping: str = NO_DROPPING
    keep_ratio: float = 0.25
    temperature: float = 0.0
    seed: int = 0
    max_new_tokens: Optional[int] = 64  # None: the cap, or what the model's context leaves after the prompt
    compare: bool = False  # also answer with plain AR and no dropping, same seed
    family_options: dict = field(default_factory=dict)  # its family's own options (`registry.family_options`)


@dataclass
class ChatRun(PerUnit):
    """One decoding of the request: its label ("sjd · fastv 0.25", "ar (baseline)"), answer and
    stats, and the visual tokens the model kept (None: the pipeline reported none, no dropping)."""

    label: str
    text: str
    tokens: int  # the answer's tokens, its stop token included
    stats: DecodeStats
    tokens_kept: Optional[str] = None

    @property
    def units(self) -> int:
        return self.tokens

    @property
    def seconds(self) -> float:
        return self.stats.wall_time_s



@dataclass
class ChatResult(Result):
    """The runs of one request (the baseline first in compare mode), and the conversation with
    the new user turn and the method's answer appended, for the next turn."""

    runs: list[ChatRun]
    history: list[dict] = field(default_factory=list)
    history_images: list = field(default_factory=list)
    history_videos: list = field(default_factory=list)  # [T, H, W, 3] uint8 arrays, as read
    unit = "token"

    def stats_rows(self) -> list[dict[str, Any]]:
        """One row per run: forwards (the prefill included), answer tokens, tokens per forward,
        wall time, time per token (and in compare mode the speedup per token over the
        baseline: answers of different lengths compare fairly), visual tokens kept."""
        return [{"run": r.label, "forwards": r.stats.forwards, "tokens": r.tokens,
                 "tokens/forward": round(r.tokens / r.stats.forwards, 2) if r.stats.forwards else 0.0,
                 "time (s)": round(r.seconds, 3), **self.speed_columns(r), "tokens kept": r.tokens_kept or "all"}
                for r in self.runs]


@dataclass(frozen=True)
class AnswerUpdate:
    """A streamed update: run `index` of the request (0 is the baseline in compare mode) has
    answered `text` so far."""

    index: int
    label: str
    text: str


@dataclass(frozen=True)
class CheckedChat:
    """A chat request whose every input passed its checks (`check_request`): the conversation,
    its images and videos (read) and the runs to make. Making one loads the model's pipeline if
    needed, and runs nothing."""

    request: ChatRequest
    pipe: Any
    conversation: list
    images: list
    videos: list  # [T, H, W, 3] uint8 arrays, the conversation's in order
    prompt: Any  # what the pipeline takes: the message alone for a first turn, else the conversation
    token_limit: int  # the shared batch's token budget (the server's or the layer's cap)
    budget: int
    seed: int
    temperature: float
    plan: tuple  # (label, method, dropping policy) of each run, the baseline first in compare mode
    family: dict  # the family's own options, as call keywords (`family_call`)


def check_request(request: ChatRequest, catalog: VLMCatalog, max_images: int = 4,
                  max_new_tokens: int = MAX_NEW_TOKENS) -> CheckedChat:
    """Every check of `request` (ValueError with a one-line message), before any decoding: the
    server calls it before the request waits for its model."""
    pipe = catalog.main_pipeline(request.model)
    message = checked_text("the message", request.message, MAX_MESSAGE_CHARS, empty="type a question (the message is empty)")
    cap = max(1, min(int(max_new_tokens), MAX_NEW_TOKENS))
    budget = None if request.max_new_tokens is None else integer("max new tokens", request.max_new_tokens, 1, cap)
    seed = integer("seed", request.seed, 0, MAX_SEED)
    temperature = number("temperature", request.temperature, 0.0, MAX_TEMPERATURE)
    family = family_call("text", pipe, request.family_options)
    offered = catalog.methods(request.model)
    if not isinstance(request.method, str) or request.method not in offered:
        raise ValueError(f"unknown decoding method {shown(request.method)} for this model; choose one of {offered}")
    dropping = _dropping(request.dropping, request.keep_ratio)
    history, history_images, history_videos = _history(request.history, request.history_images, request.history_videos)
    images = [_image(image) for image in items("images", request.images)]
    limit = max(1, min(int(max_images), MAX_IMAGES))
    if len(history_images) + len(images) > limit:
        raise ValueError(f"at most {limit} images per conversation, got {len(history_images) + len(images)}: "
                         "clear the chat to start again")
    if sum(m["role"] == "user" for m in history) >= MAX_TURNS:
        raise ValueError(f"at most {MAX_TURNS} turns per conversation: clear the chat to start again")
    new_videos = items("videos", request.videos)
    videos = _videos(pipe, [*history_videos, *new_videos])
    turn = {"role": "user", "content": [*({"type": "image"} for _ in images), *({"type": "video"} for _ in new_videos),
                                        {"type": "text", "text": message}]}
    conversation = [*history, turn]
    # One turn goes in as text (what every VLMPipeline takes), a longer chat as the conversation.
    prompt = [conversation] if history else message
    images = [*history_images, *images]
    if budget is None:
        budget = _fitting_budget(pipe, prompt, images, videos, cap)
    label = request.method + (f" · {dropping}" if dropping else "")
    plan = ((BASELINE_LABEL, "ar", None),) if request.compare else ()
    return CheckedChat(request, pipe, conversation, images, videos, prompt, cap, budget, seed,
                       temperature, plan + ((label, request.method, dropping),), family)


def _fitting_budget(pipe: Any, prompt: Any, images: list, videos: list, cap: int) -> int:
    """The default answer budget: `cap`, less where the model's context leaves fewer tokens after
    the prompt (a default must fit the model); ValueError when it leaves none."""
    context = getattr(pipe, "context_length", None)
    if context is None:
        return cap
    inputs = pipe.prepare_inputs(prompt, images or None, videos or None)
    mask = inputs.get("attention_mask")
    length = int(mask.sum()) if mask is not None else int(inputs["input_ids"].shape[-1])
    if length >= context:
        raise ValueError(f"the prompt is {length} tokens, the whole of the model's context of {context}: "
                         "shorten it or send fewer or smaller images")
    return min(cap, context - length)


def run_request(request: ChatRequest, catalog: VLMCatalog, max_images: int = 4,
                max_new_tokens: int = MAX_NEW_TOKENS) -> ChatResult:
    """Check `request` (ValueError with a one-line message), answer it and return the runs."""
    return finish(stream_request(request, catalog, max_images, max_new_tokens))


def stream_request(request: ChatRequest, catalog: VLMCatalog, max_images: int = 4,
                   max_new_tokens: int = MAX_NEW_TOKENS) -> Iterator[AnswerUpdate]:
    """`run_request`, yielding each run's answer so far as tokens commit; returns the
    `ChatResult` (the generator's return value). Every input is checked before any decoding."""
    return (yield from stream_checked(check_request(request, catalog, max_images, max_new_tokens), catalog))


def stream_checked(checked: CheckedChat, catalog: VLMCatalog) -> Iterator[AnswerUpdate]:
    """`stream_request` of a request `check_request` passed."""
    request, pipe, plan = checked.request, checked.pipe, list(checked.plan)
    runs = []
    # Compare mode times its two runs and dropping prunes each prefill, so neither shares a batch, nor
    # does a call with its family's own options.
    shared = None if request.compare or plan[-1][2] or checked.family else catalog.server(
        request.model, request.method, catalog.decoder(request.method, request.model), max_new_tokens=checked.token_limit,
        temperature=checked.temperature)
    if shared is not None:  # outside the model's lock, which the shared batch takes while it decodes
        run_label = f"{plan[-1][0]} (continuous batch)"
        stream = shared.stream(checked.prompt, checked.images or None, make_generator(checked.seed, catalog.device),
                               checked.budget, videos=checked.videos or None)
        text, tokens, stats = yield from relay(stream, _answer_so_far(0, run_label))
        runs.append(ChatRun(run_label, text, len(tokens), stats))
        plan = []
    with catalog.using([request.model, *filter(None, [catalog.companion_of(request.model, "-draft")])] if plan else []):
        for index, (run_label, method, policy) in enumerate(plan):
            call = dict(max_new_tokens=checked.budget, decoding=catalog.decoder(method, request.model),
                        temperature=checked.temperature, generator=make_generator(checked.seed, catalog.device),
                        **checked.family)
            if policy is not None:
                call["dropping"] = policy
            stream = pipe.stream(checked.prompt, checked.images or None, videos=checked.videos or None, **call)
            answer = yield from relay(stream, _answer_so_far(index, run_label, lambda item: item[1]))
            runs.append(ChatRun(run_label, answer.texts[0], int(answer.lengths[0]), answer.stats, _tokens_kept(answer)))
    reply = {"role": "assistant", "content": [{"type": "text", "text": runs[-1].text}]}
    return ChatResult(runs, [*checked.conversation, reply], checked.images, checked.videos)


class ChatService(ModalityService):
    """The text modality's request layer (`mmgen.apps.requests.service`): vision-language chat,
    each answer streamed as its tokens commit (`AnswerUpdate`)."""

    noun, unit = "vision-language", ChatResult.unit
    catalog, request = VLMCatalog, ChatRequest
    check, stream = staticmethod(check_request), staticmethod(stream_checked)


SERVICE = register_service(ChatService())


def _answer_so_far(index: int, label: str, piece_of: Any = lambda item: item):
    """A `relay` progress function: each streamed piece (`piece_of(item)`) appended to the answer."""
    pieces: list[str] = []

    def progress(item: Any) -> AnswerUpdate:
        pieces.append(piece_of(item))
        return AnswerUpdate(index, label, "".join(pieces))

    return progress


def _tokens_kept(output: Any) -> Optional[str]:
    """"kept/total" visual tokens from the pipeline's `DroppingReport` (None without dropping)."""
    report = getattr(output, "dropping", None)
    return None if report is None else f"{sum(report.kept_tokens)}/{sum(report.image_tokens)}"


def _image(image: Any) -> Any:
    """An RGB PIL image from a PIL image or a file path; bounded in pixels before decoding."""
    from PIL import Image

    if isinstance(image, (str, Path)):  # an upload's temporary path: only its name is shown
        return read_image(image, Path(image).name, MAX_IMAGE_PIXELS)
    if isinstance(image, Image.Image):
        check_pixels(image.size)
        return image.convert("RGB")
    raise ValueError(f"an image must be an image file or a PIL image, got {shown(image)}")


def _videos(pipe: Any, videos: list) -> list:
    """A conversation's videos read (`_video`), after their count and the model's family (one
    line naming its model_type when it takes none) are checked: before any is decoded."""
    if not videos:
        return []
    if len(videos) > MAX_VIDEOS:
        raise ValueError(f"at most {MAX_VIDEOS} videos per conversation, got {len(videos)}: clear the chat to start again")
    video_family_check(getattr(getattr(getattr(pipe, "model", None), "config", None), "model_type", None))
    return [_video(video, f"video {k + 1} of the conversation") for k, video in enumerate(videos)]


def _video(video: Any, label: str) -> Any:
    """A [T, H, W, 3] uint8 array through the pipeline's own video checks (`mmgen.vlm.videos`),
    bounded in frames and pixels while it decodes. A file (an upload's path: named by its file
    name, never its server-side path) or a file's bytes (a data: URL's, read from a private
    temporary file removed after) is bounded in bytes before it is read."""
    if isinstance(video, (str, os.PathLike)):
        path = Path(video)
        if not path.is_file():  # not a regular file: a device, a folder or nothing
            raise ValueError(f"{path.name}: not a video file")
        if path.stat().st_size > MAX_VIDEO_BYTES:
            raise ValueError(f"{path.name} is {path.stat().st_size} bytes; a video may have at most {MAX_VIDEO_BYTES}")
        return read_video(path, path.name, MAX_VIDEO_FRAMES, MAX_VIDEO_PIXELS)
    if isinstance(video, (bytes, bytearray)):
        if len(video) > MAX_VIDEO_BYTES:
            raise ValueError(f"{label} is over {MAX_VIDEO_BYTES} bytes; at most {MAX_VIDEO_BYTES} are accepted")
        descriptor, name = tempfile.mkstemp(prefix="mmgen-video-")  # readable by this user only
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(video)
            return read_video(name, label, MAX_VIDEO_FRAMES, MAX_VIDEO_PIXELS)
        finally:
            os.unlink(name)
    return as_video(video, label, MAX_VIDEO_FRAMES, MAX_VIDEO_PIXELS)


def _history(history: Any, images: Any, videos: Any = ()) -> tuple[list[dict], list, list]:
    """The earlier turns, checked: alternating user/assistant messages of text and image and
    video placeholders, as many images and videos as placeholders (the videos not read yet)."""
    messages, pictures, clips = items("history", history), items("history images", images), items("history videos", videos)
    placeholders = {"image": 0, "video": 0}
    for i, message in enumerate(messages):
        role = "user" if i % 2 == 0 else "assistant"
        if not isinstance(message, dict) or message.get("role") != role or not isinstance(message.get("content"), list):
            raise ValueError(f"history message {i} must be a {role} message in transformers' chat format")
        for part in message["content"]:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in placeholders and role == "user" and set(part) == {"type"}:  # bare: no path or URL rides along
                placeholders[kind] += 1
            elif kind != "text" or not isinstance(part.get("text"), str) or len(part["text"]) > MAX_MESSAGE_CHARS * 2:
                raise ValueError(f"history message {i} has an unexpected part {shown(part)}")
    if len(messages) % 2:
        raise ValueError("the history must end with an assistant message")
    if placeholders["image"] != len(pictures):
        raise ValueError(f"the history has {placeholders['image']} image placeholders but {len(pictures)} images")
    if placeholders["video"] != len(clips):
        raise ValueError(f"the history has {placeholders['video']} video placeholders but {len(clips)} videos")
    return messages, [_image(image) for image in pictures], clips


def _dropping(policy: Any, keep_ratio: Any) -> Optional[str]:
    """The dropping spec ("fastv:keep_ratio=0.25") of the chosen policy, or None."""
    if policy in (None, "", NO_DROPPING):
        return None
    offered = dropping_policies()
    if not isinstance(policy, str) or policy not in offered:
        raise ValueError(f"unknown token dropping {shown(policy)}; choose one of {[NO_DROPPING, *offered]}")
    ratio = number("keep ratio", keep_ratio, 0.0, 1.0, low_open=True)
    return f"{policy}:keep_ratio={ratio:g}"
