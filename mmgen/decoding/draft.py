"""Draft-model speculative decoding: a small model of the same tokenizer proposes, the target
verifies (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mmgen.decoding.acceptance import ExactAcceptance
from mmgen.decoding.base import DecodeOutput, Decoder, Progress, check_int, check_num_tokens, raise_if_masked, report_progress
from mmgen.decoding.stats import StatsRecorder
from mmgen.modeling import TokenModel
from mmgen.sampling import SamplingConfig, invalid_rows, sample


def as_token_model(drafter: Any) -> TokenModel:
    """A `TokenModel` from a token model or from anything with `token_model()` (a pipeline)."""
    if hasattr(drafter, "token_model") and callable(drafter.token_model):
        drafter = drafter.token_model()
    if not isinstance(drafter, TokenModel):
        raise ValueError(f"drafter must be a TokenModel or a pipeline with token_model(), got {type(drafter).__name__}")
    return drafter


@dataclass
class DraftSpeculative(Decoder):
    """The drafter samples `num_draft` tokens autoregressively from its own distribution q
    (same sampling settings and guidance as the target); the target scores all of them in one
    forward and keeps a prefix with `acceptance`; then the drafter's cache is rewound to the
    kept prefix, per row. Lossless with `ExactAcceptance`.

    Each round the drafter re-feeds the last two finalised tokens, so a row whose every draft
    was accepted (the last draft was never fed to the drafter) needs no special case, and
    shapes stay fixed.
    """

    drafter: Any = None
    num_draft: int = 4
    acceptance: Any = field(default_factory=ExactAcceptance)

    def __post_init__(self):
        check_int("num_draft", self.num_draft, 1)

    @property
    def window(self) -> int:
        return self.num_draft + 1

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
        if self.drafter is None:
            raise ValueError("DraftSpeculative needs a drafter: a smaller model with the same tokenizer")
        drafter = as_token_model(self.drafter)
        if drafter.vocab_size != model.vocab_size:
            raise ValueError(f"drafter vocabulary {drafter.vocab_size} != target vocabulary {model.vocab_size}")
        k = min(self.num_draft, num_tokens)  # more drafts than tokens have nothing to draft
        rule = self.acceptance.bind(model)
        state = model.start(conditions, self.capacity(num_tokens), sampling.uses_guidance)
        draft_state = drafter.start(conditions, self.capacity(num_tokens), sampling.uses_guidance)
        B, device = state.batch_size, state.device
        recorder = StatsRecorder(device, max_accepted=k + 1)
        slots = torch.arange(k + 2, device=device)
        out = torch.zeros(B, num_tokens + 2 * (k + 1), dtype=torch.long, device=device)
        ones = torch.ones(B, dtype=torch.long, device=device)

        probs = sampling.probs(state.first_logits, torch.zeros(B, 1, dtype=torch.long, device=device))
        bad = invalid_rows(probs).any(-1)
        out[:, 0] = sample(probs, generator)[:, 0]
        pos = torch.zeros(B, dtype=torch.long, device=device)  # newest finalised, not yet fed
        recorder.record(ones, ones.bool())
        done_min, draft_forwards, first_round = 1, 0, True

        while done_min < num_tokens:
            active = pos + 1 < num_tokens
            # Draft k tokens. The drafter holds tokens < pos - 1 (all < pos in round one).
            feed = out.gather(1, pos[:, None] + (slots[:1] if first_round else slots[:2] - 1))
            drafts, q = [], []
            for j in range(k):
                q_j = sampling.probs(drafter.forward(draft_state, feed)[:, -1:], pos[:, None] + 1 + j)
                drafter.commit(draft_state, torch.full_like(pos, feed.shape[1]))
                feed = sample(q_j, generator)
                drafts.append(feed)
                q.append(q_j)
            draft_forwards += k
            drafts, q = torch.cat(drafts, 1), torch.cat(q, 1)

            # Verify: the target scores [newest finalised, drafts] in one forward.
            window = torch.cat([out.gather(1, pos[:, None]), drafts], 1)
            p = sampling.probs(model.forward(state, window), pos[:, None] + 1 + slots[: k + 1])
            bad |= invalid_rows(p).any(-1) & active
            accepted, residual = rule(p[:, :-1], q, drafts, generator)
            n_acc = accepted.long().cumprod(-1).sum(-1)
            bonus = sample(p[:, -1], generator)
            resampled = sample(residual, generator).gather(1, n_acc.clamp_max(k - 1)[:, None])[:, 0]
            next_token = torch.where(n_acc == k, bonus, resampled)
            written = torch.cat([window, bonus[:, None]], 1).scatter(1, (n_acc + 1)[:, None], next_token[:, None])
            out.scatter_(1, pos[:, None] + slots, written)

            step = torch.where(active, n_acc + 1, 0)
            model.commit(state, step)
            recorder.record(step, active)
            pos = pos + step
            drafter.rewind(draft_state, (pos - 1).clamp_min(0))
            first_round = False

            done_min = report_progress(pos, num_tokens, done_min, progress)  # the one host sync

        raise_if_masked(bad)
        stats = recorder.finish(num_tokens, B, state.cache_bytes + draft_state.cache_bytes)
        stats.draft_forwards = draft_forwards + 1  # plus the drafter's prefill
        return DecodeOutput(out[:, :num_tokens], stats)
