"""Image subcommands of `mmgen`: generate image, bench; and what `mmgen convert llamagen / var /
mar` run (those subcommands are built from the families' records in `mmgen.image_ar`).

Building the parser imports no pipeline and no benchmark code: each subcommand imports what it
runs when it runs (`mmgen bench image` its harness, `mmgen.image_ar.bench`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from mmgen.cli import DTYPES, add_family_flags, add_json_flag, report, seed_arg
from mmgen.files import write_atomic

from mmgen.image_ar.bundled import BUNDLED_MODELS, DEFAULT_MODEL
from mmgen.image_ar.generation import (
    ImageOptions,
    check_targets,
    compile_companions,
    image_file_names,
    load_image_pipeline,
    png_bytes,
    prepare_call,
)


def register(commands, groups) -> None:
    image = groups["generate"].add_parser(
        "image", help="image generation: class-conditional or text-to-image",
        description="One PNG per class label or prompt, named <position>_<class or prompt>_<model>_seed<seed>_<decoding "
                    "and options>.png; an existing file is an error unless --overwrite.")
    image.add_argument("--model", default=None, metavar="NAME_OR_PATH",
                       help=f"a bundled model ({', '.join(BUNDLED_MODELS)}; default: {DEFAULT_MODEL}), a pipeline folder "
                            "written by save_pretrained or `mmgen convert` (LlamaGen class-conditional or text-to-image, "
                            "VAR, MAR), or a Janus-Pro transformers folder or Hugging Face repo id (with --prompt). "
                            "Names starting with ./ ../ / or ~ are always folders")
    condition = image.add_mutually_exclusive_group(required=True)
    condition.add_argument("--class-labels", nargs="+", help="one image per class: class ids or class names")
    condition.add_argument("--prompt", nargs="+", help="one image per prompt (text-to-image models)")
    image.add_argument("--decoding", default=None, metavar="SPEC", help=decoding_help())
    image.add_argument("--window", type=int, default=None, help="tokens scored per forward (Jacobi decoders; default 16)")
    image.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: the model's)")
    image.add_argument("--temperature", type=float, default=None, help="default: the model's")
    image.add_argument("--top-k", type=int, default=None, help="top-k filter (default: the model's)")
    image.add_argument("--top-p", type=float, default=None, help="default: the model's")
    image.add_argument("--seed", type=seed_arg, default=0, help="seed of the random generator, in [0, 2**63) (default 0): "
                       "the same seed, model and options give the same images")
    image.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N, mps")
    image.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    image.add_argument("--compile", action="store_true", help="LlamaGen models: run the decode and verify steps under "
                       "torch.compile (CUDA graphs on CUDA), and those of a LlamaGen companion (draft, entropy-switch); "
                       "each window width compiles once, on its first step (seconds on a GPU, tens of seconds on a CPU)")
    image.add_argument("--out", required=True, help="output folder for the PNG files (created if missing)")
    image.add_argument("--overwrite", action="store_true", help="replace existing files of the same names (default: "
                       "an existing file is an error, before any work)")
    image.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    # The options only some families take (LlamaGen's --cfg-interval, VAR's --pruning, MAR's --num-iter,
    # a plugin's own): a flag each, from the families' records (`mmgen.image_ar`, `registry.family_options`);
    # last, so that none takes a flag above.
    add_family_flags(image, "image")
    add_json_flag(image)
    image.set_defaults(run=generate_image)

    bench = groups["bench"].add_parser("image", help="image models: decoding methods against autoregressive decoding, "
                                       "speed and quality", formatter_class=DefaultsHelpFormatter)
    add_bench_arguments(bench)
    bench.set_defaults(run=run_bench)


def decoding_help() -> str:
    """`--decoding`'s help, listing every registered decoder of each model family."""
    from mmgen.decoding import CONTINUOUS_DECODERS, DECODERS, SCALE_DECODERS

    companions = "draft, entropy-switch, collaborative and cspd"  # the bundled families' `Pipeline.companions`
    return (f"decoder, optionally with options as NAME:key=value,...: for LlamaGen and Janus models {', '.join(DECODERS)} "
            "(default: sjd, lossless speculative Jacobi decoding; 'sjd-8' is 'sjd:window=8'; e.g. "
            f"'lantern:delta=0.2,window=8', 'draft:drafter=emoji64-draft'); for VAR models {', '.join(SCALE_DECODERS)} "
            f"(default: ar; collaborative is CoDe, e.g. 'collaborative:large_steps=4'); for MAR models {', '.join(CONTINUOUS_DECODERS)} "
            f"(default: ar; cspd is continuous speculative decoding, e.g. 'cspd:num_draft=4'). {companions} use the "
            "bundled companion of a bundled model unless the spec names one. A setting given both here and as a flag "
            "(--window, --num-iter) must agree")


