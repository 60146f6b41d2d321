"""A preallocated KV cache whose rows each have their own length.

gpt-fast's static cache, extended for speculative decoding with batches: every row writes
at its own positions, the attention mask comes from those positions, and rolling back a
rejected draft is just not advancing the row's length (later writes overwrite the stale
entries, which the mask already hides). Shapes never change after allocation, so a verify
step of fixed width can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

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
