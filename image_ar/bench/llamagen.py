"""`mmgen bench` rows for token models (LlamaGen): every decoding method against autoregressive
decoding on the same model and batch, and the per-forward cost of a verify window at official
sizes with random weights."""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Optional, Sequence

import torch
from tqdm.auto import tqdm

from mmgen.benchmarking import plan, sync, tick
from mmgen.decoding import Decoder
from mmgen.image_ar.bench.common import quality_chunks
from mmgen.image_ar.bundled import QUALITY_CLASSIFIER
from mmgen.image_ar.llamagen import LlamaGenConfig, LlamaGenPipeline, LlamaGenTokenModel, LlamaGenTransformer
from mmgen.loading import decoder_from_spec
from mmgen.quality import token_nll
from mmgen.sampling import SamplingConfig


@torch.no_grad()
def speed_rows(pipe: LlamaGenPipeline, model_name: str, methods: Sequence[str], batch_sizes: Sequence[int],
               sampling: SamplingConfig, repeats: int, warmup: int, progress: Optional[tqdm] = None) -> list[dict]:
    """Per batch size, every method's decodes interleaved: repeat r decodes the same classes with
    seed r under each method in turn, so a change of the machine's load reaches all of them;
    `speedup_vs_ar` is the median of the paired ratios (each repeat's `ar` time over the
    method's), and the other figures medians over repeats."""
    device = pipe.device
    token_model = pipe.token_model()
    n = pipe.transformer.config.block_size
    rows = []
    dtype = pipe.transformer.output.weight.dtype
    decoders = {method: decoder_from_spec(method, pipe, model_name, device, dtype) for method in methods}  # drafters load once
    for batch in batch_sizes:
        labels = lambda seed: ((seed * batch + torch.arange(batch)) % pipe.num_classes).tolist()
        decode = lambda method, seed: decoders[method].generate(token_model, torch.tensor(labels(seed), device=device), n,
                                                                sampling, torch.Generator(device).manual_seed(seed)).stats
        plan(progress, (warmup + repeats) * len(methods), f"{model_name} batch {batch}")
        for method, seed in itertools.product(methods, range(10_000, 10_000 + warmup)):
            decode(method, seed)
            tick(progress)
        runs: dict[str, list] = {method: [] for method in methods}
        for seed in range(repeats):
            for method in methods:
                runs[method].append(decode(method, seed))
                tick(progress)
        for method in methods:
            stats = runs[method]
            row = {
                "model": model_name, "method": method, "batch": batch,
                "forwards": statistics.median(s.forwards for s in stats),
                "step_compression": statistics.median(s.step_compression for s in stats),
                "mean_accepted_length": statistics.median(s.mean_accepted_length for s in stats),
                "seconds": statistics.median(s.wall_time_s for s in stats),
                "peak_memory_mb": None if stats[0].peak_memory_bytes is None else max(s.peak_memory_bytes for s in stats) / 2**20,
                "speedup_vs_ar": statistics.median(a.wall_time_s / s.wall_time_s for a, s in zip(runs["ar"], stats))
                if "ar" in runs else None,
            }
            rows.append(row)
    return rows


def score_samples(scorer, token_model: LlamaGenTokenModel, images: torch.Tensor, labels: torch.Tensor,
                  tokens: torch.Tensor) -> dict:
    """Quality proxies of images [N, 3, H, W] in [0, 1] plus the GPT's NLL of their tokens."""
    nll = torch.cat([token_nll(token_model, l, t).cpu() for l, t in zip(labels.split(256), tokens.split(256))])
    return {**scorer(images, labels), "nll": float(nll.mean())}


@torch.no_grad()
def sample_and_score(pipe: LlamaGenPipeline, decoder: Decoder, sampling: SamplingConfig, labels: torch.Tensor,
                     batch_size: int, seed: int, scorer, progress: Optional[tqdm] = None) -> dict:
    """Generate one image per label in chunks from one seeded generator, then score them.

    Also returns the per-row step compression over all chunks: tokens finalised per row per
    forward (the mean accepted length over every (row, forward) pair), which, unlike a
    batch's forwards, does not depend on which row of a chunk is slowest.
    """
    device = pipe.device
    token_model = pipe.token_model()
    generator = torch.Generator(device).manual_seed(seed)
    outputs = []
    for chunk in labels.split(batch_size):
        outputs.append(decoder.generate(token_model, chunk.to(device), pipe.transformer.config.block_size, sampling, generator))
        tick(progress)
    tokens = torch.cat([o.tokens for o in outputs])
    histogram = [sum(h) for h in itertools.zip_longest(*(o.stats.accepted_histogram for o in outputs), fillvalue=0)]
    row_compression = sum(k * c for k, c in enumerate(histogram)) / sum(histogram)
    scores = score_samples(scorer, token_model, pipe.decode_tokens(tokens, output_type="pt"), labels.to(device), tokens)
    return {"row_step_compression": row_compression, **scores}


def quality_rows(pipe: LlamaGenPipeline, model_name: str, methods: Sequence[str], sampling: SamplingConfig,
                 labels: torch.Tensor, batch_size: int, seed: int, progress: Optional[tqdm] = None) -> list[dict]:
    """Quality proxies of each method's samples: the same labels and seed for every method."""
    from mmgen.image_ar.quality import ImageQualityProxies

    scorer = ImageQualityProxies.from_pretrained(QUALITY_CLASSIFIER)
    rows = []
    for method in methods:
        plan(progress, quality_chunks(labels, batch_size), f"{model_name} {method} quality")
        decoder = decoder_from_spec(method, pipe, model_name, pipe.device, pipe.transformer.output.weight.dtype)
        rows.append({"model": model_name, "method": method,
                     **sample_and_score(pipe, decoder, sampling, labels, batch_size, seed, scorer, progress)})
    return rows


@torch.no_grad()
def forward_cost_rows(preset: str, windows: Sequence[int], batch_sizes: Sequence[int], device: torch.device,
                      dtype: torch.dtype, guidance: bool, repeats: int, warmup: int,
                      progress: Optional[tqdm] = None) -> list[dict]:
    """Latency of one W-token forward (the verify step) vs a 1-token AR step, cache half full."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaGenTransformer(LlamaGenConfig.from_preset(preset)).eval().to(dtype)
    token_model = LlamaGenTokenModel(model)
    rows = []
    for batch in batch_sizes:
        labels = torch.arange(batch, device=device)
        base = None
        for window in windows:
            plan(progress, warmup + repeats, f"{preset} batch {batch} window {window}")
            state = token_model.start(labels, model.config.block_size + 2 * max(windows), guidance=guidance)
            state.cache.advance(model.config.block_size // 2)
            tokens = torch.randint(0, model.config.vocab_size, (batch, window), device=device)
            for _ in range(warmup):
                token_model.forward(state, tokens)
                tick(progress)
            times = []
            for _ in range(repeats):
                sync(device)
                start = time.perf_counter()
                token_model.forward(state, tokens)
                sync(device)
                times.append(time.perf_counter() - start)
                tick(progress)
            seconds = statistics.median(times)
            base = seconds if window == 1 else base
            rows.append({"preset": preset, "batch": batch, "window": window, "ms_per_forward": seconds * 1e3,
                         "cost_vs_ar_step": seconds / base if base else None})
    return rows

