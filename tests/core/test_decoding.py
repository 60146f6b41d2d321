"""Losslessness of speculative Jacobi decoding: what "lossless" means, tested both ways.

Greedy: token-identical to autoregressive decoding (batch 1 and 4, with CFG).
Sampling: on a model small enough to enumerate every sequence, the empirical distribution
of SJD samples matches the exact autoregressive joint, by a chi-square test at a stated
false-alarm rate, both for batch-1 runs and for one batch of many rows (per-row acceptance).
A broken acceptance rule fails the same test, so the test can fail.
"""

import itertools
import pytest
import torch
from scipy.stats import chisquare

from mmgen.decoding import Autoregressive, ExactAcceptance, SpeculativeJacobi, resolve_decoder
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import AllTokensMaskedError, IntervalGuidance, Logits, SamplingConfig

from tests.conftest import tiny_transformer
from tests.speculation import RULE_CASES, AlwaysAccept, ResidualForgotten, assert_drafted, rule

ALPHA = 1e-3  # false-alarm rate of each chi-square test (seeds are fixed, so the outcome is too)


@pytest.mark.parametrize("labels", [[3], [1, 5, 7, 9]])
@pytest.mark.parametrize("guidance", [1.0, 4.0, IntervalGuidance(4.0, 10)])
@pytest.mark.parametrize("window", [4, 16, 4096])
def test_greedy_sjd_is_token_identical_to_ar(labels, guidance, window):
    model = LlamaGenTokenModel(tiny_transformer())
    sampling = SamplingConfig(top_k=1, guidance=guidance)
    conditions = torch.tensor(labels)
    ar = Autoregressive().generate(model, conditions, 64, sampling, torch.Generator().manual_seed(0))
    sjd = SpeculativeJacobi(window=window).generate(model, conditions, 64, sampling, torch.Generator().manual_seed(1))
    assert torch.equal(ar.tokens, sjd.tokens)
    assert ar.stats.forwards == 64
    assert sum(sjd.stats.accepted_histogram[k] * k for k in range(len(sjd.stats.accepted_histogram))) >= 64 * len(labels)
    assert_drafted(sjd, ar)


def test_accepted_per_forward_is_the_trace_behind_the_histogram():
    model = LlamaGenTokenModel(tiny_transformer())
    out = SpeculativeJacobi(window=8).generate(model, torch.tensor([2]), 64, SamplingConfig(top_k=1), torch.Generator().manual_seed(0))
    trace = out.stats.accepted_per_forward
    assert len(trace) == out.stats.forwards and sum(trace) == 64
    counts = [0] * len(out.stats.accepted_histogram)
    for accepted in trace:
        counts[int(accepted)] += 1
    assert counts == out.stats.accepted_histogram


# ------------------------------------------------------------------ distribution tests

VOCAB, LENGTH = 3, 4  # 81 sequences: small enough to enumerate


@pytest.fixture(scope="module")
def enumerable():
    # output_std 0.1: a spread law (entropy 3.0 of log 81 = 4.4 nats at guidance 2, temperature
    # 0.9), so a chi-square sees every outcome; at 1.5 one sequence held 97% of the mass.
    model = tiny_transformer(vocab_size=VOCAB, block_size=LENGTH, num_classes=3, output_std=0.1, seed=3)
    return LlamaGenTokenModel(model)


def exact_joint(token_model, label, sampling):
    """P(sequence) for all VOCAB**LENGTH sequences from teacher-forced full forwards."""
    model = token_model.transformer
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))
    cond = torch.full((len(seqs),), label)
    with torch.no_grad():
        logits_c, _ = model(seqs[:, :-1], cond)
        logits_u, _ = model(seqs[:, :-1], torch.full_like(cond, model.config.num_classes))
    index = torch.arange(LENGTH).expand(len(seqs), -1)
    probs = sampling.probs(Logits(logits_c, logits_u if sampling.uses_guidance else None), index)
    joint = probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1)
    assert abs(joint.sum().item() - 1) < 1e-5
    return seqs, joint / joint.sum()  # float32 rounding of the factors


def chi_square_pvalue(samples, seqs, joint):
    codes = (samples * torch.tensor([VOCAB ** (LENGTH - 1 - i) for i in range(LENGTH)])).sum(-1)
    counts = torch.bincount(codes, minlength=VOCAB**LENGTH).double()
    order = (seqs * torch.tensor([VOCAB ** (LENGTH - 1 - i) for i in range(LENGTH)])).sum(-1)
    expected = torch.zeros(VOCAB**LENGTH, dtype=torch.float64)
    expected[order] = joint * len(samples)
    if counts[expected == 0].sum() > 0:
        return 0.0  # sampled a sequence of probability zero
    # Pool cells expected below 5 into one, the usual validity condition of the test.
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    return chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue


SAMPLINGS = {
    "plain": SamplingConfig(),
    "cfg+temperature+top_k": SamplingConfig(temperature=0.9, top_k=2, guidance=2.0),
}


