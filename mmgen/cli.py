"""The `mmgen` command.

    mmgen generate image --model DIR --class-labels 1 2 3 --decoding sjd --seed 0 --out out/
    mmgen convert llamagen --gpt-checkpoint c2i_B_256.pt --vq-checkpoint vq_ds16_c2i.pt --out DIR

Modality pipelines are imported only when their subcommand runs; the core never depends on
them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmgen", description="Fast autoregressive generation on one decoding core.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate samples with a pipeline")
    modality = generate.add_subparsers(dest="modality", required=True)
    image = modality.add_parser("image", help="class-conditional image generation (LlamaGen)")
    image.add_argument("--model", required=True, help="pipeline folder written by save_pretrained / `mmgen convert`, or a Hugging Face repo id")
    image.add_argument("--class-labels", type=int, nargs="+", required=True, help="one image per class id")
    image.add_argument("--decoding", default="sjd", choices=["ar", "sjd"], help="decoder (sjd is lossless)")
    image.add_argument("--window", type=int, default=16, help="SJD window: tokens scored per forward")
    image.add_argument("--guidance-scale", type=float, default=4.0)
    image.add_argument("--cfg-interval", type=int, default=-1)
    image.add_argument("--temperature", type=float, default=1.0)
    image.add_argument("--top-k", type=int, default=2000)
    image.add_argument("--top-p", type=float, default=1.0)
    image.add_argument("--seed", type=int, default=0)
    image.add_argument("--device", default="cpu")
    image.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    image.add_argument("--out", required=True, help="output folder for the PNG files")
    image.add_argument("--no-progress", action="store_true")

    convert = commands.add_parser("convert", help="convert official checkpoints into a pipeline folder")
    family = convert.add_subparsers(dest="family", required=True)
    llamagen = family.add_parser("llamagen", help="official LlamaGen c2i GPT + VQ .pt files")
    llamagen.add_argument("--gpt-checkpoint", required=True)
    llamagen.add_argument("--vq-checkpoint", required=True)
    llamagen.add_argument("--gpt-model", default="GPT-B")
    llamagen.add_argument("--vq-model", default="VQ-16", choices=["VQ-16", "VQ-8"])
    llamagen.add_argument("--image-size", type=int, default=256)
    llamagen.add_argument("--codebook-size", type=int, default=16384)
    llamagen.add_argument("--codebook-embed-dim", type=int, default=8)
    llamagen.add_argument("--num-classes", type=int, default=1000)
    llamagen.add_argument("--out", required=True)
    return parser


def generate_image(args: argparse.Namespace) -> int:
    import torch

    from mmgen.decoding import Autoregressive, SpeculativeJacobi
    from mmgen.image_ar.llamagen import LlamaGenPipeline
    from mmgen.sampling import make_generator

    pipe = LlamaGenPipeline.from_pretrained(args.model, device=args.device, dtype=getattr(torch, DTYPES[args.dtype]))
    pipe.set_progress_bar_config(disable=args.no_progress)
    decoder = SpeculativeJacobi(window=args.window) if args.decoding == "sjd" else Autoregressive()
    output = pipe(
        args.class_labels,
        decoding=decoder,
        guidance_scale=args.guidance_scale,
        cfg_interval=args.cfg_interval,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=make_generator(args.seed, args.device),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (label, image) in enumerate(zip(args.class_labels, output.images)):
        path = out / f"{i:03d}_class{label}.png"
        tmp = path.with_name(path.name + ".tmp")
        image.save(tmp, format="PNG")
        os.replace(tmp, path)
        print(f"wrote {path}")
    print(output.stats.summary())
    print(json.dumps({"stats": output.stats.to_dict()}))
    return 0


def convert_llamagen(args: argparse.Namespace) -> int:
    from mmgen.image_ar.llamagen import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_official(
        args.gpt_checkpoint,
        args.vq_checkpoint,
        gpt_model=args.gpt_model,
        vq_model=args.vq_model,
        image_size=args.image_size,
        codebook_size=args.codebook_size,
        codebook_embed_dim=args.codebook_embed_dim,
        num_classes=args.num_classes,
    )
    pipe.save_pretrained(args.out)
    print(f"wrote {args.out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return generate_image(args)
        return convert_llamagen(args)
    except (ValueError, OSError) as error:
        print(f"mmgen: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
