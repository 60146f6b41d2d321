"""`mmgen calibrate MODEL`: a model's forward cost and tokens per forward by window width, measured
in whole decodes on this machine, and stored in the model folder. The adaptive window
(`mmgen.decoding.window`) reads the cost curve (`window_cost`) instead of its linear cost model,
and starts from the tokens per forward (`window_tokens`).

    mmgen calibrate emoji-vlm [--inputs 16] [--repeats 3] [--threads 1] [--no-write] [--compare 3]

Decodes the pipeline's own held-out inputs (`Pipeline.calibration_calls`: a VLM's held-out
questions, held-out speech texts, class ids spread over a class-conditional model's classes) at
batch 1 with fixed Jacobi windows of 1 (AR steps of the same loop), 2, 4, 8 and 16 tokens
(interleaved per input, order rotated per repeat, the first repeat dropped as a warm-up) and
times every decoding forward of the token model, so each width is measured where decoding runs
it (the cache as full as it is then, the model's own guidance). `--steps` times whole decoding
steps instead (`timed_steps`: proposal, forward, verification, commit); measured so, the curves
of the bundled models rose by up to 0.08 AR steps at two tokens and the adaptive window did
worse by the clock, so the shipped curves are of forwards. The curve is each width's median
time over width 1's; the tokens are the mean each decoding forward finalised (the prefill's
token aside), which depend on the model and its sampling, not on the machine.

The command stores both in the model folder (`--no-write`: print only), the curve under this
device type (on a CPU, with torch's thread count: "cpu:2"): under `mmgen_window_cost` and
`mmgen_window_tokens` in a transformers model's config.json (VLM, TTS), under `window_cost` and
`window_tokens` in an mmgen pipeline's model_index.json (LlamaGen). A curve is the machine's it
was measured on (CPUs differ several-fold in what a few extra tokens cost): measure yours.
`--compare N` then times whole decodes (see `compare`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from mmgen.decoding.window import WINDOW_COST_KEY, WINDOW_TOKENS_KEY, FixedWindow, window_cost_key
from mmgen.files import write_atomic

WIDTHS = (1, 2, 4, 8, 16)


@contextlib.contextmanager
def timed_forwards(model_class: type, times: dict[int, list[float]]) -> Iterator[None]:
    """Times every `forward` of `model_class`'s token models into `times[window width]`."""
    forward = model_class.forward

    def timed(self, state, tokens):
        start = time.perf_counter()
        logits = forward(self, state, tokens)
        times[tokens.shape[1]].append(time.perf_counter() - start)
        return logits

    model_class.forward = timed
    try:
        yield
    finally:
        model_class.forward = forward


@contextlib.contextmanager
def timed_steps(times: dict[int, list[float]]) -> Iterator[None]:
    """Times every step of fixed-window speculative decodes into `times[window width]`: from one
    forward's choice of width to the next's (the last: to the end of the loop), so a step is
    its proposal, forward, verification and commit, all a width costs the loop beside an
    autoregressive step of the same loop (width 1)."""
    choose, finish = FixedWindow.choose, FixedWindow.finish

    def lap(window: FixedWindow) -> None:
        now = time.perf_counter()
        if getattr(window, "lap_started", None) is not None:
            times[window.num_draft + 1].append(now - window.lap_started)
        window.lap_started = now

    def timed_choose(self):
        lap(self)
        return choose(self)

    def timed_finish(self, stats):
        lap(self)
        self.lap_started = None
        return finish(self, stats)

    FixedWindow.choose, FixedWindow.finish = timed_choose, timed_finish
    try:
        yield
    finally:
        FixedWindow.choose, FixedWindow.finish = choose, finish


