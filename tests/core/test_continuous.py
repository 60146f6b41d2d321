"""Continuous speculative sampling on toy heads whose densities are known: the verified tokens
follow the target exactly (statistical tests at alpha = 1e-3), identical heads keep every draft,
the flattened ratio is not exact (negative control), and the residual never leaves a zero token."""

import math

import pytest
import torch
from scipy import stats

from mmgen.decoding.continuous_tokens import ContinuousAcceptance, ContinuousSpeculative, GaussianTokens, MaskedContinuous
from mmgen.modeling import ContinuousModel, ContinuousState, HeadSample
from mmgen.sampling import SamplingConfig

ALPHA = 1e-3
N = 40_000


def gaussians(mean, std, n=N):
    mean, std = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)
    return GaussianTokens(mean.expand(n, -1).clone(), std.expand(n, -1).clone())


def verify(draft, target, rule=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = draft.sample(g)
    return (rule or ContinuousAcceptance())(x, draft, target, g)


def overlap_1d(q, p):
    """1 - TV of two 1-D Gaussians by numerical integration."""
    grid = torch.linspace(-12, 12, 200_001, dtype=torch.float64)
    pdf = lambda m, s: torch.exp(-0.5 * ((grid - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))
    return float(torch.minimum(pdf(*q), pdf(*p)).sum() * (grid[1] - grid[0]))


@pytest.mark.parametrize("q,p", [((0.0, 1.0), (0.7, 0.6)), ((0.0, 0.5), (-0.4, 1.5)), ((1.0, 1.0), (1.0, 1.0))])
def test_1d_output_follows_the_target(q, p):
    out, kept, fallbacks = verify(gaussians([q[0]], [q[1]]), gaussians([p[0]], [p[1]]))
    assert stats.kstest(out[:, 0].numpy(), "norm", args=p).pvalue > ALPHA
    assert fallbacks == 0 and torch.isfinite(out).all()
    # The acceptance rate is the overlap of the two densities, 1 - TV(p, q).
    rate, expected = kept.float().mean().item(), overlap_1d(q, p)
    assert abs(rate - expected) < 4 * math.sqrt(max(expected * (1 - expected), 0.0) / N) + 1e-3


def test_2d_diagonal_output_follows_the_target():
    p_mean, p_std = [0.5, -0.3], [0.8, 1.3]
    out, kept, _ = verify(gaussians([0.0, 0.0], [1.0, 1.0]), gaussians(p_mean, p_std))
    for d in range(2):
        assert stats.kstest(out[:, d].numpy(), "norm", args=(p_mean[d], p_std[d])).pvalue > ALPHA
    # Independence of the two coordinates: counts in the four quadrants around the target's
    # mean against the product of the marginals (each 1/4).
    quadrant = ((out[:, 0] > p_mean[0]).long() * 2 + (out[:, 1] > p_mean[1]).long()).bincount(minlength=4).numpy()
    assert stats.chisquare(quadrant).pvalue > ALPHA
    assert 0.3 < kept.float().mean().item() < 0.95


def test_identical_heads_keep_every_draft():
    head = gaussians([0.3, -1.0, 2.0], [0.5, 1.0, 2.0], n=1000)
    g = torch.Generator().manual_seed(0)
    x = head.sample(g)
    out, kept, fallbacks = ContinuousAcceptance()(x, head, head, g)
    assert kept.all() and torch.equal(out, x) and fallbacks == 0


def test_flattened_ratio_keeps_more_and_is_not_exact():
    q, p = ([0.0], [1.0]), ([1.5], [0.5])
    exact = verify(gaussians(*q), gaussians(*p))
    flat = verify(gaussians(*q), gaussians(*p), ContinuousAcceptance(flatten=42.0))
    assert flat[1].float().mean() > exact[1].float().mean() + 0.3
    assert stats.kstest(flat[0][:, 0].numpy(), "norm", args=(1.5, 0.5)).pvalue < ALPHA


def test_residual_never_leaves_a_zero_token_and_counts_fallbacks():
    # Nearly identical heads: the residual is tiny, so one try rarely succeeds.
    rule = ContinuousAcceptance(max_tries=1)
    out, kept, fallbacks = verify(gaussians([0.0, 0.0], [1.0, 1.0], n=4000), gaussians([0.05, 0.0], [1.0, 1.0], n=4000), rule)
    assert fallbacks > 0 and (~kept).sum() >= fallbacks
    assert torch.isfinite(out).all() and not (out == 0).all(-1).any()


def test_bad_parameters():
    with pytest.raises(ValueError, match="flatten"):
        ContinuousAcceptance(flatten=0.5)
    with pytest.raises(ValueError, match="max_tries"):
        ContinuousAcceptance(max_tries=0)


# ---------------------------------------------------------------------------- decoders


class ToyContinuousModel:
    """A masked continuous-token model with a 3-step 'diffusion' head whose final step is an
    explicit Gaussian: everything a `ContinuousModel` promises, at toy size."""

    head_steps = 3

    def __init__(self, num_tokens=4, token_dim=1, seed=0, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        self.num_tokens, self.token_dim = num_tokens, token_dim
        self.pos = torch.randn(num_tokens, 8, generator=g) * scale
        self.cls = torch.randn(4, 8, generator=g) * scale  # 3 classes + the null class
        self.mix = torch.randn(token_dim, 8, generator=g) * scale
        self.out = torch.randn(8, token_dim, generator=g) * 0.5
        self.calls = 0

    def start(self, conditions, guidance):
        B = conditions.shape[0]
        return ContinuousState(torch.zeros(B, self.num_tokens, self.token_dim), torch.zeros(B, self.num_tokens, dtype=torch.bool),
                               conditions, guidance)

    def schedule(self, state, num_steps, generator):
        order = torch.stack([torch.randperm(self.num_tokens, generator=generator) for _ in range(state.tokens.shape[0])])
        bounds = torch.linspace(0, self.num_tokens, num_steps + 1).round().long().tolist()
        return [order[:, a:b] for a, b in zip(bounds, bounds[1:]) if b > a]

    def head_inputs(self, state, positions):
        self.calls += 1
        known = state.known.float()[..., None]
        context = (state.tokens * known).sum(1) / known.sum(1).clamp(min=1)  # [B, D]
        base = self.pos[positions] + (context @ self.mix)[:, None]
        cond = torch.tanh(base + self.cls[state.conditions][:, None])
        uncond = torch.tanh(base + self.cls[3]) if state.guidance else None
        return cond, uncond

    def sample(self, inputs, noise, temperature, guidance_scale):
        cond, uncond = inputs
        x = noise[:, :, 0]
        for t in range(1, self.head_steps + 1):
            eps = cond @ self.out
            if uncond is not None:
                # guidance per row [B] (masked models) or per row and position [B, n] (causal ones)
                scale = guidance_scale.reshape(guidance_scale.shape[0], -1, 1)
                eps = uncond @ self.out + scale * (eps - uncond @ self.out)
            mean = 0.6 * x + eps
            std = torch.full_like(mean, 0.5 * temperature)
            x = mean + std * noise[:, :, t]
        return HeadSample(x, mean, std)


def sampled(decoder, model, rows, seed, guidance=1.0):
    return decoder.generate(model, torch.arange(rows) % 3, SamplingConfig(guidance=guidance), torch.Generator().manual_seed(seed))


def test_toy_is_a_continuous_model():
    assert isinstance(ToyContinuousModel(), ContinuousModel)


def test_masked_decoding_fills_every_position_once_and_is_seeded():
    model = ToyContinuousModel(num_tokens=6)
    a, b = sampled(MaskedContinuous(num_steps=3), model, 5, 0), sampled(MaskedContinuous(num_steps=3), model, 5, 0)
    assert torch.equal(a.tokens, b.tokens) and a.stats.forwards == 3 and model.calls == 6
    assert (a.tokens != 0).all()


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_drafter_equal_to_target_keeps_everything_and_equals_plain_decoding(guidance):
    model = ToyContinuousModel(num_tokens=8, token_dim=2)
    plain = sampled(MaskedContinuous(num_steps=6), model, 16, 3, guidance)
    spec = sampled(ContinuousSpeculative(drafter=model, num_steps=6, num_draft=3, prefill_ratio=0.2), model, 16, 3, guidance)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.stats.accepted_drafts == spec.stats.drafted > 0 and spec.stats.fallbacks == 0
    # 2 prefill steps, then windows of 3 and 1 drafted steps, each verified in one forward.
    assert spec.stats.forwards == 2 + 2 and spec.stats.draft_forwards == 4


def test_speculative_output_follows_the_target_distribution():
    target, drafter = ToyContinuousModel(seed=0), ToyContinuousModel(seed=1, scale=0.8)
    rows = 20_000
    plain = sampled(MaskedContinuous(num_steps=4), target, rows, 0, guidance=2.0).tokens[..., 0]
    spec = sampled(ContinuousSpeculative(drafter=drafter, num_steps=4, num_draft=3, prefill_ratio=0.0), target, rows, 1,
                   guidance=2.0)
    tokens = spec.tokens[..., 0]
    assert 0 < spec.stats.accepted_drafts < spec.stats.drafted
    # Every position's marginal, and a joint statistic of two positions, against plain decoding.
    for j in range(4):
        assert stats.ks_2samp(tokens[:, j].numpy(), plain[:, j].numpy()).pvalue > ALPHA
    assert stats.ks_2samp((tokens[:, 0] * tokens[:, 3]).numpy(), (plain[:, 0] * plain[:, 3]).numpy()).pvalue > ALPHA
    # Negative control: the reference's flattened ratio does not follow the target.
    flat = sampled(ContinuousSpeculative(drafter=drafter, num_steps=4, num_draft=3, prefill_ratio=0.0,
                                         acceptance=ContinuousAcceptance(flatten=42.0)), target, rows, 1, guidance=2.0)
    assert min(stats.ks_2samp(flat.tokens[:, j, 0].numpy(), plain[:, j].numpy()).pvalue for j in range(4)) < ALPHA


class CausalToyModel(ToyContinuousModel):
    """Next-token diffusion (as VibeVoice generates speech latents): one position per step, left
    to right, each conditioned on the tokens before it."""

    def schedule(self, state, num_steps, generator):
        B = state.tokens.shape[0]
        return [torch.full((B, 1), i, dtype=torch.long) for i in range(self.num_tokens)]


def test_causal_continuous_model_takes_the_same_speculative_decoder():
    target, drafter = CausalToyModel(seed=0), CausalToyModel(seed=1, scale=0.8)
    rows = 20_000
    plain = sampled(MaskedContinuous(num_steps=4), target, rows, 0).tokens[..., 0]
    same = sampled(ContinuousSpeculative(drafter=target, num_steps=4, num_draft=2, prefill_ratio=0.0), target, 64, 0)
    assert torch.equal(same.tokens, sampled(MaskedContinuous(num_steps=4), target, 64, 0).tokens)
    assert same.stats.forwards == 2  # two windows of two drafted tokens, one target forward each
    spec = sampled(ContinuousSpeculative(drafter=drafter, num_steps=4, num_draft=3, prefill_ratio=0.0), target, rows, 1)
    assert 0 < spec.stats.accepted_drafts < spec.stats.drafted
    for j in range(4):
        assert stats.ks_2samp(spec.tokens[:, j, 0].numpy(), plain[:, j].numpy()).pvalue > ALPHA
    assert stats.ks_2samp((spec.tokens[:, 0, 0] * spec.tokens[:, 3, 0]).numpy(),
                          (plain[:, 0] * plain[:, 3]).numpy()).pvalue > ALPHA


def test_prefill_ratio_one_is_the_target_alone():
    target, drafter = ToyContinuousModel(), ToyContinuousModel(seed=1)
    spec = sampled(ContinuousSpeculative(drafter=drafter, num_steps=4, prefill_ratio=1.0), target, 8, 0)
    assert torch.equal(spec.tokens, sampled(MaskedContinuous(num_steps=4), target, 8, 0).tokens)
    assert spec.stats.draft_forwards == 0


def test_continuous_decoder_errors():
    model = ToyContinuousModel()
    with pytest.raises(ValueError, match="drafter"):
        sampled(ContinuousSpeculative(), model, 2, 0)
    with pytest.raises(ValueError, match="share"):
        sampled(ContinuousSpeculative(drafter=ToyContinuousModel(token_dim=2)), model, 2, 0)
    with pytest.raises(ValueError, match="top-k"):
        MaskedContinuous().generate(model, torch.tensor([0]), SamplingConfig(top_k=5), torch.Generator())
    with pytest.raises(ValueError, match="prefill_ratio"):
        ContinuousSpeculative(prefill_ratio=1.5)


def test_linear_progress_guidance_is_mars_schedule():
    from mmgen.sampling import LinearProgressGuidance

    g = LinearProgressGuidance(3.0, total=256)
    known_after = torch.tensor([1, 64, 255])
    torch.testing.assert_close(g.scales(known_after), 1 + 2.0 * known_after.float() / 256)
    assert g.scales(torch.tensor([256])).item() == g.scales(torch.tensor([255])).item()  # the official last step
    assert g.max_scale == 3.0 and SamplingConfig(guidance=g).uses_guidance
