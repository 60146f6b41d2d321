"""`mmgen bench` rows for next-scale (VAR) models: plain decoding, collaborative decoding
(CoDe) and FastVAR token pruning, alone and together, in one process.

Speed rows time whole decodes (warm-up, medians over repeats) and report the speedup against
plain decoding of the same model and batch, the forwards of each model, and memory: the KV
caches' bytes (the largest cache alive at once: CoDe frees the large model's before the small
one allocates), the weights of the models involved, and the CUDA allocator's peak on a GPU.
Quality rows score the same labels and seed for every method with the bundled classifier and
the NLL of the tokens under the plain model.
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

import torch

from mmgen.benchmarking import plan, tick
from mmgen.image_ar.bench.common import quality_chunks, quality_labels, timed_decodes
from mmgen.decoding import RENAMED_SHORTCUTS, parse_decoding
from mmgen.decoding.pruning import CachedTokenPruning
from mmgen.deprecation import warn_deprecated
from mmgen.image_ar.bundled import QUALITY_CLASSIFIER
from mmgen.loading import decoder_from_spec, resolve_model
from mmgen.image_ar.var import MultiScaleVQVAE, VARConfig, VARPipeline, VARTransformer, VQVAEConfig


def parse_pruning_spec(spec: str) -> Optional[CachedTokenPruning]:
    """"none", or a `CachedTokenPruning.from_spec` spec."""
    return None if spec == "none" else CachedTokenPruning.from_spec(spec)


def weights_mb(*pipes: VARPipeline) -> float:
    seen, total = set(), 0
    for pipe in pipes:
        for module in pipe.module_components():
            for p in module.parameters():
                if p.data_ptr() not in seen:
                    seen.add(p.data_ptr())
                    total += p.nbytes
    return total / 2**20


@torch.no_grad()
def var_speed_rows(pipe: VARPipeline, model_name: str, decoders: dict, prunings: Sequence[str],
                   batch_sizes: Sequence[int], options: dict, repeats: int, warmup: int, progress=None) -> list[dict]:
    """`decoders`: method name -> scale decoder (the "ar" row is the baseline)."""
    device = pipe.device
    methods = list(decoders)
    rows = []
    for batch in batch_sizes:
        baseline = None
        for method, pruning_spec in ((m, p) for m in methods for p in prunings):
            decoder, pruning = decoders[method], parse_pruning_spec(pruning_spec)
            run = lambda labels, seed: pipe(labels, decoding=decoder, pruning=pruning, generator=torch.Generator(device).manual_seed(seed),
                                            output_type="pt", **options).stats
            stats = timed_decodes(run, batch, pipe.num_classes, repeats, warmup, progress,
                                  f"{model_name} {method} pruning {pruning_spec} batch {batch}")
            small = getattr(decoder, "small", None)
            row = {
                "model": model_name, "method": method, "pruning": pruning_spec, "batch": batch,
                "forwards": "+".join(str(f) for f in stats[0].stage_forwards),
                "seconds": statistics.median(s.wall_time_s for s in stats),
                "kv_cache_mb": max(s.cache_bytes for s in stats) / 2**20,
                "weights_mb": weights_mb(pipe, *([small] if isinstance(small, VARPipeline) else [])),
                "peak_memory_mb": None if stats[0].peak_memory_bytes is None else max(s.peak_memory_bytes for s in stats) / 2**20,
            }
            baseline = baseline or (row["seconds"] if method == "ar" and pruning is None else None)
            row["speedup_vs_ar"] = baseline / row["seconds"] if baseline else None
            rows.append(row)
    return rows


@torch.no_grad()
def var_token_nll(pipe: VARPipeline, labels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean NLL per token [B] of all scales' tokens [B, L] under the plain conditional model
    (teacher-forced, no guidance)."""
    maps = list(tokens.split(list(pipe.transformer.config.step_sizes), dim=1))
    logits = pipe.transformer(labels, pipe.vqvae.quantize.next_scale_inputs(maps))
    return -logits.float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1).mean(-1)