def measure(pipe: Any, inputs: int, repeats: int, steps: bool = False) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Model forward times (with `steps`, decoding step times: `timed_steps`) by window width over
    `repeats` rounds of every input decoded at each width, and the tokens each decoding forward
    of the fixed windows finalised (warm-up round included: they do not depend on the clock)."""
    calls = pipe.calibration_calls(inputs)
    specs = [f"sjd:adapt=false,window={w}" for w in WIDTHS]  # width 1: AR steps of the same loop
    times: dict[int, list[float]] = defaultdict(list)
    warm_up: dict[int, list[float]] = defaultdict(list)
    tokens: dict[int, list[float]] = defaultdict(list)
    with contextlib.suppress(AttributeError):
        pipe.set_progress_bar_config(disable=True)
    model_class = type(pipe.token_model())
    for r in range(repeats + 1):
        for call in calls:
            timer = timed_steps(times if r else warm_up) if steps else timed_forwards(model_class, times if r else warm_up)
            with timer:
                for spec in specs[r % len(specs):] + specs[: r % len(specs)]:
                    stats = call(spec).stats
                    tokens[int(spec.rsplit("=", 1)[1])] += decoding_tokens(stats)
    return times, tokens


def decoding_tokens(stats: Any) -> list[float]:
    """The tokens each decoding forward of a batch-1 decode finalised: its stats' per-forward
    figures without the prefill's (forward 0 finalises token 0 whatever the window)."""
    return stats.accepted_per_forward[1:]


def mean_tokens(finalised: dict[int, list[float]]) -> dict[int, float]:
    """`window_tokens` from the tokens each decoding forward finalised, by window width (width 1,
    which finalises one by definition, left out)."""
    return {w: round(statistics.mean(t), 3) for w, t in sorted(finalised.items()) if w > 1 and t}


def use_window_cost(pipe: Any, window_cost: Optional[dict], window_tokens: Optional[dict] = None) -> None:
    """Make `pipe`'s later token models carry `window_cost` (None: the linear cost model) and
    `window_tokens` (None: none)."""
    if hasattr(pipe, "model") and hasattr(pipe.model, "config"):  # a transformers model: its config
        setattr(pipe.model.config, WINDOW_COST_KEY, window_cost)
        setattr(pipe.model.config, WINDOW_TOKENS_KEY, window_tokens)
    else:
        pipe.window_cost, pipe.window_tokens = window_cost, window_tokens


def compare(pipe: Any, inputs: int, repeats: int, window_cost: dict, window_tokens: Optional[dict] = None) -> dict[str, list[float]]:
    """Seconds per generated token over a round of the inputs: AR, and the adaptive window with
    the linear cost model and with `window_cost`, both starting from `window_tokens` (interleaved,
    order rotated per repeat, the first round dropped). Per token, since sampled outputs (speech)
    differ in length between methods."""
    calls = pipe.calibration_calls(inputs)
    carried = pipe.token_model()
    modes = {"ar": ("ar", None), "sjd, linear cost": ("sjd", None), "sjd, measured cost": ("sjd", window_cost)}
    per_token: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    for r in range(repeats + 1):
        for name in names[r % 3:] + names[: r % 3]:
            spec, cost = modes[name]
            use_window_cost(pipe, cost, window_tokens)
            start, tokens = time.perf_counter(), 0
            for call in calls:
                tokens += call(spec).stats.tokens
            if r:
                per_token[name].append((time.perf_counter() - start) / tokens)
    use_window_cost(pipe, carried.window_cost, carried.window_tokens)
    return per_token


def write_measured(folder: Path, key: str, curve: dict[int, float], tokens: dict[int, float]) -> Path:
    """Store `curve` under `key` (`window_cost_key`) and `tokens` (in place of any before) in the
    model folder (see the module docstring)."""
    index = folder / "model_index.json"
    on_index = index.is_file()
    path = index if on_index else folder / "config.json"
    cost_name, tokens_name = ("window_cost", "window_tokens") if on_index else (WINDOW_COST_KEY, WINDOW_TOKENS_KEY)
    data = json.loads(path.read_text())
    section = data.setdefault("config", {}) if on_index else data
    section.setdefault(cost_name, {})[key] = {str(w): c for w, c in sorted(curve.items())}
    section[tokens_name] = {str(w): t for w, t in sorted(tokens.items())}
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=on_index) + "\n").encode())
    return path


