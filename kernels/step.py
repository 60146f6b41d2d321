"""A decode step's token work in two kernel launches: the target's probabilities and samples
(`sample_logits`), then the exact verify and the token after the accepted prefix
(`verify_exact`). A bounded lossy rule (GSD, LANTERN) is the exact verify against its relaxed
target pi, built in between (`relaxed_target`: GSD's groups in one more kernel, LANTERN's
neighbourhoods in two).

The torch path of `speculative_decode` does this as a chain: guidance, temperature, filters
and softmax over [B, n, V] (`SamplingConfig.probs`), the exact rule's ratios and a residual
for every one of the n - 1 draft positions (`ExactAcceptance`), samples of the fresh tokens
and of every residual (`sample`), then `finalise`, which keeps one residual sample. Here the
residual is formed only at each row's first rejection, inside the verify kernel.

The step draws from the generator exactly what the torch path draws, in its order: the
acceptance uniforms [B, n - 1], the fresh tokens' Exp(1) noise, the residuals' noise
[B, n - 1, V]. So for the same generator state both paths accept the same drafts (the same
float32 ratios) and pick the same tokens, up to float32 near-ties in the probabilities (the
kernels sum and exponentiate in their own order). Greedy decoding (temperature 0, the exact rule
or none) draws nothing on either path: the laws are one-hot, a draft is accepted exactly when it
is the argmax and the token after the accepted prefix is the argmax there.
"""

from __future__ import annotations

from typing import Optional

import torch

from mmgen.kernels.dispatch import relaxed_target, sample_logits, verify_exact
from mmgen.sampling import Logits, SamplingConfig, exponential_noise, uniform


class ExactStep:
    """One forward's sampling and verify for one-token slots: (p [B, n, V], fresh tokens
    [B, n] or [B, 1] (`every`), accepted prefix n_acc [B], the token after it [B]), what the
    loop's torch path computes from the same logits and generator state. `rule`: None or the
    exact rule (verify against p), or a bounded lossy rule (verify against its relaxed target
    pi, which is that rule: `NeighbourhoodAcceptance.probabilities`)."""

    def __init__(self, sampling: SamplingConfig, rule=None, backend: Optional[str] = None):
        self.sampling = sampling
        self.relaxed = rule if getattr(rule, "lossy", False) else None
        self.backend = backend
        self.greedy = sampling.temperature == 0 and self.relaxed is None

    def __call__(self, logits: Logits, index: torch.Tensor, drafts: Optional[torch.Tensor], q: Optional[torch.Tensor],
                 generator: torch.Generator, every: bool):
        B, n = index.shape
        d, V, device = n - 1, logits.cond.shape[-1], logits.cond.device
        config = self.sampling
        scale = config.guidance.scales(index) if logits.uncond is not None else None
        if self.greedy:
            p, picks = sample_logits(logits, scale, torch.ones(B, n, V, device=device), 0.0, backend=self.backend)
            n_acc = (drafts == picks[:, :-1]).long().cumprod(-1).sum(-1) if d > 0 else torch.zeros(B, dtype=torch.long, device=device)
            return p, picks if every else picks[:, -1:], n_acc, picks.gather(1, n_acc[:, None])[:, 0]
        uniforms = uniform((B, d), generator, device) if d > 0 else None
        noise = exponential_noise((B, n if every else 1, V), generator, device)
        if not every and d > 0:  # only the bonus slot is sampled; the others race unit noise, unread
            noise = torch.cat([torch.ones(B, d, V, device=device), noise], 1)
        p, fresh = sample_logits(logits, scale, noise, config.temperature, config.top_k, config.top_p, backend=self.backend)
        if d == 0:
            return p, fresh, torch.zeros(B, dtype=torch.long, device=device), fresh[:, -1]
        residual_noise = exponential_noise((B, d, V), generator, device)
        target = p[:, :-1] if self.relaxed is None else relaxed_target(self.relaxed, p[:, :-1], q, backend=self.backend)
        n_acc, token = verify_exact(target, q, drafts, uniforms, residual_noise, fresh[:, -1], backend=self.backend)
        return p, fresh if every else fresh[:, -1:], n_acc, token
