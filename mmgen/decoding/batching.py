"""Continuous batching: a fixed number of rows decode while requests wait, and a row that
finishes takes the next request at once (Orca's iteration-level scheduling, Yu et al. 2022,
OSDI; vLLM's scheduler), instead of idling until the slowest row of a static batch ends.

Speculative decoders finalise a different number of tokens per row and forward, so in a
static batch the fast rows wait for the slowest one (batch 4: step compression 1.4-1.7x
against 2x per row). Here every row is one request with its own generator: its prefill runs
alone (`TokenModel.restart`) and every random draw for it comes from its generator in the
order a batch-1 decode draws (`RowGenerators`), so its tokens are those of decoding it alone
with that generator, whichever rows it shared forwards with and whenever it joined. That holds
as far as the model's forward is batch-invariant (a row's logits do not depend on the other
rows): dense matmuls are where the kernel does not change with the row count, as on this CPU
for the tiny and bundled LlamaGens of tests/core/test_continuous_batching.py.

Decoders: autoregressive and the Jacobi family (sjd, gsd, lantern, lantern++), with a fixed
window or the adaptive one; under the adaptive window each row chooses its own draft counts
from its own tokens (`window.RowWindows`), as its decode alone does, and verifies only those
(a forward holds the largest; a row's draws cover its own slots: `RowGenerators.narrowed`),
tokens and frames alike. A row's width widens the whole padded forward, so rows judge widths
at what they cost the batch (`AdaptiveWindow.batch_rows` = `batch_size`, `row_policy`); a
request then decodes what a batch-1 decode with that policy decodes (under greedy decoding,
what any decode does).

A server's batch (`LiveQueue`) changes width with its requests where the model can keep a
subset of its rows (`select_rows`: LlamaGen, the VLM adapter, Dia): it starts as wide as the
requests waiting, grows up to `batch_size` when more wait than rows are free, and narrows to the
running rows once they fill at most half of it (`feed.FeedRows.fit`). A lone request then runs
batch-1 forwards instead of a full batch's; rows keep their state and draws, so each request
still decodes what it decodes alone. Offline calls (`speak_each`, `answer_each`, a job file)
keep the width they start with.

Cancellation (a client that went away): set a request's `cancelled` event, or cancel the future
`ContinuousServer.submit` returned. A running request's row stops decoding at the next forward
and takes the next waiting request; a waiting one never starts. Either way nothing more is
delivered (no tokens, no result; its streamer is ended), and the other rows decode exactly what
they decode without it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch

from mmgen.decoding.base import check_int, check_num_tokens, raise_if_masked
from mmgen.decoding.feed import follows_requests
from mmgen.decoding.stats import DecodeStats
from mmgen.decoding.window import AdaptiveWindow, resolve_adaptive
from mmgen.inference import ordinary
from mmgen.modeling import TokenModel
from mmgen.sampling import RowGenerators, SamplingConfig


@dataclass
class Request:
    """One row's work: `conditions` as `TokenModel.start` takes a batch of one (a class id
    tensor [1], one caption, ...), the `generator` its draws come from, an optional token
    budget below the decode's `num_tokens`, and an optional `streamer` (a core `Streamer`)
    that receives the request's new tokens as they commit (`put([tokens])`, as row 0 of a
    batch-1 decode) and `end()` once they are all out, before its result is handed over.
    `cancelled`: set it from any thread to cancel the request (see the module's docstring)."""

    conditions: Any
    generator: torch.Generator
    max_new_tokens: Optional[int] = None
    streamer: Any = None
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)


@dataclass
class Finished:
    """A request's result: its position in the input order, its tokens [n(, K)] (n = its
    length), its stats (as a batch-1 decode's: forwards with the prefill, histogram; wall time
    from its admission) and whether some distribution had nothing left to sample."""

    index: int
    tokens: torch.Tensor
    stats: DecodeStats
    masked: bool = False

    def checked(self) -> "Finished":
        """This result, or the error a batch-1 decode of it raises (AllTokensMaskedError)."""
        raise_if_masked(torch.tensor([self.masked]))
        return self


class RequestQueue:
    """The loop's `RowFeed` over a sequence of requests: in order; each finished one goes to
    `on_finish` (a cancelled one is skipped, or dropped from its row: no result)."""

    def __init__(self, requests: Iterable[Request], on_finish: Callable[[Finished], None]):
        self.requests, self.on_finish = enumerate(requests), on_finish
        self.index: dict[int, int] = {}  # row -> the request it decodes
        self.count = 0  # requests handed out
        self.tokens = 0  # tokens of the finished ones

    def refill(self, rows: list[int]) -> list[tuple[int, Request]]:
        out = []
        for row in rows:
            while (nxt := next(self.requests, None)) is not None and check_request(nxt[1]).cancelled.is_set():
                _end_stream(nxt[1])  # cancelled while waiting: it never starts
            if nxt is None:
                break
            self.index[row], request = nxt
            self.count += 1
            out.append((row, request))
        return out

    def finish(self, row: int, tokens: torch.Tensor, stats: DecodeStats, masked: bool) -> None:
        self.tokens += len(tokens)
        self.on_finish(Finished(self.index.pop(row), tokens, stats, masked))

    def drop(self, row: int) -> None:
        del self.index[row]


