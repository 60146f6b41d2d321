"""Static-token dropping across denoising steps: compute only the tokens that changed.

Between two denoising steps of one block, most of a video's tokens (the background, anything
that does not move) barely change. A `StaticTokenHook` on each `WanTransformerBlock` compares
the block's input with its input at the previous step of the same block: tokens whose relative
change is below `threshold` keep the previous step's residual (output − input), and the block
runs on the others only, as queries and in its feed-forward; they attend to every token's
keys, the static ones' left in the cache's scratch slots by the previous step (the ToCa /
token-wise feature caching idea, applied per block). The first step of a block and the clean
pass that writes the cache compute every token. A token is dropped only if it is static in
every batch row, so shapes stay shared; threshold 0 drops nothing, which gives the video of no
dropping (tested).

The hooks sit on diffusers' hook registry through `mmgen.hooks` and come off with the decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from mmgen.hooks import ModelHook

HOOK_NAME = "mmgen-static-tokens"


@dataclass
class DroppingState:
    """Shared by a decode's hooks: whether this forward may drop (not a block's first step, not
    the clean pass), the active token indices the attention processors read, and counts."""

    threshold: float
    enabled: bool = False  # may this forward drop tokens
    record: bool = True  # keep this forward's inputs and residuals for the next step
    active: Optional[torch.Tensor] = None
    computed: int = 0  # token-layers computed
    total: int = 0  # token-layers in all

    @property
    def computed_fraction(self) -> float:
        return self.computed / self.total if self.total else 1.0


@dataclass
class StaticTokenHook(ModelHook):
    state: DroppingState
    previous: Optional[tuple[torch.Tensor, torch.Tensor]] = field(default=None)

    def __post_init__(self):
        super().__init__()

    def new_forward(self, module, hidden_states, encoder_hidden_states, temb, rotary_emb):
        state = self.state
        tokens = hidden_states.shape[1]
        state.total += tokens
        if not state.enabled or self.previous is None or self.previous[0].shape != hidden_states.shape:
            out = self.fn_ref.original_forward(hidden_states, encoder_hidden_states, temb, rotary_emb)
            state.computed += tokens
            self.previous = (hidden_states, out - hidden_states) if state.record else None
            return out
        before, residual = self.previous
        change = (hidden_states - before).float().norm(dim=-1) / before.float().norm(dim=-1).clamp_min(1e-12)
        dynamic = (change >= state.threshold).any(0).nonzero().flatten()
        out = hidden_states + residual
        if dynamic.numel():
            state.active = dynamic
            try:
                out[:, dynamic] = self.fn_ref.original_forward(hidden_states[:, dynamic], encoder_hidden_states, temb, rotary_emb)
            finally:
                state.active = None
        state.computed += dynamic.numel()
        self.previous = (hidden_states, out - hidden_states)
        return out

