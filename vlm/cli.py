"""`mmgen generate text`: answer a prompt about images (or videos) with a vision-language model.

    mmgen generate text --image cat.png --prompt "what is this emoji?" [--model emoji-vlm] [--decoding draft]
        [--dropping fastv --keep-ratio 0.25] [--stream]
    mmgen generate text --model Qwen/Qwen2.5-VL-3B-Instruct --video clip.mp4 --prompt "what happens?"

The default model is the bundled `emoji-vlm` (offline); `--decoding draft` pairs it with the
bundled `emoji-vlm-draft`. Any transformers image-text-to-text folder or Hub repo of a family
mmgen serves (`mmgen.vlm.MODEL_TYPES`: LLaVA, Qwen-VL, Gemma3, PaliGemma, InternVL, ...) works the same way.

The pipeline (and transformers) is imported only when the command runs, so building the
`mmgen` parser stays cheap.
"""

from __future__ import annotations

import argparse
from typing import Optional

from mmgen.cli import DTYPES, add_family_flags, add_json_flag, family_flags, report, seed_arg

from mmgen.vlm.images import read_image  # noqa: F401  (re-exported: the demo reads images through here)

#: The bundled model `mmgen generate text` answers with when no --model is given.
DEFAULT_MODEL = "emoji-vlm"


def register(commands, groups) -> None:
    from mmgen.vlm.bench import register as register_bench

    register_bench(groups)
    text = groups["generate"].add_parser("text", help="answer a prompt about images (vision-language models)")
    text.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_OR_FOLDER",
                      help=f"a bundled model (default {DEFAULT_MODEL}), a transformers image-text-to-text folder or a "
                           "Hugging Face repo id (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Qwen2/2.5/3-VL, Idefics3, SmolVLM, "
                           "Gemma3, PaliGemma, InternVL, Mistral3, AyaVision)")
    text.add_argument("--image", nargs="*", action="extend", default=[], metavar="PATH",
                      help="image files the prompt is about (any number; repeatable)")
    text.add_argument("--video", nargs="*", action="extend", default=[], metavar="PATH",
                      help="video files the prompt is about, after its images (any number; repeatable), decoded through "
                           "PyAV; for Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA-OneVision models")
    text.add_argument("--prompt", required=True, help="the question or instruction")
    text.add_argument("--decoding", default="ar", metavar="SPEC",
                      help="a token decoder: ar (default), sjd, sjd-coupled, lookup, gsd, draft (the model's bundled "
                           "drafter, or --drafter), with options as NAME:key=value,... (e.g. 'lookup:num_draft=8')")
    text.add_argument("--drafter", default=None, metavar="NAME_OR_FOLDER",
                      help="for --decoding draft: a smaller VLM of the same tokenizer and processor, drafting with the image")
    text.add_argument("--dropping", default=None, metavar="SPEC",
                      help="visual token dropping in the model (lossy): fastv, visionzip or mustdrop, with options as "
                           "NAME:key=value,... (e.g. 'fastv:layer=2')")
    text.add_argument("--keep-ratio", type=float, default=None, metavar="R",
                      help="fraction of visual tokens the dropping policy keeps (implies --dropping fastv when none is given)")
    text.add_argument("--draft-dropping", default=None, metavar="SPEC",
                      help="dropping for the drafter only (SpecVLM): cheaper drafts, output still exact")
    text.add_argument("--max-new-tokens", type=int, default=64, help="answer length at most (default 64)")
    text.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    text.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    text.add_argument("--top-p", type=float, default=1.0, help="sampling: nucleus mass (1: all)")
    text.add_argument("--seed", type=seed_arg, default=0, help="seed of the random generator, in [0, 2**63) (default 0)")
    text.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N, mps")
    text.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    text.add_argument("--stream", action="store_true", help="print the answer as tokens commit")
    add_family_flags(text, "text")  # each family's own options, from its record
    add_json_flag(text)
    text.set_defaults(run=generate_text)


