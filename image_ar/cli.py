"""Image subcommands of `mmgen`: generate image, convert llamagen / var / mar, bench."""

from __future__ import annotations

import argparse
import inspect
import json
import os
from pathlib import Path

import torch

from mmgen.sampling import make_generator

from mmgen.image_ar import bench
from mmgen.image_ar.bundled import DEFAULT_MODEL, decoder_from_spec, resolve_model
from mmgen.image_ar.llamagen import LlamaGenPipeline

DTYPES = ("float32", "bfloat16", "float16")


def register(commands, groups) -> None:
    image = groups["generate"].add_parser("image", help="image generation: class-conditional or text-to-image")
    image.add_argument("--model", default=None, help=f"a bundled model name (default: {DEFAULT_MODEL}), a pipeline folder "
                       "written by save_pretrained / `mmgen convert` (LlamaGen c2i or t2i), or a Janus-Pro transformers "
                       "folder / Hugging Face repo id (with --prompt)")
    condition = image.add_mutually_exclusive_group(required=True)
    condition.add_argument("--class-labels", nargs="+", help="one image per class: class ids or class names")
    condition.add_argument("--prompt", nargs="+", help="one image per prompt (text-to-image models)")
    image.add_argument("--decoding", default=None, metavar="SPEC",
                       help="decoder: ar, sjd, sjd-coupled, draft (lossless) or gsd, lantern, lantern++, entropy-switch "
                            "(lossy), optionally with options, e.g. 'lantern:delta=0.2,window=8' or "
                            "'draft:drafter=emoji64-draft'; for VAR models ar or code (e.g. 'code:draft_steps=4'). "
                            "Default: sjd, for VAR ar")
    image.add_argument("--window", type=int, default=None, help="tokens scored per forward (Jacobi decoders; default 16)")
    image.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: the model's)")
    image.add_argument("--cfg-interval", type=int, default=None, help="guide tokens t <= N + 1 only (default: the model's)")
    image.add_argument("--temperature", type=float, default=None, help="default: the model's")
    image.add_argument("--top-k", type=int, default=None, help="top-k filter (default: the model's)")
    image.add_argument("--top-p", type=float, default=None, help="default: the model's")
    image.add_argument("--preset", default=None, choices=["fid", "demo"], help="VAR: the official sampler settings")
    image.add_argument("--more-smooth", action="store_true", help="VAR: Gumbel-softmax soft maps (official visualisation option)")
    image.add_argument("--pruning", default=None, metavar="STEP=KEEP,...[@START:STOP]",
                       help="VAR: FastVAR cached token pruning, keep ratios per scale step and optionally the block "
                            "range, e.g. '4=0.6,5=0.5' or '5=0.5@0:' "
                            "(negative steps count from the last: --pruning=-2=0.6,-1=0.5)")
    image.add_argument("--pruning-layers", type=int, nargs=2, default=None, metavar=("START", "STOP"),
                       help="VAR: the block range that prunes (default 3 -4, FastVAR's)")
    image.add_argument("--num-iter", type=int, default=None, help="MAR: masked steps (default: the model's, officially 64)")
    image.add_argument("--cfg-schedule", default=None, choices=["linear", "constant"], help="MAR: guidance schedule")
    image.add_argument("--seed", type=int, default=0)
    image.add_argument("--device", default="cpu")
    image.add_argument("--dtype", default="float32", choices=DTYPES)
    image.add_argument("--out", required=True, help="output folder for the PNG files")
    image.add_argument("--no-progress", action="store_true")
    image.set_defaults(run=generate_image)

    llamagen = groups["convert"].add_parser("llamagen", help="official LlamaGen c2i or t2i GPT + VQ .pt files")
    llamagen.add_argument("--gpt-checkpoint", required=True)
    llamagen.add_argument("--vq-checkpoint", required=True)
    llamagen.add_argument("--t2i", action="store_true", help="a text-to-image GPT (with a T5 caption encoder)")
    llamagen.add_argument("--text-encoder", default="google/flan-t5-xl", help="with --t2i: T5 repo id or folder (and its tokenizer)")
    llamagen.add_argument("--gpt-model", default=None, help="official preset (default: GPT-B, with --t2i GPT-XL)")
    llamagen.add_argument("--vq-model", default="VQ-16", choices=["VQ-16", "VQ-8"])
    llamagen.add_argument("--image-size", type=int, default=None, help="default: 256, with --t2i 512")
    llamagen.add_argument("--codebook-size", type=int, default=16384)
    llamagen.add_argument("--codebook-embed-dim", type=int, default=8)
    llamagen.add_argument("--num-classes", type=int, default=1000)
    llamagen.add_argument("--out", required=True)
    llamagen.set_defaults(run=convert_llamagen)

    var = groups["convert"].add_parser("var", help="official VAR .pth files (var_dN.pth + vae_ch160v4096z32.pth)")
    var.add_argument("--var-checkpoint", required=True)
    var.add_argument("--vae-checkpoint", required=True)
    var.add_argument("--depth", type=int, default=16, choices=[16, 20, 24, 30, 36], help="36 is the 512px model")
    var.add_argument("--out", required=True)
    var.set_defaults(run=convert_var)

    mar = groups["convert"].add_parser("mar", help="official MAR checkpoint-last.pth (its model_ema) + kl16.ckpt")
    mar.add_argument("--mar-checkpoint", required=True)
    mar.add_argument("--vae-checkpoint", required=True)
    mar.add_argument("--model", default="mar_base", choices=["mar_base", "mar_large", "mar_huge"])
    mar.add_argument("--out", required=True)
    mar.set_defaults(run=convert_mar)

    bench_parser = commands.add_parser("bench", help="benchmark decoding methods against autoregressive decoding")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=lambda args: print(bench.run(args)) or 0)


