"""Speculative Jacobi decoding with per-row acceptance.

SJD (Teng et al. 2024, "Accelerating Auto-regressive Text-to-Image Generation with
Training-free Speculative Jacobi Decoding", arXiv 2410.01699): keep a window of draft tokens
after each row's committed prefix, score the whole window in one forward, accept drafts
left to right with a lossless rule, resample at the first rejection, and reuse the tokens
sampled after the rejection as the next iteration's drafts. Every row advances by its own
accepted length; the reference code advances the whole batch by the minimum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.drafts import DraftContext, RandomDraftInit, resolve_draft_init
from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_int, check_num_tokens, raise_if_masked, report_progress
from mmgen.decoding.stats import StatsRecorder
from mmgen.modeling import TokenModel
from mmgen.sampling import SamplingConfig, invalid_rows, sample


@dataclass
class SpeculativeJacobi(Decoder):
    """Speculative Jacobi decoding (SJD, arXiv 2410.01699), lossless with `ExactAcceptance`.

    Each forward feeds `window` tokens per row: the row's newest finalised token and
    window - 1 drafts. Draft i is checked against the prediction made at position i - 1; the
    accepted prefix plus one resampled (or bonus) token is finalised, so every forward
    finalises between 1 and `window` tokens per row.
    """

    window: int = 16
    acceptance: Any = field(default_factory=ExactAcceptance)
    draft_init: Any = field(default_factory=RandomDraftInit)  # or a name of drafts.DRAFT_INITS

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
        rule = self.acceptance.bind(model)
        init = resolve_draft_init(self.draft_init)
        state = model.start(conditions, self.capacity(num_tokens), sampling.uses_guidance)
        B, device = state.batch_size, state.device
        recorder = StatsRecorder(device, max_accepted=L)
        slots = torch.arange(L + 1, device=device)  # window slots, plus the bonus slot
        # Finalised tokens land here; writes past num_tokens are scratch for finished rows.
        out = torch.zeros(B, num_tokens + 2 * L, dtype=torch.long, device=device)
        row_length = getattr(model, "row_length", None)

        def fill(window, fresh, pos, q_carried):
            """Fill the fresh slots with initial drafts; return the window and the drafts' laws."""
            ctx = DraftContext(window, fresh, pos[:, None] + slots[:L], out, V, generator, row_length)
            tokens, q_init = init(ctx)
            window = torch.where(fresh, tokens, window)
            return window, torch.where(fresh[:, 1:, None], q_init[:, 1:], q_carried)

        # Token 0 comes from the prefill; `pos` is the index of each row's newest finalised
        # (not yet fed) token, `window` = [that token, drafts], `q` the drafts' laws.
        probs = sampling.probs(state.first_logits, torch.zeros(B, 1, dtype=torch.long, device=device))
        bad = invalid_rows(probs).any(-1)
        pos = torch.zeros(B, dtype=torch.long, device=device)
        window = torch.cat([sample(probs, generator), torch.zeros(B, L - 1, dtype=torch.long, device=device)], dim=1)
        out[:, 0] = window[:, 0]
        window, q = fill(window, (slots[:L] > 0).expand(B, -1), pos, torch.zeros(B, L - 1, V, device=device))
        recorder.record(torch.ones_like(pos), torch.ones_like(pos, dtype=torch.bool))
        done_min = 1

        while done_min < num_tokens:
            active = pos + 1 < num_tokens
            logits = model.forward(state, window)
            p = sampling.probs(logits, pos[:, None] + 1 + slots[:L])  # p[:, i] predicts slot i + 1
            bad |= invalid_rows(p).any(-1) & active

            accepted, residual = rule(p[:, :-1], q, window[:, 1:], generator)
            n_acc = accepted.long().cumprod(-1).sum(-1)  # accepted draft prefix, 0..L-1
            fresh = sample(p, generator)  # target samples at every slot
            resampled = sample(residual, generator) if L > 1 else fresh
            # Bonus token when every draft passed, else the residual draw at the rejection.
            next_token = torch.where(
                n_acc == L - 1, fresh[:, -1], resampled.gather(1, n_acc.clamp_max(L - 2).clamp_min(0)[:, None])[:, 0]
            )

            # Finalise [fed token, accepted drafts, next_token] and move the window on.
            written = torch.cat([window, fresh[:, -1:]], dim=1)
            written = written.scatter(1, (n_acc + 1)[:, None], next_token[:, None])
            out.scatter_(1, pos[:, None] + slots, written)
            step = torch.where(active, n_acc + 1, 0)
            model.commit(state, step)
            recorder.record(step, active)
            new_pos = pos + step

            # Next drafts: the target's samples after the rejection (q = p there), then
            # initial drafts for the slots the old window did not reach.
            source = n_acc[:, None] + 1 + slots[: L - 1]  # slot of p that predicted each new draft
            carried = source < L
            src = source.clamp_max(L - 1)
            new_window = torch.cat([next_token[:, None], fresh.gather(1, src)], 1)
            new_fresh = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=device), ~carried], 1)
            new_window, new_q = fill(new_window, new_fresh, new_pos, p.gather(1, src[..., None].expand(-1, -1, V)))

            keep = active[:, None]
            window = torch.where(keep, new_window, window)
            q = torch.where(keep[..., None], new_q, q)
            pos = new_pos

            done_min = report_progress(pos, num_tokens, done_min, progress)  # the one host sync

        raise_if_masked(bad)
        return DecodeOutput(out[:, :num_tokens], recorder.finish(num_tokens, B, state.cache_bytes))
