"""`mmgen bench video`: a block-diffusion video model's decoding methods and cache policies
against plain block decoding with the global cache, in one process.

    mmgen bench video --models emoji-motion --methods block collaborative --cache-policies global sink:1,window:2

Each input is a caption of the bundled clips' kind ("<sprite> moving <direction>", the data's
sprites),
made at batch 1 with one seed per caption, the same for every method; every method x cache
policy is one row (the first is the baseline). Units are video frames: frames per model forward
(denoising and commit forwards of every model, CFG batches counted once), milliseconds per
frame (VAE decoding of each block included on every side), the speedup against the baseline
(paired per caption), and how many videos equal the baseline's latents (all of them for the
baseline's own settings; a cache policy or collaborative decoding changes them by design:
judge those with the quality proxies of the model card).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from mmgen.benchmarking import Run, add_method_arguments, compare_methods, run_methods


def captions(count: int) -> list[str]:
    """Captions of the kind the bundled pair was trained on: its sprites, each with a direction."""
    from mmgen.video.data import DEFAULT_SPRITES

    directions = ("left", "right", "up", "down")
    return [f"{DEFAULT_SPRITES[i % len(DEFAULT_SPRITES)]} moving {directions[i % 4]}" for i in range(count)]


def register(groups: dict) -> None:
    bench = groups["bench"].add_parser("video", help="video models: decoding methods and cache policies against block "
                                       "decoding", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_method_arguments(bench, "emoji-motion", ["block", "collaborative"], inputs=4)
    bench.add_argument("--cache-policies", nargs="+", default=["global"],
                       help="KV cache policies crossed with --methods: global, window:N, sink:S,window:N, none")
    bench.add_argument("--num-frames", type=int, default=None, help="video frames (default: the model's)")
    bench.set_defaults(run=run_bench)


def rows(pipe: Any, args: argparse.Namespace, progress: Optional[tqdm] = None) -> list[dict]:
    def ours(spec: str, policy: str):
        def run(caption: str, seed: int) -> Run:
            begun = time.perf_counter()
            out = pipe(caption, decoding=spec, cache_policy=policy, num_frames=args.num_frames,
                       generator=torch.Generator().manual_seed(seed))
            seconds = time.perf_counter() - begun
            stats = out.stats
            forwards = sum(stats.denoise_forwards.values()) + sum(stats.commit_forwards.values())
            return Run(out.latents, int(out.frames.shape[1]), seconds, forwards)
        return run

    methods = {f"{spec} cache={policy}": ours(spec, policy) for spec in args.methods for policy in args.cache_policies}
    return compare_methods(captions(args.inputs), methods, args.repeats, args.warmup, progress)


def run_bench(args: argparse.Namespace) -> int:
    if args.num_frames is not None and args.num_frames < 1:
        raise ValueError(f"--num-frames must be at least 1, got {args.num_frames}")
    print(run_methods(args, lambda pipe, name, progress: rows(pipe, args, progress)))
    return 0
