"""Draft heads: speculation without a second model.

A small head on the target's own final hidden state drafts the next tokens (Medusa, Cai et al.
2024, arXiv 2401.10774); each draft sees the tokens drafted before it, so the drafts form one
coherent continuation rather than k independent guesses (Hydra's sequentially dependent heads,
Ankner et al. 2024, arXiv 2402.05109). Here the k heads are one recurrent block applied k times
(as EAGLE's draft layer, without attention), so any draft count runs with one set of weights:

    s_0 = h                  the target's final hidden state that predicted the newest token x_0
    s_j = s_{j-1} + down(silu(up([norm(s_{j-1}); norm(embed(x_{j-1}))])))
    draft x_j ~ the target's own output head (and logits processing, guidance) on s_j

The target's output head and embeddings are reused, so a head is one MLP (~0.4 M parameters
for a 256-wide model). Frames (codec TTS, K codebooks per position) embed as the target embeds
them and take every codebook from its head at once (VADUSA's idea, under exact acceptance).
Acceptance is the core's: with `ExactAcceptance` the output is exactly the target's, whatever
the heads predict; they only decide how many drafts survive.

Heads are a companion folder of a model (`<model>/draft_heads/`: `config.json` and
`model.safetensors`); `training/train_heads.py` trains them on the frozen target.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn import functional as F

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.base import check_int
from mmgen.decoding.draft import ConfidenceStop, check_confidence
from mmgen.decoding.proposer import DecodeRun, Proposer
from mmgen.decoding.speculative import SpeculativeDecoder
from mmgen.decoding.stats import DraftCounters
from mmgen.decoding.tree import TreeDrafts, check_tree_width, grow_tree
from mmgen.modeling import HiddenStateModel
from mmgen.sampling import sample

#: The companion folder of a model folder that holds its heads.
HEADS_FOLDER = "draft_heads"


@dataclass
class DraftHeadsConfig:
    """`hidden_size`: the target's (its final hidden state and embeddings); `intermediate_size`:
    the block's MLP width (0: twice the hidden size); `num_drafts`: the drafts per forward the
    heads were trained for, the decoder's default."""

    hidden_size: int
    intermediate_size: int = 0
    num_drafts: int = 3

    def __post_init__(self):
        check_int("hidden_size", self.hidden_size, 1)
        check_int("intermediate_size", self.intermediate_size, 0)
        check_int("num_drafts", self.num_drafts, 1)
        if self.intermediate_size == 0:
            self.intermediate_size = 2 * self.hidden_size


class DraftHeads(nn.Module):
    """The recurrent draft block (module docstring). Its last projection starts at zero, so an
    untrained head drafts with the target's own law at the newest position."""

    def __init__(self, config: DraftHeadsConfig):
        super().__init__()
        D, I = config.hidden_size, config.intermediate_size
        self.config = config
        self.hidden_norm = nn.RMSNorm(D, eps=1e-6)
        self.token_norm = nn.RMSNorm(D, eps=1e-6)
        self.up = nn.Linear(2 * D, I)
        self.down = nn.Linear(I, D)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """The next draft state [R, n, D] from the state `hidden` [R, n, D] that predicted a
        token, and that token's embedding [R, n, D]."""
        x = torch.cat([self.hidden_norm(hidden), self.token_norm(embedding.to(hidden.dtype))], -1)
        return hidden + self.down(F.silu(self.up(x)))

    def save_pretrained(self, folder: Union[str, os.PathLike]) -> None:
        """`folder/config.json` and `folder/model.safetensors`, each written atomically."""
        from mmgen.files import write_atomic
        from mmgen.hub import save_safetensors
        import json

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "config.json", (json.dumps(asdict(self.config), indent=2, sort_keys=True) + "\n").encode())
        save_safetensors({k: v.detach().contiguous() for k, v in self.state_dict().items()}, folder / "model.safetensors")

    @classmethod
    def from_pretrained(cls, folder: Union[str, os.PathLike], device: Any = "cpu",
                        dtype: torch.dtype = torch.float32) -> "DraftHeads":
        """Heads saved by `save_pretrained` (weights loaded strictly; a bad folder is one
        `CheckpointError` line)."""
        from mmgen.hub import CheckpointError, load_state_dict, load_strict, read_json

        folder = Path(folder)
        config = read_json(folder / "config.json")
        known = {"hidden_size", "intermediate_size", "num_drafts"}
        if not isinstance(config, dict) or set(config) - known or "hidden_size" not in config:
            raise CheckpointError(f"{folder / 'config.json'}: not a draft heads config (keys {sorted(known)})")
        try:
            heads = cls(DraftHeadsConfig(**config))
        except ValueError as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
        load_strict(heads, load_state_dict(folder / "model.safetensors"), str(folder))
        return heads.to(device=device, dtype=dtype).eval()


