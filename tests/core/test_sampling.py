import math

import pytest
import torch

from mmgen.sampling import (
    AllTokensMaskedError,
    ConstantGuidance,
    IntervalGuidance,
    Logits,
    SamplingConfig,
    apply_guidance,
    check_probs,
    logits_to_probs,
    sample,
)


def reference_top_k_top_p(logits, top_k, top_p):
    """Straight-line transcription of the rule LlamaGen's sampler uses (HF's filtering)."""
    logits = logits.clone()
    if top_k > 0:
        kth = torch.topk(logits, top_k)[0][..., -1, None]
        logits[logits < kth] = -math.inf
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = torch.cumsum(torch.softmax(sorted_logits, -1), -1)
        remove = cum > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits[remove.scatter(1, idx, remove)] = -math.inf
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (7, 0.5), (1, 1.0), (0, 0.01)])
def test_filters_match_reference(top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    expected = reference_top_k_top_p(logits / 0.8, top_k, top_p)
    torch.testing.assert_close(logits_to_probs(logits, 0.8, top_k, top_p), expected)


def test_probs_are_float32_from_bfloat16():
    logits = torch.randn(2, 3, 50).to(torch.bfloat16)
    probs = SamplingConfig(top_k=10).probs(Logits(logits, logits * 0.5), torch.zeros(2, 3, dtype=torch.long))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))


def test_temperature_zero_is_greedy_one_hot():
    logits = torch.tensor([[0.1, 3.0, -1.0]])
    assert logits_to_probs(logits, temperature=0).tolist() == [[0.0, 1.0, 0.0]]


def test_guidance_combination_and_exact_cond_when_off():
    cond, uncond = torch.randn(1, 4, 9), torch.randn(1, 4, 9)
    scale = torch.tensor([[2.0, 1.0, 0.0, 4.0]])
    out = apply_guidance(Logits(cond, uncond), scale)
    torch.testing.assert_close(out[:, 0], uncond[:, 0] + 2.0 * (cond[:, 0] - uncond[:, 0]))
    assert torch.equal(out[:, 1], cond[:, 1])  # bit-exact when guidance is off
    torch.testing.assert_close(out[:, 2], uncond[:, 2])
    assert torch.equal(apply_guidance(Logits(cond), scale), cond)


def test_interval_guidance_follows_official_semantics():
    # Official: prefill (token 0) guided, decode step i (token i + 1) guided while i <= interval.
    index = torch.arange(8)
    assert IntervalGuidance(4.0, 3).scales(index).tolist() == [4.0] * 5 + [1.0] * 3
    assert IntervalGuidance(4.0, -1).scales(index).tolist() == [4.0] * 8
    assert ConstantGuidance(2.5).scales(index).tolist() == [2.5] * 8
    assert not SamplingConfig(guidance=1.0).uses_guidance
    assert SamplingConfig(guidance=IntervalGuidance(3.0, 5)).uses_guidance


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(guidance=-1.0), "guidance"),
        (dict(guidance=float("nan")), "guidance"),
    ],
)
def test_invalid_sampling_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_all_masked_row_is_a_clear_error():
    logits = torch.randn(3, 10)
    logits[1] = -math.inf
    probs = logits_to_probs(logits, top_k=3)
    with pytest.raises(AllTokensMaskedError, match="every token was masked"):
        check_probs(probs)
    check_probs(probs[[0, 2]])  # the valid rows pass


def test_sample_is_exact_and_reproducible():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0]).expand(40000, 4)
    draws = sample(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    # Binomial standard error <= 0.0025; 5 sigma.
    assert (freq - probs[0]).abs().max() < 0.0125
    assert freq[3] == 0
    again = sample(probs, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
