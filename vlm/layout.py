"""Where transformers' image-text-to-text models keep the parts mmgen reads, across families."""

from __future__ import annotations

from typing import Any, Optional


def text_trunk(model: Any) -> Any:
    """The language model's decoder stack: `model.model.language_model` (LLaVA, LLaVA-NeXT,
    Qwen2-VL / Qwen2.5-VL), or `model.model.text_model` (Idefics3 / SmolVLM)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def image_token_id(config: Any) -> Optional[int]:
    """The prompt token that image features replace (`image_token_id`, or LLaVA's older
    `image_token_index`); None for a config with neither."""
    value = getattr(config, "image_token_id", None)
    return getattr(config, "image_token_index", None) if value is None else value
