"""Prompt lookup: drafts copied from the context where its last n-gram occurred before.

Prompt lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`) drafts the
tokens that followed the most recent earlier occurrence of the context's last n tokens, trying
n = `max_ngram` down to 1. Text that quotes or repeats its prompt (VLM answers, code, lists)
accepts long runs of such drafts. The drafts are deterministic, so their law is one-hot and
any lossless rule keeps the output exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.base import check_int
from mmgen.decoding.speculative import DecodeRun, Proposer, SpeculativeDecoder
from mmgen.decoding.window import resolve_adaptive
from mmgen.sampling import one_hot


def lookup_drafts(sequence: torch.Tensor, length: torch.Tensor, num_draft: int,
                  max_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of `sequence` [B, S] (valid up to `length` [B]), the `num_draft` tokens after
    the latest earlier match of its last n tokens (longest n first), and [B] whether it had a
    match; rows with no match repeat their last token. Positions past a row's valid tokens are
    never read as context. Frames [B, S, K] match only whole (every codebook), and the drafts
    are frames [B, num_draft, K]."""
    if sequence.ndim == 2:
        at, found = lookup_positions(sequence, length, num_draft, max_ngram)
        return sequence.gather(1, at), found
    frame_ids = torch.unique(sequence.flatten(0, 1), dim=0, return_inverse=True)[1].view(sequence.shape[:2])
    at, found = lookup_positions(frame_ids, length, num_draft, max_ngram)
    return sequence.gather(1, at[..., None].expand(-1, -1, sequence.shape[-1])), found


def lookup_positions(sequence: torch.Tensor, length: torch.Tensor, num_draft: int,
                     max_ngram: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `lookup_drafts` copies each row's drafts from: positions [B, num_draft] in `sequence`,
    and [B] whether the row had a match."""
    B, S = sequence.shape
    device = sequence.device
    last = (length - 1).clamp_min(0)
    at = last[:, None].expand(B, num_draft).clone()
    found = torch.zeros(B, dtype=torch.bool, device=device)
    for n in range(min(max_ngram, S - 1), 0, -1):
        tail = sequence.gather(1, (length[:, None] - n + torch.arange(n, device=device)).clamp(0, S - 1))  # [B, n]
        grams = sequence.unfold(1, n, 1)  # [B, S - n + 1, n]: the n-gram starting at each index
        starts = torch.arange(grams.shape[1], device=device)
        # An earlier occurrence: it ends before the tail starts being the last n tokens.
        match = (grams == tail[:, None]).all(-1) & (starts[None] + n < length[:, None]) & (length[:, None] >= n + 1)
        latest = torch.where(match, starts[None], -1).max(1).values
        hit = (latest >= 0) & ~found
        follow = (latest[:, None] + n + torch.arange(num_draft, device=device)).clamp(0, S - 1)
        # Past the row's valid tokens the copy has nothing to follow: repeat its last copied token.
        valid = follow < length[:, None]
        follow = torch.where(valid, follow, follow.gather(1, (valid.sum(1, keepdim=True) - 1).clamp_min(0)))
        at = torch.where(hit[:, None], follow, at)
        found |= hit
    return at, found


class NGramProposer(Proposer):
    """Drafts by prompt lookup over `context` [B, P] (the prompt's token ids, optional) and the
    tokens generated so far. Where no decoding row's n-grams match, it proposes nothing and the
    forward is an autoregressive step (as transformers' and vLLM's n-gram proposers do); a row
    without a match in a batch with one drafts repeats of its last token."""

    adapts_window = True

    def __init__(self, num_draft: int, max_ngram: int, context: Optional[torch.Tensor]):
        self.num_draft, self.max_ngram, self.context = num_draft, max_ngram, context

    def propose(self, run: DecodeRun):
        B = run.batch_size
        context = self.context if self.context is not None else run.tokens.new_zeros(B, 0, *run.tokens.shape[2:])
        context = context.to(run.device).expand(B, *context.shape[1:])
        sequence = torch.cat([context, run.tokens], 1)
        drafts, found = lookup_drafts(sequence, context.shape[1] + run.pos + 1, run.num_draft, self.max_ngram)
        if not bool((found & run.active).any()):  # one host read: nothing to verify
            drafts = drafts[:, :0]
        return drafts, one_hot(drafts, run.vocab_size)


@dataclass
class PromptLookup(SpeculativeDecoder):
    """Prompt-lookup speculative decoding (`NGramProposer`), lossless with `ExactAcceptance`.
    `context` is the prompt's token ids ([P] or [B, P]; frames [P, K] or [B, P, K] for a model
    of K codebooks); without it only the generated tokens are searched (repeating image rows,
    audio loops: a frame matches only whole)."""

    num_draft: int = 8
    max_ngram: int = 3
    acceptance: Any = field(default_factory=ExactAcceptance)
    context: Optional[torch.Tensor] = field(default=None, repr=False)
    adapt: Any = True  # an AdaptiveWindow, True (its defaults), a token cost, or False: always num_draft

    def __post_init__(self):
        check_int("num_draft", self.num_draft, 1)
        check_int("max_ngram", self.max_ngram, 1)
        resolve_adaptive(self.adapt)

    @property
    def window(self) -> int:
        return self.num_draft + 1

    def roles(self, model, num_tokens, generator):
        context, K = self.context, int(getattr(model, "num_codebooks", 1))
        if context is not None:
            context = torch.as_tensor(context, dtype=torch.long)
            one_row = 1 if K == 1 else 2  # [P] tokens, or [P, K] frames
            context = context[None] if context.ndim == one_row else context
            if context.ndim != one_row + 1 or (K > 1 and context.shape[-1] != K):
                shape = "[P] or [B, P] token ids" if K == 1 else f"[P, {K}] or [B, P, {K}] frames"
                raise ValueError(f"lookup context must be {shape}, got shape {tuple(context.shape)}")
        return NGramProposer(min(self.num_draft, num_tokens), self.max_ngram, context), self.acceptance.bind(model)
