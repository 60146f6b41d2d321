"""GSD's relaxed target in one kernel: pi = p (1 - claimed) + q moved_in over the vocabulary,
with groups taken in probability-rank order (grouped speculative decoding, So et al. 2025,
arXiv 2508.07747; `mmgen.decoding.GroupedAcceptance`, bounded rule).

The rule's torch path (`GroupedAcceptance._relaxed_target_ranks`) sorts each row of p, then
for each of the 2 w rank offsets (w = 7) builds a [rows, V] membership mask (the partner's
probability gap and a close-pair bitset lookup) and accumulates moved_in and, with `index_add_`,
claimed: about 2 w passes over [rows, V] float and index temporaries, and a host sync to trim
the ranks past the largest support. The kernel takes the sorted rows (torch's sort) and
computes every rank's 2 w memberships in registers, one program per block of ranks: loads of
the rank window, one bitset byte per pair, no temporaries and no sync.

A rank s is claimed by the rank s - o whose offset-o partner it is, so the kernel gathers
claimed[s] from rank s - o instead of scattering (no atomics: deterministic on a GPU, unlike
`index_add_` there), and adds the offsets in the rule's order without fused multiply-adds:
pi has the twin's bits (tested under the interpreter). The acceptance test and the residual
are the exact rule's against pi (`verify_exact`).
"""

from __future__ import annotations

from typing import Optional

import torch

from mmgen.kernels._triton import jit as _jit, tl, triton


def grouped_target_triton(rule, p: torch.Tensor, q: torch.Tensor, block: Optional[int] = None) -> torch.Tensor:
    """`rule.relaxed_target(p, q)` (the twin) with the groups in one kernel launch after
    torch's sort. Needs the rule's close-pair bitset (vocabularies up to 16384 tokens)."""
    V = p.shape[-1]
    close = rule.close.to(p.device)
    if close.bits is None:
        raise ValueError(f"the grouped kernel needs the close-pair bitset (vocabularies up to 16384 tokens), V = {V}")
    rows = lambda t: t.reshape(-1, V).float().contiguous()
    flat_p, flat_q = rows(p), rows(q)
    sorted_p, sorted_idx = flat_p.sort(-1, descending=True)
    out = torch.empty_like(flat_p)
    reach = min(rule.rank_window, V - 1)
    BLOCK = block or min(1024, triton.next_power_of_2(V))
    if len(flat_p):
        _grouped_kernel[(len(flat_p), triton.cdiv(V, BLOCK))](
            sorted_p, sorted_idx, flat_q, close.bits, out, V, float(rule.prob_threshold),
            REACH=reach, BLOCK=BLOCK, enable_fp_fusion=False,
        )
    return out.view(p.shape)


@_jit
def _close(bits, a, b, V, ok):
    """Whether tokens a and b are a close pair: bit a V + b of the bitset."""
    code = a * V + b
    byte = tl.load(bits + (code >> 3), mask=ok, other=0).to(tl.int32)
    return ((byte >> (code & 7).to(tl.int32)) & 1) != 0


@_jit
def _grouped_kernel(sorted_p, sorted_idx, q, bits, out, V, threshold, REACH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    on = s < V
    sorted_p += row * V
    sorted_idx += row * V
    q += row * V
    sp = tl.load(sorted_p + s, mask=on, other=0.0)
    si = tl.load(sorted_idx + s, mask=on, other=0)
    sq = tl.load(q + si, mask=on, other=0.0)
    moved_in = tl.zeros((BLOCK,), tl.float32)
    claimed = tl.zeros((BLOCK,), tl.float32)
    for step in tl.static_range(2 * REACH):
        o = step - REACH if step < REACH else step - REACH + 1  # -w, ..., -1, 1, ..., w: the rule's order
        # s's partner at rank s + o is in s's group: it moves its mass onto s.
        t = s + o
        inside = on & (t >= 0) & (t < V)
        tp = tl.load(sorted_p + t, mask=inside, other=0.0)
        ti = tl.load(sorted_idx + t, mask=inside, other=0)
        member = inside & (tl.abs(tp - sp) < threshold) & (sp > 0) & _close(bits, si, ti, V, inside)
        moved_in += tl.where(member, tp, 0.0)
        # Rank r = s - o has s as its offset-o partner: if s is in r's group, r claims q(r) of s.
        r = s - o
        from_r = on & (r >= 0) & (r < V)
        rp = tl.load(sorted_p + r, mask=from_r, other=0.0)
        ri = tl.load(sorted_idx + r, mask=from_r, other=0)
        rq = tl.load(q + ri, mask=from_r, other=0.0)
        claims = from_r & (tl.abs(sp - rp) < threshold) & (rp > 0) & _close(bits, ri, si, V, from_r)
        claimed += tl.where(claims, rq, 0.0)
    pi = sp * tl.maximum(1.0 - claimed, 0.0) + sq * moved_in
    tl.store(out + row * V + si, pi, mask=on)
