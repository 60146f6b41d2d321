"""Continuous speculative decoding on cached causal models (next-token diffusion).

CSpD (Wang et al., arXiv 2411.11925) on a `CausalContinuousModel`: a small causal model
drafts k continuous tokens with its diffusion head, the target conditions its head on all of
them in one cached forward, and each row keeps its drafts up to its first rejection by the
density ratio of the two heads' final Gaussians (`ContinuousAcceptance`), with the residual at
that position or the target's own bonus token after the last. Both heads run on one noise
table per position (denoising-trajectory alignment), so a drafter equal to the target keeps
everything. Rows advance independently and roll back by not committing, as the token loop
(`speculative.py`) does.

A model that ends rows on its own (a speech model's end of audio) offers `lengths(state)`: each
row's token count once it has ended (a number past `num_tokens` while it goes on). Ended rows
stop drafting and verifying, the output's `lengths` holds the counts and the tokens after them
are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from mmgen.decoding.base import BaseDecoder, Progress, check_int, check_num_tokens
from mmgen.decoding.continuous_tokens import ContinuousAcceptance, ContinuousOutput, GaussianTokens, check_continuous_sampling
from mmgen.decoding.stats import DraftCounters, StatsRecorder
from mmgen.modeling import CausalContinuousModel, HeadSample
from mmgen.sampling import SamplingConfig, uniform


def _slots(inputs: Any, part: slice) -> Any:
    """Head conditioning restricted to some positions (tensors [B, n, ...] or tuples of them)."""
    if isinstance(inputs, tuple):
        return tuple(None if t is None else t[:, part] for t in inputs)
    return inputs[:, part]


@dataclass
class CausalContinuousSpeculative(BaseDecoder):
    """Next-token diffusion, autoregressive (`drafter=None`) or speculative with a small causal
    drafter of the same token space drafting `num_draft` tokens per target forward."""

    drafter: Any = None
    num_draft: int = 4
    acceptance: ContinuousAcceptance = field(default_factory=ContinuousAcceptance)
    family: ClassVar[str] = "causal-continuous"

    def __post_init__(self):
        check_int("num_draft", self.num_draft, 1)

    def generate(self, model: CausalContinuousModel, conditions: Any, num_tokens: int, sampling: SamplingConfig,
                 generator: torch.Generator, progress: Optional[Progress] = None, streamer: Optional[Any] = None) -> ContinuousOutput:
        """Decode `num_tokens` tokens per row (fewer where the model ends a row: `lengths`);
        `streamer.put` receives each row's newly final tokens [n_b, D] after every round (a token
        is final once sampled and the model has said its row goes on to it), `streamer.end()`
        once at the end."""
        check_num_tokens(num_tokens)
        check_continuous_sampling(sampling)
        drafter = self.drafter
        k = 0 if drafter is None else min(self.num_draft, num_tokens)
        if drafter is not None and (drafter.token_dim, drafter.head_steps) != (model.token_dim, model.head_steps):
            raise ValueError("drafter and target must share the token dimension and the head steps")
        capacity = num_tokens + 2 * (k + 1)
        state = model.start(conditions, capacity, sampling.uses_guidance)
        B, D, device = state.batch_size, model.token_dim, state.device
        # One noise table for both heads, the same whatever k (slots past the end are scratch).
        noise = torch.randn(B, num_tokens, model.head_steps + 1, D, generator=generator, device=device)
        noise = torch.cat([noise, noise.new_zeros(B, capacity - num_tokens, *noise.shape[2:])], 1)
        out = torch.zeros(B, capacity, D, device=device)
        slots = torch.arange(k + 2, device=device)
        recorder = StatsRecorder(device, max_accepted=k + 1)

        def head(m, inputs, index):  # index [B, n]: the generated-token index of each slot
            at = index[..., None, None].expand(-1, -1, *noise.shape[2:])
            return m.sample(inputs, noise.gather(1, at), sampling.temperature, sampling.guidance.scales(index).to(device))

        zero = torch.zeros(B, 1, dtype=torch.long, device=device)
        out[:, 0] = head(model, state.first_inputs, zero).x[:, 0]
        pos = torch.zeros(B, dtype=torch.long, device=device)  # each row's newest finalised token
        ones = torch.ones(B, dtype=torch.long, device=device)
        recorder.record(ones, ones.bool())
        ends = getattr(model, "lengths", None)
        limit = lambda: torch.full_like(pos, num_tokens) if ends is None else ends(state).clamp(max=num_tokens)
        stop = limit()
        draft_state = drafter.start(conditions, capacity, sampling.uses_guidance) if drafter is not None else None
        drafted = kept = fallbacks = 0
        draft_forwards, first_round = 1 if drafter is not None else 0, True
        finished = lambda: min(int(torch.where(pos + 1 < stop, pos, num_tokens).min()) + 1, num_tokens)
        sent = [0] * B

        def report():
            for b, upto in enumerate(torch.minimum(pos + 1, stop).tolist()):
                new, sent[b] = out[b, sent[b]: max(upto, sent[b])], max(upto, sent[b])
                yield new

        done = finished()
        if streamer is not None:
            streamer.put(list(report()))
        if progress is not None:
            progress.update(done)

        while done < num_tokens:
            active = pos + 1 < stop
            newest = out.gather(1, pos[:, None, None].expand(-1, 1, D))
            drafts, q = [], []
            if k:
                back = torch.arange(1 if first_round else 2, device=device) - (0 if first_round else 1)
                feed = out.gather(1, (pos[:, None] + back)[..., None].expand(-1, -1, D))
                for j in range(k):
                    inputs = _slots(drafter.forward(draft_state, feed), slice(-1, None))
                    drafter.commit(draft_state, torch.full_like(pos, feed.shape[1]))
                    d = head(drafter, inputs, pos[:, None] + 1 + j)
                    drafts.append(d)
                    feed = d.x
                draft_forwards += k
            window = torch.cat([newest] + [d.x for d in drafts], 1)
            target: HeadSample = head(model, model.forward(state, window), pos[:, None] + 1 + slots[: k + 1])

            if k:
                x = torch.cat([d.x for d in drafts], 1)  # [B, k, D]
                gauss = lambda mean, std: GaussianTokens(mean.flatten(0, 1), std.expand_as(mean).flatten(0, 1))
                q = gauss(torch.cat([d.mean for d in drafts], 1), torch.cat([d.std.expand_as(d.mean) for d in drafts], 1))
                p = gauss(target.mean[:, :k], target.std.expand_as(target.mean)[:, :k])
                accept = uniform((B, k), generator, device) < self.acceptance.accept_prob(x.flatten(0, 1), q, p).view(B, k)
                n_acc = accept.long().cumprod(-1).sum(-1)
                # The residual at each row's first rejection (rows that kept every draft take the bonus).
                at = n_acc.clamp_max(k - 1)
                pick = lambda g: GaussianTokens(g.mean.view(B, k, D)[torch.arange(B), at], g.std.view(B, k, D)[torch.arange(B), at])
                replacement, fell_back = self.acceptance.residual(pick(q), pick(p), generator)
                rejected = n_acc < k
                next_token = torch.where(rejected[:, None], replacement, target.x[:, k])
                drafted += int(active.sum()) * k
                kept += int((n_acc * active).sum())
                fallbacks += int((fell_back & rejected & active).sum())
                written = torch.cat([newest, x, target.x[:, k:]], 1)
            else:
                n_acc, next_token, written = torch.zeros_like(pos), target.x[:, 0], torch.cat([newest, target.x], 1)
            written = written.scatter(1, (n_acc + 1)[:, None, None].expand(-1, 1, D), next_token[:, None])
            out.scatter_(1, (pos[:, None] + slots)[..., None].expand(-1, -1, D), written)
            step = torch.where(active, n_acc + 1, 0)
            model.commit(state, step)
            recorder.record(step, active)
            pos = pos + step
            stop = limit()
            if k:
                drafter.rewind(draft_state, (pos - 1).clamp_min(0))
                first_round = False
            now = finished()  # the one host sync (an ended row counts as done)
            if streamer is not None:
                streamer.put(list(report()))
            if progress is not None and now > done:
                progress.update(now - done)
            done = now

        if streamer is not None:
            streamer.end()
        stats = recorder.finish(num_tokens if ends is None else max(int(stop.max()), 1), B, state.cache_bytes + (draft_state.cache_bytes if k else 0))
        stats.extra = DraftCounters(draft_forwards, drafted, kept, fallbacks)
        tokens = out[:, :num_tokens]
        if ends is None:
            return ContinuousOutput(tokens, stats)
        tokens = tokens * (torch.arange(num_tokens, device=device) < stop[:, None])[..., None]
        return ContinuousOutput(tokens, stats, lengths=stop)