@pytest.mark.parametrize("rule_name,lossless", RULE_CASES)
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_batched_sjd_matches_exact_distribution(enumerable, name, rule_name, lossless):
    sampling = SAMPLINGS[name]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    n = 6000
    # The fixed window: at 6000 rows the adaptive window's cost model would take AR steps.
    acceptance = rule(rule_name)
    out = SpeculativeJacobi(window=3, adapt=False, acceptance=acceptance).generate(
        enumerable, torch.full((n,), 1), LENGTH, sampling, torch.Generator().manual_seed(0))
    assert acceptance.speculated(), acceptance.counts
    assert out.stats.mean_accepted_length > 1.1, "drafts were hardly ever accepted: the test would not exercise SJD"
    assert (chi_square_pvalue(out.tokens, seqs, joint) > ALPHA) == lossless


@pytest.mark.parametrize("rule_name,lossless", RULE_CASES)
def test_batch_one_sjd_matches_exact_distribution(enumerable, rule_name, lossless):
    """1500 batch-1 decodes; the fixed window, so that every decode drafts (the adaptive
    window's own law is tested in tests/core/test_adaptive_window.py)."""
    sampling = SAMPLINGS["cfg+temperature+top_k"]
    seqs, joint = exact_joint(enumerable, 2, sampling)
    acceptance = rule(rule_name)
    decoder, generator = SpeculativeJacobi(window=4, adapt=False, acceptance=acceptance), torch.Generator().manual_seed(1)
    samples = torch.cat([decoder.generate(enumerable, torch.tensor([2]), LENGTH, sampling, generator).tokens for _ in range(1500)])
    assert acceptance.speculated(), acceptance.counts
    assert (chi_square_pvalue(samples, seqs, joint) > ALPHA) == lossless


def test_autoregressive_matches_exact_distribution(enumerable):
    sampling = SAMPLINGS["plain"]
    seqs, joint = exact_joint(enumerable, 0, sampling)
    out = Autoregressive().generate(enumerable, torch.zeros(6000, dtype=torch.long), LENGTH, sampling, torch.Generator().manual_seed(2))
    assert chi_square_pvalue(out.tokens, seqs, joint) > ALPHA


def test_distribution_test_detects_a_biased_decoder(enumerable):
    sampling = SAMPLINGS["plain"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    decoder = SpeculativeJacobi(window=3, acceptance=AlwaysAccept(), adapt=False)  # 6000 rows: the fixed window drafts
    out = decoder.generate(enumerable, torch.full((6000,), 1), LENGTH, sampling, torch.Generator().manual_seed(0))
    assert chi_square_pvalue(out.tokens, seqs, joint) < ALPHA


def speculative_step_samples(rule, p, q, n, seed):
    """Draft x ~ q, apply `rule`, resample on rejection: n draws of one speculative step."""
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, n, replacement=True, generator=generator)[:, None]
    P, Q = p.expand(n, 1, -1), q.expand(n, 1, -1)
    accepted, residual = rule(P, Q, drafts, generator)
    resampled = torch.multinomial(residual[:, 0], 1, generator=generator)
    return torch.where(accepted, drafts, resampled)[:, 0]


@pytest.mark.parametrize("acceptance,lossless", [(ExactAcceptance(), True), (ResidualForgotten(), False)])
def test_acceptance_rule_reproduces_target_for_any_draft_law(acceptance, lossless):
    p = torch.tensor([0.05, 0.5, 0.1, 0.3, 0.05, 0.0])
    q = torch.tensor([0.4, 0.1, 0.2, 0.1, 0.1, 0.1])
    n = 20000
    counts = torch.bincount(speculative_step_samples(acceptance, p, q, n, seed=0), minlength=6).double()
    if counts[p == 0].sum() > 0:
        pvalue = 0.0
    else:
        pvalue = chisquare(counts[p > 0].numpy(), (p[p > 0].double() * n).numpy()).pvalue
    assert (pvalue > ALPHA) == lossless


# ------------------------------------------------------------------ interface and errors


def test_same_seed_same_tokens(token_model):
    sampling = SamplingConfig(guidance=3.0, top_k=8)
    run = lambda: SpeculativeJacobi(window=8).generate(token_model, torch.tensor([1, 2]), 64, sampling, torch.Generator().manual_seed(5))
    assert torch.equal(run().tokens, run().tokens)


def test_rows_finish_independently_and_stats_add_up(token_model):
    out = SpeculativeJacobi(window=8).generate(token_model, torch.tensor([0, 1, 2]), 64, SamplingConfig(top_k=1), torch.Generator().manual_seed(0))
    hist = out.stats.accepted_histogram
    assert len(hist) == 9 and hist[0] == 0
    assert sum(k * c for k, c in enumerate(hist)) >= 3 * 64
    assert out.stats.tokens == 64 and out.stats.rows == 3
    assert out.stats.step_compression == pytest.approx(64 / out.stats.forwards)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_invalid_window(window):
    with pytest.raises(ValueError, match="window"):
        SpeculativeJacobi(window=window)


def test_unknown_decoder_name():
    with pytest.raises(ValueError, match="unknown decoding"):
        resolve_decoder("beam")
    assert isinstance(resolve_decoder("SJD"), SpeculativeJacobi)


@pytest.mark.parametrize("decoder", [Autoregressive(), SpeculativeJacobi(window=4)])
def test_masked_logits_raise_instead_of_nan(token_model, decoder):
    with torch.no_grad():
        token_model.transformer.output.weight.fill_(float("nan"))
    with pytest.raises(AllTokensMaskedError, match="every token was masked"):
        decoder.generate(token_model, torch.tensor([1]), 16, SamplingConfig(top_k=5), torch.Generator().manual_seed(0))
