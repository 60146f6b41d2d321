"""What every decoder reports: forwards, tokens, accepted lengths, time and memory."""

from __future__ import annotations

import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Optional

import torch


@dataclass
class DraftCounters:
    """Per-family extra of decoders where a second model proposes (draft-model speculation,
    continuous speculative decoding): the drafter's forwards, prefill included, the tokens
    `drafted` and verified over all rows, the `accepted_drafts` the acceptance rule kept, and for
    continuous drafts the residual samples that ran out of rejection rounds (`fallbacks`)."""

    draft_forwards: int = 0
    drafted: int = 0
    accepted_drafts: int = 0
    fallbacks: int = 0


@dataclass
class StageCounters:
    """Per-family extra of decoders that hand work between models (entropy switching,
    next-scale schedules): per model in their schedule, its forwards (`stage_forwards`) and the
    tokens it sampled over all rows (`stage_tokens`)."""

    stage_forwards: list[int] = field(default_factory=list)
    stage_tokens: list[int] = field(default_factory=list)


#: Every family extra, for reading its counters with their defaults on any stats object.
EXTRAS = (DraftCounters, StageCounters)
_EXTRA_DEFAULTS = {f.name: f for cls in EXTRAS for f in fields(cls)}


@dataclass
class DecodeStats:
    """Counters of one `generate` call: a small common core plus a per-family `extra`.

    `forwards` counts model calls over the whole batch, the prefill included, so plain
    autoregressive decoding of n tokens takes exactly n. `tokens` is the tokens per row (with
    stop tokens, the longest row's: the forwards autoregressive decoding of the batch takes). `accepted_histogram[k]` counts the
    (row, forward) pairs that finalised k tokens; rows that had finished are not counted.
    `accepted_per_forward[i]` is the mean number of tokens the rows still decoding finalised at
    forward i (the trace behind the histogram). Decoders whose baseline is not one forward per
    token (next-scale models: one per scale; masked continuous models: one per step) set
    `baseline_forwards`. Peak memory is the CUDA allocator's peak and None on CPU, where torch
    has no allocator statistics.

    `extra` holds one family's own counters (`DraftCounters`, `StageCounters`) or None. Its
    fields read as attributes of the stats (`stats.draft_forwards`), with their defaults when
    the decode had none, and `to_dict` flattens them.
    """

    forwards: int = 0
    tokens: int = 0
    rows: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    peak_memory_bytes: Optional[int] = None
    cache_bytes: int = 0
    baseline_forwards: Optional[int] = None
    accepted_per_forward: list[float] = field(default_factory=list)
    drafts_per_forward: list[int] = field(default_factory=list)  # under an AdaptiveWindow or a drafter's confidence stop: each forward's draft count
    extra: Optional[Any] = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not core fields: a family counter.
        extra = self.__dict__.get("extra")
        if extra is not None and hasattr(extra, name):
            return getattr(extra, name)
        if name in _EXTRA_DEFAULTS:
            f = _EXTRA_DEFAULTS[name]
            return f.default_factory() if f.default_factory is not MISSING else f.default
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens finalised per row per forward (1.0 for autoregressive decoding)."""
        total = sum(self.accepted_histogram)
        return sum(k * c for k, c in enumerate(self.accepted_histogram)) / total if total else 0.0

    @property
    def step_compression(self) -> float:
        """Autoregressive forwards / this decoder's forwards for the same tokens. Autoregressive
        decoding takes one forward per token, or per step (`baseline_forwards`) for models that
        emit several tokens per step (next-scale models)."""
        baseline = self.tokens if self.baseline_forwards is None else self.baseline_forwards
        return baseline / self.forwards if self.forwards else 0.0

    def to_dict(self, per_forward: bool = True) -> dict:
        """The core counters, every family counter (defaults where the decode had none) and
        the derived figures, flat. `per_forward=False` leaves out the per-forward traces
        (`accepted_per_forward`, `drafts_per_forward`): batch records, where the histogram
        suffices and one list per forward would repeat in every row's record."""
        skip = {"extra"} if per_forward else {"extra", "accepted_per_forward", "drafts_per_forward"}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out.update({name: getattr(self, name) for name in _EXTRA_DEFAULTS})
        out["mean_accepted_length"] = self.mean_accepted_length
        out["step_compression"] = self.step_compression
        return out

    def summary(self) -> str:
        return (
            f"forwards={self.forwards} tokens/row={self.tokens} rows={self.rows} "
            f"mean_accepted_length={self.mean_accepted_length:.2f} "
            f"step_compression={self.step_compression:.2f}x wall_time={self.wall_time_s:.3f}s"
        )


class StatsRecorder:
    """Times a decode and collects its histogram on the device (no host sync until `finish`)."""

    def __init__(self, device: torch.device, max_accepted: int):
        self.device = torch.device(device)
        self.histogram = torch.zeros(max_accepted + 1, dtype=torch.long, device=self.device)
        self.forwards = 0
        self._trace: list[torch.Tensor] = []  # per forward [2]: tokens its active rows finalised, and their count
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()

    def record(self, accepted: torch.Tensor, active: torch.Tensor) -> None:
        """One forward: `accepted` [B] tokens finalised by each row, counted where `active`."""
        self.forwards += 1
        self.histogram.scatter_add_(0, accepted.clamp(0, self.histogram.numel() - 1), active.long())
        # Reduced on the device, read in `finish` (a continuous batch's width may change between forwards).
        self._trace.append(torch.stack([torch.where(active, accepted, 0).sum(), active.sum()]))

    def finish(self, tokens: int, rows: int, cache_bytes: int) -> DecodeStats:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._start
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        trace = torch.stack(self._trace).double() if self._trace else torch.zeros(0, 2, dtype=torch.float64)
        per_forward = (trace[:, 0] / trace[:, 1].clamp_min(1)).tolist()
        return DecodeStats(
            forwards=self.forwards,
            tokens=tokens,
            rows=rows,
            accepted_histogram=self.histogram.tolist(),
            wall_time_s=wall,
            peak_memory_bytes=peak,
            cache_bytes=cache_bytes,
            accepted_per_forward=per_forward,
        )
