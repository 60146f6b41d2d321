"""Entropy switching between a small and a large LlamaGen on one raster sequence."""

import pytest
import torch

from mmgen.decoding import Autoregressive, EntropySwitch, make_decoder
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig

from tests.conftest import tiny_transformer

SAMPLING = SamplingConfig(guidance=2.0)


def models():
    return LlamaGenTokenModel(tiny_transformer(seed=0)), LlamaGenTokenModel(tiny_transformer(seed=1))


def decode(decoder, model, seed=0, labels=(1, 2, 3)):
    return decoder.generate(model, torch.tensor(labels), 24, SAMPLING, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(3))
def test_infinite_threshold_is_the_small_model_alone(seed):
    large, small = models()
    out = decode(EntropySwitch(small=small, threshold=float("inf")), large, seed)
    assert torch.equal(out.tokens, decode(Autoregressive(), small, seed).tokens)
    assert out.stats.stage_forwards == [1, 24] and out.stats.stage_tokens == [0, 72]


@pytest.mark.parametrize("seed", range(3))
def test_zero_threshold_is_the_large_model_alone(seed):
    # Every sampled distribution has positive entropy, so every token is the large model's.
    large, small = models()
    out = decode(EntropySwitch(small=small, threshold=0.0), large, seed)
    assert torch.equal(out.tokens, decode(Autoregressive(), large, seed).tokens)
    assert out.stats.stage_tokens == [72, 0]


class Recording:
    """A TokenModel wrapper that records every forward: where it started and its logits."""

    def __init__(self, inner):
        self.inner, self.vocab_size, self.fed, self.calls = inner, inner.vocab_size, 0, []

    def start(self, conditions, capacity, guidance):
        return self.inner.start(conditions, capacity, guidance)

    def forward(self, state, tokens):
        logits = self.inner.forward(state, tokens)
        self.calls.append((self.fed, tokens.shape[1], logits.cond[:, -1].clone()))
        return logits

    def commit(self, state, accepted):
        self.fed += int(accepted[0])
        self.inner.commit(state, accepted)


def test_large_model_catches_up_in_one_forward_with_exact_logits():
    """Between its steps the small model decodes; when the large one runs again it feeds every
    missed token in one forward, and its logits equal a teacher-forced pass over the sequence."""
    large, small = models()
    recording = Recording(large)
    out = decode(EntropySwitch(small=small, threshold=1.0, entropy_window=2), recording, seed=4)
    large_share, small_share = out.stats.stage_tokens
    assert 0 < large_share < 72 and large_share + small_share == 72
    assert any(n > 1 for _, n, _ in recording.calls)  # at least one catch-up over several tokens
    state = large.start(torch.tensor([1, 2, 3]), 32, guidance=True)
    full = large.forward(state, out.tokens[:, :-1]).cond
    for start, n, last in recording.calls:
        torch.testing.assert_close(last, full[:, start + n - 1], rtol=1e-5, atol=1e-5)


def test_errors():
    large, small = models()
    with pytest.raises(ValueError, match="small model"):
        decode(EntropySwitch(), large)
    with pytest.raises(ValueError, match="threshold"):
        EntropySwitch(small=small, threshold=-1.0)
    with pytest.raises(ValueError, match="entropy_window"):
        EntropySwitch(small=small, entropy_window=0)
    assert make_decoder("entropy-switch", threshold=1.5).threshold == 1.5
