"""LlamaGen VQ tokenizer against the official implementation.

Fixtures were produced by running the official LlamaGen code (see
tests/fixtures/llamagen_tiny_reference.json and llamagen_official_layout.json for how).
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgen.image_ar.llamagen.vq import VQ_CONFIGS, VQConfig, VQModel

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def layout() -> dict:
    return json.loads((FIXTURES / "llamagen_official_layout.json").read_text())


@pytest.fixture(scope="module")
def tiny() -> tuple[VQModel, dict]:
    """Our model built from the tiny official VQ config, loaded with the official weights."""
    sidecar = json.loads((FIXTURES / "llamagen_tiny_reference.json").read_text())
    tensors = load_file(str(FIXTURES / "llamagen_tiny_reference.safetensors"))
    config = VQConfig.from_dict(sidecar["vq"]["equivalent_mmgen_config"])
    model = VQModel(config).eval()
    weights = {
        k[len("vq."):]: v.float()
        for k, v in tensors.items()
        if k.startswith("vq.") and not k.startswith(("vq.input.", "vq.output."))
    }
    model.load_state_dict(weights, strict=True)
    return model, tensors


@pytest.mark.parametrize("name", ["VQ-16", "VQ-8"])
def test_state_dict_layout_matches_official(name, layout):
    with torch.device("meta"):
        model = VQModel(VQ_CONFIGS[name])
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == layout["vq"][name]
    assert sum(p.numel() for p in model.parameters()) == layout["vq_param_counts"][name]


def test_config_helpers():
    assert VQ_CONFIGS["VQ-16"].downsample_factor == 16
    assert VQ_CONFIGS["VQ-8"].downsample_factor == 8
    d = VQ_CONFIGS["VQ-8"].to_dict()
    assert d["encoder_ch_mult"] == [1, 2, 2, 4]
    assert VQConfig.from_dict(json.loads(json.dumps(d))) == VQ_CONFIGS["VQ-8"]


def test_encode_matches_official(tiny):
    model, ref = tiny
    with torch.no_grad():
        quant, losses, indices = model.encode(ref["vq.input.image"])
    assert indices.dtype == torch.long
    assert torch.equal(indices, ref["vq.output.indices"])
    torch.testing.assert_close(quant, ref["vq.output.quant"], atol=1e-5, rtol=0)
    assert losses.vq_loss is None and losses.commit_loss is None and losses.entropy_loss is None


def test_decode_code_matches_official(tiny):
    model, ref = tiny
    with torch.no_grad():
        decoded = model.decode_code(ref["vq.output.indices"])
    # Error source: the decoder's float32 convolutions, group norms and attention (oneDNN/MKL
    # kernels, thread count, CPU). Measured: <= 4.2e-6 (2.6e-6 of max |decoded| = 1.6) under
    # OMP_NUM_THREADS=1/2/4, ATEN_CPU_CAPABILITY=default/avx2, MKL_ENABLE_INSTRUCTIONS=SSE4_2,
    # MKL_CBWR=COMPATIBLE; 3e-5 of max(1, max |decoded|) leaves > 11x (atol=1e-5 left 2.4x).
    scale = max(1.0, ref["vq.output.decoded"].abs().max().item())
    torch.testing.assert_close(decoded, ref["vq.output.decoded"], atol=3e-5 * scale, rtol=0)


def test_code_shapes_decode_identically(tiny):
    model, ref = tiny
    flat = ref["vq.output.indices"]  # [B, 64]
    with torch.no_grad():
        a = model.decode_code(flat)
        b = model.decode_code(flat.view(2, 8, 8))
        c = model.decode_code(flat, shape=(8, 8))
        d = model.decode_code(flat.flatten(), shape=(2, 8, 8, 8))  # official (B, C, h, w) form
    assert a.shape == (2, 3, 16, 16)
    for other in (b, c, d):
        assert torch.equal(a, other)


def test_codebook_lookup_is_l2_normalised(tiny):
    base, ref = tiny
    model = VQModel(base.config).eval()  # a copy, so the shared fixture stays untouched
    model.load_state_dict(base.state_dict())
    with torch.no_grad():
        # Rescale codebook rows arbitrarily: lookups and quantization must not change.
        scale = torch.rand(model.config.codebook_size, 1, generator=torch.Generator().manual_seed(0)) * 10 + 0.1
        model.quantize.embedding.weight.mul_(scale)
        entries = model.quantize.embed_code(torch.arange(model.config.codebook_size))
        torch.testing.assert_close(entries.norm(dim=-1), torch.ones(model.config.codebook_size))
        quant, _, indices = model.encode(ref["vq.input.image"])
        torch.testing.assert_close(quant.norm(dim=1), torch.ones(2, 8, 8))
        assert torch.equal(indices, ref["vq.output.indices"])


def test_training_losses(tiny):
    base, ref = tiny
    model = VQModel(base.config)
    model.load_state_dict(base.state_dict())
    model.train()
    dec, losses = model(ref["vq.input.image"])
    assert dec.shape == (2, 3, 16, 16)
    assert losses.vq_loss.ndim == 0 and losses.commit_loss.ndim == 0 and losses.entropy_loss.ndim == 0
    assert 0 < losses.codebook_usage <= 1
    (losses.vq_loss + losses.commit_loss + dec.square().mean()).backward()
    assert model.encoder.conv_in.weight.grad is not None
