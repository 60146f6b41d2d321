"""The one set of input limits every user surface enforces (the demos, `mmgen serve`), and the
checks that apply them: each refusal is a ValueError of one line, raised before any work.

A surface's own widgets or JSON schema are no protection on their own: Gradio's HTTP API takes
any value, and a client of the server sends what it likes. So every value is checked here, by
type and range, and quoted back (`shown`) in a few characters at most.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

MAX_SEED = 2**31 - 1
MAX_TEMPERATURE = 5.0
MAX_GUIDANCE = 20.0


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, whichever surface it came through. A surface may lower a
    limit (`--max-images`), never raise it above these."""

    upload_bytes: int = 16 * 1024 * 1024  # one uploaded file (an image, a voice, a video), refused before it is read
    body_bytes: int = 64 * 1024 * 1024  # one HTTP request body (images and videos travel inside it as data: URLs)
    image_pixels: int = 4096 * 4096  # an image larger than this is refused before it is decoded
    audio_seconds: float = 30.0  # a voice prompt
    text_chars: int = 2000  # a prompt, a message, a text to speak
    images: int = 16  # images made by one request, or read by one conversation
    new_tokens: int = 512  # an answer
    new_frames: int = 4096  # decoder frames of an utterance
    video_frames: int = 321  # frames of a video, made or read (20 s at 16 fps)
    video_pixels: int = 1 << 25  # a video read, over all its frames (~100 MB as RGB): refused while it decodes
    videos: int = 4  # videos read by one conversation
    turns: int = 16  # user turns of one conversation


LIMITS = Limits()


def shown(value: Any, limit: int = 60) -> str:
    """`value` as an error message quotes it: the repr of a plain value (text, number, list of
    them) cut to `limit` characters, and only the type of anything else, whose repr could be
    long or name a memory address."""
    if not _plain(value):
        return f"a {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _plain(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, (list, tuple)) and depth < 2:
        return all(_plain(item, depth + 1) for item in value[:8])
    if isinstance(value, dict) and depth < 2:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in list(value.items())[:8])
    return False


def integer(what: str, value: Any, low: int, high: int) -> int:
    """An integer in [low, high] (whole floats such as 3.0, as number boxes send, are accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {shown(value)}")
    return value


def number(what: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    """A finite number in [low, high] (or (low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{what} must be a number in {interval}, got {shown(value)}")
    return float(value)


#: Control characters no model reads (tabs and line breaks aside): a NUL, say, breaks text
#: front ends with a raw message, so text holding one is refused first.
CONTROL_CHARACTERS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def check_plain_text(what: str, value: str) -> None:
    """Refuse text holding a control character (tabs and line breaks are fine)."""
    found = CONTROL_CHARACTERS.search(value)
    if found is not None:
        raise ValueError(f"{what} holds a control character ({found.group()!r} at {found.start()}); send plain text")


def checked_text(what: str, value: Any, limit: int = LIMITS.text_chars, empty: str = "") -> str:
    """Non-empty plain text of at most `limit` characters, stripped; `empty` is the message for none."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(empty or f"{what} must be non-empty text, got {shown(value)}")
    if len(value) > limit:
        raise ValueError(f"{what} must be at most {limit} characters, got {len(value)}")
    check_plain_text(what, value)
    return value.strip()


def items(what: str, value: Any) -> list:
    """A list (None: empty)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {shown(value)}")
    return list(value)


def check_pixels(size: tuple[int, int], limit: int = LIMITS.image_pixels) -> None:
    """Refuse an image of more than `limit` pixels (checked from its header, before decoding)."""
    if size[0] * size[1] > limit:
        raise ValueError(f"an image may have at most {limit} pixels, got {size[0]}x{size[1]}")


def sampler(temperature: Any = None, top_k: Any = None, top_p: Any = None, vocab_size: Optional[int] = None,
            guidance_scale: Any = None) -> dict[str, Any]:
    """The sampler arguments a request sets, checked and bounded; None leaves the model's own.
    Without a `vocab_size` the model takes no top-k / top-p (they are ignored)."""
    out: dict[str, Any] = {}
    if guidance_scale is not None:
        out["guidance_scale"] = number("guidance", guidance_scale, 0.0, MAX_GUIDANCE)
    if temperature is not None:
        out["temperature"] = number("temperature", temperature, 0.0, MAX_TEMPERATURE)
    if vocab_size is not None:
        if top_k is not None:
            out["top_k"] = integer("top-k", top_k, 0, vocab_size)
        if top_p is not None:
            out["top_p"] = number("top-p", top_p, 0.0, 1.0, low_open=True)
    return out
