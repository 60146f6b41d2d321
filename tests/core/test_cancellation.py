"""A client that goes away: a cancelled request frees its row at the next forward, a cancelled
waiting request never starts, and the other requests decode what they decode alone; one
thread-and-stream helper stops its run at the next output and closes only once it has ended.
"""

import threading
from concurrent.futures import CancelledError

import pytest
import torch

from mmgen.decoding.batching import ContinuousServer, Request, continuous_decode
from mmgen.sampling import make_generator
from mmgen.streaming import StreamClosed, stream_from_thread

from tests.core.test_continuous_batching import LABELS, MODEL, SAMPLED, fixed, solo


class Counting:
    """MODEL, counting the batch's decode forwards (prefills run inside `restart`)."""

    def __init__(self):
        self.forwards = 0

    def __getattr__(self, name):
        return getattr(MODEL, name)

    def forward(self, state, window):
        self.forwards += 1
        return MODEL.forward(state, window)


class Recorder:
    """A request's streamer: logs (event, request, tokens, decode forwards so far); `on_put(n)`
    runs at its n-th put (from the decoding thread)."""

    def __init__(self, index, log, model, on_put=None):
        self.index, self.log, self.model, self.on_put, self.puts = index, log, model, on_put, 0

    def put(self, rows):
        self.puts += 1
        self.log.append(("put", self.index, len(rows[0]), self.model.forwards))
        if self.on_put is not None:
            self.on_put(self.puts)

    def end(self):
        self.log.append(("end", self.index, 0, self.model.forwards))


def events(log, index, kind=None):
    return [e for e in log if e[1] == index and (kind is None or e[0] == kind)]


def fresh_state(seed):
    return make_generator(seed).get_state()


def test_a_cancelled_running_request_frees_its_row_at_once_for_the_next_waiting_one():
    decoder, model, log = fixed("sjd"), Counting(), []
    requests = [Request(torch.tensor([label]), make_generator(i)) for i, label in enumerate(LABELS[:4])]
    cancel_at = 3  # request 0 is cancelled at its third put (after two decode forwards)
    for i, request in enumerate(requests):
        on_put = (lambda n: n == cancel_at and requests[0].cancelled.set()) if i == 0 else None
        request.streamer = Recorder(i, log, model, on_put)
    done, stats = continuous_decode(decoder, model, requests, 64, SAMPLED, batch_size=2)
    # No result and nothing more streamed: its streamer ends right after the put that cancelled it.
    assert [f.index for f in done] == [1, 2, 3] and stats.rows == 4
    mine = events(log, 0)
    assert [e[0] for e in mine] == ["put"] * cancel_at + ["end"] and mine[-1][3] == mine[-2][3]
    # Request 2 starts on the freed row before the next forward, while request 1 still runs in
    # the other row (so the freed row is the one request 2 took).
    cancelled_at = mine[-1][3]
    assert events(log, 2, "put")[0][3] == cancelled_at < events(log, 1, "end")[0][3]
    # Every other request decodes what it decodes alone.
    for f in done:
        alone = solo(decoder, LABELS[f.index], f.index, SAMPLED)
        assert torch.equal(f.tokens, alone.tokens[0]), f"request {f.index}"
        assert f.stats.forwards == alone.stats.forwards


def test_a_cancelled_waiting_request_never_starts():
    decoder, model, log = fixed("sjd"), Counting(), []
    requests = [Request(torch.tensor([label]), make_generator(i)) for i, label in enumerate(LABELS[:5])]
    requests[1].cancelled.set()  # before the decode
    for i, request in enumerate(requests):
        # request 3 is cancelled while it waits (at request 0's second put)
        on_put = (lambda n: n == 2 and requests[3].cancelled.set()) if i == 0 else None
        request.streamer = Recorder(i, log, model, on_put)
    done, stats = continuous_decode(decoder, model, requests, 64, SAMPLED, batch_size=2)
    assert [f.index for f in done] == [0, 2, 4] and stats.rows == 3
    for i in (1, 3):  # no prefill, no draw, no token: only its streamer's end
        assert [e[0] for e in events(log, i)] == ["end"]
        assert torch.equal(requests[i].generator.get_state(), fresh_state(i))
    for f in done:
        assert torch.equal(f.tokens, solo(decoder, LABELS[f.index], f.index, SAMPLED).tokens[0]), f"request {f.index}"


