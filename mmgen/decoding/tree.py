"""Token trees: several draft continuations verified in one forward, exactly.

A proposer's tree here is `width` branches of `d` drafts each that leave the newest token with
distinct first tokens (the root's children) and go on as chains (Medusa's and SpecInfer's trees
branch most at the first draft, where a chain's acceptance is lowest). The model scores the
whole tree in one forward with tree attention (`TreeModel.forward_tree`: each draft attends to
the committed tokens and its own ancestors, at its depth's position; SpecInfer, Miao et al.
2024, arXiv 2305.09781), then keeps the chosen branch's keys and values (`keep_path`), so the
loop commits it as it commits a chain.

Acceptance is exact:

- greedy: the branch whose drafts match the target's argmax the longest (first on ties);
- sampling: recursive rejection sampling over the root's children (Jeon et al. 2024, "Recursive
  Speculative Decoding", arXiv 2402.14160; SpecTr's multi-draft setting, Sun et al. 2023):
  child j was drawn from Q_j (the drafter's law without the children before it, or a point
  mass for copied drafts) and is accepted with probability min(1, P_j(x) / Q_j(x)); on a
  rejection P_{j+1} = norm(max(0, P_j - Q_j)). Whatever Q_j, the token that leaves the root is
  distributed as P_1, the target's law: the first accepted child, or a draw from the last
  residual when every child was rejected. Below an accepted child its chain is verified by
  `ExactAcceptance` as any chain is, with the bonus token at its end.

Each forward draws the same number of values from the generator whatever it accepts (a fixed
seed gives the same tokens run after run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from mmgen.decoding.acceptance import ExactAcceptance, residual_distribution
from mmgen.decoding.proposer import DecodeRun, Proposer
from mmgen.modeling import TreeModel
from mmgen.sampling import Logits, exponential_noise, sample, uniform


@dataclass
class TreeDrafts:
    """A proposer's tree: `tokens` [B, W, d], branch j's drafts in order; `laws` [B, W, d, V]
    the law each was drawn from (for the first draft of branch j: given the first drafts of the
    branches before it), or None under greedy decoding; `valid` [B, W]: branches that exist (a
    law with fewer than W tokens, fewer copies found)."""

    tokens: torch.Tensor
    laws: Optional[torch.Tensor]
    valid: torch.Tensor


def distinct_children(q: torch.Tensor, width: int, generator: torch.Generator,
                      greedy: bool, ranking: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """`width` distinct tokens from the law `q` [B, V] drawn one after another without
    replacement (the exponential race's order: Plackett-Luce, as Gumbel top-k), with the law
    each was drawn from [B, W, V] and whether it exists [B, W] (q has mass there). Greedy: the
    top `width` tokens of `ranking` [B, V] (the law at temperature 1), no laws."""
    if greedy:
        top = (q if ranking is None else ranking).topk(width, -1)
        return top.indices, None, top.values > 0
    keys = q / exponential_noise(q.shape, generator, q.device, q.dtype)
    tokens = keys.topk(width, -1).indices
    valid = q.gather(-1, tokens) > 0
    # Q_j: q without the tokens drawn before j, renormalised.
    drawn = torch.zeros(q.shape[0], width, q.shape[-1], dtype=torch.bool, device=q.device)
    for j in range(1, width):
        drawn[:, j] = drawn[:, j - 1]
        drawn[:, j].scatter_(-1, tokens[:, j - 1 : j], True)
    laws = q[:, None].masked_fill(drawn, 0)
    laws = laws / laws.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
    return tokens, laws, valid


def grow_tree(run: DecodeRun, width: int, root: Logits, branch_logits: Callable[[torch.Tensor], Logits]) -> TreeDrafts:
    """A proposer's tree, drafted depth by depth: the root's children from `root` (the drafter's
    logits [B, 1, V] after the newest token; `distinct_children`), then each branch's next draft
    from `branch_logits(tokens)`, the drafter's logits [B, W, V] after each branch's drafts so
    far (`tokens` [B, W, i]), drawn with the run's generator (greedy: the argmax)."""
    index = run.pos[:, None] + 1
    q = run.probs(root, index)[:, 0]
    ranking = replace(run.sampling, temperature=1.0).probs(root, index)[:, 0] if run.greedy else None
    x, first, valid = distinct_children(q, width, run.generator, run.greedy, ranking)
    tokens, laws = [x], [first]
    for j in range(1, run.num_draft):
        q = run.probs(branch_logits(torch.stack(tokens, 2)), (index + j).expand(-1, width))
        tokens.append(q.argmax(-1) if run.greedy else sample(q, run.generator))
        laws.append(q)
    return TreeDrafts(torch.stack(tokens, 2), None if run.greedy else torch.stack(laws, 2), valid)


def tree_forward_logits(model, state, run: DecodeRun, tokens: torch.Tensor) -> Logits:
    """A `TreeModel`'s logits [B, W, V] after each branch of `tokens` [B, W, i] (rooted at the
    run's newest token), from one tree forward left pending: how a drafter model, or the target
    skipping layers, drafts a tree's next depth."""
    layout = TreeLayout(tokens.shape[1], tokens.shape[2], tokens.device)
    logits = model.forward_tree(state, torch.cat([run.newest(), tokens.flatten(1)], 1), layout.depth, layout.visible)
    return logits[:, layout.paths[:, -1]]


class TreeLayout:
    """The slots of a tree of `width` branches of `depth` drafts: slot 0 the newest token, then
    branch j's drafts at 1 + j * depth ..; each slot's depth [n], which window slots it sees
    [n, n] and each branch's slots from the root [W, depth + 1]."""

    def __init__(self, width: int, depth: int, device: torch.device):
        n = 1 + width * depth
        branch = torch.arange(width, device=device)[:, None] * depth + 1 + torch.arange(depth, device=device)  # [W, d]
        self.depth = torch.zeros(n, dtype=torch.long, device=device)
        self.depth[branch.flatten()] = torch.arange(1, depth + 1, device=device).repeat(width)
        self.visible = torch.eye(n, dtype=torch.bool, device=device)
        self.visible[:, 0] = True
        for j in range(width):
            slots = branch[j]
            self.visible[slots[:, None], slots[None, :]] = torch.ones(depth, depth, dtype=torch.bool, device=device).tril()
        self.paths = torch.cat([torch.zeros(width, 1, dtype=torch.long, device=device), branch], 1)  # [W, d + 1]


class TreeStep:
    """One forward of the loop on a proposer's tree (`Proposer.propose_tree`): propose, score in
    one tree forward, accept exactly (module docstring), move the chosen branch's keys and
    values into place and its hidden states into `state.hidden`. Returns what the loop's chain
    step returns, for the chosen branch: (window [B, d + 1], drafts [B, d], p [B, d + 1, V],
    fresh [B, 1], n_acc [B], next token [B]); None when the proposer has no drafts."""

    def __init__(self, width: int):
        self.width = width
        self.layouts: dict = {}
        self.rule = ExactAcceptance()

    def __call__(self, run: DecodeRun, proposer: Proposer):
        tree = proposer.propose_tree(run, self.width)
        B, W, d = tree.tokens.shape
        if d == 0:
            return None
        layout = self.layouts.get((W, d))
        if layout is None:
            layout = self.layouts[(W, d)] = TreeLayout(W, d, run.device)
        model, state, rows = run.model, run.state, torch.arange(B, device=run.device)
        newest = run.newest()
        logits = model.forward_tree(state, torch.cat([newest, tree.tokens.flatten(1)], 1), layout.depth, layout.visible)
        p = run.probs(logits, run.pos[:, None] + 1 + layout.depth[None])  # [B, n, V]
        p = p[:, layout.paths]  # [B, W, d + 1, V]: each branch's laws from the root
        if run.greedy:
            branch, n_acc, next_token = self._greedy(p, tree)
        else:
            branch, n_acc, next_token = self._sampled(run, p, tree)
        path = layout.paths[branch]  # [B, d + 1]
        model.keep_path(state, path)
        proposer.tree_kept(run, branch, n_acc)
        if state.hidden is not None:
            halves = state.hidden.shape[0] // B
            state.hidden = state.hidden.gather(1, path.repeat(halves, 1)[..., None].expand(-1, -1, state.hidden.shape[-1]))
        drafts = tree.tokens[rows, branch]
        return torch.cat([newest, drafts], 1), drafts, p[rows, branch], next_token[:, None], n_acc, next_token

    @staticmethod
    def _greedy(p: torch.Tensor, tree: TreeDrafts):
        """The branch with the longest run of drafts equal to the target's argmax."""
        picks = p.argmax(-1)  # [B, W, d + 1]
        match = (tree.tokens == picks[..., :-1]) & tree.valid[..., None]
        runs = match.long().cumprod(-1).sum(-1)  # [B, W]
        n_acc, branch = runs.max(-1)  # first branch among the longest
        return branch, n_acc, picks[torch.arange(len(branch), device=p.device), branch, n_acc]

    def _sampled(self, run: DecodeRun, p: torch.Tensor, tree: TreeDrafts):
        """Recursive rejection sampling over the root's children, then the chosen chain."""
        B, W, d = tree.tokens.shape
        rows, gen = torch.arange(B, device=p.device), run.generator
        target = p[:, 0, 0]  # P_1: the target's law after the newest token (every branch's root)
        branch = torch.full((B,), -1, dtype=torch.long, device=p.device)
        u = uniform((B, W), gen, p.device)
        for j in range(W):
            x, law = tree.tokens[:, j, :1], tree.laws[:, j, 0]
            p_x, q_x = target.gather(-1, x)[:, 0], law.gather(-1, x)[:, 0]
            open_ = (branch < 0) & tree.valid[:, j]
            accept = open_ & (u[:, j] * q_x < p_x)
            branch = torch.where(accept, j, branch)
            rejected = open_ & ~accept
            target = torch.where(rejected[:, None], residual_distribution(target, law), target)
        chosen = branch.clamp_min(0)
        tokens, laws, laws_p = tree.tokens[rows, chosen], tree.laws[rows, chosen], p[rows, chosen]  # [B, d], [B, d, V], [B, d + 1, V]
        if d > 1:
            accepted, residual = self.rule(laws_p[:, 1:d], laws[:, 1:], tokens[:, 1:], gen)
            chain = accepted.long().cumprod(-1).sum(-1)  # [B]
        else:
            chain = torch.zeros(B, dtype=torch.long, device=p.device)
        n_acc = torch.where(branch >= 0, 1 + chain, 0)
        # The token after the accepted drafts: the bonus from the target when the whole chain
        # passed, else the chain's residual at its first rejection, or the root's last residual
        # when no child was accepted.
        law = laws_p[:, d]
        if d > 1:
            law = torch.where((n_acc < d)[:, None], residual[rows, chain.clamp_max(d - 2)], law)
        law = torch.where((branch < 0)[:, None], target, law)
        return branch.clamp_min(0), n_acc, sample(law[:, None], gen)[:, 0]


def check_tree(width: int, model, proposer: Proposer, rule, num_codebooks: int) -> None:
    """What a tree decode needs, checked before any work (ValueError, one line)."""
    if not isinstance(model, TreeModel):
        raise ValueError(f"{type(model).__name__} cannot verify a token tree (no forward_tree): decode it without tree=")
    refusal = getattr(model, "tree_refusal", None)  # a model that can verify trees only in some configurations
    if refusal is not None and refusal() is not None:
        raise ValueError(refusal())
    if type(proposer).propose_tree is Proposer.propose_tree:
        raise ValueError(f"{type(proposer).__name__} proposes no trees: tree= runs with draft, heads, skip and lookup")
    if type(rule) is not ExactAcceptance:
        raise ValueError(f"a token tree is verified by the exact rule; {type(rule).__name__} is not it")
    if num_codebooks > 1:
        raise ValueError("token trees draft single tokens, not frames of codebooks")
    check_tree_width(width)


def check_tree_width(tree: int, confidence: float = 0.0) -> None:
    """A decoder's `tree` option: 0 (one chain) or at least 2 branches, and no confidence stop
    beside it (a tree drafts every branch to its depth); ValueError otherwise."""
    if isinstance(tree, bool) or not isinstance(tree, int) or tree < 0 or tree == 1:
        raise ValueError(f"tree must be 0 (no tree) or a number of branches >= 2, got {tree!r}")
    if tree and confidence:
        raise ValueError("a token tree drafts every branch to its depth: leave confidence out with tree=")
