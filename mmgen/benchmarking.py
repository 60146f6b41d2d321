"""Pieces every `mmgen bench` harness shares: the machine a report was measured on, one
progress bar, and the Markdown / JSON report files (written atomically).

A modality's harness (`mmgen.image_ar.bench`, `mmgen.vlm.bench`, `mmgen.audio.bench`,
`mmgen.video.bench`) says what a method's run on one input is; `compare_methods` runs baseline and
methods side by side in one process, and the rest describes and writes what it measured."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from mmgen.files import write_atomic


def environment(device: torch.device, command: str) -> dict:
    """The machine, versions, commit (when run from a checkout) and date a report was measured with."""
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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for row in rows for k in row))  # every row's columns, first seen first
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



@dataclass
class Run:
    """One timed call of one method on one input: `output` (compared with the baseline's),
    `units` made (tokens, frames, video frames), wall `seconds`, the target's `forwards` and the
    drafter's (`draft_forwards`)."""

    output: Any
    units: int
    seconds: float
    forwards: int
    draft_forwards: int = 0


def same(a: Any, b: Any) -> bool:
    """Outputs equal element for element (tensors, or sequences of them)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def compare_methods(inputs: Sequence[Any], methods: dict[str, Callable[[Any, int], Run]], repeats: int, warmup: int = 1,
                    progress: Optional[tqdm] = None) -> list[dict]:
    """Every method on every input, baseline (the first method) and the rest side by side in
    one process: per input, `warmup` untimed rounds, then `repeats` rounds, the methods' order
    rotated every round so a busy machine slows all alike. `run(input, seed)` draws from `seed`
    (the input's index), the same for every method. Per method: units per target forward, the
    median milliseconds per unit, the speedup against the baseline as the median over inputs
    of each input's paired ratio (baseline's seconds per unit over the method's), the drafter's
    forwards per unit, and the share of inputs whose output equals the baseline's. A method
    that fails is reported with its error instead of figures."""
    names = list(methods)
    per_unit: dict[str, list[list[float]]] = {n: [[] for _ in inputs] for n in names}
    runs: dict[str, list[Run]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    plan(progress, len(inputs) * len(names) * (warmup + repeats), "methods")
    for i, item in enumerate(inputs):
        for r in range(warmup + repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                tick(progress)
                if name in errors:
                    continue
                try:
                    run = methods[name](item, i)
                except Exception as error:  # reported in the table, the other methods go on
                    errors[name] = f"{type(error).__name__}: {error}"
                    continue
                if r >= warmup:
                    per_unit[name][i].append(run.seconds / max(run.units, 1))
                if r == warmup:
                    runs[name].append(run)
    rows, base = [], names[0]
    for name in names:
        if name in errors:
            rows.append({"method": name, "error": errors[name]})
            continue
        done = runs[name]
        medians = [statistics.median(times) for times in per_unit[name]]
        row = {"method": name, "units": sum(r.units for r in done),
               "units_per_forward": sum(r.units for r in done) / max(sum(r.forwards for r in done), 1),
               "ms_per_unit": 1000 * statistics.median(medians),
               "draft_forwards_per_unit": sum(r.draft_forwards for r in done) / max(sum(r.units for r in done), 1)}
        if base not in errors:
            base_medians = [statistics.median(times) for times in per_unit[base]]
            row["speedup_vs_" + base] = statistics.median(b / m for b, m in zip(base_medians, medians))
            row["identical_to_" + base] = sum(same(a.output, b.output) for a, b in zip(done, runs[base])) / len(done)
        rows.append(row)
    return rows


def add_method_arguments(parser: argparse.ArgumentParser, model: str, methods: Sequence[str], inputs: int) -> None:
    """The options every `compare_methods` harness takes (`mmgen bench text|speech|video`)."""
    parser.add_argument("--models", nargs="+", default=[model], help="bundled model names or model folders")
    parser.add_argument("--methods", nargs="+", default=list(methods),
                        help="decoding specs as `--decoding` takes them; the first is the baseline")
    parser.add_argument("--inputs", type=int, default=inputs, help="held-out inputs, each decoded at batch 1")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per input (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per input first")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N, mps")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--markdown", help="write the report as Markdown here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_methods(args: argparse.Namespace, rows_of: Callable[[Any, str, Optional[tqdm]], list[dict]]) -> str:
    """Check the shared options (one line before any model loads), then `rows_of(pipe, name,
    progress)` for each model of `--models`, written as one report."""
    for flag in ("inputs", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.warmup < 0 or (args.threads is not None and args.threads < 1):
        raise ValueError("--warmup must be >= 0 and --threads >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmgen.loading import load_pipeline

    device = torch.device(args.device)
    report = {"environment": environment(device, args.command_line),
              "args": {k: v for k, v in vars(args).items() if not callable(v)}, "speed": []}
    with progress_bar(not args.no_progress) as progress:
        for name in args.models:
            pipe = load_pipeline(name, device, torch.float32)
            pipe.set_progress_bar_config(disable=True)
            report["speed"] += [{"model": name, **row} for row in rows_of(pipe, name, progress)]
    return write_report(report, args.json, args.markdown)
