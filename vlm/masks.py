"""Attention masks for language models with sliding-window layers, under the core's slot cache.

transformers builds a sliding-window mask from slot indices (`kv_idx > q_idx - window`), which
is a row's token distance only while the row's slots are contiguous. Under speculative
decoding at batch > 1 the `SlotKVCache` leaves masked holes in shorter rows (and a row
restarted by continuous batching sits after masked slots), so a window counted in slots would
hide keys the model sees. Here each key's distance is counted in the row's own kept slots (its
tokens), and the masks are handed over 4-D, which transformers' mask builders pass through
untouched: a dict by layer type for models that mix full and sliding layers (Gemma3, Cohere2),
one tensor for models whose layers are all alike (Mistral).

The cache under these masks holds every slot (full-attention layers only, never transformers'
sliding layers, which cannot rewind past their window), so rejected drafts rewind exactly.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Union

import torch

#: Layer types these masks serve (transformers' `layer_types` names).
FULL, SLIDING = "full_attention", "sliding_attention"


def attention_layers(text_config: Any) -> list[tuple[str, Optional[int]]]:
    """(layer type, window) of each layer of a language model: ("full_attention", None) or
    ("sliding_attention", window). ValueError for layer kinds the slot cache cannot serve
    (chunked attention, linear attention or state-space layers, layers sharing another's cache)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(text_config)
    unknown = sorted({t for t in types if t not in (FULL, SLIDING)})
    if unknown:
        raise ValueError(f"its language model ({text_config.model_type}) has {', '.join(unknown)} layers, which mmgen's "
                         "rewindable cache does not serve (full and sliding-window attention only)")
    return [(t, k.get("sliding_window") if t == SLIDING else None) for t, k in zip(types, kwargs)]


def takes_mask_dict(trunk: Any) -> bool:
    """Whether a language model takes a dict of masks by layer type (transformers' hybrid
    models: `if not isinstance(causal_mask_mapping := attention_mask, dict)`)."""
    try:
        source = inspect.getsource(type(trunk).forward)
    except (OSError, TypeError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in source


def window_masks(mask: torch.Tensor, n: int, layers: list[tuple[str, Optional[int]]], implementation: str,
                 dtype: torch.dtype, as_dict: bool) -> Union[torch.Tensor, dict]:
    """4-D masks [R, 1, n, S] for a forward of the last `n` slots of `mask` [R, S] (each row's
    kept slots): causal in slots, and for a sliding layer of window w a query sees the keys
    fewer than w of the row's own tokens back (itself included), as transformers' window
    `kv_idx > q_idx - w` over a contiguous row. Boolean for SDPA, additive for eager."""
    if implementation not in ("sdpa", "eager"):
        raise ValueError(f"sliding-window layers decode under the sdpa or eager attention here, not {implementation!r} "
                         "(load the model with attn_implementation='sdpa')")
    slots = mask.shape[1]
    rank = mask.long().cumsum(1)  # 1-based count of the row's kept slots up to each slot
    query = rank[:, slots - n:, None]  # [R, n, 1]
    causal = torch.ones(n, slots, dtype=torch.bool, device=mask.device).tril(slots - n)
    base = mask[:, None, :] & causal
    windows = dict(layers)
    if len(windows) < len(set(layers)):
        raise ValueError("its language model has sliding-window layers of several widths, which mmgen does not serve")
    out = {}
    for kind, window in windows.items():
        seen = base if window is None else base & (rank[:, None, :] > query - window)
        seen = seen[:, None]
        if implementation == "eager":
            seen = torch.zeros(seen.shape, dtype=dtype, device=mask.device).masked_fill(~seen, torch.finfo(dtype).min)
        out[kind] = seen
    if len(out) == 1 and not as_dict:
        return next(iter(out.values()))
    if not as_dict:
        raise ValueError("its language model mixes full and sliding-window layers but takes one attention mask")
    return out
