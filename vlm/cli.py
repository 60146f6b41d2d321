"""`mmgen generate text`: answer a prompt about images with a vision-language model.

    mmgen generate text --model FOLDER_OR_REPO --image cat.png --prompt "what is this?" [--decoding sjd] [--stream]

The pipeline (and transformers) is imported only when the command runs, so building the
`mmgen` parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys

from mmgen.cli import DTYPES, seed_arg


def register(commands, groups) -> None:
    text = groups["generate"].add_parser("text", help="answer a prompt about images (vision-language models)")
    text.add_argument("--model", required=True, metavar="FOLDER_OR_REPO",
                      help="a transformers image-text-to-text folder or Hugging Face repo id (LLaVA, Qwen2-VL / "
                           "Qwen2.5-VL, Idefics3)")
    text.add_argument("--image", nargs="*", default=[], metavar="PATH", help="image files the prompt is about (any number)")
    text.add_argument("--prompt", required=True, help="the question or instruction")
    text.add_argument("--decoding", default="ar", metavar="SPEC",
                      help="a token decoder: ar (default), sjd, sjd-coupled, lookup, gsd, draft (with --drafter), with "
                           "options as NAME:key=value,... (e.g. 'lookup:num_draft=8')")
    text.add_argument("--drafter", default=None, metavar="FOLDER_OR_REPO",
                      help="for --decoding draft: a smaller VLM of the same tokenizer and processor, drafting with the image")
    text.add_argument("--max-new-tokens", type=int, default=64, help="answer length at most (default 64)")
    text.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    text.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    text.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass (1: all)")
    text.add_argument("--seed", type=seed_arg, default=0, help="seed of the random generator, in [0, 2**63) (default 0)")
    text.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N, mps")
    text.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    text.add_argument("--stream", action="store_true", help="print the answer as tokens commit")
    text.set_defaults(run=generate_text)


def generate_text(args: argparse.Namespace) -> int:
    import torch
    from PIL import Image, UnidentifiedImageError

    from mmgen.decoding import resolve_decoder
    from mmgen.sampling import make_generator

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    images = []
    for path in args.image:  # every image is read before any model loads
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError) as error:
            raise ValueError(f"--image {path}: not a readable image ({error.__class__.__name__})") from None
    decoder = resolve_decoder(args.decoding)
    if args.drafter is not None:
        if not hasattr(decoder, "drafter"):
            raise ValueError(f"--drafter is for --decoding draft, not {args.decoding!r}")
        from transformers import AutoTokenizer

        # Tokenizers first (small files): a mismatch is an error before any weights load.
        if AutoTokenizer.from_pretrained(args.drafter).get_vocab() != AutoTokenizer.from_pretrained(args.model).get_vocab():
            raise ValueError(f"--drafter {args.drafter} has another tokenizer than --model {args.model}")
    import mmgen

    dtype = getattr(torch, args.dtype)
    pipe = mmgen.load_pipeline(args.model, device=args.device, dtype=dtype)
    if args.drafter is not None:
        decoder.drafter = mmgen.load_pipeline(args.drafter, device=args.device, dtype=dtype)
    call = dict(max_new_tokens=args.max_new_tokens, decoding=decoder, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p)
    if args.stream:
        for _, piece in pipe.stream(args.prompt, images or None, generator=make_generator(args.seed, args.device), **call):
            print(piece, end="", flush=True)
        print()
        return 0
    out = pipe(args.prompt, images or None, generator=make_generator(args.seed, args.device), **call)
    print(out.texts[0])
    print(json.dumps({"stats": out.stats.to_dict(), "tokens": out.lengths.tolist()}), file=sys.stderr)
    return 0
