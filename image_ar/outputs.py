"""Image pipelines' shared input checks and outputs: prompts in, pixels out as the requested type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch
from PIL import Image

from mmgen.decoding import DecodeStats

OUTPUT_TYPES = ("pil", "np", "pt")


@dataclass
class ImageGenerationOutput:
    """`images` (PIL list, uint8 array [B, H, W, 3] or float tensor [B, 3, H, W] in [0, 1]),
    the generated `tokens` and the decoder's `stats`."""

    images: Union[list, np.ndarray, torch.Tensor]
    tokens: torch.Tensor
    stats: DecodeStats


def check_prompts(prompt) -> list[str]:
    """A list of non-empty prompt strings from one string or a list; ValueError otherwise."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompt must be a string or a list of strings, got {type(prompt).__name__}")
    if not prompts:
        raise ValueError("prompt is an empty list: give at least one prompt")
    for p in prompts:
        if not isinstance(p, str):
            raise ValueError(f"invalid prompt {p!r}: every prompt must be a string, got {type(p).__name__}")
        if not p.strip():
            raise ValueError("empty prompt: describe the image to generate")
    return list(prompts)


def check_output_type(output_type: str) -> None:
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"output_type must be one of {OUTPUT_TYPES}, got {output_type!r}")


def postprocess(pixels: torch.Tensor, output_type: str) -> Any:
    """Decoder output in [-1, 1] (clamped, as the official `save_image(normalize=True)`)."""
    images = ((pixels.float().clamp(-1, 1) + 1) / 2).cpu()
    if output_type == "pt":
        return images
    array = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    if output_type == "np":
        return array
    return [Image.fromarray(a) for a in array]
