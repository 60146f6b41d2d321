"""Every VLM family mmgen serves, on tiny random models of its own transformers classes
(`tests/vlm/tiny.py`): greedy answers equal the model's own `generate(do_sample=False)` at batch
1 and at batch 3 (prompts of different lengths, images of different sizes: left padding),
through `answer_each` and `serve`, under every lossless decoder (with drafts accepted and
rejected in the run); the logits of every step are the model's own forward's (soft-capping,
sliding windows and hybrid layers included) after rejected drafts were rewound; sampled
answers follow their own seed at any batch; dropping that keeps every token changes nothing.

Weights are drawn with std 0.1, so answers depend on the positions and speculation both
accepts and rejects drafts.
"""

from __future__ import annotations

import pytest
import torch

import mmgen
from mmgen.decoding import make_decoder
from mmgen.sampling import make_generator
from mmgen.vlm import MODEL_TYPES
from mmgen.vlm.pipeline import VLMPipeline

from tests.vlm.tiny import BUILDERS, PROMPTS, WORDS, drafter_for, images

SIZES = [(40, 36), (24, 48), (56, 20)]  # one image per prompt, each of another size
BUDGET = 10


def pictures():
    return images(3, SIZES)


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request):
    """(name, target, drafter): the drafter is a smaller model of the same family and tokenizer,
    sharing the target's weights where they exist."""
    target = BUILDERS[request.param](0, std=0.1)
    return request.param, target, drafter_for(target, BUILDERS[request.param])


def generate(pipe, prompts, imgs, budget=BUDGET):
    """The model's own greedy answer tokens (transformers' `generate`, no end token)."""
    inputs = pipe.prepare_inputs(prompts, imgs)
    out = pipe.model.generate(**inputs, max_new_tokens=budget, do_sample=False, eos_token_id=[],
                              pad_token_id=pipe.pad_token_id)
    return out[:, inputs["input_ids"].shape[1]:]


def speculated(stats) -> bool:
    """Drafts were accepted (a forward finalised 2+ tokens) and rejected (one finalised 1)."""
    histogram = stats.accepted_histogram
    return sum(histogram[2:]) > 0 and histogram[1] > 0


def test_every_family_is_registered(family):
    name, pipe, _ = family
    assert pipe.model.config.model_type in MODEL_TYPES


def test_greedy_equals_generate_alone_batched_and_continuous(family):
    _, pipe, _ = family
    imgs = pictures()
    batch = pipe.prepare_inputs(PROMPTS, imgs)["attention_mask"]
    assert len(set(batch.sum(1).tolist())) == 3  # three prompt lengths: two rows are left-padded
    reference = generate(pipe, PROMPTS, imgs)
    for row in range(3):  # transformers' own answer at batch 1 is its answer at batch 3
        assert torch.equal(generate(pipe, PROMPTS[row], imgs[row])[0], reference[row])
        assert torch.equal(pipe(PROMPTS[row], imgs[row], max_new_tokens=BUDGET, stop_token_ids=[]).token_ids[0], reference[row])
    assert torch.equal(pipe(PROMPTS, imgs, max_new_tokens=BUDGET, stop_token_ids=[]).token_ids, reference)
    gens = [make_generator(k) for k in range(3)]
    each = pipe.answer_each(PROMPTS, imgs, gens, batch_size=2, max_new_tokens=BUDGET, stop_token_ids=[])
    assert torch.equal(each.token_ids, reference)
    gens = [make_generator(k) for k in range(3)]  # the adaptive window, each row its own widths
    each = pipe.answer_each(PROMPTS, imgs, gens, batch_size=2, max_new_tokens=BUDGET, stop_token_ids=[], decoding="sjd:window=4")
    assert torch.equal(each.token_ids, reference)
    server = pipe.serve("ar", batch_size=3, max_new_tokens=BUDGET, stop_token_ids=[])
    futures = [server.submit(PROMPTS[row], imgs[row], make_generator(row)) for row in range(3)]
    assert all(torch.equal(f.result(timeout=120)[1], reference[row]) for row, f in enumerate(futures))


