"""Entropy switching between a small and a large model on one token sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_int, check_num_tokens, raise_if_masked
from mmgen.decoding.draft import as_token_model
from mmgen.decoding.stats import StageCounters, StatsRecorder
from mmgen.modeling import TokenModel
from mmgen.sampling import SamplingConfig, invalid_rows, sample


@dataclass
class EntropySwitch(Decoder):
    """A small model decodes while it is sure of itself; the large (pipeline's) model takes
    the tokens where it is not: the raster-sequence form of collaborative large/small decoding
    (the fallback policy of Big Little Decoder, Kim et al., NeurIPS 2023, arXiv 2302.07863,
    with the small model's predictive entropy as the signal).

    Every step the small model predicts token t; where the mean of its entropies (nats, after
    guidance and filtering) over the last `entropy_window` tokens exceeds `threshold`, the row
    samples token t from the large model instead. The large model runs only at such steps and
    first catches up on every token since it last ran, in one forward. `threshold=inf` is the
    small model alone; `threshold=0` is (almost always) the large one. The default, 3.5 nats,
    is where the bundled emoji pair gains (2.3x fewer large-model calls at batch 1, about even at
    batch 8, where the large model runs whenever any row needs it) for a measured quality cost
    (docs/benchmarks.md); 2.0 ran the large model at almost every token.
    """

    small: Any = None
    threshold: float = 3.5
    entropy_window: int = 4

    def __post_init__(self):
        check_int("entropy_window", self.entropy_window, 1)
        if not isinstance(self.threshold, (int, float)) or self.threshold != self.threshold or self.threshold < 0:
            raise ValueError(f"threshold must be a number of nats >= 0, got {self.threshold!r}")

    def generate(
        self,
        model: TokenModel,
        conditions: Any,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        progress: Optional[Progress] = None,
        stopping: Optional[Any] = None,
        streamer: Optional[Any] = None,
    ) -> DecodeOutput:
        check_num_tokens(num_tokens)
        if stopping is not None or streamer is not None:
            raise ValueError("EntropySwitch decodes a fixed number of tokens: it takes no stopping or streamer yet")
        if self.small is None:
            raise ValueError("EntropySwitch needs a small model with the same tokenizer (small=...)")
        small = as_token_model(self.small)
        if small.vocab_size != model.vocab_size:
            raise ValueError(f"small model vocabulary {small.vocab_size} != large model vocabulary {model.vocab_size}")
        large_state = model.start(conditions, self.capacity(num_tokens), sampling.uses_guidance)
        small_state = small.start(conditions, self.capacity(num_tokens), sampling.uses_guidance)
        B, device = small_state.batch_size, small_state.device
        recorder = StatsRecorder(device, max_accepted=1)
        tokens = torch.empty(B, num_tokens, dtype=torch.long, device=device)
        entropies = torch.zeros(B, self.entropy_window, device=device)
        ones = torch.ones(B, dtype=torch.long, device=device)
        index = torch.zeros(B, 1, dtype=torch.long, device=device)
        bad = torch.zeros(B, dtype=torch.bool, device=device)
        # Forwards per model, prefills included; `large_fed` counts the tokens the large model has seen.
        large_fed, large_forwards, small_forwards = 0, 1, 1
        large_tokens = torch.zeros((), dtype=torch.long, device=device)
        for t in range(num_tokens):
            if t > 0:
                logits = small.forward(small_state, tokens[:, t - 1 : t])
                small.commit(small_state, ones)
                small_forwards += 1
            else:
                logits = small_state.first_logits
            probs = sampling.probs(logits, index + t)
            entropies[:, t % self.entropy_window] = -(probs * probs.clamp_min(1e-30).log()).sum(-1)[:, 0]
            rolling = entropies.sum(1) / min(t + 1, self.entropy_window)
            use_large = rolling > self.threshold
            if bool(use_large.any()):  # one host sync per token: the large model runs only when needed
                if t > large_fed:
                    large_logits = model.forward(large_state, tokens[:, large_fed:t])[:, -1:]
                    model.commit(large_state, ones * (t - large_fed))
                    large_fed, large_forwards = t, large_forwards + 1
                else:
                    large_logits = large_state.first_logits
                probs = torch.where(use_large[:, None, None], sampling.probs(large_logits, index + t), probs)
                large_tokens += use_large.sum()
            bad |= invalid_rows(probs).any(-1)
            tokens[:, t] = sample(probs, generator)[:, 0]
            recorder.record(ones, ones.bool())  # one token per row per step
            if progress is not None:
                progress.update(1)
        raise_if_masked(bad)
        stats = recorder.finish(num_tokens, B, large_state.cache_bytes + small_state.cache_bytes)
        stats.forwards = large_forwards + small_forwards
        stats.extra = StageCounters([large_forwards, small_forwards], [int(large_tokens), B * num_tokens - int(large_tokens)])
        return DecodeOutput(tokens, stats)
