"""Model-agnostic quality figures: token NLL under a `TokenModel`, Fréchet distance of features."""

from __future__ import annotations

from typing import Any

import torch

from mmgen.inference import inference
from mmgen.modeling import TokenModel


@inference
def token_nll(model: TokenModel, conditions: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood per token [B] of `tokens` [B, n] under the model's plain
    conditional distribution (no guidance, temperature 1, no filtering), teacher-forced in one
    forward. Lower means the model finds the samples more typical of what it learned."""
    state = model.start(conditions, tokens.shape[1] + 1, guidance=False)
    logits = torch.cat([state.first_logits.cond, model.forward(state, tokens[:, :-1]).cond], dim=1)
    logp = logits.float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    return -logp.mean(-1)


def feature_statistics(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [D] and covariance [D, D] (unbiased) of features [N, D], in float64."""
    x = features.double()
    return x.mean(0), torch.cov(x.T)


def frechet_distance(mu1: torch.Tensor, cov1: torch.Tensor, mu2: torch.Tensor, cov2: torch.Tensor) -> float:
    """||mu1 - mu2||^2 + tr(C1 + C2 - 2 (C1^1/2 C2 C1^1/2)^1/2), the FID formula (Heusel et al.
    2017), computed with symmetric eigendecompositions in float64 (no scipy `sqrtm`)."""
    mu1, mu2, cov1, cov2 = (t.double() for t in (mu1, mu2, cov1, cov2))
    vals, vecs = torch.linalg.eigh(cov1)
    root1 = (vecs * vals.clamp_min(0).sqrt()) @ vecs.T
    middle = root1 @ cov2 @ root1
    trace_root = torch.linalg.eigvalsh((middle + middle.T) / 2).clamp_min(0).sqrt().sum()
    return float((mu1 - mu2).pow(2).sum() + cov1.trace() + cov2.trace() - 2 * trace_root)
