"""Continuous speculative decoding on a cached causal model (next-token diffusion)."""

import pytest
import torch
from scipy import stats

from mmgen.decoding import CausalContinuousSpeculative, ContinuousAcceptance
from mmgen.modeling import CausalContinuousModel, CausalContinuousState
from mmgen.sampling import SamplingConfig

from tests.core.test_continuous import ALPHA, ToyContinuousModel


class CachedCausalToy(ToyContinuousModel):
    """The toy head of test_continuous, conditioned causally on a cache of the tokens so far
    (a buffer plus per-row lengths; rewinding is moving a length back)."""

    def start(self, conditions, capacity, guidance):
        B = conditions.shape[0]
        cache = {"tokens": torch.zeros(B, capacity, self.token_dim), "length": torch.zeros(B, dtype=torch.long),
                 "fed": None, "conditions": conditions}
        state = CausalContinuousState(cache, B, guidance, None, torch.device("cpu"))
        state.first_inputs = self._inputs(cache, torch.zeros(B, 0, self.token_dim), guidance)
        return state

    def _inputs(self, cache, window, guidance):
        """Conditioning of the position after each window slot (or of position `length` when
        the window is empty): the mean of every token before it, committed and fed."""
        B, n = window.shape[0], max(window.shape[1], 1)
        length = cache["length"]
        known = (torch.arange(cache["tokens"].shape[1])[None] < length[:, None]).float()[..., None]
        total = (cache["tokens"] * known).sum(1)[:, None] + torch.cat([torch.zeros(B, 1, self.token_dim), window.cumsum(1)], 1)[:, -n:]
        count = length[:, None] + torch.arange(n) + (1 if window.shape[1] else 0)
        context = total / count.clamp(min=1)[..., None]
        position = (length[:, None] + torch.arange(n) + (1 if window.shape[1] else 0)).clamp_max(self.num_tokens - 1)
        base = self.pos[position] + context @ self.mix
        cond = torch.tanh(base + self.cls[cache["conditions"]][:, None])
        return cond, (torch.tanh(base + self.cls[3]) if guidance else None)

    def forward(self, state, tokens):
        self.calls += 1
        state.cache["fed"] = tokens
        return self._inputs(state.cache, tokens, state.guidance)

    def commit(self, state, accepted):
        cache, fed = state.cache, state.cache["fed"]
        index = cache["length"][:, None] + torch.arange(fed.shape[1])
        keep = torch.arange(fed.shape[1])[None] < accepted[:, None]
        current = cache["tokens"].gather(1, index[..., None].expand(-1, -1, self.token_dim))
        cache["tokens"].scatter_(1, index[..., None].expand(-1, -1, self.token_dim), torch.where(keep[..., None], fed, current))
        cache["length"] = cache["length"] + accepted

    def rewind(self, state, num_generated):
        state.cache["length"] = num_generated.clone()


def run(decoder, model, rows, seed, n=4, guidance=1.0):
    return decoder.generate(model, torch.arange(rows) % 3, n, SamplingConfig(guidance=guidance), torch.Generator().manual_seed(seed))


def test_toy_is_a_cached_causal_continuous_model():
    assert isinstance(CachedCausalToy(), CausalContinuousModel)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_drafter_equal_to_target_keeps_everything_and_equals_autoregressive(guidance):
    model = CachedCausalToy(num_tokens=12, token_dim=2)
    ar = run(CausalContinuousSpeculative(drafter=None), model, 8, 3, 12, guidance)
    model.calls = 0
    spec = run(CausalContinuousSpeculative(drafter=CachedCausalToy(num_tokens=12, token_dim=2), num_draft=3), model, 8, 3, 12, guidance)
    # The toy sums its context in window order instead of token by token: rounding only.
    torch.testing.assert_close(spec.tokens, ar.tokens, rtol=1e-5, atol=1e-5)
    assert ar.stats.forwards == 12
    assert spec.stats.accepted_drafts == spec.stats.drafted > 0 and spec.stats.fallbacks == 0
    # Token 0 from the prefill, then 11 tokens at 4 per target forward (3 drafts + the bonus).
    assert spec.stats.forwards == 1 + 3 and model.calls == 3


def test_speculative_output_follows_the_target_distribution():
    target, drafter = CachedCausalToy(seed=0), CachedCausalToy(seed=1, scale=0.8)
    rows = 20_000
    plain = run(CausalContinuousSpeculative(drafter=None), target, rows, 0, guidance=2.0).tokens[..., 0]
    spec = run(CausalContinuousSpeculative(drafter=drafter, num_draft=3), target, rows, 1, guidance=2.0)
    tokens = spec.tokens[..., 0]
    assert 0 < spec.stats.accepted_drafts < spec.stats.drafted
    for j in range(4):
        assert stats.ks_2samp(tokens[:, j].numpy(), plain[:, j].numpy()).pvalue > ALPHA
    assert stats.ks_2samp((tokens[:, 0] * tokens[:, 3]).numpy(), (plain[:, 0] * plain[:, 3]).numpy()).pvalue > ALPHA
    assert stats.ks_2samp((tokens[:, 1] * tokens[:, 2]).numpy(), (plain[:, 1] * plain[:, 2]).numpy()).pvalue > ALPHA
    # Negative control: the reference's flattened ratio does not follow the target.
    flat = run(CausalContinuousSpeculative(drafter=drafter, num_draft=3, acceptance=ContinuousAcceptance(flatten=42.0)),
               target, rows, 1, guidance=2.0)
    assert min(stats.ks_2samp(flat.tokens[:, j, 0].numpy(), plain[:, j].numpy()).pvalue for j in range(4)) < ALPHA
