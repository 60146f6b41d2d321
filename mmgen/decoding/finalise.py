"""The finalise rule of speculative decoding: after verification, the accepted draft prefix and
one more token per row.

Its own module so that the speculative loop (`speculative.py`) and the fused kernels
(`mmgen.kernels`, whose exact-rule twin calls it) share one rule while neither imports the
other's module: the loop imports the kernels lazily, the kernels import this.
"""

from __future__ import annotations

from typing import Optional

import torch


def finalise(accepted: torch.Tensor, resampled: torch.Tensor, fresh: torch.Tensor, drafts: torch.Tensor,
             K: int, limit: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Accepted draft prefix n_acc [B], the token finalised after it [B(, K)] and, for frames,
    how many of its codebooks are final [B] (for models that complete frames themselves).

    `accepted` [B, k(, K)] says which drafts `drafts` [B, k(, K)] passed the rule; `resampled`
    [B, k(, K)] holds the draw at each position for when it is the first rejected one; `fresh`
    holds the target's own samples, its last slot the bonus: [B, k + 1, K] for frames, [B, 1]
    or [B, k + 1] for tokens.

    Tokens: the bonus sample when every draft passed, else the resample at the first rejected
    position. Frames: the first rejected frame keeps its accepted codebooks, takes the resample
    at its first rejected codebook and the target's own samples after it.

    `limit` [B] (`fresh` at every slot): row b verifies only its first limit[b] drafts (a
    per-row window, `mmgen.decoding.window.RowWindows`); its bonus is its sample at slot
    limit[b], and drafts after them are not read.
    """
    k = drafts.shape[1]
    frame_ok = accepted if K == 1 else accepted.all(-1)
    if limit is not None:
        frame_ok = frame_ok & (torch.arange(k, device=limit.device) < limit[:, None])
    n_acc = frame_ok.long().cumprod(-1).sum(-1)
    at = n_acc.clamp_max(k - 1)[:, None]
    if K == 1:
        if limit is not None:
            return n_acc, torch.where(n_acc == limit, fresh.gather(1, limit[:, None])[:, 0], resampled.gather(1, at)[:, 0]), None
        return n_acc, torch.where(n_acc == k, fresh[:, -1], resampled.gather(1, at)[:, 0]), None
    pick = lambda t: t.gather(1, at[..., None].expand(-1, -1, K))[:, 0]  # [B, K] at the first rejected frame
    ok = pick(accepted.long()).cumprod(-1).bool()  # codebooks accepted before the first rejection
    first_bad = torch.cat([~ok[:, :1], ok[:, :-1] & ~ok[:, 1:]], 1)
    rejected_frame = torch.where(ok, pick(drafts), torch.where(first_bad, pick(resampled), pick(fresh[:, :-1])))
    full = n_acc == (k if limit is None else limit)
    bonus = fresh[:, -1] if limit is None else fresh.gather(1, limit[:, None, None].expand(-1, 1, K))[:, 0]
    known = torch.where(full, 1, ok.sum(-1) + 1)
    return n_acc, torch.where(full[:, None], bonus, rejected_frame), known
