"""`mmgen serve`: every modality's models behind OpenAI-compatible HTTP routes (FastAPI + uvicorn),
on the same request layer as the Gradio demos (`mmgen.apps.requests`).

    POST /v1/images/generations   class-conditional images (prompt = a class name), b64_json
    POST /v1/chat/completions     vision-language chat; image_url and video_url parts as data: URLs; SSE streaming
    POST /v1/audio/speech         speech, streamed as its frames decode (wav or raw pcm16)
    POST /v1/videos               a video job; GET /v1/videos/{id} its status, .../content the MP4,
                                  .../events its blocks as they commit (server-sent events)
    GET  /v1/models, /health, /metrics (Prometheus)

Every request is checked by the request layer (its modality's `check_request`) before it waits
for or takes a model, so bad input is one JSON error in OpenAI's shape (`{"error": {"message",
"type", "param", "code"}}`) with a 4xx status and never a traceback; an unexpected failure is logged here and
answered with a generic 500. Requests queue per model in a bounded waiting room: a model takes as
many requests at once as its catalogue's continuous batch has rows (one without), and a request
that would wait when `max_queue` requests already wait is refused with 429 and `Retry-After`.
Model work runs in worker threads, so a long decode never holds up `/health`. A streamed
response whose client goes away closes its request's stream, which stops the run at its next
output and frees the model (`mmgen.apps.requests.runs`).

The server listens on 127.0.0.1 unless told otherwise, never fetches a URL a client sends, bounds
request bodies by their Content-Length before reading them, and, given an API key, requires it as
`Authorization: Bearer KEY` on every route but `/health`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import io
import json
import logging
import math
import re
import secrets
import struct
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Sequence, Union

import anyio
import anyio.to_thread
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmgen.apps.job_board import JobBoard
from mmgen.apps.metrics import CONTENT_TYPE, ServerMetrics
from mmgen.apps.requests import image, speech, video, vlm
from mmgen.apps.requests.bounds import LIMITS, MAX_SEED, shown
from mmgen.apps.serve_cli import BATCHED

log = logging.getLogger("mmgen.serve")

#: The modalities in the order `/v1/models` lists them, and a --model entry is tried in: image
#: and speech catalogues recognise their folders exactly, the text one (vision-language models)
#: takes any model folder. These names key the catalogues, `/v1/models`' "modality" and the
#: metrics' `modality` label.
MODALITIES = ("image", "speech", "video", "text")
NOUNS = {"image": "image", "text": "vision-language", "speech": "speech", "video": "video"}
ROUTES = {"image": "/v1/images/generations", "text": "/v1/chat/completions", "speech": "/v1/audio/speech",
          "video": "/v1/videos"}
MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 64
MAX_MESSAGES = 2 * LIMITS.turns
#: Extra worker threads beyond one per model slot: request checks and response assembly.
SPARE_THREADS = 16
WAV_UNKNOWN_SIZE = 0xFFFFFFFF  # a streamed WAV's RIFF and data sizes: not known until it ends
EVENT_POLL_S = 0.05  # how often a video job's event stream looks for a newly committed block


def catalog_classes() -> dict[str, Any]:
    """Each modality's catalogue class, in the order a --model entry is tried."""
    classes = {"image": image.ImageCatalog, "speech": speech.SpeechCatalog, "video": video.VideoCatalog,
               "text": vlm.VLMCatalog}
    return {modality: classes[modality] for modality in MODALITIES}


def discover_catalogs(models: Optional[Sequence[str]] = None, device: str = "cpu",
                      continuous_batch: Optional[Mapping[str, int]] = None) -> dict[str, Any]:
    """The catalogues a server offers: each modality's bundled models present in this installation
    (default), or the given bundled names and folders, each assigned to the first modality whose
    catalogue takes it. `continuous_batch` gives a modality's shared batch rows (0: off; the old
    key "vlm" is "text", with a DeprecationWarning)."""
    from mmgen import registry

    classes = catalog_classes()
    batch_rows: dict[str, int] = {}
    for modality, rows in (continuous_batch or {}).items():
        batch_rows[registry.modality_name(modality)] = rows
    catalogs: dict[str, Any] = {}
    if not models:
        for modality, cls in classes.items():
            try:
                catalogs[modality] = cls.discover(device=device)
            except ValueError:  # this modality's bundled models are missing from the installation
                continue
    else:
        groups: dict[str, list[str]] = {}
        for entry in models:
            groups.setdefault(_modality_of(str(entry), classes), []).append(str(entry))
        catalogs = {m: classes[m].discover(groups[m], device=device) for m in classes if m in groups}
    if not catalogs:
        raise ValueError("no models to serve: the bundled models are missing from this installation; pass --model FOLDER")
    seen: dict[str, str] = {}
    for modality, catalog in catalogs.items():
        for name in catalog.main:
            if name in seen:
                raise ValueError(f"two models go by the name {name!r} ({seen[name]} and {modality}): requests name a "
                                 "model by its folder's name, so rename one folder")
            seen[name] = modality
        rows = batch_rows.get(modality, 0)
        catalog.continuous_batch = rows if modality in BATCHED else 0
    return catalogs


def _modality_of(entry: str, classes: Mapping[str, Any]) -> str:
    for modality, cls in classes.items():
        try:
            cls.discover([entry])  # finds and checks the entry's files; loads nothing
        except ValueError:
            continue
        return modality
    from mmgen import registry

    raise ValueError(f"--model {entry!r} is neither a bundled model ({', '.join(registry.bundled_models())}) nor a "
                     "model folder of a modality mmgen serves (image, vision-language, speech or video)")


def preload(catalogs: Mapping[str, Any]) -> None:
    """Load every model of the catalogues now (main models and companions), so that the first
    requests do not wait for a load and a model that cannot load fails before the server listens."""
    for catalog in catalogs.values():
        for name in catalog.names:
            catalog.pipeline(name)


