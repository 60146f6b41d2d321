"""The core's KV caches.

`StaticKVCache`: slot = position, preallocated (mmgen's own models). `SlotKVCache`: slots and
positions differ, over a growable store (adapters of transformers models). `FrameKVCache`: whole
frames of a block-causal model under a `CachePolicy` (global, sliding window, sink + window).

`StaticKVCache` is gpt-fast's static cache, extended for speculative decoding with batches: every row writes
at its own positions, the attention mask comes from those positions, and rolling back a
rejected draft is just not advancing the row's length (later writes overwrite the stale
entries, which the mask already hides). Shapes never change after allocation, so a verify
step of fixed width can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn


def tree_attention_mask(visible: torch.Tensor, committed: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Bool mask [R, 1, n, S] for a tree forward whose n slots start at slot `start` [R] of a
    cache of S slots: slot s is seen by query i when `committed` [R, S] says it holds one of
    the row's committed tokens, or when it is window slot j = s - start[r] and `visible[i, j]`."""
    n, S = visible.shape[0], committed.shape[1]
    rel = torch.arange(S, device=committed.device)[None, :] - start[:, None]  # [R, S]
    inside = (rel >= 0) & (rel < n)
    window = visible[:, rel.clamp(0, n - 1)].permute(1, 0, 2) & inside[:, None, :]  # [R, n, S]
    return (window | (committed & ~inside)[:, None, :])[:, None]


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
        if torch.compiler.is_compiling():
            # The same writes as one index_put_ into the whole buffer, which inductor does in
            # place: a scatter_ into the layer's view makes it copy the whole cache every step.
            rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
            at = (torch.full_like(positions, layer), rows, slice(None), positions)
            self.k[at] = k.transpose(1, 2).to(self.k.dtype)
            self.v[at] = v.transpose(1, 2).to(self.v.dtype)
            return self.k[layer], self.v[layer]
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

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy each row's keys and values at slots `source` [B, m] to slots `target` [B, m]
        (every layer; all reads happen before the writes): a verified tree's chosen branch
        moved to the slots its tokens now hold."""
        L, B, H, _, D = self.k.shape
        at = lambda slots: slots[None, :, None, :, None].expand(L, B, H, slots.shape[1], D)
        for buffer in (self.k, self.v):
            buffer.scatter_(3, at(target), buffer.gather(3, at(source)))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` [B'] (indices into the current rows, in that order; one may repeat,
        for a row that restarts): continuous batching whose width follows its requests."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.lengths, self.key_padding = self.lengths[rows], self.key_padding[rows]

    def advance(self, n: torch.Tensor | int) -> None:
        """Commit n tokens per row (int or [B] tensor) written by the last forward."""
        self.lengths += n

    def rollback(self, lengths: torch.Tensor) -> None:
        """Set each row's committed length; entries past it are dead."""
        self.lengths.copy_(lengths)

    def reset(self) -> None:
        self.lengths.zero_()
        self.key_padding.zero_()

    def clear(self) -> None:
        """Back to its freshly allocated state, in place (K/V zeroed too, so a reused cache
        computes bit for bit what a new one does; the buffers keep their addresses)."""
        self.reset()
        self.k.zero_()
        self.v.zero_()


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
    - `keep(policy)`: a `CachePolicy` (the window policy of streaming video / StreamingLLM): each
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

    def open_tree(self, depth: torch.Tensor, visible: torch.Tensor, implementation: str,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`open` for a token tree of n = len(depth) slots (`mmgen.modeling.TreeModel`): its 4-D
        attention mask [R, 1, n, S + n] for transformers (boolean for sdpa, additive for eager)
        and each slot's position id [R, n] (the row's next position + its depth)."""
        if implementation not in ("sdpa", "eager"):
            raise ValueError(f"token trees are verified under sdpa or eager attention, not {implementation!r} "
                             "(load the model with attn_implementation='sdpa')")
        n = depth.shape[0]
        mask, positions = self.open(n)
        seen = tree_attention_mask(visible, mask, torch.full((mask.shape[0],), mask.shape[1] - n, device=mask.device))
        if implementation == "eager":
            seen = torch.zeros(seen.shape, dtype=dtype, device=mask.device).masked_fill(~seen, torch.finfo(dtype).min)
        return seen, positions[:, :1] + depth[None]

    def keep_path(self, path: torch.Tensor) -> None:
        """Move the pending forward's slots `path` [R, m] (each row's own, in order) to its first
        m slots in every layer, so that `commit` keeps a verified tree's chosen branch."""
        start = self.length - self.pending
        for layer in self.kv.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                R, H, _, D = t.shape
                moved = t.gather(2, (start + path)[:, None, :, None].expand(R, H, path.shape[1], D))
                t[:, :, start:start + path.shape[1]] = moved

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

    def restart_row(self, row: int, fresh: "SlotKVCache", fresh_row: int = 0) -> int:
        """Continuous batching: row `row` starts over on row `fresh_row` of `fresh`, a cache
        holding only a prompt (a prefill run alone; two rows under guidance). Its slots go to
        the right end of the prompt region, the rest of the row is masked; when the prompt is
        longer than the region, the region first grows on the left by masked slots for every row. Returns that growth: every row's
        `positions` moved by it (their slots did), which an adapter adding its own offsets to
        them subtracts again. Attention sees the row exactly the prompt `fresh` holds."""
        self.crop(self.length - self.pending)
        self.pending = 0
        grow = max(0, fresh.prompt_length - self.prompt_length)
        for mine, theirs in zip(self.kv.layers, fresh.kv.layers):
            for name in ("keys", "values"):
                t, new = getattr(mine, name), getattr(theirs, name)
                if grow:
                    t = torch.cat([t.new_zeros(*t.shape[:2], grow, t.shape[-1]), t], dim=2)
                    setattr(mine, name, t)
                t[row] = 0
                t[row, :, self.prompt_length + grow - new.shape[2] : self.prompt_length + grow] = new[fresh_row]
        if grow:
            self.mask = torch.cat([self.mask.new_zeros(self.mask.shape[0], grow), self.mask], dim=1)
            self.prompt_length += grow
            self.positions = self.positions + grow
        self.mask[row] = False
        self.mask[row, self.prompt_length - fresh.length : self.prompt_length] = fresh.mask[fresh_row]
        self.positions[row] = self.prompt_length
        return grow

    def select_rows(self, rows: torch.Tensor) -> None:
        """Continuous batching whose width follows its requests: keep the cache rows `rows` [R']
        (indices into the current rows, in that order; an index may repeat, for a row that will
        be restarted). Between forwards only (nothing pending)."""
        self.crop(self.length - self.pending)
        self.pending = 0
        for layer in self.kv.layers:
            for name in ("keys", "values"):
                setattr(layer, name, getattr(layer, name)[rows])
        self.mask, self.positions = self.mask[rows], self.positions[rows]

    def fill_layers(self, layers: Sequence[int]) -> None:
        """Append zero slots to the store's `layers` up to the cache's length: a forward that
        skipped those blocks (layer-skip drafting, `mmgen.decoding.layer_skip`) wrote no K/V
        there, and crops (`Cache.crop` cuts each layer's own tail) and compaction need every
        layer the same length. No query reads the zeros: the drafting rewinds past them before
        a full forward rewrites those slots."""
        for i in layers:
            layer = self.kv.layers[i]
            for name in ("keys", "values"):
                t = getattr(layer, name)
                if t.shape[2] < self.length:
                    setattr(layer, name, torch.cat([t, t.new_zeros(*t.shape[:2], self.length - t.shape[2], t.shape[3])], dim=2))

    def evict(self, drop: torch.Tensor) -> None:
        """Hide the slots where `drop` [R, S] is True from their rows, for every later query.
        Positions are unchanged: evicted tokens keep their place in each row's sequence."""
        self.mask = self.mask & ~drop

    def keep(self, policy: "CachePolicy") -> None:
        """Each row keeps what `policy` holds of its kept slots: all (global), or its first `sink`
        and its `window` most recent ones."""
        if policy.window is None:
            return
        order = self.mask.long().cumsum(1)  # 1-based rank of each kept slot
        count = order[:, -1:]
        self.evict(self.mask & (order > policy.sink) & (order <= count - policy.window))

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


