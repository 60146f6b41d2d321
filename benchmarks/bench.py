"""`mmgen bench`: decoding methods x models x batch sizes, baseline and method in one process.

Two modes:

* trained pipelines (the bundled emoji models by default): forwards, step compression, mean
  accepted length, wall-clock speedup against AR on the same model and batch (warm-up, medians
  over repeats), peak memory, and the quality proxies of each method's samples;
* `--random-weights PRESET`: per-forward latency of a W-token verify window against an AR step
  at official model sizes (speed does not depend on the weights).

Both write a Markdown table and a JSON file that state the machine, device, versions and the
exact command. A progress bar on stderr counts the decodes (forwards with --random-weights)
of the whole run; --no-progress turns it off.

The harness lives in the repository, not in the installed package: `mmgen bench` (its options
are `mmgen.image_ar.cli.add_bench_arguments`) imports this module when the command runs.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from mmgen import registry
from mmgen.decoding import DecodeStats, Decoder
from mmgen.files import write_atomic
from mmgen.hub import read_json
from mmgen.metrics import token_nll
from mmgen.sampling import SamplingConfig

from mmgen.image_ar.bundled import QUALITY_CLASSIFIER
from mmgen.loading import decoder_from_spec, resolve_model
from mmgen.image_ar.llamagen import LlamaGenConfig, LlamaGenPipeline, LlamaGenTokenModel, LlamaGenTransformer


def environment(device: torch.device, command: str) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    import mmgen

    return {
        "command": command,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mmgen": mmgen.__version__,
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def progress_bar(enabled: bool = True) -> tqdm:
    """The bench's one progress bar (stderr): each part adds the work it plans (`plan`) and
    ticks once per decode."""
    return tqdm(total=0, desc="bench", unit="decode", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def plan(progress: Optional[tqdm], count: int, what: str) -> None:
    """Add `count` units of work, described by `what`, to the bar."""
    if progress is not None:
        progress.total += count
        progress.set_postfix_str(what, refresh=False)
        progress.refresh()


def tick(progress: Optional[tqdm], n: int = 1) -> None:
    if progress is not None:
        progress.update(n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ trained models


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


@torch.no_grad()
def speed_rows(pipe: LlamaGenPipeline, model_name: str, methods: Sequence[str], batch_sizes: Sequence[int],
               sampling: SamplingConfig, repeats: int, warmup: int, progress: Optional[tqdm] = None) -> list[dict]:
    device = pipe.device
    token_model = pipe.token_model()
    n = pipe.transformer.config.block_size
    rows = []
    dtype = pipe.transformer.output.weight.dtype
    decoders = {method: decoder_from_spec(method, pipe, model_name, device, dtype) for method in methods}  # drafters load once
    for batch in batch_sizes:
        baseline = None
        for method in methods:
            decoder = decoders[method]
            run = lambda labels, seed: decoder.generate(token_model, torch.tensor(labels, device=device), n, sampling,
                                                        torch.Generator(device).manual_seed(seed)).stats
            stats = timed_decodes(run, batch, pipe.num_classes, repeats, warmup, progress, f"{model_name} {method} batch {batch}")
            row = {
                "model": model_name, "method": method, "batch": batch,
                "forwards": statistics.median(s.forwards for s in stats),
                "step_compression": statistics.median(s.step_compression for s in stats),
                "mean_accepted_length": statistics.median(s.mean_accepted_length for s in stats),
                "seconds": statistics.median(s.wall_time_s for s in stats),
                "peak_memory_mb": None if stats[0].peak_memory_bytes is None else max(s.peak_memory_bytes for s in stats) / 2**20,
            }
            baseline = baseline or (row["seconds"] if method == "ar" else None)
            row["speedup_vs_ar"] = baseline / row["seconds"] if baseline else None
            rows.append(row)
    return rows


def score_samples(scorer, token_model: LlamaGenTokenModel, images: torch.Tensor, labels: torch.Tensor,
                  tokens: torch.Tensor) -> dict:
    """Quality proxies of images [N, 3, H, W] in [0, 1] plus the GPT's NLL of their tokens."""
    nll = torch.cat([token_nll(token_model, l, t).cpu() for l, t in zip(labels.split(256), tokens.split(256))])
    return {**scorer(images, labels), "nll": float(nll.mean())}


