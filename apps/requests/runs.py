"""What every request returns and streams, whatever the modality: a `Result` of runs (the
method's, and in compare mode the autoregressive baseline's first on the same seed), each run
counting its output units (tokens, frames, blocks), so that methods are compared per unit of
output and never per call; and the generator plumbing that relays a pipeline's stream as a
request's progress.

One rule for a client that goes away: closing a request's stream closes the pipeline's stream
under it, which stops the run at its next output and returns only when the model is free
(`mmgen.streaming`), so the catalogue's lock is never released under a running model.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterator, Optional, Sequence, TypeVar

R = TypeVar("R")

BASELINE_LABEL = "ar (baseline)"


class PerUnit:
    """What a modality's run adds to its `units` (output made) and `seconds` (time taken): the
    milliseconds per unit that comparisons use."""

    @property
    def ms_per_unit(self) -> Optional[float]:
        return 1000 * self.seconds / self.units if self.units else None


class Result:
    """The runs of one request, the baseline first in compare mode: each a `PerUnit` with a
    `label`, the `units` it made and the `seconds` it took. `unit` names what the runs count
    ("token", "frame")."""

    unit: str = "token"
    runs: Sequence[Any]

    @property
    def method(self) -> Any:
        return self.runs[-1]

    @property
    def baseline(self) -> Optional[Any]:
        return self.runs[0] if len(self.runs) > 1 else None

    def speed_columns(self, run: PerUnit) -> dict[str, Any]:
        """A run's time per output unit and, in compare mode, its speedup over the baseline per
        unit: runs that make different amounts of output are compared fairly."""
        columns = {f"ms/{self.unit}": None if run.ms_per_unit is None else round(run.ms_per_unit, 2)}
        base = self.baseline
        if base is not None:
            fair = base.ms_per_unit and run.ms_per_unit
            columns[f"speedup (per {self.unit})"] = round(base.ms_per_unit / run.ms_per_unit, 2) if fair else None
        return columns


def finish(events: Generator[Any, None, R]) -> R:
    """Drive a request's stream to its end and return its result (the generator's return value)."""
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value


def relay(stream: Iterator[Any], progress: Callable[[Any], Any]) -> Generator[Any, None, Any]:
    """Yield `progress(item)` for each item of a pipeline's `stream`; return the stream's return
    value. Closed early, it closes `stream` (which stops the run and waits for the model)."""
    try:
        while True:
            try:
                item = next(stream)
            except StopIteration as end:
                return end.value
            yield progress(item)
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
