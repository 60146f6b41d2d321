"""Logits -> probabilities -> tokens, always in float32 and always through an explicit generator.

The pieces follow transformers' vocabulary: a guidance schedule decides the classifier-free
guidance scale per generated token, a `SamplingConfig` turns (cond, uncond) logits into float32
probabilities (CFG, temperature, top-k, top-p), and `sample` draws from them with a
`torch.Generator` and no host synchronisation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch


class AllTokensMaskedError(ValueError):
    """Every logit of a row was -inf (or NaN) after processing: there is nothing to sample."""


@dataclass(frozen=True)
class Logits:
    """A model's next-token logits for `n` positions per row, conditional and unconditional.

    `cond` is [B, n, V]; `uncond` is the same shape when the model ran a classifier-free
    guidance batch, else None.
    """

    cond: torch.Tensor
    uncond: Optional[torch.Tensor] = None

    def __getitem__(self, index) -> "Logits":
        return Logits(self.cond[index], None if self.uncond is None else self.uncond[index])


# --------------------------------------------------------------------------------------------
# Guidance schedules: the CFG scale as a function of the generated token's index.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConstantGuidance:
    """The same CFG scale for every token (Ho & Salimans 2022, arXiv 2207.12598)."""

    scale: float = 1.0

    def __post_init__(self):
        check_sampling_values(guidance_scale=self.scale)

    @property
    def max_scale(self) -> float:
        """The largest scale the schedule uses: 1.0 means no unconditional rows are needed."""
        return self.scale

    def scales(self, index: torch.Tensor) -> torch.Tensor:
        return torch.full(index.shape, self.scale, dtype=torch.float32, device=index.device)


@dataclass(frozen=True)
class IntervalGuidance(ConstantGuidance):
    """LlamaGen's `cfg_interval`: guidance for the first tokens only, then the conditional logits.

    The official decoder guides the prefill token and the decode steps `i <= interval`, where
    step i produces token i + 1; so token t is guided when t <= interval + 1. A negative
    interval (the official default -1) guides every token.
    """

    interval: int = -1

    def scales(self, index: torch.Tensor) -> torch.Tensor:
        on = torch.ones_like(index, dtype=torch.bool) if self.interval < 0 else index <= self.interval + 1
        return torch.where(on, self.scale, 1.0).to(torch.float32)


@dataclass(frozen=True)
class RampGuidance(ConstantGuidance):
    """VAR's per-scale ramp (Tian et al. 2024, arXiv 2404.02905): step k of n is guided as
    (1 + t) c - t u with t = scale * k / (n - 1), so the first scale is unguided and the last
    gets 1 + scale. `index` is the step (the scale), not a token position."""

    num_steps: int = 2

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps must be an integer >= 1, got {self.num_steps!r}")

    @property
    def max_scale(self) -> float:
        return 1.0 + self.scale

    def scales(self, index: torch.Tensor) -> torch.Tensor:
        ratio = index.to(torch.float32) / max(self.num_steps - 1, 1)
        return 1.0 + self.scale * ratio


@dataclass(frozen=True)
class LinearProgressGuidance(ConstantGuidance):
    """MAR's "linear" CFG schedule (after Muse): 1 + (scale - 1) * k / total, where the index k
    is the number of tokens known after the step, so guidance grows as the image fills in. As
    in the official sampler, k counts at most total - 1 (its last step computes the scale with
    one token still masked)."""

    total: int = 1

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total < 1:
            raise ValueError(f"total must be an integer >= 1, got {self.total!r}")

    def scales(self, index: torch.Tensor) -> torch.Tensor:
        return 1.0 + (self.scale - 1.0) * index.clamp(max=self.total - 1).to(torch.float32) / self.total


#: Anything with `max_scale` and `scales(index)`; every schedule above derives from ConstantGuidance.
GuidanceSchedule = ConstantGuidance


def apply_guidance(logits: Logits, scale: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance u + s * (c - u) in float32; `scale` broadcasts over [B, n].

    Where s == 1 the conditional logits are returned bit-exactly, as the official samplers do
    when guidance is switched off.
    """
    cond = logits.cond.float()
    if logits.uncond is None:
        return cond
    uncond = logits.uncond.float()
    s = scale.to(cond.device)[..., None]
    return torch.where(s == 1.0, cond, uncond + s * (cond - uncond))