def generate_image(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    prompts = args.prompt is not None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder")
    pipe = load_image_pipeline(args.model, args.device, dtype)
    pipe.set_progress_bar_config(disable=args.no_progress)
    if args.compile:
        pipe.compile()
    options = ImageOptions.from_namespace(args)
    call = prepare_call(pipe, args.model or DEFAULT_MODEL, options, args.device, dtype, prompts=prompts)
    if args.compile:
        compile_companions(pipe, call.decoder)
    inputs = args.prompt if prompts else [pipe.class_index(label) for label in args.class_labels]
    paths = [out / name for name in image_file_names(inputs, args.model or DEFAULT_MODEL, args.seed, options, call.spec, prompts)]
    check_targets(paths, args.overwrite)
    output = call(inputs, args.seed, args.device)
    out.mkdir(parents=True, exist_ok=True)
    for path, image in zip(paths, output.images):
        write_atomic(path, png_bytes(image))
    report(args, [*(f"wrote {path}" for path in paths), output.stats.summary()],
           {"files": [str(path) for path in paths], "stats": output.stats.to_dict()})
    return 0


def convert_llamagen(args: argparse.Namespace) -> int:
    common = dict(gpt_model=args.gpt_model or ("GPT-XL" if args.t2i else "GPT-B"), vq_model=args.vq_model,
                  image_size=args.image_size or (512 if args.t2i else 256), codebook_size=args.codebook_size,
                  codebook_embed_dim=args.codebook_embed_dim)
    if args.t2i:
        from mmgen.image_ar.llamagen import LlamaGenText2ImagePipeline

        pipe = LlamaGenText2ImagePipeline.from_official(args.gpt_checkpoint, args.vq_checkpoint, args.text_encoder, **common)
    else:
        from mmgen.image_ar.llamagen import LlamaGenPipeline

        pipe = LlamaGenPipeline.from_official(args.gpt_checkpoint, args.vq_checkpoint, num_classes=args.num_classes, **common)
    pipe.save_pretrained(args.out)
    print(f"wrote {args.out}")
    return 0


def convert_var(args: argparse.Namespace) -> int:
    from mmgen.image_ar.var import VARPipeline

    pipe = VARPipeline.from_official(args.var_checkpoint, args.vae_checkpoint, depth=args.depth,
                                     image_size=512 if args.depth == 36 else 256)
    pipe.save_pretrained(args.out)
    print(f"wrote {args.out}")
    return 0


def convert_mar(args: argparse.Namespace) -> int:
    from mmgen.image_ar.mar import MARPipeline

    MARPipeline.from_official(args.mar_checkpoint, args.vae_checkpoint, model=args.model).save_pretrained(args.out)
    print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------------------------
# mmgen bench: the options here, the harness in the repository's benchmarks/ (not installed)
# --------------------------------------------------------------------------------------------


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, except where it is None (the help says what
    happens then) or a flag's False."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """`mmgen bench`'s options (its parser uses `DefaultsHelpFormatter`, which shows the defaults)."""
    parser.add_argument("--models", nargs="+", default=["emoji64"], help="bundled model names or pipeline folders, "
                        "all LlamaGen, all VAR or all MAR")
    from mmgen.decoding import CONTINUOUS_DECODERS, DECODERS, SCALE_DECODERS

    parser.add_argument("--methods", nargs="+", default=["ar", "sjd-8", "sjd-16"],
                        help=f"decoding specs: a shortcut ({', '.join(DECODERS)}) with optional options, e.g. sjd:window=8 "
                             "(or sjd-8), lantern:delta=0.2, draft:drafter=emoji64-draft; VAR models "
                             f"({', '.join(SCALE_DECODERS)}): ar, collaborative:large_steps=N[,small=NAME]; MAR models "
                             f"({', '.join(CONTINUOUS_DECODERS)}): ar[:num_steps=N], "
                             "cspd:num_draft=N,prefill_ratio=R,flatten=F[,drafter=NAME]")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4], help="speed rows per batch size (none: skip)")
    parser.add_argument("--repeats", type=int, default=5, help="timed decodes per speed row (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed decodes before each speed row")
    parser.add_argument("--guidance-scale", type=float, help="CFG scale (default: each model's own; random weights: CFG on)")
    parser.add_argument("--temperature", type=float, help="default: each model's own")
    parser.add_argument("--top-k", type=int, help="default: each model's own")
    parser.add_argument("--top-p", type=float, help="default: each model's own")
    parser.add_argument("--quality-per-class", type=int, default=2, help="samples per class for the quality proxies (0: skip)")
    parser.add_argument("--quality-classes", type=int, default=0, help="quality samples of the first N classes only (0: all)")
    parser.add_argument("--quality-batch-size", type=int, default=32, help="images per decode of the quality samples")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the quality samples, in [0, 2**63)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:N, mps")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype")
    parser.add_argument("--random-weights", metavar="PRESET", help="time an official preset with random weights instead: "
                        "a LlamaGen preset (e.g. GPT-B: verify-window cost) or var-d16 ... var-d36 (whole decodes)")
    parser.add_argument("--prunings", nargs="+", default=["none"], metavar="SPEC",
                        help="VAR: FastVAR pruning settings crossed with --methods: none or STEP=KEEP,...[@START:STOP] "
                             "(scale steps from 0, block range), e.g. '8=0.6,9=0.5@3:-4'")
    parser.add_argument("--small-depth", type=int, default=16, help="with --random-weights var-dN: the depth of CoDe's "
                        "small model")
    parser.add_argument("--refiner-depth", type=int, help=argparse.SUPPRESS)  # --small-depth's old name, until 0.3
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8, 16], help="with --random-weights")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.add_argument("--markdown", help="write the report as Markdown here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run_bench(args: argparse.Namespace) -> int:
    from mmgen.image_ar.bench import run

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    print(run(args))
    return 0
