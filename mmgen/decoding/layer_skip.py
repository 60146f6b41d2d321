"""Layer-skip self-drafting (SWIFT, Xia et al. 2024, arXiv 2410.06916; Draft & Verify, Zhang et
al. 2023, arXiv 2309.08168): the target with some of its decoder blocks skipped drafts for
itself, in its own cache, and the next full forward verifies. No second model, no training.

A skipped block passes its input hidden states on unchanged (a hook, `mmgen.hooks`). Drafting
writes the draft slots of every block that ran; those entries are not the full model's (their
input came through skipped blocks), so after drafting the state is rewound to the finalised
prefix and the loop's verify forward rewrites every block at those slots.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.base import check_int
from mmgen.decoding.draft import ConfidenceStop, check_confidence
from mmgen.decoding.frames import complete_frame
from mmgen.decoding.proposer import Proposer
from mmgen.decoding.speculative import SpeculativeDecoder
from mmgen.decoding.stats import DraftCounters
from mmgen.decoding.tree import check_tree_width, grow_tree, tree_forward_logits
from mmgen.modeling import TokenModel
from mmgen.sampling import sample


@functools.cache
def skip_block() -> type:
    """The hook of a skipped decoder block: its hidden states (the first argument) pass through
    unchanged. Built on first use: `mmgen.hooks` rests on diffusers, which `import mmgen.decoding`
    (and so the CLI's start-up) must not load."""
    from mmgen.hooks import ModelHook

    class SkipBlock(ModelHook):
        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            return args[0] if args else kwargs["hidden_states"]

    return SkipBlock


def decoder_blocks(model: TokenModel) -> torch.nn.ModuleList:
    """The decoder blocks a model lets layer-skip drafting skip (its `decoder_layers()`)."""
    blocks = getattr(model, "decoder_layers", None)
    if not callable(blocks):
        raise ValueError(f"{type(model).__name__} does not expose its decoder blocks (`decoder_layers()`), "
                         "which layer-skip drafting needs")
    return blocks()


def default_skipped(num_layers: int) -> list[int]:
    """Every other middle block (1, 3, 5, ...), the first and the last kept: about half the
    blocks, SWIFT's skip ratio; a model of two blocks or fewer skips none."""
    return list(range(1, num_layers - 1, 2))


class LayerSkipProposer(Proposer):
    """`num_draft` drafts a forward from the target itself with blocks `skipped` bypassed, one
    token (or frame) at a time, each drawn from its law with the run's generator (greedy: the
    argmax) and committed into the shared state so the next draft attends to it; then the state
    is rewound to the finalised prefix (`run.pos` generated tokens: the newest token is fed
    again by the verify forward). Frames are completed by a `complete_frame` model itself, as
    draft-model speculation does.

    With a `confidence` above 0, a round stops early as draft-model speculation's does (a row
    drops out at its first draft the skipping model gave less than that probability; the round
    stops once fewer than half the active rows are left: `draft.round_stops`), SWIFT's
    confidence-aware drafting. It depends only on drafts drawn, so acceptance stays exact.

    The drafts live in the run's state, so the proposer keeps nothing per row: continuous
    batching restarts and narrows the batch without it."""

    def __init__(self, blocks: Sequence[torch.nn.Module], skipped: Sequence[int], num_draft: int, confidence: float = 0.0):
        self.skipped, self.num_draft, self.confidence = list(skipped), num_draft, confidence
        self.hooks = {blocks[i]: skip_block()() for i in self.skipped}
        self.forwards = 0
        self.drafted = self.accepted = 0  # device tensors once a verify ran: no host sync per forward

    def propose(self, run):
        model, state = run.model, run.state
        complete = getattr(model, "complete_frame", None)
        # A forward that skipped blocks wrote no K/V there; a growable store levels them (zeros,
        # never read: rewound below) so its crops and compaction see one length for every layer.
        level = getattr(state.cache, "fill_layers", None)
        one = torch.ones_like(run.pos)
        feed, drafts, q = run.newest(), [], []
        stop = ConfidenceStop(self.confidence, run.active, self.num_draft)
        from mmgen.hooks import hooks_attached

        with hooks_attached(self.hooks, "mmgen_layer_skip"):
            for j in range(self.num_draft):
                at = run.pos[:, None] + 1 + j
                logits = model.forward(state, feed)
                if level is not None and self.skipped:
                    level(self.skipped)
                q_j = run.probs(logits, at)
                model.commit(state, one)
                # One-hot laws (greedy): the argmax is the sample, and no noise need be drawn.
                feed = q_j.argmax(-1) if run.greedy else sample(q_j, run.generator)
                if complete is not None:  # codebooks drawn one after another by the model itself
                    frame, laws = complete_frame(complete, state, run.per_codebook, one - 1, feed[:, 0], one, run.generator, at)
                    feed, q_j = frame[:, None], torch.cat([q_j[:, :, :1], laws[:, None, 1:]], 2)
                drafts.append(feed)
                q.append(q_j)
                if stop.stops(j, logits, feed):
                    break
        model.rewind(state, run.pos)
        self.forwards += len(drafts)
        return torch.cat(drafts, 1), torch.cat(q, 1)

    def propose_tree(self, run, width):
        """A token tree from the target with blocks skipped (`tree.grow_tree`): its law after the
        newest token gives the distinct first tokens, each later depth is one tree forward over
        the branches so far; nothing is committed (the verify's tree forward replaces them)."""
        from mmgen.hooks import hooks_attached

        model, state = run.model, run.state
        level = getattr(state.cache, "fill_layers", None)

        def leveled(logits):
            if level is not None and self.skipped:
                level(self.skipped)
            return logits

        with hooks_attached(self.hooks, "mmgen_layer_skip"):
            root = leveled(model.forward(state, run.newest()))
            tree = grow_tree(run, width, root, lambda tokens: leveled(tree_forward_logits(model, state, run, tokens)))
        model.rewind(state, run.pos)
        self.forwards += run.num_draft
        return tree

    def update(self, run, n_acc, next_token, fresh, p, active):
        self.drafted = self.drafted + active.sum() * run.num_draft  # the drafts this forward verified
        self.accepted = self.accepted + (n_acc * active).sum()

    def restart(self, run, rows):
        """Nothing per row: a restarted row's drafts come from its own state and generator."""

    def select_rows(self, run, index):
        """Nothing per row to keep (`restart`)."""

    def finish(self, stats):
        stats.extra = DraftCounters(draft_forwards=self.forwards, drafted=int(self.drafted),
                                    accepted_drafts=int(self.accepted))


@dataclass
class LayerSkipSpeculative(SpeculativeDecoder):
    """Layer-skip self-drafting (`LayerSkipProposer`), lossless with `ExactAcceptance`.

    `layers`: the decoder blocks to skip while drafting, by index (0 is the first block): a
    list, one index, or a spec's "1+3+5"; None skips every other middle block (`default_skipped`).
    """

    num_draft: int = 3
    layers: Any = None
    acceptance: Any = field(default_factory=ExactAcceptance)
    #: A row drops out of a round's drafting at a draft given less than this probability, and
    #: the round stops when fewer than half the rows are left; 0: always `num_draft` drafts.
    confidence: float = 0.0
    #: Verify a token tree of this many branches each forward (`mmgen.decoding.tree`); 0: one chain.
    tree: int = 0

    def __post_init__(self):
        check_int("num_draft", self.num_draft, 1)
        check_confidence(self.confidence)
        check_tree_width(self.tree, self.confidence)
        self.layers = skip_list(self.layers)

    @property
    def window(self) -> int:
        return self.num_draft + 1

    def roles(self, model, num_tokens, generator):
        blocks = decoder_blocks(model)
        skipped = default_skipped(len(blocks)) if self.layers is None else self.layers
        outside = [i for i in skipped if i >= len(blocks)]
        if outside:
            raise ValueError(f"layers {outside} are out of range: {type(model).__name__} has {len(blocks)} decoder blocks (0..{len(blocks) - 1})")
        # More drafts than tokens have nothing to draft.
        proposer = LayerSkipProposer(blocks, skipped, min(self.num_draft, num_tokens), float(self.confidence))
        return proposer, self.acceptance.bind(model)


def skip_list(layers: Any) -> Optional[tuple[int, ...]]:
    """`layers` as sorted distinct block indices (None stays None): from a list or tuple of ints,
    one int, or a decoding spec's "1+3+5". ValueError, in one line, for anything else."""
    if layers is None:
        return None
    if isinstance(layers, str):
        items = [int(s) if s.strip().isdigit() else s for s in layers.split("+")]
    else:
        items = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
    if not isinstance(items, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in items):
        raise ValueError(f"layers must be decoder block indices >= 0 (a list, or '1+3' in a spec), got {layers!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"layers names a block twice: {layers!r}")
    return tuple(sorted(items))
