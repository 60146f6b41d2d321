"""Block diffusion: denoise a sequence block by block, each block attending to the committed ones.

The loop of CausVid (Yin et al., 2024) and Self-Forcing (Huang et al., 2025) on any
`BlockDiffusionModel`: a block starts from noise, takes the schedule's few flow-matching steps
(each predicts x0 = x − σ·v, then moves to the next noise level), and is committed by the
model's clean pass. `CollaborativeDenoising` is CoDe's large/small split (Chen et al., 2024)
across denoising steps: the large model takes the first steps of every block, where the
content is decided, and a small one of the same latent space the rest. `BlockRollout` is the
loop one block at a time: `generate` runs it for a fixed number of blocks, a live video stream
for as long as it is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch

from mmgen.decoding.base import BaseDecoder, check_int
from mmgen.modeling import BlockDiffusionModel


@dataclass
class FlowSchedule:
    """The noise levels of each block's denoising.

    `timesteps` on [0, 1000] are warped by `shift` (σ = shift·s / (1 + (shift − 1)·s), s = t/1000,
    the flow-matching shift Wan and Self-Forcing use). `stochastic=True` is the few-step sampler
    of the distilled models: the x0 prediction is re-noised with fresh noise to the next level;
    False steps along the flow (Euler on the probability-flow ODE), for models trained with
    plain flow matching and more steps.
    """

    timesteps: Sequence[float] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = 5.0
    stochastic: bool = True

    def __post_init__(self):
        self.timesteps = tuple(float(t) for t in self.timesteps)
        if not self.timesteps or any(not 0 < t <= 1000 for t in self.timesteps) or list(self.timesteps) != sorted(self.timesteps, reverse=True):
            raise ValueError(f"timesteps must be decreasing values in (0, 1000], got {self.timesteps}")
        if not self.shift > 0:
            raise ValueError(f"shift must be > 0, got {self.shift}")

    @classmethod
    def uniform(cls, num_steps: int, shift: float = 5.0, stochastic: bool = False) -> "FlowSchedule":
        """`num_steps` evenly spaced timesteps from 1000 down (1000, 1000 − 1000/n, …)."""
        check_int("num_steps", num_steps, 1)
        return cls(tuple(1000.0 * (1 - i / num_steps) for i in range(num_steps)), shift, stochastic)

    def sigmas(self) -> list[float]:
        s = [t / 1000.0 for t in self.timesteps]
        return [self.shift * x / (1 + (self.shift - 1) * x) for x in s]


@dataclass
class BlockStats:
    """Forwards of one block-diffusion decode, per role."""

    blocks: int = 0
    denoise_forwards: dict[str, int] = field(default_factory=dict)  # role -> forwards (CFG batches count once)
    commit_forwards: dict[str, int] = field(default_factory=dict)
    cache_bytes: int = 0  # the models' caches (states that report `nbytes`)
    computed_fraction: dict[str, float] = field(default_factory=dict)  # role -> token-layers computed (token dropping)

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "denoise_forwards": dict(self.denoise_forwards),
                "commit_forwards": dict(self.commit_forwards), "cache_bytes": self.cache_bytes,
                "computed_fraction": dict(self.computed_fraction)}


@dataclass
class BlockDecodeOutput:
    latents: list[torch.Tensor]  # one tensor per block, batch first
    stats: BlockStats


BlockCallback = Callable[[int, torch.Tensor], None]


@dataclass
class BlockDenoising(BaseDecoder):
    """Plain block diffusion: every step of every block on the pipeline's own model."""

    family: ClassVar[str] = "block-diffusion"
    schedule: Optional[FlowSchedule] = None  # None: the model's own (the pipeline's schedule)

    def step_models(self, model: BlockDiffusionModel, num_steps: int) -> list[tuple[str, BlockDiffusionModel]]:
        """(role, model) of each denoising step."""
        return [("model", model)] * num_steps

    def generate(
        self,
        model: BlockDiffusionModel,
        conditions: Any,
        num_blocks: int,
        generator: torch.Generator,
        guidance_scale: float = 1.0,
        switches: Optional[dict[int, Any]] = None,
        callback: Optional[BlockCallback] = None,
        schedule: Optional[FlowSchedule] = None,
    ) -> BlockDecodeOutput:
        """Make `num_blocks` blocks. `switches` maps a block index to the conditions it and later
        blocks use (a prompt switch); `callback(index, x0)` sees each block once committed.
        `schedule` is the model's default, used when the decoder has none."""
        check_int("num_blocks", num_blocks, 1)
        switches, blocks = switches or {}, []
        with BlockRollout(self, model, conditions, num_blocks, generator, guidance_scale, schedule) as rollout:
            for b in range(num_blocks):
                blocks.append(rollout.step(switches.get(b)))
                if callback is not None:
                    callback(b, blocks[-1])
            return BlockDecodeOutput(blocks, rollout.stats)


