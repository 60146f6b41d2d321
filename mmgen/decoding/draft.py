"""Draft-model speculative decoding: a small model of the same tokenizer proposes, the target
verifies (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318); a
round's drafting may stop where the drafter is unsure (dynamic speculation lookahead, Mamou et
al. 2024, arXiv 2405.04304, transformers' `assistant_confidence_threshold`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.base import check_int
from mmgen.decoding.frames import complete_frame, gather_slots
from mmgen.decoding.proposer import Proposer
from mmgen.decoding.speculative import SpeculativeDecoder
from mmgen.decoding.stats import DraftCounters
from mmgen.decoding.tree import TreeLayout, check_tree_width, grow_tree, tree_forward_logits
from mmgen.modeling import TokenModel, TreeModel
from mmgen.sampling import sample


def as_token_model(drafter: Any) -> TokenModel:
    """A `TokenModel` from a token model or from anything with `token_model()` (a pipeline)."""
    if hasattr(drafter, "token_model") and callable(drafter.token_model):
        drafter = drafter.token_model()
    if not isinstance(drafter, TokenModel):
        raise ValueError(f"drafter must be a TokenModel or a pipeline with token_model(), got {type(drafter).__name__}")
    return drafter


def confident(logits: Any, draft: torch.Tensor, threshold: float) -> torch.Tensor:
    """[B] whether each row's drafter gave its newest draft at least `threshold` (the softmax
    of its conditional `Logits` [B, 1(, K), V] at temperature 1; draft [B, 1(, K)]; frames:
    the first codebook's)."""
    logits = logits.cond
    if draft.dim() == 3:
        logits, draft = logits[:, :, 0], draft[:, :, 0]
    chosen = torch.softmax(logits.float(), -1).gather(-1, draft[..., None])[:, 0, 0]
    return chosen >= threshold


def round_stops(drafting: torch.Tensor, active: torch.Tensor) -> bool:
    """Whether a round of drafting stops under a confidence stop: fewer than half of the
    `active` [B] rows are still `drafting` [B] (at batch 1: the first unsure draft). One host
    read."""
    sure, live = torch.stack([drafting.sum(), active.sum()]).tolist()
    return sure == 0 or 2 * sure < live


class ConfidenceStop:
    """A round's confidence stop (dynamic speculation lookahead; SWIFT's confidence-aware
    drafting): a row drops out of the round at its first draft that its drafter gave less than
    `threshold` (`confident`), and the round stops once fewer than half of the `active` rows are
    left (`round_stops`: one host read per draft). Threshold 0: it never stops a round."""

    def __init__(self, threshold: float, active: torch.Tensor, num_draft: int):
        self.threshold, self.active, self.num_draft, self.drafting = threshold, active, num_draft, active

    def stops(self, j: int, logits: Any, draft: torch.Tensor) -> bool:
        """Whether the round ends after its draft `j`, drawn from `logits`."""
        if self.threshold <= 0 or j + 1 >= self.num_draft:
            return False
        self.drafting = self.drafting & confident(logits, draft, self.threshold)
        return round_stops(self.drafting, self.active)


