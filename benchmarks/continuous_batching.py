"""Images per second: static batches against continuous batching, the same requests and decoder.

Static batching decodes the requests in groups of `--batch-size` (one `generate` per group),
so each group takes as many forwards as its slowest row. Continuous batching
(`mmgen.decoding.batching`) keeps `--batch-size` rows decoding and refills a row as soon as it
finishes; every image then equals its request decoded alone with its seed (the benchmark
checks it for the first `--check` requests; an adaptive window alone with the rows' policy,
`row_decoder`). Token decoding only (the VQ decoder costs the same
either way). Modes run in turn within each repeat (interleaved); medians reported.

    python -m benchmarks.continuous_batching --model emoji64 --requests 32 --batch-size 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import operator
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from mmgen.decoding import resolve_decoder
from mmgen.decoding.batching import Request, continuous_decode, row_decoder
from mmgen.sampling import IntervalGuidance, SamplingConfig, make_generator


METHODS = ["ar", "sjd:adapt=false", "lantern:adapt=false"]


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


def static(decoder, model, labels, num_tokens, sampling, batch_size: int, seed: int) -> tuple[int, float]:
    """Decode `labels` in groups of `batch_size`, one generator per group; returns the forwards
    and the rows' utilisation."""
    forwards, busy, slots = 0, 0, 0
    for start in range(0, len(labels), batch_size):
        group = labels[start : start + batch_size]
        out = decoder.generate(model, group, num_tokens, sampling, make_generator(seed + start, labels.device))
        forwards += out.stats.forwards
        busy, slots = busy + sum(out.stats.accepted_histogram) - len(group), slots + batch_size * (out.stats.forwards - 1)
    return forwards, busy / slots


def utilisation(stats, rows: int) -> float:
    """Row-forwards that decoded a live request over all row-forwards of the decode forwards
    (prefills, one per request, left out)."""
    decode_forwards = stats.forwards - stats.rows
    return (sum(stats.accepted_histogram)) / (rows * decode_forwards) if decode_forwards else 1.0


def continuous(decoder, model, labels, num_tokens, sampling, batch_size: int, seed: int):
    requests = [Request(label.reshape(1), make_generator(seed + i, labels.device)) for i, label in enumerate(labels)]
    return continuous_decode(decoder, model, requests, num_tokens, sampling, batch_size)


def pipeline_arguments(parser: argparse.ArgumentParser, methods: list[str]) -> None:
    """The options of a pipeline's static-against-continuous benchmark (`compare_modes`)."""
    parser.add_argument("--methods", nargs="+", default=methods, help="fixed-window decoding specs")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows here")


def compare_modes(methods: list[str], static: Callable, continuous: Callable, count: int, batch_size: int, repeats: int,
                  unit: str, same: Callable = operator.eq) -> list[dict]:
    """A pipeline's static calls against its continuous batching (`VLMPipeline.answer_each`,
    `TTSPipeline.speak_each`) for each method, the two modes in turn within each repeat:
    `static(method)` and `continuous(method)` each decode all `count` requests and return (the
    outputs, forwards, tokens). A row per method: `unit` per second (medians) and their range,
    forwards, and how many outputs `same` finds equal in both modes."""
    seconds: dict = {}
    results: dict = {}
    for repeat in range(repeats):
        for method in methods:
            modes = (("static", static), ("continuous", continuous))
            for mode, run in modes if repeat % 2 == 0 else modes[::-1]:
                start = time.perf_counter()
                results[(method, mode)] = run(method)
                seconds.setdefault((method, mode), []).append(time.perf_counter() - start)
    rows = []
    for method in methods:
        (st, sf, stok), (ct, cf, ctok) = results[(method, "static")], results[(method, "continuous")]
        s, c = statistics.median(seconds[(method, "static")]), statistics.median(seconds[(method, "continuous")])
        rows.append({
            "method": method, unit: count, "batch_size": batch_size, "tokens": ctok,
            f"static_{unit}_per_s": count / s, f"continuous_{unit}_per_s": count / c, "continuous_over_static": s / c,
            "static_s_range": [min(seconds[(method, "static")]), max(seconds[(method, "static")])],
            "continuous_s_range": [min(seconds[(method, "continuous")]), max(seconds[(method, "continuous")])],
            "static_forwards": sf, "continuous_forwards": cf,
            f"{unit}_equal_static": f"{sum(bool(same(a, b)) for a, b in zip(st, ct))}/{count}", "same_tokens": stok == ctok,
        })
    print(json.dumps(rows, indent=1))
    return rows


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="emoji64", help="a bundled model or random:<LlamaGen preset>")
    parser.add_argument("--methods", nargs="+", default=METHODS, help="fixed-window decoding specs")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=None, help="tokens per image (default: the model's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", type=int, default=4, help="requests checked against a batch-1 decode")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, sampling, num_tokens, num_classes = build(args.model, args.device)
    num_tokens = args.tokens or num_tokens
    labels = torch.arange(args.requests, device=args.device) % num_classes
    rows = []
    for spec in args.methods:
        decoder = resolve_decoder(spec)
        times: dict[str, list[float]] = {"static": [], "continuous": []}
        forwards, busy = {}, {}
        for repeat in range(args.repeats):
            for mode in ("static", "continuous") if repeat % 2 == 0 else ("continuous", "static"):
                begun = time.perf_counter()
                if mode == "static":
                    forwards[mode], busy[mode] = static(decoder, model, labels, num_tokens, sampling, args.batch_size, 0)
                else:
                    done, stats = continuous(decoder, model, labels, num_tokens, sampling, args.batch_size, 0)
                    forwards[mode], busy[mode] = stats.forwards, utilisation(stats, min(args.batch_size, args.requests))
                times[mode].append(time.perf_counter() - begun)
        identical, single = 0, row_decoder(decoder, args.batch_size)  # the adaptive window as the rows judge it
        for i in range(min(args.check, args.requests)):
            alone = single.generate(model, labels[i : i + 1], num_tokens, sampling, make_generator(i, labels.device))
            identical += bool(torch.equal(alone.tokens[0], done[i].tokens))
        row = {"method": spec, "requests": args.requests, "batch_size": args.batch_size, "tokens": num_tokens,
               "identical_to_alone": f"{identical}/{min(args.check, args.requests)}"}
        for mode in ("static", "continuous"):
            median = statistics.median(times[mode])
            row[f"{mode}_images_per_s"] = args.requests / median
            row[f"{mode}_forwards"] = forwards[mode]
            row[f"{mode}_row_utilisation"] = busy[mode]
            row[f"{mode}_spread"] = (max(times[mode]) - min(times[mode])) / median
        row["speedup"] = row["continuous_images_per_s"] / row["static_images_per_s"]
        rows.append(row)
        print(f"{spec:24s} static {row['static_images_per_s']:.2f} img/s ({forwards['static']} forwards, "
              f"rows busy {busy['static']:.0%})  continuous {row['continuous_images_per_s']:.2f} img/s "
              f"({forwards['continuous']} forwards, rows busy {busy['continuous']:.0%})  "
              f"x{row['speedup']:.2f}  identical to alone {row['identical_to_alone']}", flush=True)
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
