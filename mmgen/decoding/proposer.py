"""The proposer's side of the speculative loop (vLLM's split of proposer and rejection sampler):
`Proposer`, where a decode's drafts come from, and `DecodeRun`, what the loop shares with it
during one decode (the rows' tokens, positions and laws). The loop itself is
`mmgen.decoding.speculative`; continuous batching's rows (`mmgen.decoding.feed`) read these too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from mmgen.decoding.frames import gather_slots, sampler_probs, sampling_per_codebook
from mmgen.modeling import DecodeState, TokenModel
from mmgen.sampling import SamplingConfig, sample

if TYPE_CHECKING:  # tree.py builds on this module
    from mmgen.decoding.tree import TreeDrafts


@dataclass
class DecodeRun:
    """What the loop shares with its proposer during one decode.

    `tokens` [B, T(, K)] holds each row's finalised tokens (valid up to `pos`, the index of the
    newest one; later entries are scratch); `pos` [B]; `active` [B] rows still decoding.
    """

    model: TokenModel
    state: DecodeState
    conditions: Any
    sampling: SamplingConfig
    generator: torch.Generator
    tokens: torch.Tensor
    pos: torch.Tensor
    active: torch.Tensor
    num_tokens: int
    capacity: int
    num_draft: int
    vocab_size: int
    num_codebooks: int
    per_codebook: Optional[list] = None  # one SamplingConfig per codebook (frames)
    #: Continuous batching under an adaptive window: each row's draft count in this forward
    #: (`window.RowWindows`; the forward holds the largest), else None (every row: `num_draft`).
    row_drafts: Optional[list] = None

    @classmethod
    def begin(cls, model: TokenModel, conditions: Any, num_tokens: int,
              sampling: Union[SamplingConfig, Sequence[SamplingConfig]], generator: torch.Generator, num_draft: int,
              capacity: Optional[int] = None) -> "DecodeRun":
        """`model` prefilled on `conditions` (`TokenModel.start`, room for `capacity` tokens: by
        default `num_tokens` and two windows), with a token buffer that a last window may run
        past the end of, and no token yet."""
        K = int(getattr(model, "num_codebooks", 1))
        per_codebook = sampling_per_codebook(sampling, K)
        capacity = capacity if capacity is not None else num_tokens + 2 * min(num_draft + 1, num_tokens)
        state = model.start(conditions, capacity, any(s.uses_guidance for s in per_codebook))
        B, device = state.batch_size, state.device
        tokens = torch.zeros(B, num_tokens + 2 * (num_draft + 1), *(() if K == 1 else (K,)), dtype=torch.long, device=device)
        return cls(model, state, conditions, per_codebook[0], generator, tokens, torch.zeros(B, dtype=torch.long, device=device),
                   torch.ones(B, dtype=torch.bool, device=device), num_tokens, capacity, num_draft, model.vocab_size, K,
                   per_codebook)

    def probs(self, logits, index: torch.Tensor) -> torch.Tensor:
        """The sampler's probabilities of `logits` at generated-token `index` [B, n] (frames:
        each codebook through its own config)."""
        return sampler_probs(self.per_codebook or [self.sampling], logits, index)

    @property
    def greedy(self) -> bool:
        """Whether every law is one-hot (temperature 0 for every codebook): the race of `sample`
        then picks the argmax whatever its noise, so the target's draws need none."""
        return all(s.temperature == 0 for s in self.per_codebook or [self.sampling])

    def draw(self, proposer: "Proposer", probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The target's token draw from its own laws `probs` [B, n(, K), V] (the proposer's
        `draw`). Greedy decoding draws nothing from the generator: the argmax is the sample."""
        if self.greedy and type(proposer).draw is Proposer.draw:
            return probs.argmax(-1)
        return proposer.draw(self, probs, index)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def guided(self) -> bool:
        """Whether the model runs guided (both halves of the batch fed)."""
        return any(s.uses_guidance for s in self.per_codebook or [self.sampling])

    def newest(self) -> torch.Tensor:
        """Each row's newest finalised token [B, 1(, K)]: the first slot of every window."""
        return gather_slots(self.tokens, self.pos[:, None])

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` [B'] (into the current rows, in that order; a repeated row is one
        continuous batching restarts before it decodes), the model's state included."""
        hidden, B = self.state.hidden, self.batch_size
        self.model.select_rows(self.state, index)
        if hidden is not None:  # `HiddenStateModel`: each row's twins (guidance) come B rows apart
            self.state.hidden = hidden[torch.cat([index + half * B for half in range(hidden.shape[0] // B)])]
        self.tokens, self.pos, self.active = self.tokens[index], self.pos[index], self.active[index]
        self.generator = self.generator.select(index.tolist())


class Proposer:
    """Where drafts come from, for one decode (a decoder builds a fresh one per `generate`).

    `num_draft` drafts per forward (0 is autoregressive decoding). `samples_every_slot` asks
    the loop for the target's own sample at every slot of the window (Jacobi carries them over
    as the next drafts), not just at the bonus slot. Under an `AdaptiveWindow` the loop sets
    `run.num_draft` to each forward's draft count before `propose` and verifies only that many.
    """

    num_draft: int = 0
    samples_every_slot: bool = False
    #: Whether the loop may verify fewer drafts than `num_draft` in a forward (`AdaptiveWindow`):
    #: the proposer then sees `fresh` and `p` of the narrower window in `update`.
    adapts_window: bool = False
    #: Whether it also takes a draft count per row (`DecodeRun.row_drafts`: continuous batching
    #: under an adaptive window, each row as its decode alone).
    adapts_per_row: bool = False
    #: Whether the adaptive window starts from the model's `window_tokens`: they are measured
    #: with Jacobi windows, so only proposers of Jacobi drafts read them.
    uses_window_tokens: bool = False

    def start(self, run: DecodeRun) -> None:
        """Called once the prefill token is finalised."""

    def propose(self, run: DecodeRun) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Drafts [B, k(, K)] and the laws they were drawn from [B, k(, K), V] (None for rules
        that need none); k may fall short of `run.num_draft` (the loop verifies what it gets)."""
        B = run.batch_size
        shape = (B, 0) if run.num_codebooks == 1 else (B, 0, run.num_codebooks)
        return torch.zeros(shape, dtype=torch.long, device=run.device), None

    def propose_tree(self, run: DecodeRun, width: int) -> "TreeDrafts":
        """A token tree (`mmgen.decoding.tree.TreeDrafts`): `width` branches of up to
        `run.num_draft` drafts with distinct first tokens. Proposers that draft trees override
        this (the loop checks before any work)."""
        raise NotImplementedError(f"{type(self).__name__} proposes no token trees")

    def tree_kept(self, run: DecodeRun, branch: torch.Tensor, n_acc: torch.Tensor) -> None:
        """After a token tree's verify, before `update`: each row kept branch `branch` [B] and
        `n_acc` [B] of its drafts (a drafter with its own cache keeps that branch too)."""

    def update(self, run: DecodeRun, n_acc: torch.Tensor, next_token: torch.Tensor, fresh: torch.Tensor,
               p: torch.Tensor, active: torch.Tensor) -> None:
        """After a commit (`run.pos` already moved): `n_acc` [B] drafts kept, `next_token` the
        token finalised after them, `fresh` the target's samples, `p` its probabilities,
        `active` [B] the rows that were decoding in this forward."""

    def draw(self, run: DecodeRun, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The target's token draw from `probs` [B, n(, K), V] at generated-token `index` [B, n]."""
        return sample(probs, run.generator)

    def restart(self, run: DecodeRun, rows: torch.Tensor) -> None:
        """Continuous batching: `rows` [n] start new requests (their token 0 is in `run`);
        reset their per-row state, drawing only from their own generators. The base proposer
        (autoregressive) keeps none; a proposer with per-row state overrides this, and one that
        does not cannot serve continuous batching (the loop checks before any work)."""

    def select_rows(self, run: DecodeRun, index: torch.Tensor) -> None:
        """Continuous batching whose width follows its requests: keep the per-row state of rows
        `index` [B'] (as `DecodeRun.select_rows`). The base proposer keeps none; one with
        per-row state overrides this and `restart`, or its batches keep their width."""

    def finish(self, stats) -> None:
        """Add the proposer's own counters to the stats."""

    @property
    def cache_bytes(self) -> int:
        return 0
