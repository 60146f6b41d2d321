"""Block-diffusion video: mmgen's cached decode against a no-cache baseline and diffusers'
SkyReels-V2 diffusion forcing on the same weights, plus cache policies, First Block Cache and
collaborative large/small denoising; in one process, methods interleaved, medians.

    python -m benchmarks.video_decoding --model emoji-motion --frames 33 --repeats 3 --clips 16
    python -m benchmarks.video_decoding --model tiny --frames 45 --repeats 5
    python -m benchmarks.video_decoding --wan-size --height 64 --width 64 --blocks 4 --threads 2

Per method: seconds per video, frames per second, first-block latency, per-block latency
(median over blocks), peak extra memory during the call and the K/V cache bytes; with
`--clips N` (bundled models only), the video quality proxies (`mmgen.video.quality`: per-object
class accuracy, motion-direction accuracy, temporal L1, Fréchet distance of classifier
features) over N held-out captions, next to real clips of the same captions.

- `no-cache`: `cache_policy="none"`, every forward re-feeds all committed frames (what naive
  block-causal implementations do); the same video as `cache` (tested).
- `cache`, `window:N`, `sink:1,window:N`: mmgen's frame K/V cache under each policy.
- `fbc:T`: First Block Cache at threshold T on the denoising steps.
- `drop:T`: static-token dropping at threshold T (`video/dropping.py`).
- `collab:K`: the large model takes the first K denoising steps of every block, `MODEL-small`
  the rest.
- `skyreels-df`: diffusers' `SkyReelsV2DiffusionForcingPipeline` with the same transformer
  weights (SkyReels-V2's transformer has Wan's parameters), VAE and text encoder, synchronous
  diffusion forcing with the model's block size as `causal_block_size`, as many steps as the
  schedule; it denoises the whole video at once and returns it at the end.

`--wan-size`: per-block latency of a random-weight transformer in Wan-2.1-T2V-1.3B's
configuration (1536 wide, 30 layers, 12 heads, ffn 8960) at a small resolution, cached against
no-cache, for blocks 0 … B−1 (the no-cache block b re-feeds b blocks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Optional

import torch

from mmgen.decoding import BlockDenoising, CollaborativeDenoising
from mmgen.video.model import PromptEmbeddings, RecomputingWanModel, WanBlockModel


def load(model: str):
    from mmgen.loading import load_pipeline
    from mmgen.video.cli import quiet_loaders

    quiet_loaders()
    if model == "tiny":
        from tests.video.tiny import tiny_video_pipeline

        pipe, small = tiny_video_pipeline(), tiny_video_pipeline(layers=1, seed=1)
    else:
        pipe = load_pipeline(model, dtype=torch.float32)
        from mmgen.registry import bundled_models

        small = load_pipeline(f"{model}-small", dtype=torch.float32) if f"{model}-small" in bundled_models() else None
    for p in (pipe, small):
        if p is not None:
            p.set_progress_bar_config(disable=True)
    return pipe, small


def skyreels(pipe):
    """diffusers' diffusion-forcing pipeline over the same weights (SkyReels-V2 = Wan's parameters)."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    transformer = SkyReelsV2Transformer3DModel(**config, num_frame_per_block=pipe.block_frames).eval()
    transformer.load_state_dict(pipe.transformer.state_dict(), strict=True)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=pipe.schedule.shift)
    df = SkyReelsV2DiffusionForcingPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder,
                                            transformer=transformer, vae=pipe.vae, scheduler=scheduler)
    df.set_progress_bar_config(disable=True)
    return df


def methods(pipe, small, window: int) -> dict[str, Callable[..., Any]]:
    """name -> run(prompts, frames, seed) -> (frames uint8 [B, T, H, W, 3], profile dict)."""

    def ours(**options):
        def run(prompts, frames, seed):
            out = pipe(prompts, num_frames=frames, generator=torch.Generator().manual_seed(seed), **options)
            return out.frames, out.profile.to_dict()
        return run

    table = {
        "no-cache": ours(cache_policy="none"),
        "cache": ours(),
        f"window:{window}": ours(cache_policy=f"window:{window}"),
        f"sink:1,window:{window}": ours(cache_policy=f"sink:1,window:{window}"),
        "fbc:0.05": ours(cache_threshold=0.05),
        "fbc:0.2": ours(cache_threshold=0.2),
        "drop:0.05": ours(drop_threshold=0.05),
        "drop:0.2": ours(drop_threshold=0.2),
    }
    steps = len(pipe.schedule.timesteps)
    if small is not None:
        for k in range(1, steps):  # the quality/speed curve: k large steps, then the small model
            table[f"collab:{k}"] = ours(decoding=CollaborativeDenoising(small=small, large_steps=k))
        table["small"] = lambda prompts, frames, seed: (
            lambda out: (out.frames, out.profile.to_dict()))(small(prompts, num_frames=frames, generator=torch.Generator().manual_seed(seed)))
    df = skyreels(pipe)

    def diffusion_forcing(prompts, frames, seed):
        from mmgen.video.export import to_uint8
        from mmgen.video.profiler import BlockProfiler

        profiler = BlockProfiler(pipe.device)
        profiler.start()
        embeds = pipe.encode_prompt(prompts)  # ours, so both see the same text states (and no ftfy is needed)
        video = df(None, prompt_embeds=embeds, height=pipe.height, width=pipe.width, num_frames=frames, num_inference_steps=steps,
                   guidance_scale=1.0, generator=torch.Generator().manual_seed(seed), output_type="pt",
                   max_sequence_length=pipe.max_sequence_length, base_num_frames=frames, ar_step=0,
                   causal_block_size=pipe.block_frames).frames
        frames_u8 = to_uint8(video.permute(0, 2, 1, 3, 4) * 2 - 1)  # [B, T, C, H, W] in [0, 1] -> ours
        profiler.block_done()  # the whole video arrives at once: its first "block" is all of it
        return frames_u8, profiler.finish(frames_u8.shape[0] * frames_u8.shape[1]).to_dict()

    table["skyreels-df"] = diffusion_forcing
    return table


