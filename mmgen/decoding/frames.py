"""Rows of tokens or frames in slots: the tensor helpers the token decoders share.

Tensors carry each row's positions ("slots") on axis 1. A model with `num_codebooks = K > 1`
emits a frame of K tokens per position (codec TTS): tokens, drafts and samples then carry a
codebook axis after the slots ([B, n, K]) and laws [B, n, K, V]; K = 1 is the plain token
case, [B, n] and [B, n, V]. The speculative loop (`speculative.py`) and entropy switching
(`entropy_switch.py`) both decode such rows, with these helpers.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

from mmgen.modeling import DecodeState
from mmgen.sampling import SamplingConfig, invalid_rows


def sampling_per_codebook(sampling: Union[SamplingConfig, Sequence[SamplingConfig]], K: int) -> list[SamplingConfig]:
    """One `SamplingConfig` per codebook: `sampling` repeated K times, or the K configs given
    (ValueError for any other count)."""
    if isinstance(sampling, SamplingConfig):
        return [sampling] * K
    sampling = list(sampling)
    if len(sampling) != K or not all(isinstance(s, SamplingConfig) for s in sampling):
        raise ValueError(f"sampling must be one SamplingConfig or one per codebook ({K}), got {len(sampling)}")
    return sampling


def sampler_probs(sampling: list[SamplingConfig], logits, index: torch.Tensor) -> torch.Tensor:
    """The sampler's float32 probabilities of `logits` at generated-token `index` [B, n]:
    [B, n, V], or [B, n, K, V] for frames (each codebook through its own config)."""
    if len(sampling) == 1:
        return sampling[0].probs(logits, index)
    return torch.stack([s.probs(logits[:, :, c], index) for c, s in enumerate(sampling)], 2)


def rows_with_invalid_laws(p: torch.Tensor) -> torch.Tensor:
    """Which rows [B] of laws `p` [B, ...] have an invalid law anywhere (every token masked,
    or NaN): the rows `raise_if_masked` reports."""
    return invalid_rows(p).flatten(1).any(-1)


def frame_index(index: torch.Tensor, K: int) -> torch.Tensor:
    """A slot index or mask [B, n] over every codebook of a frame ([B, n, K]; unchanged for
    K = 1), to scatter, gather or mask rows of tokens or frames."""
    return index if K == 1 else index[..., None].expand(*index.shape, K)


def gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[b, index[b, i], ...] for t [B, n, ...] and index [B, m]: slots with their trailing axes
    (codebooks, vocabulary) kept."""
    shape = (*index.shape, *t.shape[2:])
    return t.gather(1, index.view(*index.shape, *[1] * (t.ndim - 2)).expand(shape))


def where_slots(mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.where with a [B, n] slot mask over tensors [B, n, ...]."""
    return torch.where(mask.view(*mask.shape, *[1] * (a.ndim - mask.ndim)), a, b)


def complete_frame(complete: Callable, state: DecodeState, sampling: list, slot: torch.Tensor, frame: torch.Tensor,
                   known: torch.Tensor, generator: torch.Generator, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's own completion (`complete`, its `complete_frame`) of codebooks known[b].. of
    `frame` [B, K] from the state after fed slot `slot` [B], each codebook through its sampler
    at generated-token `index` [B, 1]: (frame, the laws [B, K, V] they were drawn from)."""
    probs = lambda logits, c: sampler_probs([sampling[c]], logits, index)
    return complete(state, slot, frame, known, probs, generator)
