"""`mmgen bench video`: a block-diffusion video model's decoding methods and cache policies
against plain block decoding with the global cache, in one process.

    mmgen bench video --models emoji-motion --methods block collaborative --cache-policies global sink:1,window:2

Each input is a caption of the bundled clips' kind ("<sprite> moving <direction>", the data's
sprites),
made at batch 1 with one seed per caption, the same for every method; every method x cache
policy is one row (the first is the baseline). Units are video frames: frames per model forward
(denoising and commit forwards of every model, CFG batches counted once), milliseconds per
frame (VAE decoding of each block included on every side), the speedup against the baseline
(paired per caption), and how many videos equal the baseline's latents (all of them for the
baseline's own settings; a cache policy or collaborative decoding changes them by design:
judge those with the quality proxies of the model card).

`--diffusers` adds the peer a user would otherwise pick, diffusers'
`SkyReelsV2DiffusionForcingPipeline`, on the same weights (SkyReels-V2's transformer has Wan's
parameters; the VAE and text encoder are shared), the same text states, guidance, seeds, frames
and number of steps, `causal_block_size` the model's block: synchronous diffusion forcing
(`ar_step=0`) denoises the whole video at once with UniPC and returns it at the end. Its
sampler and its noisy context differ from block decoding by design, so its videos are not the
baseline's (`identical_to_*` is 0); its row is a speed figure.

`--stream SECONDS` measures live streams instead (`pipe.stream`): each method x rolling cache
policy streams for that long from the first caption, switching to the next caption
`--switches` times at even intervals, and reports the first block's latency, the steady frames
per second after it, resident memory at the first block, the last and its peak, the class
accuracy of the blocks before the first switch (the judge's own check), and per switch the
blocks until the new caption shows (the first block whose cut-outs the bundled emoji
classifier, its reading restricted to the data's eight sprites, reads as the new sprite at
least half the time; None: not within the run).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from mmgen.benchmarking import Run, add_method_arguments, compare_methods, run_methods

DIFFUSERS = "diffusers SkyReels-V2 DF"


def captions(count: int) -> list[str]:
    """Captions of the kind the bundled pair was trained on: its sprites, each with a direction."""
    from mmgen.video.data import DEFAULT_SPRITES

    directions = ("left", "right", "up", "down")
    return [f"{DEFAULT_SPRITES[i % len(DEFAULT_SPRITES)]} moving {directions[i % 4]}" for i in range(count)]


def register(groups: dict) -> None:
    bench = groups["bench"].add_parser("video", help="video models: decoding methods and cache policies against block "
                                       "decoding", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_method_arguments(bench, "emoji-motion", ["block", "collaborative"], inputs=4)
    bench.add_argument("--cache-policies", nargs="+", default=["global"],
                       help="KV cache policies crossed with --methods: global, window:N, sink:S,window:N, none")
    bench.add_argument("--num-frames", type=int, default=None, help="video frames (default: the model's)")
    bench.add_argument("--stream", type=float, default=0.0, metavar="SECONDS",
                       help="measure live streams of this length instead (rolling cache policies only; 'global' "
                            "means the model's default stream policy)")
    bench.add_argument("--switches", type=int, default=3, help="with --stream: prompt changes per stream")
    bench.add_argument("--diffusers", action="store_true",
                       help=f"add '{DIFFUSERS}': diffusers' SkyReels-V2 diffusion forcing on the same weights")
    bench.set_defaults(run=run_bench)


def rows(pipe: Any, args: argparse.Namespace, progress: Optional[tqdm] = None) -> list[dict]:
    def ours(spec: str, policy: str):
        def run(caption: str, seed: int) -> Run:
            begun = time.perf_counter()
            out = pipe(caption, decoding=spec, cache_policy=policy, num_frames=args.num_frames,
                       generator=torch.Generator().manual_seed(seed))
            seconds = time.perf_counter() - begun
            stats = out.stats
            forwards = sum(stats.denoise_forwards.values()) + sum(stats.commit_forwards.values())
            return Run(out.latents, int(out.frames.shape[1]), seconds, forwards)
        return run

    methods = {f"{spec} cache={policy}": ours(spec, policy) for spec in args.methods for policy in args.cache_policies}
    if args.diffusers:
        methods[DIFFUSERS] = diffusion_forcing(pipe, args.num_frames)
    return compare_methods(captions(args.inputs), methods, args.repeats, args.warmup, progress)


def diffusion_forcing(pipe: Any, num_frames: Optional[int]) -> Callable[[str, int], Run]:
    """diffusers' SkyReels-V2 diffusion forcing over `pipe`'s weights, as a method's run (module
    docstring): the transformer converted to `SkyReelsV2Transformer3DModel`, the VAE and text
    encoder shared, a UniPC flow scheduler with the pipeline's shift."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    transformer = SkyReelsV2Transformer3DModel(**config, num_frame_per_block=pipe.block_frames)
    transformer.load_state_dict(pipe.transformer.state_dict(), strict=True)
    transformer.to(pipe.device).eval()
    if pipe.transformer.dtype != transformer.dtype:  # diffusers warns on a float32 cast, which loading already did
        transformer.to(dtype=pipe.transformer.dtype)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=pipe.schedule.shift)
    df = SkyReelsV2DiffusionForcingPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, transformer=transformer,
                                            vae=pipe.vae, scheduler=scheduler)
    df.set_progress_bar_config(disable=True)
    frames = pipe.num_frames if num_frames is None else num_frames
    steps = len(pipe.schedule.timesteps)

    def run(caption: str, seed: int) -> Run:
        from mmgen.video.export import to_uint8

        begun = time.perf_counter()
        with torch.no_grad():
            # Our text states (the same for both sides), and the pipeline's guidance and negative prompt.
            guided = pipe.guidance_scale != 1.0
            embeds = pipe.embeddings([caption], guided, pipe.negative_prompt)
            video = df(None, prompt_embeds=embeds.cond, negative_prompt_embeds=embeds.uncond, height=pipe.height,
                       width=pipe.width, num_frames=frames, num_inference_steps=steps, guidance_scale=pipe.guidance_scale,
                       generator=torch.Generator().manual_seed(seed), output_type="pt",
                       max_sequence_length=pipe.max_sequence_length, base_num_frames=frames, ar_step=0,
                       causal_block_size=pipe.block_frames).frames
            video = to_uint8(video.permute(0, 2, 1, 3, 4) * 2 - 1)  # [B, T, C, H, W] in [0, 1], as ours
        seconds = time.perf_counter() - begun
        return Run(video, int(video.shape[1]), seconds, steps)  # one forward over the whole video per step
    return run