def transformers_cache(store: Any) -> dict[str, Any]:
    """The keyword that hands a transformers model its cache: `cache` from transformers 5.24 on
    (which deprecates `past_key_values` and drops it in 5.40), `past_key_values` before."""
    return {_cache_keyword(): store}


@functools.lru_cache(maxsize=None)
def _cache_keyword() -> str:
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


@dataclass(frozen=True)
class CachePolicy:
    """Which committed frames (or blocks, or tokens: any unit) later queries attend to.

    `window=None` keeps everything (global). Otherwise the cache keeps its first `sink` units
    and its `window` most recent ones, StreamingLLM's attention sink (Xiao et al., 2023) and
    the rolling cache of streaming video (Self-Forcing); `sink=0` is a plain sliding window.
    """

    window: Optional[int] = None
    sink: int = 0

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"cache window must be an integer >= 1 or None (global), got {self.window!r}")
        if isinstance(self.sink, bool) or not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"cache sink must be an integer >= 0, got {self.sink!r}")
        if self.sink and self.window is None:
            raise ValueError("a cache sink needs a window: the global policy keeps every frame already")

    @classmethod
    def parse(cls, spec: str) -> "CachePolicy":
        """`"global"`, `"window:N"` or `"sink:S,window:N"` (the CLI's --cache-policy)."""
        if spec == "global":
            return cls()
        try:
            fields = dict(part.split(":", 1) for part in spec.split(","))
            window, sink = int(fields.pop("window")), int(fields.pop("sink", 0))
        except (ValueError, KeyError):
            raise ValueError(f"cache policy {spec!r}: expected 'global', 'window:N' or 'sink:S,window:N'") from None
        if fields:
            raise ValueError(f"cache policy {spec!r}: unknown field(s) {sorted(fields)}")
        return cls(window=window, sink=sink)

    def __str__(self) -> str:
        if self.window is None:
            return "global"
        return f"sink:{self.sink},window:{self.window}" if self.sink else f"window:{self.window}"

    def held(self, committed: int) -> int:
        """Units the cache holds after `committed` units were committed."""
        return committed if self.window is None else min(committed, self.sink + self.window)


