"""Cached token pruning for next-scale models (FastVAR, Guo et al., ICCV 2025, arXiv 2503.23367).

At the largest scales most tokens have converged: their features sit close to the scale's
mean. A pruned step runs a block's attention and MLP branches only on the tokens whose
features deviate most from that mean, and fills the other slots with the same branch's
output cached at an earlier, unpruned scale, resized to the current grid. The policy here is
free of any architecture: a model asks it which steps and layers prune, which tokens to keep,
and how to restore the full grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class CachedTokenPruning:
    """Which tokens a next-scale model forwards at its largest scales.

    Args:
        keep: {step: keep ratio} for the pruned steps; a negative step counts from the last
            (FastVAR's Infinity setting drops 40% and 50% at the last two scales:
            `{-2: 0.6, -1: 0.5}`). Steps not named run in full.
        layers: the block range [start, stop) that prunes; `stop` may be negative (counted
            from the depth) or None (to the last block). FastVAR keeps the first 3 and last 4
            blocks of Infinity-2B in full.
    """

    keep: Mapping[int, float] = field(default_factory=dict)
    layers: tuple[int, Optional[int]] = (3, -4)

    def __post_init__(self):
        for step, ratio in self.keep.items():
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"pruned steps must be integers, got {step!r}")
            if not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
                raise ValueError(f"keep ratio for step {step} must be in (0, 1], got {ratio!r}")
        start, stop = self.layers
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"layers start must be an integer >= 0, got {start!r}")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int)):
            raise ValueError(f"layers stop must be an integer or None, got {stop!r}")

    @classmethod
    def from_spec(cls, spec: str) -> "CachedTokenPruning":
        """"STEP=KEEP,...[@START:STOP]" (e.g. "8=0.6,9=0.5@3:-4", "5=0.5@0:"): keep ratios per
        scale step and optionally the block range (default FastVAR's 3:-4)."""
        keep_part, at, layers = spec.partition("@")
        keep = {}
        for item in filter(None, (part.strip() for part in keep_part.split(","))):
            step, _, ratio = item.partition("=")
            try:
                keep[int(step)] = float(ratio)
            except ValueError:
                raise ValueError(f"bad item {item!r} in pruning spec {spec!r}: expected STEP=KEEP_RATIO, e.g. 5=0.5") from None
        if not keep:
            raise ValueError(f"pruning spec {spec!r} names no step: expected STEP=KEEP_RATIO,...")
        if not at:
            return cls(keep)
        start, _, stop = layers.partition(":")
        try:
            return cls(keep, (int(start or 0), int(stop) if stop else None))
        except ValueError:
            raise ValueError(f"bad block range {layers!r} in pruning spec {spec!r}: expected START:STOP, e.g. 3:-4") from None

    def keep_ratio(self, step: int, num_steps: int) -> float:
        """The keep ratio of `step` (1.0 when it runs in full)."""
        ratio = 1.0
        for named, value in self.keep.items():
            if (named if named >= 0 else num_steps + named) == step:
                ratio = float(value)
        return ratio

    def keep_count(self, step: int, num_steps: int, num_tokens: int) -> int:
        """Tokens a pruned layer forwards at `step` (at least one)."""
        return max(1, min(num_tokens, math.ceil(num_tokens * self.keep_ratio(step, num_steps) - 1e-9)))

    def pruned_steps(self, num_steps: int) -> list[int]:
        return sorted(s for s in range(num_steps) if self.keep_ratio(s, num_steps) < 1.0)

    def cache_step(self, num_steps: int) -> Optional[int]:
        """The step whose branch outputs fill pruned slots: the last one before the first pruned
        step (None when nothing is pruned, or when step 0 is)."""
        pruned = self.pruned_steps(num_steps)
        return pruned[0] - 1 if pruned and pruned[0] > 0 else None

    def prunes_layer(self, layer: int, depth: int) -> bool:
        start, stop = self.layers
        stop = depth if stop is None else (stop if stop >= 0 else depth + stop)
        return start <= layer < stop

    def check(self, num_steps: int) -> None:
        """ValueError for steps outside the schedule or a pruned first step."""
        for step in self.keep:
            if not -num_steps <= step < num_steps:
                raise ValueError(f"pruned step {step} is outside the {num_steps} steps of this model")
        if self.pruned_steps(num_steps) and self.cache_step(num_steps) is None:
            raise ValueError("step 0 cannot be pruned: there is no earlier scale to restore pruned tokens from")

    @staticmethod
    def select(x: torch.Tensor, count: int) -> torch.Tensor:
        """Indices [B, count] (ascending) of the tokens of x [B, n, C] farthest from the mean.

        The indices are sorted so that keeping every token is the identity permutation.
        """
        deviation = (x.float() - x.float().mean(1, keepdim=True)).square().sum(-1)
        return deviation.topk(count, dim=1).indices.sort(dim=1).values

    @staticmethod
    def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.gather(1, index[..., None].expand(-1, -1, x.shape[-1]))

    @staticmethod
    def restore(kept: torch.Tensor, index: torch.Tensor, cached: torch.Tensor, cached_hw: tuple[int, int], hw: tuple[int, int]) -> torch.Tensor:
        """The full grid [B, h*w, C]: `kept` [B, k, C] at `index`, elsewhere `cached`
        [B', h'*w', C] (B' = B or 1) area-resized from `cached_hw` to `hw` (FastVAR's restore)."""
        b, c = kept.shape[0], kept.shape[-1]
        grid = cached.transpose(1, 2).reshape(cached.shape[0], c, *cached_hw)
        full = F.interpolate(grid.float(), size=hw, mode="area").to(kept.dtype).flatten(2).transpose(1, 2)
        full = full.expand(b, -1, -1).contiguous()
        return full.scatter(1, index[..., None].expand(-1, -1, c), kept)
