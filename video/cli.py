"""`mmgen generate video`, and what `mmgen convert self-forcing / causvid` run (those subcommands
are built from the video family's record in `mmgen.video`).

    mmgen generate video --prompt "cat face moving left" --out cat.mp4          # the bundled emoji-motion, offline
    mmgen generate video --model FOLDER --prompt "..." --out clip.mp4 --frames 81 --block-frames 3 \
        [--cache-policy sink:1,window:6] [--decoding collaborative --small SMALLER --large-steps 2] \
        [--cache-threshold 0.05] [--drop-threshold 0.05] [--switch 40="a new prompt"] [--decode end]
    mmgen convert self-forcing self_forcing_dmd.pt --wan Wan-AI/Wan2.1-T2V-1.3B-Diffusers --out sf-pipeline

An existing OUT is an error unless `--overwrite`; the MP4 is written atomically. Every input is
checked before the model loads. The pipeline is imported only when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mmgen.cli import DTYPES, add_family_flags, add_json_flag, check_output_file, family_flags, report, seed_arg

#: The bundled model `mmgen generate video` uses when given none (its small model: emoji-motion-small).
DEFAULT_MODEL = "emoji-motion"


def _switch(text: str) -> tuple[int, str]:
    frame, sep, prompt = text.partition("=")
    if not sep or not frame.strip().isdigit() or not prompt.strip():
        raise argparse.ArgumentTypeError(f"expected FRAME=PROMPT (e.g. 40=\"dog face moving up\"), got {text!r}")
    return int(frame), prompt.strip()


def register(commands, groups) -> None:
    from mmgen.video.bench import register as register_bench

    register_bench(groups)
    video = groups["generate"].add_parser("video", help="make a video from a prompt, block by block (block-diffusion models)")
    video.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_OR_FOLDER",
                       help=f"the bundled {DEFAULT_MODEL} (default) or a BlockDiffusionVideoPipeline folder / Hub repo "
                            "(`mmgen convert self-forcing` writes one)")
    video.add_argument("--prompt", required=True, help="what the video shows")
    video.add_argument("--out", required=True, metavar="PATH.mp4", help="the MP4 file to write")
    video.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (default: an error)")
    video.add_argument("--frames", type=int, default=None, help="video frames, 1 + 4k (default: the model's)")
    video.add_argument("--block-frames", type=int, default=None, help="latent frames per block (default: the model's)")
    video.add_argument("--height", type=int, default=None, help="pixels (default: the model's)")
    video.add_argument("--width", type=int, default=None, help="pixels (default: the model's)")
    video.add_argument("--cache-policy", default="global", metavar="POLICY",
                       help="global (default), window:N or sink:S,window:N (latent frames the blocks attend to)")
    video.add_argument("--decode", default="block", choices=("block", "end"),
                       help="decode each block as it is made (default) or the whole video at the end")
    video.add_argument("--decoding", default="block", metavar="SPEC",
                       help="block (default) or collaborative (a small model takes the later denoising steps of each "
                            "block); options as NAME:key=value,...")
    video.add_argument("--small", default=None, metavar="NAME_OR_FOLDER",
                       help="for --decoding collaborative: a smaller denoiser of the same VAE (default: MODEL-small)")
    video.add_argument("--large-steps", type=int, default=None, help="collaborative: denoising steps of the large model")
    video.add_argument("--cache-threshold", type=float, default=None,
                       help="First Block Cache: reuse the later blocks' residual when the first block's changes less "
                            "than this (relative); 0 reuses nothing (default: off)")
    video.add_argument("--drop-threshold", type=float, default=None,
                       help="static-token dropping: after a block's first step, compute only tokens whose block input "
                            "changed by at least this (relative); 0 drops nothing (default: off)")
    video.add_argument("--guidance-scale", type=float, default=None,
                       help="classifier-free guidance (default: the model's; 1 is none)")
    video.add_argument("--negative-prompt", default=None, help="guidance's negative prompt (default: the model's)")
    video.add_argument("--switch", type=_switch, action="append", default=[], metavar="FRAME=PROMPT",
                       help="from the first block starting at or after FRAME, follow PROMPT (repeatable)")
    video.add_argument("--seed", type=seed_arg, default=0, help="seed of the random generator, in [0, 2**63) (default 0)")
    video.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N, mps")
    video.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    add_family_flags(video, "video")  # each family's own options, from its record
    add_json_flag(video)
    video.set_defaults(run=generate_video)


def quiet_loaders() -> None:
    """Errors and the report stay the only output lines: no loading bars, no cast warnings."""
    import diffusers
    import transformers

    for library in (transformers, diffusers):
        library.utils.logging.disable_progress_bar()
        library.utils.logging.set_verbosity_error()


def generate_video(args: argparse.Namespace) -> int:
    import torch

    from mmgen.cache import CachePolicy
    from mmgen.decoding import parse_decoding
    from mmgen.loading import decoder_from_spec, load_pipeline, pipeline_class_of
    from mmgen.sampling import make_generator

    out = check_output_file(args.out, ".mp4", args.overwrite)
    if not args.prompt.strip():
        raise ValueError("--prompt is empty")
    CachePolicy.parse(args.cache_policy)
    for flag, value in (("--cache-threshold", args.cache_threshold), ("--drop-threshold", args.drop_threshold)):
        if value is not None and not value >= 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    cls = pipeline_class_of(args.model)
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline

    if not issubclass(cls, BlockDiffusionVideoPipeline):
        raise ValueError(f"--model {args.model} holds a {cls.__name__}, not a block-diffusion video model")
    options = family_flags(args, "video", args.model, cls)
    method = parse_decoding(args.decoding)[0]
    if (args.small is not None or args.large_steps is not None) and method != "collaborative":
        raise ValueError(f"--small and --large-steps are for --decoding collaborative, not {args.decoding!r}")
    quiet_loaders()
    dtype = getattr(torch, args.dtype)
    pipe = load_pipeline(args.model, device=args.device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    # The geometry is checked before the (small) companion loads or anything runs.
    frames = pipe.num_frames if args.frames is None else args.frames
    block = pipe.block_frames if args.block_frames is None else args.block_frames
    pipe.check_geometry(frames, block, args.height or pipe.height, args.width or pipe.width)
    given = {k: v for k, v in (("small", args.small), ("large_steps", args.large_steps)) if v is not None}
    decoder = decoder_from_spec(args.decoding, pipe, args.model, args.device, dtype, **given)
    output = pipe(args.prompt, num_frames=frames, block_frames=block, height=args.height, width=args.width,
                  decoding=decoder, cache_policy=args.cache_policy, guidance_scale=args.guidance_scale,
                  negative_prompt=args.negative_prompt, prompt_switches=dict(args.switch), decode=args.decode,
                  cache_threshold=args.cache_threshold, drop_threshold=args.drop_threshold, generator=make_generator(args.seed, args.device), **options)
    from mmgen.video.export import write_mp4

    write_mp4(out, output.frames[0], fps=output.fps)
    frames = int(output.frames.shape[1])
    made = f"{output.stats.blocks} blocks at {output.profile.frames_per_second:.1f} frames/s"
    report(args, [f"wrote {out} ({frames} frames at {output.fps:g} fps; {made})"],
           {"out": str(out), "frames": frames, "fps": output.fps, "profile": output.profile.to_dict(),
            "stats": output.stats.to_dict()})
    return 0


def convert_causal(args: argparse.Namespace) -> int:
    from mmgen.video.convert import convert_to_pipeline

    if not Path(args.checkpoint).is_file():
        raise ValueError(f"{args.checkpoint}: no such file")
    quiet_loaders()
    convert_to_pipeline(args.checkpoint, args.wan, args.out, preset=args.preset, which=args.which, overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0
