"""A client that goes away from a speech stream: closing `TTSServer.stream` cancels its request
(its row is freed at the batch's next forward); closing `TTSPipeline.stream` stops the decode at
its next frame and returns once the model is free."""

import threading
import time

import torch

from mmgen.audio.dia import DiaTokenModel

from tests.audio.tiny import tiny_dia

TEXT = "[S1] Something else entirely, and longer."
BUDGET = 60  # frames a request would decode if nobody cancelled it


def slowed(monkeypatch) -> list:
    """Slow every forward down (so a decode is still running when its reader leaves) and log them."""
    forwards, forward = [], DiaTokenModel.forward

    def slow(self, state, window):
        forwards.append(threading.current_thread().name)
        time.sleep(0.01)
        return forward(self, state, window)

    monkeypatch.setattr(DiaTokenModel, "forward", slow)
    return forwards


def test_closing_a_served_stream_cancels_its_request_and_frees_its_row(monkeypatch):
    pipe = tiny_dia(0)
    forwards = slowed(monkeypatch)
    server = pipe.serve("ar", batch_size=1, max_new_frames=BUDGET, temperature=1.0, top_k=20)
    futures, submit = [], server.server.submit
    monkeypatch.setattr(server.server, "submit", lambda request: futures.append(submit(request)) or futures[-1])
    stream = server.stream(TEXT, generator=torch.Generator().manual_seed(0))
    next(stream)
    stream.close()
    closed_at = len(forwards)
    assert futures[0].cancelled()
    deadline = time.monotonic() + 60
    while server.server.queue.running:  # until the loop lets go of its row
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
    assert len(forwards) - closed_at <= 1 and len(forwards) < BUDGET  # at most the forward under way
    # The row serves the next request, which speaks what it speaks alone.
    audio, frames, _ = server.submit(TEXT, generator=torch.Generator().manual_seed(1), max_new_frames=12).result(timeout=120)
    alone = pipe(TEXT, max_new_frames=12, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(1))
    assert torch.equal(frames, alone.frames[0, : int(alone.lengths[0])]) and torch.equal(audio, alone.audio[0])


def test_closing_a_pipeline_stream_stops_the_decode_and_returns_once_the_model_is_free(monkeypatch):
    pipe = tiny_dia(0)
    forwards = slowed(monkeypatch)
    stream = pipe.stream(TEXT, max_new_frames=BUDGET, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(0))
    next(stream)
    stream.close()
    assert not any(t.name == "mmgen-tts-stream (run)" for t in threading.enumerate())  # the decode has ended
    ran = len(forwards)
    assert 0 < ran < BUDGET - 1
    time.sleep(0.05)
    assert len(forwards) == ran
