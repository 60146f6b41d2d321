"""The core's two KV caches.

`StaticKVCache`: slot = position, preallocated (mmgen's own models). `SlotKVCache`: slots and
positions differ, over a growable store (adapters of transformers models).

`StaticKVCache` is gpt-fast's static cache, extended for speculative decoding with batches: every row writes
at its own positions, the attention mask comes from those positions, and rolling back a
rejected draft is just not advancing the row's length (later writes overwrite the stale
entries, which the mask already hides). Shapes never change after allocation, so a verify
step of fixed width can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn


class StaticKVCache(nn.Module):
    """K/V buffers [layers, B, H, max_length, D] plus committed lengths [B] (int64).

    A forward of n tokens per row writes at `positions(n)` = lengths + arange(n); query at
    position p sees every key j <= p of its own row (and, with `key_padding`, only keys that
    are not padding, besides its own). `advance(n)` commits n more tokens per row;
    `rollback(lengths)` and `reset()` move lengths back in O(1).
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ):
        super().__init__()
        shape = (num_layers, batch_size, num_heads, max_length, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lengths", torch.zeros(batch_size, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("key_padding", torch.zeros(batch_size, max_length, dtype=torch.bool, device=device), persistent=False)
        self.register_buffer("_arange", torch.arange(max_length, device=device), persistent=False)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_length(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def positions(self, n: int) -> torch.Tensor:
        """Absolute positions [B, n] of the next n tokens of each row."""
        return self.lengths[:, None] + self._arange[:n]

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, H, n, D] at `positions` [B, n]; return the layer's full K, V."""
        index = positions[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        self.k[layer].scatter_(2, index, k.to(self.k.dtype))
        self.v[layer].scatter_(2, index, v.to(self.v.dtype))
        return self.k[layer], self.v[layer]

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """Bool mask [B, 1, n, max_length]: True where the query at `positions` may attend.

        A query always sees its own key, even at a padding position: a padding query with no
        visible key would give NaN, which reaches every row through the next layer's values
        (0 * NaN). LlamaGen's t2i `generate` keeps the same diagonal.
        """
        keys = self._arange[None, None, :]
        visible = (keys <= positions[:, :, None]) & ~self.key_padding[:, None, :]
        return (visible | (keys == positions[:, :, None]))[:, None]

    def advance(self, n: torch.Tensor | int) -> None:
        """Commit n tokens per row (int or [B] tensor) written by the last forward."""
        self.lengths += n

    def rollback(self, lengths: torch.Tensor) -> None:
        """Set each row's committed length; entries past it are dead."""
        self.lengths.copy_(lengths)

    def reset(self) -> None:
        self.lengths.zero_()
        self.key_padding.zero_()


class SlotKVCache:
    """A slot-mapped cache over a growable key/value store, for adapters of transformers models.

    Slots and positions differ: the store (a transformers `DynamicCache`, or anything with
    `layers[i].keys/values` [R, H, S, D] and `crop`) has one slot axis shared by all R rows,
    `mask` [R, S] says which slots each row attends to, and `positions` [R] is each row's next
    position id (tokens carry explicit position ids, so a row with masked slots computes what
    a contiguous cache would).

    - `open(n)`: the mask and position ids of a forward appending n slots per row;
    - `commit(accepted)`: keep the first accepted[b] of them for row b, mask the rest, crop the
      slots no row kept (at batch 1 rollback is exactly a crop; at batch > 1 only the shorter
      rows carry masked holes);
    - `rewind(n)`: keep each row's first n[b] generated tokens;
    - `evict(drop)`: hide chosen slots from a row for good (token dropping: FastV-style
      pruning of prompt tokens, sliding windows);
    - `keep_recent(window, sink)`: the window policy of streaming video / StreamingLLM: each
      row attends to its `sink` first slots and its `window` most recent kept slots.

    When holes outnumber `compact_ratio` x the longest row's generated slots, the kept slots are
    gathered to the right (`compact`), so the store holds at most (1 + ratio) x what the longest
    row needs, at O(1) amortised copies per slot.
    """

    def __init__(self, kv: Any, mask: torch.Tensor, prompt_length: int, compact_ratio: Optional[float] = 1.0):
        self.kv, self.mask, self.prompt_length, self.compact_ratio = kv, mask.bool(), prompt_length, compact_ratio
        self.positions = torch.full((mask.shape[0],), prompt_length, dtype=torch.long, device=mask.device)
        self.pending = 0

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.kv.layers for t in (layer.keys, layer.values) if t is not None)

    def open(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [R, S + n], position ids [R, n]) for a forward of n new slots per row; an
        uncommitted earlier forward is dropped first (it committed nothing)."""
        self.crop(self.length - self.pending)
        rows = self.mask.shape[0]
        positions = self.positions[:, None] + torch.arange(n, device=self.mask.device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(rows, n)], dim=1)
        self.pending = n
        return self.mask, positions

    def commit(self, accepted: torch.Tensor) -> None:
        """Keep the first `accepted[r]` slots of the last forward for row r ([R] int64)."""
        start = self.length - self.pending
        self.mask[:, start:] &= torch.arange(self.pending, device=accepted.device) < accepted[:, None]
        self.positions = self.positions + accepted
        # One host sync: the longest accepted run (no row reads past it, so crop there) and the
        # longest row (for compaction).
        longest, width = torch.stack([accepted.max(), self.positions.max() - self.prompt_length]).tolist()
        self.crop(start + (longest if self.pending else 0))
        self.pending = 0
        self.maybe_compact(width)

    def rewind(self, num_generated: torch.Tensor) -> None:
        """Row r keeps its first `num_generated[r]` generated tokens ([R] int64)."""
        self.crop(self.length - self.pending)
        self.pending = 0
        p = self.prompt_length
        generated = self.mask[:, p:]
        kept = generated & (generated.long().cumsum(-1) <= num_generated[:, None])
        self.mask = torch.cat([self.mask[:, :p], kept], dim=1)
        self.positions = p + num_generated
        used = kept.any(0).nonzero()
        self.crop(p + (int(used.max()) + 1 if used.numel() else 0))
        self.maybe_compact(int(num_generated.max()))

    def evict(self, drop: torch.Tensor) -> None:
        """Hide the slots where `drop` [R, S] is True from their rows, for every later query.
        Positions are unchanged: evicted tokens keep their place in each row's sequence."""
        self.mask = self.mask & ~drop

    def keep_recent(self, window: int, sink: int = 0) -> None:
        """Each row keeps its first `sink` slots and its `window` most recent kept slots."""
        order = self.mask.long().cumsum(1)  # 1-based rank of each kept slot
        count = order[:, -1:]
        self.evict(self.mask & (order > sink) & (order <= count - window))

    def crop(self, length: int) -> None:
        """Drop slots from `length` on (`Cache.crop` takes the count to remove, negated)."""
        remove = self.length - length
        if remove > 0:
            self.kv.crop(-remove)
            self.mask = self.mask[:, :length]

    def maybe_compact(self, width: int) -> None:
        """Compact once holes outnumber `compact_ratio` x `width` (the longest row's generated
        slots). Never at batch 1 without evictions, which has no holes."""
        holes = self.length - self.prompt_length - width
        if self.compact_ratio is not None and holes > 0 and holes > self.compact_ratio * width:
            self.compact(width)

    def compact(self, width: int) -> None:
        """Squeeze the holes out: each row's kept generated slots move, in order, to the right end
        of a `width`-slot region (width >= every row's count); the prompt region stays as is.

        Keys already carry their rotary positions and attention does not depend on the order of
        the keys it attends to, so this changes rounding only.
        """
        p = self.prompt_length
        kept = self.mask[:, p:]
        rows, g = kept.shape
        counts = kept.sum(1, keepdim=True)
        # Destination of each kept slot; dropped slots all go to the spare column `width`.
        target = torch.where(kept, width - counts + kept.long().cumsum(1) - 1, width)
        source = torch.zeros(rows, width + 1, dtype=torch.long, device=kept.device)
        source = source.scatter(1, target, torch.arange(g, device=kept.device).expand(rows, g))[:, :width]
        for layer in self.kv.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                index = source[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1])
                setattr(layer, name, torch.cat([t[:, :, :p], t[:, :, p:].gather(2, index)], dim=2))
        slots = torch.arange(width, device=kept.device)
        self.mask = torch.cat([self.mask[:, :p], slots >= width - counts], dim=1)
