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
