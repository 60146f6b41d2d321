"""VLMPipeline on tiny random LLaVA, LLaVA-NeXT, Qwen2.5-VL and Idefics3 models built here (no downloads): greedy
output equals transformers' own `generate`, lossless decoders equal AR, stop tokens, streaming,
loading."""

from __future__ import annotations

import pytest
import torch

import mmgen
from mmgen.decoding import make_decoder
from mmgen.vlm.pipeline import VLMPipeline

from tests.vlm.tiny import PROMPTS, images, tiny_idefics3, tiny_llava, tiny_llava_next, tiny_qwen  # noqa: F401 (shared)

#: The families this file's general tests run on (tests/vlm/test_families.py runs every family).
BUILDERS = {"llava": tiny_llava, "llava_next": tiny_llava_next, "qwen2_5_vl": tiny_qwen, "idefics3": tiny_idefics3}


@pytest.fixture(scope="module", params=list(BUILDERS))
def pipe(request):
    # Weights of std 0.1: answers that vary (no end token first, no one-token loop), on which
    # speculative decoders accept some drafts and reject others.
    return BUILDERS[request.param](std=0.1)


def transformers_greedy(pipe, prompts, imgs, max_new_tokens, eos):
    inputs = pipe.prepare_inputs(prompts, imgs)
    out = pipe.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pipe.pad_token_id,
                              eos_token_id=eos)
    return out[:, inputs["input_ids"].shape[1]:]


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_equals_transformers_generate(pipe, rows):
    prompts, imgs = PROMPTS[:rows], images(rows) if rows > 1 else images(1)[0]
    free = pipe(prompts, imgs, max_new_tokens=12, stop_token_ids=[])
    assert torch.equal(free.token_ids, transformers_greedy(pipe, prompts, imgs, 12, eos=[]))
    # a stop token that row 0 first emits mid-way, so rows end at different steps, as in generate
    first = free.token_ids[0].tolist()
    stop = next(t for i, t in enumerate(first) if i >= 1 and t not in first[:i])
    ref = transformers_greedy(pipe, prompts, imgs, 12, eos=[stop])
    out = pipe(prompts, imgs, max_new_tokens=12, stop_token_ids=[stop])
    assert out.lengths[0] == first.index(stop) + 1 < 12
    for row, n in enumerate(out.lengths.tolist()):
        assert torch.equal(out.token_ids[row, :n], ref[row, :n])
        if n < 12:  # ended at the stop token, as generate did (it pads after it)
            assert out.token_ids[row, n - 1] == stop and (ref[row, n:] == pipe.pad_token_id).all()
            assert (out.token_ids[row, n:] == pipe.pad_token_id).all()
    assert len(out.texts) == rows and out.stats.rows == rows


def test_text_only_prompts_on_mrope_models_take_the_texts_positions():
    """Without images an M-RoPE model's positions are the text's on all three axes, as in
    transformers' generate: a row's new tokens follow its own prompt (slot minus its left
    padding). Before, a text-only first prompt crashed (the model had no rope_deltas yet) and a
    later one took the rope_deltas an image prompt had left."""
    pipe = tiny_qwen()
    model, text = pipe.token_model(), pipe.prepare_inputs(PROMPTS[:2], None)
    own = text["attention_mask"].sum(1, keepdim=True) - text["input_ids"].shape[1]  # minus each row's padding
    first = model.start(text, 0, False)
    assert torch.equal(first.extra.offset, own) and int(own.min()) < 0
    model.start(pipe.prepare_inputs(PROMPTS[0], images(1)[0]), 0, False)
    assert int(pipe.model.model.rope_deltas[0, 0]) != 0  # what an image prompt leaves on the model
    again = model.start(text, 0, False)
    assert torch.equal(again.extra.offset, own) and torch.equal(again.first_logits.cond, first.first_logits.cond)
    out = pipe(PROMPTS[:2], None, max_new_tokens=8, stop_token_ids=[])
    assert torch.equal(out.token_ids, transformers_greedy(pipe, PROMPTS[:2], None, 8, eos=[]))


@pytest.mark.parametrize("decoding", ["sjd:adapt=false,window=4,draft_init=left", "lookup:adapt=false",
                                      "sjd-coupled:window=4,draft_init=left"])
def test_lossless_decoders_equal_ar_under_greedy(pipe, decoding):
    """Every row decodes its whole budget (no end token), and the run both accepted drafts (a
    forward finalised 2 or more tokens) and rejected some (a forward finalised 1): the identity
    is checked on steps where speculation happened."""
    imgs = images(3)
    ar = pipe(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[])
    other = pipe(PROMPTS, imgs, max_new_tokens=16, decoding=decoding, stop_token_ids=[])
    assert torch.equal(other.token_ids, ar.token_ids) and other.lengths.tolist() == [16, 16, 16]
    histogram = other.stats.accepted_histogram
    assert sum(histogram[2:]) > 0 and histogram[1] > 0, histogram


