"""LlamaGen text-to-image: official numerics (tests/fixtures/llamagen_t2i_reference.*), lossless
decoding with masked captions, and the pipeline with a tiny random T5 built offline."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import T5Config, T5EncoderModel, T5Tokenizer

from mmgen.decoding import Autoregressive, SpeculativeJacobi
from mmgen.hub import CheckpointError, load_strict
from mmgen.image_ar.llamagen import (
    CaptionConditions,
    LlamaGenConfig,
    LlamaGenPipeline,
    LlamaGenText2ImagePipeline,
    LlamaGenTokenModel,
    LlamaGenTransformer,
)
from mmgen.sampling import IntervalGuidance, SamplingConfig

from tests.conftest import tiny_transformer, tiny_vq

FIXTURES = Path(__file__).parents[1] / "fixtures"
WORDS = "a the cat dog red blue green photo of on in with and sky tree house small big".split()


# ------------------------------------------------------------------------------ official fixture
@pytest.fixture(scope="module")
def reference():
    tensors = load_file(str(FIXTURES / "llamagen_t2i_reference.safetensors"))
    args = json.loads((FIXTURES / "llamagen_t2i_reference.json").read_text())["gpt"]["official_model_args"]
    model = LlamaGenTransformer(LlamaGenConfig(**args)).eval()
    load_strict(model, {k[4:]: v.float() for k, v in tensors.items() if k.startswith("gpt.")})
    captions = CaptionConditions(tensors["input.caption"], tensors["input.caption_mask"])
    return LlamaGenTokenModel(model), captions, tensors


def teacher_forced_logits(tm: LlamaGenTokenModel, captions, tokens: torch.Tensor) -> torch.Tensor:
    """[cond rows; uncond rows] x (prefill + one cached step per token), the fixture's layout."""
    state = tm.start(captions, tokens.shape[1] + 4, guidance=True)
    rest = tm.forward(state, tokens[:, :-1])
    cond = torch.cat([state.first_logits.cond, rest.cond], 1)
    return torch.cat([cond, torch.cat([state.first_logits.uncond, rest.uncond], 1)])


def test_left_padding_equals_official_sample_t2i(reference):
    _, captions, t = reference
    ours = CaptionConditions.left_padded(t["input.t5_embeddings"], t["input.t5_mask"])
    assert torch.equal(ours.embeddings, t["input.caption"])
    assert torch.equal(ours.mask, t["input.caption_mask"].bool())
    assert ours.mask.sum(1).tolist() == [7, 45]


def test_logits_equal_the_official_cached_path(reference):
    tm, captions, t = reference
    ours = teacher_forced_logits(tm, captions, t["input.tokens"])
    # Error source: float32 matmuls and attention (BLAS/SDPA kernels, thread count, CPU) with
    # errors relative to the logits' scale, not to each logit. Measured: <= 3.2e-7 of
    # max |logit| (14.9) under OMP_NUM_THREADS=1/2/4, ATEN_CPU_CAPABILITY=default/avx2,
    # MKL_ENABLE_INSTRUCTIONS=SSE4_2, MKL_CBWR=COMPATIBLE; 1e-5 of it leaves > 30x (the former
    # elementwise rtol=atol=1e-5 was used to 1/4 under MKL_CBWR=COMPATIBLE).
    scale = max(1.0, t["output.logits"].abs().max().item())
    torch.testing.assert_close(ours, t["output.logits"], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "key,scale,interval",
    [("output.greedy_cfg", 7.5, -1), ("output.greedy_cfg_interval3", 7.5, 3), ("output.greedy_nocfg", 1.0, -1)],
)
@pytest.mark.parametrize("decoder", [Autoregressive(), SpeculativeJacobi(window=5)], ids=["ar", "sjd"])
def test_greedy_generation_equals_official_generate(reference, key, scale, interval, decoder):
    tm, captions, t = reference
    sampling = SamplingConfig(top_k=1, guidance=IntervalGuidance(scale, interval))
    out = decoder.generate(tm, captions, 16, sampling, torch.Generator().manual_seed(0))
    assert torch.equal(out.tokens, t[key])


@torch.no_grad()
def test_padding_is_hidden_from_every_query_but_its_own(reference):
    tm, captions, t = reference
    tokens = t["input.tokens"]
    expected = teacher_forced_logits(tm, captions, tokens)
    # Garbage at the padded rows changes nothing (they are masked keys of both CFG halves)...
    noisy = captions.embeddings + 5 * torch.randn(captions.embeddings.shape, generator=torch.Generator().manual_seed(1)) * ~captions.mask[..., None]
    torch.testing.assert_close(teacher_forced_logits(tm, CaptionConditions(noisy, captions.mask), tokens), expected, rtol=0, atol=1e-6)
    # ... while unmasking them does: the fixture depends on the mask.
    unmasked = CaptionConditions(captions.embeddings, torch.ones_like(captions.mask))
    assert (teacher_forced_logits(tm, unmasked, tokens) - expected).abs().max() > 1e-2
    # Padded query rows see their own key only: every prefix position stays finite (no NaN).
    model = tm.transformer
    cache = model.setup_cache(2, 130)
    cache.key_padding[:, :120] = ~captions.mask
    prefix = model.forward_hidden(model.embed_conditions(captions.embeddings), cache.positions(120), cache)
    assert torch.isfinite(prefix).all()


