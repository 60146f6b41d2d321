"""The one speculative loop: propose, verify, finalise, commit.

Every token decoder of the core is this loop with two roles filled in (gpt-fast's
`speculative_decode`, vLLM's proposer / rejection-sampler split):

- a **proposer** (`Proposer`) says where the k drafts of each forward come from: none
  (autoregressive), the previous forward's own samples (Jacobi), a small model, an n-gram of
  the context, a fixed noise table (coupled Jacobi). It may also replace the token draw
  (`Proposer.draw`), which is how coupled decoding fixes its noise.
- an **acceptance rule** (`mmgen.decoding.acceptance`) says which drafts survive and what to
  resample at the first rejection.

The loop owns the rest, once: the prefill token, per-row positions, the finalise step (accepted
prefix + one resampled or bonus token; the rule is `finalise.py`'s), stopping (per-row stop
tokens and lengths, nothing after a stop is ever emitted or committed; `stopping.py`),
streaming, stats and the one host sync per forward. The tensor helpers for rows of tokens or
frames are `frames.py`'s, shared with entropy switching.

Frames. A model with `num_codebooks = K > 1` emits K tokens per position (codec TTS). Drafts,
laws and samples then carry a codebook axis ([B, k, K], [B, k, K, V]); the rule runs on the
flattened (position, codebook) pairs, and a frame counts as accepted only when all its
codebooks are. At the first rejected frame the accepted codebooks are kept, the first rejected
codebook is resampled from its residual and the later ones are the target's own samples.
With codebooks that are independent given the prefix (parallel heads, as Dia's), every
codebook of that frame is then distributed as the target's, so the loop stays lossless.
Models whose later codebooks depend on earlier ones (CSM's depth decoder) score each drafted
frame's codebook k given that frame's codebooks before it, and offer
`complete_frame(state, slot, frame, known, probs, generator)`: the loop then has the model
sample every codebook it could not finalise (all but codebook 0 of a new frame, those after
the first rejected codebook) from its own conditionals, which keeps the loop lossless too.
K = 1 is the plain token case, bit for bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

import torch

from mmgen.decoding.acceptance import ExactAcceptance, NeighbourhoodAcceptance
from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_num_tokens, raise_if_masked
from mmgen.decoding.finalise import finalise
from mmgen.decoding.frames import (
    complete_frame,
    frame_index,
    gather_slots,
    rows_with_invalid_laws,
    sampler_probs,
    sampling_per_codebook,
)
from mmgen.decoding.stats import DecodeStats, StatsRecorder
from mmgen.decoding.stopping import Stopping, Streamer, TokenReporter, stop_mask
from mmgen.decoding.window import AdaptiveWindow, resolve_adaptive
from mmgen.modeling import DecodeState, TokenModel
from mmgen.sampling import RowGenerators, SamplingConfig, sample


# --------------------------------------------------------------------------------------------
# Continuous batching's feed
# --------------------------------------------------------------------------------------------


class RowFeed(Protocol):
    """Continuous batching (`mmgen.decoding.batching`): the loop hands each finished row's
    output to `finish` and asks `refill` for requests to start on free rows. A request has
    `conditions` (one row's, as `TokenModel.start` takes them), `generator` (its own, so its
    tokens are those of a batch-1 decode with that generator), `max_new_tokens` (or None),
    `streamer` (or None) and `cancelled` (a `threading.Event`): once it is set, the loop stops
    decoding the request's row after the forward under way, ends its streamer and tells `drop`
    instead of `finish`; the row then takes the next request."""

    def refill(self, rows: list[int]) -> list[tuple[int, Any]]: ...

    def finish(self, row: int, tokens: torch.Tensor, stats: Any, masked: bool) -> None: ...

    def drop(self, row: int) -> None: ...


# --------------------------------------------------------------------------------------------
# Proposers
# --------------------------------------------------------------------------------------------


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

    def probs(self, logits, index: torch.Tensor) -> torch.Tensor:
        """The sampler's probabilities of `logits` at generated-token `index` [B, n] (frames:
        each codebook through its own config)."""
        return sampler_probs(self.per_codebook or [self.sampling], logits, index)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def newest(self) -> torch.Tensor:
        """Each row's newest finalised token [B, 1(, K)]: the first slot of every window."""
        return gather_slots(self.tokens, self.pos[:, None])


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

    def start(self, run: DecodeRun) -> None:
        """Called once the prefill token is finalised."""

    def propose(self, run: DecodeRun) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Drafts [B, k(, K)] and the laws they were drawn from [B, k(, K), V] (None for rules
        that need none)."""
        B = run.batch_size
        shape = (B, 0) if run.num_codebooks == 1 else (B, 0, run.num_codebooks)
        return torch.zeros(shape, dtype=torch.long, device=run.device), None

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

    def finish(self, stats) -> None:
        """Add the proposer's own counters to the stats."""

    @property
    def cache_bytes(self) -> int:
        return 0


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
        adapt = resolve_adaptive(getattr(self, "adapt", None))
        if adapt is not None and not proposer.adapts_window:
            raise ValueError(f"{type(self).__name__} cannot adapt its window: its proposer drafts a fixed number")
        return speculative_decode(model, conditions, num_tokens, sampling, generator, proposer, rule,
                                  self.capacity(num_tokens), progress, stopping, streamer, adapt)


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
    feed: Optional[RowFeed] = None,
) -> DecodeOutput:
    """Decode up to `num_tokens` tokens per row with `proposer` and acceptance `rule`.

    Each forward feeds every row its newest finalised token plus k drafts, verifies the drafts
    left to right, and finalises the accepted prefix plus one token (resampled at the first
    rejection, the bonus sample when every draft passed), so each forward finalises 1 to k + 1
    tokens per row. Rows advance independently and finished rows idle with fixed shapes.

    With a `feed` (continuous batching), `generator` is a `RowGenerators` and `conditions`
    only size the batch: every row starts on a request from the feed (`model.restart`, a
    batch-1 prefill), a finished row goes to `feed.finish` and takes the next request (as does
    the row of a cancelled request, `feed.drop`), and the loop runs until no row is decoding.
    """
    check_num_tokens(num_tokens)
    if feed is not None:
        check_row_feed(model, proposer, adapt)
    k = proposer.num_draft
    K = int(getattr(model, "num_codebooks", 1))
    sampling = sampling_per_codebook(sampling, K)
    uses_guidance = any(s.uses_guidance for s in sampling)
    capacity = capacity if capacity is not None else num_tokens + 2 * min(k + 1, num_tokens)
    state = model.start(conditions, capacity, uses_guidance)
    B, device, V = state.batch_size, state.device, model.vocab_size
    recorder = StatsRecorder(device, max_accepted=k + 1)
    slots = torch.arange(k + 2, device=device)
    frame = () if K == 1 else (K,)
    tokens = torch.zeros(B, num_tokens + 2 * (k + 1), *frame, dtype=torch.long, device=device)
    limit = (stopping or Stopping()).limits(B, num_tokens, device)
    stop_ids = stopping.stop_ids(device) if stopping is not None else None
    variable = stopping is not None
    run = DecodeRun(model, state, conditions, sampling[0], generator, tokens, torch.zeros(B, dtype=torch.long, device=device),
                    torch.ones(B, dtype=torch.bool, device=device), num_tokens, capacity, k, V, K, sampling)

    def probs(logits, index):
        return sampler_probs(sampling, logits, index)

    # Token 0 comes from the prefill.
    zero = torch.zeros(B, 1, dtype=torch.long, device=device)
    complete = getattr(model, "complete_frame", None)
    emitted = torch.ones(B, dtype=torch.long, device=device)  # tokens finalised per row
    if feed is None:
        p0 = probs(state.first_logits, zero)
        bad = rows_with_invalid_laws(p0)
        tokens[:, 0] = proposer.draw(run, p0, zero)[:, 0]
        if complete is not None:
            tokens[:, 0] = complete_frame(complete, state, sampling, zero[:, 0], tokens[:, 0], torch.ones_like(limit), generator, zero)[0]
        run.active = ~(stop_mask(tokens[:, :1], stop_ids, stopping)[:, 0] | (limit <= 1))
        proposer.start(run)
        recorder.record(torch.ones(B, dtype=torch.long, device=device), torch.ones(B, dtype=torch.bool, device=device))
    else:
        bad = torch.zeros(B, dtype=torch.bool, device=device)
        rows = _RowCounters(B, k, device)  # each request's own histogram: its stats equal a batch-1 decode's
        run.active = torch.zeros(B, dtype=torch.bool, device=device)
        proposer.start(run)
        admit = _Admission(feed, model, state, run, proposer, probs, limit, emitted, bad, rows, stopping, stop_ids, num_tokens)
        admit(list(range(B)))
    report = TokenReporter(num_tokens, limit, progress, streamer)
    # Fixed-length decoding without drafts knows its forwards; every other loop reads one
    # number per forward (the slowest active row), which also drives progress and stopping.
    synced = k > 0 or variable or streamer is not None or feed is not None
    slowest = report(tokens, emitted, run.active, synced) if feed is None else admit.left(num_tokens)

    ones, no_drafts = torch.ones(B, dtype=torch.long, device=device), torch.zeros(B, dtype=torch.long, device=device)
    chooser = None
    if adapt is not None and k > 0:  # a model's measured window costs are for batch 1
        chooser = adapt.start(k, B * (2 if uses_guidance else 1), device, getattr(model, "window_cost", None) if B == 1 else None)
    kernels = _kernel_step(sampling, rule, proposer, K, complete, device)
    while slowest < num_tokens:
        active = run.active
        d = k if chooser is None else chooser.choose()  # drafts verified by this forward
        run.num_draft = d
        if d > 0:
            drafts, q = proposer.propose(run)
            drafts, q = drafts[:, :d], (None if q is None else q[:, :d])
            window = torch.cat([run.newest(), drafts], 1)
        else:
            window = run.newest()
        index = run.pos[:, None] + 1 + slots[: d + 1]  # generated-token index each slot predicts
        logits = model.forward(state, window)
        every = proposer.samples_every_slot or K > 1
        if kernels is not None and (d == 0 or q is not None):  # the same draws, in two kernel launches
            p, fresh, n_acc, next_token = kernels(logits, index, drafts if d > 0 else None, q if d > 0 else None, generator, every)
        else:
            p = probs(logits, index)
            if d > 0:
                accepted, residual = _verify(rule, p[:, :-1], q, drafts, generator, index[:, :-1], run)
            fresh = proposer.draw(run, p if every else p[:, -1:], index if every else index[:, -1:])
            if d > 0:
                resampled = fresh[:, :-1] if residual is None else proposer.draw(run, residual, index[:, :-1])
                n_acc, next_token, known = finalise(accepted, resampled, fresh, drafts, K)
                if complete is not None:
                    next_token = complete_frame(complete, state, sampling, n_acc, next_token, known, generator,
                                                index.gather(1, n_acc[:, None]))[0]
            else:  # autoregressive: the newest token's sample
                n_acc, next_token = no_drafts, fresh[:, -1]
                if complete is not None:
                    next_token = complete_frame(complete, state, sampling, no_drafts, next_token, ones, generator, index)[0]
        bad |= rows_with_invalid_laws(p) & active
        # Write [newest, accepted drafts, next token] from `pos`; later slots are scratch.
        if d > 0:
            written = torch.cat([window, fresh[:, -1:]], 1)
            written = written.scatter(1, frame_index((n_acc + 1)[:, None], K), next_token[:, None])
            step = n_acc + 1
        else:
            written, step = torch.cat([window, next_token[:, None]], 1), ones
        tokens.scatter_(1, frame_index(run.pos[:, None] + slots[: d + 2], K), written)
        still = active
        if variable:
            # Cut each row at its budget, and just after its first stop token among the new ones.
            step = torch.minimum(step, limit - emitted)
            stops = stop_mask(written[:, 1:], stop_ids, stopping) & (slots[1 : d + 2] <= step[:, None])
            hit = stops.any(1)
            step = torch.where(hit, stops.long().argmax(1) + 1, step)
            still = still & ~hit
        if synced:  # unsynced loops (fixed-length autoregressive) have no idle rows
            step = torch.where(active, step, 0)
        model.commit(state, step)
        recorder.record(step, active)
        run.pos = run.pos + step
        emitted += step  # in place: `_Admission` holds this tensor
        run.active = still & (emitted < limit)
        proposer.update(run, n_acc, next_token, fresh, p, active)
        if chooser is not None:  # tokens finalised per row still decoding (one more sync, while it measures)
            chooser.observe(float((step * active).sum() / active.sum().clamp_min(1)) if chooser.measuring else None)
        if feed is None:
            slowest = report(tokens, emitted, run.active, synced)
            continue
        rows.record(step, active)
        admit((active & ~run.active).nonzero().flatten().tolist())  # the host sync of this forward
        slowest = admit.left(num_tokens)

    if streamer is not None:
        streamer.end()
    if feed is None:
        raise_if_masked(bad)
    # With stop tokens, autoregressive decoding of this batch takes as many forwards as its longest row.
    stats = recorder.finish(int(emitted.max()) if variable else num_tokens, B, state.cache_bytes + proposer.cache_bytes)
    proposer.finish(stats)
    if chooser is not None:
        stats.drafts_per_forward = chooser.chosen
    if not variable:
        return DecodeOutput(tokens[:, :num_tokens], stats)
    # Nothing after a row's end is output: pad it.
    past = torch.arange(num_tokens, device=device)[None] >= emitted[:, None]
    out = tokens[:, :num_tokens].masked_fill(frame_index(past, K), stopping.pad_token)
    return DecodeOutput(out, stats, emitted)


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
    if adapt is not None:
        raise ValueError("continuous batching needs a fixed draft window (adapt=False): the adaptive window picks one "
                         "width for the whole batch, so a row's draws would depend on its neighbours")