@torch.no_grad()
def sample_and_score(pipe: LlamaGenPipeline, decoder: Decoder, sampling: SamplingConfig, labels: torch.Tensor,
                     batch_size: int, seed: int, scorer, progress: Optional[tqdm] = None) -> dict:
    """Generate one image per label in chunks from one seeded generator, then score them.

    Also returns the per-row step compression over all chunks: tokens finalised per row per
    forward (the mean accepted length over every (row, forward) pair), which, unlike a
    batch's forwards, does not depend on which row of a chunk is slowest.
    """
    device = pipe.device
    token_model = pipe.token_model()
    generator = torch.Generator(device).manual_seed(seed)
    outputs = []
    for chunk in labels.split(batch_size):
        outputs.append(decoder.generate(token_model, chunk.to(device), pipe.transformer.config.block_size, sampling, generator))
        tick(progress)
    tokens = torch.cat([o.tokens for o in outputs])
    histogram = [sum(h) for h in itertools.zip_longest(*(o.stats.accepted_histogram for o in outputs), fillvalue=0)]
    row_compression = sum(k * c for k, c in enumerate(histogram)) / sum(histogram)
    scores = score_samples(scorer, token_model, pipe.decode_tokens(tokens, output_type="pt"), labels.to(device), tokens)
    return {"row_step_compression": row_compression, **scores}


def quality_rows(pipe: LlamaGenPipeline, model_name: str, methods: Sequence[str], sampling: SamplingConfig,
                 labels: torch.Tensor, batch_size: int, seed: int, progress: Optional[tqdm] = None) -> list[dict]:
    """Quality proxies of each method's samples: the same labels and seed for every method."""
    from mmgen.image_ar.quality import ImageQualityProxies

    scorer = ImageQualityProxies.from_pretrained(QUALITY_CLASSIFIER)
    rows = []
    for method in methods:
        plan(progress, quality_chunks(labels, batch_size), f"{model_name} {method} quality")
        decoder = decoder_from_spec(method, pipe, model_name, pipe.device, pipe.transformer.output.weight.dtype)
        rows.append({"model": model_name, "method": method,
                     **sample_and_score(pipe, decoder, sampling, labels, batch_size, seed, scorer, progress)})
    return rows


def quality_labels(num_classes: int, args) -> torch.Tensor:
    """The class labels of the quality samples: `--quality-per-class` of each of the first
    `--quality-classes` classes (0: all), class by class."""
    classes = num_classes if args.quality_classes <= 0 else min(args.quality_classes, num_classes)
    return torch.arange(classes).repeat_interleave(args.quality_per_class)