@dataclass(frozen=True)
class ServerSettings:
    """What one server allows, besides its models. The request layer's own limits (`LIMITS`) bound
    every value further; a server may only lower them."""

    api_key: Optional[str] = None
    max_queue: int = 64  # requests waiting for a model, at most; beyond them: 429
    max_body_bytes: int = 32 * 1024 * 1024
    max_images: int = 4  # images a request makes, or a conversation reads
    max_new_tokens: int = 256  # an answer's tokens; the default budget
    max_new_frames: int = speech.DEFAULT_MAX_NEW_FRAMES  # an utterance's frames (a model's context bounds it too)
    max_frames: int = video.DEFAULT_MAX_FRAMES  # a video's frames
    max_finished_jobs: int = 64  # finished video jobs kept (with their MP4) for clients to fetch


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class ApiError(Exception):
    """A refusal in OpenAI's error shape: status, one-line message, type, param and code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type, param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: pydantic's names of a union's members in an error's location ("str", "list[str]"): not fields.
UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|(list|dict|nullable|union|function-\w+)\[.*\])$")
#: What a value must be, by pydantic's error type, for a union's message ("text or a list").
KINDS = {"string_type": "text", "int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
         "list_type": "a list", "dict_type": "an object", "none_required": "null"}


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, Optional[str]]:
    """One line for pydantic's errors and the field it names: the first field's (its deepest
    location; a union's members merged: "stop must be text or a list"), and how many other
    fields are wrong."""
    groups: dict[tuple, list] = {}
    for error in errors:
        loc = tuple(str(p) for p in error.get("loc", ()) if p != "body" and not UNION_MEMBER.match(str(p)))
        groups.setdefault(loc, []).append(error)
    top = next(iter(groups))[:1]
    loc = max((g for g in groups if g[:1] == top), key=len)
    found, where = groups[loc], ".".join(loc) or None
    first, kind = found[0], found[0].get("type", "")
    if kind == "json_invalid":
        message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'cannot parse it')})"
        where = None
    elif kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        message = "the request body must be a JSON object"
    elif kind == "missing":
        message = f"{where} is required"
    elif kind == "extra_forbidden":
        message = f"unknown field {where!r}: this server does not take it"
    elif len(found) > 1 and all(e.get("type") in KINDS for e in found):
        message = f"{where} must be " + " or ".join(dict.fromkeys(KINDS[e["type"]] for e in found))
    else:
        message = f"{where}: {first.get('msg', 'invalid value')}" if where else str(first.get("msg", "invalid value"))
    others = len({g[:1] for g in groups}) - 1
    if others:
        message += f" (and {others} more field{'s' if others > 1 else ''})"
    return one_line(message), where


# --------------------------------------------------------------------------------------------
# Request bodies (strict types: "2" is not a number; unknown fields are refused, not ignored)
# --------------------------------------------------------------------------------------------

Scalar = Union[bool, int, float, str, None]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageBody(Body):
    prompt: Optional[str] = Field(None, max_length=LIMITS.text_chars)  # a class name
    model: Optional[str] = Field(None, max_length=256)
    n: int = 1
    size: Optional[str] = Field(None, max_length=32)
    response_format: Optional[str] = Field(None, max_length=32)
    output_format: Optional[str] = Field(None, max_length=32)
    user: Optional[str] = Field(None, max_length=256)
    # mmgen's fields
    class_label: Optional[Union[int, str]] = None
    seed: Optional[int] = None
    decoding: Optional[str] = Field(None, max_length=256)
    decoding_options: Optional[Union[str, dict[str, Scalar]]] = None
    guidance_scale: Optional[float] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    num_steps: Optional[int] = None


class StreamOptions(Body):
    include_usage: bool = False


class ChatBody(Body):
    model: Optional[str] = Field(None, max_length=256)
    messages: list[dict[str, Any]] = Field(max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = None
    user: Optional[str] = Field(None, max_length=256)
    decoding: Optional[str] = Field(None, max_length=64)  # mmgen's


class SpeechBody(Body):
    input: str = Field(max_length=LIMITS.text_chars)
    model: Optional[str] = Field(None, max_length=256)
    voice: Optional[str] = Field(None, max_length=64)
    response_format: Optional[str] = Field(None, max_length=32)
    speed: Optional[float] = None
    stream_format: Optional[str] = Field(None, max_length=32)
    # mmgen's fields
    voice_audio: Optional[str] = None  # a voice prompt: an audio file, base64
    voice_text: Optional[str] = Field(None, max_length=LIMITS.text_chars)
    decoding: Optional[str] = Field(None, max_length=64)
    seed: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    max_new_frames: Optional[int] = None


class VideoBody(Body):
    prompt: str = Field(max_length=LIMITS.text_chars)
    model: Optional[str] = Field(None, max_length=256)
    seconds: Optional[Union[int, float, str]] = None
    size: Optional[str] = Field(None, max_length=32)
    # mmgen's fields
    num_frames: Optional[int] = None
    seed: Optional[int] = None
    decoding: Optional[str] = Field(None, max_length=64)
    large_steps: Optional[int] = None
    cache_policy: Optional[str] = Field(None, max_length=64)
    cache_threshold: Optional[float] = None
    drop_threshold: Optional[float] = None


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The request's JSON body as `model` (a 400 naming the first bad field otherwise). The
    body's size is bounded by `Guard` while it is read."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        message, where = validation_message(error.errors(include_url=False, include_input=False))
        raise ApiError(400, message, param=where) from None


async def parse_form_or_json(request: Request, model: type[BaseModel]) -> Any:
    """A JSON body, or a multipart / urlencoded form (what OpenAI's client sends to /v1/videos):
    its fields are text, so numbers are read from their text; files are refused."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        return await parse_body(request, model)
    try:
        form = await request.form(max_files=1, max_fields=64)
    except ApiError:
        raise
    except Exception as error:  # a malformed multipart body
        raise ApiError(400, f"the request body is not a readable form ({type(error).__name__})") from None
    fields: dict[str, Any] = {}
    try:
        for key, value in form.multi_items():
            if not isinstance(value, str):
                raise ApiError(400, f"{key}: files are not taken here (this server makes videos from text only)", param=key)
            if key in fields:
                raise ApiError(400, f"{key} is given twice", param=key)
            fields[key] = value
    finally:
        await form.close()
    try:
        return model.model_validate(fields, strict=False)
    except ValidationError as error:
        message, where = validation_message(error.errors(include_url=False, include_input=False))
        raise ApiError(400, message, param=where) from None


# --------------------------------------------------------------------------------------------
# Admission: a bounded waiting room and a few slots per model
# --------------------------------------------------------------------------------------------


class Lane:
    """One model's slots: as many requests at once as its continuous batch has rows (1 without)."""

    def __init__(self, slots: int):
        self.slots, self.admitted = slots, 0
        self.semaphore: Optional[asyncio.Semaphore] = None

    def gate(self) -> asyncio.Semaphore:
        if self.semaphore is None:  # made on the server's event loop
            self.semaphore = asyncio.Semaphore(self.slots)
        return self.semaphore


class Admission:
    """Requests admitted to the models: those that find their model's slots taken wait, at most
    `max_queue` of them over the whole server; one more is refused (429, `Retry-After`)."""

    def __init__(self, max_queue: int, metrics: ServerMetrics, slots: Mapping[str, int]):
        self.max_queue, self.metrics, self.slots = max_queue, metrics, dict(slots)
        self.lanes: dict[tuple[str, str], Lane] = {}
        self.queued = 0

    def admit(self, modality: str, model: str, rows: int = 1) -> "Ticket":
        lane = self.lanes.setdefault((modality, model), Lane(self.slots.get(modality, 1)))
        waits = lane.admitted >= lane.slots
        if waits and self.queued >= self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            retry = max(1, math.ceil(self.metrics.typical_latency(modality) * (1 + lane.admitted / lane.slots)))
            raise ApiError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry in {retry} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
        return Ticket(self, lane, modality, rows, waits)


class Ticket:
    """One request's place: waiting (counted in the queue) until `start`, then running (its rows
    counted) until `done`. `done` is idempotent and right in every state."""

    def __init__(self, admission: Admission, lane: Lane, modality: str, rows: int, waits: bool):
        self.admission, self.lane, self.modality, self.rows, self.waits = admission, lane, modality, rows, waits
        self.state = "waiting"
        lane.admitted += 1
        if waits:
            admission.queued += 1
            admission.metrics.queue_depth.labels(modality).inc()

    def _leave_queue(self) -> None:
        if self.waits:
            self.waits = False
            self.admission.queued -= 1
            self.admission.metrics.queue_depth.labels(self.modality).dec()

    async def start(self) -> None:
        """Wait for a slot of the model."""
        await self.lane.gate().acquire()
        self._leave_queue()
        self.state = "running"
        self.admission.metrics.rows_running.labels(self.modality).inc(self.rows)

    def done(self) -> None:
        if self.state == "done":
            return
        if self.state == "running":
            self.lane.gate().release()
            self.admission.metrics.rows_running.labels(self.modality).dec(self.rows)
        self._leave_queue()
        self.lane.admitted -= 1
        self.state = "done"


# --------------------------------------------------------------------------------------------
# The request layer, checked without running and stepped in threads
# --------------------------------------------------------------------------------------------


_END = object()


class Pull:
    """A request layer's stream (a generator of progress that returns the result), stepped in
    worker threads; `close` (from any state) closes it, which stops its run and waits for the
    model. A step and the close never overlap: a task cancelled while its step still runs in
    its thread (a server shutting down) closes the stream once that step is done."""

    def __init__(self, events: Any, limiter: anyio.CapacityLimiter):
        self.events, self.limiter = events, limiter
        self.result: Any = None
        self.finished = self.closed = False
        self.lock = threading.Lock()

    def _step(self) -> Any:
        with self.lock:
            if self.closed:
                return _END
            try:
                return next(self.events)
            except StopIteration as end:
                self.result, self.finished = end.value, True
                return _END

    def _close(self) -> None:
        with self.lock:
            self.events.close()

    async def next(self) -> Any:
        """The next progress item, or `_END` once the stream has returned its result (or was closed)."""
        if self.finished or self.closed:
            return _END
        return await anyio.to_thread.run_sync(self._step, limiter=self.limiter)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):  # runs when the response was cancelled too
            try:
                await anyio.to_thread.run_sync(self._close, limiter=self.limiter)
            except Exception:  # the run is abandoned: its error has no one to go to
                log.exception("closing an abandoned request's stream failed")


class Streamed(StreamingResponse):
    """A streamed response that runs `cleanup` however it ends: finished, failed, or cancelled
    because its client went away (Starlette cancels the body's iteration then)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Any], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleanup()


class Timing:
    """A request's clock, from its arrival: its first output and its end go to the metrics once."""

    def __init__(self, metrics: ServerMetrics, modality: str):
        self.metrics, self.modality = metrics, modality
        self.begun = time.perf_counter()
        self.first: Optional[float] = None
        self.ended = False

    def first_output(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.begun
            self.metrics.first_output.labels(self.modality).observe(self.first)

    def end(self, units: int = 0, method: Optional[str] = None, forwards: Optional[int] = None) -> None:
        if self.ended:
            return
        self.ended = True
        self.first_output()
        self.metrics.ended(self.modality, time.perf_counter() - self.begun)
        if units:
            self.metrics.output(self.modality, units, method, forwards)


# --------------------------------------------------------------------------------------------
# Encodings: images, audio, stop strings, chat messages
# --------------------------------------------------------------------------------------------


def png_base64(picture: Any) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def pcm16(chunk: np.ndarray) -> bytes:
    """Mono float32 samples in [-1, 1] as 16-bit signed little-endian PCM."""
    samples = np.clip(np.asarray(chunk, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return (np.round(samples * 32767.0)).astype("<i2").tobytes()


def wav_header(rate: int, data_bytes: int = WAV_UNKNOWN_SIZE) -> bytes:
    """A 44-byte PCM16 mono WAV header; streamed, the sizes are unknown and given as their maximum."""
    riff = WAV_UNKNOWN_SIZE if data_bytes == WAV_UNKNOWN_SIZE else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def decode_base64(text: str, what: str, param: str, limit: int) -> bytes:
    """Base64 text as bytes, bounded by `limit` decoded bytes before it is decoded."""
    if len(text) > 4 * math.ceil(limit / 3) + 4:
        raise ApiError(400, f"{what} is over {limit} bytes; at most {limit} are accepted", param=param)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{what} is not valid base64", param=param) from None
    if len(data) > limit:
        raise ApiError(400, f"{what} is over {limit} bytes; at most {limit} are accepted", param=param)
    return data


def data_url_bytes(url: Any, param: str, kind: str) -> bytes:
    """The bytes of a `data:<kind>/...;base64,...` URL (`kind` "image" or "video"), bounded by the
    upload limit before they are decoded; anything else is refused, and nothing is ever fetched."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ApiError(400, f"{param}: only data: URLs are accepted (the {kind} inside the request, base64); this "
                            "server never fetches a URL", param=param, code="unsupported_url")
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        example = {"image": "image/png", "video": "video/mp4"}.get(kind, kind)
        raise ApiError(400, f"{param}: a data: URL must be base64 (data:{example};base64,...)", param=param)
    media = header[len("data:"):].split(";")[0]
    if media and not media.startswith(f"{kind}/"):
        raise ApiError(400, f"{param}: a data: URL of {shown(media)}, not {'an' if kind[0] in 'aeiou' else 'a'} {kind}",
                       param=param)
    return decode_base64(payload, f"{param}'s {kind}", param, LIMITS.upload_bytes)


def image_from_data_url(url: Any, param: str) -> Any:
    """An RGB image from a `data:image/...;base64,...` URL; anything else is refused, and nothing
    is ever fetched. Bounded in bytes and pixels before its pixels are decoded."""
    from mmgen.vlm.images import read_image

    data = data_url_bytes(url, param, "image")
    try:
        return read_image(io.BytesIO(data), param, LIMITS.image_pixels)
    except ValueError as error:
        raise ApiError(400, one_line(str(error)), param=param) from None


@dataclass
class Conversation:
    """OpenAI chat messages in the request layer's terms: the earlier turns (transformers' chat
    format) and their images and videos, and the last user turn's text, images and videos. A
    video is its file's bytes: the request layer reads it (`vlm.check_request`)."""

    history: list[dict] = field(default_factory=list)
    history_images: list = field(default_factory=list)
    history_videos: list = field(default_factory=list)
    message: str = ""
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)


def conversation_of(messages: Sequence[Mapping[str, Any]], max_images: int,
                    max_videos: int = vlm.MAX_VIDEOS) -> Conversation:
    """Check and convert OpenAI messages: user and assistant turns alternating, starting and
    ending with a user turn; a user turn's parts are text, image_url and video_url (data: URLs
    only; a video_url as vLLM takes it: `{"type": "video_url", "video_url": {"url": ...}}`)."""
    if not messages:
        raise ApiError(400, "messages must hold at least one user message", param="messages")
    for kind, limit, noun in (("image_url", max_images, "images"), ("video_url", max_videos, "videos")):
        count = sum(1 for m in messages if isinstance(m.get("content"), list)
                    for part in m["content"] if isinstance(part, dict) and part.get("type") == kind)
        if count > limit:  # before any is decoded
            raise ApiError(400, f"at most {limit} {noun} per conversation on this server, got {count}", param="messages")
    out = Conversation()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role in ("system", "developer"):
            raise ApiError(400, f"{where}: this server's vision-language models take no {role} message; put the "
                                "instructions in the user message", param=f"{where}.role")
        expected = "user" if i % 2 == 0 else "assistant"
        if role not in ("user", "assistant"):
            raise ApiError(400, f"{where}.role must be user or assistant, got {shown(role)}", param=f"{where}.role")
        if role != expected:
            raise ApiError(400, "messages must alternate user and assistant turns, starting and ending with a user turn",
                           param=f"{where}.role")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise ApiError(400, f"{where}: unknown field {unknown[0]!r}: this server does not take it",
                           param=f"{where}.{unknown[0]}")
        texts, pictures, clips = _parts(message.get("content"), role, where)
        text = "\n".join(texts)
        if i == len(messages) - 1:
            if role != "user":
                raise ApiError(400, "the last message must be a user message", param=f"{where}.role")
            out.message, out.images, out.videos = text, pictures, clips
        elif role == "user":  # placeholders in the request layer's order: images, videos, text
            out.history.append({"role": "user", "content": [*({"type": "image"} for _ in pictures),
                                                             *({"type": "video"} for _ in clips),
                                                             {"type": "text", "text": text}]})
            out.history_images.extend(pictures)
            out.history_videos.extend(clips)
        else:
            out.history.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
    return out


def _parts(content: Any, role: str, where: str) -> tuple[list[str], list, list[bytes]]:
    """A message's texts, images (decoded) and videos (their files' bytes)."""
    if isinstance(content, str):
        return [content], [], []
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be text or a list of parts", param=f"{where}.content")
    texts, pictures, clips = [], [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "video_url") and role == "user":
            ref = part.get(kind)
            url = ref.get("url") if isinstance(ref, dict) else None
            if kind == "image_url":
                pictures.append(image_from_data_url(url, f"{at}.image_url.url"))
            else:
                clips.append(data_url_bytes(url, f"{at}.video_url.url", "video"))
        else:
            raise ApiError(400, f"{at}: a {role} message's parts are text"
                                f"{', image_url and video_url' if role == 'user' else ''}, got {shown(kind)}", param=at)
    return texts, pictures, clips


class StopText:
    """An answer streamed as it grows, cut before the first of the `stops` strings: `feed` takes
    the answer so far and returns the new text that is safe to send (text that could begin a
    stop string is held back until it cannot)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = ""
        self.stopped: Optional[str] = None

    def feed(self, text: str, final: bool = False) -> str:
        if self.stopped is not None:
            return ""
        hits = [(text.find(s), s) for s in self.stops if text.find(s) >= 0]
        if hits:
            cut, self.stopped = min(hits)
            safe = text[:cut]
        else:
            safe = text if final else text[: max(len(self.sent), len(text) - self.hold)]
        if not safe.startswith(self.sent):  # the decoded text changed under what was sent: keep what was sent
            return ""
        new, self.sent = safe[len(self.sent):], safe
        return new


def stop_strings(stop: Union[None, str, Sequence[str]]) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"each stop string must have 1 to {MAX_STOP_CHARS} characters", param="stop")
    return stops


def decoding_of(method: Optional[str], options: Union[None, str, Mapping[str, Any]]) -> tuple[Optional[str], str]:
    """A method name and its options text ("window=8,adapt=false"), from `decoding` ("sjd" or
    "sjd:window=8") and `decoding_options` (text, or an object of numbers, booleans, nulls and
    companion model names)."""
    text = ""
    if isinstance(options, Mapping):
        pieces = []
        for key, value in options.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ApiError(400, f"decoding_options: {shown(key)} is not an option name", param="decoding_options")
            shown_value = json.dumps(value) if isinstance(value, (bool, type(None))) else str(value)
            if isinstance(value, str) and (not value or re.search(r"[,=:\s]", value)):
                raise ApiError(400, f"decoding_options.{key}: {shown(value)} is not a model name", param="decoding_options")
            pieces.append(f"{key}={shown_value}")
        text = ",".join(pieces)
    elif isinstance(options, str):
        text = options
    if method is not None and ":" in method:
        if text:
            raise ApiError(400, "give decoding options either after the method (decoding='sjd:window=8') or in "
                                "decoding_options, not both", param="decoding")
        method, text = method.split(":", 1)
    return method, text


def request_of(cls: type, **values: Any) -> Any:
    """A request dataclass with the given values; None leaves the request layer's default."""
    return cls(**{k: v for k, v in values.items() if v is not None})


# --------------------------------------------------------------------------------------------
# The service
# --------------------------------------------------------------------------------------------


@dataclass
class VideoJob:
    """A `/v1/videos` job: queued, in_progress, completed (its MP4 kept) or failed."""

    id: str
    model: str
    prompt: str
    seed: int
    num_frames: int
    fps: float
    size: str
    num_blocks: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    blocks_done: int = 0
    completed_at: Optional[int] = None
    error: Optional[dict] = None
    mp4: Optional[bytes] = None
    task: Optional[asyncio.Task] = None
    #: Each committed block, as `/v1/videos/{id}/events` sends it: its index, frame range,
    #: seconds since the job started and its frames as base64 PNGs (none when decoded at the end).
    blocks: list = field(default_factory=list)

    def view(self) -> dict:
        """The job as OpenAI's video object, with mmgen's fields: progress in blocks, frames, seed."""
        percent = 100 if self.status == "completed" else int(100 * self.blocks_done / self.num_blocks) if self.num_blocks else 0
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status, "progress": percent,
                "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None, "error": self.error,
                "prompt": self.prompt, "remixed_from_video_id": None, "seconds": f"{self.num_frames / self.fps:g}",
                "size": self.size, "blocks_done": self.blocks_done, "num_blocks": self.num_blocks,
                "num_frames": self.num_frames, "seed": self.seed}


class Service:
    """The server's state and route handlers: catalogues, settings, metrics, admission, jobs."""

    def __init__(self, catalogs: Mapping[str, Any], settings: ServerSettings = ServerSettings(),
                 board: Optional[JobBoard] = None):
        self.catalogs = {m: catalogs[m] for m in MODALITIES if m in catalogs}
        self.board = board  # where other copies of the server read this one's video jobs (`apps/job_board.py`)
        self.settings = settings
        self.metrics = ServerMetrics(self.catalogs)
        slots = {m: max(1, int(getattr(c, "continuous_batch", 0) or 0)) for m, c in self.catalogs.items()}
        self.admission = Admission(settings.max_queue, self.metrics, slots)
        threads = sum(slots[m] * len(c.main) for m, c in self.catalogs.items()) + SPARE_THREADS
        self.limiter = anyio.CapacityLimiter(threads)  # above every slot's thread: a stream can always take its next step
        self.jobs: dict[str, VideoJob] = {}
        self.created = int(time.time())
        self.info: dict[str, dict] = {}

    async def thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self.limiter)

    def find(self, modality: str, name: Optional[str]) -> tuple[Any, str]:
        """The catalogue and main model a request names (default: the modality's first); 404 otherwise."""
        catalog = self.catalogs.get(modality)
        if catalog is None:
            raise ApiError(404, f"this server serves no {NOUNS[modality]} models", param="model", code="model_not_found")
        if name is None:
            return catalog, next(iter(catalog.main))
        if name not in catalog.main:
            other = next((m for m, c in self.catalogs.items() if name in c.main), None)
            hint = f" ({shown(name)} is a{'n' if NOUNS[other][0] in 'aeiou' else ''} {NOUNS[other]} model)" if other else ""
            raise ApiError(404, f"model {shown(name)} does not exist here{hint}; this route serves {list(catalog.main)}",
                           param="model", code="model_not_found")
        return catalog, name

    def seed(self, value: Optional[int]) -> int:
        """The request's seed, or a fresh one (reported back, so that the output can be made again)."""
        return secrets.randbelow(MAX_SEED + 1) if value is None else value

    async def admitted(self, ticket: Ticket, check: Callable[[], Any]) -> Any:
        """Check an admitted request with the request layer's `check_request` (400 before any
        model work), then wait for its model's slot; the ticket is given up when either fails.
        Returns the checked request."""
        try:
            checked = await self.thread(check)
            await ticket.start()
        except BaseException:
            ticket.done()
            raise
        return checked

    # ---- images ----------------------------------------------------------------------------

    async def images(self, request: Request) -> JSONResponse:
        body: ImageBody = await parse_body(request, ImageBody)
        timing = Timing(self.metrics, "image")
        catalog, model = self.find("image", body.model)
        if body.response_format not in (None, "b64_json"):
            reason = "this server hosts no files" if body.response_format == "url" else "the one format offered"
            raise ApiError(400, f"response_format must be b64_json ({reason}), got {shown(body.response_format)}",
                           param="response_format", code="unsupported_value")
        if body.output_format not in (None, "png"):
            raise ApiError(400, f"output_format must be png, got {shown(body.output_format)}", param="output_format")
        pipe = await self.thread(catalog.main_pipeline, model)
        info = image.model_info(pipe)
        side = int(pipe.image_size)
        if body.size not in (None, "auto", f"{side}x{side}"):
            raise ApiError(400, f"size must be {side}x{side} (the model's) or auto, got {shown(body.size)}", param="size")
        method, options = decoding_of(body.decoding, body.decoding_options)
        seed = self.seed(body.seed)
        ask = request_of(image.ImageRequest, model=model, class_name=self._class_name(body, info.class_names),
                         method=method or await self.thread(catalog.default_method, model), options=options, seed=seed,
                         num_images=body.n, guidance_scale=body.guidance_scale, temperature=body.temperature,
                         top_k=body.top_k, top_p=body.top_p, num_steps=body.num_steps)
        limit = self.settings.max_images
        rows = body.n if 1 <= body.n <= limit else 1
        ticket = self.admission.admit("image", model, rows)
        checked = await self.admitted(ticket, partial(image.check_request, ask, catalog, self.settings.max_images))
        try:
            result = await self.thread(image.run_checked, checked, catalog)
            data = await self.thread(lambda: [{"b64_json": png_base64(p), "revised_prompt": None} for p in result.method.images])
        finally:
            ticket.done()
        run = result.method
        timing.end(run.units, ask.method, run.stats.forwards)
        return JSONResponse({"created": int(time.time()), "data": data, "output_format": "png", "size": f"{side}x{side}",
                             "seed": seed})

    @staticmethod
    def _class_name(body: ImageBody, names: list[str]) -> Any:
        """The class a request names: `class_label` (an index or a name) or the prompt (a class
        name; case, spaces and underscores aside); the request layer refuses an unknown one."""
        given = body.class_label
        if isinstance(given, int):
            if not 0 <= given < len(names):
                raise ApiError(400, f"class_label must be in [0, {len(names)}), got {given}", param="class_label")
            given = names[given]
        prompt = body.prompt.strip() if isinstance(body.prompt, str) else None
        if prompt and given is not None and prompt != given:
            raise ApiError(400, "give the class as prompt or as class_label, not two different ones", param="class_label")
        if given is not None:
            return given
        if not prompt:
            raise ApiError(400, "prompt must name one of the model's classes (or give class_label)", param="prompt")
        if prompt in names:
            return prompt
        folded = re.sub(r"[\s_]+", "-", prompt.lower())
        return folded if folded in names else prompt

    # ---- chat ------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body: ChatBody = await parse_body(request, ChatBody)
        timing = Timing(self.metrics, "text")
        catalog, model = self.find("text", body.model)
        if body.n not in (None, 1):
            raise ApiError(400, f"n must be 1 (one answer per request), got {body.n}", param="n")
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise ApiError(400, "give max_completion_tokens or max_tokens, not two different budgets",
                           param="max_completion_tokens")
        stops = stop_strings(body.stop)
        budget = next((b for b in (body.max_completion_tokens, body.max_tokens) if b is not None), None)
        seed = self.seed(body.seed)
        method = body.decoding or await self.thread(catalog.default_method, model)
        ticket = self.admission.admit("text", model)  # before images and videos are decoded: the queue bounds their memory
        try:
            talk = await self.thread(conversation_of, body.messages, self.settings.max_images)
        except BaseException:
            ticket.done()
            raise
        ask = request_of(vlm.ChatRequest, model=model, message=talk.message, images=talk.images, history=talk.history,
                         history_images=talk.history_images, videos=talk.videos, history_videos=talk.history_videos,
                         method=method, temperature=body.temperature, seed=seed,
                         max_new_tokens=self.settings.max_new_tokens if budget is None else budget)
        checked = await self.admitted(ticket, partial(vlm.check_request, ask, catalog, max_images=self.settings.max_images,
                                                      max_new_tokens=self.settings.max_new_tokens))
        pull = Pull(vlm.stream_checked(checked, catalog), self.limiter)
        answer = StopText(stops)
        chat_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            first = await pull.next()
        except BaseException:
            await pull.close()
            ticket.done()
            raise

        tokens: dict[str, int] = {}

        async def completion_tokens() -> int:
            """The answer's tokens, its stop token included; for a run stopped at a stop string,
            the tokens of its text through the stop string (counted by the tokenizer)."""
            if "completion" not in tokens:
                if pull.result is not None:
                    tokens["completion"] = int(pull.result.method.tokens)
                elif answer.stopped is not None:
                    tokenizer = (await self.thread(catalog.pipeline, model)).processor.tokenizer
                    ids = await self.thread(tokenizer, answer.sent + answer.stopped, add_special_tokens=False)
                    tokens["completion"] = len(ids["input_ids"])
                else:
                    tokens["completion"] = 0
            return tokens["completion"]

        async def usage() -> dict:
            # The prompt as the run saw it: the checked conversation, its images and videos (read once).
            inputs = await self.thread(checked.pipe.prepare_inputs, checked.prompt, checked.images or None,
                                       checked.videos or None)
            mask = inputs.get("attention_mask")
            prompt_tokens = int(mask.sum()) if mask is not None else int(inputs["input_ids"].shape[-1])
            completion = await completion_tokens()
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

        def finish_reason() -> str:
            if answer.stopped is None and pull.result is not None and pull.result.method.tokens >= ask.max_new_tokens:
                return "length"
            return "stop"

        async def pieces() -> AsyncIterator[str]:
            """The answer's new text as it commits, stop strings applied; closes the run at a stop."""
            item = first
            while item is not _END:
                timing.first_output()
                piece = answer.feed(item.text)
                if piece:
                    yield piece
                if answer.stopped is not None:
                    await pull.close()
                    return
                item = await pull.next()
            piece = answer.feed(pull.result.method.text, final=True)
            if piece:
                yield piece

        async def cleanup() -> None:
            await pull.close()
            ticket.done()
            if pull.result is not None or answer.stopped is not None:  # an answer was made: count it
                forwards = pull.result.method.stats.forwards if pull.result is not None else None
                timing.end(await completion_tokens(), method, forwards)

        if not body.stream:
            try:
                async for _ in pieces():
                    pass
                counts = await usage()
            finally:
                await cleanup()
            return JSONResponse({"id": chat_id, "object": "chat.completion", "created": created, "model": model,
                                 "system_fingerprint": None, "seed": seed,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.sent,
                                                                      "refusal": None},
                                              "logprobs": None, "finish_reason": finish_reason()}],
                                 "usage": counts})

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def event(choices: list, **extra: Any) -> str:
            chunk = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model,
                     "system_fingerprint": None, "choices": choices, **extra}
            return f"data: {json.dumps(chunk)}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
                async for piece in pieces():
                    yield event([{"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}])
                yield event([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason()}])
                if include_usage:
                    yield event([], usage=await usage())
                yield "data: [DONE]\n\n"
            except Exception as error:  # the stream has begun: the error goes in it, as one event
                yield f"data: {json.dumps(self.stream_error(error))}\n\n"

        return Streamed(events(), cleanup, media_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def stream_error(self, error: BaseException) -> dict:
        """An error met after a stream began, as the one event that ends it."""
        if isinstance(error, ApiError):
            return error.body()
        if isinstance(error, ValueError):
            return error_body(one_line(str(error)))
        log.error("a streamed request failed", exc_info=error)
        return error_body("the server failed while streaming this response; see its log", "server_error")

    # ---- speech ----------------------------------------------------------------------------

    async def speech(self, request: Request) -> Response:
        body: SpeechBody = await parse_body(request, SpeechBody)
        timing = Timing(self.metrics, "speech")
        catalog, model = self.find("speech", body.model)
        kind = body.response_format or "wav"
        if kind not in ("wav", "pcm"):
            raise ApiError(400, f"response_format must be wav or pcm (uncompressed audio, streamed as it is made), got "
                                f"{shown(kind)}", param="response_format", code="unsupported_value")
        if body.stream_format not in (None, "audio"):
            raise ApiError(400, f"stream_format must be audio (the body streams as frames decode), got "
                                f"{shown(body.stream_format)}", param="stream_format")
        if body.speed not in (None, 1.0):
            raise ApiError(400, f"speed must be 1.0: this server does not change the speed of speech, got {body.speed:g}",
                           param="speed")
        if body.voice not in (None, "default"):
            raise ApiError(400, f"voice {shown(body.voice)}: this server's speech models have no named voices; leave it "
                                "out (or 'default'), or give a voice prompt as voice_audio (base64 audio) with voice_text",
                           param="voice")
        voice = None if body.voice_audio is None else decode_base64(body.voice_audio, "voice_audio", "voice_audio",
                                                                    LIMITS.upload_bytes)
        limits = await self.thread(speech.sampling_defaults, catalog, model)
        budget = body.max_new_frames
        if budget is None:
            budget = max(1, min(self.settings.max_new_frames, int(limits["max_new_frames"])))
        seed = self.seed(body.seed)
        method = body.decoding or await self.thread(catalog.default_method, model)
        ask = request_of(speech.SpeechRequest, model=model, text=body.input, voice=voice, voice_text=body.voice_text,
                         method=method, max_new_frames=budget, temperature=body.temperature, top_k=body.top_k,
                         top_p=body.top_p, seed=seed)
        ticket = self.admission.admit("speech", model)
        checked = await self.admitted(ticket, partial(speech.check_request, ask, catalog,
                                                      max_new_frames=self.settings.max_new_frames))
        pull = Pull(speech.stream_checked(checked, catalog), self.limiter)
        try:
            first = await pull.next()
            rate = int(first.sampling_rate if first is not _END else catalog.pipeline(model).sampling_rate)
        except BaseException:
            await pull.close()
            ticket.done()
            raise

        async def audio() -> AsyncIterator[bytes]:
            if kind == "wav":
                yield wav_header(rate)
            item = first
            try:
                while item is not _END:
                    timing.first_output()
                    yield pcm16(item.chunk)
                    item = await pull.next()
            except Exception as error:  # the status is sent: the body ends short, the log says why
                self.stream_error(error)

        async def cleanup() -> None:
            await pull.close()
            ticket.done()
            if pull.result is not None:  # the utterance was made (a client that left is not timed)
                run = pull.result.method
                timing.end(run.units, method, run.stats.forwards)

        media = "audio/wav" if kind == "wav" else "audio/pcm"
        headers = {"X-Sample-Rate": str(rate), "X-Seed": str(seed), "Cache-Control": "no-cache"}
        return Streamed(audio(), cleanup, media_type=media, headers=headers)

    # ---- video jobs ------------------------------------------------------------------------

    async def create_video(self, request: Request) -> JSONResponse:
        body: VideoBody = await parse_form_or_json(request, VideoBody)
        timing = Timing(self.metrics, "video")
        catalog, model = self.find("video", body.model)
        pipe = await self.thread(catalog.main_pipeline, model)
        size = f"{pipe.width}x{pipe.height}"
        if body.size not in (None, size):
            raise ApiError(400, f"size must be {size} (the model's), got {shown(body.size)}", param="size")
        offered = video.lengths(pipe, self.settings.max_frames)
        frames = body.num_frames if body.num_frames is not None else self._frames_for(body.seconds, offered, float(pipe.fps))
        if frames is None:
            frames = video.default_length(pipe, offered) or pipe.num_frames
        seed = self.seed(body.seed)
        method = body.decoding or await self.thread(catalog.default_method, model)
        ask = request_of(video.VideoRequest, model=model, prompt=body.prompt, num_frames=frames, method=method,
                         large_steps=body.large_steps, cache_policy=body.cache_policy, cache_threshold=body.cache_threshold,
                         drop_threshold=body.drop_threshold, seed=seed)
        ticket = self.admission.admit("video", model)
        try:
            checked = await self.thread(video.check_request, ask, catalog, self.settings.max_frames)
        except BaseException:
            ticket.done()
            raise  # the job waits for its slot in the background (`_run_video`)
        blocks = math.ceil(pipe.latent_frames(frames) / pipe.block_frames)
        job = VideoJob(f"video_{uuid.uuid4().hex}", model, ask.prompt, seed, frames, float(pipe.fps), size, blocks)
        self._keep(job)
        await self._publish(job)
        job.task = asyncio.get_running_loop().create_task(self._run_video(job, ticket, timing,
                                                                            partial(video.stream_checked, checked, catalog)))
        return JSONResponse(job.view())

    @staticmethod
    def _frames_for(seconds: Any, offered: list[int], fps: float) -> Optional[int]:
        """The offered length nearest `seconds` of video (OpenAI's field), or None when not given."""
        if seconds is None:
            return None
        try:
            wanted = float(seconds)
        except (TypeError, ValueError):
            wanted = float("nan")
        if not math.isfinite(wanted) or wanted <= 0:
            raise ApiError(400, f"seconds must be a positive number, got {shown(seconds)}", param="seconds")
        if not offered or wanted * fps > offered[-1] + (offered[1] - offered[0] if len(offered) > 1 else 1):
            longest = offered[-1] / fps if offered else 0
            raise ApiError(400, f"seconds must be at most {longest:g} for this model on this server, got {wanted:g}",
                           param="seconds")
        return min(offered, key=lambda n: (abs(n - wanted * fps), n))

    def _keep(self, job: VideoJob) -> None:
        """Store a new job; the oldest finished ones beyond `max_finished_jobs` are dropped."""
        self.jobs[job.id] = job
        finished = [j for j in self.jobs.values() if j.status in ("completed", "failed")]
        for old in finished[: max(0, len(finished) - self.settings.max_finished_jobs)]:
            del self.jobs[old.id]

    async def _run_video(self, job: VideoJob, ticket: Ticket, timing: Timing, begin: Callable[[], Any]) -> None:
        pull: Optional[Pull] = None
        try:
            await ticket.start()
            job.status = "in_progress"
            await self._publish(job)
            pull = Pull(begin(), self.limiter)
            while (item := await pull.next()) is not _END:
                timing.first_output()
                frames = [] if item.frames is None else await self.thread(
                    lambda: [png_base64(Image.fromarray(frame)) for frame in item.frames])
                job.blocks.append({"block": item.index, "num_blocks": item.num_blocks, "start_frame": item.start,
                                   "end_frame": item.start + len(frames), "seconds": round(item.seconds, 4),
                                   "frames": frames})
                job.blocks_done, job.num_blocks = item.index + 1, item.num_blocks
                await self._publish(job, job.blocks[-1:])
            result = pull.result
            job.mp4 = await self.thread(result.mp4)
            job.status, job.completed_at = "completed", int(time.time())
            timing.end(int(result.frames.shape[0]))
        except asyncio.CancelledError:
            job.status, job.error = "failed", {"code": "cancelled", "message": "the server stopped before the video was made"}
            raise
        except Exception as error:
            body = self.stream_error(error)["error"]
            job.status, job.error = "failed", {"code": body["code"] or body["type"], "message": body["message"]}
        finally:
            if pull is not None:
                await pull.close()
            ticket.done()
            job.task = None
            self._keep(job)
            await asyncio.shield(self._publish(job, mp4=job.mp4))  # the last word, even when cancelled

    async def _publish(self, job: VideoJob, blocks: Optional[list] = None, mp4: Optional[bytes] = None) -> None:
        """Show the job's change to the other copies of the server, where there are any."""
        if self.board is not None:
            await self.board.publish(job.id, job.view(), blocks, mp4)

    async def job(self, video_id: str) -> Union[VideoJob, dict]:
        """This server's job, else the one another copy published ({"view", "blocks"}); 404 for neither."""
        job = self.jobs.get(video_id)
        if job is None and self.board is not None:
            job = await self.board.read(video_id)
        if job is None:
            raise ApiError(404, f"no video job {shown(video_id)} on this server (finished jobs are kept for a while)",
                           param="video_id", code="not_found")
        return job

    async def video_status(self, video_id: str) -> JSONResponse:
        job = await self.job(video_id)
        return JSONResponse(job["view"] if isinstance(job, dict) else job.view())

    async def video_events(self, video_id: str) -> StreamingResponse:
        """The job's blocks as server-sent events, each as it commits (those already committed
        first), then one event with the job's final state and `data: [DONE]`: a viewer shows
        the video while it is made. A client that goes away stops only its own stream. A job
        another copy of the server runs is followed on the board it publishes to."""
        job = await self.job(video_id)

        async def state(sent: int) -> Optional[tuple[dict, list]]:
            """(the job's view, its blocks from `sent` on); the view is read first, so no block
            committed before a final view is missed. None once the board has dropped the job."""
            if isinstance(job, VideoJob):
                return job.view(), job.blocks[sent:]
            published = await self.board.read(video_id, sent)
            return None if published is None else (published["view"], published["blocks"])

        async def events() -> AsyncIterator[str]:
            sent, view = 0, None
            while (snapshot := await state(sent)) is not None:
                view, blocks = snapshot
                for block in blocks:
                    yield f"data: {json.dumps({'object': 'video.block', 'id': video_id, **block})}\n\n"
                sent += len(blocks)
                if view["status"] in ("completed", "failed"):
                    break
                await asyncio.sleep(EVENT_POLL_S)
            if view is not None:
                yield f"data: {json.dumps({**view, 'object': 'video.done'})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def video_content(self, video_id: str, variant: Optional[str] = None) -> Response:
        job = await self.job(video_id)
        if variant not in (None, "video"):
            raise ApiError(400, f"variant must be video (the MP4), got {shown(variant)}", param="variant")
        status = job["view"]["status"] if isinstance(job, dict) else job.status
        mp4 = (await self.board.content(video_id)) if isinstance(job, dict) else job.mp4
        if status != "completed" or mp4 is None:
            raise ApiError(409, f"video {video_id} is {status}, not completed", param="video_id", code="video_not_ready")
        return Response(mp4, media_type="video/mp4")

    # ---- models, health, metrics -----------------------------------------------------------

    async def models(self) -> JSONResponse:
        data = []
        for modality, catalog in self.catalogs.items():
            for name in catalog.main:
                if name not in self.info:
                    self.info[name] = await self.thread(self._model_info, catalog, name)
                data.append({"id": name, "object": "model", "created": self.created, "owned_by": "mmgen",
                             "modality": modality, "route": ROUTES[modality], **self.info[name]})
        return JSONResponse({"object": "list", "data": data})

    @staticmethod
    def _model_info(catalog: Any, name: str) -> dict:
        companions = [c for c in catalog.companions if c.startswith(name + "-")]
        return {"companions": companions, "decoding": catalog.methods(name), "default_decoding": catalog.default_method(name)}

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def shutdown(self) -> None:
        """Stop the video jobs still queued or running (each stops at its next block)."""
        tasks = [job.task for job in self.jobs.values() if job.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class Guard:
    """ASGI middleware in front of every route: the API key (all routes but /health), the body
    bound (a Content-Length over it is refused before anything is read; a body without one is
    cut off when it passes it), and the response count by route and status."""

    def __init__(self, app: Any, service: Service):
        self.app, self.service = app, service
        key = service.settings.api_key
        self.key = None if key is None else key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def counted_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, counted_send)
            await self.app(scope, self.bounded(receive), counted_send)
        finally:
            route = scope.get("route")
            self.service.metrics.responses.labels(getattr(route, "path", "unrouted"), str(status["code"])).inc()

    def refusal(self, scope: Any) -> Optional[Response]:
        headers = dict(scope.get("headers") or [])
        metrics, limit = self.service.metrics, self.service.settings.max_body_bytes
        if self.key is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                metrics.rejected.labels("unauthorized").inc()
                return error_response(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                                      param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, "the Content-Length header is not a number")
            if int(length) > limit:
                metrics.rejected.labels("too_large").inc()
                return error_response(413, f"the request body is {int(length)} bytes; this server takes at most {limit}",
                                      code="request_too_large")
        return None

    def bounded(self, receive: Any) -> Any:
        limit, seen = self.service.settings.max_body_bytes, {"bytes": 0}

        async def read() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                seen["bytes"] += len(message.get("body", b""))
                if seen["bytes"] > limit:
                    self.service.metrics.rejected.labels("too_large").inc()
                    raise ApiError(413, f"the request body is over {limit} bytes, the most this server takes",
                                   code="request_too_large")
            return message

        return read


def create_app(catalogs: Mapping[str, Any], settings: ServerSettings = ServerSettings(),
               board: Optional[JobBoard] = None) -> FastAPI:
    """The FastAPI app serving `catalogs` (modality -> catalogue, as `discover_catalogs` gives);
    `board`: where its video jobs are published to, and others' read, when several copies of
    the server share the requests (`apps/job_board.py`)."""
    service = Service(catalogs, settings, board)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await service.shutdown()

    app = FastAPI(title="mmgen", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"no route {request.method} {shown(request.url.path)}"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {shown(request.url.path)}"
        else:
            message = one_line(str(error.detail))
        return error_response(error.status_code, message, code=None, headers=getattr(error, "headers", None))

    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message, where = validation_message(error.errors())
        return error_response(400, message, param=where)

    async def value_error(request: Request, error: ValueError) -> JSONResponse:
        return error_response(400, one_line(str(error)))

    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(500, "the server failed to answer this request; see its log", "server_error")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ValueError, value_error)
    app.add_exception_handler(Exception, server_error)
    app.add_middleware(Guard, service=service)

    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", service.models, methods=["GET"])
    app.add_api_route("/v1/images/generations", service.images, methods=["POST"])
    app.add_api_route("/v1/chat/completions", service.chat, methods=["POST"])
    app.add_api_route("/v1/audio/speech", service.speech, methods=["POST"])
    app.add_api_route("/v1/videos", service.create_video, methods=["POST"])
    app.add_api_route("/v1/videos/{video_id}", service.video_status, methods=["GET"])
    app.add_api_route("/v1/videos/{video_id}/content", service.video_content, methods=["GET"])
    app.add_api_route("/v1/videos/{video_id}/events", service.video_events, methods=["GET"])
    return app


def _version() -> str:
    import mmgen

    return str(getattr(mmgen, "__version__", "0"))


__all__ = ["ApiError", "ServerSettings", "Service", "create_app", "discover_catalogs", "preload",
           "wav_header", "pcm16", "MODALITIES"]
