"""Writing videos: MP4 (H.264 through PyAV, which bundles FFmpeg), atomically.

The file appears complete or not at all: frames go to a hidden sibling first, renamed over
the target at the end (a killed run leaves no half-written video under the target's name).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np
import torch


def to_uint8(video: torch.Tensor) -> torch.Tensor:
    """Video [B, 3, T, H, W] in [-1, 1] -> frames [B, T, H, W, 3] uint8."""
    return ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()


def write_mp4(path: Union[str, os.PathLike], frames: Union[torch.Tensor, np.ndarray], fps: float = 16.0, crf: int = 18) -> Path:
    """Frames [T, H, W, 3] uint8 -> an H.264 MP4 at `path` (odd sizes are padded by one pixel,
    which yuv420p needs). Written to a temporary sibling and renamed, so `path` is whole."""
    import av

    frames = np.asarray(frames.cpu() if isinstance(frames, torch.Tensor) else frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected frames [T, H, W, 3] uint8, got {frames.shape} {frames.dtype}")
    t, h, w, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    path = Path(path)
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    try:
        with av.open(str(partial), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=int(round(fps)))
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(crf)}
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
            container.mux(stream.encode())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def read_mp4(path: Union[str, os.PathLike]) -> np.ndarray:
    """Frames [T, H, W, 3] uint8 of a video file (for tests and quality checks)."""
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
