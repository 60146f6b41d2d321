"""Image subcommands of `mmgen`: generate image, convert llamagen, bench."""

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
    image.add_argument("--decoding", default="sjd", metavar="SPEC",
                       help="decoder: ar, sjd, sjd-coupled, draft (lossless) or gsd, lantern, lantern++ (lossy), "
                            "optionally with options, e.g. 'lantern:delta=0.2,window=8' or 'draft:drafter=emoji64-draft'")
    image.add_argument("--window", type=int, default=None, help="tokens scored per forward (Jacobi decoders; default 16)")
    image.add_argument("--guidance-scale", type=float, default=None, help="CFG scale (default: the model's)")
    image.add_argument("--cfg-interval", type=int, default=None, help="guide tokens t <= N + 1 only (default: the model's)")
    image.add_argument("--temperature", type=float, default=None, help="default: the model's")
    image.add_argument("--top-k", type=int, default=None, help="top-k filter (default: the model's)")
    image.add_argument("--top-p", type=float, default=None, help="default: the model's")
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
    if class_name == "LlamaGenText2ImagePipeline":
        from mmgen.image_ar.llamagen import LlamaGenText2ImagePipeline

        return LlamaGenText2ImagePipeline.from_pretrained(source, device=device, dtype=dtype)
    if is_janus or (prompts and class_name is None):
        from mmgen.image_ar.janus import JanusPipeline

        return JanusPipeline.from_pretrained(model, torch_dtype=dtype, device=device)
    return LlamaGenPipeline.from_pretrained(source, device=device, dtype=dtype)


def generate_image(args: argparse.Namespace) -> int:
    dtype = getattr(torch, args.dtype)
    pipe = load_image_pipeline(args.model, args.prompt is not None, args.device, dtype)
    pipe.set_progress_bar_config(disable=args.no_progress)
    window = {} if args.window is None else {"window": args.window}
    decoder = decoder_from_spec(args.decoding, args.model or DEFAULT_MODEL, args.device, dtype, **window)
    sampling = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.cfg_interval is not None:
        sampling["cfg_interval"] = args.cfg_interval
    generator = make_generator(args.seed, args.device)
    if args.prompt is not None:
        if isinstance(pipe, LlamaGenPipeline):
            raise ValueError("this model is class-conditional: use --class-labels, not --prompt")
        unsupported = sorted(set(_given(sampling)) - set(inspect.signature(pipe.__call__).parameters))
        if unsupported:
            raise ValueError(f"{type(pipe).__name__} has no option(s) {unsupported}")
        output = pipe(args.prompt, decoding=decoder, generator=generator, **_given(sampling))
        names = [f"{i:03d}_{_slug(prompt)}.png" for i, prompt in enumerate(args.prompt)]
    else:
        if not isinstance(pipe, LlamaGenPipeline):
            raise ValueError("this model is text-to-image: use --prompt, not --class-labels")
        labels = [pipe.class_index(label) for label in args.class_labels]
        output = pipe(labels, decoding=decoder, generator=generator, **sampling)
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
