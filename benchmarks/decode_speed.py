"""AR vs speculative Jacobi decoding, side by side in one process (medians over repeats).

Two questions, two modes:

  # What does one verify forward of W tokens cost against an AR step? (random weights are
  # fine: speed does not depend on what the weights are)
  python -m benchmarks.decode_speed forward-cost --preset GPT-B --windows 1 4 8 16

  # End to end on a real pipeline folder: forwards, step compression, wall-clock speedup.
  python -m benchmarks.decode_speed decode --model DIR --class-labels 1 2 3 4 --windows 8 16

Wall-clock speedup of SJD <= step compression / (cost of a W-token forward / cost of an AR
step): the first mode measures the denominator, the second the whole product.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from mmgen.decoding import Autoregressive, SpeculativeJacobi
from mmgen.sampling import SamplingConfig


def median_time(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"torch": torch.__version__, "device": str(device), "device_name": name, "threads": torch.get_num_threads()}


@torch.no_grad()
def forward_cost(args) -> list[dict]:
    from mmgen.image_ar.llamagen import LlamaGenConfig, LlamaGenTokenModel, LlamaGenTransformer

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = LlamaGenTransformer(LlamaGenConfig.from_preset(args.preset)).eval().to(device, dtype)
    token_model = LlamaGenTokenModel(model)
    labels = torch.arange(args.batch_size, device=device)
    rows = []
    for window in args.windows:
        state = token_model.start(labels, model.config.block_size + 2 * max(args.windows), guidance=args.guidance_scale != 1)
        # Sit in the middle of the image, where a real decode spends its time.
        state.cache.advance(model.config.block_size // 2)
        tokens = torch.randint(0, model.config.vocab_size, (args.batch_size, window), device=device)
        step = lambda: token_model.forward(state, tokens)
        for _ in range(args.warmup):
            step()
        rows.append({"window": window, "seconds": median_time(step, args.repeats, device)})
    base = rows[0]["seconds"] if rows[0]["window"] == 1 else None
    for row in rows:
        row["cost_vs_ar_step"] = row["seconds"] / base if base else None
    return rows


@torch.no_grad()
def decode(args) -> list[dict]:
    from mmgen.image_ar.llamagen import LlamaGenPipeline, LlamaGenTokenModel

    device = torch.device(args.device)
    pipe = LlamaGenPipeline.from_pretrained(args.model, device=device, dtype=getattr(torch, args.dtype))
    token_model = LlamaGenTokenModel(pipe.transformer)
    labels = torch.tensor(args.class_labels, device=device)
    sampling = SamplingConfig(top_k=args.top_k, guidance=args.guidance_scale)
    n = pipe.transformer.config.block_size
    decoders = [("ar", Autoregressive())] + [(f"sjd-{w}", SpeculativeJacobi(window=w)) for w in args.windows]
    rows = []
    for name, decoder in decoders:
        run = lambda seed=0: decoder.generate(token_model, labels, n, sampling, torch.Generator(device).manual_seed(seed))
        for _ in range(args.warmup):
            run()
        stats = [run(seed).stats for seed in range(args.repeats)]
        rows.append({
            "decoding": name,
            "forwards": statistics.median(s.forwards for s in stats),
            "step_compression": statistics.median(s.step_compression for s in stats),
            "mean_accepted_length": statistics.median(s.mean_accepted_length for s in stats),
            "seconds": statistics.median(s.wall_time_s for s in stats),
        })
    for row in rows:
        row["speedup_vs_ar"] = rows[0]["seconds"] / row["seconds"]
    return rows


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = parser.add_subparsers(dest="mode", required=True)
    cost = modes.add_parser("forward-cost")
    cost.add_argument("--preset", default="GPT-B")
    cost.add_argument("--batch-size", type=int, default=1)
    full = modes.add_parser("decode")
    full.add_argument("--model", required=True)
    full.add_argument("--class-labels", type=int, nargs="+", default=[0])
    full.add_argument("--top-k", type=int, default=2000)
    for p in (cost, full):
        p.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8, 16])
        p.add_argument("--guidance-scale", type=float, default=4.0)
        p.add_argument("--device", default="cpu")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--json", help="also write the rows and environment here")
    args = parser.parse_args()
    rows = forward_cost(args) if args.mode == "forward-cost" else decode(args)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(torch.device(args.device)), "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
