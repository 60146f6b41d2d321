"""The adaptive window against the window a user would pick with hindsight: whole decodes with
autoregressive steps, the adaptive `sjd` (the default) and fixed Jacobi windows swept over
2-16 tokens, on one model, in one process.

Cases (`--case`): LlamaGen GPT-B with random weights and LlamaGen's own init (a zero output
head: the law ignores the context, so drafts pass; the good case), the same with every weight
redrawn at std 0.05 (nothing is accepted: the worst case) or 0.02 (acceptance comes and goes
within a decode), and the bundled, trained `emoji64`; and the bundled pairs' targets through their pipelines,
`emoji-vlm` on its held-out sentence answers (greedy, its default) and `speech-tts` on held-out
utterances (its own sampling), each round a batch-1 call per input and times per generated
token (sampled utterances differ in length between methods); their `sjd` row runs with the cost
curve the model ships with, if any (`window_cost`). Every adaptive row of a model that carries
measured `window_tokens` starts from them (`sjd:prior_forwards=0` as a method: without). `--sampling greedy` decodes with top-k 1
under the model's own guidance, `model` with the model's own sampling (LlamaGen's official
top-k 2000, CFG 4 for the random presets).

Methods are decoded in turn within each repeat (interleaved; a dropped warm-up round first),
medians reported with min-max, and each adaptive row's ratios also as the median of every
repeat's own ratio ("paired": the repeat's methods ran within seconds of each other, so the
box's drift cancels). Every forward is timed by its width while the decodes run, which
gives this model's cost curve on this machine and thread count (width -> forward time over
width 1, printed with the linear model's token cost it implies); "modelled" columns weigh each
decode's forwards by that curve, so they are exact for its choices and free of the box's load;
`--curve` weighs them by a given curve instead (another machine's: curves differ far more
between CPUs than between runs), so runs on different machines compare on one curve.
At batch 1 a row "sjd, measured curve and tokens" runs the adaptive window with the curve
measured in the warm-up round and the tokens per forward that round's fixed windows finalised
(at the swept widths, interpolated between), as a model that carries its `window_cost` and
`window_tokens` would (the default row runs what the model carries: for the random presets at
batch 1 on a CPU, the default curve `DEFAULT_WINDOW_COST` and no tokens; in a batch, the linear
model with the device's default token cost).
`--family lookup` compares prompt lookup the same way: its adaptive default (`lookup`) against
its fixed windows (`lookup:adapt=false,num_draft=W-1` for each swept width W).

    python -m benchmarks.adaptive_window --case gpt-b --sampling greedy --tokens 256 --repeats 3 --threads 1
    python -m benchmarks.adaptive_window --case gpt-b-barren --tokens 256 --repeats 2 --threads 1
    python -m benchmarks.adaptive_window --case emoji64 --repeats 5 --threads 2
    python -m benchmarks.adaptive_window --case emoji-vlm --inputs 8 --repeats 3 --threads 1
    python -m benchmarks.adaptive_window --case speech-tts --inputs 4 --repeats 3 --threads 1
    python -m benchmarks.adaptive_window --case emoji-vlm --family lookup --inputs 8 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Optional

import torch

from benchmarks.window_cost import decoding_tokens, mean_tokens, timed_forwards
from mmgen.decoding import resolve_decoder
from mmgen.decoding.window import interpolate_cost, window_cost_key
from mmgen.sampling import IntervalGuidance, SamplingConfig

#: --case -> (model, init std): see the module docstring.
CASES = {"gpt-b": ("random:GPT-B", 0.0), "gpt-b-partial": ("random:GPT-B", 0.02),
         "gpt-b-barren": ("random:GPT-B", 0.05), "emoji64": ("emoji64", 0.0),
         "emoji-vlm": ("emoji-vlm", 0.0), "speech-tts": ("speech-tts", 0.0)}
#: Cases decoded through their pipelines (held-out inputs, `window_cost.decode_calls`).
PIPELINE_CASES = {"emoji-vlm": "sentence", "speech-tts": None}
SWEEP = (2, 4, 8, 16)


def build(model: str, device: str, init_std: float = 0.0):
    """(token model, sampling, tokens per image, class count) of a bundled model or a random
    preset. LlamaGen's own init (std 0.02, a zero output head) gives a law that barely depends
    on the context, so Jacobi's carried drafts are accepted (a best case); `init_std` > 0
    redraws every linear and embedding weight from N(0, init_std^2), which makes the law
    depend on the whole context (0.05: nothing is accepted, the worst case)."""
    if model.startswith("random:"):
        from mmgen.image_ar.llamagen.gpt import LlamaGenConfig, LlamaGenTransformer
        from mmgen.image_ar.llamagen.token_model import LlamaGenTokenModel

        torch.manual_seed(0)
        transformer = LlamaGenTransformer(LlamaGenConfig.from_preset(model.split(":", 1)[1])).eval()
        for module in transformer.modules() if init_std else ():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=init_std)
        transformer = transformer.to(device)
        sampling = SamplingConfig(1.0, 2000, 1.0, IntervalGuidance(4.0, -1))  # LlamaGen's official sampling
        return LlamaGenTokenModel(transformer), sampling, transformer.config.block_size, transformer.config.num_classes
    from mmgen.loading import load_pipeline

    pipe = load_pipeline(model).to(device)
    return pipe.token_model(), pipe.sampling_config(None, None, None, None, None), pipe.transformer.config.block_size, pipe.num_classes


#: The adaptive window run with the cost curve this run measured in its warm-up round and the
#: tokens per forward its fixed windows finalised there (batch 1: what a model that carries its
#: `window_cost` and `window_tokens` gets, as `window_cost.py --write` stores them).
MEASURED = "sjd, measured curve and tokens"


def fixed_spec(family: str, width: int) -> str:
    """The spec of `family`'s decoder with a fixed window of `width` tokens."""
    return f"sjd:adapt=false,window={width}" if family == "sjd" else f"{family}:adapt=false,num_draft={width - 1}"


