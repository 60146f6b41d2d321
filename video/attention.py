"""Attention processors that make diffusers' Wan transformer block-causal, without editing it.

`WanTransformer3DModel` runs every attention through a swappable processor. During a
block-diffusion decode, `CachedSelfAttention` (each block's `attn1`) writes the block's keys and
values after the committed frames of a `FrameKVCache` and attends to both, with rotary
positions that start at the block's frame offset; `CachedCrossAttention` (`attn2`) keeps each
layer's prompt keys and values until the prompt changes. `MaskedSelfAttention` is the same
model over a whole sequence with a block-causal mask: the reference the cached decode equals,
and what training uses. `processors_installed` swaps them in for one call and restores the
model's own processors afterwards, also on error.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from mmgen.cache import FrameKVCache


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of x [B, S, H, D] with tables [1, S, 1, D] (interleaved pairs),
    computed in the tables' dtype (float64 on CUDA/CPU) as diffusers' processor does."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


def rotary_tables(transformer: Any, num_frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, num_frames · h · w, 1, D] of latent frames 0 … num_frames − 1 at a latent
    size of height × width (temporal patch 1), from the model's own `rope` module (which reads
    only the shape)."""
    shape_only = torch.empty(1, 1, 1, 1, 1, device=transformer.rope.freqs_cos.device).expand(1, 1, num_frames, height, width)
    return transformer.rope(shape_only)


def _heads(attn: Any, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(2, (attn.heads, -1))


def _attend(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    out = dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    out = out.flatten(2, 3).type_as(q)
    return attn.to_out[1](attn.to_out[0](out))


@dataclass
class BlockContext:
    """What the processors of one decode share: the cache, this forward's rotary tables, and the
    prompt's cached cross-attention keys and values (valid for `prompt_version`)."""

    cache: FrameKVCache
    rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    dropping: Any = None  # a `video.dropping.DroppingState` whose `active` tokens are the only queries
    prompt_version: int = 0
    cross: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class ContextSlot:
    """Where installed processors find the current decode's `BlockContext` (set by `start`)."""

    context: Optional[BlockContext] = None


class CachedSelfAttention:
    """`attn1` of layer `layer`: the block's queries against the cache's keys and its own."""

    def __init__(self, layer: int, slot: ContextSlot):
        self.layer, self.slot = layer, slot

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        context = self.slot.context
        q = _heads(attn, attn.norm_q(attn.to_q(hidden_states)))
        k = _heads(attn, attn.norm_k(attn.to_k(hidden_states)))
        v = _heads(attn, attn.to_v(hidden_states))
        active = None if context.dropping is None else context.dropping.active
        keys, values = context.cache.update(self.layer, k, v, active)
        cos, sin = context.rotary
        if active is None:
            n = q.shape[1]
            q = rotate(q, cos[:, -n:], sin[:, -n:])
        else:  # the block's active tokens only, at their own positions
            rows = active + keys.shape[1] - context.cache.block_frames * context.cache.tokens_per_frame
            q = rotate(q, cos[:, rows], sin[:, rows])
        return _attend(attn, q, rotate(keys, cos, sin), values)


class CachedCrossAttention:
    """`attn2` of layer `layer`: the prompt's keys and values are computed once per prompt."""

    def __init__(self, layer: int, slot: ContextSlot):
        self.layer, self.slot = layer, slot

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attn.add_k_proj is not None:
            raise ValueError("image-conditioned Wan (I2V) cross-attention is not supported by block diffusion yet")
        context = self.slot.context
        q = _heads(attn, attn.norm_q(attn.to_q(hidden_states)))
        cached = context.cross.get(self.layer)
        if cached is None or cached[0] != context.prompt_version:
            k = _heads(attn, attn.norm_k(attn.to_k(encoder_hidden_states)))
            v = _heads(attn, attn.to_v(encoder_hidden_states))
            cached = context.cross[self.layer] = (context.prompt_version, k, v)
        return _attend(attn, q, cached[1], cached[2])


class MaskedSelfAttention:
    """`attn1` over a whole sequence with a boolean mask [S, S] (True: may attend) and the
    model's own rotary embedding; `mask=None` is the model's bidirectional attention. `mask`
    may also be an object whose `.mask` is read at each call (a model whose sequence grows)."""

    def __init__(self, mask: Any):
        self.source = mask

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        mask = self.source if self.source is None or isinstance(self.source, torch.Tensor) else self.source.mask
        q = rotate(_heads(attn, attn.norm_q(attn.to_q(hidden_states))), *rotary_emb)
        k = rotate(_heads(attn, attn.norm_k(attn.to_k(hidden_states))), *rotary_emb)
        v = _heads(attn, attn.to_v(hidden_states))
        return _attend(attn, q, k, v, mask)


def block_causal_mask(num_frames: int, block_frames: int, tokens_per_frame: int, device=None) -> torch.Tensor:
    """[S, S] bool: a token sees every token of its own block and of earlier blocks."""
    block = torch.arange(num_frames, device=device).repeat_interleave(tokens_per_frame) // block_frames
    return block[None, :] <= block[:, None]


@contextmanager
def processors_installed(transformer: Any, make_self, make_cross=None) -> Iterator[None]:
    """Give layer i's `attn1` the processor `make_self(i)` (and `attn2` `make_cross(i)`) for the
    duration of the block; the model's own processors come back afterwards."""
    saved = [(block.attn1.processor, block.attn2.processor) for block in transformer.blocks]
    try:
        for i, block in enumerate(transformer.blocks):
            block.attn1.set_processor(make_self(i))
            if make_cross is not None:
                block.attn2.set_processor(make_cross(i))
        yield
    finally:
        for block, (p1, p2) in zip(transformer.blocks, saved):
            block.attn1.set_processor(p1)
            block.attn2.set_processor(p2)
