"""Plain autoregressive decoding: one token per row per forward; the baseline of every method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mmgen.decoding.base import DecodeOutput, Decoder, Progress
from mmgen.decoding.speculative import Proposer, Stopping, Streamer, speculative_decode
from mmgen.modeling import TokenModel
from mmgen.sampling import SamplingConfig


@dataclass
class Autoregressive(Decoder):
    """Sample token t from p(. | tokens < t), feed it, repeat (gpt-fast's `decode_n_tokens`):
    the speculative loop with a proposer that drafts nothing."""

    def generate(
        self,
        model: TokenModel,
        conditions: Any,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        progress: Optional[Progress] = None,
        stopping: Optional[Stopping] = None,
        streamer: Optional[Streamer] = None,
    ) -> DecodeOutput:
        return speculative_decode(model, conditions, num_tokens, sampling, generator, Proposer(), None,
                                  self.capacity(num_tokens) if num_tokens >= 1 else None, progress, stopping, streamer)
