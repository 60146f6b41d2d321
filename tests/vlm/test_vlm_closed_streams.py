"""A client that goes away from a VLM stream: closing `VLMServer.stream` cancels its request
(its row is freed at the batch's next forward); closing `VLMPipeline.stream` stops the decode at
its next token and returns once the model is free."""

import threading
import time

from mmgen.sampling import make_generator
from mmgen.vlm.token_model import VLMTokenModel

from tests.vlm.test_vlm_pipeline import BUILDERS, PROMPTS

BUDGET = 48  # tokens a request would decode if nobody cancelled it (no stop token)


def slowed(monkeypatch) -> list:
    """Slow every forward down (so a decode is still running when its reader leaves) and log them."""
    forwards, forward = [], VLMTokenModel.forward

    def slow(self, state, window):
        forwards.append(threading.current_thread().name)
        time.sleep(0.01)
        return forward(self, state, window)

    monkeypatch.setattr(VLMTokenModel, "forward", slow)
    return forwards


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_closing_a_served_stream_cancels_its_request_and_frees_its_row(monkeypatch):
    pipe = BUILDERS["llava"]()
    forwards = slowed(monkeypatch)
    server = pipe.serve("ar", batch_size=1, max_new_tokens=BUDGET, stop_token_ids=[])
    futures, submit = [], server.server.submit
    monkeypatch.setattr(server.server, "submit", lambda request: futures.append(submit(request)) or futures[-1])
    stream = server.stream(PROMPTS[0], generator=make_generator(0))
    next(stream)
    stream.close()
    closed_at = len(forwards)
    assert futures[0].cancelled()
    wait_until(lambda: not server.server.queue.running)  # the loop let go of its row
    assert len(forwards) - closed_at <= 1 and len(forwards) < BUDGET  # at most the forward under way
    # The row serves the next request, which answers what it answers alone.
    text, _, _ = server.submit(PROMPTS[1], generator=make_generator(1), max_new_tokens=5).result(timeout=120)
    assert text == pipe(PROMPTS[1], max_new_tokens=5, stop_token_ids=[], generator=make_generator(1)).texts[0]


def test_closing_a_pipeline_stream_stops_the_decode_and_returns_once_the_model_is_free(monkeypatch):
    pipe = BUILDERS["llava"]()
    forwards = slowed(monkeypatch)
    stream = pipe.stream(PROMPTS[0], max_new_tokens=BUDGET, stop_token_ids=[], generator=make_generator(0))
    next(stream)
    stream.close()
    assert not any(t.name == "mmgen-vlm-stream (run)" for t in threading.enumerate())  # the decode has ended
    ran = len(forwards)
    assert 0 < ran < BUDGET - 1
    time.sleep(0.05)
    assert len(forwards) == ran