def load_image_pipeline(model, prompts: bool, device: str, dtype: torch.dtype):
    """The pipeline a --model names: mmgen folders say their class in model_index.json;
    transformers folders (config.json of model_type "janus") and, with --prompt, Hub ids are
    Janus-Pro checkpoints."""
    source = Path(resolve_model(model or DEFAULT_MODEL))
    index, config = source / "model_index.json", source / "config.json"
    class_name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    is_janus = config.is_file() and json.loads(config.read_text()).get("model_type") == "janus"
    if class_name == "MARPipeline":
        from mmgen.image_ar.mar import MARPipeline

        return MARPipeline.from_pretrained(source, device=device, dtype=dtype)
    if class_name == "VARPipeline":
        from mmgen.image_ar.var import VARPipeline

        return VARPipeline.from_pretrained(source, device=device, dtype=dtype)
    if class_name == "LlamaGenText2ImagePipeline":
        from mmgen.image_ar.llamagen import LlamaGenText2ImagePipeline

        return LlamaGenText2ImagePipeline.from_pretrained(source, device=device, dtype=dtype)
    if is_janus or (prompts and class_name is None):
        from mmgen.image_ar.janus import JanusPipeline

        return JanusPipeline.from_pretrained(model, torch_dtype=dtype, device=device)
    return LlamaGenPipeline.from_pretrained(source, device=device, dtype=dtype)