def register(commands, groups) -> None:
    calibrate = commands.add_parser(
        "calibrate", help="measure a model's forward cost by window width on this machine and store it in its folder",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    calibrate.add_argument("model", help="a bundled model or a model folder (token models: LlamaGen, VLMs, codec TTS)")
    calibrate.add_argument("--inputs", type=int, default=16, help="held-out inputs decoded per width and repeat")
    calibrate.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    calibrate.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    calibrate.add_argument("--device", default="cpu")
    calibrate.add_argument("--steps", action="store_true", help="time whole decoding steps, not model forwards alone")
    calibrate.add_argument("--no-write", action="store_true", help="print the figures; leave the model folder as it is")
    calibrate.add_argument("--compare", type=int, default=0, metavar="REPEATS",
                           help="then time whole decodes: AR and the adaptive window with either cost, interleaved")
    calibrate.add_argument("--json", default=None, help="also write the figures here (JSON)")
    calibrate.set_defaults(run=run_calibrate)


def check_counts(args: argparse.Namespace) -> None:
    """One-line errors for counts that cannot measure anything, before any model loads."""
    for flag in ("inputs", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.compare < 0 or (args.threads is not None and args.threads < 1):
        raise ValueError("--compare must be >= 0 and --threads >= 1")


@torch.no_grad()
def run_calibrate(args: argparse.Namespace) -> int:
    check_counts(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmgen.loading import load_pipeline, resolve_model

    pipe = load_pipeline(args.model, args.device, torch.float32)
    times, finalised = measure(pipe, args.inputs, args.repeats, steps=args.steps)
    base = statistics.median(times[1])
    curve = {w: round(statistics.median(times[w]) / base, 3) for w in WIDTHS if times.get(w)}
    tokens = mean_tokens(finalised)
    print(f"{args.model} on {args.device}, {torch.get_num_threads()} threads, {args.inputs} inputs x {args.repeats} repeats")
    print(f"| window | {'steps' if args.steps else 'forwards'} timed | ms each (IQR) | vs width 1 | tokens per forward |")
    print("|---|---|---|---|---|")
    for w in curve:
        q = statistics.quantiles(times[w], n=4) if len(times[w]) > 1 else [times[w][0]] * 3
        print(f"| {w} | {len(times[w])} | {statistics.median(times[w]) * 1e3:.2f} ({q[0] * 1e3:.2f}-{q[2] * 1e3:.2f}) "
              f"| {curve[w]:.3f} | {tokens.get(w, 1.0):.3f} |")
    key = window_cost_key(torch.device(args.device).type)
    result = {"model": args.model, "device": args.device, "threads": torch.get_num_threads(), "curve": curve,
              "tokens": tokens, "forwards": {w: len(times[w]) for w in curve}}
    if args.compare:
        per_token = compare(pipe, args.inputs, args.compare, {key: curve}, tokens)
        ar = statistics.median(per_token["ar"])
        print(f"\nwhole decodes of the {args.inputs} inputs, medians of {args.compare} (min-max)")
        print("| method | ms per token | vs AR |")
        print("|---|---|---|")
        for name, values in per_token.items():
            print(f"| {name} | {statistics.median(values) * 1e3:.2f} ({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}) "
                  f"| {ar / statistics.median(values):.2f}x |")
        result["seconds_per_token"] = per_token
    if not args.no_write:
        print(f"wrote {write_measured(Path(resolve_model(args.model)), key, curve, tokens)}")
    if args.json:
        write_atomic(args.json, (json.dumps(result, indent=2) + "\n").encode())
    return 0
