"""Acceptance rules: given the target's and the drafter's distributions, keep or reject drafts.

A rule sees every draft position at once (vLLM's rejection sampler) and returns which drafts
pass their own test and, per position, the distribution to resample from if that position is
the first rejection. The decoder turns that into an accepted prefix.

Rules are small frozen dataclasses. `probabilities(p, q, drafts)` gives the exact acceptance
probability and residual (what the tests enumerate); `__call__` draws the accept decisions.
Rules that need a per-token table of the model (embeddings, VQ codebook) get it through
`bind(model)`, which the decoder calls once per `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import torch

from mmgen.decoding.base import check_int
from mmgen.inference import version
from mmgen.modeling import token_table
from mmgen.sampling import uniform

# Work on at most this many elements per tensor when a rule scores every token of the
# vocabulary against its neighbours (V x k per position): 2**25 elements, 128 MiB per float32
# tensor (a chunk holds a few such temporaries).
_CHUNK_ELEMENTS = 2**25


class AcceptanceRule:
    """Base class: subclasses implement `probabilities`; `bind` attaches model tables."""

    #: False for rules whose output distribution is exactly the target's.
    lossy: bool = False

    def bind(self, model: Any) -> "AcceptanceRule":
        """This rule, ready for `model` (default: nothing to prepare)."""
        return self

    def probabilities(
        self, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """p, q: [B, n, V] float32; drafts: [B, n] -> (P(accept) [B, n], residual [B, n, V])."""
        raise NotImplementedError

    def __call__(
        self, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B, n] bool, residual [B, n, V]) with one uniform draw per draft. The loop
        reads decisions only up to each row's first rejection and the residual only there, so a
        rule may stop deciding after it (False) and leave other residuals as anything that can
        be sampled from (the bounded lossy rules leave p there)."""
        accept, residual = self.probabilities(p, q, drafts)
        return uniform(drafts.shape, generator, p.device) < accept, residual


@dataclass(frozen=True)
class ExactAcceptance(AcceptanceRule):
    """Lossless speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023).

    Draft x drawn from q is accepted with probability min(1, p(x) / q(x)); at the first
    rejection the token is resampled from norm(max(0, p - q)). The output is distributed
    exactly as p whatever q is, provided x really was drawn from q.
    """

    def probabilities(self, p, q, drafts):
        return _ratio(p, q, drafts), residual_distribution(p, q)


def _ratio(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) at the drafts; q(x) > 0 because x was drawn from q."""
    p_x = p.gather(-1, drafts[..., None]).squeeze(-1)
    q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
    return (p_x / q_x.clamp_min(torch.finfo(q.dtype).tiny)).clamp_max(1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis; where p == q (nothing left) fall back to p.

    A rejection implies p(x) < q(x), so the residual has positive mass in exact arithmetic;
    the fallback only guards rounding when p and q agree to the last bit.
    """
    return _normalise_or(p, (p - q).clamp_min(0))


