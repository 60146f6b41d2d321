"""The routes' JSON bodies, strictly typed ("2" is not a number; unknown fields are refused, not
ignored), and their parsing: a body that is not JSON (by its Content-Type) is refused before it
is read, and a bad one is one 400 naming its first bad field."""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mmgen.apps.requests.bounds import LIMITS, check_plain_text, shown

from .errors import ApiError, validation_message

MAX_MESSAGES = 2 * LIMITS.turns


Scalar = Union[bool, int, float, str, None]
#: A request's family options (`"options": {"name": value}`): what the model's family declares
#: beyond the route's own fields (`mmgen.registry.family_options`; `/v1/models` lists each model's),
#: checked by the request layer.
FamilyOptions = Optional[dict[str, Scalar]]


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
    options: FamilyOptions = None


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
    options: FamilyOptions = None  # mmgen's


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
    options: FamilyOptions = None


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
    options: FamilyOptions = None


class VideoStreamBody(Body):
    """The first message of a `/v1/videos/stream` connection: what to stream."""

    prompt: str = Field(max_length=LIMITS.text_chars)
    model: Optional[str] = Field(None, max_length=256)
    seed: Optional[int] = None
    decoding: Optional[str] = Field(None, max_length=64)
    large_steps: Optional[int] = None
    cache_policy: Optional[str] = Field(None, max_length=64)
    cache_threshold: Optional[float] = None
    drop_threshold: Optional[float] = None
    max_blocks: Optional[int] = None
    realtime: Optional[bool] = None  # pace the blocks to the video's frame rate


class StreamControl(Body):
    """A later message of a `/v1/videos/stream` connection: a new prompt, or close."""

    prompt: Optional[str] = Field(None, max_length=LIMITS.text_chars)
    close: Optional[bool] = None


FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")


def media_type(request: Request) -> str:
    """The body's media type, lower case and without parameters ("" when the header is absent)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def check_json(request: Request, also: tuple[str, ...] = ()) -> None:
    """Refuse (415) a body declared as anything but JSON (or one of `also`), before it is read: a
    text/plain body is not parsed as JSON. A body with no Content-Type is taken as JSON."""
    kind = media_type(request)
    if kind and kind != "application/json" and not kind.endswith("+json") and kind not in also:
        taken = " or ".join(["application/json", *also])
        raise ApiError(415, f"the request body must be {taken}, got Content-Type {shown(kind)}",
                       code="unsupported_media_type")


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The request's JSON body as `model` (a 400 naming the first bad field otherwise; a 415 for
    a body of another media type, before it is read). The body's size is bounded by `Guard`
    while it is read."""
    check_json(request)
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        message, where = validation_message(error.errors(include_url=False, include_input=False))
        raise ApiError(400, message, param=where) from None


async def parse_form_or_json(request: Request, model: type[BaseModel]) -> Any:
    """A JSON body, or a multipart / urlencoded form (what OpenAI's client sends to /v1/videos):
    its fields are text, so numbers are read from their text; files are refused."""
    check_json(request, FORMS)
    if media_type(request) not in FORMS:
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


def check_plain_fields(body: BaseModel, *names: str) -> None:
    """Refuse (400, naming the field) a text field holding a control character: cheap, so done
    before the request is admitted."""
    for name in names:
        value = getattr(body, name)
        if isinstance(value, str):
            try:
                check_plain_text(name, value)
            except ValueError as error:
                raise ApiError(400, str(error), param=name) from None
