"""Prompt lookup: drafts copied from the context where its last n-gram occurred before.

Prompt lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`) drafts the
tokens that followed the most recent earlier occurrence of the context's last n tokens, trying
n = `max_ngram` down to 1. Text that quotes or repeats its prompt (VLM answers, code, lists)
accepts long runs of such drafts. The drafts are deterministic, so their law is one-hot and
any lossless rule keeps the output exact. With `tree=`, earlier matches that continued
differently are tried at once, as the branches of a token tree (`mmgen.decoding.tree`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.base import check_int
from mmgen.decoding.proposer import DecodeRun, Proposer
from mmgen.decoding.speculative import SpeculativeDecoder
from mmgen.decoding.tree import TreeDrafts, check_tree_width
from mmgen.decoding.window import resolve_adaptive
from mmgen.sampling import one_hot


class NGramIndex:
    """One row's sequence on the host and, for each n <= `max_ngram`, where every n-gram of it
    that ends before its newest token last started: a lookup is a few dictionary reads, and
    each token is indexed once as it arrives (a search of the whole sequence per forward cost
    more than a small model's autoregressive step on a CPU). Tokens are ints, frames tuples of
    ints (a frame matches only whole)."""

    def __init__(self, max_ngram: int, tokens: Sequence = (), branches: bool = False):
        self.max_ngram, self.tokens, self.indexed = max_ngram, [], 0
        self.latest: list[dict] = [{} for _ in range(max_ngram + 1)]  # by n: n-gram -> its latest start
        # Token trees: by n, n-gram -> {the token that followed it: that start}, oldest first.
        self.follows: Optional[list[dict]] = [{} for _ in range(max_ngram + 1)] if branches else None
        self.extend(tokens)

    def extend(self, tokens: Sequence) -> None:
        """Append `tokens` and index the n-grams that now end before the newest one."""
        seq = self.tokens
        seq.extend(tokens)
        for end in range(self.indexed, len(seq) - 1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                gram = tuple(seq[end - n + 1:end + 1])
                self.latest[n][gram] = end - n + 1
                if self.follows is not None:
                    after = self.follows[n].setdefault(gram, {})
                    after.pop(seq[end + 1], None)  # re-inserted: the latest start of each follower last
                    after[seq[end + 1]] = end - n + 1
        self.indexed = max(self.indexed, len(seq) - 1)

    def drafts(self, num_draft: int) -> tuple[list, bool]:
        """The `num_draft` tokens after the latest earlier match of the last n tokens (longest n
        first; past the newest token the last copied one repeats), and whether there was a
        match; without one, the newest token repeated."""
        seq, L = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            start = self.latest[n].get(tuple(seq[L - n:]))
            if start is not None:
                follow = seq[start + n:start + n + num_draft]
                return follow + follow[-1:] * (num_draft - len(follow)), True
        return seq[-1:] * num_draft, False

    def branches(self, num_draft: int, width: int) -> list[list]:
        """Up to `width` continuations of `num_draft` tokens with distinct first tokens: the
        tokens after earlier matches of the last n tokens, longest n first and the latest match
        of each follower first (the index must keep `branches`)."""
        seq, L = self.tokens, len(self.tokens)
        out, firsts = [], set()
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            for first, start in reversed(list(self.follows[n].get(tuple(seq[L - n:]), {}).items())):
                if first in firsts:
                    continue
                follow = seq[start + n:start + n + num_draft]
                out.append(follow + follow[-1:] * (num_draft - len(follow)))
                firsts.add(first)
                if len(out) == width:
                    return out
        return out


def _host_tokens(tokens: torch.Tensor) -> list:
    """[n] token ids as ints, or [n, K] frames as tuples."""
    return tokens.tolist() if tokens.ndim == 1 else [tuple(f) for f in tokens.tolist()]


class NGramProposer(Proposer):
    """Drafts by prompt lookup over `context` [B, P] (the prompt's token ids, optional) and the
    tokens generated so far, from one `NGramIndex` per row that reads the row's new tokens
    when asked to propose. Where no decoding row's n-grams match, it proposes nothing and the
    forward is an autoregressive step (as transformers' and vLLM's n-gram proposers do); a row
    without a match in a batch with one drafts repeats of its last token."""

    adapts_window = True

    def __init__(self, num_draft: int, max_ngram: int, context: Optional[torch.Tensor], branches: bool = False):
        self.num_draft, self.max_ngram, self.context, self.branches = num_draft, max_ngram, context, branches

    def start(self, run: DecodeRun):
        context = self.context if self.context is not None else run.tokens.new_zeros(1, 0, *run.tokens.shape[2:])
        context = context.expand(run.batch_size, *context.shape[1:])
        self.rows = [NGramIndex(self.max_ngram, _host_tokens(row), self.branches) for row in context.cpu()]
        self.read = [0] * run.batch_size  # generated tokens each row's index holds

    def _read(self, run: DecodeRun) -> list[bool]:
        """Index every row's tokens since its index last grew (one read); which rows decode."""
        pos, active = run.pos.tolist(), run.active.tolist()
        first = min(self.read)
        new = run.tokens[:, first:max(pos) + 1].cpu()
        for b, (index, p) in enumerate(zip(self.rows, pos)):
            index.extend(_host_tokens(new[b, self.read[b] - first:p + 1 - first]))
            self.read[b] = p + 1
        return active

    def propose_tree(self, run: DecodeRun, width: int) -> TreeDrafts:
        """Up to `width` earlier continuations per row with distinct first tokens (each a point
        mass for the exact rule); none anywhere: an empty tree (an autoregressive step)."""
        active = self._read(run)
        B, d = run.batch_size, run.num_draft
        rows = [index.branches(d, width) if on else [] for index, on in zip(self.rows, active)]
        if not any(rows):
            return TreeDrafts(run.tokens.new_zeros(B, width, 0), None, run.tokens.new_zeros(B, width, dtype=torch.bool))
        newest = run.newest()[:, 0].tolist()
        valid = torch.tensor([[j < len(r) for j in range(width)] for r in rows], device=run.device)
        tokens = torch.tensor([r + [[last] * d] * (width - len(r)) for r, last in zip(rows, newest)], dtype=torch.long,
                              device=run.device)
        return TreeDrafts(tokens, one_hot(tokens, run.vocab_size), valid)

    def propose(self, run: DecodeRun):
        active = self._read(run)
        drafts, found = [], False
        for index, on in zip(self.rows, active):
            row, hit = index.drafts(run.num_draft)
            drafts.append(row)
            found |= hit and on
        frame = run.tokens.shape[2:]
        if found:
            drafts = torch.tensor(drafts, dtype=torch.long).view(run.batch_size, run.num_draft, *frame).to(run.device)
        else:  # nothing to verify: an autoregressive step
            drafts = run.tokens.new_zeros(run.batch_size, 0, *frame)
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
    tree: int = 0  # verify up to this many earlier continuations at once (a token tree; its window is fixed)

    def __post_init__(self):
        check_int("num_draft", self.num_draft, 1)
        check_int("max_ngram", self.max_ngram, 1)
        resolve_adaptive(self.adapt)
        check_tree_width(self.tree)

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
        return (NGramProposer(min(self.num_draft, num_tokens), self.max_ngram, context, branches=bool(self.tree)),
                self.acceptance.bind(model))
