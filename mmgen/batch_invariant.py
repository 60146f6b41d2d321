"""Batch-invariant attention for transformers models: a row attends over exactly its own keys.

A shared batch (continuous batching, a static batch) pads rows to one key axis: the prompts'
left padding, the text's right padding, the slots other rows took before a row joined
(`mmgen.cache.SlotKVCache`). Masked keys add exact zeros, yet a reduction over a longer axis,
or over the same keys at other indices, rounds differently (the kernels block and vectorise by
index and length), and a sampled draw near a boundary then flips: a request served beside
others would not be the request decoded alone with its seed. "Defeating Nondeterminism in LLM
Inference" (He et al., Thinking Machines Lab, 2025) traces serving nondeterminism to the same
source and calls the cure batch invariance.

`ROWWISE` is an attention implementation (transformers' `AttentionInterface`) that gathers each
row's visible keys (those its mask lets any of its queries see, in slot order) and runs
transformers' own SDPA attention on that row alone, with its mask cut to them (on a CPU, rows
whose masks are equal share one call: its kernels reduce each row on its own); its mask
function always materialises the boolean mask, so a row alone and a row in a batch take the
same kernel path over the same keys in the same order. The rest of a transformer (linear
layers, norms) already computes each row on its own. `rowwise(model)` switches a model to it
for a block of mmgen's forwards and back, so the model object is left as it was found (a
trainer's eager attention, a user's own `generate`).

Cost: one SDPA call per distinct mask (CPU) or per row (GPU) and layer instead of one per
layer, and a gather of the keys: a few percent of a small model's decode step on a CPU (where
every row shares one mask, as a guided batch of one does, the rows go to SDPA as they are,
with no grouping or copies); on a GPU, where one batched kernel is the point, use it where
exactness per request matters (a server's sampled answers).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from mmgen.inference import version

#: The attention implementation's name in transformers' registries.
ROWWISE = "mmgen_rowwise"


def rowwise_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, one row at a time over that row's visible keys. `query`
    [B, H, q, D], `key` / `value` [B, Hkv, k, D], `attention_mask` bool [B, 1, q, k] (True:
    visible) or None (every key visible, causal where the module is)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, q, k = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) and kwargs.get("is_causal", True) is not False
        visible = torch.ones(q, k, dtype=torch.bool, device=query.device)
        if causal:  # bottom-right aligned: the last query sees every key
            visible = visible.tril(k - q)
        attention_mask = visible.expand(B, 1, q, k)
    kwargs = {name: v for name, v in kwargs.items() if name != "is_causal"}
    masks = attention_mask if attention_mask.shape[0] == B else attention_mask.expand(B, -1, -1, -1)
    out = None
    for rows, at, keep in row_groups(attention_mask, masks, query.device):
        whole = len(rows) == B  # every row in one call (lockstep rows, a guided batch of one): no copies
        if whole:
            take = lambda t: t
        elif at is None:  # one row: views of it (made contiguous below)
            take = lambda t: t[rows[0] : rows[0] + 1]
        else:  # copies, as indexing makes them
            take = lambda t: t[at]
        mask, keys, values = take(masks), take(key), take(value)
        if keep is not None:  # gathered, contiguous and in slot order, as the keys of a row alone are
            keys, values, mask = keys[:, :, keep], values[:, :, keep], mask[..., keep]
        # Contiguous whichever way they came: one layout, so SDPA takes one kernel path for a row
        # alone and in any group.
        part, _ = sdpa_attention_forward(module, take(query).contiguous(), keys.contiguous(), values.contiguous(),
                                         mask.contiguous(), is_causal=False, **kwargs)
        if whole:
            return part, None
        if out is None:
            out = part.new_empty(B, *part.shape[1:])
        out[rows[0] if at is None else at] = part[0] if at is None else part
    return out, None


def row_groups(attention_mask: torch.Tensor, masks: torch.Tensor, device: torch.device) -> list[tuple]:
    """How the rows of `masks` [B, 1, q, k] go to SDPA: (rows, their index tensor (None for one
    row), the keys they see (None: all of them)) per call. Every layer of a forward gets the
    same mask tensor, so the answer (one host read) is kept on the tensor for the later layers
    (until the tensor changes in place)."""
    memo = getattr(attention_mask, "_mmgen_row_groups", None)  # an inference tensor: version -1, made per forward
    if memo is not None and memo[0] == (version(attention_mask), tuple(masks.shape)):
        return memo[1]
    B = masks.shape[0]
    if B == 1 or device.type == "cuda":  # on a GPU a kernel may split by batch size: row by row
        groups = [[b] for b in range(B)]
    elif bool((masks == masks[:1]).all()):  # lockstep rows (a guided batch of one): one call, no grouping
        groups = [list(range(B))]
    else:
        # On a CPU each (row, head) is reduced on its own whatever the batch, so rows with the
        # same mask (lockstep rows of one prompt length) share one call, as they would alone.
        _, group_of = torch.unique(masks.reshape(B, -1), dim=0, return_inverse=True)
        by_group: dict = {}
        for b, g in enumerate(group_of.tolist()):
            by_group.setdefault(g, []).append(b)
        groups = list(by_group.values())
    # The keys each row's queries see, and whether that is all of them: one host read for all rows.
    seen_by_row = masks.any(dim=(1, 2))  # [B, k]
    sees_all = seen_by_row.all(-1).tolist()
    calls = [(rows, None if len(rows) == 1 or len(rows) == B else torch.tensor(rows, device=device),
              None if sees_all[rows[0]] else seen_by_row[rows[0]].nonzero().flatten()) for rows in groups]
    attention_mask._mmgen_row_groups = ((version(attention_mask), tuple(masks.shape)), calls)
    return calls


def rowwise_mask(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """transformers' SDPA mask, always materialised (never skipped for `is_causal`), so every
    row has an explicit boolean mask whatever the batch holds."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


_registered = False


def register() -> None:
    """Register `ROWWISE` with transformers' attention and mask interfaces (once per process)."""
    global _registered
    if _registered:
        return
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ROWWISE, rowwise_attention)
    AttentionMaskInterface.register(ROWWISE, rowwise_mask)
    _registered = True


@contextlib.contextmanager
def rowwise(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every attention of `model` (its config and sub-configs) is `ROWWISE`;
    afterwards each config has its own implementation back."""
    register()
    configs = [model.config, *(getattr(model.config, name) for name in model.config.sub_configs
                               if getattr(model.config, name, None) is not None)]
    before = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = ROWWISE
    try:
        yield
    finally:
        for config, implementation in zip(configs, before):
            config._attn_implementation = implementation
