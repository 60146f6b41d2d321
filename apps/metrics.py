"""What `mmgen serve` exposes at `/metrics`, in Prometheus' text format (`prometheus_client`, one
registry per app so that two servers in one process never share counters).

Per modality (the `modality` label: "image", "text", "speech", "video"; "text" was "vlm" before
this release): requests waiting for their model (`mmgen_queue_depth`), requests admitted to it
(`mmgen_rows_running`, images counted one row each), output units made (tokens, frames) in all
and per second over the last `window_s` seconds, time to first output (the first token, audio
chunk or video block; an image request's images) and total latency histograms; per modality and
decoding method, the output units each forward accepted (tokens or frames per model call, the
prefill included). The server also counts its responses by route and status and the requests it
refused before any work, by reason.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
FIRST_OUTPUT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
PER_FORWARD_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 64.0, 256.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class RateWindow:
    """Units made in the last `window_s` seconds, per second (requests are credited when they end)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.events: deque = deque()
        self.lock = threading.Lock()

    def add(self, units: float, now: Optional[float] = None) -> None:
        with self.lock:
            self.events.append((time.monotonic() if now is None else now, units))

    def rate(self, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        with self.lock:
            while self.events and self.events[0][0] < now - self.window_s:
                self.events.popleft()
            return sum(units for _, units in self.events) / self.window_s


class ServerMetrics:
    """The server's Prometheus metrics for the modalities it serves, each with the unit its requests
    make as its request layer counts them (`ModalityService.unit`); their series exist, at 0, from
    the start."""

    def __init__(self, units: Mapping[str, str], window_s: float = 30.0):
        self.registry = CollectorRegistry()
        labels = dict(registry=self.registry)
        self.queue_depth = Gauge("mmgen_queue_depth", "Requests admitted and waiting for their model (bounded by --max-queue)",
                                 ["modality"], **labels)
        self.rows_running = Gauge("mmgen_rows_running", "Rows admitted to their model (one per image of an image request, "
                                  "one per other request): decoding, or waiting for the model's lock when their method "
                                  "cannot share its continuous batch", ["modality"], **labels)
        self.units = Counter("mmgen_output_units", "Output units made (tokens for images and text, frames for speech "
                             "and video)", ["modality", "unit"], **labels)
        self.units_per_second = Gauge("mmgen_output_units_per_second", f"Output units of the requests that ended in the "
                                      f"last {window_s:g} s, per second", ["modality", "unit"], **labels)
        self.first_output = Histogram("mmgen_time_to_first_output_seconds", "Seconds from a request's arrival to its first "
                                      "output (token, audio chunk, video block; an image request's images)", ["modality"],
                                      buckets=FIRST_OUTPUT_BUCKETS, **labels)
        self.latency = Histogram("mmgen_request_latency_seconds", "Seconds from a request's arrival to its end",
                                 ["modality"], buckets=LATENCY_BUCKETS, **labels)
        self.per_forward = Histogram("mmgen_accepted_tokens_per_forward", "Output units a request's decode accepted per "
                                     "model forward (tokens, or frames for speech), by decoding method", ["modality", "method"],
                                     buckets=PER_FORWARD_BUCKETS, **labels)
        self.responses = Counter("mmgen_responses", "HTTP responses by route and status", ["route", "status"], **labels)
        self.rejected = Counter("mmgen_rejected_requests", "Requests refused before any work, by reason", ["reason"], **labels)
        self.unit = dict(units)
        self.windows: dict[str, RateWindow] = {}
        self.recent: dict[str, deque] = {}
        for modality, unit in self.unit.items():
            self.queue_depth.labels(modality)
            self.rows_running.labels(modality)
            self.units.labels(modality, unit)
            self.first_output.labels(modality)
            self.latency.labels(modality)
            window = self.windows[modality] = RateWindow(window_s)
            self.units_per_second.labels(modality, unit).set_function(window.rate)
            self.recent[modality] = deque(maxlen=32)

    def output(self, modality: str, units: int, method: Optional[str] = None, forwards: Optional[int] = None) -> None:
        """A request made `units` output units; its decode took `forwards` model calls with `method`."""
        self.units.labels(modality, self.unit[modality]).inc(units)
        self.windows[modality].add(units)
        if method is not None and forwards:
            self.per_forward.labels(modality, method).observe(units / forwards)

    def ended(self, modality: str, seconds: float) -> None:
        self.latency.labels(modality).observe(seconds)
        self.recent[modality].append(seconds)

    def typical_latency(self, modality: str) -> float:
        """The mean latency of the modality's recent requests (0 before the first): what a client
        refused for a full queue is told to wait."""
        recent = self.recent.get(modality)
        return sum(recent) / len(recent) if recent else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
