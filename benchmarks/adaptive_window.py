"""Whole decodes: autoregressive, a fixed Jacobi window and the adaptive window, side by side.

The worst case is a model whose drafts are never accepted: LlamaGen GPT-B with random weights
drawn at std 0.05 (12 x 768 trunk, 16k codes: the size of the issue's random Janus), where a
fixed window pays a verify forward for one token. With LlamaGen's own init the same random
model is a best case (its law barely depends on the context). The good case is the bundled, trained `emoji64`. Methods are
decoded in turn within each repeat (interleaved), medians reported; every row also gives the
policy's cost model with the token cost measured here on this model (forwards weighted by
1 + beta * drafts, in AR steps per token), and the measured figure itself.

    python -m benchmarks.adaptive_window --model random:GPT-B --init-std 0.05 --tokens 256 --repeats 2
    python -m benchmarks.adaptive_window --model emoji64 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Optional

import torch

from mmgen.decoding import resolve_decoder
from mmgen.decoding.window import draft_cost
from mmgen.sampling import IntervalGuidance, SamplingConfig

METHODS = ["ar", "sjd:adapt=false", "sjd"]


def build(model: str, device: str, init_std: float = 0.0):
    """(token model, sampling, tokens per image, class count) of a bundled model or a random
    preset. LlamaGen's own init (std 0.02, a zero output head) gives a law that barely depends
    on the context, so Jacobi's carried drafts are accepted (a best case); `init_std` > 0
    redraws every linear and embedding weight from N(0, init_std^2), which makes the law
    depend on the whole context and nothing is accepted (the worst case; 0.05 is enough)."""
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


def measured_token_cost(token_model, labels: torch.Tensor, sampling: SamplingConfig, window: int = 16,
                        repeats: int = 5) -> float:
    """rho of `AdaptiveWindow` for this model and machine: the median cost of a `window`-token
    forward over a 1-token one (interleaved, cache half full, nothing committed), as
    1 + (window - 1) beta with beta = rho R / (1 + rho R)."""
    import time

    capacity = 2 * window + 64
    state = token_model.start(labels, capacity, sampling.uses_guidance)
    feeds = {n: torch.zeros(len(labels), n, dtype=torch.long, device=labels.device) for n in (1, window)}
    times: dict[int, list[float]] = {1: [], window: []}
    for r in range(repeats + 1):
        for n, feed in feeds.items():
            start = time.perf_counter()
            token_model.forward(state, feed)
            if r:
                times[n].append(time.perf_counter() - start)
    ratio = statistics.median(times[window]) / statistics.median(times[1])
    beta = max(ratio - 1, 0.0) / (window - 1)
    rows = len(labels) * (2 if sampling.uses_guidance else 1)
    return beta / max(1 - beta, 1e-6) / rows


@torch.no_grad()
def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="emoji64", help="a bundled LlamaGen model or random:PRESET (e.g. random:GPT-B)")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="decoding specs")
    parser.add_argument("--init-std", type=float, default=0.0, help="random presets: std of every weight (0: LlamaGen's own init)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per image (0: the model's own)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    token_model, sampling, length, classes = build(args.model, args.device, args.init_std)
    tokens = args.tokens or length
    decoders = {m: resolve_decoder(m) for m in args.methods}
    runs: dict[str, list] = {m: [] for m in args.methods}
    for r in range(args.repeats + 1):  # the first round warms up and is dropped
        labels = torch.tensor([(r * args.batch_size + i) % classes for i in range(args.batch_size)], device=args.device)
        for method, decoder in decoders.items():
            out = decoder.generate(token_model, labels, tokens, sampling, torch.Generator(args.device).manual_seed(r))
            if r:
                runs[method].append(out.stats)
    rho = measured_token_cost(token_model, labels, sampling)
    rows_fed = args.batch_size * (2 if sampling.uses_guidance else 1)
    ar_seconds = statistics.median(s.wall_time_s for s in runs[args.methods[0]])
    rows = []
    beta = draft_cost(rho, rows_fed)
    for method, stats in runs.items():
        seconds = statistics.median(s.wall_time_s for s in stats)
        window = getattr(decoders[method], "window", 1)
        modelled = statistics.median(
            (1 + sum(1 + beta * d for d in (s.drafts_per_forward or [window - 1] * (s.forwards - 1)))) / s.tokens
            for s in stats)
        rows.append({
            "method": method, "token_cost": rho, "seconds": seconds, "speedup_vs_first": ar_seconds / seconds,
            "forwards": statistics.median(s.forwards for s in stats),
            "step_compression": statistics.median(s.step_compression for s in stats),
            "modelled_cost_per_token": modelled,
            "drafts_per_forward": statistics.median(statistics.mean(s.drafts_per_forward) for s in stats) if stats[0].drafts_per_forward else window - 1,
            "spread_seconds": [min(s.wall_time_s for s in stats), max(s.wall_time_s for s in stats)],
        })
    print(f"\n{args.model}, batch {args.batch_size}, {tokens} tokens, {args.repeats} repeats, threads {torch.get_num_threads()}; "
          f"measured token cost rho = {rho:.3f} (16-token verify = {1 + 15 * beta:.2f}x an AR step)")
    print("| method | s / decode (min-max) | vs first | forwards | step compression | mean drafts | modelled AR steps / token |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        lo, hi = row["spread_seconds"]
        print(f"| {row['method']} | {row['seconds']:.2f} ({lo:.2f}-{hi:.2f}) | {row['speedup_vs_first']:.2f}x | {row['forwards']:.0f} "
              f"| {row['step_compression']:.2f}x | {row['drafts_per_forward']:.1f} | {row['modelled_cost_per_token']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