# --------------------------------------------------------------------------------------------
# Sampling configuration: temperature, top-k, top-p.
# --------------------------------------------------------------------------------------------


@dataclass
class SamplingConfig:
    """How logits become probabilities: CFG schedule, then temperature, top-k and top-p.

    temperature == 0 means greedy (a one-hot distribution on the argmax); top_k == 0 and
    top_p == 1 disable those filters, and so does a top_k at or above the vocabulary (it keeps
    every token). Probabilities are always float32.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    guidance: GuidanceSchedule = field(default_factory=ConstantGuidance)

    def __post_init__(self):
        check_sampling_values(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        if isinstance(self.guidance, (int, float)):
            self.guidance = ConstantGuidance(float(self.guidance))

    @property
    def uses_guidance(self) -> bool:
        """Whether the model must run the unconditional half of a CFG batch."""
        return self.guidance.max_scale != 1.0

    def probs(self, logits: Logits, index: torch.Tensor) -> torch.Tensor:
        """float32 probabilities [..., V] for tokens at generated-token positions `index` [...]."""
        guided = apply_guidance(logits, self.guidance.scales(index))
        return logits_to_probs(guided, self.temperature, self.top_k, self.top_p)


# --------------------------------------------------------------------------------------------
# A pipeline call's sampling: keyword arguments, or one `sampling=` object mapped onto them.
# --------------------------------------------------------------------------------------------

#: The sampling keyword arguments pipelines take (each takes those that fit it); `sampling=`
#: maps onto them.
SAMPLING_KEYWORDS = ("temperature", "top_k", "top_p", "guidance_scale", "cfg_interval", "cfg_schedule")


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_sampling_values(**values: Any) -> None:
    """The one check of sampling values, with one wording wherever they come from (a
    `SamplingConfig`, a pipeline's keyword arguments, a `sampling=` dict): ValueError for the
    first bad one. None means unset."""
    checks = {
        "temperature": (lambda v: _number(v) and math.isfinite(v) and v >= 0, "must be >= 0 (0 means greedy)"),
        "top_k": (lambda v: not isinstance(v, bool) and isinstance(v, int) and v >= 0, "must be an integer >= 0 (0 disables it)"),
        "top_p": (lambda v: _number(v) and 0.0 < v <= 1.0, "must be in (0, 1]"),
        "guidance_scale": (lambda v: _number(v) and math.isfinite(v) and v >= 0, "must be a finite number >= 0"),
        "cfg_interval": (lambda v: not isinstance(v, bool) and isinstance(v, int), "must be an integer (-1: every token)"),
        "cfg_schedule": (lambda v: isinstance(v, str), "must be a schedule name"),
    }
    for name, value in values.items():
        if name not in checks:
            raise ValueError(f"unknown sampling setting {name!r}: settings are {', '.join(SAMPLING_KEYWORDS)}")
        valid, rule = checks[name]
        if value is not None and not valid(value):
            label = "guidance scale" if name == "guidance_scale" else name
            raise ValueError(f"{label} {rule}, got {value!r}")


def sampling_keywords(sampling: Union["SamplingConfig", Mapping[str, Any]], accepted: Sequence[str]) -> dict[str, Any]:
    """`sampling` as keyword arguments of a call that takes the `accepted` ones: a dict's items
    (each one `accepted`), or a `SamplingConfig`'s temperature, top-k, top-p and guidance (a
    constant scale as `guidance_scale`, LlamaGen's interval as `cfg_interval` too; settings the
    call cannot take must be at their neutral values). ValueError for anything else."""
    if isinstance(sampling, SamplingConfig):
        found: dict[str, Any] = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
        guidance = sampling.guidance
        if type(guidance) not in (ConstantGuidance, IntervalGuidance):
            raise ValueError(f"sampling= takes a constant or interval guidance, not {type(guidance).__name__}: give "
                             "guidance_scale (and cfg_interval or cfg_schedule where the pipeline takes them) instead")
        found["guidance_scale"] = guidance.scale
        if isinstance(guidance, IntervalGuidance):
            found["cfg_interval"] = guidance.interval
        neutral = {"top_k": 0, "top_p": 1.0, "guidance_scale": 1.0, "cfg_interval": -1}
        missing = [k for k in found if k not in accepted and found[k] != neutral.get(k)]
        if missing:
            raise ValueError(f"this pipeline takes no {' or '.join(missing)}: its sampling settings are {', '.join(accepted)}")
        return {k: v for k, v in found.items() if k in accepted}
    if not isinstance(sampling, Mapping):
        raise ValueError(f"sampling must be a SamplingConfig or a dict of settings, got {type(sampling).__name__}")
    unknown = [k for k in sampling if k not in accepted]
    if unknown:
        raise ValueError(f"unknown sampling setting {unknown[0]!r} for this pipeline: its settings are {', '.join(accepted)}")
    return dict(sampling)


def takes_sampling(call: Callable) -> Callable:
    """Give a pipeline's `__call__` the `sampling=` argument, as transformers' `generate` takes a
    `GenerationConfig`: a `SamplingConfig` or a dict that maps onto the call's own sampling
    keywords (those of `SAMPLING_KEYWORDS` it takes). A keyword given both ways must agree.
    Every sampling value is checked here, before any work (`check_sampling_values`)."""
    signature = inspect.signature(call)
    accepted = tuple(k for k in SAMPLING_KEYWORDS if k in signature.parameters)

    @functools.wraps(call)
    def wrapper(*args: Any, sampling: Union["SamplingConfig", Mapping[str, Any], None] = None, **kwargs: Any):
        bound = signature.bind_partial(*args, **kwargs)
        if sampling is not None:
            for name, value in sampling_keywords(sampling, accepted).items():
                given = bound.arguments.get(name)
                if given is not None and given != value:
                    raise ValueError(f"{name} is given twice with different values: {given!r} and sampling's {value!r}")
                bound.arguments[name] = value
        check_sampling_values(**{k: bound.arguments[k] for k in accepted if k in bound.arguments})
        return call(*bound.args, **bound.kwargs)

    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    parameters.insert(at, inspect.Parameter("sampling", inspect.Parameter.KEYWORD_ONLY, default=None))
    wrapper.__signature__ = signature.replace(parameters=parameters)
    return wrapper


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, top-k and top-p (in that order, as LlamaGen's sampler) -> float32 probs.

    Top-k keeps ties with the k-th logit; top-p keeps sorted tokens until the mass before the
    next one exceeds `top_p` (always at least one token). A row whose logits
    are all -inf comes out as NaN; `check_probs` turns that into an error.
    """
    logits = logits.float()
    if temperature == 0:
        return one_hot(logits.argmax(-1), logits.shape[-1])
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # unsorted: a third faster
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already exceeds top_p; the first always stays.
        drop_sorted = torch.zeros_like(cumulative, dtype=torch.bool)
        drop_sorted[..., 1:] = cumulative[..., :-1] > top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -math.inf)
    return logits.softmax(-1)


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 one-hot distributions [..., V] on `tokens` [...], built in place (no int64
    [..., V] intermediate: 8 bytes per entry at a 150k vocabulary)."""
    out = torch.zeros(*tokens.shape, vocab_size, device=tokens.device)
    return out.scatter_(-1, tokens[..., None], 1.0)


def invalid_rows(probs: torch.Tensor) -> torch.Tensor:
    """Bool mask [...] of distributions with no finite positive mass (all logits masked)."""
    return ~(torch.isfinite(probs).all(-1) & (probs.sum(-1) > 0))


def check_probs(probs: torch.Tensor) -> torch.Tensor:
    """Raise AllTokensMaskedError if any row has nothing left to sample (host sync)."""
    bad = invalid_rows(probs)
    if bool(bad.any()):
        rows = bad.reshape(-1).nonzero().flatten().tolist()[:8]
        raise AllTokensMaskedError(
            f"every token was masked for {int(bad.sum())} distribution(s) (first flat indices {rows}): "
            "the logits were all -inf or NaN before or after top-k/top-p; check the model output and filters"
        )
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per distribution [..., V] -> [...] without a host synchronisation.

    argmax(p / E) with E ~ Exp(1) i.i.d. is an exact sample from p (the exponential race used
    by gpt-fast), and draws its noise from `generator`, so a seed reproduces the output.
    """
    noise = exponential_noise(probs.shape, generator, probs.device, probs.dtype)
    # race(probs, noise) without a second [..., V] buffer; a draw has no gradient, so detach
    return torch.div(probs.detach(), noise, out=noise).argmax(-1)


