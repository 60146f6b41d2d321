"""Logits -> probabilities -> token in one kernel: CFG, temperature, top-k, top-p, softmax and
the exponential race, one program per row of [N, V] logits.

The core does this in `mmgen.sampling` as a chain of torch ops (`apply_guidance`,
`logits_to_probs`, `sample`), each a pass over a float32 [N, V] temporary, plus a sort of the
whole vocabulary for top-p. The kernel reads cond (and uncond) once, stages the scaled logits
in its output buffer and never sorts: top-k and top-p become thresholds found by a bitwise
binary search over the float32 order (one counting pass per bit), exact and without scratch
memory. Top-k keeps every tie of the k-th logit, as the core does; where top-p's boundary
falls inside a run of tied logits, the core keeps as many of them as the mass allows in its
sort's order (not stable on the CPU), the kernel the same number in vocabulary order.

Cost per row, V the vocabulary: 3 passes over V without filters (2 for greedy), + 32 with
top-k, + 33 with top-p; every pass after the first re-reads the 4 V bytes staged in `out`.
Not measured on a GPU yet (none was available when it was written).

Randomness stays with the caller: the kernel takes the Exp(1) noise `sample` would draw
(`mmgen.kernels.exponential_noise`: same generator, same draws) and returns argmax(p / E),
gpt-fast's exponential race, so the twin and the kernel pick the same token from the same noise.

`sample_logits_twin` is the core's own code path (the functions `SamplingConfig.probs` and
`sample` call), so kernel == twin == the decoder. Floating point: guidance and temperature
round as torch does (no fused multiply-add; on CUDA torch divides by a Python scalar through
its float32 reciprocal, and so does the kernel); exp and the sums are the kernel's own, so
probabilities agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from mmgen.kernels._triton import jit as _jit, tl, triton
from mmgen.sampling import Logits, apply_guidance, logits_to_probs, race


def sample_logits_twin(logits: Logits, scale: Optional[torch.Tensor], noise: torch.Tensor, temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 probabilities [..., V], tokens [...]): the core's `SamplingConfig.probs` and
    `sample` with the guidance scale [...] and the noise [..., V] given."""
    probs = logits_to_probs(apply_guidance(logits, scale), temperature, top_k, top_p)
    return probs, race(probs, noise)


