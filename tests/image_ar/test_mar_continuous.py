"""MAR behind the core's ContinuousModel: the plain decoder reproduces the official sampler
(replayed orders and noise), and continuous speculative decoding composes with it."""

import math

import pytest
import torch

from mmgen.decoding import ContinuousSpeculative, MaskedContinuous
from mmgen.image_ar.mar import MAR, MARConfig, sample_tokens
from mmgen.image_ar.mar.continuous_model import MARContinuousModel
from mmgen.sampling import ConstantGuidance, LinearProgressGuidance, SamplingConfig

from tests.image_ar.test_mar_model import tiny_model

NUM_ITER = 5


def official_positions(model, orders, num_iter):
    """Positions the official loop predicts at each step (possibly none)."""
    L, masked, out = model.seq_len, model.seq_len, []
    for k in range(num_iter):
        keep = 0 if k == num_iter - 1 else max(1, min(masked - 1, math.floor(L * math.cos(math.pi / 2 * (k + 1) / num_iter))))
        out.append(orders[:, keep:masked].sort(dim=1).values)
        masked = keep
    return out


@pytest.mark.parametrize("cfg,schedule,temperature", [(1.0, "linear", 1.0), (3.0, "linear", 0.9), (2.0, "constant", 1.0)])
def test_masked_decoder_reproduces_the_official_sampler(cfg, schedule, temperature):
    model = tiny_model()
    adapter = MARContinuousModel(model)
    labels = torch.tensor([1, 4, 7])
    guidance = LinearProgressGuidance(cfg, model.seq_len) if schedule == "linear" else ConstantGuidance(cfg)
    out = MaskedContinuous(num_steps=NUM_ITER).generate(adapter, labels, SamplingConfig(temperature, guidance=guidance),
                                                        torch.Generator().manual_seed(0))
    # Replay the decoder's draws (noise table first, then the orders) in the official loop.
    g = torch.Generator().manual_seed(0)
    table = torch.randn(3, model.seq_len, adapter.head_steps + 1, adapter.token_dim, generator=g)
    orders = model.random_orders(3, g)
    steps = official_positions(model, orders, NUM_ITER)

    def head_noise(step, rows):
        rows_index = steps[step]
        b = torch.arange(3)[:, None].expand_as(rows_index)
        return table[b, rows_index].reshape(-1, *table.shape[2:]).transpose(0, 1)

    ref = sample_tokens(model, labels, NUM_ITER, cfg, schedule, temperature, orders=orders, head_noise=head_noise)
    torch.testing.assert_close(model.unpatchify(out.tokens), ref, rtol=1e-5, atol=1e-5)


def bounded_model():
    """The tiny MAR with its head's output layer zeroed (eps = 0, fixed variance): a random head
    is no denoiser and blows samples up to 1e5-1e7 with a last-step std of 6e-3, where any rounding difference
    between the drafter's and the verifier's forward (one padded batch against per-step
    batches, equal to 1e-6, see test_mar_model) flips acceptances. A zeroed head is bounded and
    ignores z, so the verification plumbing (canvases, positions, noise alignment) is what this
    tests; z's equality is tested on its own."""
    model = tiny_model()
    with torch.no_grad():
        model.diffloss.net.final_layer.linear.weight.zero_()
        model.diffloss.net.final_layer.linear.bias.zero_()
    return model


def test_speculative_with_the_target_as_drafter_keeps_everything():
    model = bounded_model()
    adapter = MARContinuousModel(model, stochastic_last_step=True)
    sampling = SamplingConfig(guidance=LinearProgressGuidance(2.0, model.seq_len))
    labels = torch.tensor([0, 3])
    plain = MaskedContinuous(num_steps=8).generate(adapter, labels, sampling, torch.Generator().manual_seed(1))
    spec = ContinuousSpeculative(drafter=adapter, num_steps=8, num_draft=3, prefill_ratio=0.25).generate(
        adapter, labels, sampling, torch.Generator().manual_seed(1))
    assert spec.stats.accepted_drafts == spec.stats.drafted > 0
    torch.testing.assert_close(spec.tokens, plain.tokens, rtol=1e-5, atol=1e-5)


def test_speculative_with_a_different_drafter_runs_and_counts():
    target = MARContinuousModel(tiny_model(), stochastic_last_step=True)
    torch.manual_seed(3)
    other = MAR(MARConfig(**{**tiny_model().config.to_dict(), "encoder_depth": 1, "decoder_depth": 1})).eval()
    drafter = MARContinuousModel(other, stochastic_last_step=True)
    spec = ContinuousSpeculative(drafter=drafter, num_steps=8, num_draft=4, prefill_ratio=0.0).generate(
        target, torch.tensor([0, 3]), SamplingConfig(), torch.Generator().manual_seed(2))
    assert torch.isfinite(spec.tokens).all() and spec.stats.drafted > 0
    assert spec.stats.accepted_drafts <= spec.stats.drafted and spec.stats.fallbacks >= 0
