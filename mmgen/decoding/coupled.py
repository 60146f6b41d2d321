"""Coupled Jacobi decoding: lossless sampling whose drafts converge like greedy Jacobi.

Sampling token t as argmax(p_t / E_t), with E_t ~ Exp(1) fixed per (row, position) for the
whole decode, is an exact draw from p_t (the exponential race, equivalent to Gumbel-max).
With the noise fixed, the sample is a deterministic function of the prefix, so the decode
becomes a fixed-point problem exactly like greedy Jacobi decoding: a draft is final when it
equals argmax(p_t / E_t) under a verified prefix, and drafts of successive iterations are
maximally coupled (they change only where the prefix change moves the argmax). This is the
coupling idea behind MC-SJD / SJD-PAC ("speculative Jacobi with probabilistic-acceptance
coupling"), taken to its deterministic limit: no acceptance test is needed, and the output is
token-identical to autoregressive sampling with the same noise.

The noise is never stored: `CounterNoise` computes E for (seed, row, position, token) from a
counter-based hash when a window needs it, so a decode holds the noise of one window slot at a
time ([B, V]) whatever the vocabulary and length.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

import torch

from mmgen.decoding.base import check_int
from mmgen.decoding.jacobi_init import RandomDraftInit, resolve_draft_init
from mmgen.decoding.jacobi import JacobiProposer
from mmgen.decoding.proposer import DecodeRun
from mmgen.decoding.speculative import SpeculativeDecoder
from mmgen.sampling import race

_MASK = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 in int64 without overflowing (16-bit halves)."""
    return ((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c & _MASK


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Wellons' lowbias32) of int64 tensors holding values < 2**32."""
    x = x & _MASK
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class CounterNoise:
    """Exp(1) noise E(row, position, token) as a pure function of a seed (counter-based: no
    state, any window of it on demand). 32 hash bits per draw, so u = (h + 0.5) / 2**32."""

    def __init__(self, seed: int, vocab_size: int, device):
        self.seed = int(seed) & 0x7FFFFFFFFFFFFFFF
        self.token_keys = hash32(torch.arange(vocab_size, device=device, dtype=torch.long) * 0x9E3779B1 + 0x632BE5AB)

    def exponential(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """E [..., V] for rows and positions of the same shape [...]."""
        key = hash32(hash32(hash32(positions + (self.seed & _MASK)) ^ rows) + (self.seed >> 32))
        h = hash32(key[..., None] ^ self.token_keys)
        return -torch.log((h.double() + 0.5) / 2.0**32).float()

    def race(self, probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The exponential-race sample of `probs` [B, n, V] (frames: [B, n, K, V]) at `positions`
        [B, n], one slot at a time so only [B, (K,) V] of noise exists at once. Each codebook of a
        frame is a lane of its own (row·K + k), so a frame's K draws are independent as the
        model's law makes them; tokens (no K) keep lane = row."""
        batch, extra = probs.shape[0], probs.shape[2:-1]
        lanes = torch.arange(batch * math.prod(extra), device=probs.device).view(batch, *extra)
        samples = []
        for i in range(probs.shape[1]):
            at = positions[:, i].view(batch, *([1] * len(extra))).expand_as(lanes)
            samples.append(race(probs[:, i], self.exponential(lanes, at)))
        return torch.stack(samples, 1)


class CoupledProposer(JacobiProposer):
    """Jacobi carry-over whose every draw is the race under the run's fixed `CounterNoise`."""

    def __init__(self, window: int, init, noise: CounterNoise):
        super().__init__(window, init, laws=False)
        self.noise = noise

    def draw(self, run: DecodeRun, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.noise.race(probs, index)


@dataclass(frozen=True)
class MatchAcceptance:
    """Coupled decoding's verification: a draft is final when it equals the target's draw
    under the fixed noise at its position; the replacement at the first mismatch is that
    draw (`residual=None` tells the loop to take the target's own sample there)."""

    noise: CounterNoise

    def verify(self, p, q, drafts, index, run):
        return drafts == self.noise.race(p, index), None


@dataclass
class CoupledJacobi(SpeculativeDecoder):
    """Jacobi decoding under fixed per-position noise (lossless sampling).

    Each forward feeds `window` tokens per row (the newest finalised token and window - 1
    drafts). Draft i is accepted while it equals the noisy argmax predicted at slot i - 1; the
    first mismatch is replaced by that argmax, which is final because its prefix is. Tokens
    predicted after the mismatch become the next drafts. The noise's seed is one draw from
    `generator`.
    """

    window: int = 16
    draft_init: Any = field(default_factory=RandomDraftInit)

    def __post_init__(self):
        check_int("window", self.window, 1)

    def roles(self, model, num_tokens, generator):
        if hasattr(model, "complete_frame"):
            raise ValueError(f"coupled Jacobi fixes every token's noise up front; {type(model).__name__} samples dependent "
                             "codebooks itself: use sjd or draft")
        L = min(self.window, num_tokens)  # a wider window has nothing to draft
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        noise = CounterNoise(seed, model.vocab_size, generator.device)
        return CoupledProposer(L, resolve_draft_init(self.draft_init), noise), MatchAcceptance(noise)
