"""Decoders for next-scale models (`ScaleModel`): plain scale-by-scale decoding and
collaborative decoding, where models of different sizes take turns over the scales."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol, Sequence

import torch

from mmgen.decoding.base import BaseDecoder, DecodeOutput, Progress, check_int, raise_if_masked
from mmgen.decoding.stats import StageCounters, StatsRecorder
from mmgen.deprecation import renamed_keywords
from mmgen.modeling import ScaleModel
from mmgen.sampling import SamplingConfig, invalid_rows, sample


class MapSmoothing(Protocol):
    """Turns a step's probabilities into the soft map fed to the next step (weights [B, n, V]);
    the sampled tokens are still what the decoder returns. VAR's `more_smooth` is one."""

    def __call__(self, probs: torch.Tensor, step: int, num_steps: int, generator: torch.Generator) -> torch.Tensor: ...


#: Token maps [B, step_sizes[k]] for every step k, and the decode's statistics.
ScaleDecodeOutput = DecodeOutput


def as_scale_model(model: Any, role: str = "model") -> ScaleModel:
    """A `ScaleModel` from a scale model or from anything with `scale_model()` (a pipeline)."""
    if hasattr(model, "scale_model") and callable(model.scale_model):
        model = model.scale_model()
    if not isinstance(model, ScaleModel):
        raise ValueError(f"{role} must be a ScaleModel or a pipeline with scale_model(), got {type(model).__name__}")
    return model


class ScaleDecoder(BaseDecoder):
    """Base class of next-scale decoders: `generate(model, conditions, sampling, generator)`
    decodes every step."""

    family: ClassVar[str] = "scale"

    def generate(
        self,
        model: ScaleModel,
        conditions: Any,
        sampling: SamplingConfig,
        generator: torch.Generator,
        progress: Optional[Progress] = None,
        smoothing: Optional[MapSmoothing] = None,
    ) -> ScaleDecodeOutput:
        return decode_schedule(self.schedule(model), conditions, sampling, generator, progress, smoothing)

    def schedule(self, model: ScaleModel) -> list[tuple[ScaleModel, int]]:
        """(model, first step) pairs in step order; each model decodes until the next one's first step."""
        raise NotImplementedError


@dataclass
class NextScale(ScaleDecoder):
    """One forward per scale, with the model's KV cache carried across scales (the official
    VAR sampler, `autoregressive_infer_cfg`)."""

    def schedule(self, model: ScaleModel) -> list[tuple[ScaleModel, int]]:
        return [(as_scale_model(model), 0)]


@renamed_keywords(refiner="small", draft_steps="large_steps")
@dataclass
class Collaborative(ScaleDecoder):
    """Collaborative decoding (CoDe; Chen et al., CVPR 2025, arXiv 2411.17787): shortcut
    "collaborative", as the video's `CollaborativeDenoising`.

    The pipeline's (large) model decodes the first `large_steps` scales, where few tokens carry
    the image's content; its cache is then freed, and `small` (a smaller model on the same
    tokenizer) feeds every map decoded so far in one block-causal prefill and decodes the
    remaining, large scales, which hold most of the tokens and most of the cost. Training-free
    with two official checkpoints (e.g. VAR-d30 large, VAR-d16 small).

    `handoffs` generalises the hand-off to any number of models: [(model or None, first step),
    ...], None standing for the pipeline's own model; it overrides `small`/`large_steps`.
    `large_steps=None` gives the large model all but the last two steps: the paper's N = 8 of
    VAR's 10 scales, and a valid split for a model with fewer scales. (`refiner=` and
    `draft_steps=` are the old names of `small=` and `large_steps=`, removed in 0.3.)
    """

    small: Any = None
    large_steps: Optional[int] = None
    handoffs: Optional[Sequence[tuple[Any, int]]] = None

    def __post_init__(self):
        if self.large_steps is not None:
            check_int("large_steps", self.large_steps, 1)

    def schedule(self, model: ScaleModel) -> list[tuple[ScaleModel, int]]:
        model = as_scale_model(model)
        if self.handoffs is not None:
            stages = [(model if m is None else as_scale_model(m, "a collaborative stage's model"), s) for m, s in self.handoffs]
        elif self.small is None:
            raise ValueError("Collaborative needs small=: a smaller model on the same tokenizer")
        else:
            large = max(1, len(model.step_sizes) - 2) if self.large_steps is None else self.large_steps
            stages = [(model, 0), (as_scale_model(self.small, "small"), large)]
        steps = len(model.step_sizes)
        starts = [s for _, s in stages]
        if not stages or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= steps:
            raise ValueError(f"stage first steps {starts} must start at 0, increase, and stay below the model's {steps} steps")
        for other, _ in stages[1:]:
            if other.vocab_size != model.vocab_size or tuple(other.step_sizes) != tuple(model.step_sizes):
                raise ValueError(
                    f"collaborating models must share the tokenizer and scales: vocabulary {other.vocab_size} vs "
                    f"{model.vocab_size}, steps {tuple(other.step_sizes)} vs {tuple(model.step_sizes)}"
                )
        return stages


def decode_schedule(
    stages: list[tuple[ScaleModel, int]],
    conditions: Any,
    sampling: SamplingConfig,
    generator: torch.Generator,
    progress: Optional[Progress] = None,
    smoothing: Optional[MapSmoothing] = None,
) -> ScaleDecodeOutput:
    """Decode every step, model by model. A model's cache is sized for its own steps and freed
    before the next model starts; the next model first feeds every map decoded so far."""
    sizes = tuple(stages[0][0].step_sizes)
    num_steps = len(sizes)
    fed: list[torch.Tensor] = []  # what every later model must feed: tokens, or soft maps
    tokens: list[torch.Tensor] = []
    recorder, bad, cache_bytes, stage_forwards, stage_tokens = None, None, 0, [], []
    stops = [first for _, first in stages[1:]] + [num_steps]
    for (model, first), stop in zip(stages, stops):
        state = model.start(conditions, stop, sampling.uses_guidance)
        if recorder is None:
            recorder = StatsRecorder(state.device, max_accepted=1)
            bad = torch.zeros(state.batch_size, dtype=torch.bool, device=state.device)
            ones = torch.ones(state.batch_size, dtype=torch.long, device=state.device)
        pending = fed[:first]
        before = recorder.forwards
        for step in range(first, stop):
            logits = model.forward(state, pending)
            probs = sampling.probs(logits, torch.full(logits.cond.shape[:2], step, device=state.device))
            bad |= invalid_rows(probs).any(-1)
            tokens.append(sample(probs, generator))
            fed.append(tokens[-1] if smoothing is None else smoothing(probs, step, num_steps, generator))
            pending = fed[-1:]
            recorder.record(ones, ones.bool())
            if progress is not None:
                progress.update(1)
        stage_forwards.append(recorder.forwards - before)
        stage_tokens.append(sum(sizes[first:stop]) * state.batch_size)
        cache_bytes = max(cache_bytes, state.cache_bytes)
        del state  # frees this model's cache before the next model allocates its own
    raise_if_masked(bad)
    stats = recorder.finish(sum(sizes), len(tokens[0]), cache_bytes)
    stats.extra, stats.baseline_forwards = StageCounters(stage_forwards, stage_tokens), num_steps
    return ScaleDecodeOutput(tokens, stats)
