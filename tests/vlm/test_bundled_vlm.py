"""The bundled `emoji-vlm` / `emoji-vlm-draft` pair (package data, trained by
`training/train_vlm.py`): it loads through `VLMPipeline.from_pretrained`, its greedy answers
on the first held-out call reproduce the model card's figures for it, drafting with the drafter
is token-identical to autoregressive decoding, and the two share one tokenizer and processor."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

import mmgen.vlm
from training.data.emoji_vlm import KINDS
from training.train_vlm import EVAL_BATCH, answer_all, load_eval, scores
from mmgen import registry
from mmgen.decoding import AdaptiveWindow, make_decoder
from mmgen.vlm.pipeline import VLMPipeline

PACKAGE = Path(mmgen.vlm.__file__).parent
ASSETS = PACKAGE / "assets"


@pytest.fixture(scope="module")
def pair():
    folders = registry.bundled_models()
    return VLMPipeline.from_pretrained(folders["emoji-vlm"]), VLMPipeline.from_pretrained(folders["emoji-vlm-draft"])


@pytest.fixture(scope="module")
def subset():
    """The first evaluation call: the first EVAL_BATCH held-out questions (16 images, every kind)."""
    records, images = load_eval(ASSETS)
    return records[:EVAL_BATCH], images


def card_subset_table() -> dict[str, list[str]]:
    """kind -> the card's cells (questions, target exact, target F1, draft exact, draft F1) of the subset table."""
    text = (ASSETS / "emoji-vlm" / "MODEL_CARD.md").read_text()
    table = text.split("The first call alone", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("| ")]
    return {row[0]: row[1:] for row in rows if row[0] in (*KINDS, "short", "all")}


def test_the_pair_loads_and_shares_one_tokenizer_and_processor(pair):
    target, drafter = pair
    assert type(target.model).__name__ == type(drafter.model).__name__ == "LlavaForConditionalGeneration"
    assert target.processor.tokenizer.get_vocab() == drafter.processor.tokenizer.get_vocab()
    assert target.processor.chat_template == drafter.processor.chat_template
    assert target.processor.image_processor.to_dict() == drafter.processor.image_processor.to_dict()
    assert target.eos_token_ids == drafter.eos_token_ids == [target.processor.tokenizer.eos_token_id]
    assert sum(p.numel() for p in drafter.model.parameters()) < sum(p.numel() for p in target.model.parameters()) / 3


def test_the_target_carries_its_measured_window_cost_and_tokens(pair):
    """`mmgen calibrate` measured the target's forward cost by window width on
    the project's box and the tokens its fixed windows finalise per forward; its token models
    carry both. Its short greedy answers accept next to no Jacobi draft, so with them the
    adaptive window starts with AR steps at either thread count."""
    token_model = pair[0].token_model()
    curves, tokens = token_model.window_cost, token_model.window_tokens
    assert set(curves) == {"cpu:1", "cpu:2"} and all(curve[1] == 1.0 and curve[2] > 1.0 for curve in curves.values())
    assert set(tokens) == {2, 4, 8, 16} and all(t < 1.1 for t in tokens.values())
    for key in curves:
        assert AdaptiveWindow().start(15, 1, "cpu", {"cpu": curves[key]}, tokens).home == 0
    assert pair[1].token_model().window_cost is None  # the drafter drafts; it is never the adaptive target
    assert pair[1].token_model().window_tokens is None


def test_greedy_answers_reproduce_the_model_card(pair, subset):
    records, images = subset
    card = card_subset_table()
    assert set(card) == {kind for kind in KINDS if any(r["kind"] == kind for r in records)} | {"short", "all"}
    for column, pipe in ((1, pair[0]), (3, pair[1])):
        texts, _ = answer_all(pipe, records, images)
        measured = scores(records, texts)
        for kind, cells in card.items():
            assert int(cells[0]) == measured[kind]["n"]
            assert cells[column] == f"{measured[kind]['exact']:.1%}", (kind, column)
            assert cells[column + 1] == f"{measured[kind]['f1']:.3f}", (kind, column)
        if pipe is pair[0]:
            target_f1 = measured["all"]["f1"]
    # A trained model: it beats always giving the most common held-out answer of each kind.
    all_records, _ = load_eval(ASSETS)
    common = {k: Counter(r["answer"] for r in all_records if r["kind"] == k).most_common(1)[0][0] for k in KINDS}
    assert target_f1 > scores(records, [common[r["kind"]] for r in records])["all"]["f1"]


