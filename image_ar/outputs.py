"""Image pipelines' shared input checks and outputs: prompts in, pixels out as the requested type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence, Union

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


class ClassLabelled:
    """What class-conditional pipelines share: class ids or names in, checked ids out.

    A subclass sets `class_names` (or None) and `num_classes`.
    """

    class_names: Optional[list[str]]
    num_classes: int

    def class_index(self, label: Union[int, str]) -> int:
        """A class id from an id or a class name ("cat-face"); ValueError for anything else."""
        if isinstance(label, str) and label.lstrip("-").isdigit():
            label = int(label)
        if isinstance(label, str):
            if self.class_names is None or label not in self.class_names:
                known = ", ".join(self.class_names[:12]) + ", ..." if self.class_names else "none (this model has no class names)"
                raise ValueError(f"unknown class name {label!r}; known names: {known}")
            return self.class_names.index(label)
        return self.check_class_labels([label])[0]

    def check_class_labels(self, class_labels: Union[int, Sequence[int]]) -> list[int]:
        """A non-empty list of class ids in [0, num_classes); ValueError otherwise."""
        labels = [class_labels] if isinstance(class_labels, int) else list(class_labels)
        if not labels:
            raise ValueError("class_labels is empty: give at least one class id")
        for label in labels:
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < self.num_classes:
                raise ValueError(f"invalid class id {label!r}: expected an integer in [0, {self.num_classes})")
        return labels

    def check_class_names(self, class_names: Optional[Sequence[str]]) -> Optional[list[str]]:
        if class_names is not None and len(class_names) != self.num_classes:
            raise ValueError(f"{len(class_names)} class names for {self.num_classes} classes")
        return list(class_names) if class_names is not None else None

    def pipeline_config(self) -> dict:
        config = super().pipeline_config()
        if self.class_names is not None:
            config["class_names"] = self.class_names
        return config


class SamplingDefaults:
    """Pipelines whose sampler options default to the official sampler's (`official_sampling`)
    unless the pipeline was saved with its own; only the differences are saved."""

    official_sampling: ClassVar[dict]

    def set_sampling_defaults(self, sampling_defaults: Optional[dict]) -> None:
        unknown = sorted(set(sampling_defaults or {}) - set(self.official_sampling))
        if unknown:
            raise ValueError(f"unknown sampling defaults {unknown}; allowed: {sorted(self.official_sampling)}")
        self.sampling_defaults = {**self.official_sampling, **(sampling_defaults or {})}

    def pipeline_config(self) -> dict:
        config = super().pipeline_config()
        config["sampling_defaults"] = {k: v for k, v in self.sampling_defaults.items() if self.official_sampling[k] != v}
        return config


def check_image_size(image_size: Optional[int], supported: int, detail: str = "") -> None:
    """None or the model's own size; ValueError otherwise (`detail` explains the size)."""
    if image_size is None:
        return
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    if image_size != supported:
        raise ValueError(f"image_size {image_size} is not supported by this model: it generates {supported}px images{detail}")


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