def sample_logits_triton(logits: Logits, scale: Optional[torch.Tensor], noise: torch.Tensor, temperature: float = 1.0,
                         top_k: int = 0, top_p: float = 1.0, block: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as `sample_logits_twin`, in one kernel launch. `block` (a power of two) is the
    number of vocabulary entries a program handles per step (default: V rounded up to a power
    of two, at most 2048)."""
    cond, uncond = logits.cond, logits.uncond
    V, lead = cond.shape[-1], cond.shape[:-1]
    rows = lambda t: t.reshape(-1, V) if t.stride(-1) == 1 else t.reshape(-1, V).contiguous()
    c = rows(cond)
    N = c.shape[0]
    u = c if uncond is None else rows(uncond)
    s = torch.ones(1, device=c.device) if uncond is None else scale.to(c.device, torch.float32).expand(lead).reshape(N).contiguous()
    e = rows(noise.float())
    out = torch.empty(N, V, device=c.device)
    tokens = torch.empty(N, dtype=torch.long, device=c.device)
    # torch divides by a scalar on CUDA as x * (1 / t) in float32, on the CPU as x / t.
    reciprocal = c.is_cuda
    t = float(np.float32(1.0) / np.float32(temperature)) if reciprocal and temperature > 0 else float(temperature)
    BLOCK = block or min(2048, triton.next_power_of_2(V))
    if N:
        _sample_kernel[(N,)](
            c, u, s, e, out, tokens, V, c.stride(0), u.stride(0), e.stride(0), t, int(top_k), float(top_p),
            GUIDED=uncond is not None, GREEDY=temperature == 0, RECIPROCAL=reciprocal,
            TOP_K=0 < top_k < V, TOP_P=top_p < 1.0, BLOCK=BLOCK,
            num_warps=8 if BLOCK >= 2048 else 4, enable_fp_fusion=False,
        )
    return out.view(*lead, V), tokens.view(lead)


@_jit
def _key(x):
    """float32 -> int64 in [0, 2**32) with the same order (-0.0 and 0.0 share one key)."""
    b = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648


@_jit
def _value(k):
    """The float32 whose `_key` is k."""
    b = (k - 2147483648).to(tl.int32)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@_jit
def _sample_kernel(cond, uncond, scale, noise, out, token, V, stride_c, stride_u, stride_e, temperature, top_k, top_p,
                   GUIDED: tl.constexpr, GREEDY: tl.constexpr, RECIPROCAL: tl.constexpr, TOP_K: tl.constexpr,
                   TOP_P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cond += row * stride_c
    uncond += row * stride_u
    noise += row * stride_e
    out += row * V
    cols = tl.arange(0, BLOCK)
    s = tl.load(scale + row) if GUIDED else 1.0

    # 1. Guidance u + s (c - u) (c itself where s == 1) and temperature, staged in `out`; the row max.
    top = float("-inf")
    top_i = 0
    for start in range(0, V, BLOCK):
        i = start + cols
        x = tl.load(cond + i, mask=i < V, other=0.0).to(tl.float32)
        if GUIDED:
            u = tl.load(uncond + i, mask=i < V, other=0.0).to(tl.float32)
            x = tl.where(s == 1.0, x, u + s * (x - u))
        if not GREEDY:
            x = x * temperature if RECIPROCAL else tl.div_rn(x, temperature)
            tl.store(out + i, x, mask=i < V)
        block_top, block_i = tl.max(tl.where(i < V, x, float("-inf")), 0, return_indices=True)
        top_i = tl.where(block_top > top, start + block_i, top_i)  # first maximum, as torch.argmax
        top = tl.maximum(top, block_top)
    tl.debug_barrier()  # the passes below re-read `out`: every thread of the program sees the stores

    if GREEDY:  # temperature 0: one-hot on the argmax of the guided logits
        for start in range(0, V, BLOCK):
            i = start + cols
            tl.store(out + i, tl.where(i == top_i, 1.0, 0.0), mask=i < V)
        tl.store(token + row, top_i.to(tl.int64))
    else:
        # 2. Top-k: the k-th largest logit, counted with multiplicity, is the largest key kth with
        # #{x >= kth} >= k; built bit by bit from the top. Ties with it stay (torch.topk + `<`).
        kth = tl.zeros((), tl.int64)
        if TOP_K:
            for bit in range(32):
                candidate = kth | (tl.full((), 1, tl.int64) << (31 - bit))
                count = 0
                for start in range(0, V, BLOCK):
                    i = start + cols
                    x = tl.load(out + i, mask=i < V, other=float("-inf"))
                    count += tl.sum(((_key(x) >= candidate) & (i < V)).to(tl.int32), 0)
                kth = tl.where(count >= top_k, candidate, kth)

        # 3. The softmax denominator over the tokens top-k kept.
        z = 0.0
        for start in range(0, V, BLOCK):
            i = start + cols
            x = tl.load(out + i, mask=i < V, other=float("-inf"))
            z += tl.sum(tl.where((i < V) & (_key(x) >= kth), tl.exp(x - top), 0.0), 0)

        # 4. Top-p: the core keeps a token while the mass sorted before it is <= top_p. That is
        # every token above `cut`, the smallest logit whose mass strictly above is <= top_p
        # (one more than the largest key whose mass above exceeds it), and the first tokens tied
        # at `cut`: the j-th (in vocabulary order) while mass_above + j p(cut) <= top_p.
        cut = tl.zeros((), tl.int64)
        n_ties = 0
        if TOP_P:
            below = tl.zeros((), tl.int64)
            for bit in range(32):
                candidate = below | (tl.full((), 1, tl.int64) << (31 - bit))
                mass = 0.0
                for start in range(0, V, BLOCK):
                    i = start + cols
                    x = tl.load(out + i, mask=i < V, other=float("-inf"))
                    k = _key(x)
                    mass += tl.sum(tl.where((i < V) & (k >= kth) & (k > candidate), tl.exp(x - top), 0.0), 0)
                below = tl.where(tl.div_rn(mass, z) > top_p, candidate, below)
            cut = below + 1
            above = 0.0
            ties = 0
            for start in range(0, V, BLOCK):
                i = start + cols
                x = tl.load(out + i, mask=i < V, other=float("-inf"))
                k = _key(x)
                above += tl.sum(tl.where((i < V) & (k >= kth) & (k > cut), tl.exp(x - top), 0.0), 0)
                ties += tl.sum(((i < V) & (k >= kth) & (k == cut)).to(tl.int32), 0)
            p_cut = tl.exp(_value(cut) - top)
            fit = tl.floor(tl.div_rn(top_p - tl.div_rn(above, z), tl.div_rn(p_cut, z))) + 1.0
            n_ties = tl.maximum(tl.minimum(fit, ties.to(tl.float32)), 1.0).to(tl.int32)
            z = above + n_ties.to(tl.float32) * p_cut
            kth = tl.maximum(kth, cut)

        # 5. Probabilities (NaN rows stay NaN, as torch's softmax) and the race argmax(p / E).
        best = -1.0
        best_i = 0
        seen = 0
        for start in range(0, V, BLOCK):
            i = start + cols
            x = tl.load(out + i, mask=i < V, other=float("-inf"))
            k = _key(x)
            keep = (i < V) & (k >= kth)
            if TOP_P:
                tie = keep & (k == cut)
                rank = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
                keep = keep & ((k > cut) | (rank < n_ties))
                seen += tl.sum(tie.to(tl.int32), 0)
            p = tl.where(keep, tl.div_rn(tl.exp(x - top), z), 0.0)
            p = tl.where(z == z, p, float("nan"))
            tl.store(out + i, p, mask=i < V)
            r = tl.div_rn(p, tl.load(noise + i, mask=i < V, other=1.0))
            r = tl.where(r == r, r, float("inf"))  # torch.argmax takes the first NaN
            block_best, block_i = tl.max(tl.where(i < V, r, -1.0), 0, return_indices=True)
            best_i = tl.where(block_best > best, start + block_i, best_i)
            best = tl.maximum(best, block_best)
        tl.store(token + row, best_i.to(tl.int64))
