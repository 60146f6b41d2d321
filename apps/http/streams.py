"""The request layer's streams stepped in worker threads (`Pull`), responses that clean up however
they end (`Streamed`), and a request's clock for the metrics (`Timing`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional

import anyio
import anyio.to_thread
from fastapi.responses import StreamingResponse

from mmgen.apps.metrics import ServerMetrics

log = logging.getLogger("mmgen.serve")

#: What `Pull.next` returns once the stream has returned its result (or was closed).
END = object()


class Pull:
    """A request layer's stream (a generator of progress that returns the result), stepped in
    worker threads; `close` (from any state) closes it, which stops its run and waits for the
    model. A step and the close never overlap: a task cancelled while its step still runs in
    its thread (a server shutting down) closes the stream once that step is done."""

    def __init__(self, events: Any, limiter: anyio.CapacityLimiter):
        self.events, self.limiter = events, limiter
        self.result: Any = None
        self.finished = self.closed = False
        self.lock = threading.Lock()

    def _step(self) -> Any:
        with self.lock:
            if self.closed:
                return END
            try:
                return next(self.events)
            except StopIteration as end:
                self.result, self.finished = end.value, True
                return END

    def _close(self) -> None:
        with self.lock:
            self.events.close()

    async def next(self) -> Any:
        """The next progress item, or `END` once the stream has returned its result (or was closed)."""
        if self.finished or self.closed:
            return END
        return await anyio.to_thread.run_sync(self._step, limiter=self.limiter)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):  # runs when the response was cancelled too
            try:
                await anyio.to_thread.run_sync(self._close, limiter=self.limiter)
            except Exception:  # the run is abandoned: its error has no one to go to
                log.exception("closing an abandoned request's stream failed")


class Streamed(StreamingResponse):
    """A streamed response that runs `cleanup` however it ends: finished, failed, or cancelled
    because its client went away (Starlette cancels the body's iteration then)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Any], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleanup()


class Timing:
    """A request's clock, from its arrival: its first output and its end go to the metrics once."""

    def __init__(self, metrics: ServerMetrics, modality: str):
        self.metrics, self.modality = metrics, modality
        self.begun = time.perf_counter()
        self.first: Optional[float] = None
        self.ended = False

    def first_output(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.begun
            self.metrics.first_output.labels(self.modality).observe(self.first)

    def end(self, units: int = 0, method: Optional[str] = None, forwards: Optional[int] = None) -> None:
        if self.ended:
            return
        self.ended = True
        self.first_output()
        self.metrics.ended(self.modality, time.perf_counter() - self.begun)
        if units:
            self.metrics.output(self.modality, units, method, forwards)
