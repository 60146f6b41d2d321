"""Wall time of one mmgen tree against another: bundled-model decodes and the decoder loop alone.

The two trees cannot share a process (one package name), so each round runs one process per
tree, alternating, and the report takes medians over rounds. A tree is a folder laid out as an
installed mmgen (`<tree>/mmgen` with `image_ar` inside it); make one from any commit with

    git worktree add /tmp/wt_old <commit>
    mkdir -p /tmp/pkg_old && cp -r /tmp/wt_old/mmgen /tmp/pkg_old/ && cp -r /tmp/wt_old/image_ar /tmp/pkg_old/mmgen/

then compare it with the working tree's layout (/tmp/pkg_new, made the same way):

    python -m benchmarks.core_versions --trees /tmp/pkg_old /tmp/pkg_new --rounds 6 --mode loop
    python -m benchmarks.core_versions --trees /tmp/pkg_old /tmp/pkg_new --rounds 5 --mode bundled

`loop` decodes 256 tokens with a stand-in model whose forward is one row gather (V = 512), so
the time per forward is the loop's own work (sampling, verification, bookkeeping); `bundled`
decodes the bundled models (same seeds in every tree; forwards and token checksums must agree).
Only APIs that every tree since the bundled models has are used (pipelines, `make_decoder`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def stand_in_model(vocab_size: int = 512):
    import torch

    from mmgen.modeling import DecodeState
    from mmgen.sampling import Logits

    class StandIn:
        """logits = table[previous token]: a TokenModel that costs one gather per forward."""

        def __init__(self):
            self.vocab_size = vocab_size
            self.table = torch.randn(vocab_size + 1, vocab_size, generator=torch.Generator().manual_seed(0)) * 3

        def _logits(self, tokens, guidance):
            rows = self.table[tokens]
            return Logits(rows, rows * 0.5 if guidance else None)

        def start(self, conditions, capacity, guidance):
            state = DecodeState(torch.zeros(len(conditions), dtype=torch.long), len(conditions), guidance, None)
            state.first_logits = self._logits(torch.full((len(conditions), 1), vocab_size), guidance)
            return state

        def forward(self, state, tokens):
            return self._logits(tokens, state.guidance)

        def commit(self, state, accepted):
            state.cache += accepted

        def rewind(self, state, num_generated):
            state.cache = num_generated.clone()

    return StandIn()


def loop_cases(repeats: int) -> dict:
    import torch

    from mmgen.decoding import make_decoder
    from mmgen.sampling import ConstantGuidance, SamplingConfig

    model, out = stand_in_model(), {}
    sampling = SamplingConfig(temperature=1.0, guidance=ConstantGuidance(2.0))
    for name, batch in [("ar", 1), ("sjd", 1), ("ar", 4), ("sjd", 4)]:
        times, result = [], None
        for r in range(repeats + 2):
            start = time.perf_counter()
            result = make_decoder(name).generate(model, torch.arange(batch), 256, sampling, torch.Generator().manual_seed(0))
            if r >= 2:
                times.append((time.perf_counter() - start) / result.stats.forwards)
        out[f"loop {name} b{batch} (ms/forward)"] = (1e3 * statistics.median(times), result.stats.forwards,
                                                      int(result.tokens.sum()))
    return out


def bundled_cases(repeats: int) -> dict:
    import torch

    from mmgen.decoding import CONTINUOUS_DECODERS, SCALE_DECODERS, make_decoder
    from mmgen.loading import resolve_model
    from mmgen.image_ar.llamagen import LlamaGenPipeline
    from mmgen.image_ar.mar import MARPipeline
    from mmgen.image_ar.var import VARPipeline

    load = lambda cls, name: cls.from_pretrained(resolve_model(name))
    lg, lg_small = load(LlamaGenPipeline, "emoji64"), load(LlamaGenPipeline, "emoji64-draft")
    var, var_small = load(VARPipeline, "var-emoji64"), load(VARPipeline, "var-emoji64-small")
    mar, mar_small = load(MARPipeline, "mar-emoji64"), load(MARPipeline, "mar-emoji64-draft")
    steps = mar.sampling_defaults["num_iter"]
    cases = {
        "emoji64 ar b1": (lg, [3], "ar"),
        "emoji64 sjd b1": (lg, [3], "sjd"),
        "emoji64 draft b1": (lg, [3], make_decoder("draft", drafter=lg_small)),
        "emoji64 entropy-switch(3.5) b1": (lg, [3], make_decoder("entropy-switch", small=lg_small, threshold=3.5)),
        "emoji64 ar b4": (lg, [3, 8, 20, 41], "ar"),
        "emoji64 sjd b4": (lg, [3, 8, 20, 41], "sjd"),
        "var-emoji64 ar b1": (var, [3], "ar"),
        "var-emoji64 code b1": (var, [3], make_decoder("code", SCALE_DECODERS, refiner=var_small)),
        "mar-emoji64 ar b1": (mar, [3], make_decoder("ar", CONTINUOUS_DECODERS, num_steps=steps)),
        "mar-emoji64 cspd b1": (mar, [3], make_decoder("cspd", CONTINUOUS_DECODERS, drafter=mar_small, num_draft=4,
                                                        num_steps=steps)),
    }
    out = {}
    with torch.no_grad():
        for name, (pipe, labels, decoding) in cases.items():
            pipe.set_progress_bar_config(disable=True)
            times, result = [], None
            for r in range(repeats + 1):
                start = time.perf_counter()
                result = pipe(labels, decoding=decoding, generator=torch.Generator().manual_seed(0), output_type="pt")
                if r:
                    times.append(time.perf_counter() - start)
            out[f"{name} (s)"] = (statistics.median(times), result.stats.forwards, float(result.tokens.float().sum()))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs=2, required=True, metavar=("OLD", "NEW"))
    parser.add_argument("--mode", choices=["loop", "bundled"], default="loop")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import torch

        import mmgen

        if not mmgen.__file__.startswith(os.path.abspath(os.environ["PYTHONPATH"])):
            raise SystemExit(f"imported {mmgen.__file__}, not the tree's")

        torch.set_num_threads(args.threads)
        print(json.dumps((loop_cases if args.mode == "loop" else bundled_cases)(args.repeats)))
        return
    runs = {tree: [] for tree in args.trees}
    for _ in range(args.rounds):
        for tree in args.trees:  # alternate, so drifts in machine load hit both
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": str(args.threads)}
            # Run as a script from a neutral folder: the repository root on sys.path would put its
            # own `mmgen/` before the tree's.
            command = [sys.executable, os.path.abspath(__file__), "--child", "--trees", *args.trees, "--mode",
                       args.mode, "--repeats", str(args.repeats), "--threads", str(args.threads)]
            child = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
            runs[tree].append(json.loads(child.stdout))
    old, new = (runs[t] for t in args.trees)
    print("| case | forwards | old | new | new / old | per-round ratios |")
    print("|---|---|---|---|---|---|")
    for case in old[0]:
        if {(r[case][1], r[case][2]) for r in old + new} != {(old[0][case][1], old[0][case][2])}:
            raise SystemExit(f"{case}: the trees decode differently (forwards or tokens)")
        a, b = [r[case][0] for r in old], [r[case][0] for r in new]
        ratios = sorted(y / x for x, y in zip(a, b))
        print(f"| {case} | {old[0][case][1]} | {statistics.median(a):.3f} | {statistics.median(b):.3f} | "
              f"{statistics.median(b) / statistics.median(a):.2f} | {ratios[0]:.2f}–{ratios[-1]:.2f} |")


if __name__ == "__main__":
    main()