class LiveQueue:
    """A `RowFeed` filled from other threads (a server's queue): `put(request, on_finish,
    on_error)` from anywhere; at each forward the loop takes what has arrived for its free rows,
    never waiting for more. `fail(error)` hands an error to every request taken or waiting. A
    cancelled request (`cancel`, or its `cancelled` event set) gets `on_error(CancelledError())`
    when the queue lets go of it: at once if it waits (through `cancel`), at the next forward if
    it runs."""

    def __init__(self):
        self._waiting: collections.deque = collections.deque()
        self._ready = threading.Condition()
        self.running: dict[int, tuple[int, Callable, Callable]] = {}  # row -> its arrival index and callbacks
        self.count = 0
        self.tokens = 0
        self.max_rows: Optional[int] = None  # the widest batch a decode of this queue runs (`continuous_decode` sets it)

    def waiting(self) -> int:
        """How many requests wait (a decode whose width follows its requests grows for them)."""
        with self._ready:
            return len(self._waiting)

    def renumber(self, rows: list) -> None:
        """The decode's rows changed (`FeedRows.resize`): new row i was row `rows[i]` (None: new)."""
        self.running = {new: self.running[old] for new, old in enumerate(rows) if old in self.running}

    def put(self, request: Request, on_finish: Callable[[Finished], None], on_error: Callable[[BaseException], None]) -> None:
        check_request(request)
        with self._ready:
            self._waiting.append((request, on_finish, on_error))
            self._ready.notify()

    def wait(self) -> Request:
        """Block until a request waits; return it (it stays queued)."""
        with self._ready:
            self._ready.wait_for(lambda: self._waiting)
            return self._waiting[0][0]

    def refill(self, rows: list[int]) -> list[tuple[int, Request]]:
        out, cancelled = [], []
        with self._ready:
            while self._waiting and len(out) < len(rows):
                request, on_finish, on_error = self._waiting.popleft()
                if request.cancelled.is_set():  # it never starts
                    cancelled.append((request, on_error))
                    continue
                row = rows[len(out)]
                self.running[row] = (self.count, on_finish, on_error)  # its place in arrival order
                self.count += 1
                out.append((row, request))
        for request, on_error in cancelled:
            _cancelled(request, on_error)
        return out

    def finish(self, row: int, tokens: torch.Tensor, stats: DecodeStats, masked: bool) -> None:
        self.tokens += len(tokens)
        index, on_finish, _ = self.running.pop(row)
        on_finish(Finished(index, tokens, stats, masked))

    def drop(self, row: int) -> None:
        _, _, on_error = self.running.pop(row)
        on_error(CancelledError())

    def cancel(self, request: Request) -> None:
        """Cancel `request` (from any thread): waiting, it leaves the queue now and never starts;
        running, the loop frees its row at the next forward."""
        request.cancelled.set()
        with self._ready:
            at = next((i for i, (waiting, _, _) in enumerate(self._waiting) if waiting is request), None)
            if at is None:  # running, finished or already let go of
                return
            _, _, on_error = self._waiting[at]
            del self._waiting[at]
        _cancelled(request, on_error)

    def fail(self, error: BaseException) -> None:
        with self._ready:
            failed = [*self.running.values(), *self._waiting]
            self.running.clear()
            self._waiting.clear()
        for _, _, on_error in failed:
            on_error(error)


