"""Janus-Pro through transformers on the shared core, checked against transformers itself.

Tiny random `JanusConfig`s only (no downloads): greedy decoding through mmgen is
token-identical to `JanusForConditionalGeneration.generate(generation_mode="image")`, every
decoder agrees with autoregressive decoding, cached logits after uneven per-row commits equal
a fresh no-cache forward, and the pipeline runs end to end with an in-memory processor.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mmgen.decoding import Autoregressive, SpeculativeJacobi
from mmgen.decoding.window import TOKEN_COST, AdaptiveWindow
from mmgen.image_ar.janus import DEFAULT_REPO, JanusConditions, JanusPipeline, JanusTokenModel
from mmgen.modeling import TokenModel, token_table
from mmgen.sampling import ConstantGuidance, SamplingConfig

from transformers import GenerationConfig, JanusConfig, JanusForConditionalGeneration, LlamaConfig, LogitsProcessorList
from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig

PAD, BOS, EOS, BOI = 0, 1, 2, 4
WORDS = ["<pad>", "<bos>", "<eos>", "<image_placeholder>", "<begin_of_image>", "<end_of_image>", "<|User|>", "<|Assistant|>",
         ":", "<unk>", "a", "red", "cat", "dog", "on", "the", "mat", "blue", "sky", "under", "green", "tree"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|User|>: {{ m['content'][0]['text'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|>:{% endif %}"
)


def tiny_janus(seed=0, std=0.1, head_std=0.3, grid=4) -> JanusForConditionalGeneration:
    """A 2-layer, 64-wide Janus: grid x grid image tokens, decoded to 2·grid px by a 2-level VQ.

    transformers' init (std 0.02) makes nearly constant images; wider weights give varied
    tokens, and `std` tunes how predictable they are (speculative acceptance needs some).
    """
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    vision = JanusVisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8 * grid, patch_size=8,
                               projection_dim=64, num_image_tokens=grid * grid, depth=1)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=48, base_channels=32, channel_multiplier=[1, 2], num_res_blocks=1,
                          latent_channels=32, projection_dim=64, image_token_embed_dim=64, num_hidden_layers=2)
    model = JanusForConditionalGeneration(JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=3)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not name.startswith(("model.vqmodel", "model.vision_model")):
                p.normal_(0, head_std if "generation_head" in name else std)
    # What the converted checkpoints carry (the boi id where `generate` reads it).
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = BOS
    model.generation_config.generation_kwargs = {"boi_token_id": BOI}
    return model


def tiny_processor(grid=4):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import JanusImageProcessor, JanusProcessor, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    backend.add_special_tokens(["<|User|>", "<|Assistant|>"])  # split out of "<|User|>:" like the real tokenizer
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"},
    )
    images = JanusImageProcessor(size={"height": 8 * grid, "width": 8 * grid}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return JanusProcessor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE, num_image_tokens=grid * grid)


# Two prompts of different lengths, left-padded as JanusProcessor pads them, ending with BOI.
IDS = torch.tensor([[PAD, PAD, PAD, BOS, 6, 8, 10, 11, 12, 7, 8, BOI], [BOS, 6, 8, 17, 18, 19, 10, 20, 21, 7, 8, BOI]])
MASK = (IDS != PAD).long()


def conditions(rows):
    ids, mask = IDS[rows], MASK[rows]
    keep = mask.bool().any(0)  # drop columns that are padding in every chosen row
    return JanusConditions(ids[:, keep], mask[:, keep])


class RecordScores:
    """A logits processor that records the raw [2B, V] generation-head scores of each step;
    `generate` applies its CFG processor after the user's processors."""

    def __init__(self):
        self.scores = []

    def __call__(self, input_ids, scores):
        self.scores.append(scores.clone())
        return scores


def transformers_greedy(model, cond: JanusConditions, scale: float, record=None) -> torch.Tensor:
    config = GenerationConfig(do_sample=False, guidance_scale=scale, pad_token_id=PAD, bos_token_id=BOS,
                              generation_kwargs={"boi_token_id": BOI})
    processors = LogitsProcessorList([record] if record is not None else [])
    return model.generate(cond.input_ids, attention_mask=cond.attention_mask, generation_mode="image",
                          generation_config=config, logits_processor=processors)


