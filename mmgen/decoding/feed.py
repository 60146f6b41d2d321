"""Continuous batching's side of the speculative loop: the feed of requests (`RowFeed`) and the
loop's rows while a feed fills them (`FeedRows`).

The loop (`speculative.decode`, set up here by `feed_decode`) asks its rows for three things: token 0 of every row before the
first forward (`start`), what follows each forward (`forwarded`: finished rows handed on, free
rows started, and the value the loop compares with `num_tokens` to stop) and the end (`end`).
For one batch decoded once that is `speculative.BatchRows`; with a feed it is `FeedRows`, whose
rows each decode what a batch-1 decode of their request decodes (`mmgen.decoding.batching`
says why and how).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Protocol

import torch

from mmgen.decoding.frames import complete_frame, rows_with_invalid_laws
from mmgen.decoding.proposer import DecodeRun, Proposer
from mmgen.decoding.stats import DecodeStats
from mmgen.decoding.stopping import RowEnds, Streamer
from mmgen.sampling import RowGenerators, sample


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


def follows_requests(feed: Any, model: Any, proposer: Proposer) -> bool:
    """Whether a continuous batch over `feed` can change its width as requests come and go: the
    feed says how many requests wait and renumbers its rows (`LiveQueue`), the model keeps a
    subset of its rows (`select_rows`), and the proposer has no per-row state or keeps it too."""
    cls = type(proposer)
    return (callable(getattr(feed, "waiting", None)) and callable(getattr(model, "select_rows", None))
            and (cls.restart is Proposer.restart or cls.select_rows is not Proposer.select_rows))


class RowCounters:
    """Per-row histograms of finalised tokens per forward (the prefill counts one), reset when
    a row takes a new request: each request's stats are then those of its batch-1 decode."""

    def __init__(self, B: int, k: int, device):
        self.histogram = torch.zeros(B, k + 2, dtype=torch.long, device=device)
        self.started = [0.0] * B

    def reset(self, row: int) -> None:
        self.histogram[row] = 0
        self.histogram[row, 1] = 1
        self.started[row] = time.perf_counter()

    def record(self, step: torch.Tensor, active: torch.Tensor) -> None:
        self.histogram.scatter_add_(1, step.clamp(0, self.histogram.shape[1] - 1)[:, None], active.long()[:, None])

    def select(self, rows: list[int]) -> None:
        """Keep the counters of `rows` (into the current rows, in that order)."""
        self.histogram, self.started = self.histogram[rows], [self.started[r] for r in rows]

    def stats(self, row: int, tokens: int) -> DecodeStats:
        histogram = self.histogram[row].tolist()
        return DecodeStats(forwards=sum(histogram), tokens=tokens, rows=1, accepted_histogram=histogram,
                           wall_time_s=time.perf_counter() - self.started[row])


