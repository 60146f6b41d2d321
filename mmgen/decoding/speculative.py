"""The one speculative loop: propose, verify, finalise, commit.

Every token decoder of the core is this loop with two roles filled in (gpt-fast's
`speculative_decode`, vLLM's proposer / rejection-sampler split):

- a **proposer** (`Proposer`) says where the k drafts of each forward come from: none
  (autoregressive), the previous forward's own samples (Jacobi), a small model, an n-gram of
  the context, a fixed noise table (coupled Jacobi). It may also replace the token draw
  (`Proposer.draw`), which is how coupled decoding fixes its noise.
- an **acceptance rule** (`mmgen.decoding.acceptance`) says which drafts survive and what to
  resample at the first rejection.

The loop (`speculative_decode`) reads as those four steps; the rest is small collaborators,
each behind a narrow interface:

- `DecodeRun` (`proposer.py`, beside `Proposer`): the rows' tokens and positions, shared with
  the proposer.
- `VerifyStep`: verify and finalise one forward: the rule on the drafts, then the accepted
  prefix plus one resampled or bonus token (`finalise.py`'s rule); the fused kernels' step
  (`mmgen.kernels.step`) in its place where it covers the case, with the same draws.
- `stopping.RowEnds`: each row's budget and stop tokens; nothing after a stop is ever emitted
  or committed.
- `window.window_chooser`: each forward's draft count (`AdaptiveWindow`, or fixed).
- the rows: `BatchRows` (one batch: the prefill's token 0, progress and streaming after each
  forward) or `feed.FeedRows` (continuous batching: rows that finish take the next request).
- `frames.py`: the tensor helpers for rows of tokens or frames, shared with entropy switching.

Frames. A model with `num_codebooks = K > 1` emits K tokens per position (codec TTS). Drafts,
laws and samples then carry a codebook axis ([B, k, K], [B, k, K, V]); the rule runs on the
flattened (position, codebook) pairs, and a frame counts as accepted only when all its
codebooks are. At the first rejected frame the accepted codebooks are kept, the first rejected
codebook is resampled from its residual and the later ones are the target's own samples.
With codebooks that are independent given the prefix (parallel heads, as Dia's), every
codebook of that frame is then distributed as the target's, so the loop stays lossless.
Models whose later codebooks depend on earlier ones (CSM's depth decoder) score each drafted
frame's codebook k given that frame's codebooks before it (the forward's last position, whose
frame is not drafted, holds zeros for codebooks 1..), and offer
`complete_frame(state, slot, frame, known, probs, generator)`: the loop then has the model
sample every codebook it could not finalise (all but codebook 0 of a new frame, those after
the first rejected codebook) from its own conditionals, which keeps the loop lossless too.
K = 1 is the plain token case, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from mmgen.decoding.acceptance import ExactAcceptance, NeighbourhoodAcceptance
from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_num_tokens, raise_if_masked
from mmgen.decoding.feed import FeedRows, RowFeed
from mmgen.decoding.proposer import DecodeRun, Proposer
from mmgen.decoding.finalise import finalise
from mmgen.decoding.frames import (
    complete_frame,
    frame_index,
    rows_with_invalid_laws,
)
from mmgen.decoding.stats import StatsRecorder
from mmgen.decoding.stopping import RowEnds, Stopping, Streamer, TokenReporter
from mmgen.decoding.tree import TreeStep, check_tree
from mmgen.decoding.window import AdaptiveWindow, RowWindows, resolve_adaptive, window_chooser, with_default_curves
from mmgen.modeling import TokenModel
from mmgen.sampling import SamplingConfig


class SpeculativeDecoder(Decoder):
    """A token decoder that is `speculative_decode` with its two roles: a subclass says which
    (`roles`), the loop does the rest. A new proposer is one `Proposer` class plus, for users,
    a small dataclass like this."""

    def roles(self, model: TokenModel, num_tokens: int, generator: torch.Generator) -> tuple[Proposer, Any]:
        """A fresh proposer for one decode, and the acceptance rule bound to `model`."""
        raise NotImplementedError

    def generate(
        self,
        model: TokenModel,
        conditions: Any,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        progress: Optional[Progress] = None,
        stopping: Optional[Stopping] = None,
        streamer: Optional[Streamer] = None,
    ) -> DecodeOutput:
        check_num_tokens(num_tokens)
        proposer, rule = self.roles(model, num_tokens, generator)
        tree = int(getattr(self, "tree", 0) or 0)
        adapt = None if tree else resolve_adaptive(getattr(self, "adapt", None))  # a tree keeps its width
        if adapt is not None and not proposer.adapts_window:
            raise ValueError(f"{type(self).__name__} cannot adapt its window: its proposer drafts a fixed number")
        return speculative_decode(model, conditions, num_tokens, sampling, generator, proposer, rule,
                                  self.capacity(num_tokens), progress, stopping, streamer, adapt, tree)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------


def speculative_decode(
    model: TokenModel,
    conditions: Any,
    num_tokens: int,
    sampling: Union[SamplingConfig, Sequence[SamplingConfig]],
    generator: torch.Generator,
    proposer: Proposer,
    rule: Any = None,
    capacity: Optional[int] = None,
    progress: Optional[Progress] = None,
    stopping: Optional[Stopping] = None,
    streamer: Optional[Streamer] = None,
    adapt: Optional[AdaptiveWindow] = None,
    tree: int = 0,
) -> DecodeOutput:
    """Decode up to `num_tokens` tokens per row with `proposer` and acceptance `rule`.

    Each forward feeds every row its newest finalised token plus k drafts, verifies the drafts
    left to right, and finalises the accepted prefix plus one token (resampled at the first
    rejection, the bonus sample when every draft passed), so each forward finalises 1 to k + 1
    tokens per row. Rows advance independently and finished rows idle with fixed shapes.

    `tree` > 1: each forward verifies a token tree of that many branches instead
    (`mmgen.decoding.tree`: the proposer's `propose_tree`, the model's `forward_tree`, exact).

    This sets up one batch's decode (`BatchRows`); continuous batching sets up its own
    (`feed_decode`); both hand a `DecodePlan` to the one loop, `decode`.
    """
    check_num_tokens(num_tokens)
    if tree:
        check_tree(tree, model, proposer, rule, int(getattr(model, "num_codebooks", 1)))
        adapt, k = None, proposer.num_draft
        # A tree forward writes 1 + tree * k slots past the committed ones.
        capacity = (capacity if capacity is not None else num_tokens + 2 * min(k + 1, num_tokens)) + tree * k
    rows_of = adapt.batch_rows if adapt is not None else None
    run, adapt, ends, recorder = _begin(model, conditions, num_tokens, sampling, generator, proposer, capacity, stopping, adapt)
    B, k = run.batch_size, run.num_draft
    if rows_of is not None and B > 1:
        raise ValueError(f"batch_rows={rows_of} is for a decode of one row (a continuous batch's row, or alone); "
                         f"this static batch of {B} rows shares one window: leave batch_rows out")
    # Fixed-length decoding without drafts knows its forwards; every other loop reads one
    # number per forward (the slowest active row), which also drives progress and stopping.
    synced = k > 0 or stopping is not None or streamer is not None
    window_cost = with_default_curves(getattr(model, "window_cost", None))  # GPT-B's measured curve where the model carries none
    window_tokens = getattr(model, "window_tokens", None) if proposer.uses_window_tokens else None
    length = ends.known_length() if adapt is not None else None
    chooser = window_chooser(adapt, k, B, run.guided, run.device, window_cost, window_tokens, length)
    rows = BatchRows(run, proposer, ends, recorder, TokenReporter(num_tokens, ends.limit, progress, streamer), synced)
    return decode(DecodePlan(run, proposer, rule, ends, recorder, rows, chooser, synced, idle_rows=B > 1 and synced,
                             tree=TreeStep(tree) if tree else None))


def feed_decode(
    model: TokenModel,
    feed: RowFeed,
    conditions: Any,
    num_tokens: int,
    sampling: Union[SamplingConfig, Sequence[SamplingConfig]],
    generators: Any,
    proposer: Proposer,
    rule: Any = None,
    capacity: Optional[int] = None,
    stopping: Optional[Stopping] = None,
    adapt: Optional[AdaptiveWindow] = None,
) -> DecodeOutput:
    """Continuous batching's decode (`mmgen.decoding.batching.continuous_decode`): `conditions`
    (one request's, repeated) only size the first batch and `generators` (`RowGenerators`) are
    the rows' own until requests arrive. Every row starts on a request from `feed`
    (`model.restart`, a batch-1 prefill), a finished row goes to `feed.finish` and takes the
    next request (as does the row of a cancelled request, `feed.drop`), and the loop runs until
    no row is decoding. Under an adaptive window each row chooses its own draft counts
    (`RowWindows`), as its decode alone would."""
    check_num_tokens(num_tokens)
    check_row_feed(model, proposer, adapt)
    run, adapt, ends, recorder = _begin(model, conditions, num_tokens, sampling, generators, proposer, capacity, stopping, adapt)
    k = run.num_draft
    window_tokens = getattr(model, "window_tokens", None) if proposer.uses_window_tokens else None
    windows = None
    if adapt is not None and k > 0:
        windows = RowWindows(adapt, k, run.guided, run.device, with_default_curves(getattr(model, "window_cost", None)), run,
                             window_tokens, ends)
    rows = FeedRows(feed, run, proposer, ends, None, windows)
    chooser = windows or window_chooser(None, k, run.batch_size, run.guided, run.device)
    return decode(DecodePlan(run, proposer, rule, ends, recorder, rows, chooser, synced=True, idle_rows=True))


def _begin(model, conditions, num_tokens, sampling, generator, proposer, capacity, stopping, adapt):
    """What both set-ups share: the run (the model prefilled), its adaptive window (None where
    no width can pay), its rows' ends and the stats recorder."""
    if adapt is not None and proposer.num_draft > 0 and adapt.never_drafts(proposer.num_draft, generator.device):
        # A row whose window no width can pay for (a continuous batch's row on a compute-bound
        # device): autoregressive steps, in a cache without the window's room (fewer keys).
        proposer.num_draft, adapt, capacity = 0, None, None
    run = DecodeRun.begin(model, conditions, num_tokens, sampling, generator, proposer.num_draft, capacity)
    ends = RowEnds(stopping, run.batch_size, num_tokens, run.device)
    return run, adapt, ends, StatsRecorder(run.device, max_accepted=run.num_draft + 1)


@dataclass
class DecodePlan:
    """One decode, set up (`speculative_decode` for a batch, `feed_decode` for continuous
    batching) and ready for the loop: the run and its two roles, its rows' ends, the stats, who
    the rows decode for (`BatchRows` or `feed.FeedRows`), the window chooser, whether the loop
    reads the slowest row every forward (`synced`), whether rows may idle in it
    (`idle_rows`: their steps are zeroed) and, for token trees, their step (`tree.TreeStep`)."""

    run: DecodeRun
    proposer: Proposer
    rule: Any
    ends: RowEnds
    recorder: StatsRecorder
    rows: Any
    chooser: Any
    synced: bool
    idle_rows: bool
    tree: Optional[TreeStep] = None


def decode(plan: DecodePlan) -> DecodeOutput:
    """The loop: propose, verify and finalise, commit, until the slowest row is done."""
    run, proposer, ends, rows, chooser = plan.run, plan.proposer, plan.ends, plan.rows, plan.chooser
    model, state, K, device = run.model, run.state, run.num_codebooks, run.device
    slowest = rows.start()  # every row's token 0
    B = run.batch_size  # continuous batching may have grown the batch for requests that arrived meanwhile
    verify = VerifyStep(run, proposer, plan.rule)
    slots, ones = torch.arange(run.num_draft + 2, device=device), torch.ones(B, dtype=torch.long, device=device)
    while slowest < run.num_tokens:
        active = run.active
        # Propose: d drafts per row and the laws they were drawn from (d = 0: an autoregressive step).
        d = run.num_draft = chooser.choose()
        drafts = q = treed = None
        if d > 0 and plan.tree is not None:
            # A token tree: proposed, scored in one forward and verified; its chosen branch
            # comes back as a chain's window would (None: nothing proposed).
            treed = plan.tree(run, proposer)
            d = run.num_draft = 0 if treed is None else treed[1].shape[1]
        elif d > 0:
            drafts, q = proposer.propose(run)
            drafts, q = drafts[:, :d], (None if q is None else q[:, :d])
            # A proposer may stop a round early (a drafter unsure) or have nothing to propose
            # (no n-gram matched): then the forward is an autoregressive step.
            d = run.num_draft = drafts.shape[1]
            if d == 0:
                drafts = q = None
        if treed is not None:
            window, drafts, p, fresh, n_acc, next_token = treed
        else:
            window = run.newest() if d == 0 else torch.cat([run.newest(), drafts], 1)
            index = run.pos[:, None] + 1 + slots[: d + 1]  # the generated-token index each slot predicts
            # Verify and finalise: one forward scores the window, the rule keeps a prefix of the
            # drafts and one more token is final (resampled at the first rejection, else the bonus).
            p, fresh, n_acc, next_token = verify(model.forward(state, window), index, drafts, q)
        # Commit: [newest, accepted drafts, next token] from `pos` (later slots are scratch), each
        # row cut at its end; then the cache, the rows, the proposer and the window move on.
        if d > 0:
            written = torch.cat([window, fresh[:, -1:]], 1)
            written, step = written.scatter(1, frame_index((n_acc + 1)[:, None], K), next_token[:, None]), n_acc + 1
        else:
            written, step = torch.cat([window, next_token[:, None]], 1), ones
        run.tokens.scatter_(1, frame_index(run.pos[:, None] + slots[: d + 2], K), written)
        step, still = ends.cut(step, written, slots, active)
        if plan.idle_rows:  # unsynced loops and a lone row have no idle rows
            step = torch.where(active, step, 0)
        model.commit(state, step)
        plan.recorder.record(step, active)
        run.pos = run.pos + step
        run.active = still & ends.advance(step)
        proposer.update(run, n_acc, next_token, fresh, p, active)
        chooser.after(step, active, d)
        slowest = rows.forwarded(step, active, p)
        if run.batch_size != B:  # continuous batching changed the batch's width (`FeedRows.resize`)
            B, ones, verify = run.batch_size, torch.ones(run.batch_size, dtype=torch.long, device=device), VerifyStep(run, proposer, plan.rule)
    rows.end()
    stats = plan.recorder.finish(ends.tokens(), B, state.cache_bytes + proposer.cache_bytes)
    proposer.finish(stats)
    chooser.finish(stats)
    return ends.output(run.tokens, stats)


# --------------------------------------------------------------------------------------------
# The loop's collaborators
# --------------------------------------------------------------------------------------------


class BatchRows:
    """The loop's rows when it decodes one batch once (no feed): every row's token 0 from the
    prefill, progress and streaming after every forward (`TokenReporter`), and at the end a
    ValueError if a row met a law with no valid token (`raise_if_masked`). Continuous
    batching's rows (`feed.FeedRows`) have the same three calls."""

    def __init__(self, run: DecodeRun, proposer: Proposer, ends: RowEnds, recorder: StatsRecorder,
                 reporter: TokenReporter, synced: bool):
        self.run, self.proposer, self.ends, self.recorder, self.report, self.synced = run, proposer, ends, recorder, reporter, synced
        # A lone row without stop tokens advances exactly one token in an autoregressive step,
        # so such a step needs no host read, as none of `ar`'s steps does.
        self.steps_known = ends.stopping is None and run.batch_size == 1

    def start(self) -> int:
        """Token 0 of every row, drawn from the prefill's laws; the slowest row's token count."""
        run, B, ends = self.run, self.run.batch_size, self.ends
        zero = torch.zeros(B, 1, dtype=torch.long, device=run.device)
        p0 = run.probs(run.state.first_logits, zero)
        self.bad = rows_with_invalid_laws(p0)
        run.tokens[:, 0] = run.draw(self.proposer, p0, zero)[:, 0]
        complete = getattr(run.model, "complete_frame", None)
        if complete is not None:
            run.tokens[:, 0] = complete_frame(complete, run.state, run.per_codebook, zero[:, 0], run.tokens[:, 0],
                                              torch.ones_like(ends.limit), run.generator, zero)[0]
        run.active = ~ends.done_at_first(run.tokens[:, :1], ends.limit)
        self.proposer.start(run)
        self.recorder.record(torch.ones(B, dtype=torch.long, device=run.device), torch.ones(B, dtype=torch.bool, device=run.device))
        return self.report(run.tokens, ends.emitted, run.active, self.synced)

    def forwarded(self, step: torch.Tensor, active: torch.Tensor, p: torch.Tensor) -> int:
        """After a forward of the rows `active` [B] from laws `p`: progress and streaming; the
        slowest active row's token count (`num_tokens` once none is)."""
        self.bad |= rows_with_invalid_laws(p) & active
        synced = self.synced and not (self.steps_known and self.run.num_draft == 0)
        return self.report(self.run.tokens, self.ends.emitted, self.run.active, synced)

    def end(self) -> None:
        if self.report.streamer is not None:
            self.report.streamer.end()
        raise_if_masked(self.bad)


class VerifyStep:
    """One forward's verify and finalise, from the logits of its window: the target's laws p
    [B, d + 1(, K), V], its own samples `fresh` (at every slot, or the bonus slot only), the
    accepted draft prefix n_acc [B] and the token finalised after it [B(, K)]: the bonus sample
    when every draft passed, else the resample at the first rejection (`finalise`). A model with
    `complete_frame` then samples the codebooks of that frame the rule could not finalise.
    Where the fused kernels cover the step (`_kernel_step`) they do this work, with the same
    draws in the same order."""

    def __init__(self, run: DecodeRun, proposer: Proposer, rule: Any):
        self.run, self.proposer, self.rule, K = run, proposer, rule, run.num_codebooks
        self.every = proposer.samples_every_slot or K > 1  # the target's sample at every slot, not just the bonus
        self.complete = getattr(run.model, "complete_frame", None)
        self.fused = _kernel_step(run.per_codebook, rule, proposer, K, self.complete, run.device)
        self.greedy_exact = run.greedy and type(rule) is ExactAcceptance and type(proposer).draw is Proposer.draw
        self.no_drafts = torch.zeros(run.batch_size, dtype=torch.long, device=run.device)
        self.ones = torch.ones(run.batch_size, dtype=torch.long, device=run.device)

    def __call__(self, logits, index: torch.Tensor, drafts: Optional[torch.Tensor],
                 q: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p, fresh, n_acc, next_token) for the window whose slots predict generated-token
        `index` [B, d + 1], with `drafts` [B, d(, K)] drawn from laws `q` (None: d = 0, or a
        proposer without laws)."""
        run, d = self.run, index.shape[1] - 1
        rows = run.row_drafts
        if d > 0 and rows is not None and min(rows) < d:  # some rows verify fewer drafts: their own draws
            with run.generator.narrowed([d - r for r in rows], run.num_codebooks):
                p, fresh, n_acc, next_token, known = self._step(logits, index, drafts, q, torch.tensor(rows, device=run.device))
        elif self.fused is not None and (d == 0 or q is not None):  # the same draws, in two kernel launches
            return self.fused(logits, index, drafts, q, run.generator, self.every)
        else:
            p, fresh, n_acc, next_token, known = self._step(logits, index, drafts, q, None)
        if self.complete is not None:
            at = index if d == 0 else index.gather(1, n_acc[:, None])
            next_token = complete_frame(self.complete, run.state, run.per_codebook, n_acc, next_token, known, run.generator, at)[0]
        return p, fresh, n_acc, next_token

    def _step(self, logits, index, drafts, q, limit: Optional[torch.Tensor]):
        """The torch path up to `finalise` (frames: also how many codebooks it finalised);
        `limit` [B]: each row's own draft count, or None."""
        run, d, every = self.run, index.shape[1] - 1, self.every
        if limit is not None and self.complete is not None:
            logits = _frame_placeholders(logits, limit)
        p = run.probs(logits, index)
        if d > 0 and self.greedy_exact:
            # One-hot laws: the exact rule accepts a draft exactly when it is the argmax (ratio
            # 1, else 0) and the residual at the first rejection is that argmax, so no uniform
            # and no residual is drawn.
            picks = p.argmax(-1)
            accepted, residual, fresh = drafts == picks[:, :-1], None, picks if every else picks[:, -1:]
        else:
            if d > 0:
                accepted, residual = _verify(self.rule, p[:, :-1], q, drafts, run.generator, index[:, :-1], run)
            fresh = run.draw(self.proposer, p if every else p[:, -1:], index if every else index[:, -1:])
        if d == 0:  # autoregressive: the newest token's sample
            n_acc, next_token, known = self.no_drafts, fresh[:, -1], self.ones
        else:
            resampled = picks[:, :-1] if self.greedy_exact else (
                fresh[:, :-1] if residual is None else self.proposer.draw(run, residual, index[:, :-1]))
            n_acc, next_token, known = finalise(accepted, resampled, fresh, drafts, run.num_codebooks, limit)
        return p, fresh, n_acc, next_token, known


def _frame_placeholders(logits, limit: torch.Tensor):
    """A frame-completing model's logits [B, n, K, V] with each row's own last slot (`limit[b]`,
    its bonus) holding the placeholders a forward of its own width ends on: zeros for codebooks
    1.. (`complete_frame` draws them). Without this a row verifying fewer drafts than the forward
    would draw those codebooks from the scores of a stale draft there, which Jacobi carries on
    as its next drafts: other drafts, other frames than its decode alone."""
    rows = torch.arange(limit.shape[0], device=limit.device)
    out = []
    for part in (logits.cond, logits.uncond):
        if part is not None:
            part = part.clone()
            part[rows, limit, 1:] = 0
        out.append(part)
    return type(logits)(*out)


def check_row_feed(model: TokenModel, proposer: Proposer, adapt: Optional[AdaptiveWindow]) -> None:
    """What the loop needs to take a `RowFeed` (continuous batching), checked before any work
    (ValueError): each row must draw what a batch-1 decode of it draws, and start over on a new
    request. `mmgen.decoding.batching.check_continuous` runs it on a job's decoder and model."""
    name = type(proposer).__name__
    if getattr(model, "restart", None) is None:
        raise ValueError(f"{type(model).__name__} cannot restart a row (no `restart`), so it cannot serve continuous batching")
    if type(proposer).draw is not Proposer.draw:
        raise ValueError(f"{name} draws tokens from its own fixed noise, not from each row's generator: "
                         "it cannot serve continuous batching")
    if type(proposer) is not Proposer and type(proposer).restart is Proposer.restart:
        raise ValueError(f"{name} cannot restart rows, so it cannot serve continuous batching")
    if adapt is not None and not proposer.adapts_per_row:
        raise ValueError(f"continuous batching needs a fixed draft window here (adapt=False): it adapts the window per "
                         f"row with sjd and its rules, not {name}")


def _kernel_step(sampling: list[SamplingConfig], rule, proposer: Proposer, K: int, complete, device):
    """The fused kernels' step (`mmgen.kernels.step.ExactStep`) where the dispatch picks Triton
    (CUDA) and the step is one it covers: one token per slot, the exact rule, a bounded lossy
    rule (the exact rule against its relaxed target) or none (autoregressive), the target's own
    draws, no frame completion. None: the torch path."""
    if K > 1 or complete is not None or type(proposer).draw is not Proposer.draw:
        return None
    bounded = isinstance(rule, NeighbourhoodAcceptance) and rule.bounded
    if rule is not None and type(rule) is not ExactAcceptance and not bounded:
        return None
    from mmgen.kernels import backend_for  # the dispatch imports no triton until a kernel runs

    if backend_for(device) != "triton":
        return None
    from mmgen.kernels.step import ExactStep

    return ExactStep(sampling[0], rule)


def _verify(rule, p, q, drafts, generator, index, run):
    """(accepted [B, k(, K)], residual or None): the rule on flattened (position, codebook).
    A rule with `verify` (coupled decoding's match) sees the positions and the run instead."""
    verify = getattr(rule, "verify", None)
    if verify is not None:
        return verify(p, q, drafts, index, run)
    if drafts.ndim == 2 or getattr(rule, "frames", False):
        return rule(p, q, drafts, generator)
    B, k, K, V = p.shape
    accepted, residual = rule(p.reshape(B, k * K, V), q.reshape(B, k * K, V), drafts.reshape(B, k * K), generator)
    return accepted.view(B, k, K), residual.view(B, k, K, V)