class ContinuousServer:
    """Serves requests submitted from many threads as one continuous batch (a demo's shared
    queue): `submit` returns a future; one worker thread decodes while requests run or wait
    (`decode(queue)`, e.g. `continuous_decode` on a `LiveQueue`), and a request that arrives
    mid-decode takes the next free row. `result(finished)` runs on the worker for each finished
    request (an image decoder, say); the future holds what it returns. `lock` (a context
    manager) is held while a decode runs, to keep the pipeline's other users off the model. A
    request's `streamer` is ended when its future fails, so a reader never waits on it.
    `future.cancel()` cancels a request until its result is set: waiting, it never starts;
    running, its row is freed at the next forward (its streamer ended, no result).
    The worker thread exists only while requests run or wait: it ends when the queue empties
    and the next `submit` starts another, so an idle server (one a cache let go of, say) holds
    no thread."""

    def __init__(self, decode: Callable[[LiveQueue], Any], result: Callable[[Finished], Any] = lambda f: f,
                 lock: Any = None):
        self.queue, self._decode, self._result = LiveQueue(), decode, result
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self.sessions = 0  # decodes run: requests that overlap share one
        self._worker: Optional[threading.Thread] = None  # while requests run or wait
        self._worker_state = threading.Lock()

    def submit(self, request: Request) -> Future:
        future: Future = Future()

        def finished(done: Finished) -> None:
            if future.cancelled():  # no one waits for its result
                return
            try:
                result = ordinary(self._result(done))
            except BaseException as error:  # the result's own failure goes to its caller
                failed(error)
                return
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                future.set_result(result)

        def failed(error: BaseException) -> None:
            if isinstance(error, CancelledError):  # the queue let go of a cancelled request
                future.cancel()
                return
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)

        def settled(f: Future) -> None:
            if f.cancelled():
                self.queue.cancel(request)
            elif f.exception() is not None and request.streamer is not None:
                request.streamer.end()

        self.queue.put(request, finished, failed)
        future.add_done_callback(settled)
        with self._worker_state:  # after the put: a worker checking for work now sees it, or is gone
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, daemon=True, name="mmgen-continuous-batch")
                self._worker.start()
        return future

    def _work(self) -> None:
        while True:
            with self._worker_state:
                if not self.queue.waiting():  # idle: the next submit starts a new worker
                    self._worker = None
                    return
            self.sessions += 1
            try:
                with self._lock, torch.inference_mode():  # as a pipeline's call decodes (mmgen.inference)
                    self._decode(self.queue)
            except BaseException as error:  # every request of the failed decode hears of it
                self.queue.fail(error)


def check_continuous(decoder: Any, model: Optional[TokenModel] = None) -> None:
    """ValueError unless `decoder` can serve continuous batching: one of the speculative
    loop's decoders; with `model`, also its proposer on that model (rows that restart, draws
    from each row's generator, per-row windows where it adapts its window) and the model's
    `restart`, as the loop checks at its start (a job file's lines are checked so, before any
    work)."""
    from mmgen.decoding.speculative import SpeculativeDecoder, check_row_feed

    if not isinstance(decoder, SpeculativeDecoder):
        raise ValueError(f"continuous batching runs the token decoders of the speculative loop, not {type(decoder).__name__}")
    if getattr(decoder, "tree", 0):
        raise ValueError("token trees decode static batches: continuous batching verifies chains (leave tree= out)")
    if model is not None:
        proposer, _ = decoder.roles(model, 2, torch.Generator(device="cpu"))
        check_row_feed(model, proposer, resolve_adaptive(getattr(decoder, "adapt", None)))