@pytest.mark.parametrize("decoding", ["sjd", "lookup", "draft", "draft-pruned"])
def test_speculative_decoders_equal_generate(family, decoding):
    _, pipe, drafter = family
    imgs = pictures()
    options = {}
    if decoding == "sjd":
        decoder = make_decoder("sjd", window=4, adapt=False, draft_init="left")
    elif decoding == "lookup":
        decoder = make_decoder("lookup", adapt=False)
    else:  # a smaller model of the family drafts with the image, or with it pruned (SpecVLM)
        decoder = make_decoder("draft", drafter=drafter, num_draft=3)
        if decoding == "draft-pruned":
            options["draft_dropping"] = "fastv:layer=0,keep_ratio=0.5"
    out = pipe(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[], decoding=decoder, **options)
    assert torch.equal(out.token_ids, generate(pipe, PROMPTS, imgs, 16))
    assert speculated(out.stats), out.stats.accepted_histogram
    if decoding == "draft-pruned":
        assert sum(out.draft_dropping.kept_tokens) < sum(out.draft_dropping.image_tokens)


def _continued(pipe, prompt, image, tokens: list[int]) -> dict:
    """One row's processor inputs with `tokens` appended as generated text (as `generate` extends
    them: PaliGemma's suffix is causal, type 1; every other token type is text, 0)."""
    inputs = pipe.prepare_inputs(prompt, image)
    n = len(tokens)
    extra = {"input_ids": torch.tensor([tokens]), "attention_mask": torch.ones(1, n, dtype=torch.long),
             "token_type_ids": torch.full((1, n), int(pipe.model.config.model_type == "paligemma")),
             "mm_token_type_ids": torch.zeros(1, n, dtype=torch.long)}
    for key, tail in extra.items():
        if key in inputs:
            inputs[key] = torch.cat([inputs[key], tail.to(inputs[key].dtype)], dim=1)
    return inputs


def test_decode_logits_are_the_models_own_after_rejected_drafts(family):
    """Forwards of several drafted tokens per row, each row keeping another number of them
    (holes in the shared cache), then a rewind: the logits of every kept token are those of the
    model's own forward over the row's whole sequence (prefill and decode alike: soft-capping,
    sliding windows counted in the row's tokens, hybrid local/global layers)."""
    _, pipe, _ = family
    imgs = pictures()
    model = pipe.token_model()
    state = model.start(pipe.prepare_inputs(PROMPTS, imgs), 0, False)
    kept = [[] for _ in PROMPTS]  # committed tokens per row
    logits = [[state.first_logits.cond[row, 0]] for row in range(3)]  # logits predicting each next token
    words = torch.tensor([i for i, w in enumerate(WORDS) if i >= 7])  # plain words, never a special token
    g = torch.Generator().manual_seed(0)
    for width, accepted in [(4, [1, 4, 2]), (3, [3, 0, 2]), (5, [2, 5, 1]), (4, [4, 1, 3])]:
        tokens = words[torch.randint(len(words), (3, width), generator=g)]
        out = model.forward(state, tokens).cond
        for row in range(3):
            kept[row] += tokens[row, : accepted[row]].tolist()
            logits[row] += list(out[row, : accepted[row]])
        model.commit(state, torch.tensor(accepted))
        if width == 3:  # rows 0 and 2 go back to their first token
            model.rewind(state, torch.tensor([1, len(kept[1]), 1]))
            for row in (0, 2):
                kept[row], logits[row] = kept[row][:1], logits[row][:2]
    for row in range(3):
        inputs = _continued(pipe, PROMPTS[row], imgs[row], kept[row])
        with torch.no_grad():
            own = pipe.model(**inputs).logits[0].float()
        start = inputs["input_ids"].shape[1] - len(kept[row]) - 1
        torch.testing.assert_close(torch.stack(logits[row]), own[start:], rtol=1e-4, atol=1e-4)