def _normalise_or(fallback: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """mass / its sum over the last axis, or `fallback` where it has none; reuses `mass`'s
    buffer (a fresh temporary at every call site), so a [B, n, V] residual costs one buffer."""
    total = mass.sum(-1, keepdim=True)
    if mass.requires_grad or fallback.requires_grad:  # out= has no autograd: the plain path
        return torch.where(total > 0, mass / total.clamp_min(torch.finfo(mass.dtype).tiny), fallback)
    mass.div_(total.clamp_min(torch.finfo(mass.dtype).tiny))
    return torch.where(total > 0, mass, fallback, out=mass)


def _set_number(rule, name: str, valid, meaning: str) -> None:
    """Validate a numeric field of a frozen rule and store it as a float (CLI specs may give ints)."""
    value = getattr(rule, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(float(value)):
        raise ValueError(f"{name} must be a number: {meaning}; got {value!r}")
    object.__setattr__(rule, name, float(value))


# --------------------------------------------------------------------------------------------
# Lossy rules: move a bounded amount of probability onto the draft from tokens that are
# interchangeable with it (a group, a latent neighbourhood).
# --------------------------------------------------------------------------------------------


class NeighbourhoodAcceptance(AcceptanceRule):
    """Shared machinery of grouped and relaxed acceptance.

    Each rule defines, for a draft x, a set N(x) of tokens interchangeable with x and lets the
    draft claim their target mass: the per-draft relaxed target p_x moves p(N(x)) onto x.

    `bounded=True` (the default) verifies exactly against the q-mixture of those targets,
    pi = sum_x q(x) p_x = p * (1 - Q) + q * s, where s(x) = p(N(x)) and Q(y) = q(N^-1(y)).
    The output is then distributed exactly as pi, so it moves at most E_q[p(N(x))] of mass
    away from p (at most delta for relaxed acceptance) and pi <= lambda * p for LANTERN++.
    When q is one-hot (random or copied drafts) pi = p_x, which is the paper's rule exactly.

    `bounded=False` is the papers' literal per-draft rule: accept with the relaxed ratio,
    resample from the papers' residual. With a spread-out q (drafts carried over from the
    previous Jacobi iteration) that rule has no mass bound: on 6-token vocabularies it moves more
    than delta (up to 2.7 delta in our search; tests/core/test_acceptance.py keeps a case). It accepts more, which the
    benchmarks measure.
    """

    lossy = True
    bounded: bool = True

    def probabilities(self, p, q, drafts):
        if self.bounded:
            pi = self.relaxed_target(p, q)
            return _ratio(pi, q, drafts), residual_distribution(pi, q)
        return self.literal(p, q, drafts)

    def __call__(self, p, q, drafts, generator):
        """The bounded rule on the CPU scores positions left to right, in chunks of 1, 2, 4, ...
        positions, and stops at each row's first rejection: the loop reads decisions only up to
        there and the residual only there, so later chunks are never scored (decisions past
        the first rejection come back False, the residual elsewhere is p). Each scored position
        is computed as `probabilities` computes it (the same bits), from the same uniform
        draws, so decodes are unchanged; a row whose first rejection is at draft j costs at
        most 2j + 1 positions instead of all of them. Off the CPU (a host sync per chunk) and
        for the literal rule: every position at once."""
        if not self.bounded or p.device.type != "cpu" or drafts.ndim != 2:
            return super().__call__(p, q, drafts, generator)
        u = uniform(drafts.shape, generator, p.device)
        accepted = torch.zeros(drafts.shape, dtype=torch.bool, device=p.device)
        residual = p.clone()
        alive = torch.arange(drafts.shape[0], device=p.device)  # rows with no rejection yet
        start, width, n = 0, 1, drafts.shape[1]
        while start < n and len(alive):
            js = slice(start, min(n, start + width))
            ok, residual_of = self._decide(p[alive, js], q[alive, js], drafts[alive, js], u[alive, js])
            passed = ok.long().cumprod(-1)
            accepted[alive, js] = passed.bool()
            first = passed.sum(-1)  # each row's first rejection in the chunk (its width if none)
            rejected = first < ok.shape[1]
            if bool(rejected.any()):
                at = torch.zeros_like(ok)
                at[rejected.nonzero().squeeze(1), first[rejected]] = True
                residual[alive[rejected], start + first[rejected]] = residual_of(at)
            alive, start, width = alive[~rejected], start + ok.shape[1], 2 * width
        return accepted, residual

    def _decide(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor):
        """Positions of some rows: p, q [R, m, V], drafts x [R, m], uniforms u [R, m] ->
        (accepted [R, m], a function giving the residuals [c, V] at the c places a mask [R, m]
        picks, in row-major order)."""
        pi = self.relaxed_target(p, q)
        return u < _ratio(pi, q, x), lambda at: residual_distribution(pi[at], q[at])

    def relaxed_target(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """pi = sum_x q(x) p_x over the whole vocabulary, [B, n, V]."""
        raise NotImplementedError

    def literal(self, p, q, drafts):
        raise NotImplementedError


@dataclass(frozen=True)
class RelaxedAcceptance(NeighbourhoodAcceptance):
    """Relaxed acceptance over latent neighbours: LANTERN (Jang et al. 2024, arXiv 2410.03355)
    and LANTERN++ (Park et al. 2025, arXiv 2502.06352).

    Neighbours come from the VQ codebook (L2, self excluded; the model's `codebook()` table),
    computed once per table. N(x) is the longest prefix of x's `k` nearest neighbours whose
    target mass stays <= `delta` (LANTERN's total-variation budget) or, when `lam` is given,
    <= (lam - 1) * p(x) (LANTERN++'s static bound, so p~(x) <= lam * p(x)). Accept with
    min(1, p~(x) / q(x)), p~(x) = p(x) + p(N(x)); on rejection the neighbours are removed
    from the residual. Defaults: k = 1000, delta = 0.1 (the paper's code).
    """

    k: int = 1000
    delta: float = 0.1
    lam: Optional[float] = None
    bounded: bool = True
    neighbours: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        check_int("k", self.k, 1)
        _set_number(self, "delta", lambda v: 0.0 <= v <= 1.0, "a total-variation budget in [0, 1]")
        if self.lam is not None:
            _set_number(self, "lam", lambda v: v >= 1.0, ">= 1 (lam = 1 is lossless)")

    def bind(self, model: Any) -> "RelaxedAcceptance":
        return replace(self, neighbours=nearest_neighbours(token_table(model, "codebook"), self.k))

    def _table(self) -> torch.Tensor:
        if self.neighbours is None:
            raise ValueError("RelaxedAcceptance is not bound to a model: call rule.bind(token_model) first")
        return self.neighbours

    def _within(self, p_x: torch.Tensor, neighbour_p: torch.Tensor, positive: bool = False) -> torch.Tensor:
        """Which neighbours (a prefix, since the cumulative sum only grows) fit the budget. A
        token the sampling filters removed (p(x) = 0) claims nothing, so it is never emitted
        (`positive`: the caller knows every p(x) > 0)."""
        budget = self.delta if self.lam is None else (self.lam - 1.0) * p_x[..., None]
        within = neighbour_p.cumsum(-1) <= budget
        return within if positive else within & (p_x[..., None] > 0)

    def relaxed_target(self, p, q):
        neighbours = self._table().to(p.device)
        V = neighbours.shape[0]
        flat_p, flat_q = p.reshape(-1, V), q.reshape(-1, V)
        support = (flat_p > 0) & (flat_q > 0)
        if bool(support.all()):
            return self._relaxed_target_dense(flat_p, flat_q, neighbours).view_as(p)
        return self._relaxed_target_on(support, flat_p, flat_q, neighbours).view_as(p)

    def _relaxed_target_dense(self, flat_p, flat_q, neighbours):
        """`relaxed_target` over the whole vocabulary: [rows, V, k] in chunks."""
        V, k = neighbours.shape
        pi = torch.empty_like(flat_p)
        rows = max(1, _CHUNK_ELEMENTS // max(1, V * k))
        for start in range(0, flat_p.shape[0], rows):
            pc, qc = flat_p[start : start + rows], flat_q[start : start + rows]
            neighbour_p = pc[:, neighbours]  # [R, V, k]: p of each token's neighbours
            within = self._within(pc, neighbour_p)
            moved_in = (neighbour_p * within).sum(-1)
            claimed = torch.zeros_like(pc).index_add_(1, neighbours.reshape(-1), (qc[..., None] * within).reshape(len(pc), -1))
            pi[start : start + rows] = pc * (1 - claimed).clamp_min(0) + qc * moved_in
        return pi

    def _relaxed_target_on(self, support, flat_p, flat_q, neighbours):
        """`relaxed_target` row by row over each row's S = supp(p) ∩ supp(q): a token outside S
        claims nothing (p(x) = 0 fails the budget test) or is weighted by q(x) = 0, so every
        term dropped is an exact zero and S stays in token order: the same bits as the dense
        [V, k] pass at |S| / V of its work (top-k sampling: 2000 of 16384 tokens)."""
        pi = torch.empty_like(flat_p)
        neighbours = _int32(neighbours)  # half the memory traffic of the row reads
        for r, (pc, qc) in enumerate(zip(flat_p, flat_q)):
            xs = support[r].nonzero().squeeze(1)
            nb = neighbours.index_select(0, xs)  # [S, k]; index_select: a third of indexing's time
            neighbour_p = pc.index_select(0, nb.reshape(-1)).view_as(nb)
            within = self._within(pc[xs], neighbour_p, positive=True)  # S is inside supp(p)
            moved_in = torch.zeros_like(pc).index_copy_(0, xs, (neighbour_p * within).sum(-1))
            claimed = torch.zeros_like(pc).index_add_(0, nb.reshape(-1), (qc[xs, None] * within).reshape(-1))
            pi[r] = pc * (1 - claimed).clamp_min(0) + qc * moved_in
        return pi

    def _decide(self, p, q, x, u):
        """LANTERN's bounded rule without the whole target: pi at each draft (its own neighbour
        prefix, plus the mass its reverse neighbours claim from it), and pi over the vocabulary
        only where a residual is asked for (each row's first rejection, the one place the loop
        reads it). The same bits as the whole pass (tested). Used when k <= V / 4 (LlamaGen's
        16384 codes with k = 1000): with k near V (a small codebook) each draft's claimers are
        most of the vocabulary and the whole pass is cheaper."""
        R, m, V = p.shape
        if 4 * self._table().shape[1] > V:
            return super()._decide(p, q, x, u)
        flat_p, flat_q, flat_x = p.reshape(-1, V), q.reshape(-1, V), x.reshape(-1)
        pi_x = self._target_at(flat_p, flat_q, flat_x).view(R, m)
        q_x = q.gather(-1, x[..., None]).squeeze(-1)
        ok = u < (pi_x / q_x.clamp_min(torch.finfo(q.dtype).tiny)).clamp_max(1.0)

        def residual_of(at):
            at_p, at_q = p[at], q[at]
            pi = self._relaxed_target_on((at_p > 0) & (at_q > 0), at_p, at_q, self._table().to(p.device))
            return residual_distribution(pi, at_q)

        return ok, residual_of

    def _target_at(self, flat_p: torch.Tensor, flat_q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """pi(x) for one token x [R] per row of `flat_p`, `flat_q` [R, V]: p(x) (1 - claimed(x))
        + q(x) moved_in(x), summed in the order the whole-vocabulary pass sums (claimed: over
        the claiming tokens z in token order, one float32 addition at a time, as `index_add_`)."""
        neighbours = self._table().to(flat_p.device)
        R, rows = len(x), torch.arange(len(x), device=x.device)
        p_x, q_x = flat_p[rows, x], flat_q[rows, x]
        neighbour_p = flat_p.gather(1, neighbours[x])
        moved_in = (neighbour_p * self._within(p_x, neighbour_p)).sum(-1)
        # Who could claim x: every z with x among its k nearest, at rank r; z claims x when z is
        # in supp(p) ∩ supp(q) and its prefix up to r fits its budget.
        starts, claimers, ranks = self._reverse()
        rows_of = _int32(neighbours)
        claimed = torch.zeros(R, device=flat_p.device)
        for r in range(R):
            lo, hi = int(starts[x[r]]), int(starts[x[r] + 1])
            z, rank = claimers[lo:hi].to(flat_p.device).long(), ranks[lo:hi].to(flat_p.device).long()
            keep = (flat_p[r, z] > 0) & (flat_q[r, z] > 0)
            z, rank = z[keep], rank[keep]
            if not len(z):
                continue
            nb = rows_of.index_select(0, z)
            z_p = flat_p[r].index_select(0, nb.reshape(-1)).view_as(nb)  # [m, k], the rows the whole pass cumsums
            within = self._within(flat_p[r, z], z_p, positive=True).gather(1, rank[:, None]).squeeze(1)  # z: p > 0
            terms = flat_q[r, z][within]
            if len(terms):
                claimed[r] = float(np.add.accumulate(terms.cpu().numpy(), dtype=np.float32)[-1])
        return p_x * (1 - claimed).clamp_min(0) + q_x * moved_in

    def _reverse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The neighbour table inverted (CSR, on the CPU): for token x, `claimers[starts[x]:
        starts[x + 1]]` are the tokens z with x among their neighbours, in token order, and
        `ranks` the place of x in z's list."""
        table = self._table()

        def build():
            V, k = table.shape
            flat = table.reshape(-1).cpu()
            order = torch.sort(flat, stable=True).indices  # by x, then by z (stable)
            starts = torch.zeros(V + 1, dtype=torch.long)
            starts[1:] = torch.bincount(flat, minlength=V).cumsum(0)
            return starts, (order // k).to(torch.int32), (order % k).to(torch.int32)  # int32: V k entries each

        return _cached("reverse", table, None, build)

    def kernel_tables(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the fused kernel (`mmgen.kernels.relaxed`) reads, on `device` and cached while
        the bound table lives: the neighbour table [V, k] as int32, and its inverse (`starts`
        [V + 1], `claimers`, `ranks`: for token x, the tokens z with x among their neighbours,
        in token order, and the place of x in z's list)."""
        table = self._table()
        neighbours = _cached("int32-on", table, str(device), lambda: _int32(table).to(device))
        starts, claimers, ranks = _cached("reverse-on", table, str(device),
                                          lambda: tuple(t.to(device) for t in self._reverse()))
        return neighbours, starts, claimers, ranks

    def literal(self, p, q, drafts):
        neighbours = self._table().to(p.device)[drafts]  # [B, n, k]
        neighbour_p = p.gather(-1, neighbours)
        p_x = p.gather(-1, drafts[..., None]).squeeze(-1)
        within = self._within(p_x, neighbour_p)
        relaxed = p_x + (neighbour_p * within).sum(-1)
        q_x = q.gather(-1, drafts[..., None]).squeeze(-1)
        accept = (relaxed / q_x.clamp_min(torch.finfo(q.dtype).tiny)).clamp_max(1.0)
        # The paper's residual: max(0, p - q) without the neighbours the draft claimed (x's own
        # entry is already 0 after a rejection, so pointing the others at it zeroes nothing new).
        claimed = torch.where(within, neighbours, drafts[..., None])
        return accept, _normalise_or(p, (p - q).clamp_min(0).scatter(-1, claimed, 0.0))


@dataclass(frozen=True)
class GroupedAcceptance(NeighbourhoodAcceptance):
    """Grouped speculative decoding (GSD, So et al. 2025, arXiv 2508.07747).

    The group of draft x: tokens within `rank_window` probability ranks of x in p whose
    probability differs from p(x) by less than `prob_threshold` and whose squared L2 distance
    to x in the model's token embedding table (`token_embeddings()`) is below
    `distance_threshold`. The paper's rule accepts with min(1, p(G) / q(G)) and resamples from
    the exact residual (`bounded=False`); the bounded default verifies against the q-mixture
    of "group mass moved onto x" targets (see `NeighbourhoodAcceptance`). Defaults as the
    paper's code: 7 ranks, 0.15, 0.5.
    """

    rank_window: int = 7
    prob_threshold: float = 0.15
    distance_threshold: float = 0.5
    bounded: bool = True
    close: Optional["ClosePairs"] = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        check_int("rank_window", self.rank_window, 0)
        _set_number(self, "prob_threshold", lambda v: v >= 0, ">= 0")
        _set_number(self, "distance_threshold", lambda v: v >= 0, ">= 0")

    def bind(self, model: Any) -> "AcceptanceRule":
        """Groups from the model's token embeddings; for frames of codebooks with their own
        tables (`codebook_embeddings()` [K, V, D], codec TTS), one rule per codebook."""
        tables = getattr(model, "codebook_embeddings", None)
        if int(getattr(model, "num_codebooks", 1)) > 1 and callable(tables):
            return PerCodebook(tuple(replace(self, close=close_pairs(t.detach(), self.distance_threshold)) for t in tables()))
        return replace(self, close=close_pairs(token_table(model, "token_embeddings"), self.distance_threshold))

    def _members(self, sorted_p, sorted_idx, offset):
        """For each rank r, the token at rank r + offset and whether it is in r's group."""
        V = sorted_p.shape[-1]
        if self.close is None:
            raise ValueError("GroupedAcceptance is not bound to a model: call rule.bind(token_model) first")
        close = self.close.to(sorted_p.device)
        ranks = torch.arange(V, device=sorted_p.device) + offset
        inside = (ranks >= 0) & (ranks < V)
        partner = sorted_idx[..., ranks.clamp(0, V - 1)]
        partner_p = sorted_p[..., ranks.clamp(0, V - 1)]
        member = inside & ((partner_p - sorted_p).abs() < self.prob_threshold) & close[sorted_idx, partner]
        # A token the sampling filters removed (p = 0) claims nothing, so it is never emitted.
        return partner, partner_p, member & (sorted_p > 0)

    def _offsets(self, vocab_size: int):
        # Ranks further apart than the vocabulary have no partner: skipping them changes nothing.
        reach = min(self.rank_window, vocab_size - 1)
        return [o for o in range(-reach, reach + 1) if o != 0]

    def relaxed_target(self, p, q):
        return self._relaxed_target_ranks(p, q)

    def _relaxed_target_ranks(self, p, q, restrict: bool = True):
        """pi in rank order. With `restrict`, only the ranks up to the largest support of p
        among the rows (plus the rank window): past it every p is 0, so nothing there claims
        or is claimed into a non-zero pi, and every term dropped is an exact zero (the same
        bits as the whole vocabulary, tested); under top-k 2000 of 16384 that is 1/8 of it."""
        sorted_p, sorted_idx = p.sort(-1, descending=True)
        V = p.shape[-1]
        reach = min(V, int((sorted_p > 0).sum(-1).max()) + self.rank_window) if restrict else V
        sorted_p, sorted_idx = sorted_p[..., :reach], sorted_idx[..., :reach]
        sorted_q = q.gather(-1, sorted_idx)
        moved_in = torch.zeros_like(sorted_p)
        claimed = torch.zeros_like(sorted_p)  # in rank order
        for offset in self._offsets(V):
            _, partner_p, member = self._members(sorted_p, sorted_idx, offset)
            moved_in += partner_p * member
            # The token at rank r + offset is claimed by rank r with weight q(rank r).
            ranks = (torch.arange(reach, device=p.device) + offset).clamp(0, reach - 1)
            claimed.index_add_(-1, ranks, sorted_q * member)
        pi_sorted = sorted_p * (1 - claimed).clamp_min(0) + sorted_q * moved_in
        return torch.zeros_like(p).scatter_(-1, sorted_idx, pi_sorted)

    def literal(self, p, q, drafts):
        sorted_p, sorted_idx = p.sort(-1, descending=True)
        rank = torch.empty_like(sorted_idx).scatter_(-1, sorted_idx, torch.arange(p.shape[-1], device=p.device).expand_as(sorted_idx))
        rank_x = rank.gather(-1, drafts[..., None])
        group_p = p.gather(-1, drafts[..., None]).squeeze(-1)
        group_q = q.gather(-1, drafts[..., None]).squeeze(-1)
        at_x = lambda t: t.gather(-1, rank_x).squeeze(-1)  # a rank-ordered table's entry at x
        for offset in self._offsets(p.shape[-1]):
            partner, partner_p, member = self._members(sorted_p, sorted_idx, offset)
            m = at_x(member)
            group_p = group_p + at_x(partner_p) * m
            group_q = group_q + q.gather(-1, at_x(partner)[..., None]).squeeze(-1) * m
        accept = (group_p / group_q.clamp_min(torch.finfo(q.dtype).tiny)).clamp_max(1.0)
        return accept, residual_distribution(p, q)


# --------------------------------------------------------------------------------------------
# Per-token tables, computed once per model table.
# --------------------------------------------------------------------------------------------

_TABLE_CACHE: dict = {}


def _cached(kind: str, table: torch.Tensor, param, build):
    """Memoise a table derived from `table` while its memory holds the same, unmodified values.

    The key is the table's storage address and version counter (shared with the parameter a
    detached table views, and bumped by in-place updates); the entry keeps the table alive, so
    no other tensor can take that address while the entry exists.
    """
    key = (kind, table.data_ptr(), version(table), tuple(table.shape), table.stride(), table.dtype, str(table.device), param)
    if key not in _TABLE_CACHE:
        if len(_TABLE_CACHE) >= 8:
            _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
        _TABLE_CACHE[key] = (table, build())
    return _TABLE_CACHE[key][1]


def _int32(table: torch.Tensor) -> torch.Tensor:
    """An int32 copy of an index table (cached while the table lives): row reads move half the
    bytes (LlamaGen's 16384 x 1000 neighbours: 65 MB instead of 131 MB)."""
    return _cached("int32", table, None, lambda: table.to(torch.int32))


def nearest_neighbours(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """[V, min(k, V - 1)] indices of each codebook vector's nearest others by L2 (self excluded)."""
    k = min(k, codebook.shape[0] - 1)

    def build():
        rows, table = [], codebook.float()
        for start, chunk in _enumerate_chunks(table):
            d = torch.cdist(chunk, table)
            d[torch.arange(len(chunk)), torch.arange(start, start + len(chunk))] = float("inf")
            rows.append(d.topk(k, dim=-1, largest=False).indices)
        return torch.cat(rows)

    return _cached("nn", codebook, k, build)


#: Vocabularies up to this many pairs (V^2) keep a bitset of the close pairs beside the sorted
#: list: V = 16384 (LlamaGen's codebook) is 32 MiB, and a lookup is two gathers instead of a
#: binary search (GSD's rule cost at that size: 14 rank offsets of lookups per position).
_BITSET_MAX_PAIRS = 2**28


class ClosePairs:
    """The pairs of tokens whose embeddings are close, as a sorted list of codes a * V + b:
    O(pairs) memory instead of a [V, V] table (22 GB of bools at a 150k text vocabulary), and
    membership by binary search; vocabularies up to 16384 also keep a [V * V] bitset (one bit
    a pair) for constant-time membership."""

    def __init__(self, codes: torch.Tensor, vocab_size: int, bits: Optional[torch.Tensor] = None):
        self.codes, self.vocab_size = codes, vocab_size
        if bits is None and vocab_size * vocab_size <= _BITSET_MAX_PAIRS:
            ones = torch.ones(1, dtype=torch.uint8, device=codes.device).bitwise_left_shift((codes & 7).to(torch.uint8))
            bits = torch.zeros((vocab_size * vocab_size + 7) // 8, dtype=torch.uint8, device=codes.device)
            bits.index_add_(0, codes >> 3, ones)  # codes are unique: the sum of a byte's bits is their OR
        self.bits = bits

    def to(self, device) -> "ClosePairs":
        return ClosePairs(self.codes.to(device), self.vocab_size, None if self.bits is None else self.bits.to(device))

    def __getitem__(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Bool tensor: is (a, b) close, for index tensors a, b of one shape."""
        a, b = pair
        query = a * self.vocab_size + b
        if self.bits is not None:
            return (self.bits[query >> 3].bitwise_right_shift((query & 7).to(torch.uint8)) & 1).bool()
        if not len(self.codes):
            return torch.zeros_like(query, dtype=torch.bool)
        at = torch.searchsorted(self.codes, query.reshape(-1)).clamp_max(len(self.codes) - 1).view_as(query)
        return self.codes[at] == query


def close_pairs(embeddings: torch.Tensor, threshold: float) -> ClosePairs:
    """The token pairs whose squared L2 embedding distance is below `threshold`."""

    def build():
        table = embeddings.float()
        V, sq = table.shape[0], (table**2).sum(-1)
        codes = []
        for start, chunk in _enumerate_chunks(table):
            close = (sq[start : start + len(chunk), None] + sq[None] - 2 * chunk @ table.T) < threshold
            a, b = close.nonzero(as_tuple=True)
            codes.append((a + start) * V + b)  # row-major, so already sorted
        return ClosePairs(torch.cat(codes), V)

    return _cached("close", embeddings, float(threshold), build)


def _enumerate_chunks(table: torch.Tensor):
    size = max(1, _CHUNK_ELEMENTS // table.shape[0])
    return [(start, table[start : start + size]) for start in range(0, table.shape[0], size)]


@dataclass(frozen=True)
class PerCodebook(AcceptanceRule):
    """One bound rule per codebook of a frame ([B, n, K, V] laws, drafts [B, n, K]): each
    codebook's pairs are judged by its own rule (grouped acceptance with that codebook's
    embedding table). The loop calls it on frames unflattened (`frames = True`)."""

    rules: tuple = ()
    frames = True

    @property
    def lossy(self) -> bool:
        return any(rule.lossy for rule in self.rules)

    def probabilities(self, p, q, drafts):
        parts = [rule.probabilities(p[:, :, c], q[:, :, c], drafts[:, :, c]) for c, rule in enumerate(self.rules)]
        return torch.stack([a for a, _ in parts], 2), torch.stack([r for _, r in parts], 2)
