"""Speculative sampling for continuous tokens (continuous speculative decoding, CSpD: Wang et
al., arXiv 2411.11925).

A continuous-token model (MAR, next-token diffusion) samples each token through a diffusion
head. With the draft and the target head run on the *same* noise (denoising-trajectory
alignment), each reports the Gaussian of its final denoising step, N(mean, std^2), from which
its token was drawn. Speculative sampling then works on these densities as on discrete ones:
keep the draft's x with probability min(1, p(x) / q(x)); otherwise draw from the residual
max(0, p - q) / (1 - overlap). The output follows p exactly when p and q are the densities the
tokens come from (tested on toy heads with known densities).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from mmgen.decoding.base import BaseDecoder, DecodeOutput, check_int
from mmgen.decoding.stats import DraftCounters, StatsRecorder
from mmgen.modeling import ContinuousModel, ContinuousState, HeadSample
from mmgen.sampling import SamplingConfig


@dataclass
class GaussianTokens:
    """Diagonal Gaussians, one per token: `mean` and `std` [N, D] (std broadcastable)."""

    mean: torch.Tensor
    std: torch.Tensor

    def log_prob(self, x: torch.Tensor, flatten: float = 1.0) -> torch.Tensor:
        """log N(x; mean, std^2) summed over D -> [N]; `flatten` > 1 divides the quadratic term
        by flatten^2 (a flatter, unnormalised density)."""
        z = (x.float() - self.mean.float()) / self.std.float()
        log_norm = torch.log(self.std.float()).expand_as(z).sum(-1) + 0.5 * z.shape[-1] * math.log(2 * math.pi)
        return -0.5 * z.square().sum(-1) / flatten**2 - log_norm

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        noise = torch.randn(self.mean.shape, generator=generator, device=self.mean.device, dtype=torch.float32)
        return self.mean.float() + self.std.float() * noise


@dataclass
class ContinuousAcceptance:
    """Accept or replace draft tokens x ~ q by the target p, both diagonal Gaussians.

    Args:
        flatten: divides both Gaussians' exponents by flatten^2 in the acceptance ratio. The
            reference implementation uses 42 (its `inner_temperature`): ratios move towards
            the ratio of normalisers and far more drafts are kept, but the output no longer
            follows p. 1.0 (the default) is the exact ratio.
        max_tries: rejection-sampling rounds for the residual. Each round proposes y ~ p and
            keeps it with probability max(0, 1 - q(y) / p(y)), a valid bound since
            (p - q)+ <= p. A row with no kept proposal after `max_tries` rounds takes its
            last proposal, an exact sample of p (never a zero token). This is counted in
            `fallbacks`: it biases the output only on those rows, with probability
            (1 - TV(p, q))^max_tries.
    """

    flatten: float = 1.0
    max_tries: int = 100

    def __post_init__(self):
        if not isinstance(self.flatten, (int, float)) or not self.flatten >= 1.0:
            raise ValueError(f"flatten must be a number >= 1 (1 is exact), got {self.flatten!r}")
        if isinstance(self.max_tries, bool) or not isinstance(self.max_tries, int) or self.max_tries < 1:
            raise ValueError(f"max_tries must be an integer >= 1, got {self.max_tries!r}")

    def accept_prob(self, x: torch.Tensor, draft: GaussianTokens, target: GaussianTokens) -> torch.Tensor:
        """min(1, p(x) / q(x)) per token [N] (with `flatten`, the flattened ratio)."""
        return (target.log_prob(x, self.flatten) - draft.log_prob(x, self.flatten)).clamp(max=0).exp()

    def residual(self, draft: GaussianTokens, target: GaussianTokens, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [N, D] of max(0, p - q) / Z by rejection from p, and the rows [N] that fell back."""
        out = torch.zeros_like(target.mean, dtype=torch.float32)
        done = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        for _ in range(self.max_tries):
            y = target.sample(generator)
            keep_prob = (1 - (draft.log_prob(y) - target.log_prob(y)).exp()).clamp(min=0)
            u = torch.rand(keep_prob.shape, generator=generator, device=out.device)
            take = (u < keep_prob) & ~done
            out[take] = y[take]
            done |= take
            if bool(done.all()):
                return out, ~done
        out[~done] = y[~done]  # fallback: an exact sample of p
        return out, ~done

    def __call__(self, x: torch.Tensor, draft: GaussianTokens, target: GaussianTokens,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Verified tokens [N, D], which drafts were kept [N], and how many rows fell back."""
        accept = torch.rand(x.shape[0], generator=generator, device=x.device) < self.accept_prob(x, draft, target)
        if bool(accept.all()):
            return x, accept, 0
        rejected = (~accept).nonzero().flatten()
        sub = lambda g: GaussianTokens(g.mean[rejected], g.std.expand_as(g.mean)[rejected])
        replacement, fell_back = self.residual(sub(draft), sub(target), generator)
        out = x.float().clone()
        out[rejected] = replacement
        return out.to(x.dtype), accept, int(fell_back.sum())


# --------------------------------------------------------------------------------------------
# Decoders
# --------------------------------------------------------------------------------------------


#: The canvas [B, L, D] of generated tokens and the decode's statistics.
ContinuousOutput = DecodeOutput


def noise_table(model: ContinuousModel, batch: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """The head's noise for every position, drawn once [B, L, head_steps + 1, D]: whichever
    model samples a position uses this noise (denoising-trajectory alignment)."""
    shape = (batch, model.num_tokens, model.head_steps + 1, model.token_dim)
    return torch.randn(shape, generator=generator, device=device)


def _gather(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    index = positions.reshape(*positions.shape, *([1] * (table.ndim - 2)))
    return table.gather(1, index.expand(*positions.shape, *table.shape[2:]))


def _commit(state: ContinuousState, positions: torch.Tensor, values: torch.Tensor) -> None:
    state.tokens.scatter_(1, positions[..., None].expand(-1, -1, values.shape[-1]), values.to(state.tokens.dtype))
    state.known.scatter_(1, positions, True)


def _guidance(sampling: SamplingConfig, state: ContinuousState, after_step: torch.Tensor) -> torch.Tensor:
    """Per-row guidance scales [B] for a step; the schedule's index is the number of tokens
    known after the step (MAR's "linear" CFG grows with it)."""
    return sampling.guidance.scales(after_step).to(state.device)


def check_continuous_sampling(sampling: SamplingConfig) -> None:
    """ValueError unless `sampling` suits continuous tokens: temperature and guidance only
    (top-k and top-p filter discrete logits)."""
    if sampling.top_k or sampling.top_p < 1.0:
        raise ValueError("top-k and top-p filter discrete logits; continuous tokens take temperature and guidance only")


def _step(model: ContinuousModel, state: ContinuousState, positions: torch.Tensor, noise: torch.Tensor,
          sampling: SamplingConfig) -> HeadSample:
    after = state.known.sum(1) + positions.shape[1]
    out = model.sample(model.head_inputs(state, positions), _gather(noise, positions), sampling.temperature,
                       _guidance(sampling, state, after))
    _commit(state, positions, out.x)
    return out


#: Masked steps of a model that names no default of its own (MAR's official 64).
DEFAULT_NUM_STEPS = 64


class ContinuousDecoder(BaseDecoder):
    """Base class of masked continuous decoders: `generate(model, conditions, sampling,
    generator)` fills the canvas.

    `num_steps` None (the default) runs the model's own step count (`model.default_num_steps`,
    e.g. a pipeline's saved `num_iter`; `DEFAULT_NUM_STEPS` for a model without one), so a
    decoder object and a shortcut run the same schedule unless one is set explicitly.
    """

    family: ClassVar[str] = "continuous"

    num_steps: Optional[int]

    def steps_for(self, model: ContinuousModel) -> int:
        """The masked steps this decoder runs on `model`."""
        return self.num_steps if self.num_steps is not None else getattr(model, "default_num_steps", DEFAULT_NUM_STEPS)

    def generate(self, model: ContinuousModel, conditions: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator) -> ContinuousOutput:
        raise NotImplementedError


@dataclass
class MaskedContinuous(ContinuousDecoder):
    """One head sample per position, a schedule of position sets (MAR's sampler: random order,
    cosine mask schedule over `num_steps` iterations)."""

    num_steps: Optional[int] = None

    def __post_init__(self):
        if self.num_steps is not None:
            check_int("num_steps", self.num_steps, 1)

    def generate(self, model: ContinuousModel, conditions: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator) -> ContinuousOutput:
        check_continuous_sampling(sampling)
        state = model.start(conditions, sampling.uses_guidance)
        recorder = StatsRecorder(state.device, max_accepted=1)
        noise = noise_table(model, state.tokens.shape[0], state.device, generator)
        ones = torch.ones(state.tokens.shape[0], dtype=torch.long, device=state.device)
        num_steps = self.steps_for(model)
        for positions in model.schedule(state, num_steps, generator):
            _step(model, state, positions, noise, sampling)
            recorder.record(ones, ones.bool())
        stats = recorder.finish(model.num_tokens, state.tokens.shape[0], 0)
        stats.baseline_forwards = num_steps
        return ContinuousOutput(state.tokens, stats)


@dataclass
class ContinuousSpeculative(ContinuousDecoder):
    """Continuous speculative decoding (CSpD, arXiv 2411.11925) on any `ContinuousModel`.

    The first `prefill_ratio` of the steps run on the target alone. Then the drafter runs
    `num_draft` steps on the shared canvas and noise table; the target scores every drafted
    step in one batched forward, each step on the canvas its draft saw (so a drafter equal to
    the target keeps everything); `acceptance` keeps or replaces each token. Steps are
    committed in order up to the first step where any row replaced a token (that step is
    committed with its replacements); later drafted steps are discarded and drafted again.
    Given the shared trajectory noise, the draft's token and the target's are Gaussians of
    their final denoising steps, so with `ContinuousAcceptance()` (flatten 1) every committed
    token follows the target's head exactly. Discarding steps because of *other* rows'
    rejections does not bias a row: rows are independent.

    The reference verifies a window on the pre-window canvas in one unbatched forward; that is
    cheaper but conditions later drafted steps differently from their drafts, so even a
    drafter equal to the target rejects tokens there.
    """

    drafter: Any = None
    num_steps: Optional[int] = None
    num_draft: int = 8
    prefill_ratio: float = 0.15
    acceptance: ContinuousAcceptance = field(default_factory=ContinuousAcceptance)

    def __post_init__(self):
        if self.num_steps is not None:
            check_int("num_steps", self.num_steps, 1)
        check_int("num_draft", self.num_draft, 1)
        if not isinstance(self.prefill_ratio, (int, float)) or not 0.0 <= self.prefill_ratio <= 1.0:
            raise ValueError(f"prefill_ratio must be in [0, 1], got {self.prefill_ratio!r}")

    def generate(self, model: ContinuousModel, conditions: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator) -> ContinuousOutput:
        check_continuous_sampling(sampling)
        drafter = self.drafter.continuous_model() if hasattr(self.drafter, "continuous_model") else self.drafter
        if drafter is None:
            raise ValueError("ContinuousSpeculative needs a drafter: a smaller model with the same token space")
        if (drafter.num_tokens, drafter.token_dim, drafter.head_steps) != (model.num_tokens, model.token_dim, model.head_steps):
            raise ValueError("drafter and target must share the number of tokens, token dimension and head steps")
        state = model.start(conditions, sampling.uses_guidance)
        B, device = state.tokens.shape[0], state.device
        recorder = StatsRecorder(device, max_accepted=self.num_draft)  # steps committed per target forward
        noise = noise_table(model, B, device, generator)
        steps = model.schedule(state, self.steps_for(model), generator)
        ones = torch.ones(B, dtype=torch.long, device=device)
        prefill = min(len(steps), math.ceil(self.prefill_ratio * len(steps)))
        for positions in steps[:prefill]:
            _step(model, state, positions, noise, sampling)
            recorder.record(ones, ones.bool())
        drafted = kept = fallbacks = draft_forwards = 0
        done = prefill
        while done < len(steps):
            window = steps[done : done + self.num_draft]
            canvases, drafts = [], []
            for positions in window:
                canvases.append(ContinuousState(state.tokens.clone(), state.known.clone(), state.conditions, state.guidance))
                drafts.append(_step(drafter, state, positions, noise, sampling))
                draft_forwards += 1
            # One target forward over every drafted step, each on its draft's canvas (padded to
            # the widest step by repeating a position; the copies are ignored).
            width = max(p.shape[1] for p in window)
            pad = lambda t: torch.cat([t, t[:, :1].expand(-1, width - t.shape[1], *t.shape[2:])], 1)
            stacked = ContinuousState(torch.cat([c.tokens for c in canvases]), torch.cat([c.known for c in canvases]),
                                      torch.cat([state.conditions] * len(window)), state.guidance)
            positions = torch.cat([pad(p) for p in window])
            after = torch.cat([c.known.sum(1) + p.shape[1] for c, p in zip(canvases, window)])
            target = model.sample(model.head_inputs(stacked, positions), _gather(noise.repeat(len(window), 1, 1, 1), positions),
                                  sampling.temperature, _guidance(sampling, stacked, after))
            commit_to = len(window)
            verified = []
            for j, (p, d) in enumerate(zip(window, drafts)):
                n = p.shape[1]
                t_mean, t_std = (x[j * B : (j + 1) * B, :n] for x in (target.mean, target.std))
                out, accept, fb = self.acceptance(
                    d.x.flatten(0, 1), GaussianTokens(d.mean.flatten(0, 1), d.std.expand_as(d.mean).flatten(0, 1)),
                    GaussianTokens(t_mean.flatten(0, 1), t_std.expand_as(t_mean).flatten(0, 1)), generator)
                verified.append(out.view_as(d.x))
                drafted, kept, fallbacks = drafted + accept.numel(), kept + int(accept.sum()), fallbacks + fb
                if not bool(accept.all()):
                    commit_to = j + 1
                    break
            # Roll the canvas back to the window's start and commit the verified steps.
            state.tokens, state.known = canvases[0].tokens, canvases[0].known
            for p, values in zip(window[:commit_to], verified):
                _commit(state, p, values)
            recorder.record(ones * commit_to, ones.bool())
            done += commit_to
        stats = recorder.finish(model.num_tokens, B, 0)
        stats.baseline_forwards = len(steps)
        stats.extra = DraftCounters(draft_forwards, drafted, kept, fallbacks)
        return ContinuousOutput(state.tokens, stats)
