"""Where transformers' image-text-to-text models keep the parts mmgen reads, across families."""

from __future__ import annotations

import inspect
from typing import Any, Optional


def text_trunk(model: Any) -> Any:
    """The language model's decoder stack: `model.model.language_model` (every family served
    but one), or `model.model.text_model` (Idefics3 / SmolVLM)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def image_token_id(config: Any) -> Optional[int]:
    """The prompt token that image features replace (`image_token_id`, or LLaVA's older
    `image_token_index`); None for a config with neither."""
    value = getattr(config, "image_token_id", None)
    return getattr(config, "image_token_index", None) if value is None else value


def video_token_id(config: Any) -> Optional[int]:
    """The prompt token that video features replace (`video_token_id`, or LLaVA-OneVision's
    `video_token_index`); None for a config with neither."""
    value = getattr(config, "video_token_id", None)
    return getattr(config, "video_token_index", None) if value is None else value


def visual_token_ids(config: Any) -> list[int]:
    """Every prompt token that visual features replace: the image token and the video token."""
    return [t for t in (image_token_id(config), video_token_id(config)) if t is not None]


def logit_softcap(model: Any) -> Optional[float]:
    """The cap the model's own forward applies to its logits (`tanh(x / cap) * cap`), None when
    it applies none. Read from the forward's code: the text config's `final_logit_softcapping`
    is applied by PaliGemma's forward (PaliGemma 2 sets it) but not by Gemma3's."""
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap is None:
        return None
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return cap
    return cap if "final_logit_softcapping" in source else None
