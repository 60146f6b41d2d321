"""A bundled speech model computed in its stored dtype (float16) against float32 on this CPU:
why `mmgen.pipeline.load_dtype` loads float32 on a CPU when no dtype is asked for.

Times `TTSPipeline.speak_each` (continuous batching, `ar`, the model's sampling, codec decoding
included) at several row counts, and the codec decoding one utterance alone; the two dtypes run
in turn within each repeat (interleaved), medians reported. Half precision on a CPU runs
matmuls and (dilated) convolutions on slow fallback kernels, so the stored dtype pays most where
the work is widest.

    python -m benchmarks.load_dtype --rows 1,8,16 --frames 64 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from mmgen.sampling import make_generator

TEXTS = ("Hello there, how are you today?", "the red cat is under the box", "seven shoes", "a tiny pink key")


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="speech-tts")
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16])
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from mmgen.loading import load_pipeline

    stored = stored_dtype(args.model)
    pipes = {"stored": load_pipeline(args.model, dtype=stored), "float32": load_pipeline(args.model, dtype=torch.float32)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    codes = torch.randint(0, 256, (pipes["float32"].codec.num_codebooks, args.frames), generator=make_generator(0))
    jobs = {f"speak_each, {n} rows": (lambda pipe, n=n: pipe.speak_each(
        [TEXTS[i % len(TEXTS)] for i in range(n)], generators=[make_generator(i) for i in range(n)], batch_size=n,
        max_new_frames=args.frames)) for n in args.rows}
    jobs[f"codec decode, {args.frames} frames"] = lambda pipe: pipe.codec.decode(codes)
    times: dict = {(job, name): [] for job in jobs for name in pipes}
    for job, run in jobs.items():
        for pipe in pipes.values():
            run(pipe)  # warm-up
        for _ in range(args.repeats):
            for name, pipe in pipes.items():
                start = time.perf_counter()
                run(pipe)
                times[job, name].append(time.perf_counter() - start)
    print(f"| work | stored ({stored}) s | float32 s | stored / float32 |")
    print("|---|---|---|---|")
    report = {}
    for job in jobs:
        half, fp32 = statistics.median(times[job, "stored"]), statistics.median(times[job, "float32"])
        report[job] = {"stored_s": half, "float32_s": fp32}
        print(f"| {job} | {half:.3f} | {fp32:.3f} | {half / fp32:.2f}x |")
    return report


def stored_dtype(model: str) -> torch.dtype:
    """The dtype the model's weights ship in (its first floating tensor's)."""
    from safetensors import safe_open

    from mmgen.loading import resolve_model

    with safe_open(f"{resolve_model(model)}/model.safetensors", "pt") as f:
        return next(t.dtype for t in map(f.get_tensor, f.keys()) if t.is_floating_point())


if __name__ == "__main__":
    main()