def generate_text(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from mmgen.decoding import parse_decoding
    from mmgen.loading import decoder_from_spec, load_pipeline, pipeline_class_of
    from mmgen.sampling import make_generator

    from mmgen.vlm.pipeline import check_budget, check_sampling

    if args.stream and args.json:
        raise ValueError("--stream prints the answer as it comes, --json one record at the end: give one of them")
    check_budget(args.max_new_tokens)  # every setting is checked before any model loads
    check_sampling(args.temperature, args.top_k, args.top_p)
    dropping = dropping_from_flags(args.dropping, args.keep_ratio)
    draft_dropping = dropping_from_flags(args.draft_dropping, None)
    images = [read_image(path) for path in args.image]  # every input is checked before any model loads
    cls = pipeline_class_of(args.model)
    from mmgen.vlm.pipeline import VLMPipeline

    if not issubclass(cls, VLMPipeline):
        raise ValueError(f"--model {args.model} holds a {cls.__name__}, not a vision-language model")
    videos = read_videos(args.model, args.video)
    options = family_flags(args, "text", args.model, cls)
    if args.drafter is not None and parse_decoding(args.decoding)[0] not in cls.companions:
        raise ValueError(f"--drafter is for --decoding draft, not {args.decoding!r}")
    if args.drafter is not None:
        # Tokenizers first (small files): a mismatch is an error before any weights load.
        mine, theirs = (vocabulary(m) for m in (args.model, args.drafter))
        if mine != theirs:
            raise ValueError(f"--drafter {args.drafter} has another tokenizer than --model {args.model}")
    transformers.utils.logging.disable_progress_bar()  # errors and answers stay the only output lines
    dtype = getattr(torch, args.dtype)
    pipe = load_pipeline(args.model, device=args.device, dtype=dtype)
    given = {"drafter": args.drafter} if args.drafter is not None else {}
    decoder = decoder_from_spec(args.decoding, pipe, args.model, args.device, dtype, **given)
    call = dict(max_new_tokens=args.max_new_tokens, decoding=decoder, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, dropping=dropping, draft_dropping=draft_dropping, videos=videos or None, **options)
    if args.stream:
        for _, piece in pipe.stream(args.prompt, images or None, generator=make_generator(args.seed, args.device), **call):
            print(piece, end="", flush=True)
        print()
        return 0
    out = pipe(args.prompt, images or None, generator=make_generator(args.seed, args.device), **call)
    record = {"text": out.texts[0], "stats": out.stats.to_dict(), "tokens": out.lengths.tolist(),
              "ttft_s": round(out.ttft_s, 4), "decode_tokens_per_s": round(out.decode_tokens_per_s, 1)}
    if out.dropping is not None:
        record["dropping"] = {"policy": out.dropping.policy, "image_tokens": out.dropping.image_tokens,
                              "kept_tokens": out.dropping.kept_tokens}
    report(args, [out.texts[0]], record)
    return 0


def vocabulary(model: str) -> dict:
    """The vocabulary of a model's tokenizer, loaded alone (small files) from its checked folder
    (`mmgen.hub.loading_folder`) or Hub repo."""
    from transformers import AutoTokenizer

    from mmgen.hub import loading_folder
    from mmgen.loading import resolve_model

    source = resolve_model(model)
    with loading_folder(source):
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False).get_vocab()


def read_videos(model: str, paths: list[str]) -> list:
    """The --video files as `Video`s at their own frame rates (`mmgen.vlm.videos.read_video`: the
    pipeline's own reader and bounds), once the model's config.json says its family takes video:
    both before any weights load. ValueError naming the file or the model_type otherwise."""
    if not paths:
        return []
    from mmgen.hub import read_json, resolve_path
    from mmgen.loading import resolve_model
    from mmgen.vlm.videos import read_video, video_family_check

    # A folder's config.json (never through a link out of it), or a Hub repo's (only that file is fetched).
    config = resolve_path(resolve_model(model), "config.json")
    model_type = read_json(config).get("model_type")
    try:
        video_family_check(model_type)
    except ValueError as error:
        raise ValueError(f"--video: {error}") from None
    return [read_video(path, f"--video {path}") for path in paths]


def dropping_from_flags(spec: Optional[str], keep_ratio: Optional[float]):
    """The dropping policy a --dropping spec and --keep-ratio give (one rule for a setting given
    twice: `mmgen.loading.merge_decoding_options`); None for neither."""
    if spec is None and keep_ratio is None:
        return None
    from dataclasses import replace

    from mmgen.decoding import parse_decoding
    from mmgen.loading import merge_decoding_options
    from mmgen.vlm.dropping import make_dropping

    spec = spec if spec is not None else "fastv"
    policy = make_dropping(spec)
    if keep_ratio is not None:
        merge_decoding_options(spec, parse_decoding(spec)[1], {"keep_ratio": keep_ratio})
        policy = replace(policy, keep_ratio=keep_ratio)
    return policy
