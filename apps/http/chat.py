"""OpenAI chat messages in the request layer's terms (`conversation_of`), and stop strings
applied to an answer as it streams (`StopText`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from mmgen.apps.requests import text as text_requests
from mmgen.apps.requests.bounds import shown

from .encoders import data_url_bytes, image_from_data_url
from .errors import ApiError

MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 64


@dataclass
class Conversation:
    """OpenAI chat messages in the request layer's terms: the earlier turns (transformers' chat
    format) and their images and videos, and the last user turn's text, images and videos. A
    video is its file's bytes: the request layer reads it (`text_requests.check_request`)."""

    history: list[dict] = field(default_factory=list)
    history_images: list = field(default_factory=list)
    history_videos: list = field(default_factory=list)
    message: str = ""
    images: list = field(default_factory=list)
    videos: list = field(default_factory=list)


def conversation_of(messages: Sequence[Mapping[str, Any]], max_images: int,
                    max_videos: int = text_requests.MAX_VIDEOS) -> Conversation:
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
