"""Entropy switching between a small and a large model on one token (or frame) sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_int, check_num_tokens, raise_if_masked
from mmgen.decoding.draft import as_token_model
from mmgen.decoding.frames import (
    complete_frame,
    frame_index,
    rows_with_invalid_laws,
    sampler_probs,
    sampling_per_codebook,
    where_slots,
)
from mmgen.decoding.stats import StageCounters, StatsRecorder
from mmgen.decoding.stopping import Stopping, Streamer, TokenReporter, stop_mask
from mmgen.modeling import DecodeState, TokenModel
from mmgen.sampling import SamplingConfig, sample


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
    (lab notes in the git history of docs/benchmarks.md); 2.0 ran the large model at almost every token.

    Frames (codec TTS, `num_codebooks = K > 1`): each step is one frame [B, K], and a frame's
    entropy is the mean over its codebooks of each codebook's entropy (a codebook the model
    forces, one-hot, counts 0 nats). Both models must share the frame layout (codebooks and
    vocabulary). A model with `complete_frame` (CSM: codebook 0 from the backbone, the rest from
    its depth decoder) completes its own frames: the small model draws and completes its frame
    first, since the laws of its later codebooks are part of the entropy, and a row the large
    model takes gets the large model's own frame. Otherwise one draw is made from the chosen
    model's law, as autoregressive decoding draws it (the same seed gives the same tokens).

    Stopping and streaming are the speculative loop's (`mmgen.decoding.stopping`, shared): a row
    ends with its stop token or budget (`Stopping`), nothing after it is committed to either
    model, the output is padded after it and `lengths` holds each row's count; `streamer.put`
    receives each row's new token after every step, `streamer.end()` once at the end.
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
        sampling: Union[SamplingConfig, Sequence[SamplingConfig]],
        generator: torch.Generator,
        progress: Optional[Progress] = None,
        stopping: Optional[Stopping] = None,
        streamer: Optional[Streamer] = None,
    ) -> DecodeOutput:
        check_num_tokens(num_tokens)
        if self.small is None:
            raise ValueError("EntropySwitch needs a small model with the same tokenizer (small=...)")
        small = as_token_model(self.small)
        K, V = _layout(model)
        if _layout(small) != (K, V):
            raise ValueError(f"the small model's frames ({_layout(small)[0]} codebooks x {_layout(small)[1]} tokens) are "
                             f"not the large model's ({K} x {V}): it must decode the same frames")
        sampling = sampling_per_codebook(sampling, K)
        guidance = any(s.uses_guidance for s in sampling)
        large_state = model.start(conditions, self.capacity(num_tokens), guidance)
        small_state = small.start(conditions, self.capacity(num_tokens), guidance)
        B, device = small_state.batch_size, small_state.device
        recorder = StatsRecorder(device, max_accepted=1)
        tokens = torch.zeros(B, num_tokens, *(() if K == 1 else (K,)), dtype=torch.long, device=device)
        limit = (stopping or Stopping()).limits(B, num_tokens, device)
        stop_ids = stopping.stop_ids(device) if stopping is not None else None
        variable = stopping is not None
        report = TokenReporter(num_tokens, limit, progress, streamer)
        synced = variable or streamer is not None  # else every row runs to num_tokens: no sync for progress
        entropies = torch.zeros(B, self.entropy_window, device=device)
        emitted = torch.zeros(B, dtype=torch.long, device=device)
        active = torch.ones(B, dtype=torch.bool, device=device)  # rows still decoding token t
        bad = torch.zeros(B, dtype=torch.bool, device=device)
        zero = torch.zeros(B, dtype=torch.long, device=device)
        completes = getattr(small, "complete_frame", None), getattr(model, "complete_frame", None)
        draw_first = any(c is not None for c in completes)  # the small frame is needed for its entropy
        # Forwards per model, prefills included; `large_fed` counts the tokens the large model has seen.
        large_fed, large_forwards, small_forwards = 0, 1, 1
        large_tokens = torch.zeros((), dtype=torch.long, device=device)
        t = 0
        while True:
            index = zero[:, None] + t  # generated-token index [B, 1]
            step = active.long()  # what each row commits of a forward: nothing once it has ended
            if t > 0:
                logits = small.forward(small_state, tokens[:, t - 1 : t])
                small.commit(small_state, step)
                small_forwards += 1
            else:
                logits = small_state.first_logits
            probs = sampler_probs(sampling, logits, index)
            token, law = None, probs[:, 0]
            if draw_first:
                token, law = _draw(completes[0], small_state, sampling, probs, zero, index, generator)
            entropy = -(law * law.clamp_min(1e-30).log()).sum(-1)
            entropies[:, t % self.entropy_window] = entropy.reshape(B, -1).mean(-1)  # frames: mean over codebooks
            rolling = entropies.sum(1) / min(t + 1, self.entropy_window)
            use_large = (rolling > self.threshold) & active
            if bool(use_large.any()):  # one host sync per token: the large model runs only when needed
                if t > large_fed:
                    large_logits = model.forward(large_state, tokens[:, large_fed:t])[:, -1:]
                    model.commit(large_state, step * (t - large_fed))
                    slot = zero + (t - large_fed - 1)  # the fed position the logits follow
                    large_fed, large_forwards = t, large_forwards + 1
                else:
                    large_logits, slot = large_state.first_logits, zero
                large_probs = sampler_probs(sampling, large_logits, index)
                if token is not None:
                    large_token = _draw(completes[1], large_state, sampling, large_probs, slot, index, generator)[0]
                    token = where_slots(use_large, large_token, token)
                probs = where_slots(use_large, large_probs, probs)
                large_tokens += use_large.sum()
            bad |= rows_with_invalid_laws(probs) & active
            tokens[:, t] = sample(probs, generator)[:, 0] if token is None else token
            recorder.record(step, active)  # one token per decoding row per step
            emitted = emitted + step
            active = active & ~stop_mask(tokens[:, t : t + 1], stop_ids, stopping)[:, 0] & (emitted < limit)
            t += 1
            if report(tokens, emitted, active, synced) >= num_tokens:
                break
        if streamer is not None:
            streamer.end()
        raise_if_masked(bad)
        stats = recorder.finish(int(emitted.max()) if variable else num_tokens, B,
                                large_state.cache_bytes + small_state.cache_bytes)
        stats.forwards = large_forwards + small_forwards
        total = int(emitted.sum())
        stats.extra = StageCounters([large_forwards, small_forwards], [int(large_tokens), total - int(large_tokens)])
        if not variable:
            return DecodeOutput(tokens, stats)
        # Nothing after a row's end is output: pad it, as the speculative loop does.
        past = torch.arange(num_tokens, device=device)[None] >= emitted[:, None]
        return DecodeOutput(tokens.masked_fill(frame_index(past, K), stopping.pad_token), stats, emitted)


def _layout(model: TokenModel) -> tuple[int, int]:
    """(codebooks per frame, vocabulary): what two models must share to decode one sequence."""
    return int(getattr(model, "num_codebooks", 1)), int(model.vocab_size)


def _draw(complete: Optional[Callable], state: DecodeState, sampling: list, probs: torch.Tensor, slot: torch.Tensor,
          index: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A token [B] or frame [B, K] drawn from `probs` [B, 1(, K), V], and the laws it was drawn
    from [B(, K), V]. A model with `complete_frame` (`complete`) draws codebooks 1.. itself from
    its state after fed position `slot` [B], as autoregressive decoding does."""
    token = sample(probs, generator)[:, 0]
    if complete is None:
        return token, probs[:, 0]
    frame, laws = complete_frame(complete, state, sampling, slot, token, torch.ones_like(slot), generator, index)
    return frame, torch.cat([probs[:, 0, :1], laws[:, 1:]], 1)