class RecordLogits:
    """Wraps a TokenModel and keeps every `Logits` it returns."""

    def __init__(self, model):
        self.model, self.vocab_size, self.logits = model, model.vocab_size, []

    def start(self, *args):
        state = self.model.start(*args)
        self.logits.append(state.first_logits)
        return state

    def forward(self, state, tokens):
        self.logits.append(self.model.forward(state, tokens))
        return self.logits[-1]

    def commit(self, state, accepted):
        self.model.commit(state, accepted)

    def rewind(self, state, num_generated):
        self.model.rewind(state, num_generated)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: one intra-op thread is as fast, and does not thrash when other
    processes share the cores (measured 7 s vs 53 s for this module under a load of 6 on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_janus()


# ------------------------------------------------------------------ against transformers


@pytest.mark.parametrize("rows, scale", [([0], 5.0), ([1], 5.0), ([0, 1], 5.0), ([0, 1], 3.0)])
def test_greedy_ar_is_token_identical_to_transformers_generate(model, rows, scale):
    """transformers: greedy `generate(generation_mode="image")` (do_sample=False: argmax of its
    ClassifierFreeGuidanceLogitsProcessor output); mmgen: Autoregressive at temperature 0.
    Tokens are identical, and so are the raw cond/uncond logits of every step up to float32
    rounding (transformers uses a static cache and a one-position head call; measured <= 7e-6)."""
    cond, record = conditions(rows), RecordScores()
    expected = transformers_greedy(model, cond, scale, record)
    sampling = SamplingConfig(temperature=0, guidance=ConstantGuidance(scale))
    ours = RecordLogits(JanusTokenModel(model))
    tokens = Autoregressive().generate(ours, cond, 16, sampling, torch.Generator().manual_seed(0)).tokens
    assert torch.equal(tokens, expected)
    assert len(expected[0].unique()) > 4  # varied output, so the comparison means something
    steps = torch.stack([torch.cat([l.cond[:, 0], l.uncond[:, 0]]) for l in ours.logits])
    torch.testing.assert_close(steps, torch.stack(record.scores), atol=2e-5, rtol=1e-5)


def test_unconditional_rows_are_built_as_transformers_builds_them(model):
    tm = JanusTokenModel(model)
    uncond = tm.unconditional_ids(IDS)
    # transformers: every token that is neither BOS nor BOI becomes the pad token; mask unchanged.
    expected = IDS.masked_fill((IDS != BOS) & (IDS != BOI), PAD)
    assert torch.equal(uncond, expected)
    state = tm.start(conditions([0, 1]), 8, guidance=True)
    assert state.batch_size == 2 and torch.equal(state.cache.mask, torch.cat([MASK, MASK]).bool())


# ------------------------------------------------------------------ every decoder on Janus


GREEDY_CFG4 = SamplingConfig(temperature=0, guidance=ConstantGuidance(4.0))


@pytest.fixture(scope="module")
def predictable():
    """An 8x8-token model predictable enough that drafts get accepted, and its greedy AR output."""
    model = tiny_janus(seed=1, std=0.05, grid=8)
    ar = Autoregressive().generate(JanusTokenModel(model), conditions([0, 1]), 64, GREEDY_CFG4, torch.Generator().manual_seed(0))
    return model, ar.tokens


@pytest.mark.parametrize("rows, compact_ratio", [([0], 1.0), ([0, 1], 1.0), ([0, 1], 0.0)])
@pytest.mark.parametrize("window", [4, 16])
def test_greedy_sjd_is_token_identical_to_ar(predictable, rows, compact_ratio, window):
    model, ar_batch = predictable
    tm, cond = JanusTokenModel(model, compact_ratio=compact_ratio), conditions(rows)
    assert isinstance(tm, TokenModel)
    if rows == [0]:  # batch 1 gets its own AR reference (left padding in the pair shifts rounding)
        ar = Autoregressive().generate(tm, cond, 64, GREEDY_CFG4, torch.Generator().manual_seed(0)).tokens
    else:
        ar = ar_batch
    # The linear CPU cost: at the default curve's dear drafts a 64-token decode is mostly AR steps.
    sjd = SpeculativeJacobi(window=window, adapt=AdaptiveWindow(token_cost=TOKEN_COST["cpu"])).generate(
        tm, cond, 64, GREEDY_CFG4, torch.Generator().manual_seed(1))
    assert torch.equal(ar, sjd.tokens)
    assert sjd.stats.forwards < 64 and sum(sjd.stats.accepted_histogram[2:]) > 0  # multi-token accepts happened


def _full_forward(model, tm, cond, guidance, committed, window):
    """No cache: each row's logical sequence (prompt, committed tokens, window) in one forward."""
    ids, mask = cond.input_ids, cond.attention_mask
    if guidance:
        ids, mask = torch.cat([ids, tm.unconditional_ids(ids)]), torch.cat([mask, mask])
    rows = []
    for r in range(ids.shape[0]):
        tokens = torch.cat([committed[r], window[r]])[None]
        embeds = torch.cat([model.get_input_embeddings()(ids[r : r + 1]), model.prepare_embeddings_for_image_generation(tokens)], 1)
        full_mask = torch.cat([mask[r : r + 1], torch.ones_like(tokens)], 1)
        hidden = model.model.language_model(inputs_embeds=embeds, attention_mask=full_mask, use_cache=False).last_hidden_state
        rows.append(model.model.generation_head(hidden[:, -window.shape[1] :]).float())
    return torch.cat(rows)


@pytest.mark.parametrize("rows", [[0], [0, 1]])
@pytest.mark.parametrize("guidance", [False, True])
@pytest.mark.parametrize("compact_ratio", [None, 0.0])  # holes kept / squeezed out at every commit
@torch.no_grad()
def test_cached_logits_after_uneven_commits_equal_a_fresh_forward(model, rows, guidance, compact_ratio):
    tm, cond = JanusTokenModel(model, compact_ratio=compact_ratio), conditions(rows)
    B, n, V = len(rows), 4, tm.vocab_size
    state = tm.start(cond, 64, guidance)
    gen = torch.Generator().manual_seed(0)
    committed = [torch.empty(0, dtype=torch.long) for _ in range(B)]
    plan = [[3, 0], [1, 4], [0, 2], [4, 1], "rewind", [2, 3], [0, 0], [1, 4]]
    for step in plan:
        if step == "rewind":  # drop a draft model's rejected tokens: keep 2 and 5
            keep = torch.tensor([2, 5][:B])
            tm.rewind(state, keep)
            committed = [c[: int(k)] for c, k in zip(committed, keep)]
            continue
        window = torch.randint(0, V, (B, n), generator=gen)
        accepted = torch.tensor(step[:B])
        tm.forward(state, window)
        tm.commit(state, accepted)
        committed = [torch.cat([c, w[: int(a)]]) for c, w, a in zip(committed, window, accepted)]
    window = torch.randint(0, V, (B, n), generator=gen)
    cached = tm.forward(state, window)
    full = _full_forward(model, tm, cond, guidance, committed + committed if guidance else committed, window.repeat(2 if guidance else 1, 1))
    cached_all = torch.cat([cached.cond, cached.uncond]) if guidance else cached.cond
    torch.testing.assert_close(cached_all, full, atol=2e-5, rtol=1e-5)  # measured: <= 8e-6 on logits ~10

    generated = state.cache.mask[:, cond.input_ids.shape[1] : -n]
    longest = cond.input_ids.shape[1] + max(len(c) for c in committed)
    if B == 1:  # batch 1: rollback is exactly a crop, no holes
        assert bool(generated.all()) and state.cache.length == longest + n
    elif compact_ratio is None:  # the shorter rows carry masked holes
        assert not bool(generated.all()) and state.cache.length > longest + n
    else:  # compacted: the cache holds just what the longest row needs
        assert state.cache.length == longest + n
        assert generated.sum(1).tolist() == [len(c) for c in (committed + committed if guidance else committed)]


def test_token_tables(model):
    tm = JanusTokenModel(model)
    emb, book = token_table(tm, "token_embeddings"), token_table(tm, "codebook")
    assert emb.shape == (48, 64) and book.shape == (48, 8)
    ids = torch.tensor([5, 0, 47])
    with torch.no_grad():
        torch.testing.assert_close(emb[ids], model.prepare_embeddings_for_image_generation(ids))
    torch.testing.assert_close(book.norm(dim=-1), torch.ones(48))


def test_prompt_must_end_with_image_start(model):
    with pytest.raises(ValueError, match="image-start token"):
        JanusTokenModel(model).start(JanusConditions(IDS[:, :-1], MASK[:, :-1]), 8, True)


# ------------------------------------------------------------------ pipeline


@pytest.fixture(scope="module")
def pipe():
    pipe = JanusPipeline(tiny_janus(), tiny_processor())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_pipeline_end_to_end(pipe):
    out = pipe(["a red cat", "the blue sky under a green tree"], generator=torch.Generator().manual_seed(0))
    assert len(out.images) == 2 and all(isinstance(i, Image.Image) and i.size == (8, 8) for i in out.images)
    assert out.tokens.shape == (2, 16) and out.stats.rows == 2
    pil = pipe("a red cat", generator=torch.Generator().manual_seed(1)).images
    arr = pipe("a red cat", output_type="np", generator=torch.Generator().manual_seed(1)).images
    assert arr.shape == (1, 8, 8, 3) and arr.dtype == np.uint8
    assert np.array_equal(np.asarray(pil[0]), arr[0])  # same seed, same image
    pt = pipe("a red cat", output_type="pt", generator=torch.Generator().manual_seed(1)).images
    assert pt.shape == (1, 3, 8, 8) and 0 <= float(pt.min()) and float(pt.max()) <= 1


def test_pipeline_formats_prompts_like_transformers_and_matches_its_greedy_output(pipe):
    prompts = ["a red cat", "the blue sky under a green tree"]
    cond = pipe.encode_prompt(prompts)
    # The transformers example: chat template with the generation prompt, then generation_mode="image".
    texts = [pipe.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}], add_generation_prompt=True)
             for p in prompts]
    assert texts[0] == "<|User|>: a red cat\n\n<|Assistant|>:"
    ref = pipe.processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    assert torch.equal(cond.input_ids, ref["input_ids"]) and torch.equal(cond.attention_mask, ref["attention_mask"])
    assert cond.input_ids[0, 0] == PAD and (cond.input_ids[:, -1] == BOI).all() and 9 not in cond.input_ids  # no <unk>
    ours = pipe(prompts, decoding="ar", temperature=0, output_type="pt").tokens
    assert torch.equal(ours, transformers_greedy(pipe.model, cond, 5.0))
    sjd = pipe(prompts, decoding=SpeculativeJacobi(window=4), temperature=0, output_type="pt").tokens
    assert torch.equal(ours, sjd)