def test_conditions_of_the_wrong_kind_are_rejected(reference):
    tm, captions, _ = reference
    with pytest.raises(ValueError, match=r"caption features \[B, 120, 32\], got \(2, 10, 32\)"):
        tm.start(torch.zeros(2, 10, 32), 20, guidance=True)
    with pytest.raises(ValueError, match="class-conditional: it takes class ids"):
        LlamaGenTokenModel(tiny_transformer()).start(captions, 20, guidance=True)


# ------------------------------------------------------------------------------ tiny pipeline
def tiny_tokenizer() -> T5Tokenizer:
    """A real T5Tokenizer (Unigram) built in memory from a word list: no download, no sentencepiece."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0 - i / 100) for i, w in enumerate(WORDS)]
    pieces += [(c, -10.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_t2i_pipeline(seed: int = 0) -> LlamaGenText2ImagePipeline:
    """A 4x4-token, 8-pixel text-conditional pipeline with a 2-layer random T5 encoder."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    encoder = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, dropout_rate=0.0)
    ).eval()
    transformer = tiny_transformer(block_size=16, model_type="t2i", caption_dim=32, cls_token_num=120, seed=seed)
    pipe = LlamaGenText2ImagePipeline(transformer, tiny_vq(seed=seed), encoder, tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return tiny_t2i_pipeline()


PROMPTS = ["A red cat", "a small green house with a big tree on the blue sky"]


def test_prompts_are_encoded_as_left_padded_captions(pipe):
    captions = pipe.encode_prompt(PROMPTS)
    assert captions.embeddings.shape == (2, 120, 32) and captions.mask.shape == (2, 120)
    lengths = captions.mask.sum(1).tolist()
    assert lengths == [4, 13]  # words + </s>; "A" is lower-cased like the official cleaning
    for row, n in enumerate(lengths):
        assert captions.mask[row, -n:].all() and not captions.mask[row, :-n].any()
        assert torch.count_nonzero(captions.embeddings[row, :-n]) == 0
    # The valid rows are the encoder's own output for the unpadded caption.
    ids = pipe.tokenizer(["a red cat"], return_tensors="pt")["input_ids"]
    alone = pipe.text_encoder(input_ids=ids).last_hidden_state[0]
    torch.testing.assert_close(captions.embeddings[0, -4:], alone, rtol=1e-5, atol=1e-5)


def test_generates_images_tokens_and_stats(pipe):
    out = pipe(PROMPTS, generator=torch.Generator().manual_seed(0))
    assert len(out.images) == 2 and out.images[0].size == (pipe.image_size, pipe.image_size) == (8, 8)
    assert out.tokens.shape == (2, 16) and out.tokens.max() < 32
    assert out.stats.forwards <= 16 and out.stats.rows == 2
    assert pipe.token_model().codebook().shape == (32, 8)  # the VQ codebook, for relaxed acceptance
    pt = pipe(PROMPTS[0], generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert pt.shape == (1, 3, 8, 8) and 0 <= pt.min() and pt.max() <= 1


def test_defaults_are_the_official_t2i_sampler(pipe):
    assert pipe.sampling_defaults == {"guidance_scale": 7.5, "cfg_interval": -1, "temperature": 1.0, "top_k": 1000, "top_p": 1.0}


def test_greedy_sjd_equals_ar_batch_1_and_2(pipe):
    run = lambda prompts, decoding: pipe(prompts, decoding=decoding, top_k=1, generator=torch.Generator().manual_seed(0),
                                         output_type="pt").tokens  # CFG 7.5, the official default
    batch_ar = run(PROMPTS, Autoregressive())
    assert torch.equal(run(PROMPTS, SpeculativeJacobi(window=6)), batch_ar)
    for row, prompt in enumerate(PROMPTS):  # each row as if decoded alone: the other's padding does not leak
        assert torch.equal(run([prompt], SpeculativeJacobi(window=4)), batch_ar[row : row + 1])


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "t2i", dtypes={"vq": torch.float16})
    names = sorted(p.name for p in (tmp_path / "t2i").iterdir())
    assert names == ["model_index.json", "text_encoder", "tokenizer", "transformer", "vq"]
    loaded = LlamaGenText2ImagePipeline.from_pretrained(tmp_path / "t2i")
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded.tokenizer) is type(pipe.tokenizer) and loaded.tokenizer.get_vocab() == pipe.tokenizer.get_vocab()
    for name, tensor in pipe.text_encoder.state_dict().items():
        assert torch.equal(loaded.text_encoder.state_dict()[name], tensor)
    a = pipe(PROMPTS, generator=torch.Generator().manual_seed(5), output_type="np")
    b = loaded(PROMPTS, generator=torch.Generator().manual_seed(5), output_type="np")
    assert torch.equal(a.tokens, b.tokens)

    # A second pipeline (a draft, say) ships no copy of the text encoder and tokenizer.
    shared = {"text_encoder": "../t2i/text_encoder", "tokenizer": "../t2i/tokenizer", "vq": "../t2i/vq"}
    pipe.save_pretrained(tmp_path / "draft", shared=shared)
    assert sorted(p.name for p in (tmp_path / "draft").iterdir()) == ["model_index.json", "transformer"]
    draft = LlamaGenText2ImagePipeline.from_pretrained(tmp_path / "draft")
    assert draft.tokenizer.get_vocab() == pipe.tokenizer.get_vocab()
    with pytest.raises(ValueError, match="saves itself through its own save_pretrained"):
        pipe.save_pretrained(tmp_path / "bad", dtypes={"text_encoder": torch.float16})
    with pytest.raises(CheckpointError, match="holds a .LlamaGenText2ImagePipeline., not a LlamaGenPipeline"):
        LlamaGenPipeline.from_pretrained(tmp_path / "t2i")