def check_confidence(confidence: Any) -> None:
    """ValueError unless `confidence` (a confidence stop's threshold) is a probability in [0, 1)."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence < 1:
        raise ValueError(f"confidence must be a probability in [0, 1), got {confidence!r}")


class DraftModelProposer(Proposer):
    """A small model of the same tokenizer samples `num_draft` tokens autoregressively from its
    own distribution q (same sampling settings and guidance as the target); after each verify
    its cache is rewound to the kept prefix, per row.

    Each round the drafter re-feeds the last two finalised tokens, so a row whose every draft
    was accepted (the last draft was never fed to the drafter) needs no special case, and
    shapes stay fixed.

    With a `confidence` above 0, a row drops out of a round's drafting at its first draft that
    its drafter gave less than that probability (the softmax of its conditional logits at
    temperature 1, before guidance and truncation; for frames, the first codebook's token): its
    later drafts would likely follow a rejected one. The round stops once fewer than half of the
    active rows are left in it (at batch 1: at the first unsure draft), since each more draft
    costs every row a drafter forward and a wider verify (on the bundled VLM pair at batch 8,
    waiting for every row drafted 7.6 of 12 a round and ran slower than `ar`: lab notes in the git history of docs/benchmarks.md).
    Where to stop depends only on drafts already drawn, so acceptance stays exact (the target
    still judges every draft it is given). The loop then records each forward's draft count
    in the stats (`drafts_per_forward`).
    """

    def __init__(self, drafter: TokenModel, num_draft: int, confidence: float = 0.0):
        self.drafter, self.num_draft, self.confidence = drafter, num_draft, confidence
        self.forwards, self.first_round = 1, True  # the drafter's prefill
        self.drafted = self.accepted = 0  # device tensors once a verify ran: no host sync per forward

    def start(self, run):
        guidance = run.sampling.uses_guidance
        self.state = self.drafter.start(run.conditions, run.capacity, guidance)

    def propose(self, run):
        # The drafter holds tokens < pos - 1 (all < pos in the first round).
        back = torch.arange(1 if self.first_round else 2, device=run.device) - (0 if self.first_round else 1)
        # Clamped: a row that ended on its very first token stays at pos 0 (idle, fed anyway).
        feed = gather_slots(run.tokens, (run.pos[:, None] + back).clamp_min(0))
        drafts, q = [], []
        complete = getattr(self.drafter, "complete_frame", None)
        stop = ConfidenceStop(self.confidence, run.active, self.num_draft)
        for j in range(self.num_draft):
            at = run.pos[:, None] + 1 + j
            logits = self.drafter.forward(self.state, feed)[:, -1:]
            q_j = run.probs(logits, at)
            slot = torch.full_like(run.pos, feed.shape[1])
            self.drafter.commit(self.state, slot)
            # One-hot laws (greedy): the argmax is the sample, and no noise need be drawn.
            feed = q_j.argmax(-1) if run.greedy else sample(q_j, run.generator)
            if complete is not None:  # codebooks drawn one after another by the drafter itself
                frame, laws = complete_frame(complete, self.state, run.per_codebook, slot - 1, feed[:, 0],
                                             torch.ones_like(slot), run.generator, at)
                feed, q_j = frame[:, None], torch.cat([q_j[:, :, :1], laws[:, None, 1:]], 2)
            drafts.append(feed)
            q.append(q_j)
            if stop.stops(j, logits, feed):
                break
        self.forwards += len(drafts)
        return torch.cat(drafts, 1), torch.cat(q, 1)

    def propose_tree(self, run, width):
        """A token tree from the drafter (`tree.grow_tree`): its law after the newest token gives
        the distinct first tokens; each later depth is one tree forward of the drafter over the
        branches so far (left pending; the last one's chosen branch is kept, `tree_kept`)."""
        back = torch.arange(1 if self.first_round else 2, device=run.device) - (0 if self.first_round else 1)
        feed = gather_slots(run.tokens, (run.pos[:, None] + back).clamp_min(0))
        root = self.drafter.forward(self.state, feed)[:, -1:]
        # Every depth's tree is rooted at the newest token, fed again: commit only what precedes it.
        fed = feed.shape[1] - (1 if run.num_draft > 1 else 0)
        self.drafter.commit(self.state, torch.full_like(run.pos, fed))
        self.newest_committed, self.tree_width = fed == feed.shape[1], width
        tree = grow_tree(run, width, root, lambda tokens: tree_forward_logits(self.drafter, self.state, run, tokens))
        self.forwards += run.num_draft
        return tree

    def tree_kept(self, run, branch, n_acc):
        """The drafter keeps the newest token and the chosen branch's drafts it was fed (all but
        the last), so `update` may rewind it to the finalised prefix as after a chain."""
        if self.newest_committed:
            return
        d = run.num_draft
        self.drafter.keep_path(self.state, TreeLayout(self.tree_width, d - 1, run.device).paths[branch])
        self.drafter.commit(self.state, n_acc.clamp_max(d - 1) + 1)

    def update(self, run, n_acc, next_token, fresh, p, active):
        self.drafter.rewind(self.state, (run.pos - 1).clamp_min(0))
        self.first_round = False
        self.drafted = self.drafted + active.sum() * run.num_draft  # the drafts this forward verified
        self.accepted = self.accepted + (n_acc * active).sum()

    def finish(self, stats):
        stats.extra = DraftCounters(draft_forwards=self.forwards, drafted=int(self.drafted),
                                    accepted_drafts=int(self.accepted))

    @property
    def cache_bytes(self):
        return self.state.cache_bytes


@dataclass
class DraftSpeculative(SpeculativeDecoder):
    """Draft-model speculative decoding (`DraftModelProposer`), lossless with `ExactAcceptance`."""

    drafter: Any = None
    num_draft: int = 4
    acceptance: Any = field(default_factory=ExactAcceptance)
    #: A row drops out of a round's drafting at a draft its drafter gave less than this
    #: probability, and the round stops when fewer than half the rows are left in it; 0: always
    #: `num_draft` drafts (`DraftModelProposer`).
    confidence: float = 0.0
    #: Verify a token tree of this many branches each forward (`mmgen.decoding.tree`; the
    #: drafter drafts it with tree forwards of its own); 0: one chain.
    tree: int = 0

    def __post_init__(self):
        check_int("num_draft", self.num_draft, 1)
        check_confidence(self.confidence)
        check_tree_width(self.tree, self.confidence)

    @property
    def window(self) -> int:
        return self.num_draft + 1

    def roles(self, model, num_tokens, generator):
        if self.drafter is None:
            raise ValueError("DraftSpeculative needs a drafter: a smaller model with the same tokenizer")
        drafter = as_token_model(self.drafter)
        if drafter.vocab_size != model.vocab_size:
            raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {model.vocab_size}")
        if self.tree and not isinstance(drafter, TreeModel):
            raise ValueError(f"the drafter ({type(drafter).__name__}) cannot draft a token tree (no forward_tree)")
        # More drafts than tokens have nothing to draft.
        return DraftModelProposer(drafter, min(self.num_draft, num_tokens), float(self.confidence)), self.acceptance.bind(model)
