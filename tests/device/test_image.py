"""Image families on the device: LlamaGen (c2i, t2i) and Janus-Pro token decoders, VAR and MAR.

Official numerics (the LlamaGen and VAR reference fixtures, Janus against transformers'
`generate`) in float32; every lossless decoder greedy-identical to AR with CFG in float32 and
bfloat16 (`parity.assert_greedy_identical` says what bfloat16 allows); sampled decodes
reproduced by their seed.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mmgen.decoding import Autoregressive, Collaborative, SpeculativeJacobi
from mmgen.image_ar.janus import JanusConditions, JanusTokenModel
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import ConstantGuidance, IntervalGuidance, SamplingConfig, make_generator

from tests.conftest import tiny_pipeline
from tests.device.parity import DTYPES, assert_greedy_identical
from tests.image_ar.test_decoding_on_pipelines import LOSSLESS, LOSSY, decoder
from tests.image_ar.test_janus import conditions as janus_conditions
from tests.image_ar.test_janus import tiny_janus, tiny_processor, transformers_greedy
from tests.image_ar.test_llamagen_gpt import reference  # noqa: F401 - the official LlamaGen fixture
from tests.image_ar.test_llamagen_t2i import tiny_t2i_pipeline
from tests.image_ar.test_var_pipeline import tiny_transformer as tiny_var, tiny_vqvae
from tests.image_ar.test_var_transformer import cached_logits
from tests.image_ar.test_var_transformer import reference as var_reference  # noqa: F401 - the official VAR fixture

pytestmark = pytest.mark.device

GREEDY = SamplingConfig(temperature=0.0, guidance=ConstantGuidance(3.0))
SAMPLED = SamplingConfig(temperature=1.0, guidance=ConstantGuidance(3.0))


def on(device, tensors: dict) -> dict:
    return {k: v.to(device) for k, v in tensors.items()}


# --------------------------------------------------------------------------------------------
# Official numerics, float32
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def test_llamagen_equals_the_official_reference(device, reference):  # noqa: F811
    """The official LlamaGen's cached logits (tests/fixtures, made on a CPU) and its greedy
    CFG-4 tokens, by AR and by SJD."""
    model, t = copy.deepcopy(reference[0]).to(device), on(device, reference[1])
    tm = LlamaGenTokenModel(model)
    state = tm.start(t["input.cond"], 20, guidance=True)
    rest = tm.forward(state, t["input.tokens"][:, :-1])
    ours = torch.cat([torch.cat([state.first_logits.cond, rest.cond], 1), torch.cat([state.first_logits.uncond, rest.uncond], 1)])
    scale = max(1.0, t["output.logits"].abs().max().item())
    torch.testing.assert_close(ours, t["output.logits"], rtol=0, atol=1e-5 * scale)  # tests/image_ar/test_llamagen_gpt.py's bound
    for interval, key in ((-1, "output.greedy_cfg4"), (3, "output.greedy_cfg4_interval3")):
        sampling = SamplingConfig(top_k=1, guidance=IntervalGuidance(4.0, interval))
        for dec in (Autoregressive(), SpeculativeJacobi(window=5)):
            out = dec.generate(tm, t["input.cond"], 16, sampling, make_generator(0, device))
            assert torch.equal(out.tokens, t[key]), (key, type(dec).__name__)


@pytest.mark.parametrize("variant", ["plain", "shared"])
@torch.no_grad()
def test_var_cached_decode_equals_the_official_loop(device, var_reference, variant):  # noqa: F811
    models, t = var_reference
    model, c = copy.deepcopy(models[variant]).to(device), models[variant].config
    labels, inputs = t[f"{variant}.input.labels"].to(device), t[f"{variant}.input.inputs"].float().to(device)
    cond = model.condition(torch.cat([labels, torch.full_like(labels, c.num_classes)]))
    logits = cached_logits(model, cond, inputs.repeat(2, 1, 1), [1] * c.num_steps)
    torch.testing.assert_close(logits, t[f"{variant}.output.cached_logits"].to(device), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [[0], [0, 1]])
def test_janus_greedy_equals_transformers_official_generate(device, rows):
    model = tiny_janus().to(device)
    cond = janus_conditions(rows)
    cond = JanusConditions(cond.input_ids.to(device), cond.attention_mask.to(device))
    expected = transformers_greedy(model, cond, 5.0)
    sampling = SamplingConfig(temperature=0, guidance=ConstantGuidance(5.0))
    ours = Autoregressive().generate(JanusTokenModel(model), cond, 16, sampling, make_generator(0, device)).tokens
    assert torch.equal(ours, expected) and len(expected[0].unique()) > 4


# --------------------------------------------------------------------------------------------
# Every decoder on every discrete image family, float32 and bfloat16
# --------------------------------------------------------------------------------------------


def family(kind: str, device, dtype):
    """(pipeline, its token model, the conditions a decode takes, the pipeline's inputs)."""
    if kind == "c2i":
        pipe = tiny_pipeline().to(device, dtype)
        return pipe, pipe.token_model(), torch.tensor([1, 2], device=device), dict(class_labels=[1, 2])
    if kind == "t2i":
        pipe = tiny_t2i_pipeline().to(device, dtype)
        prompts = ["a red cat", "the blue sky"]
        return pipe, pipe.token_model(), pipe.encode_prompt(prompts), dict(prompt=prompts)
    from mmgen.image_ar.janus import JanusPipeline

    pipe = JanusPipeline(tiny_janus(), tiny_processor()).to(device, dtype)
    prompts = ["a red cat", "the blue sky under a green tree"]
    return pipe, pipe.token_model(), pipe.encode_prompt(prompts), dict(prompt=prompts)


@pytest.fixture(scope="module")
def families():
    built = {}
    return lambda kind, device, dtype: built.setdefault((kind, device, dtype), family(kind, device, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["c2i", "t2i", "janus"])
def test_lossless_decoders_equal_ar_under_greedy_cfg(device, families, kind, dtype):
    pipe, model, conditions, _ = families(kind, device, dtype)
    pipe.set_progress_bar_config(disable=True)
    tokens = 16  # every tiny family's 4x4 grid
    ar = Autoregressive().generate(model, conditions, tokens, GREEDY, make_generator(0, device)).tokens
    assert len(ar.unique()) > 3  # varied output, so the comparison means something
    for name in LOSSLESS:
        out = decoder(name, pipe).generate(model, conditions, tokens, GREEDY, make_generator(0, device))
        assert_greedy_identical(model, conditions, GREEDY, ar, out.tokens, dtype, f"{kind} {name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["c2i", "janus"])
def test_sampled_decodes_are_reproduced_by_their_seed(device, families, kind, dtype):
    pipe, _, _, inputs = families(kind, device, dtype)
    pipe.set_progress_bar_config(disable=True)
    for name in ["ar", "sjd"] + LOSSY:
        run = lambda seed: pipe(**inputs, decoding=decoder(name, pipe) if name != "ar" else "ar", guidance_scale=3.0,
                                temperature=1.0, output_type="pt", generator=make_generator(seed, device))
        a, b = run(1), run(1)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.images, b.images), name
        assert torch.isfinite(a.images).all() and a.images.shape[0] == 2


# --------------------------------------------------------------------------------------------
# VAR and MAR
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_var_decodes_are_seeded_and_collaborative_with_itself_is_plain_decoding(device, dtype):
    from mmgen.image_ar.var import VARPipeline

    pipe = VARPipeline(tiny_var(), tiny_vqvae()).to(device, dtype)
    pipe.set_progress_bar_config(disable=True)
    run = lambda decoding, seed=0, temperature=1.0: pipe([0, 5], decoding=decoding, temperature=temperature, top_k=0, top_p=1.0,
                                                         generator=make_generator(seed, device), output_type="pt")
    a = run("ar")
    assert torch.equal(a.tokens, run("ar").tokens) and torch.isfinite(a.images).all()
    if dtype == torch.float32:  # CoDe's small model prefills the large one's scales at once: bf16 rounds that differently
        for temperature in (0.0, 1.0):
            plain = run("ar", temperature=temperature)
            collaborative = run(Collaborative(small=pipe, large_steps=2), temperature=temperature)
            assert torch.equal(collaborative.tokens, plain.tokens), temperature


def test_mar_decodes_are_seeded(device):
    """float32 only: a MARPipeline cast to bfloat16 does not run (its canvas stays float32)."""
    pytest.importorskip("timm", reason="MAR's blocks come from timm (with torchvision), not installed here")
    from mmgen.image_ar.mar.pipeline import MARPipeline
    from tests.image_ar.test_mar_pipeline import tiny_model, tiny_vae

    pipe = MARPipeline(tiny_model(), tiny_vae()).to(device)
    pipe.set_progress_bar_config(disable=True)
    run = lambda: pipe([1, 3], num_iter=4, generator=make_generator(2, device), output_type="pt")
    a, b = run(), run()
    assert torch.equal(a.images, b.images) and torch.isfinite(a.images).all()