def load_heads(heads: Any, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> DraftHeads:
    """`DraftHeads` from themselves or a folder."""
    if isinstance(heads, DraftHeads):
        return heads
    if isinstance(heads, (str, os.PathLike)):
        return DraftHeads.from_pretrained(heads, device, dtype)
    raise ValueError(f"heads must be DraftHeads or a folder of them, got {type(heads).__name__}")


class HeadsProposer(Proposer):
    """Drafts from `DraftHeads` on the target's final hidden state (`HiddenStateModel`): after
    each verify, the state that predicted each row's newest token (index `n_acc` of the
    forward's hidden states); each draft's law is the target's logits of the head's state,
    through the sampler's settings, and the draft is drawn from it with the decode's generator."""

    def __init__(self, heads: DraftHeads, num_draft: int, confidence: float = 0.0):
        self.heads, self.num_draft, self.confidence = heads, num_draft, confidence
        self.steps = 0
        self.drafted = self.accepted = 0  # device tensors once a verify ran: no host sync per forward

    def start(self, run: DecodeRun) -> None:
        hidden = run.state.hidden
        if hidden is None:
            raise ValueError(f"{type(run.model).__name__} keeps no hidden states here (a compiled model?): "
                             "draft heads need an eager decode")
        self.halves = hidden.shape[0] // run.batch_size  # 2: guidance runs each row's unconditional twin
        self.hidden = hidden[:, -1]
        if self.heads.up.weight.device != hidden.device:  # heads loaded from a folder land on the CPU
            self.heads.to(hidden.device)

    def propose(self, run: DecodeRun):
        model, state = run.model, run.state
        fed = run.newest()
        s = self.hidden[:, None].to(self.dtype)
        drafts, laws = [], []
        stop = ConfidenceStop(self.confidence, run.active, run.num_draft)
        for j in range(run.num_draft):
            s = self.heads(s, self._embed(model, fed[:, -1:]))
            logits = model.hidden_logits(state, s.to(self.out_dtype), fed)
            q = run.probs(logits, run.pos[:, None] + 1 + j)
            draft = q.argmax(-1) if run.greedy else sample(q, run.generator)
            drafts.append(draft)
            laws.append(q)
            fed = torch.cat([fed, draft], 1)
            if stop.stops(j, logits, draft):
                break
        self.steps += len(drafts)
        return torch.cat(drafts, 1), torch.cat(laws, 1)

    def propose_tree(self, run: DecodeRun, width: int) -> TreeDrafts:
        """`width` branches (`tree.grow_tree`): the first head step's law gives the distinct
        first tokens, then the heads run on every branch at once (branches along the sequence
        axis), each from the state its first token was drawn from."""
        model, state = run.model, run.state
        fed = run.newest()
        s = self.heads(self.hidden[:, None].to(self.dtype), self._embed(model, fed))
        states = [s.expand(-1, width, -1)]

        def branch_logits(tokens: torch.Tensor):
            states[0] = self.heads(states[0], self._embed(model, tokens[:, :, -1]))
            return model.hidden_logits(state, states[0].to(self.out_dtype), tokens[:, :, -1])

        tree = grow_tree(run, width, model.hidden_logits(state, s.to(self.out_dtype), fed), branch_logits)
        self.steps += run.num_draft
        return tree

    def _embed(self, model, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding of `tokens` [B, n] for every row it runs (guidance: twice)."""
        embedding = model.embed_tokens(tokens)
        return embedding.repeat(self.halves, *([1] * (embedding.dim() - 1)))

    def update(self, run, n_acc, next_token, fresh, p, active):
        hidden = run.state.hidden  # [R, k + 1, D]: index n_acc predicted the token just finalised
        at = n_acc.repeat(self.halves)
        self.hidden = hidden[torch.arange(hidden.shape[0], device=at.device), at]
        self.drafted = self.drafted + active.sum() * run.num_draft  # the drafts this forward verified
        self.accepted = self.accepted + (n_acc * active).sum()

    def restart(self, run, rows):
        B = run.batch_size
        twins = torch.cat([rows + half * B for half in range(self.halves)])
        self.hidden[twins] = run.state.hidden[twins, 0].to(self.hidden.dtype)

    def select_rows(self, run, index):
        B = self.hidden.shape[0] // self.halves
        self.hidden = self.hidden[torch.cat([index + half * B for half in range(self.halves)])]

    def finish(self, stats):
        stats.extra = DraftCounters(draft_forwards=self.steps, drafted=int(self.drafted), accepted_drafts=int(self.accepted))

    @property
    def dtype(self) -> torch.dtype:
        return self.heads.up.weight.dtype

    @property
    def out_dtype(self) -> torch.dtype:
        return self.hidden.dtype


@dataclass
class HeadsSpeculative(SpeculativeDecoder):
    """Speculation with draft heads (`HeadsProposer`), lossless with `ExactAcceptance`.

    `heads`: `DraftHeads` or their folder; None takes the pipeline's own (its model folder's
    `draft_heads/`). `num_draft`: drafts per forward (None: what the heads were trained for).
    `confidence`: a row drops out of a round's drafting at a draft the heads gave less than this
    probability, and the round stops when fewer than half the rows are left in it (as
    `DraftSpeculative`'s); 0: always `num_draft` drafts. `tree`: verify a token tree of that
    many branches each forward (`mmgen.decoding.tree`, exact; 0: one chain).
    """

    heads: Any = None
    num_draft: Optional[int] = None
    acceptance: Any = field(default_factory=ExactAcceptance)
    confidence: float = 0.0
    tree: int = 0

    def __post_init__(self):
        if self.num_draft is not None:
            check_int("num_draft", self.num_draft, 1)
        check_confidence(self.confidence)
        check_tree_width(self.tree, self.confidence)

    @property
    def window(self) -> int:
        return self.drafts + 1

    @property
    def drafts(self) -> int:
        if self.num_draft is not None:
            return self.num_draft
        return self.heads.config.num_drafts if isinstance(self.heads, DraftHeads) else 3

    def roles(self, model, num_tokens, generator):
        if self.heads is None:
            raise ValueError("decoding 'heads' needs draft heads: heads=FOLDER, or a model whose folder has draft_heads/ "
                             "(train them with training/train_heads.py)")
        if not isinstance(model, HiddenStateModel):
            raise ValueError(f"{type(model).__name__} does not show its hidden states: draft heads cannot run on it")
        if getattr(model, "compiled", False):
            raise ValueError("a compiled model keeps no hidden states (its graphs' outputs are reused): "
                             "decode with draft heads uncompiled")
        if callable(getattr(model, "complete_frame", None)):
            raise ValueError(f"{type(model).__name__} samples a frame's later codebooks itself: draft heads draft whole "
                             "frames of independent codebooks only")
        heads = load_heads(self.heads)
        if heads.config.hidden_size != model.hidden_size:
            raise ValueError(f"draft heads of hidden size {heads.config.hidden_size} do not fit a model of hidden size "
                             f"{model.hidden_size}")
        return HeadsProposer(heads, min(self.drafts, num_tokens), float(self.confidence)), self.acceptance.bind(model)