def test_sampling_is_reproducible_from_the_generator(pipe):
    run = lambda seed: pipe(PROMPTS[:2], images(2), max_new_tokens=8, temperature=1.0,
                            generator=torch.Generator().manual_seed(seed)).token_ids
    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))


def test_stop_tokens_and_budgets(pipe):
    out = pipe(PROMPTS, images(3), max_new_tokens=6, stop_token_ids=[])
    assert out.lengths.tolist() == [6, 6, 6]  # no stop token: the budget ends every row
    first = out.token_ids[0, 0].item()
    stopped = pipe(PROMPTS, images(3), max_new_tokens=6, stop_token_ids=[first])
    assert stopped.lengths[0] == 1 and stopped.token_ids[0, 0] == first
    assert pipe.eos_token_ids == [2]  # the default stop: the model's end token


def test_streamed_text_concatenates_to_the_answer(pipe):
    imgs = images(2)
    whole = pipe(PROMPTS[:2], imgs, max_new_tokens=10, stop_token_ids=[])
    pieces, stream = {}, pipe.stream(PROMPTS[:2], imgs, max_new_tokens=10, stop_token_ids=[])
    while True:
        try:
            row, piece = next(stream)
        except StopIteration as end:  # the generator returns the call's output
            assert torch.equal(end.value.token_ids, whole.token_ids)
            break
        pieces[row] = pieces.get(row, "") + piece
    assert [pieces.get(r, "") for r in range(2)] == whole.texts


