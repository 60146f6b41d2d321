"""VAR as the core's `ScaleModel`: the transformer predicts, the VQVAE turns each decoded map
into the next scale's input (f_hat accumulated, then area-downsampled)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mmgen.decoding.pruning import CachedTokenPruning
from mmgen.modeling import ScaleState
from mmgen.sampling import Logits

from mmgen.image_ar.var.transformer import VARTransformer
from mmgen.image_ar.var.vqvae import MultiScaleVQVAE


class VARScaleModel:
    """Class-conditional VAR behind the `ScaleModel` protocol.

    Conditions are class ids [B]. With guidance the batch holds the B conditional rows, then B
    rows of the null class (`num_classes`), as the official sampler. `pruning` turns on
    FastVAR's cached token pruning at the scales it names.
    """

    def __init__(self, transformer: VARTransformer, vqvae: MultiScaleVQVAE, pruning: Optional[CachedTokenPruning] = None):
        config = transformer.config
        if tuple(config.patch_nums) != tuple(vqvae.config.patch_nums) or config.vocab_size != vqvae.config.vocab_size:
            raise ValueError(
                f"transformer (patch_nums {tuple(config.patch_nums)}, vocabulary {config.vocab_size}) does not match the "
                f"VQVAE (patch_nums {tuple(vqvae.config.patch_nums)}, vocabulary {vqvae.config.vocab_size})"
            )
        if pruning is not None:
            pruning.check(len(config.patch_nums))
        self.transformer, self.vqvae, self.pruning = transformer, vqvae, pruning
        self.vocab_size = config.vocab_size
        self.step_sizes = tuple(config.step_sizes)

    def start(self, conditions: torch.Tensor, num_steps: int, guidance: bool) -> ScaleState:
        labels = conditions.long()
        if guidance:
            labels = torch.cat([labels, torch.full_like(labels, self.transformer.config.num_classes)])
        weight = self.transformer.class_emb.weight
        cache = self.transformer.new_cache(len(labels), sum(self.step_sizes[:num_steps]), dtype=weight.dtype, device=weight.device)
        extra = _Progress(cond=self.transformer.condition(labels))
        return ScaleState(cache, len(conditions), guidance, weight.device, extra=extra)

    def forward(self, state: ScaleState, token_maps: Sequence[torch.Tensor]) -> Logits:
        progress: _Progress = state.extra
        fresh = progress.processed == 0
        chunks, cfg_rows = [], 2 if state.guidance else 1
        if fresh:
            chunks.append(self.transformer.start_tokens(progress.cond))
        inputs = []
        for tokens in token_maps:
            progress.f_hat, nxt = self.vqvae.quantize.add_scale(progress.f_hat, state.steps_fed, tokens)
            state.steps_fed += 1
            inputs.append(nxt)
        first = 0 if fresh else progress.processed
        last = state.steps_fed  # the step these logits predict
        if inputs:
            x = torch.cat(inputs, 1).repeat(cfg_rows, 1, 1)
            chunks.append(self.transformer.scale_tokens(x, first_step=first if not fresh else 1, num_steps=len(inputs)))
        if last < first:
            raise ValueError("a next-scale forward needs the token map of the last predicted step")
        x = torch.cat(chunks, 1)
        num_steps = last - first + 1
        if num_steps > 1 and self.pruning is not None and self.pruning.keep_ratio(last, len(self.step_sizes)) < 1.0:
            # A pruned scale runs alone: prefill the earlier scales of a hand-off first.
            split = x.shape[1] - self.step_sizes[last]
            self.transformer.decode(x[:, :split], progress.cond, state.cache, first, num_steps - 1, self.pruning)
            x, first, num_steps = x[:, split:], last, 1
        logits = self.transformer.decode(x, progress.cond, state.cache, first_step=first, num_steps=num_steps, pruning=self.pruning)
        progress.processed = last + 1
        logits = logits[:, -self.step_sizes[last]:]
        B = state.batch_size
        return Logits(logits[:B], logits[B:] if state.guidance else None)


@dataclass
class _Progress:
    """The adapter's bookkeeping: class embeddings of the CFG batch, f_hat so far, and how many
    steps the transformer has processed (its cache holds their keys and values)."""

    cond: torch.Tensor
    f_hat: Optional[torch.Tensor] = None
    processed: int = 0


@dataclass(frozen=True)
class MoreSmooth:
    """VAR's `more_smooth` (visualisation only; the official FID numbers do not use it): the
    next scale is fed the codebook mean under a Gumbel-softmax of the guided, filtered logits
    sharpened by (1 + r), at temperature max(0.27 (1 - 0.95 r), 0.005), r = step / (n - 1).

    log(probs) stands in for the logits: it differs by a per-row constant, which softmax ignores.
    """

    def __call__(self, probs: torch.Tensor, step: int, num_steps: int, generator: torch.Generator) -> torch.Tensor:
        ratio = step / max(num_steps - 1, 1)
        tau = max(0.27 * (1 - ratio * 0.95), 0.005)
        gumbel = -torch.empty_like(probs).exponential_(generator=generator).log()
        return ((probs.log() * (1 + ratio) + gumbel) / tau).softmax(-1)
