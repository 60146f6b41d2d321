"""What one `mmgen serve` allows besides its models: `ServerSettings`, and which modalities'
requests may share a model's continuous batch (`BATCHED`, which the CLI offers too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mmgen.apps.requests import speech, video

#: Modalities whose requests may share a model's continuous batch (`--continuous-batch MODALITY=ROWS`);
#: a video model makes one video at a time.
BATCHED = ("image", "text", "speech")


@dataclass(frozen=True)
class ServerSettings:
    """What one server allows, besides its models. The request layer's own limits (`LIMITS`) bound
    every value further; a server may only lower them."""

    api_key: Optional[str] = None
    max_queue: int = 64  # requests waiting for a model, at most; beyond them: 429
    max_body_bytes: int = 32 * 1024 * 1024
    max_images: int = 4  # images a request makes, or a conversation reads
    max_new_tokens: int = 256  # an answer's tokens; the default budget where the model's context leaves as many
    max_new_frames: int = speech.DEFAULT_MAX_NEW_FRAMES  # an utterance's frames (a model's context bounds it too)
    max_frames: int = video.DEFAULT_MAX_FRAMES  # a video's frames
    max_stream_blocks: int = video.DEFAULT_STREAM_BLOCKS  # blocks one /v1/videos/stream connection makes
    max_stream_seconds: float = 600.0  # how long one /v1/videos/stream connection may run
    max_finished_jobs: int = 64  # finished video jobs kept (with their MP4) for clients to fetch
    # Abuse bounds: a connection must send its headers within `header_timeout_s` and its body
    # within `body_timeout_s`; at most `max_connections` are open; bodies held at once (read,
    # parsed or waiting for their answer) total at most `max_body_bytes_in_flight`.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    max_connections: int = 1024
    max_body_bytes_in_flight: int = 128 * 1024 * 1024
