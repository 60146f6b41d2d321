"""Coupled Jacobi decoding: lossless sampling whose drafts converge like greedy Jacobi.

Sampling token t as argmax(p_t / E_t), with E_t ~ Exp(1) drawn once per (row, position) and
kept for the whole decode, is an exact draw from p_t (the exponential race, equivalent to
Gumbel-max). With the noise fixed, the sample is a deterministic function of the prefix, so
the decode becomes a fixed-point problem exactly like greedy Jacobi decoding: a draft is
final when it equals argmax(p_t / E_t) under a verified prefix, and drafts of successive
iterations are maximally coupled (they change only where the prefix change moves the argmax).
This is the coupling idea behind MC-SJD / SJD-PAC ("speculative Jacobi with
probabilistic-acceptance coupling"), taken to its deterministic limit: no acceptance test is
needed, and the output is token-identical to autoregressive sampling with the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_int, check_num_tokens, raise_if_masked, report_progress
from mmgen.decoding.drafts import DraftContext, RandomDraftInit, resolve_draft_init
from mmgen.decoding.stats import StatsRecorder
from mmgen.modeling import TokenModel
from mmgen.sampling import SamplingConfig, invalid_rows, race


def race_noise(batch: int, num_tokens: int, vocab_size: int, generator: torch.Generator, device) -> torch.Tensor:
    """The Exp(1) noise table [B, num_tokens, V] that fixes every token's sample in advance."""
    return torch.empty(batch, num_tokens, vocab_size, device=device).exponential_(generator=generator)


@dataclass
class CoupledJacobi(Decoder):
    """Jacobi decoding under a fixed per-position noise table (lossless sampling).

    Each forward feeds `window` tokens per row (the newest finalised token and window - 1
    drafts). Draft i is accepted while it equals the noisy argmax predicted at slot i - 1; the
    first mismatch is replaced by that argmax, which is final because its prefix is. Tokens
    predicted after the mismatch become the next drafts. The noise table costs
    B x num_tokens x V float32 (4 MiB per row for 256 tokens x 4096 codes).
    """

    window: int = 16
    draft_init: Any = field(default_factory=RandomDraftInit)

    def __post_init__(self):
        check_int("window", self.window, 1)

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
        L, V = min(self.window, num_tokens), model.vocab_size  # a wider window has nothing to draft
        init = resolve_draft_init(self.draft_init)
        state = model.start(conditions, self.capacity(num_tokens), sampling.uses_guidance)
        B, device = state.batch_size, state.device
        recorder = StatsRecorder(device, max_accepted=L)
        slots = torch.arange(L + 1, device=device)
        noise = race_noise(B, num_tokens, V, generator, device)
        # Padded so a window reaching past the end reads valid (unused) noise.
        noise = torch.cat([noise, torch.ones(B, 2 * L, V, device=device)], 1)
        out = torch.zeros(B, num_tokens + 2 * L, dtype=torch.long, device=device)
        row_length = getattr(model, "row_length", None)

        def noisy_argmax(probs, index):
            return race(probs, noise.gather(1, index[..., None].expand(-1, -1, V)))

        def fill(window, fresh, pos):
            ctx = DraftContext(window, fresh, pos[:, None] + slots[:L], out, V, generator, row_length)
            return torch.where(fresh, init(ctx)[0], window)

        zero = torch.zeros(B, 1, dtype=torch.long, device=device)
        probs = sampling.probs(state.first_logits, zero)
        bad = invalid_rows(probs).any(-1)
        pos = torch.zeros(B, dtype=torch.long, device=device)
        window = torch.cat([noisy_argmax(probs, zero), torch.zeros(B, L - 1, dtype=torch.long, device=device)], 1)
        out[:, 0] = window[:, 0]
        window = fill(window, (slots[:L] > 0).expand(B, -1), pos)
        recorder.record(torch.ones_like(pos), torch.ones_like(pos, dtype=torch.bool))
        done_min = 1

        while done_min < num_tokens:
            active = pos + 1 < num_tokens
            index = pos[:, None] + 1 + slots[:L]  # generated-token index each slot predicts
            p = sampling.probs(model.forward(state, window), index)
            bad |= invalid_rows(p).any(-1) & active
            target = noisy_argmax(p, index)  # [B, L]: the sample at each slot given the window

            n_acc = (window[:, 1:] == target[:, :-1]).long().cumprod(-1).sum(-1)
            written = torch.cat([window, target[:, -1:]], 1).scatter(1, (n_acc + 1)[:, None], target.gather(1, n_acc[:, None]))
            out.scatter_(1, pos[:, None] + slots, written)
            step = torch.where(active, n_acc + 1, 0)
            model.commit(state, step)
            recorder.record(step, active)
            new_pos = pos + step

            source = n_acc[:, None] + slots[:L]  # slot of `target` that becomes each new slot
            carried = source < L
            new_window = fill(target.gather(1, source.clamp_max(L - 1)), ~carried, new_pos)
            window = torch.where(active[:, None], new_window, window)
            pos = new_pos

            done_min = report_progress(pos, num_tokens, done_min, progress)  # the one host sync

        raise_if_masked(bad)
        return DecodeOutput(out[:, :num_tokens], recorder.finish(num_tokens, B, state.cache_bytes))