def test_sampled_answers_follow_their_seed_at_any_batch(family):
    _, pipe, _ = family
    imgs = pictures()
    call = dict(max_new_tokens=8, temperature=1.0, top_k=20, stop_token_ids=[])
    together = pipe.answer_each(PROMPTS, imgs, [make_generator(7 + k) for k in range(3)], batch_size=3, **call)
    for row in range(3):
        alone = pipe(PROMPTS[row], imgs[row], generator=make_generator(7 + row), **call)
        assert torch.equal(together.token_ids[row], alone.token_ids[0])
    other = pipe.answer_each(PROMPTS, imgs, [make_generator(8 + k) for k in range(3)], batch_size=3, **call)
    assert not torch.equal(other.token_ids, together.token_ids)


@pytest.mark.parametrize("spec", ["fastv:layer=1,keep_ratio=0.999", "mustdrop:layer=1,keep_ratio=0.999,merge_threshold=1.0,decode_keep=1.0"])
def test_dropping_that_keeps_every_token_changes_nothing(family, spec):
    """FastV and MustDrop run (scores, merging, gathers, each layer's own mask over the kept
    slots: sliding windows, prefix-LM images; original positions, Qwen3-VL's deepstack) yet keep
    every visual token: the answer is the unpruned model's."""
    _, pipe, _ = family
    imgs = pictures()
    plain = pipe(PROMPTS, imgs, max_new_tokens=8, stop_token_ids=[])
    out = pipe(PROMPTS, imgs, max_new_tokens=8, stop_token_ids=[], dropping=spec)
    assert out.dropping.kept_tokens == out.dropping.image_tokens
    assert torch.equal(out.token_ids, plain.token_ids)


def test_a_saved_folder_loads_as_its_family(family, tmp_path):
    _, pipe, _ = family
    pipe.save_pretrained(tmp_path / "model")
    loaded = mmgen.load_pipeline(tmp_path / "model")
    assert type(loaded) is VLMPipeline and type(loaded.model) is type(pipe.model)
    image = pictures()[0]
    assert torch.equal(loaded(PROMPTS[0], image, max_new_tokens=6).token_ids, pipe(PROMPTS[0], image, max_new_tokens=6).token_ids)


@pytest.mark.parametrize("name", ["llava", "qwen2_5_vl", "gemma3"])
def test_the_generation_configs_logits_processing_applies_on_every_step(name):
    """A repetition penalty, suppressed tokens and tokens suppressed at the start (as the model's
    generation config asks): the greedy answers are `generate`'s, at batch 3, under speculative
    decoders (each verified position with its own history) and continuous batching."""
    pipe = BUILDERS[name](0, std=0.1)
    imgs = pictures()
    plain = generate(pipe, PROMPTS, imgs, 12)
    config = pipe.model.generation_config
    config.repetition_penalty, config.suppress_tokens = 1.5, [int(plain[0, 1])]
    config.begin_suppress_tokens = [int(plain[1, 0])]
    reference = generate(pipe, PROMPTS, imgs, 12)
    assert not torch.equal(reference, plain)
    for decoder in ["ar", make_decoder("sjd", window=4, adapt=False, draft_init="left"), make_decoder("lookup", adapt=False)]:
        out = pipe(PROMPTS, imgs, max_new_tokens=12, stop_token_ids=[], decoding=decoder)
        assert torch.equal(out.token_ids, reference) and (decoder == "ar" or speculated(out.stats)), decoder
    each = pipe.answer_each(PROMPTS, imgs, [make_generator(k) for k in range(3)], batch_size=2, max_new_tokens=12,
                            stop_token_ids=[], decoding="sjd:adapt=false,window=4")
    assert torch.equal(each.token_ids, reference)
    config.no_repeat_ngram_size = 3
    with pytest.raises(ValueError, match="generation_config sets no_repeat_ngram_size=3, which mmgen's decoders do not apply"):
        pipe(PROMPTS[0], imgs[0], max_new_tokens=2)