def continuous_decode(
    decoder: Any,
    model: TokenModel,
    requests: Union[Iterable[Request], "LiveQueue"],
    num_tokens: int,
    sampling: SamplingConfig,
    batch_size: int,
    on_finish: Optional[Callable[[Finished], None]] = None,
    stopping: Any = None,
) -> tuple[list[Finished], DecodeStats]:
    """Decode every request with `decoder`, at most `batch_size` rows at a time, refilling a
    row as soon as it finishes. Returns the finished requests in input order (or, with
    `on_finish`, hands each over as it finishes and returns none; a `LiveQueue` hands each to
    its own callback and the decode ends when no request runs or waits; a cancelled request is
    left out) and the run's stats (its forwards over the whole run, prefills included; `rows` =
    requests started; `baseline_forwards` = autoregressive decoding of the same tokens in
    gap-free rows)."""
    from mmgen.decoding.speculative import feed_decode

    check_num_tokens(num_tokens)
    check_continuous(decoder)
    check_int("batch_size", batch_size, 1)
    done: list[Finished] = []
    if isinstance(requests, LiveQueue):
        queue, rows = requests, batch_size
        queue.max_rows = batch_size
        head = queue.wait()
    else:
        requests = iter(requests)
        first = [r for _, r in zip(range(batch_size), requests)]
        if not first:
            return [], DecodeStats()
        queue, rows = RequestQueue(itertools.chain(first, requests), on_finish or done.append), len(first)
        head = check_request(first[0])
    count, tokens = queue.count, queue.tokens
    # The rows' generators until their first request arrives: the proposer's set-up draws
    # from these, never from a request's.
    device = head.generator.device
    generators = RowGenerators(torch.Generator(device=device).manual_seed(0) for _ in range(rows))
    proposer, rule = decoder.roles(model, num_tokens, generators[0])  # feed_decode checks them first
    if follows_requests(queue, model, proposer):  # start as wide as the requests waiting; grow as more come
        rows = min(rows, max(1, queue.waiting()))
        generators = generators.select(range(rows))
    # The batch is sized by the first request's conditions; each row is prefilled again alone.
    result = feed_decode(model, queue, _stack([head.conditions] * rows), num_tokens, sampling, generators, proposer, rule,
                         decoder.capacity(num_tokens), stopping=stopping,
                         adapt=row_policy(resolve_adaptive(getattr(decoder, "adapt", None)), batch_size))
    stats = result.stats
    # Forwards: the batch's decode forwards plus one batch-1 prefill per request. The baseline
    # is autoregressive decoding of the same tokens in rows packed without a gap (a prefill per
    # request, then one token per row and forward), so step_compression compares like with like.
    count, tokens = queue.count - count, queue.tokens - tokens
    stats.forwards, stats.rows, stats.tokens = stats.forwards + count, count, num_tokens
    stats.baseline_forwards = count + -(-(tokens - count) // max(1, min(rows, count)))
    return sorted(done, key=lambda f: f.index), stats


def row_policy(adapt: Optional[AdaptiveWindow], batch_size: int) -> Optional[AdaptiveWindow]:
    """The adaptive window of a continuous batch's rows: judged as rows of `batch_size` rows
    (`AdaptiveWindow.batch_rows`), unless the policy names its own. A fixed setting, never the
    batch's current width, so what a request decodes does not depend on the load."""
    if adapt is None or adapt.batch_rows is not None:
        return adapt
    return dataclasses.replace(adapt, batch_rows=batch_size)


def row_decoder(decoder: Any, batch_size: int) -> Any:
    """The decoder whose batch-1 decode each request of a `batch_size`-row continuous batch
    decodes: `decoder` itself, or under the adaptive window the same decoder with its rows'
    policy (`row_policy`). A decoder object or a spec; a decoder object is returned."""
    from mmgen.decoding import resolve_decoder

    decoder = resolve_decoder(decoder)
    adapt = resolve_adaptive(getattr(decoder, "adapt", None))
    return decoder if adapt is None else dataclasses.replace(decoder, adapt=row_policy(adapt, batch_size))


def check_request(request: Any) -> Request:
    """`request` if it is a `Request` with its own generator and a budget >= 1 (ValueError)."""
    if not isinstance(request, Request) or not isinstance(request.generator, torch.Generator):
        raise ValueError("continuous_decode takes Request objects, each with its own torch.Generator")
    budget = request.max_new_tokens
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"a request's max_new_tokens must be an integer >= 1 or None, got {budget!r}")
    return request


def _end_stream(request: Request) -> None:
    """End a request's streamer, if it has one (its last call: nothing follows)."""
    if request.streamer is not None:
        request.streamer.end()


def _cancelled(request: Request, on_error: Callable[[BaseException], None]) -> None:
    """A cancelled request that never started: its streamer ended, its caller told."""
    _end_stream(request)
    on_error(CancelledError())


def _stack(conditions: list) -> Any:
    """One batch of conditions from per-row ones: tensors concatenated on their first axis,
    dataclasses field by field, mappings (a processor's inputs) key by key; other values (a
    budget, a guidance scale) must be equal in every row. One row's conditions are already a
    batch: returned as they are (so a batch of one starts on the request's own conditions)."""
    head = conditions[0]
    if len(conditions) == 1:
        return head
    if isinstance(head, torch.Tensor):
        return torch.cat([c.reshape(1) if c.ndim == 0 else c for c in conditions])
    if dataclasses.is_dataclass(head):
        return dataclasses.replace(head, **{f.name: _stack([getattr(c, f.name) for c in conditions])
                                            for f in dataclasses.fields(head)})
    if isinstance(head, Mapping):
        return {key: _stack([c[key] for c in conditions]) for key in head}
    if isinstance(head, (int, float, str, type(None))) and all(c == head for c in conditions):
        return head
    raise ValueError(f"cannot batch conditions of type {type(head).__name__}: give tensors, dataclasses or mappings of tensors")


def split_rows(conditions: Any) -> list:
    """Per-row conditions (each a batch of one) from a batch: the inverse of `_stack`."""
    if isinstance(conditions, torch.Tensor):
        return list(conditions.split(1))
    if dataclasses.is_dataclass(conditions):
        parts = {f.name: split_rows(getattr(conditions, f.name)) for f in dataclasses.fields(conditions)}
        return [dataclasses.replace(conditions, **{name: rows[i] for name, rows in parts.items()})
                for i in range(len(next(iter(parts.values()))))]
    raise ValueError(f"cannot split conditions of type {type(conditions).__name__} into rows: give tensors or dataclasses of tensors")