def generate_image(args: argparse.Namespace) -> int:
    from mmgen.image_ar.mar import MARPipeline
    from mmgen.image_ar.var import VARPipeline

    dtype = getattr(torch, args.dtype)
    pipe = load_image_pipeline(args.model, args.prompt is not None, args.device, dtype)
    pipe.set_progress_bar_config(disable=args.no_progress)
    is_var, is_mar = isinstance(pipe, VARPipeline), isinstance(pipe, MARPipeline)
    overrides = {} if args.window is None else {"window": args.window}
    spec = args.decoding or ("ar" if is_var or is_mar else "sjd")
    family = "scale" if is_var else "continuous" if is_mar else "token"
    if is_mar:  # the decoder object carries the step count: the model's default unless --num-iter
        overrides["num_steps"] = pipe.sampling_defaults["num_iter"] if args.num_iter is None else args.num_iter
    decoder = decoder_from_spec(spec, args.model or DEFAULT_MODEL, args.device, dtype, family=family, **overrides)
    sampling = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.cfg_interval is not None:
        sampling["cfg_interval"] = args.cfg_interval
    var_options = dict(preset=args.preset, more_smooth=args.more_smooth or None, pruning=parse_pruning(args.pruning, args.pruning_layers))
    if not is_var and any(v is not None for v in var_options.values()):
        raise ValueError("--preset, --more-smooth and --pruning are VAR options; this model is not a VAR model")
    generator = make_generator(args.seed, args.device)
    if args.prompt is not None:
        if isinstance(pipe, (LlamaGenPipeline, VARPipeline, MARPipeline)):
            raise ValueError("this model is class-conditional: use --class-labels, not --prompt")
        unsupported = sorted(set(_given(sampling)) - set(inspect.signature(pipe.__call__).parameters))
        if unsupported:
            raise ValueError(f"{type(pipe).__name__} has no option(s) {unsupported}")
        output = pipe(args.prompt, decoding=decoder, generator=generator, **_given(sampling))
        names = [f"{i:03d}_{_slug(prompt)}.png" for i, prompt in enumerate(args.prompt)]
    else:
        if not isinstance(pipe, (LlamaGenPipeline, VARPipeline, MARPipeline)):
            raise ValueError("this model is text-to-image: use --prompt, not --class-labels")
        labels = [pipe.class_index(label) for label in args.class_labels]
        if is_var and args.cfg_interval is not None:
            raise ValueError("--cfg-interval is a LlamaGen option; VAR ramps guidance over the scales")
        options = {**sampling, **(var_options if is_var else {}), "num_iter": args.num_iter, "cfg_schedule": args.cfg_schedule}
        unsupported = sorted(set(_given(options)) - set(inspect.signature(pipe.__call__).parameters))
        if unsupported:
            raise ValueError(f"{type(pipe).__name__} has no option(s) {unsupported}")
        output = pipe(labels, decoding=decoder, generator=generator, **_given(options))
        names = [f"{i:03d}_class{label}.png" for i, label in enumerate(labels)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, image in zip(names, output.images):
        path = out / name
        tmp = path.with_name(path.name + ".tmp")
        image.save(tmp, format="PNG")
        os.replace(tmp, path)
        print(f"wrote {path}")
    print(output.stats.summary())
    print(json.dumps({"stats": output.stats.to_dict()}))
    return 0


def parse_pruning(spec, layers):
    """`--pruning "4=0.6,5=0.5[@START:STOP]"` (+ `--pruning-layers`) -> a CachedTokenPruning, or None."""
    from dataclasses import replace

    from mmgen.decoding import CachedTokenPruning

    if spec is None:
        if layers is not None:
            raise ValueError("--pruning-layers needs --pruning")
        return None
    try:
        pruning = CachedTokenPruning.from_spec(spec)
    except ValueError as error:
        raise ValueError(f"bad --pruning item: {error}") from None
    return replace(pruning, layers=tuple(layers)) if layers is not None else pruning


def _given(options: dict) -> dict:
    return {k: v for k, v in options.items() if v is not None}


def _slug(text: str, limit: int = 40) -> str:
    """A file-name-safe stem from a prompt."""
    return "".join(c if c.isalnum() else "-" for c in text.lower())[:limit].strip("-") or "prompt"


def convert_llamagen(args: argparse.Namespace) -> int:
    common = dict(gpt_model=args.gpt_model or ("GPT-XL" if args.t2i else "GPT-B"), vq_model=args.vq_model,
                  image_size=args.image_size or (512 if args.t2i else 256), codebook_size=args.codebook_size,
                  codebook_embed_dim=args.codebook_embed_dim)
    if args.t2i:
        from mmgen.image_ar.llamagen import LlamaGenText2ImagePipeline

        pipe = LlamaGenText2ImagePipeline.from_official(args.gpt_checkpoint, args.vq_checkpoint, args.text_encoder, **common)
    else:
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
