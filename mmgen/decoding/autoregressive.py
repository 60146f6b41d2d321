"""Plain autoregressive decoding: one token per row per forward; the baseline of every method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_num_tokens, raise_if_masked
from mmgen.decoding.stats import StatsRecorder
from mmgen.modeling import TokenModel
from mmgen.sampling import SamplingConfig, invalid_rows, sample


@dataclass
class Autoregressive(Decoder):
    """Sample token t from p(. | tokens < t), feed it, repeat (gpt-fast's `decode_n_tokens`)."""

    def generate(
        self,
        model: TokenModel,
        conditions: Any,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        progress: Optional[Progress] = None,
    ) -> DecodeOutput:
        check_num_tokens(num_tokens)
        state = model.start(conditions, self.capacity(num_tokens), sampling.uses_guidance)
        batch, device = state.batch_size, state.device
        recorder = StatsRecorder(device, max_accepted=1)
        tokens = torch.empty(batch, num_tokens, dtype=torch.long, device=device)
        ones = torch.ones(batch, dtype=torch.long, device=device)
        active = torch.ones(batch, dtype=torch.bool, device=device)
        index = torch.zeros(batch, 1, dtype=torch.long, device=device)

        logits = state.first_logits
        bad = torch.zeros(batch, dtype=torch.bool, device=device)
        for t in range(num_tokens):
            if t > 0:
                logits = model.forward(state, tokens[:, t - 1 : t])
                model.commit(state, ones)
            probs = sampling.probs(logits, index + t)
            bad |= invalid_rows(probs).any(-1)
            tokens[:, t] = sample(probs, generator)[:, 0]
            recorder.record(ones, active)
            if progress is not None:
                progress.update(1)
        raise_if_masked(bad)
        return DecodeOutput(tokens, recorder.finish(num_tokens, batch, state.cache_bytes))