def methods(sweep: tuple[int, ...], extra: list[str], batch_size: int, family: str = "sjd") -> list[str]:
    """AR first (the baseline), the family's adaptive default (and, for `sjd` at batch 1, with
    the measured figures), its fixed windows, then `extra` specs."""
    measured = [MEASURED] if batch_size == 1 and family == "sjd" else []
    return ["ar", family, *measured, *(fixed_spec(family, w) for w in sweep), *extra]


def curve_of(times: dict[int, list[float]]) -> dict[int, float]:
    """Forward time by width over width 1's (medians)."""
    base = statistics.median(times[1])
    return {w: statistics.median(t) / base for w, t in sorted(times.items())}


def parse_curve(items: list[str]) -> dict[int, float]:
    """`--curve` WIDTH:COST items, width 1 at cost 1 unless given."""
    try:
        curve = {int(w): float(c) for w, c in (item.split(":") for item in items)}
    except ValueError:
        raise SystemExit(f"--curve takes WIDTH:COST items such as 2:1.05, got {' '.join(items)}") from None
    return {1: 1.0, **curve}


def linear_token_cost(curve: dict[int, float], rows_fed: int) -> float:
    """The `token_cost` (rho) of the linear model whose widest forward costs what the curve says."""
    width = max(curve)
    beta = max(curve[width] - 1, 0.0) / max(width - 1, 1)
    return beta / max(1 - beta, 1e-6) / rows_fed


def modelled(stats, curve: dict[int, float], window: int) -> float:
    """A decode's forwards in AR steps per token under `curve` (each prefill counts one: a
    round of pipeline calls has `calls` of them)."""
    drafts = stats.drafts_per_forward or [window - 1] * (stats.forwards - 1)
    return (getattr(stats, "calls", 1) + sum(interpolate_cost(curve, d + 1) for d in drafts)) / stats.tokens


