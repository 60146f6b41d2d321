"""What the image harnesses share: which labels a run decodes, and timed whole decodes."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from tqdm.auto import tqdm

from mmgen.benchmarking import plan, tick
from mmgen.decoding import DecodeStats


def timed_decodes(run: Callable[[list[int], int], DecodeStats], batch: int, num_classes: int, repeats: int,
                  warmup: int, progress: Optional[tqdm] = None, what: str = "") -> list[DecodeStats]:
    """`warmup` untimed decodes, then the stats of `repeats` decodes: repeat r decodes classes
    r*B ... r*B + B - 1 with seed r, the same for every method. `run(labels, seed)` decodes once;
    `progress` gains each decode (`what` names the row)."""
    labels = lambda seed: ((seed * batch + torch.arange(batch)) % num_classes).tolist()
    plan(progress, warmup + repeats, what)
    for seed in range(10_000, 10_000 + warmup):
        run(labels(seed), seed)
        tick(progress)
    stats = []
    for seed in range(repeats):
        stats.append(run(labels(seed), seed))
        tick(progress)
    return stats


def quality_labels(num_classes: int, args) -> torch.Tensor:
    """The class labels of the quality samples: `--quality-per-class` of each of the first
    `--quality-classes` classes (0: all), class by class."""
    classes = num_classes if args.quality_classes <= 0 else min(args.quality_classes, num_classes)
    return torch.arange(classes).repeat_interleave(args.quality_per_class)


def quality_chunks(labels: torch.Tensor, batch_size: int) -> int:
    """Decodes of one method's quality samples."""
    return -(-len(labels) // batch_size)

