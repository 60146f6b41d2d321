"""LANTERN's relaxed target in two kernels: pi = p (1 - claimed) + q moved_in over the
vocabulary, with neighbourhoods from the VQ codebook (LANTERN, Jang et al. 2024, arXiv
2410.03355; LANTERN++, Park et al. 2025, arXiv 2502.06352; `mmgen.decoding.RelaxedAcceptance`,
bounded rule).

Token z's neighbourhood is the longest prefix of its k nearest codes whose target mass fits
the budget (delta, or (lam - 1) p(z)); z moves that mass onto itself (moved_in) and, with
weight q(z), claims each of those neighbours' mass (claimed). The rule's torch path gathers
p over the whole [rows, V, k] neighbour table in chunks of 2**25 elements and scatters the
claims with `index_add_` (atomic, so run-to-run nondeterministic on a GPU); at LlamaGen's
16384 codes and k = 1000 that is 16M neighbour terms per position.

- `_prefix_kernel`, one program per block of tokens z: walks z's neighbour row in chunks,
  carrying the cumulative mass, and stores the prefix length L(z) and moved_in(z). Tokens
  outside supp(p) ∩ supp(q) claim nothing and weigh nothing (exact zeros), so their rows are
  never read (under top-k 2000 of 16384: 1/8 of the table).
- `_target_kernel`, one program per block of tokens y: claimed(y) sums q(z) over the tokens
  z that list y inside their prefix, read from the inverted table (`RelaxedAcceptance.kernel_tables`)
  in token order, so the sum is deterministic and in the CPU twin's order; then pi.

pi agrees with the twin to float32 rounding, not bit for bit: the kernel's cumulative sums and
moved_in are chunked scans, the twin's sequential, so a prefix can end one neighbour earlier
or later where its mass meets the budget to the last bit. The acceptance test and the residual
are the exact rule's against pi (`verify_exact`).
"""

from __future__ import annotations

from typing import Optional

import torch

from mmgen.kernels._triton import jit as _jit, tl, triton


def relaxed_target_triton(rule, p: torch.Tensor, q: torch.Tensor, block: Optional[int] = None) -> torch.Tensor:
    """`rule.relaxed_target(p, q)` (the twin) in two kernel launches (`block`: tokens per
    program)."""
    device = p.device
    neighbours, starts, claimers, ranks = rule.kernel_tables(device)
    V, k = neighbours.shape
    rows = lambda t: t.reshape(-1, V).float().contiguous()
    flat_p, flat_q = rows(p), rows(q)
    R = len(flat_p)
    prefix = torch.empty(R, V, dtype=torch.int32, device=device)
    moved_in = torch.empty(R, V, device=device)
    out = torch.empty_like(flat_p)
    BLOCK = block or min(128, triton.next_power_of_2(V))
    lam = rule.lam is not None
    budget = (rule.lam - 1.0) if lam else rule.delta
    if R:
        grid = (R, triton.cdiv(V, BLOCK))
        _prefix_kernel[grid](flat_p, flat_q, neighbours, prefix, moved_in, V, k, float(budget), LAM=lam, BLOCK=BLOCK,
                             BLOCK_K=min(64, triton.next_power_of_2(k)), enable_fp_fusion=False)
        _target_kernel[grid](flat_p, flat_q, starts, claimers, ranks, prefix, moved_in, out, V, BLOCK=BLOCK,
                             enable_fp_fusion=False)
    return out.view(p.shape)


@_jit
def _prefix_kernel(p, q, neighbours, prefix, moved_in, V, k, budget, LAM: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    on = z < V
    p += row * V
    p_z = tl.load(p + z, mask=on, other=0.0)
    q_z = tl.load(q + row * V + z, mask=on, other=0.0)
    live = on & (p_z > 0) & (q_z > 0)  # supp(p) ∩ supp(q): every other token's terms are exact zeros
    limit = budget * p_z if LAM else tl.zeros((BLOCK,), tl.float32) + budget  # lam - 1 arrives as `budget`
    carried = tl.zeros((BLOCK,), tl.float32)
    moved = tl.zeros((BLOCK,), tl.float32)
    count = tl.zeros((BLOCK,), tl.int32)
    j = tl.arange(0, BLOCK_K)
    for start in range(0, k, BLOCK_K):
        m = live[:, None] & (start + j < k)[None, :]
        nb = tl.load(neighbours + z.to(tl.int64)[:, None] * k + start + j[None, :], mask=m, other=0)
        mass = tl.load(p + nb, mask=m, other=0.0)
        running = carried[:, None] + tl.cumsum(mass, 1)
        within = m & (running <= limit[:, None])  # a prefix: the running mass only grows
        moved += tl.sum(tl.where(within, mass, 0.0), 1)
        count += tl.sum(within.to(tl.int32), 1)
        carried = tl.max(tl.where(m, running, 0.0), 1)
    tl.store(prefix + row * V + z, count, mask=on)
    tl.store(moved_in + row * V + z, moved, mask=on)


@_jit
def _target_kernel(p, q, starts, claimers, ranks, prefix, moved_in, out, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    on = y < V
    p += row * V
    q += row * V
    prefix += row * V
    lo = tl.load(starts + y, mask=on, other=0)
    n = tl.load(starts + y + 1, mask=on, other=0) - lo
    claimed = tl.zeros((BLOCK,), tl.float32)
    for c in range(0, tl.max(n, 0)):  # y's claimers in token order: the twin's summation order
        m = c < n
        z = tl.load(claimers + lo + c, mask=m, other=0)
        rank = tl.load(ranks + lo + c, mask=m, other=0)
        claims = m & (rank < tl.load(prefix + z, mask=m, other=0))
        claimed += tl.where(claims, tl.load(q + z, mask=claims, other=0.0), 0.0)
    p_y = tl.load(p + y, mask=on, other=0.0)
    q_y = tl.load(q + y, mask=on, other=0.0)
    pi = p_y * tl.maximum(1.0 - claimed, 0.0) + q_y * tl.load(moved_in + row * V + y, mask=on, other=0.0)
    tl.store(out + row * V + y, pi, mask=on)
