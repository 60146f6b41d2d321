"""CPU threads and OpenMP's wait policy against a busy box: the latency of one decode step.

PyTorch's CPU kernels run on OpenMP threads. Between parallel regions GNU OpenMP's threads spin
(`OMP_WAIT_POLICY` unset or ACTIVE) for a while before they sleep; when another process holds a
core, a spinning thread burns the time slice the thread it waits for needs, and a step of a
GPT-B-size model slows by an order of magnitude. This measures it: each configuration (threads x
wait policy) runs in a fresh process (OpenMP reads the policy when torch loads), with `--load`
busy processes beside it, in interleaved rounds; the figure is the median step over the rounds.

    python -m benchmarks.threads --preset GPT-B --threads 1 2 --load 0 1 --rounds 3

The step is a LlamaGen AR step with classifier-free guidance (batch 1, 2 rows, KV cache half
full), random weights, float32; `--window 16` times a 16-token verify forward instead.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

POLICIES = ("default", "PASSIVE")


def worker(preset: str, threads: int, window: int, steps: int) -> float:
    """Median seconds of one forward (after two warm-up forwards), in this process."""
    import torch

    from mmgen.image_ar.llamagen.gpt import LlamaGenConfig, LlamaGenTransformer
    from mmgen.image_ar.llamagen.token_model import LlamaGenTokenModel

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with torch.no_grad():
        model = LlamaGenTransformer(LlamaGenConfig.from_preset(preset)).eval()
        token_model = LlamaGenTokenModel(model)
        state = token_model.start(torch.tensor([0]), model.config.block_size + 2 * window, guidance=True)
        state.cache.advance(model.config.block_size // 2)
        tokens = torch.randint(0, model.config.vocab_size, (1, window))
        times = []
        for i in range(steps + 2):
            start = time.perf_counter()
            token_model.forward(state, tokens)
            if i >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def measure(preset: str, threads: int, policy: str, window: int, steps: int, load: int) -> float:
    """One configuration in a fresh process, with `load` busy processes running beside it."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(load)]
    for hog in hogs:
        hog.start()
    try:
        out = subprocess.run([sys.executable, "-m", "benchmarks.threads", "--worker", "--preset", preset,
                              "--threads", str(threads), "--window", str(window), "--steps", str(steps)],
                             env=env, check=True, capture_output=True, text=True).stdout
    finally:
        stop.set()
        for hog in hogs:
            hog.join()
    return float(out.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="GPT-B")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--load", type=int, nargs="+", default=[0, 1], help="busy processes beside the step")
    parser.add_argument("--window", type=int, default=1, help="tokens per forward (1: an AR step)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(worker(args.preset, args.threads[0], args.window, args.steps))
        return {}
    configs = [(load, threads, policy) for load in args.load for threads in args.threads for policy in args.policies]
    seconds: dict = {c: [] for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            load, threads, policy = config
            seconds[config].append(measure(args.preset, threads, policy, args.window, args.steps, load))
    rows = [{"load": load, "threads": threads, "wait_policy": policy, "ms_median": 1e3 * statistics.median(t),
             "ms_min": 1e3 * min(t), "ms_max": 1e3 * max(t)} for (load, threads, policy), t in seconds.items()]
    result = {"preset": args.preset, "window": args.window, "cpus": os.cpu_count(), "rows": rows}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