def test_bad_input_is_a_clear_error(pipe):
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer in \[1, 1048576\]"):
        pipe("what is this ?", images(1)[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompts must be"):
        pipe("", images(1)[0])
    with pytest.raises(ValueError, match="2 prompts need a list of 2 images"):
        pipe(PROMPTS[:2], images(1)[0])


def test_saved_folder_loads_through_the_registry(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "tiny-llava")
    loaded = mmgen.load_pipeline(tmp_path / "tiny-llava")
    assert type(loaded) is VLMPipeline and mmgen.VLMPipeline is VLMPipeline
    assert type(loaded.model) is type(pipe.model)
    a = pipe(PROMPTS[0], images(1)[0], max_new_tokens=6)
    b = loaded(PROMPTS[0], images(1)[0], max_new_tokens=6)
    assert torch.equal(a.token_ids, b.token_ids)
    assert loaded.token_model().window_cost is None and loaded.token_model().window_tokens is None
    loaded.model.config.mmgen_window_cost = {"cpu:2": {"1": 1.0, "4": 1.2}}  # as window_cost.py --write stores them
    loaded.model.config.mmgen_window_tokens = {"4": 1.5}
    loaded.save_pretrained(tmp_path / "measured")
    measured = mmgen.load_pipeline(tmp_path / "measured").token_model()
    assert measured.window_cost == {"cpu:2": {1: 1.0, 4: 1.2}} and measured.window_tokens == {4: 1.5}


def test_several_images_in_one_prompt_and_none_in_another(pipe):
    imgs = [images(2), []]
    inputs = pipe.prepare_inputs(PROMPTS[:2], imgs)
    image_token = pipe.processor.tokenizer.convert_tokens_to_ids(pipe.processor.image_token)
    counts = (inputs["input_ids"] == image_token).sum(1).tolist()
    assert counts[0] > 0 and counts[1] == 0
    out = pipe(PROMPTS[:2], imgs, max_new_tokens=8, stop_token_ids=[])
    assert torch.equal(out.token_ids, transformers_greedy(pipe, PROMPTS[:2], imgs, 8, eos=[]))


def test_image_aware_drafting_is_exact_in_distribution():
    """A smaller VLM of the same tokenizer drafts with the image; the core's exact rule keeps
    the target's distribution: the first two sampled tokens of 3000 rows against the target's
    enumerated joint (top-k 3: 9 outcomes), chi-square."""
    from scipy.stats import chisquare

    from mmgen.sampling import SamplingConfig

    target, drafter = tiny_llava(0), tiny_llava(1)
    prompt, image = PROMPTS[0], images(1)[0]
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    # The target's exact joint of (token 0, token 1), teacher-forced.
    model = target.token_model()
    inputs = target.prepare_inputs([prompt] * 3, [image] * 3)
    state = model.start(inputs, 4, False)
    p0 = sampling.probs(state.first_logits, torch.zeros(3, 1, dtype=torch.long))[0, 0]
    first = p0.topk(3).indices
    p1 = sampling.probs(model.forward(state, first[:, None]), torch.ones(3, 1, dtype=torch.long))[:, 0]
    joint = (p0[first, None] * p1).double()  # [3, V]: P(first[i], j)
    rows = 3000
    draft = make_decoder("draft", drafter=drafter, num_draft=2)
    out = target([prompt] * rows, [image] * rows, max_new_tokens=2, decoding=draft, temperature=1.0, top_k=3,
                 stop_token_ids=[], generator=torch.Generator().manual_seed(0))
    assert out.stats.draft_forwards > 0
    counts = torch.zeros_like(joint)
    for a, b in out.token_ids.tolist():
        assert a in first.tolist() and joint[first.tolist().index(a), b] > 0  # never outside the target's support
        counts[first.tolist().index(a), b] += 1
    keep = joint > 0
    assert chisquare(counts[keep].numpy(), (joint[keep] / joint.sum() * rows).numpy()).pvalue > 1e-3


def test_grouped_acceptance_runs_on_vlms(pipe):
    """GSD groups tokens by the language model's input embeddings; LANTERN's latent proximity is
    an image-token notion (it needs a tokenizer codebook): a VLM does not offer it, by name
    (`VLMPipeline.decoders`) or as an object."""
    from mmgen.decoding import make_decoder

    out = pipe(PROMPTS, images(3), max_new_tokens=6, decoding="gsd", stop_token_ids=[])
    assert out.lengths.tolist() == [6, 6, 6] and out.stats.forwards <= 6
    with pytest.raises(ValueError, match=r"unknown decoding 'lantern': use one of \['ar', 'draft', 'gsd'"):
        pipe(PROMPTS[0], images(1)[0], max_new_tokens=4, decoding="lantern")
    with pytest.raises(ValueError, match=r"does not provide `codebook\(\)`"):
        pipe(PROMPTS[0], images(1)[0], max_new_tokens=4, decoding=make_decoder("lantern"))


@pytest.mark.parametrize("build", list(BUILDERS.values()), ids=list(BUILDERS))
def test_image_aware_drafting_equals_ar_under_greedy(build):
    target, drafter = build(0), build(1)
    imgs = images(3)
    ar = target(PROMPTS, imgs, max_new_tokens=10, stop_token_ids=[])
    draft = target(PROMPTS, imgs, max_new_tokens=10, stop_token_ids=[], decoding=make_decoder("draft", drafter=drafter))
    assert torch.equal(draft.token_ids, ar.token_ids) and draft.stats.draft_forwards > 0


def test_a_conversation_is_a_prompt(pipe):
    """A chat conversation (transformers' message format) is one row: the same text as the
    question alone when it is one user turn; earlier turns change the prompt the model sees."""
    image = images(1)[0]
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPTS[0]}]}]
    asked = pipe(PROMPTS[0], image, max_new_tokens=6, stop_token_ids=[])
    assert torch.equal(pipe(turn, image, max_new_tokens=6, stop_token_ids=[]).token_ids, asked.token_ids)
    chat = turn + [{"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
                   {"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]
    longer = pipe.prepare_inputs([chat, PROMPTS[2]], [[image], []])
    assert longer["attention_mask"][0].sum() > pipe.prepare_inputs(turn, image)["attention_mask"].sum()
    with pytest.raises(ValueError, match="must end with a user turn"):
        pipe(chat[:2], image)
    with pytest.raises(ValueError, match="1 image placeholder\\(s\\) but 2 image\\(s\\)"):
        pipe(turn, images(2))


def test_prompts_longer_than_the_context_are_refused_before_decoding(pipe, monkeypatch):
    length = int(pipe.prepare_inputs(PROMPTS[0], images(1)[0])["attention_mask"].sum())
    monkeypatch.setattr(type(pipe), "context_length", property(lambda self: length + 3))
    pipe(PROMPTS[0], images(1)[0], max_new_tokens=3)  # exactly fits
    monkeypatch.setattr(type(pipe.model), "forward", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(ValueError, match=f"prompt 0: {length} tokens \\(\\d+ of them for its images.*exceed the model's "
                                         f"context of {length + 3} tokens"):
        pipe(PROMPTS[0], images(1)[0], max_new_tokens=4)


def test_a_drafter_with_another_tokenizer_is_refused(tmp_path):
    from mmgen.loading import decoder_from_spec

    target, drafter = tiny_llava(0), tiny_llava(1)
    drafter.save_pretrained(tmp_path / "same")
    assert decoder_from_spec(f"draft:drafter={tmp_path / 'same'}", target, "x").drafter is not None
    vocab = drafter.processor.tokenizer.get_vocab()
    drafter.processor.tokenizer.add_tokens(["zebra"])
    assert len(drafter.processor.tokenizer.get_vocab()) == len(vocab) + 1
    with pytest.raises(ValueError, match="another tokenizer"):
        decoder_from_spec("draft", target, "x", drafter=drafter)
    with pytest.raises(ValueError, match="another tokenizer"):  # a drafter handed over in Python, too
        target(PROMPTS[0], images(1)[0], decoding=make_decoder("draft", drafter=drafter))