def test_a_servers_cancelled_future_frees_its_row_and_the_server_goes_on():
    """`ContinuousServer`: `future.cancel()` while waiting (the request never starts) and while
    running (from its own streamer, on the decoding thread); the others' results are their
    decodes alone, and the server serves the next request."""
    decoder, model, log, gate = fixed("sjd"), Counting(), [], threading.Lock()
    server = ContinuousServer(lambda queue: continuous_decode(decoder, model, queue, 64, SAMPLED, batch_size=2), lock=gate)
    futures = []
    requests = [Request(torch.tensor([label]), make_generator(i)) for i, label in enumerate(LABELS[:4])]
    for i, request in enumerate(requests):
        request.streamer = Recorder(i, log, model, (lambda n: n == 3 and futures[0].cancel()) if i == 0 else None)
    with gate:  # nothing decodes until every request waits
        futures = [server.submit(r) for r in requests]
        assert futures[1].cancel() and futures[1].cancelled()
        assert [e[0] for e in events(log, 1)] == ["end"]  # ended at once, not when its turn comes
    for i in (2, 3):
        assert torch.equal(futures[i].result(timeout=120).tokens, solo(decoder, LABELS[i], i, SAMPLED).tokens[0])
    mine = events(log, 0)  # freed at once: no put after the cancel, its end before the next forward
    assert futures[0].cancelled() and [e[0] for e in mine] == ["put"] * 3 + ["end"] and mine[-1][3] == mine[-2][3]
    with pytest.raises(CancelledError):
        futures[0].result()
    assert torch.equal(requests[1].generator.get_state(), fresh_state(1)) and not server.queue.running
    # A request set cancelled directly (not through its future) has its future cancelled too.
    direct = Request(torch.tensor([LABELS[4]]), make_generator(4))
    direct.cancelled.set()
    late = Request(torch.tensor([LABELS[5]]), make_generator(5))
    with gate:
        skipped, served = server.submit(direct), server.submit(late)
    assert torch.equal(served.result(timeout=120).tokens, solo(decoder, LABELS[5], 5, SAMPLED).tokens[0])
    assert skipped.cancelled() and torch.equal(direct.generator.get_state(), fresh_state(4))


# --- one thread-and-stream helper ---------------------------------------------------------


def test_stream_from_thread_yields_returns_and_raises_in_the_consumer():
    def run(emit):
        for i in range(3):
            emit(i)
        return "done"

    stream, items = stream_from_thread(run), []
    with pytest.raises(StopIteration) as end:
        while True:
            items.append(next(stream))
    assert items == [0, 1, 2] and end.value.value == "done"

    def broken(emit):
        emit("first")
        raise RuntimeError("the run broke")

    stream = stream_from_thread(broken)
    assert next(stream) == "first"
    with pytest.raises(RuntimeError, match="the run broke"):
        next(stream)


def test_a_closed_stream_stops_its_run_at_the_next_output_and_closes_once_it_ended():
    emitted, finished, release = [], threading.Event(), threading.Event()
    outcome = {}

    def run(emit):
        try:
            for i in range(1000):
                if i == 1:
                    release.wait(timeout=60)  # still working when the consumer closes
                emit(i)
                emitted.append(i)
        except StreamClosed as error:
            outcome["stopped"] = error
            raise
        finally:
            finished.set()

    stream = stream_from_thread(run)
    assert next(stream) == 0
    closer = threading.Thread(target=stream.close)
    closer.start()
    closer.join(timeout=0.2)
    assert closer.is_alive() and not finished.is_set()  # the close waits for the run
    release.set()
    closer.join(timeout=60)
    assert not closer.is_alive() and finished.is_set()
    assert emitted == [0] and "stopped" in outcome  # it stopped at its next output
