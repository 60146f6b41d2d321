"""The decoding core on the device: the sampled law of AR and SJD (chi-square against the
enumerated law) and continuous batching equal to each request alone.

On CUDA the token decoders sample and verify through the Triton kernels by default
(`mmgen.kernels`), so every decode here runs them there; tests/device/test_cuda.py checks the
kernels and the compiled steps themselves.
"""

from __future__ import annotations

import pytest
import torch

from mmgen.decoding import Autoregressive, SpeculativeJacobi, make_decoder
from mmgen.decoding.batching import Request, continuous_decode
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig, make_generator

from tests.conftest import tiny_transformer
from tests.device.parity import ALPHA, assert_greedy_identical, chi_square_pvalue, exact_law

pytestmark = pytest.mark.device

VOCAB, LENGTH = 3, 4  # 81 sequences: small enough to enumerate
LAWS = {"plain": SamplingConfig(), "cfg+temperature+top_k": SamplingConfig(temperature=0.9, top_k=2, guidance=2.0)}
SAMPLED = SamplingConfig(temperature=1.0, top_k=16, guidance=3.0)
GREEDY = SamplingConfig(top_k=1, guidance=4.0)
LABELS = [1, 5, 7, 2, 9]


def model_on(device, **overrides) -> LlamaGenTokenModel:
    codebook = torch.randn(32, 8, generator=make_generator(0)).to(device)  # LANTERN's neighbours
    return LlamaGenTokenModel(tiny_transformer(**overrides).to(device), codebook=codebook)


@pytest.mark.parametrize("sampling", list(LAWS))
@pytest.mark.parametrize("decoder", ["ar", "sjd"])
def test_sampled_decodes_follow_the_exact_law(device, decoder, sampling):
    """3000 rows in one batch (per-row acceptance), every sequence's count against its exact
    probability (teacher-forced forwards over all 81), chi-square at ALPHA."""
    model = LlamaGenTokenModel(tiny_transformer(vocab_size=VOCAB, block_size=LENGTH, num_classes=3, output_std=0.1, seed=3)
                               .to(device))
    seqs, law = exact_law(model, 1, LAWS[sampling], LENGTH)
    dec = Autoregressive() if decoder == "ar" else SpeculativeJacobi(window=3, adapt=False)
    out = dec.generate(model, torch.ones(3000, dtype=torch.long, device=device), LENGTH, LAWS[sampling], make_generator(0, device))
    codes = (out.tokens * VOCAB ** torch.arange(LENGTH - 1, -1, -1, device=device)).sum(-1)
    order = (seqs * VOCAB ** torch.arange(LENGTH - 1, -1, -1, device=device)).sum(-1)
    observed = torch.bincount(codes, minlength=VOCAB**LENGTH)
    expected = torch.zeros(VOCAB**LENGTH, dtype=torch.float64, device=device).index_put_((order,), law * len(codes))
    assert chi_square_pvalue(observed, expected) > ALPHA
    if decoder == "sjd":
        assert out.stats.forwards < LENGTH + 1  # drafts were accepted: the verify path ran


def test_the_bfloat16_allowance_covers_near_ties_only(device):
    """The helper the bfloat16 parity tests assert with fails where a decoder parts from AR at a
    token whose logits were not close."""
    model, labels = model_on(device), torch.tensor([1, 2], device=device)
    ar = Autoregressive().generate(model, labels, 16, GREEDY, make_generator(0, device)).tokens
    wrong = ar.clone()
    wrong[0, 5] = (wrong[0, 5] + 1) % 32
    assert_greedy_identical(model, labels, GREEDY, ar, ar.clone(), torch.bfloat16, "same")
    with pytest.raises(AssertionError, match="parts from AR at token 5"):
        assert_greedy_identical(model, labels, GREEDY, ar, wrong, torch.bfloat16, "perturbed")
    with pytest.raises(AssertionError, match="differ"):
        assert_greedy_identical(model, labels, GREEDY, ar, wrong, torch.float32, "perturbed")


@pytest.mark.parametrize("name,sampling", [("ar", SAMPLED), ("sjd", SAMPLED), ("lantern", SAMPLED), ("sjd", GREEDY)],
                         ids=["ar", "sjd", "lantern", "sjd-greedy"])
def test_each_request_decodes_what_it_decodes_alone(device, name, sampling):
    """A row gives the same bits whatever rows share its batch (the device's kernels decide)."""
    model = model_on(device, output_std=1.5)
    decoder = make_decoder(name) if name == "ar" else make_decoder(name, adapt=False, window=8)
    requests = [Request(torch.tensor([label], device=device), make_generator(10 + i, device)) for i, label in enumerate(LABELS)]
    done, stats = continuous_decode(decoder, model, requests, 32, sampling, batch_size=2)
    assert [f.index for f in done] == list(range(len(LABELS))) and stats.rows == len(LABELS)
    for i, label in enumerate(LABELS):
        alone = decoder.generate(model, torch.tensor([label], device=device), 32, sampling, make_generator(10 + i, device))
        assert torch.equal(done[i].tokens, alone.tokens[0]), f"request {i}"
        assert done[i].stats.accepted_histogram == alone.stats.accepted_histogram
