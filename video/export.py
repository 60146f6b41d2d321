"""Writing videos: MP4 (H.264 through PyAV, which bundles FFmpeg), atomically.

The file appears complete or not at all (`mmgen.files.write_atomic`: a temporary sibling,
fsynced and renamed over the target), so a killed run leaves no half-written video.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Union

import numpy as np
import torch

from mmgen.files import write_atomic


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """Video [B, 3, T, H, W] in [-1, 1] -> frames [B, T, H, W, 3] uint8."""
    return ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()


def mp4_bytes(frames: Union[torch.Tensor, np.ndarray], fps: float = 16.0, crf: int = 18) -> bytes:
    """Frames [T, H, W, 3] uint8 -> an H.264 MP4 (odd sizes padded by one pixel: yuv420p)."""
    import av

    frames = np.asarray(frames.cpu() if isinstance(frames, torch.Tensor) else frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected frames [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
    _, h, w, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    buffer = io.BytesIO()
    # Same frames, same bytes: x264's macroblock-tree rate control encodes identical frames
    # differently from call to call on AVX-512 CPUs (its AVX-512 code's results vary with memory
    # it does not own; with AVX2 or without it they do not), so it is off (`mbtree=0`: a
    # slightly larger file at this crf); bitexact keeps the library versions out of the file.
    with av.open(buffer, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("libx264", rate=int(round(fps)))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "x264-params": "mbtree=0"}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def write_mp4(path: Union[str, os.PathLike], frames: Union[torch.Tensor, np.ndarray], fps: float = 16.0, crf: int = 18) -> Path:
    """`mp4_bytes` written atomically to `path` (a temporary sibling renamed over it)."""
    path = Path(path)
    write_atomic(path, mp4_bytes(frames, fps, crf))
    return path


def read_mp4(path: Union[str, os.PathLike]) -> np.ndarray:
    """Frames [T, H, W, 3] uint8 of a video file (for tests and quality checks)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
