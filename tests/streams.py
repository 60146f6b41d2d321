"""Helpers for tests of streamed outputs and concurrent requests."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator


def drain(events: Iterator) -> tuple[list, Any]:
    """Every item a generator yields, and its return value."""
    items = []
    while True:
        try:
            items.append(next(events))
        except StopIteration as done:
            return items, done.value


def in_threads(work: Callable[[Any], None], keys: Iterable, timeout: float = 120) -> None:
    """`work(key)` for every key, each in its own thread, all started before any is joined."""
    threads = [threading.Thread(target=work, args=(key,)) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)


def arrivals(schedule: dict, seen: dict):
    """A server's queue (`LiveQueue`) whose requests arrive at chosen points of a decode: the
    batch asks how many wait after each forward (call 1 sizes the batch, call 2 comes while its
    first rows start), and `schedule` maps a call number to the requests that arrive then. Each
    finished request lands in `seen` under its arrival index; `queue.arrive(request)` puts one now."""
    from mmgen.decoding.batching import LiveQueue

    class Arrivals(LiveQueue):
        calls = 0

        def arrive(self, request) -> None:
            self.put(request, lambda done: seen.__setitem__(done.index, done), None)

        def waiting(self) -> int:
            self.calls += 1
            for request in schedule.pop(self.calls, []):
                self.arrive(request)
            return super().waiting()

    return Arrivals()


def recorded_widths(monkeypatch) -> list:
    """The width of a continuous batch after each change (`FeedRows.resize`), as it happens."""
    from mmgen.decoding import feed

    widths = []
    resize = feed.FeedRows.resize
    monkeypatch.setattr(feed.FeedRows, "resize", lambda self, rows: (widths.append(len(rows)), resize(self, rows))[1])
    return widths
