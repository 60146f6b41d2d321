"""What the comparisons with official code share (`official_llamagen`, `official_var`,
`official_mar`): interleaved timed rounds, each method's time against the official code and
against mmgen `ar` as medians of the per-round (paired) ratios, and the report."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mmgen.files import write_atomic


def parse(doc: str, repository: str, model: str, methods: Sequence[str], needs: Sequence[str],
          argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """The shared command line: `--official` (a checkout of `repository` holding the files
    `needs`), `--model`, `--methods`, `--repeats`, `--batch`, `--threads`, `--json`; bad values
    are one-line errors. Sets torch's threads."""
    import torch

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official", required=True, help=f"a checkout of {repository}")
    parser.add_argument("--model", default=model, help="bundled name or folder")
    parser.add_argument("--methods", nargs="+", default=list(methods), help="mmgen decoding specs")
    parser.add_argument("--repeats", type=int, default=10, help="rounds; each decodes --batch classes with every method")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    args.official = Path(args.official)
    missing = [name for name in needs if not (args.official / name).exists()]
    if missing:
        parser.error(f"--official {args.official}: not a {repository} checkout (no {', '.join(missing)})")
    if args.repeats < 1 or args.batch < 1 or args.threads < 1:
        parser.error("--repeats, --batch and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    return args


def timed_rounds(official: str, run_official: Callable[[list, int], Any], methods: Sequence[str],
                 run_mmgen: Callable[[str, list, int], Any], repeats: int, batch: int, classes: int) -> dict[str, list[float]]:
    """Seconds per round of the official run (named `official`) and of each mmgen method: round
    r decodes the same `batch` classes with the official code first, then each method, with r as
    the seed; round 0 warms up and is dropped."""
    times: dict[str, list[float]] = {official: [], **{m: [] for m in methods}}
    for repeat in range(repeats + 1):
        labels = [(repeat * batch + i) % classes for i in range(batch)]
        seconds = {}
        begun = time.perf_counter()
        run_official(labels, repeat)
        seconds[official] = time.perf_counter() - begun
        for method in methods:
            begun = time.perf_counter()
            run_mmgen(method, labels, repeat)
            seconds[method] = time.perf_counter() - begun
        if repeat:
            for key, value in seconds.items():
                times[key].append(value)
    return times


def ratio_rows(times: dict[str, list[float]], official: str, batch: int) -> list[dict]:
    """Per run: ms per image (median) and the medians of its paired ratios against the official
    run and against mmgen `ar` (None without an `ar` run)."""
    paired = lambda base, values: statistics.median(b / v for b, v in zip(base, values))
    return [{"method": key, "ms_per_image": 1e3 * statistics.median(values) / batch,
             "vs_official": paired(times[official], values),
             "vs_ar": paired(times["ar"], values) if "ar" in times else None} for key, values in times.items()]


def finish(report: dict, json_path: Optional[str]) -> int:
    """Print the rows and write the report (atomically) where asked; the exit status."""
    width = max(len(row["method"]) for row in report["rows"])
    for row in report["rows"]:
        print(f"{row['method']:>{width}}  {row['ms_per_image']:8.1f} ms/image  {row['vs_official']:.2f}x official"
              + (f"  {row['vs_ar']:.2f}x ar" if row["vs_ar"] is not None else ""))
    if json_path:
        write_atomic(json_path, (json.dumps(report, indent=2) + "\n").encode())
    return 0


def command(module: str, argv: Optional[Sequence[str]]) -> str:
    """The command line a report records."""
    return f"python -m benchmarks.{module} " + " ".join(sys.argv[1:] if argv is None else argv)


def commit_of(official: Path) -> Optional[str]:
    """The official checkout's commit, where it is a git checkout."""
    head = official / ".git" / "HEAD"
    return head.read_text().strip() if head.is_file() else None