def test_pipeline_decodes_with_the_models_vq(pipe):
    tokens = torch.randint(0, 48, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pixels = pipe.model.decode_image_tokens(tokens)  # NHWC in [-1, 1]
    expected = ((pixels.clamp(-1, 1) + 1) / 2).permute(0, 3, 1, 2)
    torch.testing.assert_close(pipe.decode_tokens(tokens, "pt"), expected)


def test_pipeline_defaults_are_the_official_sampler(pipe):
    import inspect

    params = inspect.signature(JanusPipeline.__call__).parameters
    assert params["guidance_scale"].default == 5.0 and params["temperature"].default == 1.0
    assert params["top_k"].default in (None, 0) and params["top_p"].default == 1.0 and params["decoding"].default == "sjd"
    assert DEFAULT_REPO == "deepseek-community/Janus-Pro-1B"
    # transformers' default configs are Janus-Pro 1B's: 576 tokens (24 x 24), a 16x VQ decoder, 384 px.
    vision, vq = JanusVisionConfig(), JanusVQVAEConfig()
    assert vision.num_image_tokens == 576 == (vision.image_size // vision.patch_size) ** 2
    assert vision.image_size // vision.patch_size * 2 ** (len(vq.channel_multiplier) - 1) == 384
    assert pipe.image_size == 8 and pipe.num_image_tokens == 16


@pytest.mark.parametrize(
    "prompt, error, match",
    [("", ValueError, "empty prompt"), ("   ", ValueError, "empty prompt"), ([], ValueError, "empty list"),
     (["a cat", 3], ValueError, "must be a string"), (7, ValueError, "string or a list")],
)
def test_pipeline_rejects_bad_prompts(pipe, prompt, error, match):
    with pytest.raises(error, match=match):
        pipe(prompt)


def test_generator_on_another_device_is_a_value_error(pipe):
    with pytest.raises(ValueError, match="generator is on cuda but the pipeline runs on cpu"):
        pipe("a cat", generator=SimpleNamespace(device=torch.device("cuda")))


def test_save_and_load_roundtrip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    loaded = JanusPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    a = pipe("a red cat", decoding="ar", temperature=0, output_type="np").images
    b = loaded("a red cat", decoding="ar", temperature=0, output_type="np").images
    assert np.array_equal(a, b)


def test_from_pretrained_offline_is_a_clear_error():
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set"):
        JanusPipeline.from_pretrained("nobody-here/not-a-janus-repo")
