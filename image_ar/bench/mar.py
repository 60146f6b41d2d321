"""`mmgen bench` rows for continuous-token (MAR) models: the official masked sampler and
continuous speculative decoding (CSpD), in one process.

Speed rows time whole decodes (warm-up, medians over repeats) against the first method (by
default "ar" on the model's own step count) on the same batch, and report the target's
forwards against the schedule's steps, the drafter's forwards, the share of drafted tokens
kept and the residual samples that needed the exact fallback. Quality rows score the same
labels and seed for every method with the bundled classifier.

Methods are continuous decoder specs: "ar", "ar:num_steps=4" (the official sampler on a
coarser schedule: the fair baseline for a method that commits several steps per forward),
"cspd:num_draft=4,prefill_ratio=0.15,flatten=1". A spec without `num_steps` takes the
model's default (`sampling_defaults["num_iter"]`).
"""

from __future__ import annotations

import statistics
from typing import Sequence

import torch

from mmgen.benchmarking import plan, tick
from mmgen.image_ar.bench.common import quality_chunks, quality_labels, timed_decodes
from mmgen.image_ar.bench.var import weights_mb
from mmgen.image_ar.bundled import QUALITY_CLASSIFIER
from mmgen.loading import decoder_from_spec, resolve_model
from mmgen.image_ar.mar import MAR, MARPipeline


def continuous_decoders(methods: Sequence[str], pipe: MARPipeline, model_name: str) -> dict:
    """Decoders for method specs, on the model's step count unless a spec names `num_steps`."""
    dtype = pipe.transformer.z_proj.weight.dtype
    return {m: decoder_from_spec(m, pipe, model_name, pipe.device, dtype) for m in methods}


@torch.no_grad()
def mar_speed_rows(pipe: MARPipeline, model_name: str, decoders: dict, batch_sizes: Sequence[int], options: dict,
                   repeats: int, warmup: int, progress=None) -> list[dict]:
    """`decoders`: method -> continuous decoder; the first is the baseline of `speedup`."""
    device = pipe.device
    rows = []
    for batch in batch_sizes:
        baseline = None
        for method, decoder in decoders.items():
            run = lambda labels, seed: pipe(labels, decoding=decoder, generator=torch.Generator(device).manual_seed(seed),
                                            output_type="pt", **options).stats
            stats = timed_decodes(run, batch, pipe.num_classes, repeats, warmup, progress, f"{model_name} {method} batch {batch}")
            drafter = getattr(decoder, "drafter", None)
            drafted = sum(s.drafted for s in stats)
            row = {
                "model": model_name, "method": method, "batch": batch,
                "steps": stats[0].baseline_forwards,
                "target_forwards": statistics.median(s.forwards for s in stats),
                "draft_forwards": statistics.median(s.draft_forwards for s in stats),
                "step_compression": statistics.median(s.step_compression for s in stats),
                "kept_drafts": sum(s.accepted_drafts for s in stats) / drafted if drafted else None,
                "fallbacks": sum(s.fallbacks for s in stats),
                "seconds": statistics.median(s.wall_time_s for s in stats),
                "weights_mb": weights_mb(pipe, *([drafter] if isinstance(drafter, MARPipeline) else [])),
            }
            baseline = baseline or row["seconds"]
            row["speedup"] = baseline / row["seconds"]
            rows.append(row)
    return rows


@torch.no_grad()
def mar_diffusion_loss(model: MAR, latents: torch.Tensor, labels: torch.Tensor, seed: int = 0, repeats: int = 4) -> float:
    """MAR's training loss on given token latents [B, C, H, W] (scaled), averaged over `repeats`
    fixed draws of order, mask ratio, t and noise: the same draws for every model of the same
    token grid, so the figures compare (lower: the model explains the images better)."""
    model.eval()
    return sum(model(latents, labels, torch.Generator(latents.device).manual_seed(seed + r)).item() for r in range(repeats)) / repeats


@torch.no_grad()
def mar_quality_rows(pipe: MARPipeline, model_name: str, decoders: dict, options: dict, labels: torch.Tensor, batch_size: int,
                     seed: int, progress=None) -> list[dict]:
    from mmgen.image_ar.quality import ImageQualityProxies

    scorer = ImageQualityProxies.from_pretrained(QUALITY_CLASSIFIER)
    rows = []
    for method, decoder in decoders.items():
        plan(progress, quality_chunks(labels, batch_size), f"{model_name} {method} quality")
        generator = torch.Generator(pipe.device).manual_seed(seed)
        images = []
        for chunk in labels.split(batch_size):
            images.append(pipe(chunk.tolist(), decoding=decoder, generator=generator, output_type="pt", **options).images)
            tick(progress)
        images = torch.cat(images)
        rows.append({"model": model_name, "method": method, **scorer(images, labels.to(pipe.device))})
    return rows


def run_mar(args, report: dict, device: torch.device, dtype: torch.dtype, progress=None) -> None:
    """The MAR part of `mmgen bench`: bundled or saved MAR pipelines."""
    if args.random_weights:
        raise ValueError("--random-weights takes LlamaGen or VAR presets; MAR models are benchmarked from pipeline folders")
    options = {k: v for k, v in dict(guidance_scale=args.guidance_scale, temperature=args.temperature).items() if v is not None}
    report.setdefault("speed", [])
    report.setdefault("quality", [])
    for name in args.models:
        pipe = MARPipeline.from_pretrained(resolve_model(name), device=device, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        decoders = continuous_decoders(args.methods, pipe, name)
        if args.batch_sizes:
            report["speed"] += mar_speed_rows(pipe, name, decoders, args.batch_sizes, options, args.repeats, args.warmup,
                                              progress)
        if args.quality_per_class > 0:
            report["quality"] += mar_quality_rows(pipe, name, decoders, options, quality_labels(pipe.num_classes, args),
                                                  args.quality_batch_size, args.seed, progress)