class FeedRows:
    """The loop's rows under continuous batching: hands finished rows to the feed, frees the
    rows of cancelled requests and starts free rows on the feed's next requests. Row b's
    prefill runs alone (`model.restart`) and every draw for it comes from its request's
    generator, in a batch-1 decode's order, so what it decodes does not depend on the other
    rows (up to the forward's own batch invariance). The loop runs while any row holds a
    request.

    `run` is the loop's `DecodeRun` (its `generator` a `RowGenerators`), `ends` its `RowEnds`,
    whose `limit` and `emitted` this sets per request; `streamer` is the loop's own (each
    request streams to its own), ended with the loop.

    Where the feed, model and proposer allow it (`follows_requests`), the batch's width follows
    its requests (vLLM's scheduler packs only running sequences; Orca's batches change size at
    each iteration): it grows, up to the feed's `max_rows`, when requests wait and no row is
    free, and narrows to its running rows once at most half of them run, so a lone request does
    not pay for a full batch's forwards. Rows keep their order; each keeps its state."""

    def __init__(self, feed: RowFeed, run: DecodeRun, proposer: Proposer, ends: RowEnds, streamer: Optional[Streamer] = None,
                 windows: Any = None):
        B, device = run.batch_size, run.device
        self.feed, self.run, self.proposer, self.ends, self.streamer = feed, run, proposer, ends, streamer
        self.windows = windows  # the rows' own adaptive windows (`window.RowWindows`), or None
        self.restart, self.complete = run.model.restart, getattr(run.model, "complete_frame", None)
        self.bad = torch.zeros(B, dtype=torch.bool, device=device)  # rows that met a law with no valid token
        self.rows = RowCounters(B, run.num_draft, device)
        self.requests: list = [None] * B  # the request each row decodes (None: free)
        self.streamed = [0] * B  # tokens each has been handed
        # Idle rows still draw (shapes are fixed): from this one, never from a finished request's
        # generator, which the caller gets back as a batch-1 decode would leave it.
        self.idle = torch.Generator(device=device).manual_seed(0)
        # A batch of one started on its request's own conditions (`continuous_decode`): that
        # prefill is the request's alone, so its row needs no second one.
        self.prefilled = run.conditions if B == 1 else None
        self.follows = follows_requests(feed, run.model, proposer)
        self.max_rows = max(B, getattr(feed, "max_rows", None) or B)

    def start(self) -> int:
        """Start every row on a request (no row decodes until then)."""
        self.run.active = torch.zeros(self.run.batch_size, dtype=torch.bool, device=self.run.device)
        self.proposer.start(self.run)
        self.admit(list(range(self.run.batch_size)))
        return self.left()

    def forwarded(self, step: torch.Tensor, active: torch.Tensor, p: torch.Tensor) -> int:
        """After a forward that finalised `step` [B] tokens of the rows `active` [B] from laws
        `p`: hand on the rows it ended, start free rows."""
        self.bad |= rows_with_invalid_laws(p) & active
        self.rows.record(step, active)
        self.admit((active & ~self.run.active).nonzero().flatten().tolist())  # the host sync of this forward
        return self.left()

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def left(self) -> int:
        """The loop's test value: 0 while a row decodes a request, else `num_tokens` (no sync:
        after admission a row decodes exactly when it holds a request)."""
        return 0 if any(r is not None for r in self.requests) else self.run.num_tokens

    def admit(self, ended: list[int]) -> None:
        """Hand the rows `ended` to the feed, then start free rows until no new one ends at
        its token 0."""
        run, ends = self.run, self.ends
        zero = torch.zeros(1, 1, dtype=torch.long, device=run.device)
        while True:
            self.stream()
            self.drop_cancelled()
            for row in ended:
                if self.requests[row] is not None:
                    n = int(torch.minimum(ends.emitted[row], ends.limit[row]))  # a last window may run past the end
                    stats = self.rows.stats(row, n)
                    if self.windows is not None:
                        stats.drafts_per_forward = list(self.windows.chosen(row))
                    self.release(row)
                    self.feed.finish(row, run.tokens[row, :n].clone(), stats, bool(self.bad[row]))
            started = []
            if self.follows:
                self.fit()
            # Every free row asks, not only those that just ended: a feed whose requests arrive
            # while others decode (a server's queue) has them started at the next forward.
            free = [row for row, request in enumerate(self.requests) if request is None]
            taken = self.feed.refill(free) if free else []
            for (row, request), first in zip(taken, self.prefill(taken)):
                p0 = run.probs(first, zero)
                run.generator[row] = request.generator
                run.tokens[row] = 0
                run.tokens[row, 0] = (p0.argmax(-1) if run.greedy else sample(p0, request.generator))[0, 0]
                if self.complete is not None:
                    run.tokens[row, 0] = self.completed(row, run.tokens[row, 0])
                run.pos[row] = 0
                ends.emitted[row] = 1
                ends.limit[row] = run.num_tokens if request.max_new_tokens is None else min(request.max_new_tokens, run.num_tokens)
                self.bad[row] = rows_with_invalid_laws(p0)[0]
                self.rows.reset(row)
                self.requests[row], self.streamed[row] = request, 0
                started.append(row)
            if not started:  # (the rows started before this pass had their token 0 streamed at its top)
                return
            at = torch.tensor(started, device=run.device)
            run.active[at] = ~ends.done_at_first(run.tokens[at, :1], ends.limit[at])
            self.proposer.restart(run, at)
            if self.windows is not None:
                self.windows.restart(started)
            ended = [row for row, on in zip(started, run.active[at].tolist()) if not on]  # requests done at token 0

    def prefill(self, taken: list) -> list:
        """The logits predicting token 0 of each (row, request) in `taken`, its row restarted on
        it: together where the model prefills several requests in one batch (`restart_rows`,
        each as alone), else one by one."""
        prefilled, self.prefilled = self.prefilled, None  # only before the first forward
        if len(taken) == 1 and taken[0][0] == 0 and prefilled is not None and taken[0][1].conditions is prefilled:
            return [self.run.state.first_logits]
        together = getattr(self.run.model, "restart_rows", None)
        if together is not None and len(taken) > 1:
            return together(self.run.state, [row for row, _ in taken], [request.conditions for _, request in taken])
        return [self.restart(self.run.state, row, request.conditions) for row, request in taken]

    def fit(self) -> None:
        """Grow to the requests that run and wait (at most `max_rows`) when they outnumber the
        rows; narrow to them once they fill at most half the rows (not on every finished request:
        each change copies the caches)."""
        running = [row for row, request in enumerate(self.requests) if request is not None]
        width = self.run.batch_size
        want = min(self.max_rows, len(running) + self.feed.waiting())
        if want > width:
            self.resize(list(range(width)) + [None] * (want - width))
        elif 0 < want <= width // 2:
            free = [row for row in range(width) if self.requests[row] is None]
            self.resize(running + free[: want - len(running)])

    def resize(self, rows: list) -> None:
        """The batch becomes `rows`: old row indices in their new order, None for a new free row
        (a copy of row 0's state until a request restarts it)."""
        run = self.run
        index = torch.tensor([0 if r is None else r for r in rows], device=run.device)
        run.select_rows(index)
        self.ends.select_rows(index)
        self.proposer.select_rows(run, index)
        if self.windows is not None:
            self.windows.select_rows(index.tolist())
        self.bad = self.bad[index]
        self.rows.select(index.tolist())
        self.requests = [None if r is None else self.requests[r] for r in rows]
        self.streamed = [0 if r is None else self.streamed[r] for r in rows]
        for row, old in enumerate(rows):
            if old is None:
                run.active[row] = False
                run.generator[row] = self.idle
        self.feed.renumber(rows)

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
        return complete_frame(self.complete, run.state, run.per_codebook, zero, frames, known, generators, zero[:, None])[0][row]

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
        ends = torch.minimum(self.ends.emitted, self.ends.limit).tolist()
        for row, streamer in streaming:
            if ends[row] > self.streamed[row]:
                streamer.put([self.run.tokens[row, self.streamed[row] : ends[row]].clone()])
                self.streamed[row] = ends[row]
