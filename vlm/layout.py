"""Where transformers' image-text-to-text models keep the parts mmgen reads, across families.

`TextModelLayout` states what `VLMTokenModel` reads of a text family's model; `check_layout`
refuses a model that lacks a part of it, in one line naming the part, when it is wrapped.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Protocol

import torch


class TextModelLayout(Protocol):
    """What `VLMTokenModel` reads of a transformers image-text-to-text model (every family
    `mmgen.vlm` registers has it; a new one must): the inner `model` holding the language model's
    decoder stack as `language_model` (or `text_model`: Idefics3 / SmolVLM; `text_trunk`), the
    `lm_head` (a Linear: its weight's shape is the vocabulary and the hidden width), the input
    embeddings, the `config` whose `get_text_config()` is the language model's, and the
    `generation_config` (its logits processing; optional)."""

    model: Any
    lm_head: torch.nn.Linear
    config: Any

    def get_input_embeddings(self) -> torch.nn.Module: ...


#: The parts `check_layout` looks up, dotted; "a | b": either one.
LAYOUT_PARTS = ("model.language_model | model.text_model", "lm_head.in_features", "lm_head.out_features",
                "get_input_embeddings", "config.get_text_config")


def _missing(obj: Any, path: str) -> Optional[str]:
    """The first prefix of dotted `path` that `obj` lacks ("lm_head" for a model without one), or None."""
    parts = path.split(".")
    for end, name in enumerate(parts, 1):
        if not hasattr(obj, name):
            return ".".join(parts[:end])
        obj = getattr(obj, name)
    return None


def check_layout(model: Any) -> None:
    """ValueError, in one line naming what is missing, unless `model` has every part of
    `TextModelLayout` (`LAYOUT_PARTS`): before any decoding, instead of an AttributeError inside it."""
    missing = []
    for part in LAYOUT_PARTS:
        gaps = [_missing(model, path.strip()) for path in part.split("|")]
        if all(gaps):
            missing.append(" or ".join(gaps))
    if missing:
        raise ValueError(f"the text model {type(model).__name__} lacks {', '.join(dict.fromkeys(missing))}, which mmgen "
                         "reads (mmgen.vlm.layout.TextModelLayout)")


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