def test_official_checkpoints_load_strictly(pipe, tmp_path):
    torch.save({"model": {**pipe.transformer.state_dict(), "freqs_cis": torch.zeros(3)}}, tmp_path / "t2i.pt")
    torch.save({"model": pipe.vq.state_dict()}, tmp_path / "vq.pt")
    pipe.text_encoder.save_pretrained(tmp_path / "t5")
    pipe.tokenizer.save_pretrained(tmp_path / "t5")
    load = lambda gpt: LlamaGenText2ImagePipeline.from_official(
        tmp_path / gpt, tmp_path / "vq.pt", tmp_path / "t5", gpt_model=pipe.transformer.config, vq_model=pipe.vq.config
    )
    loaded = load("t2i.pt")
    for name, tensor in pipe.transformer.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[name], tensor)
    assert loaded.tokenizer.get_vocab() == pipe.tokenizer.get_vocab()

    broken = dict(pipe.transformer.state_dict())
    broken.pop("cls_embedding.uncond_embedding")
    torch.save(broken, tmp_path / "broken.pt")
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): cls_embedding.uncond_embedding"):
        load("broken.pt")
    with pytest.raises(OSError):  # tests are offline: a repo id cannot be fetched
        LlamaGenText2ImagePipeline.from_official(
            tmp_path / "t2i.pt", tmp_path / "vq.pt", "some-org/no-such-t5", gpt_model=pipe.transformer.config, vq_model=pipe.vq.config
        )


def test_official_layout_of_the_gpt_xl_t2i_preset():
    with torch.device("meta"):
        config = LlamaGenConfig.from_preset("GPT-XL", vocab_size=16384, block_size=32 * 32, model_type="t2i", cls_token_num=120)
        model = LlamaGenTransformer(config)
    assert model.cls_embedding.uncond_embedding.shape == (120, 2048)
    assert model.cls_embedding.cap_proj.fc1.weight.shape == (1280, 2048)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompt=""), "empty prompt"),
        (dict(prompt=["a cat", "   "]), "empty prompt"),
        (dict(prompt=[]), "prompt is an empty list"),
        (dict(prompt=["a cat", 3]), "invalid prompt 3: every prompt must be a string"),
        (dict(prompt=7), "prompt must be a string or a list of strings"),
        (dict(prompt="a cat", image_size=16), "image_size 16 is not supported"),
        (dict(prompt="a cat", image_size=0), "image_size must be a positive integer"),
        (dict(prompt="a cat", output_type="jpeg"), "output_type"),
        (dict(prompt="a cat", guidance_scale=-1.0), "guidance scale"),
        (dict(prompt="a cat", decoding="beam"), "unknown decoding"),
    ],
)
def test_bad_input_is_a_value_error(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipe(**kwargs)


def test_generator_on_another_device_is_a_value_error(pipe):
    with pytest.raises(ValueError, match="generator is on cuda but the pipeline runs on cpu"):
        pipe("a cat", generator=SimpleNamespace(device=torch.device("cuda")))


def test_mismatched_components_are_rejected(pipe):
    with pytest.raises(ValueError, match="text-conditional; this transformer is class-conditional"):
        LlamaGenText2ImagePipeline(tiny_transformer(block_size=16), pipe.vq, pipe.text_encoder, pipe.tokenizer)
    wide = tiny_transformer(block_size=16, model_type="t2i", caption_dim=48, cls_token_num=120)
    with pytest.raises(ValueError, match="text encoder width 32 != transformer caption_dim 48"):
        LlamaGenText2ImagePipeline(wide, pipe.vq, pipe.text_encoder, pipe.tokenizer)
    with pytest.raises(ValueError, match="class-conditional; this transformer is text-conditional"):
        LlamaGenPipeline(pipe.transformer, pipe.vq)