class FrameKVCache:
    """A static K/V cache of whole frames for block-causal models (block-diffusion video).

    K/V [layers, B, capacity, H, D] (tokens: frames × `tokens_per_frame`), keys stored before
    their rotary embedding. A forward of a block writes its K/V after the committed frames
    (`update`), so the block attends to the cache and to itself; `commit(n)` keeps the
    block's last n frames and applies the `CachePolicy`, moving the kept recent frames left
    over the evicted ones. Keys are rotated at attention time by their slot's frame index: under
    the global policy that is the absolute frame, under a window it is the frame's place in the
    cache (StreamingLLM's positions), so rotary positions stay below sink + window + block and
    rollouts run past the model's rotary table. Memory is fixed at allocation.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int, tokens_per_frame: int,
                 max_frames: int, block_frames: int, policy: CachePolicy = CachePolicy(),
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        self.policy, self.tokens_per_frame, self.block_frames = policy, tokens_per_frame, block_frames
        self.capacity_frames = policy.held(max_frames) + block_frames
        shape = (num_layers, batch_size, self.capacity_frames * tokens_per_frame, num_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.frames = 0  # frames held (all of them committed)
        self.committed = 0  # frames committed since the start (the next block's absolute frame)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a block's k, v [B, n, H, D] after the held frames; return the layer's keys and
        values [B, held + block, H, D] (views), the block's last. With `index` [n], the rows are
        the block's tokens at those offsets; its other slots keep what the last forward wrote."""
        start = self.frames * self.tokens_per_frame
        end = start + (self.block_frames * self.tokens_per_frame if index is not None else k.shape[1])
        if end > self.k.shape[2]:
            raise ValueError(f"a block of {end - start} tokens does not fit the cache after {self.frames} frames")
        slots = slice(start, end) if index is None else start + index
        self.k[layer, :, slots] = k
        self.v[layer, :, slots] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, num_frames: int) -> None:
        """Keep the `num_frames` frames the last forward wrote, then evict by the policy."""
        self.frames += num_frames
        self.committed += num_frames
        held = self.policy.held(self.frames)
        if held < self.frames:
            t, sink = self.tokens_per_frame, self.policy.sink
            recent = slice((self.frames - (held - sink)) * t, self.frames * t)
            for buffer in (self.k, self.v):
                buffer[:, :, sink * t:held * t] = buffer[:, :, recent].clone()
            self.frames = held

    def reset(self) -> None:
        self.frames = self.committed = 0
