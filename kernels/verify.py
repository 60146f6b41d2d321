"""Verify and finalise a batch of drafts in one kernel (the exact rule).

Lossless speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318): draft x_j ~ q_j is accepted when u_j < min(1, p_j(x_j) / q_j(x_j)); the
token after the accepted prefix is drawn from norm(max(0, p - q)) at the first rejection, or
is the bonus sample from p at slot n when every draft passed.

The core runs `ExactAcceptance` (ratios, and a residual for every one of the n positions: a
[B, n, V] tensor), samples all n residuals, then `finalise` (`mmgen.decoding.finalise`, the
rule the twin below calls too) keeps the one at the first rejection. The kernel, one program
per row, reads the n ratios at the drafts, finds the first rejection and touches the
vocabulary only at that position: two passes over one row of p and q (O(n + V) per row
instead of O(n V)), no [B, n, V] temporary; vLLM v1's rejection sampler does the same work in
Triton. The decoding loop calls it through `kernels/step.py`. Not
measured on a GPU yet.

Randomness stays with the caller: the uniforms [B, n] the rule would draw, the Exp(1) noise
[B, n, V] `sample` would draw for the residuals (only the first rejection's row is read) and
the bonus tokens [B]. The acceptance decisions are bit-identical to the twin's (the same
IEEE division and comparisons); the residual's normalising sum is the kernel's own, so the
resampled token matches the twin's for the same noise up to float32 near-ties.

Only the exact rule is verified here. A bounded lossy rule (GSD's groups, LANTERN's
neighbourhoods) is this exact verify against its relaxed target, which `kernels/grouped.py` and
`kernels/relaxed.py` build first (`step.ExactStep`). Frames of K > 1 codebooks are not fused.
"""

from __future__ import annotations

from typing import Optional

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.finalise import finalise
from mmgen.kernels._triton import jit as _jit, tl, triton
from mmgen.sampling import race


def verify_exact_twin(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor,
                      noise: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_acc [B], next token [B]) for target laws p [B, n, V], draft laws q [B, n, V], drafts
    [B, n], uniforms [B, n], residual noise [B, n, V] and bonus tokens [B]: the core's
    `ExactAcceptance` and its finalise step."""
    accept, residual = ExactAcceptance().probabilities(p, q, drafts)
    n_acc, token, _ = finalise(uniforms < accept, race(residual, noise), bonus[:, None], drafts, 1)
    return n_acc, token


def verify_exact_triton(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor,
                        noise: torch.Tensor, bonus: torch.Tensor, block: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `verify_exact_twin`, in one kernel launch (`block`: vocabulary entries per step)."""
    B, n, V = p.shape
    last = lambda t: t if t.stride(-1) == 1 else t.contiguous()
    p, q, noise = last(p.float()), last(q.float()), last(noise.float())
    drafts, uniforms = drafts.contiguous(), uniforms.float().contiguous()
    n_acc = torch.empty(B, dtype=torch.long, device=p.device)
    token = torch.empty(B, dtype=torch.long, device=p.device)
    BLOCK = block or min(2048, triton.next_power_of_2(V))
    if B:
        _verify_kernel[(B,)](
            p, q, drafts, uniforms, noise, bonus.contiguous(), n_acc, token, n, V,
            p.stride(0), p.stride(1), q.stride(0), q.stride(1), noise.stride(0), noise.stride(1),
            BLOCK_N=max(triton.next_power_of_2(n), 2), BLOCK=BLOCK, num_warps=8 if BLOCK >= 2048 else 4,
        )
    return n_acc, token


@_jit
def _verify_kernel(p, q, drafts, uniforms, noise, bonus, n_acc, token, n, V, sp_b, sp_n, sq_b, sq_n, se_b, se_n,
                   BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_N)
    on = j < n
    # min(1, p(x) / max(q(x), tiny)) at each draft, tested against its uniform.
    x = tl.load(drafts + b * n + j, mask=on, other=0)
    p_x = tl.load(p + b * sp_b + j * sp_n + x, mask=on, other=0.0)
    q_x = tl.load(q + b * sq_b + j * sq_n + x, mask=on, other=1.0)
    ratio = tl.minimum(tl.div_rn(p_x, tl.maximum(q_x, 1.1754943508222875e-38)), 1.0)
    accepted = tl.load(uniforms + b * n + j, mask=on, other=1.0) < ratio
    first = tl.min(tl.where(on & ~accepted, j, n), 0)  # the accepted prefix's length
    tl.store(n_acc + b, first.to(tl.int64))

    out = tl.load(bonus + b)
    if first < n:  # resample from norm(max(0, p - q)) at the first rejection (p where it is empty)
        p += b * sp_b + first * sp_n
        q += b * sq_b + first * sq_n
        noise += b * se_b + first * se_n
        cols = tl.arange(0, BLOCK)
        total = 0.0
        for start in range(0, V, BLOCK):
            i = start + cols
            mass = tl.load(p + i, mask=i < V, other=0.0) - tl.load(q + i, mask=i < V, other=0.0)
            total += tl.sum(tl.maximum(mass, 0.0), 0)
        best = -1.0
        best_i = 0
        for start in range(0, V, BLOCK):
            i = start + cols
            p_i = tl.load(p + i, mask=i < V, other=0.0)
            mass = tl.maximum(p_i - tl.load(q + i, mask=i < V, other=0.0), 0.0)
            r = tl.where(total > 0, tl.div_rn(mass, tl.maximum(total, 1.1754943508222875e-38)), p_i)
            r = tl.div_rn(r, tl.load(noise + i, mask=i < V, other=1.0))
            block_best, block_i = tl.max(tl.where(i < V, r, -1.0), 0, return_indices=True)
            best_i = tl.where(block_best > best, start + block_i, best_i)  # first maximum, as torch.argmax
            best = tl.maximum(best, block_best)
        out = best_i.to(tl.int64)
    tl.store(token + b, out)