def quality_chunks(labels: torch.Tensor, batch_size: int) -> int:
    """Decodes of one method's quality samples."""
    return -(-len(labels) // batch_size)


# ------------------------------------------------------------------------------ random weights


@torch.no_grad()
def forward_cost_rows(preset: str, windows: Sequence[int], batch_sizes: Sequence[int], device: torch.device,
                      dtype: torch.dtype, guidance: bool, repeats: int, warmup: int,
                      progress: Optional[tqdm] = None) -> list[dict]:
    """Latency of one W-token forward (the verify step) vs a 1-token AR step, cache half full."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaGenTransformer(LlamaGenConfig.from_preset(preset)).eval().to(dtype)
    token_model = LlamaGenTokenModel(model)
    rows = []
    for batch in batch_sizes:
        labels = torch.arange(batch, device=device)
        base = None
        for window in windows:
            plan(progress, warmup + repeats, f"{preset} batch {batch} window {window}")
            state = token_model.start(labels, model.config.block_size + 2 * max(windows), guidance=guidance)
            state.cache.advance(model.config.block_size // 2)
            tokens = torch.randint(0, model.config.vocab_size, (batch, window), device=device)
            for _ in range(warmup):
                token_model.forward(state, tokens)
                tick(progress)
            times = []
            for _ in range(repeats):
                _sync(device)
                start = time.perf_counter()
                token_model.forward(state, tokens)
                _sync(device)
                times.append(time.perf_counter() - start)
                tick(progress)
            seconds = statistics.median(times)
            base = seconds if window == 1 else base
            rows.append({"preset": preset, "batch": batch, "window": window, "ms_per_forward": seconds * 1e3,
                         "cost_vs_ar_step": seconds / base if base else None})
    return rows


# ------------------------------------------------------------------------------ output


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    fmt = lambda v: "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows])


def write_report(report: dict, json_path: Optional[str], markdown_path: Optional[str]) -> str:
    env = report["environment"]
    parts = [f"Command: `{env['command']}`", "",
             f"Machine: {env['device_name']} ({env['cpu_count']} CPUs, {env['torch_threads']} torch threads), device {env['device']}; "
             f"torch {env['torch']}, python {env['python']}, mmgen {env['mmgen']} @ {env['git_commit']}; {env['date']}.", ""]
    for title, key in (("Speed", "speed"), ("Quality proxies", "quality"), ("Forward cost (random weights)", "forward_cost")):
        if report.get(key):
            parts += [f"### {title}", "", markdown_table(report[key]), ""]
    text = "\n".join(parts)
    for path, content in ((json_path, json.dumps(report, indent=2) + "\n"), (markdown_path, text)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, content.encode())
    return text


def bench_family(args) -> str:
    """"var" for next-scale models (bundled `var-*` names, VARPipeline folders, `--random-weights
    var-dN`), "mar" for continuous-token ones (MARPipeline folders), else "token"."""
    if args.random_weights:
        return "var" if args.random_weights.startswith("var-") else "token"
    kinds = set()
    for name in args.models:
        index = Path(resolve_model(name)) / "model_index.json"
        class_name = read_json(index).get("_class_name") if index.exists() else "LlamaGenPipeline"
        kinds.add({"scale": "var", "continuous": "mar"}.get(registry.pipeline_class(class_name).decoder_family, "token"))
    if len(kinds) > 1:
        raise ValueError(f"benchmark one kind of model per run (token, VAR or MAR), got {sorted(kinds)}")
    return kinds.pop()


def run(args) -> str:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    report = {"environment": environment(device, args.command_line),
              "args": {k: v for k, v in vars(args).items() if not callable(v)}}
    family = bench_family(args)
    with progress_bar(not getattr(args, "no_progress", False)) as progress:
        if family == "var":
            from benchmarks.bench_var import run_var

            run_var(args, report, device, dtype, progress)
        elif family == "mar":
            from benchmarks.bench_mar import run_mar

            run_mar(args, report, device, dtype, progress)
        elif args.random_weights:
            report["forward_cost"] = forward_cost_rows(args.random_weights, args.windows, args.batch_sizes, device, dtype,
                                                       args.guidance_scale != 1, args.repeats, args.warmup, progress)
        else:
            report["speed"], report["quality"] = [], []
            for name in args.models:
                pipe = LlamaGenPipeline.from_pretrained(resolve_model(name), device=device, dtype=dtype)
                sampling = pipe.sampling_config(args.guidance_scale, None, args.temperature, args.top_k, args.top_p)
                if args.batch_sizes:
                    report["speed"] += speed_rows(pipe, name, args.methods, args.batch_sizes, sampling, args.repeats,
                                                  args.warmup, progress)
                if args.quality_per_class > 0:
                    report["quality"] += quality_rows(pipe, name, args.methods, sampling, quality_labels(pipe.num_classes, args),
                                                      args.quality_batch_size, args.seed, progress)
    return write_report(report, args.json, args.markdown)