def exponential_noise(shape: tuple, generator: torch.Generator, device: torch.device,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exp(1) noise of `shape`: the draws `sample` makes for probabilities of that shape and
    dtype from the same generator state (row b from generator b under `RowGenerators`)."""
    noise = torch.empty(shape, device=device, dtype=dtype)
    if isinstance(generator, RowGenerators):
        for b, (row, g) in enumerate(zip(noise, generator)):
            n = generator.slots(b, row.shape[0])
            row[:n].exponential_(generator=g)
            row[n:] = 1.0  # unread slots of a row that verifies fewer drafts (`RowGenerators.narrowed`)
    else:
        noise.exponential_(generator=generator)
    return noise


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) for given Exp(1) noise E: the sample `sample` draws, with the noise
    made explicit so a decoder can reuse one noise table across iterations (coupled drafts)."""
    return (probs / noise).argmax(-1)


def uniform(shape: tuple, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """U[0, 1) float32 draws from `generator` (acceptance tests of speculative decoders)."""
    if isinstance(generator, RowGenerators):
        out = torch.ones(shape, device=device, dtype=torch.float32)  # 1.0 accepts no draft: unread slots
        for b, g in enumerate(generator):
            n = generator.slots(b, shape[1], flat=len(shape) == 2)
            out[b, :n] = torch.rand((n, *shape[2:]), generator=g, device=device, dtype=torch.float32)
        return out
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def randint(high: int, shape: tuple, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform integers in [0, high) from `generator` (random drafts)."""
    if isinstance(generator, RowGenerators):
        return generator.stack(lambda g: torch.randint(0, high, shape[1:], generator=g, device=device))
    return torch.randint(0, high, shape, generator=generator, device=device)


class RowGenerators:
    """One `torch.Generator` per batch row, for continuous batching: `sample`, `uniform` and
    `randint` draw row b's share of a [B, ...] draw from generator b alone, in the order a
    batch-1 decode of that row would, so a row's tokens do not depend on its neighbours (nor
    on the step at which it joined the batch). Generators may be swapped per row (`[b] = g`)."""

    def __init__(self, generators):
        self.generators = list(generators)
        self.short: Optional[list[int]] = None  # per row, slots it does not draw (`narrowed`)
        self.codebooks = 1  # entries per slot of a flat [B, slots x codebooks] draw (`narrowed`)
        if not self.generators or not all(isinstance(g, torch.Generator) for g in self.generators):
            raise ValueError("RowGenerators takes one torch.Generator per row")
        devices = {torch.device(g.device) for g in self.generators}
        if len(devices) != 1:
            raise ValueError(f"the row generators are on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()

    def __len__(self) -> int:
        return len(self.generators)

    def __iter__(self):
        return iter(self.generators)

    def __getitem__(self, row: int) -> torch.Generator:
        return self.generators[row]

    def __setitem__(self, row: int, generator: torch.Generator) -> None:
        self.generators[row] = generator

    def select(self, rows) -> "RowGenerators":
        """The generators of `rows` (ints), in that order."""
        return RowGenerators([self.generators[int(b)] for b in rows])

    @contextlib.contextmanager
    def narrowed(self, short: list[int], codebooks: int = 1):
        """Within the block, row b's `uniform` and `exponential_noise` draws cover `short[b]`
        fewer slots (axis 1) than asked, the rest filled with 1.0: a row that verifies fewer
        drafts than the forward holds draws what a decode of it at its own window draws.
        Frames: a flat [B, n] uniform draw is over (slot, codebook) pairs, `codebooks` a slot."""
        self.short, self.codebooks = list(short), codebooks
        try:
            yield self
        finally:
            self.short, self.codebooks = None, 1

    def slots(self, row: int, n: int, flat: bool = False) -> int:
        """How many of `n` entries along axis 1 row `row` draws (all, outside `narrowed`);
        `flat`: a [B, n] draw over (slot, codebook) pairs."""
        return n if self.short is None else n - self.short[row] * (self.codebooks if flat else 1)

    def stack(self, draw) -> torch.Tensor:
        """torch.stack of `draw(generator)` for every row."""
        return torch.stack([draw(g) for g in self.generators])


def make_generator(seed: Optional[int] = None, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A generator on `device`, seeded with `seed` or, when None, with fresh OS entropy."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(int(seed))