def pipeline_runs(model: str, kind: Optional[str], specs: list[str], inputs: int, repeats: int,
                  times: dict, warm_up: dict, warm_tokens: dict) -> dict[str, list]:
    """Per spec, one summary per repeat of a round of batch-1 pipeline calls on held-out inputs
    (`decode_calls`): seconds per generated token, forwards, and the drafts of every forward
    (the prefill of each call counted as one AR step by `modelled`)."""
    from types import SimpleNamespace

    from benchmarks.window_cost import decode_calls, use_window_cost
    from mmgen.loading import load_pipeline

    pipe = load_pipeline(model)
    pipe.set_progress_bar_config(disable=True)
    calls = decode_calls(pipe, inputs, kind)
    model_class = type(pipe.token_model())
    carried = pipe.token_model()  # its curve and tokens as shipped (None: the linear model, no tokens)
    runs: dict[str, list] = {m: [] for m in specs}
    for r in range(repeats + 1):
        for spec in specs[r % len(specs):] + specs[: r % len(specs)]:
            if r and spec == MEASURED:
                use_window_cost(pipe, {window_cost_key("cpu"): curve_of(warm_up)}, mean_tokens(warm_tokens))
            else:
                use_window_cost(pipe, carried.window_cost, carried.window_tokens)
            stats = []
            with timed_forwards(model_class, times if r else warm_up):
                for call in calls:
                    stats.append(call("sjd" if spec == MEASURED else spec).stats)
            tokens = sum(s.tokens for s in stats)
            window = getattr(resolve_decoder("sjd" if spec == MEASURED else spec), "window", 1)
            if not r and spec.startswith("sjd:adapt=false"):
                warm_tokens[window] += [t for s in stats for t in decoding_tokens(s)]
            drafts = [d for s in stats for d in (s.drafts_per_forward or [window - 1] * (s.forwards - 1))]
            runs[spec].append(SimpleNamespace(
                wall_time_s=sum(s.wall_time_s for s in stats) / tokens, forwards=sum(s.forwards for s in stats),
                step_compression=tokens / sum(s.forwards for s in stats), drafts_per_forward=drafts or None,
                tokens=tokens, calls=len(stats)))
        use_window_cost(pipe, carried.window_cost, carried.window_tokens)
    return {spec: stats[1:] for spec, stats in runs.items()}  # the first round warms up