@torch.no_grad()
def var_quality_rows(pipe: VARPipeline, model_name: str, methods: Sequence[str], prunings: Sequence[str], options: dict,
                     labels: torch.Tensor, batch_size: int, seed: int, progress=None) -> list[dict]:
    from mmgen.image_ar.quality import ImageQualityProxies

    scorer = ImageQualityProxies.from_pretrained(QUALITY_CLASSIFIER)
    rows = []
    for method, pruning_spec in ((m, p) for m in methods for p in prunings):
        plan(progress, quality_chunks(labels, batch_size), f"{model_name} {method} pruning {pruning_spec} quality")
        decoder = decoder_from_spec(method, pipe, model_name, pipe.device, pipe.transformer.class_emb.weight.dtype)
        generator = torch.Generator(pipe.device).manual_seed(seed)
        outs = []
        for chunk in labels.split(batch_size):
            outs.append(pipe(chunk.tolist(), decoding=decoder, pruning=parse_pruning_spec(pruning_spec), generator=generator,
                             output_type="pt", **options))
            tick(progress)
        images, tokens = torch.cat([o.images for o in outs]), torch.cat([o.tokens for o in outs])
        nll = torch.cat([var_token_nll(pipe, l.to(pipe.device), t) for l, t in zip(labels.split(256), tokens.split(256))])
        rows.append({"model": model_name, "method": method, "pruning": pruning_spec,
                     **scorer(images, labels.to(pipe.device)), "nll": float(nll.mean())})
    return rows


def random_var_pipeline(depth: int, device: torch.device, dtype: torch.dtype) -> VARPipeline:
    """An official-size VAR (`d16` ... `d36`) with random weights and the official VQVAE layout:
    speed does not depend on the weights."""
    torch.manual_seed(0)
    with torch.device(device):
        config = VARConfig.from_preset(f"d{depth}")
        pipe = VARPipeline(VARTransformer(config), MultiScaleVQVAE(VQVAEConfig(patch_nums=config.patch_nums)))
    return pipe.to(device, dtype)


def is_collaborative(method: str) -> bool:
    """Whether a method spec names CoDe (also by its old shortcut, which decoding it warns about)."""
    name = parse_decoding(method)[0]
    return RENAMED_SHORTCUTS["scale"].get(name, name) == "collaborative"


def scale_decoders(methods: Sequence[str], pipe: VARPipeline, model_name: str, small: Optional[VARPipeline] = None) -> dict:
    """Decoders for method specs; `small` (random-weight runs) replaces the bundled companion."""
    dtype = pipe.transformer.class_emb.weight.dtype
    overrides = lambda m: {"small": small} if small is not None and is_collaborative(m) else {}
    return {m: decoder_from_spec(m, pipe, model_name, pipe.device, dtype, **overrides(m)) for m in methods}


def run_var(args, report: dict, device: torch.device, dtype: torch.dtype, progress=None) -> None:
    """The VAR part of `mmgen bench`: bundled/saved VAR pipelines, or official sizes with random weights."""
    options = {k: v for k, v in dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k,
                                     top_p=args.top_p).items() if v is not None}
    if getattr(args, "refiner_depth", None) is not None:
        warn_deprecated("--refiner-depth", "use --small-depth")
        args.small_depth = args.refiner_depth
    if args.random_weights:
        depth = int(args.random_weights.removeprefix("var-d"))
        pipe = random_var_pipeline(depth, device, dtype)
        small = random_var_pipeline(args.small_depth, device, dtype) if any(map(is_collaborative, args.methods)) else None
        for p in (pipe, small):
            if p is not None:
                p.set_progress_bar_config(disable=True)
        report["speed"] = var_speed_rows(pipe, args.random_weights, scale_decoders(args.methods, pipe, "", small), args.prunings,
                                         args.batch_sizes, options, args.repeats, args.warmup, progress)
        return
    report.setdefault("speed", [])
    report.setdefault("quality", [])
    for name in args.models:
        pipe = VARPipeline.from_pretrained(resolve_model(name), device=device, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        if args.batch_sizes:
            report["speed"] += var_speed_rows(pipe, name, scale_decoders(args.methods, pipe, name), args.prunings,
                                              args.batch_sizes, options, args.repeats, args.warmup, progress)
        if args.quality_per_class > 0:
            report["quality"] += var_quality_rows(pipe, name, args.methods, args.prunings, options,
                                                  quality_labels(pipe.num_classes, args),
                                                  args.quality_batch_size, args.seed, progress)
