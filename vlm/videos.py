"""A VLM's video inputs: a call's videos checked (or a local file decoded through PyAV) before any work.

A video is a sequence of frames (PIL images or [H, W, 3] uint8 arrays, each read as an image
is: `mmgen.vlm.images.as_image`), a [T, H, W, 3] uint8 array or tensor, a local video file's
path, or a `Video` (frames with their frame rate). Each becomes one `Video`: a [T, H, W, 3]
uint8 numpy array (what every video processor takes), its frames all of one size, bounded in
frame count and pixels, and its frames per second where known (a file's own rate); URLs are
never fetched.

The frame rate matters to Qwen2.5-VL and Qwen3-VL, which place video tokens in time by it
(M-RoPE's temporal positions, Qwen3-VL's timestamps): the processor reads it from the video's
metadata, and takes 24 frames per second where none is given (transformers' `VideoMetadata`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

#: Frames per video, at most (Qwen3-VL's processor samples at most 768).
MAX_FRAMES = 768
#: Pixels of one frame, at most (4096 x 4096).
MAX_FRAME_PIXELS = 1 << 24
#: Pixels of one video over all its frames, at most (768 frames of 640 x 480 fit).
MAX_VIDEO_PIXELS = 1 << 28


@dataclass(frozen=True)
class Video:
    """A video's frames [T, H, W, 3] (uint8 numpy, or any form `as_video` takes) and its frames
    per second (None: unknown, the processor's default)."""

    frames: Any
    fps: Optional[float] = None

    def metadata(self) -> dict:
        """transformers' `VideoMetadata` fields for the processor: every frame is a sampled frame."""
        return {"total_num_frames": len(self.frames), "fps": self.fps, "frames_indices": list(range(len(self.frames)))}


def video_input(model_type: Optional[str]) -> Optional[str]:
    """How a text family takes video (its registered capability "video": "separate" or
    "stacked"), or None when mmgen takes no video input for it."""
    from mmgen import registry

    family = registry.family("text", model_type) if isinstance(model_type, str) else None
    return None if family is None else family.capabilities.get("video")


def video_families() -> list[str]:
    """The registered text families that take video input."""
    from mmgen import registry

    return [name for name, family in registry.families("text").items() if family.capabilities.get("video")]


def video_family_check(model_type: Optional[str]) -> None:
    """ValueError naming `model_type` when mmgen takes no video input for it."""
    if video_input(model_type) is None:
        raise ValueError(f"model_type {model_type!r} takes no video input in mmgen (videos go to {', '.join(video_families())})")


def video_batch_check(model_type: str, videos: list) -> None:
    """ValueError when a family that stacks a batch's videos gets videos of several frame counts."""
    counts = sorted({len(v.frames) for v in videos})
    if video_input(model_type) == "stacked" and len(counts) > 1:
        raise ValueError(f"{model_type} takes a batch's videos at one frame count only, got {counts} frames: give them "
                         "in separate calls (or answer_each, each prompt alone)")


def is_frame(value: Any) -> bool:
    """A PIL image or an [H, W, C] array / tensor: one frame of a video given as a sequence."""
    import numpy as np
    import torch
    from PIL import Image

    return isinstance(value, Image.Image) or (isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 3)


def is_video(value: Any) -> bool:
    """One video, not a list of them: a file path, a 4-D array / tensor, or a non-empty
    sequence of frames."""
    import numpy as np
    import torch

    if isinstance(value, (str, os.PathLike, Video)):
        return True
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return value.ndim == 4
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(is_frame(f) for f in value)


def as_video(value: Any, label: str, max_frames: int = MAX_FRAMES, max_pixels: int = MAX_VIDEO_PIXELS) -> Video:
    """A video (see the module) as a `Video` of a [T, H, W, 3] uint8 numpy array; ValueError
    naming `label` for anything else: a wrong type, no frames, frames of different sizes, a dtype
    other than uint8, more than `max_frames` frames or `max_pixels` pixels, a frame rate that is
    not a positive number."""
    if isinstance(value, Video):
        fps = value.fps
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf")):
            raise ValueError(f"{label}'s fps must be a positive number, got {fps!r}")
        return Video(_frames(value.frames, label, max_frames, max_pixels), None if fps is None else float(fps))
    if isinstance(value, (str, os.PathLike)):
        return read_video(value, f"{label} ({os.fspath(value)})", max_frames, max_pixels)
    return Video(_frames(value, label, max_frames, max_pixels))


def _frames(value: Any, label: str, max_frames: int, max_pixels: int):
    """`as_video`'s frames: the [T, H, W, 3] uint8 numpy array of frames given in any form."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray) and value.ndim == 4:  # one array: its frames are of one size
        if value.shape[0] == 0:
            raise ValueError(f"{label} has no frames")
        if value.shape[-1] != 3 or value.dtype != np.uint8:
            raise ValueError(f"{label} must be a [T, H, W, 3] uint8 array, got shape {list(value.shape)} of {value.dtype}")
        if value.shape[0] > max_frames:
            raise ValueError(f"{label} has {value.shape[0]} frames; a video may have at most {max_frames}")
        if value.shape[1] * value.shape[2] > MAX_FRAME_PIXELS:
            raise ValueError(f"{label}'s frames have {_size(value[0])} pixels; a frame may have at most {MAX_FRAME_PIXELS}")
        _check_pixels(label, value.shape[0], value.shape[2], value.shape[1], max_pixels)
        return np.ascontiguousarray(value)
    if isinstance(value, (list, tuple)) and all(is_frame(f) for f in value):
        frames = list(value)
    else:
        kind = f"{value.ndim}-D array" if isinstance(value, np.ndarray) else type(value).__name__
        raise ValueError(f"{label} must be a list of frames (PIL images or [H, W, 3] uint8 arrays), a [T, H, W, 3] uint8 "
                         f"array or a video file path, got {kind}")
    if not frames:
        raise ValueError(f"{label} has no frames")
    if len(frames) > max_frames:
        raise ValueError(f"{label} has {len(frames)} frames; a video may have at most {max_frames}")
    arrays = []
    for i, frame in enumerate(frames):
        frame = _frame_array(frame, f"{label}'s frame {i}")
        if arrays and frame.shape != arrays[0].shape:
            raise ValueError(f"{label}'s frames differ in size: frame 0 is {_size(arrays[0])}, frame {i} is {_size(frame)}")
        arrays.append(frame)
    _check_pixels(label, len(arrays), arrays[0].shape[1], arrays[0].shape[0], max_pixels)
    return np.stack(arrays)


def read_video(path: Union[str, os.PathLike], label: Optional[str] = None, max_frames: int = MAX_FRAMES,
               max_pixels: int = MAX_VIDEO_PIXELS) -> Video:
    """The frames of a local video file as a [T, H, W, 3] uint8 array, decoded through PyAV,
    with the stream's average frame rate. Only a regular file is opened (no URL, device or
    FIFO); the frame size is checked before any frame is decoded and the count while decoding,
    so a bound stops the read early."""
    import av
    import numpy as np

    label = f"video {os.fspath(path)}" if label is None else label
    if not os.path.isfile(path):
        raise ValueError(f"{label}: not a readable video (not a file)")
    frames = []
    try:
        with av.open(os.fspath(path), mode="r") as container:
            if not container.streams.video:
                raise ValueError(f"{label}: not a readable video (no video stream)")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate and float(rate) > 0 else None
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > MAX_FRAME_PIXELS:
                raise ValueError(f"{label}: a frame may have at most {MAX_FRAME_PIXELS} pixels, got {width}x{height}")
            for frame in container.decode(stream):
                if len(frames) == max_frames:
                    raise ValueError(f"{label} has more than {max_frames} frames; a video may have at most {max_frames}")
                frames.append(frame.to_ndarray(format="rgb24"))
                _check_pixels(label, len(frames), frames[0].shape[1], frames[0].shape[0], max_pixels)
    except (av.FFmpegError, OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{label}: not a readable video ({error.__class__.__name__})") from None
    if not frames:
        raise ValueError(f"{label} has no frames")
    if any(f.shape != frames[0].shape for f in frames):
        raise ValueError(f"{label}'s frames differ in size")
    return Video(np.stack(frames), fps)


def _frame_array(frame: Any, label: str):
    """One frame as an [H, W, 3] uint8 array, read as an image (`as_image`), bounded in pixels."""
    import numpy as np
    import torch
    from PIL import Image

    from mmgen.vlm.images import as_image

    frame = as_image(frame, label)
    if isinstance(frame, Image.Image):
        if frame.width * frame.height > MAX_FRAME_PIXELS:
            raise ValueError(f"{label} has {frame.width}x{frame.height} pixels; a frame may have at most {MAX_FRAME_PIXELS}")
        return np.asarray(frame.convert("RGB"))
    array = frame.detach().cpu().numpy() if isinstance(frame, torch.Tensor) else frame
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise ValueError(f"{label} must be an [H, W, 3] uint8 array, got shape {list(array.shape)} of {array.dtype}")
    if array.shape[0] * array.shape[1] > MAX_FRAME_PIXELS:
        raise ValueError(f"{label} has {_size(array)} pixels; a frame may have at most {MAX_FRAME_PIXELS}")
    return array


def _check_pixels(label: str, frames: int, width: int, height: int, max_pixels: int) -> None:
    if frames * width * height > max_pixels:
        raise ValueError(f"{label} has {frames} frames of {width}x{height}, more than {max_pixels} pixels in all")


def _size(array) -> str:
    return f"{array.shape[1]}x{array.shape[0]}"


def __getattr__(name: str) -> Any:
    # The old tuples, read from the registry now (a family's "video" capability).
    if name == "VIDEO_FAMILIES":
        return tuple(video_families())
    if name == "STACKED_VIDEOS":
        return tuple(f for f in video_families() if video_input(f) == "stacked")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