@torch.no_grad()
def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="emoji64")
    parser.add_argument("--model", help="instead of --case: a bundled LlamaGen model or random:PRESET")
    parser.add_argument("--init-std", type=float, default=0.0, help="with --model random:PRESET (0: LlamaGen's own init)")
    parser.add_argument("--sampling", choices=("model", "greedy"), default="model")
    parser.add_argument("--family", choices=("sjd", "lookup"), default="sjd",
                        help="the speculative decoder whose adaptive default and fixed windows are compared")
    parser.add_argument("--sweep", type=int, nargs="+", default=list(SWEEP), help="fixed windows to compare")
    parser.add_argument("--methods", nargs="*", default=[], help="more decoding specs")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per image (0: the model's own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=8, help="held-out inputs per round (the emoji-vlm and speech-tts cases)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--curve", nargs="+", metavar="WIDTH:COST", help="weigh the modelled columns by this cost curve "
                        "(e.g. another machine's: 2:1.053 4:1.156 8:1.334 16:1.673) instead of the one this run measures")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    given = parse_curve(args.curve) if args.curve else None  # before any work
    model_name, init_std = (args.model, args.init_std) if args.model else CASES[args.case]
    on_pipeline = args.model is None and args.case in PIPELINE_CASES
    if on_pipeline and (args.batch_size != 1 or args.sampling != "model" or args.device != "cpu"):
        raise SystemExit(f"--case {args.case} decodes batch-1 calls at the model's own sampling on the CPU")
    specs = methods(tuple(args.sweep), args.methods, args.batch_size, args.family)
    decoders = {m: resolve_decoder("sjd" if m == MEASURED else m) for m in specs}
    times: dict[int, list[float]] = defaultdict(list)
    warm_up: dict[int, list[float]] = defaultdict(list)
    warm_tokens: dict[int, list[float]] = defaultdict(list)  # by width: what the warm-up's fixed windows finalised per forward
    if on_pipeline:
        runs = pipeline_runs(model_name, PIPELINE_CASES[args.case], specs, args.inputs, args.repeats, times, warm_up, warm_tokens)
        sampling, tokens = None, "held-out"
    else:
        token_model, sampling, length, classes = build(model_name, args.device, init_std)
        if args.sampling == "greedy":
            sampling = SamplingConfig(top_k=1, guidance=sampling.guidance)
        tokens = args.tokens or length
        runs = {m: [] for m in specs}
    # The curve and tokens the model ships with (None: the linear model, no tokens).
    carried = (None, None) if on_pipeline else (getattr(token_model, "window_cost", None), getattr(token_model, "window_tokens", None))
    for r in range(0 if on_pipeline else args.repeats + 1):  # the first round warms up (and measures the measured row's figures)
        labels = torch.tensor([(r * args.batch_size + i) % classes for i in range(args.batch_size)], device=args.device)
        for spec in specs[r % len(specs):] + specs[: r % len(specs)]:
            if r and spec == MEASURED:
                measured = ({window_cost_key(torch.device(args.device).type): curve_of(warm_up)}, mean_tokens(warm_tokens))
            else:
                measured = carried
            token_model.window_cost, token_model.window_tokens = measured
            with timed_forwards(type(token_model), times if r else warm_up):
                out = decoders[spec].generate(token_model, labels, tokens, sampling, torch.Generator(args.device).manual_seed(r))
            if r:
                runs[spec].append(out.stats)
            elif spec.startswith("sjd:adapt=false") and args.batch_size == 1:
                warm_tokens[decoders[spec].window] += decoding_tokens(out.stats)
        token_model.window_cost, token_model.window_tokens = carried
    if MEASURED in runs and not runs[MEASURED]:
        del runs[MEASURED]
    curve = given or curve_of(times)
    # Rows a forward feeds: guidance doubles them (Dia's own guidance too: its forwards feed both halves).
    guided = sampling.uses_guidance if sampling is not None else args.case == "speech-tts"
    rows_fed = args.batch_size * (2 if guided else 1)
    rows = {}
    for spec, stats in runs.items():
        window = getattr(decoders[spec], "window", 1)
        rows[spec] = {
            "seconds": statistics.median(s.wall_time_s for s in stats),
            "spread": [min(s.wall_time_s for s in stats), max(s.wall_time_s for s in stats)],
            "forwards": statistics.median(s.forwards for s in stats),
            "step_compression": statistics.median(s.step_compression for s in stats),
            "mean_drafts": statistics.median(statistics.mean(s.drafts_per_forward) if s.drafts_per_forward else window - 1
                                             for s in stats),
            "modelled": statistics.median(modelled(s, curve, window) for s in stats),
            # Over many decodes (one per repeat) the mean is the throughput figure: total cost.
            "modelled_mean": statistics.mean(modelled(s, curve, window) for s in stats),
            "unit": "s / token" if on_pipeline else "s / decode",
        }
    fixed = [s for s in runs if s.startswith(f"{args.family}:adapt=false")]
    best = min(fixed, key=lambda s: rows[s]["seconds"])
    best_modelled = min(fixed, key=lambda s: rows[s]["modelled"])
    best_mean = min(fixed, key=lambda s: rows[s]["modelled_mean"])
    ar = rows["ar"]
    summary = {"best_fixed": best, "best_fixed_modelled": best_modelled}
    for name in (args.family, MEASURED):
        if name in rows:
            key = "adaptive" if name == args.family else "measured"
            summary[f"{key}_vs_best_fixed"] = rows[name]["seconds"] / rows[best]["seconds"]
            summary[f"{key}_vs_ar"] = rows[name]["seconds"] / ar["seconds"]
            summary[f"{key}_vs_best_fixed_modelled"] = rows[name]["modelled"] / rows[best_modelled]["modelled"]
            summary[f"{key}_vs_ar_modelled"] = rows[name]["modelled"] / ar["modelled"]
            summary[f"{key}_vs_best_fixed_modelled_mean"] = rows[name]["modelled_mean"] / rows[best_mean]["modelled_mean"]
            # Each repeat decodes every method in turn, so a repeat's own ratio cancels the box's drift.
            for other, label in ((best, "best_fixed"), ("ar", "ar")):
                summary[f"{key}_vs_{label}_paired"] = statistics.median(
                    a.wall_time_s / b.wall_time_s for a, b in zip(runs[name], runs[other]))
    name = args.model or args.case
    print(f"\n{name} ({model_name}, init std {init_std}), {args.sampling} sampling, batch {args.batch_size}, {tokens} tokens, "
          f"{args.repeats} repeats, threads {torch.get_num_threads()}")
    print(("cost curve given (--curve)" if args.curve else "cost curve (forward time by width over width 1)") + ": "
          + ", ".join(f"{w}: {c:.2f}" for w, c in curve.items())
          + f"; as a linear model's token cost: {linear_token_cost(curve, rows_fed):.3f}")
    measured_tokens = mean_tokens(warm_tokens)
    if measured_tokens:
        print("tokens per forward of the warm-up's fixed windows: " + ", ".join(f"{w}: {t:.2f}" for w, t in measured_tokens.items()))
    unit, scale = ("ms / token", 1000.0) if on_pipeline else ("s / decode", 1.0)
    print(f"| method | {unit} (min-max) | vs AR | forwards | step compression | mean drafts | modelled AR steps / token |")
    print("|---|---|---|---|---|---|---|")
    for spec, row in rows.items():
        lo, hi = row["spread"]
        print(f"| {spec} | {row['seconds'] * scale:.2f} ({lo * scale:.2f}-{hi * scale:.2f}) | {ar['seconds'] / row['seconds']:.2f}x "
              f"| {row['forwards']:.0f} | {row['step_compression']:.2f}x | {row['mean_drafts']:.1f} | {row['modelled']:.3f} |")
    for key, name in (("adaptive", f"adaptive {args.family}"), ("measured", "adaptive sjd with the measured curve and tokens")):
        if f"{key}_vs_ar" in summary:
            print(f"{name}: {summary[f'{key}_vs_best_fixed']:.3f}x the time of the best fixed window ({best}), "
                  f"{summary[f'{key}_vs_ar']:.3f}x AR's; modelled {summary[f'{key}_vs_best_fixed_modelled']:.3f}x the best "
                  f"({best_modelled}), {summary[f'{key}_vs_ar_modelled']:.3f}x AR; modelled means over the "
                  f"{len(runs[args.family])} decodes: {summary[f'{key}_vs_best_fixed_modelled_mean']:.3f}x the best ({best_mean}); "
                  f"by the clock, the median of each repeat's own ratio: {summary[f'{key}_vs_best_fixed_paired']:.3f}x the best "
                  f"fixed window, {summary[f'{key}_vs_ar_paired']:.3f}x AR")
    result = {"case": name, "family": args.family, "model": model_name, "init_std": init_std, "sampling": args.sampling, "batch_size": args.batch_size,
              "tokens": tokens, "threads": torch.get_num_threads(), "curve": curve,
              "window_tokens": measured_tokens, "rows": rows, "summary": summary}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
