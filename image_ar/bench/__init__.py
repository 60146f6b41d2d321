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

`mmgen bench image` (its options are `mmgen.image_ar.cli.add_bench_arguments`) imports this
package when the command runs; `llamagen`, `var` and `mar` hold each kind's rows.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmgen import registry
from mmgen.benchmarking import environment, progress_bar, write_report
from mmgen.hub import read_json
from mmgen.loading import resolve_model


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
            from mmgen.image_ar.bench.var import run_var

            run_var(args, report, device, dtype, progress)
        elif family == "mar":
            from mmgen.image_ar.bench.mar import run_mar

            run_mar(args, report, device, dtype, progress)
        elif args.random_weights:
            from mmgen.image_ar.bench.llamagen import forward_cost_rows

            report["forward_cost"] = forward_cost_rows(args.random_weights, args.windows, args.batch_sizes, device, dtype,
                                                       args.guidance_scale != 1, args.repeats, args.warmup, progress)
        else:
            from mmgen.image_ar.bench.common import quality_labels
            from mmgen.image_ar.bench.llamagen import quality_rows, speed_rows
            from mmgen.image_ar.llamagen import LlamaGenPipeline

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