def test_drafting_with_the_drafter_equals_greedy(pair, subset):
    target, drafter = pair
    records, images = subset
    records = records[:32]  # 8 images, every kind: enough rows for drafts to be accepted and rejected
    from PIL import Image

    prompts, imgs = [r["question"] for r in records], [Image.fromarray(images[r["index"]]) for r in records]
    ar = target(prompts, imgs, max_new_tokens=32)
    draft = target(prompts, imgs, max_new_tokens=32, decoding=make_decoder("draft", drafter=drafter, num_draft=4))
    assert torch.equal(draft.token_ids, ar.token_ids) and torch.equal(draft.lengths, ar.lengths)
    assert draft.stats.draft_forwards > 0 and draft.stats.forwards < ar.stats.forwards


def test_batched_greedy_answers_equal_each_question_alone_and_generate(pair, subset):
    """Left-padded rows decode at their own prompt's positions: the trained model's batched
    answers are its answers alone and transformers' `generate`'s (the tiny random test models
    barely depend on positions; this one does: a padded row's answer changed when its new
    tokens sat at padded slot positions)."""
    from PIL import Image

    pipe = pair[0]
    records, images = subset
    rows = records[:6]
    questions, pictures = [r["question"] for r in rows], [[Image.fromarray(images[r["index"]])] for r in rows]
    inputs = pipe.prepare_inputs(questions, pictures)
    assert len(set(inputs["attention_mask"].sum(1).tolist())) > 1  # rows of several lengths: some padded
    batched = pipe(questions, pictures, max_new_tokens=16)
    assert batched.texts == [pipe(q, p, max_new_tokens=16).texts[0] for q, p in zip(questions, pictures)]
    reference = pipe.model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=pipe.pad_token_id)
    texts = [pipe.processor.tokenizer.decode(r, skip_special_tokens=True).strip() for r in reference[:, inputs["input_ids"].shape[1]:]]
    assert batched.texts == texts
    # Pruned prompts too: new tokens follow each row's unpruned prompt.
    pruned = pipe(questions, pictures, max_new_tokens=16, dropping="fastv:layer=2,keep_ratio=0.5")
    assert pruned.texts == [pipe(q, p, max_new_tokens=16, dropping="fastv:layer=2,keep_ratio=0.5").texts[0]
                            for q, p in zip(questions, pictures)]


# 4 drafts, 6, and the settings of the pair's decoding.json (12 drafts stopped where the drafter is unsure)
DRAFTERS = {"draft": dict(num_draft=4), "draft6": dict(num_draft=6), "draft12-confident": dict(num_draft=12, confidence=0.7)}


@pytest.mark.parametrize("decoding", ["sjd", "sjd:adapt=false", "lookup", "lookup:adapt=false", *DRAFTERS])
def test_every_lossless_method_equals_greedy_on_sentence_answers(pair, decoding):
    """The long answers (a sentence of 16-34 tokens), where speculation has room: each lossless
    method gives greedy AR's tokens, and the fixed Jacobi window and the drafter (4 drafts, 6,
    and 12 stopped where the drafter is unsure) finalise several tokens in some forwards; a
    confidence stop also one question at a time, where it stops at the first unsure draft."""
    from PIL import Image

    target, drafter = pair
    records, images = load_eval(ASSETS)
    # 16 answers: greedy Jacobi drafts of this model pass rarely (about 10 of 360 row-forwards),
    # and with 4 answers whether any passed depended on the thread count's rounding.
    rows = [r for r in records if r["kind"] == "sentence"][:16]
    assert rows, "the held-out questions include sentence answers"
    prompts, pictures = [r["question"] for r in rows], [Image.fromarray(images[r["index"]]) for r in rows]
    ar = target(prompts, pictures, max_new_tokens=40)
    options = DRAFTERS.get(decoding)
    decoder = make_decoder("draft", drafter=drafter, **options) if options else decoding
    out = target(prompts, pictures, max_new_tokens=40, decoding=decoder)
    assert torch.equal(out.token_ids, ar.token_ids) and torch.equal(out.lengths, ar.lengths)
    # (the prompt holds no n-gram of the answer for lookup to copy)
    if decoding in ("sjd:adapt=false", *DRAFTERS):  # some row finalised drafts in some forward
        assert sum(out.stats.accepted_histogram[2:]) > 0
    if options:  # and the drafter's are accepted often enough to save whole batch forwards
        assert out.stats.forwards < ar.stats.forwards
    if options and options.get("confidence"):
        counts = []
        for b in range(4):
            alone = target(prompts[b], pictures[b], max_new_tokens=40, decoding=decoder)
            assert alone.token_ids[0, : alone.lengths[0]].tolist() == ar.token_ids[b, : ar.lengths[b]].tolist()
            counts += alone.stats.drafts_per_forward
        assert min(counts) < options["num_draft"] == max(counts)  # rounds stopped early and rounds that did not
