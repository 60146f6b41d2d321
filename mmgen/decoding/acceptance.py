"""Acceptance rules: given the target's and the drafter's distributions, keep or reject drafts.

A rule sees every draft position at once (vLLM's rejection sampler) and returns which drafts
pass their own test and, per position, the distribution to resample from if that position is
the first rejection. The decoder turns that into an accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgen.sampling import uniform


@dataclass(frozen=True)
class ExactAcceptance:
    """Lossless speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023).

    Draft x drawn from q is accepted with probability min(1, p(x) / q(x)); at the first
    rejection the token is resampled from norm(max(0, p - q)). The output is distributed
    exactly as p whatever q is, provided x really was drawn from q.
    """

    def __call__(
        self, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """p, q: [B, n, V] float32; drafts: [B, n] -> (accepted [B, n] bool, residual [B, n, V])."""
        p_x = p.gather(-1, drafts[..., None]).squeeze(-1)
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
        # u < min(1, p/q) written without the division: q(x) > 0 because x was drawn from q.
        accepted = uniform(drafts.shape, generator, p.device) * q_x < p_x
        return accepted, residual_distribution(p, q)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis; where p == q (nothing left) fall back to p.

    A rejection implies p(x) < q(x), so the residual has positive mass in exact arithmetic;
    the fallback only guards rounding when p and q agree to the last bit.
    """
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)
