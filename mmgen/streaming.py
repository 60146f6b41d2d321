"""Run a pipeline call in a thread and stream what it emits: the one implementation behind every
`stream` of the pipelines and demos.

A client that goes away (the consumer closes the generator, or drops it) follows one rule: the
run is stopped at its next output, and the generator's close returns only when the run has
ended, so the model is free again; a caller that holds a model lock around the stream holds it
for as long as the model runs.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Generator, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

_DONE = object()  # the worker's last item


class StreamClosed(Exception):
    """Raised by `emit` in the worker once the stream was closed: it ends the run there."""


def stream_from_thread(run: Callable[[Callable[[T], None]], R], name: str = "mmgen-stream") -> Generator[T, None, R]:
    """Run `run(emit)` in a daemon thread and yield each item it passes to `emit`, in order; the
    generator's return value (`StopIteration.value`, or `yield from`) is what `run` returns, and
    an exception `run` raises is raised here, in the consumer's thread.

    Closed early (`close()`, an exception thrown in, or garbage collection), the generator tells
    the run to stop: its next `emit` raises `StreamClosed`, which ends it at its next output.
    The close then waits for the thread to end before returning, so the model it runs is free
    when it returns. The thread, named `"{name} (run)"`, starts at the first `next()`."""
    items: "queue.Queue" = queue.Queue()
    stop = threading.Event()
    outcome: dict[str, Any] = {}

    def emit(item: T) -> None:
        if stop.is_set():
            raise StreamClosed("the stream was closed: the run stops at its next output")
        items.put(item)

    def work() -> None:
        try:
            outcome["value"] = run(emit)
        except BaseException as error:  # re-raised in the consumer's thread
            outcome["error"] = error
        finally:
            items.put(_DONE)

    worker = threading.Thread(target=work, daemon=True, name=f"{name} (run)")
    worker.start()
    try:
        while (item := items.get()) is not _DONE:
            yield item
    finally:  # also when closed early: stop at the next output, and wait for the model to be free
        stop.set()
        worker.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class CallbackStreamer:
    """A decoding `Streamer` (`mmgen.decoding.Streamer`) that hands each row's newly committed
    tokens to `emit` as `(row, tokens)` (rows with new tokens only; the tokens copied, since a
    decode reuses its buffers): a decode's bridge to `stream_from_thread`."""

    def __init__(self, emit: Callable[[tuple[int, Any]], None]):
        self.emit = emit

    def put(self, rows: list) -> None:
        for row, tokens in enumerate(rows):
            if len(tokens):
                with torch.inference_mode(False):  # an ordinary copy, from a decode in inference mode too
                    copy = tokens.clone()
                self.emit((row, copy))

    def end(self) -> None:
        pass