def timing(pipe, small, frames: int, repeats: int, window: int, only: Optional[list[str]]) -> dict:
    table = methods(pipe, small, window)
    names = [n for n in table if only is None or n in only]
    runs = {n: [] for n in names}
    prompt = ["cat face moving left"]
    for n in names:  # warm-up
        table[n](prompt, frames, 0)
    for r in range(repeats):
        for n in names:  # interleaved
            runs[n].append(table[n](prompt, frames, r)[1])
    rows = {}
    for n, profiles in runs.items():
        med = lambda key: statistics.median(p[key] for p in profiles)
        rows[n] = {"total_s": med("total_s"), "fps": med("frames_per_second"), "first_block_s": med("first_block_s"),
                   "block_s": statistics.median(statistics.median(p["block_s"]) for p in profiles),
                   "peak_mb": med("peak_memory_bytes") / 2**20, "cache_kb": med("cache_bytes") / 2**10,
                   "spread_s": [min(p["total_s"] for p in profiles), max(p["total_s"] for p in profiles)]}
    return rows


def quality(pipe, small, frames: int, clips: int, window: int, only: Optional[list[str]]) -> dict:
    from mmgen.video.data import MovingEmoji, MovingEmojiConfig
    from mmgen.video.quality import VideoQualityProxies

    config = MovingEmojiConfig(size=pipe.height, num_frames=frames)
    held_out = [MovingEmoji(config, seed=7)[i] for i in range(clips)]
    captions = [c.caption for c in held_out]
    proxies = VideoQualityProxies.from_dataset(num_clips=256, seed=1, config=config)
    table = methods(pipe, small, window)
    rows = {"real": proxies(torch.stack([torch.from_numpy(c.frames) for c in held_out]), captions)}
    for n, run in table.items():
        if only is not None and n not in only:
            continue
        videos = torch.cat([run([c], frames, i)[0] for i, c in enumerate(captions)])
        rows[n] = proxies(videos, captions)
    return rows


def wan_size(height: int, width: int, blocks: int, block_frames: int, repeats: int) -> dict:
    """Per-block latency (4 denoising forwards + the clean pass) at Wan-2.1-1.3B's width and depth."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30,
                                        in_channels=16, out_channels=16, text_dim=4096).eval()
    latent = (height // 8, width // 8)
    text = PromptEmbeddings(torch.randn(1, 512, 4096))
    rows = {}
    for name, model in (("cache", WanBlockModel(transformer, block_frames, latent)),
                        ("no-cache", RecomputingWanModel(transformer, block_frames, latent))):
        per_block = [[] for _ in range(blocks)]
        for r in range(repeats):
            marks = [time.perf_counter()]
            with torch.no_grad():
                BlockDenoising().generate(model, text, blocks, torch.Generator().manual_seed(r),
                                          callback=lambda i, x: marks.append(time.perf_counter()))
            for b in range(blocks):
                per_block[b].append(marks[b + 1] - marks[b])
        rows[name] = [statistics.median(t) for t in per_block]
    return {"params": sum(p.numel() for p in transformer.parameters()), "tokens_per_block": block_frames * latent[0] * latent[1] // 4,
            "per_block_s": rows}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="emoji-motion", help="a video pipeline name or folder, or 'tiny'")
    parser.add_argument("--frames", type=int, default=None, help="video frames (default the model's num_frames)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window", type=int, default=2, help="latent frames of the window policies")
    parser.add_argument("--clips", type=int, default=0, help="held-out captions for the quality proxies (0: none)")
    parser.add_argument("--methods", default=None, help="comma-separated subset of the methods")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wan-size", action="store_true", help="per-block latency at Wan-2.1-1.3B size instead")
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block-frames", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = None if args.methods is None else args.methods.split(",")
    if args.wan_size:
        result = {"wan_size": wan_size(args.height, args.width, args.blocks, args.block_frames, args.repeats)}
    else:
        pipe, small = load(args.model)
        args.frames = args.frames or pipe.num_frames
        result = {"model": args.model, "frames": args.frames, "threads": args.threads,
                  "timing": timing(pipe, small, args.frames, args.repeats, args.window, only)}
        if args.clips:
            result["quality"] = quality(pipe, small, args.frames, args.clips, args.window, only)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
