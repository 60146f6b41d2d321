"""Speculative Jacobi decoding with per-row acceptance.

SJD (Teng et al. 2024, "Accelerating Auto-regressive Text-to-Image Generation with
Training-free Speculative Jacobi Decoding", arXiv 2410.01699): keep a window of draft tokens
after each row's committed prefix, score the whole window in one forward, accept drafts
left to right with a lossless rule, resample at the first rejection, and reuse the tokens
sampled after the rejection as the next iteration's drafts. Every row advances by its own
accepted length; the reference code advances the whole batch by the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.base import check_int
from mmgen.decoding.jacobi_init import DraftContext, RandomDraftInit, resolve_draft_init
from mmgen.decoding.frames import gather_slots, where_slots
from mmgen.decoding.proposer import DecodeRun, Proposer
from mmgen.decoding.speculative import SpeculativeDecoder
from mmgen.decoding.window import resolve_adaptive


class JacobiProposer(Proposer):
    """Jacobi carry-over: the drafts of the next forward are the target's own samples after
    the first rejection (their law q is the target's p there); slots the old window did not
    reach get initial drafts from `init`. `laws=False` skips the [B, L, V] laws (rules that
    need none, as coupled decoding's match). Frames carry a codebook axis throughout."""

    samples_every_slot = True
    adapts_window = True
    adapts_per_row = True
    uses_window_tokens = True

    def __init__(self, window: int, init, laws: bool = True):
        self.num_draft, self.init, self.laws = window - 1, init, laws

    def _fill(self, run: DecodeRun, window, fresh, rows: Optional[torch.Tensor] = None):
        """`window` with initial drafts in its `fresh` slots, for `rows` (all when None)."""
        L = self.num_draft + 1
        pos, tokens, generator = run.pos, run.tokens, run.generator
        if rows is not None:  # only these rows' generators draw
            pos, tokens, generator = pos[rows], tokens[rows], generator.select(rows.tolist())
        positions = pos[:, None] + torch.arange(L, device=run.device)
        ctx = DraftContext(window, fresh, positions, tokens, run.vocab_size, generator, getattr(run.model, "row_length", None))
        return where_slots(fresh, self.init.propose(ctx), window)

    def _first_window(self, run: DecodeRun, rows: Optional[torch.Tensor] = None):
        """The window after token 0 of `rows` (all when None): that token, then initial drafts;
        and the drafts' laws."""
        newest = run.newest() if rows is None else run.newest()[rows]
        B, L = newest.shape[0], self.num_draft + 1
        window = torch.cat([newest, newest.new_zeros(B, L - 1, *newest.shape[2:])], 1)
        window = self._fill(run, window, (torch.arange(L, device=run.device) > 0).expand(B, -1), rows)
        return window, (self.init.laws(window[:, 1:], run.vocab_size) if self.laws else None)

    def start(self, run):
        # The first window is drawn at the first forward that drafts: right after token 0 when
        # that is the first forward (the same draws as building it here), never when an
        # adaptive window starts with autoregressive steps (a short decode may never draft).
        self.window = self.q = None
        self.stale = True
        # Per-row windows (`run.row_drafts`): which rows' windows are rebuilt when they next
        # draft, each as its decode alone would (None until such a forward drafts).
        self.stale_rows: Optional[list[bool]] = None

    def restart(self, run, rows):
        if self.stale:  # the first propose builds every row's window, these rows' included
            return
        if self.stale_rows is not None:  # built when the row first drafts, as alone
            for row in rows.tolist():
                self.stale_rows[row] = True
            return
        window, q = self._first_window(run, rows)
        self.window[rows] = window
        if self.laws:
            self.q[rows] = q

    def select_rows(self, run, index):
        if self.stale:
            return
        self.window = self.window[index]
        if self.laws:
            self.q = self.q[index]
        if self.stale_rows is not None:
            self.stale_rows = [self.stale_rows[i] for i in index.tolist()]

    def propose(self, run):
        if run.row_drafts is not None:
            return self._propose_rows(run)
        if self.stale:  # after autoregressive steps: a first window after the newest token
            self.window, self.q = self._first_window(run)
            self.stale = False
        return self.window[:, 1:], self.q

    def _propose_rows(self, run):
        """Per-row windows: the rows that draft in this forward and have no window yet (since
        their start or their last autoregressive step) get a first one, drawn from their own
        generators; the others keep theirs."""
        B, L = run.batch_size, self.num_draft + 1
        if self.stale_rows is None:
            newest = run.newest()  # [B, 1(, K)]
            self.window = torch.cat([newest, newest.new_zeros(B, L - 1, *newest.shape[2:])], 1)
            self.q = torch.zeros(B, L - 1, *newest.shape[2:], run.vocab_size, device=run.device) if self.laws else None
            self.stale_rows, self.stale = [True] * B, False
        rows = [b for b, drafts in enumerate(run.row_drafts) if drafts > 0 and self.stale_rows[b]]
        if rows:
            at = torch.tensor(rows, device=run.device)
            window, q = self._first_window(run, at)
            self.window[at] = window
            if self.laws:
                self.q[at] = q
            for b in rows:
                self.stale_rows[b] = False
        return self.window[:, 1:], self.q

    def update(self, run, n_acc, next_token, fresh, p, active):
        if run.row_drafts is not None:
            self._update_rows(run, n_acc, next_token, fresh, p, active)
            return
        fed = fresh.shape[1]
        if fed == 1:
            # An autoregressive step (`AdaptiveWindow` at 0 drafts) reads no draft: the window
            # is rebuilt when drafting resumes instead of carried over every step (its upkeep,
            # [L, K, V] laws and redrawn drafts, cost tiny models 14% of a step).
            self.stale = True
            return
        window, fresh_slots = self._carried(run, n_acc, next_token, fresh, fed)
        # Rows that had finished before this forward keep their window.
        self.window = where_slots(active, self._fill(run, window, fresh_slots), self.window)
        if self.laws:
            self.q = self._next_laws(run, p, n_acc.tolist(), [fed] * run.batch_size, active.tolist())

    def _carried(self, run, n_acc, next_token, fresh, fed):
        """The next window after a forward whose rows fed `fed` slots (an int, or [B, 1] per
        row), before its initial drafts, and the slots still to fill. Jacobi carry-over: the
        token after the accepted prefix, then the target's samples after it; slots the forward
        did not reach keep the old window's drafts there (`_next_laws` shifts the laws alike)."""
        L = self.num_draft + 1
        source = n_acc[:, None] + 1 + torch.arange(L - 1, device=run.device)  # slot of p that predicted each new draft
        carried = source < fed
        window = torch.cat([next_token[:, None], gather_slots(fresh, source.clamp_max(fresh.shape[1] - 1))], 1)
        if not isinstance(fed, int) or fed < L:
            # A narrower forward (`AdaptiveWindow`) left the old window's later drafts unread:
            # each is still a draw from its own law, so it stays a valid draft for its position.
            unread = ~carried & (source + 1 < L)
            window[:, 1:] = where_slots(unread, gather_slots(self.window[:, 1:], source.clamp_max(L - 2)), window[:, 1:])
            carried = carried | unread
        return window, torch.cat([torch.zeros_like(carried[:, :1]), ~carried], 1)

    def _next_laws(self, run, p, n_acc: list[int], fed: list[int], rows: list[bool]) -> torch.Tensor:
        """The laws [B, L - 1(, K), V] of `self.window`'s drafts after `_carried` and `_fill`
        moved the windows of `rows` (the others keep theirs). Row b's drafts are the target's
        samples at slots n_acc[b] + 1 .. fed[b] - 1 (their law: p there), the old drafts the
        forward did not reach (their old laws), then initial drafts (`DraftInit.laws`). Built by
        slices, one copy per row: a narrow forward in a wide window then moves its laws once
        instead of through masked ops over every slot (15 of them at one draft)."""
        out = []
        for b, moved in enumerate(rows):
            if not moved:
                out.append(self.q[b])
                continue
            kept, unread = p[b, n_acc[b] + 1:fed[b]], self.q[b, fed[b]:]
            new = self.window[b, 1 + kept.shape[0] + unread.shape[0]:]
            out.append(torch.cat([kept, unread, self.init.laws(new, run.vocab_size)]))
        return torch.stack(out)

    def _update_rows(self, run, n_acc, next_token, fresh, p, active):
        """`update` with per-row windows: row b fed 1 + run.row_drafts[b] slots. A row that took
        an autoregressive step keeps no window (rebuilt when it drafts again); a row that
        drafted carries its drafts over as `update` does at that width, and only its generator
        draws the initial drafts of its fresh slots."""
        fed = torch.tensor(run.row_drafts, device=run.device) + 1
        active_rows = active.tolist()
        for b, (drafts, on) in enumerate(zip(run.row_drafts, active_rows)):
            if on and drafts == 0 and self.stale_rows is not None:
                self.stale_rows[b] = True
        if fresh.shape[1] == 1:
            return
        drafting = active & (fed > 1)
        rows = drafting.nonzero().flatten()
        if rows.numel() == 0:
            return
        window, fresh_slots = self._carried(run, n_acc, next_token, fresh, fed[:, None])
        self.window[rows] = self._fill(run, window[rows], fresh_slots[rows], rows)
        if self.laws:
            self.q = self._next_laws(run, p, n_acc.tolist(), fed.tolist(), drafting.tolist())


@dataclass
class SpeculativeJacobi(SpeculativeDecoder):
    """Speculative Jacobi decoding (SJD, arXiv 2410.01699), lossless with `ExactAcceptance`.

    Each forward feeds `window` tokens per row: the row's newest finalised token and
    window - 1 drafts. Draft i is checked against the prediction made at position i - 1; the
    accepted prefix plus one resampled (or bonus) token is finalised, so every forward
    finalises between 1 and `window` tokens per row.
    """

    window: int = 16
    acceptance: Any = field(default_factory=ExactAcceptance)
    draft_init: Any = field(default_factory=RandomDraftInit)  # or a name of drafts.DRAFT_INITS
    adapt: Any = True  # an AdaptiveWindow, True (its defaults), a token cost, or False: always `window`

    def __post_init__(self):
        check_int("window", self.window, 1)
        resolve_adaptive(self.adapt)

    def roles(self, model, num_tokens, generator):
        L = min(self.window, num_tokens)  # a wider window has nothing to draft
        return JacobiProposer(L, resolve_draft_init(self.draft_init)), self.acceptance.bind(model)
