"""LlamaGen GPT against facts produced by the official code (tests/fixtures, see their JSON)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgen.decoding import Autoregressive, SpeculativeJacobi
from mmgen.hub import CheckpointError, load_strict
from mmgen.image_ar.llamagen import GPT_PRESETS, LlamaGenConfig, LlamaGenTokenModel, LlamaGenTransformer
from mmgen.image_ar.llamagen.gpt import precompute_rope_2d
from mmgen.image_ar.llamagen.pipeline import OFFICIAL_IGNORED_KEYS
from mmgen.sampling import IntervalGuidance, SamplingConfig

FIXTURES = Path(__file__).parents[1] / "fixtures"
LAYOUT = json.loads((FIXTURES / "llamagen_official_layout.json").read_text())
PUBLISHED = {"GPT-B": 111e6, "GPT-L": 343e6, "GPT-XL": 775e6, "GPT-XXL": 1.4e9, "GPT-XXXL": 3.9e9, "GPT-1B": 1.2e9, "GPT-3B": 3.1e9, "GPT-7B": 6.6e9}
C2I = dict(vocab_size=16384, block_size=256, num_classes=1000, cls_token_num=1)


def meta_model(name, **kwargs):
    with torch.device("meta"):
        return LlamaGenTransformer(LlamaGenConfig.from_preset(name, **kwargs))


@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
def test_every_preset_has_the_official_parameter_count(name):
    count = sum(p.numel() for p in meta_model(name, **C2I).parameters())
    assert count == LAYOUT["gpt_param_counts"][name]  # counted by the official code
    assert abs(count / PUBLISHED[name] - 1) < 0.02  # and as published


@pytest.mark.parametrize("name", ["GPT-B", "GPT-XL"])
def test_state_dict_layout_is_official(name):
    ours = {k: list(v.shape) for k, v in meta_model(name, **C2I).state_dict().items()}
    assert ours == LAYOUT["gpt"][name]


def test_text_conditional_layout_is_official():
    model = meta_model("GPT-XL", vocab_size=16384, block_size=1024, cls_token_num=120, model_type="t2i")
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == LAYOUT["gpt_t2i"]["GPT-XL"]


@pytest.fixture(scope="module")
def reference():
    tensors = load_file(str(FIXTURES / "llamagen_tiny_reference.safetensors"))
    args = json.loads((FIXTURES / "llamagen_tiny_reference.json").read_text())["gpt"]["official_model_args"]
    model = LlamaGenTransformer(LlamaGenConfig(**args)).eval()
    load_strict(model, {k[4:]: v for k, v in tensors.items() if k.startswith("gpt.")})
    return model, tensors


@torch.no_grad()
def test_logits_equal_the_official_cached_path(reference):
    model, t = reference
    cond, tokens = t["input.cond"], t["input.tokens"]
    tm = LlamaGenTokenModel(model)
    state = tm.start(cond, 20, guidance=True)
    rest = tm.forward(state, tokens[:, :-1])
    ours = torch.cat(
        [torch.cat([state.first_logits.cond, rest.cond], 1), torch.cat([state.first_logits.uncond, rest.uncond], 1)]
    )
    # Error source: float32 matmuls and attention (BLAS/SDPA kernels, thread count, CPU) with
    # errors relative to the logits' scale, not to each logit. Measured: <= 3.7e-7 of
    # max |logit| (13.1) under OMP_NUM_THREADS=1/2/4, ATEN_CPU_CAPABILITY=default/avx2,
    # MKL_ENABLE_INSTRUCTIONS=SSE4_2, MKL_CBWR=COMPATIBLE; 1e-5 of it leaves > 25x (the former
    # elementwise rtol=atol=1e-5 was used to 1/3 under MKL_CBWR=COMPATIBLE).
    scale = max(1.0, t["output.logits"].abs().max().item())
    torch.testing.assert_close(ours, t["output.logits"], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("interval,key", [(-1, "output.greedy_cfg4"), (3, "output.greedy_cfg4_interval3")])
@pytest.mark.parametrize("decoder", [Autoregressive(), SpeculativeJacobi(window=5)])
def test_greedy_generation_equals_official_generate(reference, interval, key, decoder):
    model, t = reference
    sampling = SamplingConfig(top_k=1, guidance=IntervalGuidance(4.0, interval))
    out = decoder.generate(LlamaGenTokenModel(model), t["input.cond"], 16, sampling, torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, t[key])


def test_condition_positions_have_zero_rotary_rows():
    table = precompute_rope_2d(grid_size=4, head_dim=16, cls_token_num=3)
    assert table.shape == (3 + 16, 8, 2)
    assert torch.count_nonzero(table[:3]) == 0
    torch.testing.assert_close(table[3, :, 0], torch.ones(8))  # grid (0, 0): identity rotation


def test_mismatched_state_dict_names_missing_unexpected_and_shapes(reference):
    model, _ = reference
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.pop("layers.1.feed_forward.w2.weight")
    state["layers.9.attention.wqkv.weight"] = torch.zeros(1)
    state["tok_embeddings.weight"] = torch.zeros(5, 64)
    with pytest.raises(CheckpointError) as error:
        load_strict(model, state, source="ckpt.pt")
    message = str(error.value)
    assert "missing keys (1): layers.1.feed_forward.w2.weight" in message
    assert "unexpected keys (1): layers.9.attention.wqkv.weight" in message
    assert "tok_embeddings.weight: checkpoint (5, 64) vs model (32, 64)" in message


def test_runtime_state_saved_by_official_scripts_is_ignored(reference):
    model, _ = reference
    state = dict(model.state_dict())
    state["freqs_cis"] = torch.zeros(17, 8, 2)
    state["layers.0.attention.kv_cache.k_cache"] = torch.zeros(1)
    load_strict(model, state, ignore=OFFICIAL_IGNORED_KEYS)


@torch.no_grad()
def test_bfloat16_model_keeps_float32_probabilities(reference):
    model, t = reference
    model = LlamaGenTransformer(model.config).eval()
    model.load_state_dict(reference[0].state_dict())
    model.to(torch.bfloat16)
    assert model.freqs_cis.dtype == torch.float32
    tm = LlamaGenTokenModel(model)
    state = tm.start(t["input.cond"], 20, guidance=True)
    assert state.cache.k.dtype == torch.bfloat16
    assert state.first_logits.cond.dtype == torch.float32
    out = SpeculativeJacobi(window=4).generate(tm, t["input.cond"], 16, SamplingConfig(guidance=4.0), torch.Generator().manual_seed(0))
    assert out.tokens.shape == (2, 16)


# --- official attention: the official decode loop's math SDPA backend -------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("masked", [True, False])
def test_math_attention_is_sdpa_under_the_math_backend_bit_for_bit(dtype, masked):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from mmgen.image_ar.llamagen.gpt import additive_mask, attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g).to(dtype) for n in (5, 40, 40))
    mask = None
    if masked:  # a cache's mask: each row sees its own prefix, the rest is stale or unused
        positions = torch.tensor([[20], [31]]) + torch.arange(5)
        mask = (torch.arange(40)[None, None] <= positions[:, :, None])[:, None]
    else:
        k, v = k[:, :, :5], v[:, :, :5]  # causal self-attention of a teacher-forced pass
    with sdpa_kernel(SDPBackend.MATH):
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    assert torch.equal(attention(q, k, v, mask, backend="math"), reference)
    if masked:  # what forward_hidden hands every layer: the mask converted once per forward
        assert torch.equal(attention(q, k, v, additive_mask(mask, dtype), backend="math"), reference)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        attention(q, k, v, mask, backend="flash")


def _half_model(reference, dtype=torch.bfloat16):
    model = LlamaGenTransformer(reference[0].config).eval()
    model.load_state_dict(reference[0].state_dict())
    return model.to(dtype)


class _MathContextTokenModel(LlamaGenTokenModel):
    """The reference: every decoding forward inside `sdpa_kernel(SDPBackend.MATH)`, as the
    official `decode_n_tokens` does; the prefix (`start`) on the default backend."""

    def forward(self, state, tokens):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return super().forward(state, tokens)


@pytest.mark.parametrize("decoder", [Autoregressive(), SpeculativeJacobi(window=5)])
def test_official_attention_equals_an_explicit_math_backend_run_in_bfloat16(reference, decoder):
    model, t = _half_model(reference), reference[1]
    sampling = SamplingConfig(temperature=0.0, guidance=IntervalGuidance(4.0, -1))
    run = lambda tm: decoder.generate(tm, t["input.cond"], 16, sampling, torch.Generator().manual_seed(0)).tokens
    expected = run(_MathContextTokenModel(model, official_attention=False))
    assert torch.equal(run(LlamaGenTokenModel(model)), expected)  # bf16: on by default
    assert torch.equal(run(LlamaGenTokenModel(model, official_attention=True)), expected)


def test_official_attention_picks_the_backend_of_decoding_forwards_only(reference, monkeypatch):
    from mmgen.image_ar.llamagen import gpt

    used = []
    real = gpt.attention
    monkeypatch.setattr(gpt, "attention", lambda *a, **kw: used.append(a[5]) or real(*a, **kw))
    cond = reference[1]["input.cond"]

    def backends(model, **kw):
        used.clear()
        tm = LlamaGenTokenModel(model, **kw)
        state = tm.start(cond, 4, guidance=True)
        start = set(used)
        used.clear()
        tm.forward(state, torch.zeros(2, 3, dtype=torch.long))
        return start, set(used), tm.decode_attention

    fp32, bf16, fp16 = reference[0], _half_model(reference), _half_model(reference, torch.float16)
    assert backends(fp32) == ({"default"}, {"default"}, "default")  # float32 output unchanged
    assert backends(bf16) == ({"default"}, {"math"}, "math")  # the prefix, as officially, on the default
    assert backends(fp16) == ({"default"}, {"math"}, "math")
    assert backends(bf16, official_attention=False) == ({"default"}, {"default"}, "default")
    assert backends(fp32, official_attention=True) == ({"default"}, {"math"}, "math")
    with pytest.raises(ValueError, match="official_attention must be True, False or None"):
        LlamaGenTokenModel(fp32, official_attention="math")
    with pytest.raises(ValueError, match="unknown attention backend"):
        fp32.forward_hidden(torch.zeros(1, 1, 64), torch.zeros(1, 1, dtype=torch.long), attention_backend="fast")
