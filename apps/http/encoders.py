"""What responses and requests encode: PNG as base64, PCM16 and WAV headers, base64 and data:
URLs (bounded before they are decoded; nothing is ever fetched)."""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct
from typing import Any

import numpy as np

from mmgen.apps.requests.bounds import LIMITS, shown

from .errors import ApiError, one_line

WAV_UNKNOWN_SIZE = 0xFFFFFFFF  # a streamed WAV's RIFF and data sizes: not known until it ends


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