@dataclass
class CollaborativeDenoising(BlockDenoising):
    """CoDe across denoising steps: `large_steps` first steps of each block on the pipeline's
    model, the rest on `small` (a smaller model of the same latent space, or a pipeline with
    `block_model()`). Both commit every block, so each keeps its own cache of the same video."""

    small: Any = None
    large_steps: int = 1

    def step_models(self, model: BlockDiffusionModel, num_steps: int) -> list[tuple[str, BlockDiffusionModel]]:
        if self.small is None:
            raise ValueError("collaborative denoising needs a small model of the same VAE: pass small=NAME_OR_PIPELINE")
        check_int("large_steps", self.large_steps, 1)
        if self.large_steps > num_steps:
            raise ValueError(f"large_steps={self.large_steps} exceeds the schedule's {num_steps} steps")
        small = self.small.block_model(like=model) if hasattr(self.small, "block_model") else self.small
        return [("large", model)] * self.large_steps + [("small", small)] * (num_steps - self.large_steps)


class BlockRollout:
    """A started block decode of `decoder` (a `BlockDenoising` or a subclass: its step roles)
    on `model`, `step` by `step`. `num_blocks` sizes the models' caches (under a window policy,
    blocks past the window need no more). Draws come from `generator` in the order of
    `generate`, so the same seed makes the same blocks."""

    def __init__(self, decoder: "BlockDenoising", model: BlockDiffusionModel, conditions: Any, num_blocks: int,
                 generator: torch.Generator, guidance_scale: float = 1.0, schedule: Optional[FlowSchedule] = None):
        schedule = decoder.schedule or schedule or FlowSchedule()
        self.sigmas, self.stochastic = schedule.sigmas(), schedule.stochastic
        self.generator, self.guidance_scale = generator, guidance_scale
        self.steps = decoder.step_models(model, len(self.sigmas))
        self.roles = {id(m): role for role, m in reversed(self.steps)}
        self.models = {id(m): m for _, m in self.steps}  # each distinct model once, the pipeline's first
        self.states: dict[int, Any] = {}
        try:
            for key, m in self.models.items():
                self.states[key] = m.start(conditions, num_blocks, guidance_scale != 1.0)
        except BaseException:
            self.close()  # the models started so far release what they installed
            raise
        self.stats = BlockStats(cache_bytes=self.cache_bytes)

    @property
    def cache_bytes(self) -> int:
        """The models' caches now (states that report `nbytes`)."""
        return sum(getattr(state, "nbytes", 0) for state in self.states.values())

    def step(self, conditions: Any = None) -> torch.Tensor:
        """Make and commit the next block; `conditions` (a prompt switch) first conditions every
        model on them for this block and later ones. Returns the block's x0 (batch first)."""
        models, states, stats, sigmas = self.models, self.states, self.stats, self.sigmas
        if conditions is not None:
            for key, m in models.items():
                m.condition(states[key], conditions)
        first = id(self.steps[0][1])
        shape = models[first].block_shape(states[first])
        generator = self.generator
        x = torch.randn(shape, generator=generator, device=generator.device)
        for i, (role, m) in enumerate(self.steps):
            cond, uncond = m.velocity(states[id(m)], x, 1000.0 * sigmas[i])
            v = cond if uncond is None else uncond + self.guidance_scale * (cond - uncond)
            stats.denoise_forwards[role] = stats.denoise_forwards.get(role, 0) + 1
            x0 = x - sigmas[i] * v
            if i + 1 < len(self.steps):
                nxt = sigmas[i + 1]
                if self.stochastic:
                    x = (1 - nxt) * x0 + nxt * torch.randn(shape, generator=generator, device=generator.device)
                else:
                    x = x + (nxt - sigmas[i]) * v
        for key, m in models.items():
            m.commit(states[key], x0)
            stats.commit_forwards[self.roles[key]] = stats.commit_forwards.get(self.roles[key], 0) + 1
        stats.blocks += 1
        for key, state in states.items():
            if getattr(state, "computed_fraction", None) is not None:
                stats.computed_fraction[self.roles[key]] = state.computed_fraction
        return x0

    def close(self) -> None:
        """Finish every started model once (their caches and installed processors go)."""
        states, self.states = self.states, {}
        for key, state in states.items():
            self.models[key].finish(state)

    def __enter__(self) -> "BlockRollout":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
