"""Admission: a bounded waiting room and a few slots per model. Requests that find their model's
slots taken wait, at most `max_queue` of them over the whole server; one more is refused (429,
`Retry-After`)."""

from __future__ import annotations

import asyncio
import math
from typing import Mapping, Optional, Sequence

from mmgen.apps.metrics import ServerMetrics

from .errors import ApiError


class Lane:
    """One model's slots: as many requests at once as its continuous batch has rows (1 without)."""

    def __init__(self, slots: int):
        self.slots, self.admitted = slots, 0
        self.semaphore: Optional[asyncio.Semaphore] = None

    def gate(self) -> asyncio.Semaphore:
        if self.semaphore is None:  # made on the server's event loop
            self.semaphore = asyncio.Semaphore(self.slots)
        return self.semaphore


class Admission:
    """Requests admitted to the models: those that find their model's slots taken wait, at most
    `max_queue` of them over the whole server; one more is refused (429, `Retry-After`).
    `models` names each modality's models, so that a request whose every model would wait is
    refused before its body is read (`full`)."""

    def __init__(self, max_queue: int, metrics: ServerMetrics, slots: Mapping[str, int],
                 models: Optional[Mapping[str, Sequence[str]]] = None):
        self.max_queue, self.metrics, self.slots = max_queue, metrics, dict(slots)
        self.models = {modality: list(names) for modality, names in (models or {}).items()}
        self.lanes: dict[tuple[str, str], Lane] = {}
        self.queued = 0

    def lane(self, modality: str, model: str) -> Lane:
        return self.lanes.setdefault((modality, model), Lane(self.slots.get(modality, 1)))

    def full(self, modality: str) -> bool:
        """Whether a request for any of the modality's models would be refused now: the queue is
        full and every one of those models' slots is taken."""
        names = self.models.get(modality)
        return bool(names) and self.queued >= self.max_queue and all(
            self.lane(modality, name).admitted >= self.lane(modality, name).slots for name in names)

    def retry_after(self, modality: str, model: Optional[str] = None) -> int:
        """Seconds a refused request should wait: the modality's typical latency, longer the
        busier its model (the busiest of the modality's when none is named)."""
        names = [model] if model is not None else self.models.get(modality, [])
        load = max((self.lane(modality, n).admitted / self.lane(modality, n).slots for n in names), default=0)
        return max(1, math.ceil(self.metrics.typical_latency(modality) * (1 + load)))

    def admit(self, modality: str, model: str, rows: int = 1) -> "Ticket":
        lane = self.lane(modality, model)
        waits = lane.admitted >= lane.slots
        if waits and self.queued >= self.max_queue:
            self.metrics.rejected.labels("queue_full").inc()
            retry = self.retry_after(modality, model)
            raise ApiError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry in {retry} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
        return Ticket(self, lane, modality, rows, waits)


class Ticket:
    """One request's place: waiting (counted in the queue) until `start`, then running (its rows
    counted) until `done`. `done` is idempotent and right in every state."""

    def __init__(self, admission: Admission, lane: Lane, modality: str, rows: int, waits: bool):
        self.admission, self.lane, self.modality, self.rows, self.waits = admission, lane, modality, rows, waits
        self.state = "waiting"
        lane.admitted += 1
        if waits:
            admission.queued += 1
            admission.metrics.queue_depth.labels(modality).inc()

    def _leave_queue(self) -> None:
        if self.waits:
            self.waits = False
            self.admission.queued -= 1
            self.admission.metrics.queue_depth.labels(self.modality).dec()

    async def start(self) -> None:
        """Wait for a slot of the model."""
        await self.lane.gate().acquire()
        self._leave_queue()
        self.state = "running"
        self.admission.metrics.rows_running.labels(self.modality).inc(self.rows)

    def done(self) -> None:
        if self.state == "done":
            return
        if self.state == "running":
            self.lane.gate().release()
            self.admission.metrics.rows_running.labels(self.modality).dec(self.rows)
        self._leave_queue()
        self.lane.admitted -= 1
        self.state = "done"
