"""Draft initialisers: where a Jacobi window's fresh draft slots come from.

A speculative decoder stays lossless whatever its drafts are, provided each draft is scored
with the law q it was drawn from. Deterministic drafts (a copied neighbour) have a one-hot q
on the copied token, so they are accepted with probability p(token); the SJD paper's random
drafts have a one-hot q on the uniform draw. Spatial initialisation follows the observation
of LANTERN/ZipAR-style image decoders that neighbouring image tokens are often alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mmgen.decoding.frames import gather_slots, where_slots
from mmgen.sampling import one_hot, randint


@dataclass
class DraftContext:
    """What an initialiser may look at when filling the `fresh` slots of a window.

    window [B, L(, K)]: slot 0 holds each row's newest finalised token, later slots carried drafts
    (fresh slots hold junk); fresh [B, L] bool marks the slots to fill (never slot 0);
    positions [B, L] the generated-token index of each slot; tokens [B, T(, K)] the finalised tokens
    (valid up to positions[:, 0]); row_length the image width in tokens when the model has one.
    """

    window: torch.Tensor
    fresh: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    vocab_size: int
    generator: torch.Generator
    row_length: Optional[int] = None


class DraftInit:
    """Base class: `propose(ctx) -> tokens [B, L]`, read where `ctx.fresh`, and `laws(tokens, V)`
    the laws [..., V] they were drawn from (one-hot on each token unless a subclass says);
    `__call__(ctx)` gives both. The Jacobi proposer takes the laws of the fresh slots only."""

    def __call__(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.propose(ctx)
        return tokens, self.laws(tokens, ctx.vocab_size)

    def propose(self, ctx: DraftContext) -> torch.Tensor:
        raise NotImplementedError

    def laws(self, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return one_hot(tokens, vocab_size)


@dataclass(frozen=True)
class RandomDraftInit(DraftInit):
    """Drafts drawn uniformly from the vocabulary.

    `law="one-hot"` (SJD, arXiv 2410.01699) scores a draft x with q one-hot on x, so it is
    accepted with probability p(x); `law="uniform"` scores it with the law it was really drawn
    from, q = 1/V, so it is accepted with probability min(1, V p(x)). Both are lossless;
    averaged over the draw, uniform accepts sum_y min(1/V, p(y)) >= 1/V.
    """

    law: str = "one-hot"

    def __post_init__(self):
        if self.law not in ("one-hot", "uniform"):
            raise ValueError(f"law must be 'one-hot' or 'uniform', got {self.law!r}")

    def laws(self, tokens, vocab_size):
        if self.law == "one-hot":
            return one_hot(tokens, vocab_size)
        return torch.full((*tokens.shape, vocab_size), 1.0 / vocab_size, device=tokens.device)

    def propose(self, ctx):
        return randint(ctx.vocab_size, ctx.window.shape, ctx.generator, ctx.window.device)


@dataclass(frozen=True)
class LeftNeighbourInit(DraftInit):
    """Copy the nearest known token to the left (finalised or carried draft); q one-hot."""

    def propose(self, ctx):
        return _copy_left(ctx.window, ctx.fresh)


@dataclass(frozen=True)
class AboveNeighbourInit(DraftInit):
    """Copy the finalised token one image row above (raster order); where that row is not
    finalised yet, copy the left neighbour. `row_length` defaults to the model's."""

    row_length: Optional[int] = None

    def propose(self, ctx):
        width = self.row_length or ctx.row_length
        if not width:
            raise ValueError("AboveNeighbourInit needs a row length: the model has none, pass row_length=")
        above = ctx.positions - width
        known = (above >= 0) & (above <= ctx.positions[:, :1])
        copied = gather_slots(ctx.tokens, above.clamp(0, ctx.tokens.shape[1] - 1))
        return where_slots(known, copied, _copy_left(ctx.window, ctx.fresh))


def _copy_left(window: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Each slot's value, or for a fresh slot the value of the nearest non-fresh slot left of it
    (frames [B, L, K]: the whole frame)."""
    slots = torch.arange(window.shape[1], device=window.device).expand_as(fresh)
    source = torch.where(fresh, 0, slots).cummax(1).values
    return gather_slots(window, source)


#: String names accepted by the decoders' `draft_init=`.
DRAFT_INITS = {
    "random": RandomDraftInit,
    "random-uniform": lambda: RandomDraftInit(law="uniform"),
    "left": LeftNeighbourInit,
    "above": AboveNeighbourInit,
}


def resolve_draft_init(init) -> DraftInit:
    if isinstance(init, DraftInit):
        return init
    if isinstance(init, str) and init in DRAFT_INITS:
        return DRAFT_INITS[init]()
    raise ValueError(f"unknown draft_init {init!r}: use one of {sorted(DRAFT_INITS)} or a DraftInit object")