def resident_mib() -> float:
    """This process's resident memory (Linux /proc; 0.0 where there is none)."""
    try:
        line = next(l for l in open("/proc/self/status") if l.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 1024


def stream_rows(pipe: Any, args: argparse.Namespace, progress: Optional[tqdm] = None) -> list[dict]:
    """One row per method x cache policy: a live stream of `args.stream` seconds (module docstring)."""
    from mmgen.image_ar.bundled import QUALITY_CLASSIFIER
    from mmgen.image_ar.quality import ImageQualityProxies
    from mmgen.video.quality import VideoQualityProxies

    judge = VideoQualityProxies(ImageQualityProxies.from_pretrained(QUALITY_CLASSIFIER))
    sprites = judge.sprite_classes  # read among the data's eight sprites
    texts = captions(args.switches + 1)
    switch_at = [args.stream * (k + 1) / (args.switches + 1) for k in range(args.switches)]
    rows = []
    for spec in args.methods:
        for policy in args.cache_policies:
            begun = time.perf_counter()
            stream = pipe.stream(texts[0], decoding=spec, cache_policy=None if policy == "global" else policy,
                                 generator=torch.Generator().manual_seed(0))
            shown, switched, rss, frames, first_s, current, before = [], [], [], 0, None, 0, []
            with stream:
                for block in stream:
                    now = time.perf_counter() - begun
                    frames += block.frames.shape[1] if first_s is not None else 0
                    first_s = now if first_s is None else first_s
                    rss.append(resident_mib())
                    accuracy = judge.class_accuracy(block.frames.cpu().numpy(), [texts[current]], among=sprites)
                    if not switched:
                        before.append(accuracy)
                    if switched and shown[-1] is None and accuracy >= 0.5:
                        shown[-1] = block.index - switched[-1]
                    if progress is not None:
                        progress.update(1)
                    if now >= args.stream:
                        break
                    if current < args.switches and now >= switch_at[current]:
                        current += 1
                        stream.set_prompt(texts[current])
                        switched.append(block.index + 1)
                        shown.append(None)
                seconds = time.perf_counter() - begun
            rows.append({"method": f"{spec} cache={policy}", "seconds": round(seconds, 1), "blocks": len(rss),
                         "first_block_s": first_s, "steady_fps": frames / max(seconds - first_s, 1e-9),
                         "rss_first_mib": rss[0], "rss_last_mib": rss[-1], "rss_max_mib": max(rss),
                         "class_accuracy_first_prompt": sum(before) / len(before), "blocks_until_switch_shows": shown})
    return rows


def run_bench(args: argparse.Namespace) -> int:
    if args.num_frames is not None and args.num_frames < 1:
        raise ValueError(f"--num-frames must be at least 1, got {args.num_frames}")
    if args.stream < 0 or args.switches < 0:
        raise ValueError("--stream and --switches must be >= 0")
    if args.stream and args.diffusers:
        raise ValueError("--diffusers times whole videos: it does not combine with --stream")
    rows_of = stream_rows if args.stream else rows
    print(run_methods(args, lambda pipe, name, progress: rows_of(pipe, args, progress)))
    return 0
