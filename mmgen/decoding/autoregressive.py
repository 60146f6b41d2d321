"""Plain autoregressive decoding: one token per row per forward; the baseline of every method."""

from __future__ import annotations

from dataclasses import dataclass

from mmgen.decoding.proposer import Proposer
from mmgen.decoding.speculative import SpeculativeDecoder


@dataclass
class Autoregressive(SpeculativeDecoder):
    """Sample token t from p(. | tokens < t), feed it, repeat (gpt-fast's `decode_n_tokens`):
    the speculative loop with a proposer that drafts nothing."""

    def roles(self, model, num_tokens, generator):
        return Proposer(), None