class _RowCounters:
    """Per-row histograms of finalised tokens per forward (the prefill counts one), reset when
    a row takes a new request."""

    def __init__(self, B: int, k: int, device):
        self.histogram = torch.zeros(B, k + 2, dtype=torch.long, device=device)
        self.started = [0.0] * B

    def reset(self, row: int) -> None:
        self.histogram[row] = 0
        self.histogram[row, 1] = 1
        self.started[row] = time.perf_counter()

    def record(self, step: torch.Tensor, active: torch.Tensor) -> None:
        self.histogram.scatter_add_(1, step.clamp(0, self.histogram.shape[1] - 1)[:, None], active.long()[:, None])

    def stats(self, row: int, tokens: int) -> DecodeStats:
        histogram = self.histogram[row].tolist()
        return DecodeStats(forwards=sum(histogram), tokens=tokens, rows=1, accepted_histogram=histogram,
                           wall_time_s=time.perf_counter() - self.started[row])


class _Admission:
    """Continuous batching: hands finished rows to the feed, frees the rows of cancelled
    requests and starts free rows on the feed's next requests. Row b's prefill runs alone
    (`model.restart`) and every draw for it comes from its request's generator, in a batch-1
    decode's order, so what it decodes does not depend on the other rows (up to the forward's
    own batch invariance)."""

    def __init__(self, feed, model, state, run, proposer, probs, limit, emitted, bad, rows, stopping, stop_ids, num_tokens):
        self.feed, self.restart, self.state, self.run, self.proposer, self.probs = feed, model.restart, state, run, proposer, probs
        self.complete = getattr(model, "complete_frame", None)
        self.limit, self.emitted, self.bad, self.rows = limit, emitted, bad, rows
        self.stopping, self.stop_ids, self.num_tokens = stopping, stop_ids, num_tokens
        self.requests: list = [None] * run.batch_size  # the request each row decodes (None: free)
        self.streamed = [0] * run.batch_size  # tokens each has been handed
        # Idle rows still draw (shapes are fixed): from this one, never from a finished request's
        # generator, which the caller gets back as a batch-1 decode would leave it.
        self.idle = torch.Generator(device=run.device).manual_seed(0)

    def left(self, num_tokens: int) -> int:
        """The loop's test value: 0 while a row decodes a request, else `num_tokens` (no sync:
        after admission a row decodes exactly when it holds a request)."""
        return 0 if any(r is not None for r in self.requests) else num_tokens

    def __call__(self, ended: list[int]) -> None:
        run, zero = self.run, torch.zeros(1, 1, dtype=torch.long, device=self.run.device)
        while True:
            self.stream()
            self.drop_cancelled()
            for row in ended:
                if self.requests[row] is not None:
                    n = int(torch.minimum(self.emitted[row], self.limit[row]))  # a last window may run past the end
                    stats = self.rows.stats(row, n)
                    self.release(row)
                    self.feed.finish(row, run.tokens[row, :n].clone(), stats, bool(self.bad[row]))
            started = []
            # Every free row asks, not only those that just ended: a feed whose requests arrive
            # while others decode (a server's queue) has them started at the next forward.
            free = [row for row, request in enumerate(self.requests) if request is None]
            for row, request in self.feed.refill(free) if free else ():
                p0 = self.probs(self.restart(self.state, row, request.conditions), zero)
                run.generator[row] = request.generator
                run.tokens[row] = 0
                run.tokens[row, 0] = sample(p0, request.generator)[0, 0]
                if self.complete is not None:
                    run.tokens[row, 0] = self.completed(row, run.tokens[row, 0])
                run.pos[row] = 0
                self.emitted[row] = 1
                self.limit[row] = self.num_tokens if request.max_new_tokens is None else min(request.max_new_tokens, self.num_tokens)
                self.bad[row] = rows_with_invalid_laws(p0)[0]
                self.rows.reset(row)
                self.requests[row], self.streamed[row] = request, 0
                started.append(row)
            if not started:  # (the rows started before this pass had their token 0 streamed at its top)
                return
            at = torch.tensor(started, device=run.device)
            first = run.tokens[at, :1]
            run.active[at] = ~(stop_mask(first, self.stop_ids, self.stopping)[:, 0] | (self.limit[at] <= 1))
            self.proposer.restart(run, at)
            ended = [row for row, on in zip(started, run.active[at].tolist()) if not on]  # requests done at token 0

    def completed(self, row: int, frame: torch.Tensor) -> torch.Tensor:
        """Frame 0 [K] of the request starting on `row`, its later codebooks sampled by the
        model (`complete_frame`, from the row's prefill state that `restart` left at slot 0).
        The other rows know their whole frame and draw from the idle generator, so only this
        request's generator draws, as in its batch-1 decode."""
        run, K = self.run, self.run.num_codebooks
        frames = run.tokens[:, 0].clone()
        frames[row] = frame
        known = torch.full((run.batch_size,), K, dtype=torch.long, device=run.device)
        known[row] = 1
        generators = RowGenerators([self.idle] * run.batch_size)
        generators[row] = run.generator[row]
        zero = torch.zeros(run.batch_size, dtype=torch.long, device=run.device)
        return complete_frame(self.complete, self.state, run.per_codebook, zero, frames, known, generators, zero[:, None])[0][row]

    def release(self, row: int) -> None:
        """Free `row`: its request's streamer ends, and the row draws from the idle generator."""
        streamer = self.requests[row].streamer
        if streamer is not None:
            streamer.end()
        self.requests[row] = None
        self.run.generator[row] = self.idle

    def drop_cancelled(self) -> None:
        """Stop decoding the rows whose request was cancelled, and tell the feed (no result)."""
        for row, request in enumerate(self.requests):
            if request is not None and request.cancelled.is_set():
                self.run.active[row] = False
                self.release(row)
                self.feed.drop(row)

    def stream(self) -> None:
        """Hand each live request with a streamer the tokens committed since its last call (one
        host read, only while such a request runs); a cancelled one gets no more."""
        streaming = [(row, r.streamer) for row, r in enumerate(self.requests)
                     if r is not None and r.streamer is not None and not r.cancelled.is_set()]
        if not streaming:
            return
        ends = torch.minimum(self.emitted, self.limit).tolist()
        for row, streamer in streaming:
            if ends[row] > self.streamed[row]:
                streamer.put([self.run.tokens[row, self.streamed[row] : ends[row]].clone()])
                self.streamed[row] = ends[row]


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
