"""When rows end, and who hears of their tokens: `Stopping`, the speculative loop's `RowEnds`,
streamers and the reporter that the token loops (`speculative_decode`, `EntropySwitch`) call
after every forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

import torch

from mmgen.decoding.base import DecodeOutput, Progress
from mmgen.decoding.frames import frame_index
from mmgen.inference import ordinary


@dataclass
class Stopping:
    """When each row ends: at its first stop token (which is kept) or after `max_new_tokens`
    tokens (an int, or one per row), whichever comes first. For frames, a stop token is read
    on codebook `stop_codebook`, or on every codebook of a tuple (CSM ends with a frame whose
    first K-1 codebooks are all its EOS code). Image models decode a fixed length and pass no
    `Stopping`."""

    stop_tokens: Sequence[int] = ()
    max_new_tokens: Union[int, Sequence[int], torch.Tensor, None] = None
    stop_codebook: Union[int, tuple[int, ...]] = 0
    pad_token: int = 0  # what the output holds after a row's end

    def limits(self, batch: int, num_tokens: int, device) -> torch.Tensor:
        """Per-row token budget [B], at most `num_tokens`."""
        if self.max_new_tokens is None:
            return torch.full((batch,), num_tokens, dtype=torch.long, device=device)
        limit = torch.as_tensor(self.max_new_tokens, dtype=torch.long, device=device).expand(batch).clone()
        if bool((limit < 1).any()):
            raise ValueError(f"max_new_tokens must be >= 1 per row, got {self.max_new_tokens!r}")
        return limit.clamp_max(num_tokens)

    def stop_ids(self, device) -> Optional[torch.Tensor]:
        ids = [int(t) for t in self.stop_tokens]
        return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def stop_mask(new: torch.Tensor, stop_ids: Optional[torch.Tensor], stopping: Optional[Stopping]) -> torch.Tensor:
    """Which of the tokens `new` [B, n] (frames [B, n, K]: their stop codebook, or all of a
    tuple of them) are stop tokens (`stop_ids`, from `stopping.stop_ids`; None: none are)."""
    if stop_ids is None:
        return torch.zeros(new.shape[:2], dtype=torch.bool, device=new.device)
    if new.ndim == 3:
        codebooks = stopping.stop_codebook
        if isinstance(codebooks, tuple):
            return (new[..., list(codebooks), None] == stop_ids).any(-1).all(-1)
        new = new[..., codebooks]
    return (new[..., None] == stop_ids).any(-1)


class RowEnds:
    """Where each row of the speculative loop ends: its budget `limit` [B] (at most
    `num_tokens`) and its first stop token, from a `Stopping`; `emitted` [B] counts each row's
    finalised tokens (token 0, the prefill's, included). Without a `Stopping` every row decodes
    `num_tokens` tokens and nothing is cut. `limit` and `emitted` change in place: continuous
    batching (`feed.FeedRows`) starts a row over on each new request."""

    def __init__(self, stopping: Optional[Stopping], batch: int, num_tokens: int, device):
        self.stopping, self.num_tokens = stopping, num_tokens
        self.limit = (stopping or Stopping()).limits(batch, num_tokens, device)
        self.stop_ids = stopping.stop_ids(device) if stopping is not None else None
        self.emitted = torch.ones(batch, dtype=torch.long, device=device)

    def done_at_first(self, first: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        """Which rows end with their token 0 `first` [n, 1(, K)]: a stop token, or a `limit` [n] of 1."""
        return stop_mask(first, self.stop_ids, self.stopping)[:, 0] | (limit <= 1)

    def cut(self, step: torch.Tensor, written: torch.Tensor, slots: torch.Tensor,
            active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of the `step` [B] tokens each row finalised, those it keeps: up to its budget, and up
        to its first stop token among them. `written` [B, n + 1(, K)] holds the row's newest
        token, then the new ones; `slots` = 0, 1, ... (at least n + 1). Also which of the rows
        `active` [B] did not stop."""
        if self.stopping is None:
            return step, active
        n = written.shape[1] - 1
        step = torch.minimum(step, self.limit - self.emitted)
        stops = stop_mask(written[:, 1:], self.stop_ids, self.stopping) & (slots[1 : n + 1] <= step[:, None])
        hit = stops.any(1)
        return torch.where(hit, stops.long().argmax(1) + 1, step), active & ~hit

    def known_length(self, row: Optional[int] = None) -> Optional[int]:
        """The tokens row `row` (None: the slowest row) will finalise when no stop token can end
        it sooner, else None."""
        if self.stop_ids is not None:
            return None
        return int(self.limit.max() if row is None else self.limit[row])

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` [B'] (continuous batching whose width follows its requests)."""
        self.limit, self.emitted = self.limit[index], self.emitted[index]

    def advance(self, step: torch.Tensor) -> torch.Tensor:
        """Count `step` [B] more tokens per row; which rows are still within budget."""
        self.emitted += step  # in place: `FeedRows` holds this tensor
        return self.emitted < self.limit

    def tokens(self) -> int:
        """The stats' tokens per row: the longest row's (with a `Stopping`, the forwards
        autoregressive decoding of the batch takes), else `num_tokens`."""
        return int(self.emitted.max()) if self.stopping is not None else self.num_tokens

    def output(self, tokens: torch.Tensor, stats: Any) -> DecodeOutput:
        """Each row's first `num_tokens` of `tokens` [B, T(, K)]; with a `Stopping`, padded after
        the row's end (nothing after it is output) and with each row's length."""
        out = tokens[:, : self.num_tokens]
        if self.stopping is None:
            return DecodeOutput(out, stats)
        past = torch.arange(self.num_tokens, device=tokens.device)[None] >= self.emitted[:, None]
        K = tokens.shape[2] if tokens.ndim == 3 else 1
        return DecodeOutput(out.masked_fill(frame_index(past, K), self.stopping.pad_token), stats, self.emitted)


class Streamer(Protocol):
    """Receives each row's newly finalised tokens after every forward (transformers'
    `BaseStreamer` idea, per row): `put(rows)` with one tensor per row ([n] or [n, K], n may
    be 0), then `end()` once."""

    def put(self, rows: list[torch.Tensor]) -> Any: ...

    def end(self) -> Any: ...


class TokenQueueStreamer:
    """A streamer that is also an iterator: run `generate` in a thread and iterate over
    `(row, tokens)` pairs here as they are committed (transformers' `TextIteratorStreamer`)."""

    def __init__(self, timeout: Optional[float] = None):
        import queue

        self._queue: "queue.Queue" = queue.Queue()
        self.timeout = timeout

    def put(self, rows):
        for row, tokens in enumerate(rows):
            if len(tokens):
                self._queue.put((row, ordinary(tokens)))

    def end(self):
        self._queue.put(None)

    def __iter__(self):
        while (item := self._queue.get(timeout=self.timeout)) is not None:
            yield item


class TokenReporter:
    """After each forward of a token loop: progress (tokens of the slowest row still decoding)
    and each row's new tokens to the streamer. Returns that progress, which the loop compares
    with `num_tokens` to stop."""

    def __init__(self, num_tokens: int, limit: torch.Tensor, progress: Optional[Progress], streamer: Optional[Streamer]):
        self.num_tokens, self.limit, self.progress, self.streamer = num_tokens, limit, progress, streamer
        self.done = 0
        self.streamed = [0] * len(limit)

    def __call__(self, tokens: torch.Tensor, emitted: torch.Tensor, active: torch.Tensor, synced: bool) -> int:
        """`tokens` [B, T(, K)] of which each row's first `emitted` [B] are final; `active` [B]
        the rows still decoding; `synced` False where every row is known to advance one token
        per forward (no host read)."""
        if not synced:  # one token per row per forward, every row active to the end
            now = self.done + 1
        else:
            now = int(torch.where(active, emitted, self.num_tokens).min())  # the one host sync
        if self.streamer is not None:
            ends = torch.minimum(emitted, self.limit).tolist()
            self.streamer.put([tokens[b, s:e] for b, (s, e) in enumerate(zip(self.streamed, ends))])
            self.streamed = ends
        if self.progress is not None and now > self.done:
            self.progress.update(min(now, self.num_tokens) - self.done)
        self.done = min(now, self.num_tokens)
        return now
