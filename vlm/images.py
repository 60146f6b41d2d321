"""A VLM's image inputs: files read as RGB images, and a call's images checked before any work."""

from __future__ import annotations

import os
from typing import Any, Optional, Union


def read_image(path: Union[str, os.PathLike], label: Optional[str] = None, max_pixels: Optional[int] = None):
    """The RGB image of a file. ValueError "<label>: not a readable image" (label default
    "--image PATH") when it is not one, or naming its size when it has more than `max_pixels`
    (checked before the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    label = f"--image {path}" if label is None else label
    try:
        with Image.open(path) as image:
            if max_pixels is not None and image.size[0] * image.size[1] > max_pixels:
                raise ValueError(f"an image may have at most {max_pixels} pixels, got {image.size[0]}x{image.size[1]}")
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as error:
        raise ValueError(f"{label}: not a readable image ({error.__class__.__name__})") from None


def as_image(value: Any, label: str) -> Any:
    """An image a processor takes: a PIL image, a numpy array or a torch tensor as given, a
    file path read (`read_image`); ValueError naming `label` for anything else."""
    import numpy as np
    import torch
    from PIL import Image

    if isinstance(value, (str, os.PathLike)):
        return read_image(value, f"{label} ({os.fspath(value)})")
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim in (2, 3) and 0 not in value.shape:
        return value
    raise ValueError(f"{label} must be a PIL image, an image array [H, W, C] or a file path, got {type(value).__name__}")
