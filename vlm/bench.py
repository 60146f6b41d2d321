"""`mmgen bench text`: a vision-language model's decoding methods against autoregressive
decoding, and against transformers' own `generate` on the same weights, in one process.

    mmgen bench text --models emoji-vlm --methods ar sjd lookup draft --kind sentence --json out/text.json

Each input is a held-out question about an emoji (`mmgen.vlm.heldout`; `--kind sentence`: the
questions with sentence answers), answered at batch 1, greedily unless `--temperature` is given
(then one seed per question, the same for every method). Units are new tokens: tokens per
target forward (the prefill's first token included), milliseconds per token over the whole call
(preprocessing included on every side), the speedup against the first method (paired per
question), the drafter's forwards per token, and how many answers equal the first method's
(all of them, for a lossless method decoding greedily).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from mmgen.benchmarking import Run, add_method_arguments, compare_methods, run_methods

GENERATE = "transformers generate"


def register(groups: dict) -> None:
    bench = groups["bench"].add_parser("text", help="vision-language models: decoding methods against autoregressive "
                                       "decoding and transformers' generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_method_arguments(bench, "emoji-vlm", ["ar", "sjd", "lookup", "draft"], inputs=8)
    bench.add_argument("--kind", default=None, help="held-out questions of this kind only (e.g. sentence, colour)")
    bench.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per answer at most")
    bench.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    bench.add_argument("--no-transformers", action="store_true", help="leave out transformers' generate")
    bench.set_defaults(run=run_bench)


def rows(pipe: Any, args: argparse.Namespace, progress: Optional[tqdm] = None) -> list[dict]:
    from PIL import Image

    from mmgen.vlm.heldout import load_eval

    records, images = load_eval()
    records = [r for r in records if args.kind in (None, r["kind"])][: args.inputs]
    if not records:
        raise ValueError(f"--kind {args.kind}: no held-out question of that kind")
    inputs = [(r["question"], Image.fromarray(images[r["index"]])) for r in records]

    def ours(spec: str):
        def run(item: tuple, seed: int) -> Run:
            begun = time.perf_counter()
            out = pipe(item[0], item[1], decoding=spec, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       generator=torch.Generator().manual_seed(seed))
            seconds = time.perf_counter() - begun
            stats = out.stats
            return Run(out.texts[0], int(out.lengths[0]), seconds, stats.forwards, stats.draft_forwards)
        return run

    def generate(item: tuple, seed: int) -> Run:
        begun = time.perf_counter()
        prepared = pipe.prepare_inputs(item[0], [item[1]])
        sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature else {"do_sample": False}
        torch.manual_seed(seed)  # transformers draws from the global generator
        out = pipe.model.generate(**prepared, max_new_tokens=args.max_new_tokens, pad_token_id=pipe.pad_token_id, **sampling)
        seconds = time.perf_counter() - begun
        new = out[0, prepared["input_ids"].shape[1]:].tolist()
        ends = [i for i, token in enumerate(new) if token in pipe.eos_token_ids]
        new = new[: ends[0] + 1] if ends else new
        text = pipe.processor.tokenizer.decode(new, skip_special_tokens=True).strip()
        return Run(text, len(new), seconds, len(new))

    methods = {spec: ours(spec) for spec in args.methods}
    if not args.no_transformers:
        methods[GENERATE] = generate
    return compare_methods(inputs, methods, args.repeats, args.warmup, progress)


def run_bench(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or not args.temperature >= 0:
        raise ValueError("--max-new-tokens must be at least 1 and --temperature >= 0")
    print(run_methods(args, lambda pipe, name, progress: rows(pipe, args, progress)))
    return 0
