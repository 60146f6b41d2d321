"""Visual token dropping (FastV, VisionZip, MustDrop) and SpecVLM's pruned drafter on tiny random
LLaVA, Qwen2.5-VL and Idefics3 models built here: keep ratio 1.0 is the identity, kept tokens
keep their original positions (a pruned run equals the unpruned model with the dropped tokens
masked out), rows keep their own counts, reports add up, and a drafter on a pruned image keeps
decoding exact (greedy identity, sampled distribution)."""

from __future__ import annotations

import pytest
import torch

from mmgen.decoding import make_decoder
from mmgen.hooks import ModelHook, hooks_attached
from mmgen.vlm.dropping import FastV, MustDrop, VisionZip, layer_flops, make_dropping
from tests.vlm.test_vlm_pipeline import BUILDERS, PROMPTS, images, tiny_idefics3, tiny_llava, tiny_qwen
from tests.vlm.tiny import qwen_visionzip_reference


@pytest.fixture(scope="module", params=list(BUILDERS))
def pipe(request):
    return BUILDERS[request.param]()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spec", ["fastv:keep_ratio=1.0", "fastv:layer=0,keep_ratio=1.0", "visionzip:keep_ratio=1.0",
                                  "mustdrop:keep_ratio=1.0"])
def test_keep_ratio_one_is_identical_to_no_dropping(pipe, spec, rows):
    prompts, imgs = (PROMPTS, images(3)) if rows == 3 else (PROMPTS[0], images(1)[0])
    plain = pipe(prompts, imgs, max_new_tokens=8, stop_token_ids=[])
    out = pipe(prompts, imgs, max_new_tokens=8, stop_token_ids=[], dropping=spec)
    assert torch.equal(out.token_ids, plain.token_ids) and torch.equal(out.lengths, plain.lengths)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("spec", ["fastv:layer=1,keep_ratio=0.999", "fastv:layer=0,keep_ratio=0.999",
                                  "visionzip:keep_ratio=0.999,contextual=0",
                                  "mustdrop:layer=1,keep_ratio=0.999,merge_threshold=1.0,decode_keep=1.0"])
def test_the_hooked_prefill_keeping_every_token_is_identical_to_no_dropping(pipe, spec, rows):
    """Keep ratio 1.0 skips the hooks; 0.999 runs them (scores, gathers, packed masks, original
    positions, cache compaction) yet keeps every visual token (ceil of 0.999 x fewer than 1000),
    so the answer must be the unpruned model's."""
    prompts, imgs = (PROMPTS, images(3)) if rows == 3 else (PROMPTS[0], images(1)[0])
    if spec.startswith("visionzip") and pipe.model.config.model_type == "llava_next":
        with pytest.raises(ValueError, match="VisionZip is not available for LLaVA-NeXT"):
            pipe(prompts, imgs, max_new_tokens=8, dropping=spec)
        return
    plain = pipe(prompts, imgs, max_new_tokens=8, stop_token_ids=[])
    out = pipe(prompts, imgs, max_new_tokens=8, stop_token_ids=[], dropping=spec)
    assert out.dropping is not None and out.dropping.kept_tokens == out.dropping.image_tokens  # the hooks ran, kept all
    assert torch.equal(out.token_ids, plain.token_ids) and torch.equal(out.lengths, plain.lengths)


class _Inputs(ModelHook):
    def __init__(self, store):
        super().__init__()
        self.store = store

    def pre_forward(self, module, *args, **kwargs):
        self.store.update(kwargs)
        return args, kwargs


@torch.no_grad()
def masked_reference(pipe, prompts, imgs, kept_slots, steps):
    """Greedy tokens of the UNPRUNED language model with the dropped prompt tokens masked out of
    every layer's attention, every token at its original position (the trunk's inputs of an
    unpruned prefill; new tokens at slot + rope_deltas), recomputed without a cache."""
    inputs = pipe.prepare_inputs(prompts, imgs)
    model, store = pipe.token_model(), {}
    with hooks_attached({model.trunk: _Inputs(store)}, "test"):
        state = model.start(inputs, steps, False)
    embeds, pos = store["inputs_embeds"], store["position_ids"]
    rows, s = inputs["input_ids"].shape
    mask = torch.zeros(rows, s, dtype=torch.long)
    for r, slots in enumerate(kept_slots):
        mask[r, slots] = 1
    out = []
    for i in range(steps):
        hidden = model.trunk(inputs_embeds=embeds, attention_mask=mask, position_ids=pos).last_hidden_state
        token = pipe.model.lm_head(hidden[:, -1]).argmax(-1)
        out.append(token)
        new = s + i + state.extra.offset  # [B, 1]
        pos = torch.cat([pos, new.expand(3, -1, -1) if pos.dim() == 3 else new], dim=-1)
        embeds = torch.cat([embeds, pipe.model.get_input_embeddings()(token)[:, None]], 1)
        mask = torch.cat([mask, torch.ones(rows, 1, dtype=torch.long)], 1)
    return torch.stack(out, 1)


@pytest.mark.parametrize("build,spec", [
    (tiny_llava, "fastv:layer=0,keep_ratio=0.4"),
    (tiny_qwen, "fastv:layer=0,keep_ratio=0.4"),
    (tiny_llava, "visionzip:keep_ratio=0.4,contextual=0"),
    (tiny_qwen, "visionzip:keep_ratio=0.4,contextual=0"),
    (tiny_qwen, "mustdrop:layer=0,keep_ratio=0.4,merge_threshold=1.0,decode_keep=1.0"),
])
def test_pruned_run_equals_masked_run_at_original_positions(build, spec):
    pipe = build()
    imgs = images(3)
    out = pipe(PROMPTS, imgs, max_new_tokens=6, stop_token_ids=[], dropping=spec)
    report = out.dropping
    assert report.kept_tokens != report.image_tokens  # something was dropped
    ref = masked_reference(pipe, PROMPTS, imgs, report.kept_slots, 6)
    assert torch.equal(out.token_ids, ref)


def test_rows_keep_their_own_counts(pipe):
    imgs = [images(2), images(1)[0], []]  # two images, one, none
    out = pipe(PROMPTS, imgs, max_new_tokens=4, stop_token_ids=[], dropping=FastV(layer=1, keep_ratio=0.3))
    r = out.dropping
    assert r.image_tokens[0] > r.image_tokens[1] > r.image_tokens[2] == 0
    assert r.kept_tokens == [-(-n * 3 // 10) for n in r.image_tokens]  # ceil(0.3 n) per row
    assert r.kept_tokens[0] > r.kept_tokens[1] > r.kept_tokens[2] == 0
    assert out.lengths.tolist() == [4, 4, 4]


@pytest.mark.parametrize("spec", ["fastv:layer=1,keep_ratio=0.25", "visionzip:keep_ratio=0.5", "mustdrop:layer=1,keep_ratio=0.5"])
def test_reports_add_up(pipe, spec):
    if spec.startswith("visionzip") and pipe.model.config.model_type == "llava_next":
        with pytest.raises(ValueError, match="VisionZip is not available for LLaVA-NeXT"):
            pipe(PROMPTS[0], images(1)[0], max_new_tokens=2, dropping=spec)
        return
    out = pipe(PROMPTS, images(3), max_new_tokens=5, stop_token_ids=[], dropping=spec)
    r, cfg = out.dropping, pipe.model.config.get_text_config()
    policy = make_dropping(spec)
    for n, kept, full, left, slots in zip(r.image_tokens, r.kept_tokens, r.prompt_tokens, r.kept_prompt_tokens, r.kept_slots):
        assert kept == -(-n * int(policy.keep_ratio * 100) // 100) and full - left == n - kept == n - kept
        assert len(slots) == left and slots == sorted(slots)
    k = getattr(policy, "layer", 0)
    full, kept = torch.tensor(r.prompt_tokens), torch.tensor(r.kept_prompt_tokens)
    for i in range(cfg.num_hidden_layers):
        assert (r.attention_flops_full[i], r.mlp_flops_full[i]) == layer_flops(cfg, full)
        assert (r.attention_flops_pruned[i], r.mlp_flops_pruned[i]) == layer_flops(cfg, full if i < k else kept)
    assert r.prefill_flops_full == sum(r.attention_flops_full) + sum(r.mlp_flops_full)
    assert 0 < r.flops_saved < 1
    if isinstance(policy, MustDrop):  # output-aware eviction at the first decode step
        assert r.evicted_tokens == [kept - -(-kept // 2) for kept in r.kept_tokens]
    assert out.ttft_s > 0 and out.decode_tokens_per_s > 0


def test_timings_on_every_output(pipe):
    out = pipe(PROMPTS[:2], images(2), max_new_tokens=4, stop_token_ids=[])
    assert out.dropping is None and out.ttft_s > 0 and out.decode_tokens_per_s > 0


def test_mustdrop_merges_similar_neighbours():
    pipe = tiny_llava()
    out = pipe(PROMPTS[:2], images(2), max_new_tokens=3, stop_token_ids=[], dropping="mustdrop:layer=1,merge_threshold=-1,keep_ratio=0.5")
    r = out.dropping
    # every visual token after the first of its image merges (similarity > -1): one anchor per image
    assert r.merged_tokens == [n - 1 for n in r.image_tokens] and r.kept_tokens == [1, 1]


def test_visionzip_keeps_contextual_tokens():
    out = tiny_idefics3()(PROMPTS[:1], images(1), max_new_tokens=2, dropping=VisionZip(keep_ratio=0.75, contextual=0.5))
    assert out.dropping.kept_tokens == [3] and out.dropping.merged_tokens == [1]  # 2 dominant, 1 contextual absorbing the other
    out = tiny_llava()(PROMPTS[:1], images(1), max_new_tokens=2, dropping=VisionZip(keep_ratio=0.5, contextual=0.25))
    assert out.dropping.kept_tokens == [8] and out.dropping.merged_tokens == [16 - 8]


def test_bad_specs_are_clear_errors():
    assert make_dropping(None) is None and make_dropping("fastv") == FastV()
    assert make_dropping("fastv:layer=3,keep_ratio=0.5") == FastV(layer=3, keep_ratio=0.5)
    with pytest.raises(ValueError, match="unknown dropping policy 'foo'"):
        make_dropping("foo")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['ratio'\] for dropping 'fastv'"):
        make_dropping("fastv:ratio=0.5")
    with pytest.raises(ValueError, match=r"keep_ratio must be a number in \(0, 1\]"):
        make_dropping("visionzip:keep_ratio=0")
    with pytest.raises(ValueError, match="layer must be an integer >= 0"):
        FastV(layer=-1)
    with pytest.raises(ValueError, match="dropping must be None"):
        make_dropping(3)
    pipe = tiny_llava()
    with pytest.raises(ValueError, match="dropping layer 5 is past the language model's 2 layers"):
        pipe(PROMPTS[0], images(1)[0], max_new_tokens=2, dropping="fastv:layer=5")
    with pytest.raises(ValueError, match="draft_dropping needs a draft decoder"):
        pipe(PROMPTS[0], images(1)[0], max_new_tokens=2, draft_dropping="fastv")


@pytest.mark.parametrize("build", [tiny_llava, tiny_qwen, tiny_idefics3])
def test_pruned_drafter_equals_ar_under_greedy(build):
    """SpecVLM: the drafter sees a pruned image, the target verifies on the full one."""
    target, drafter = build(0), build(1)
    imgs = images(3)
    ar = target(PROMPTS, imgs, max_new_tokens=10, stop_token_ids=[])
    out = target(PROMPTS, imgs, max_new_tokens=10, stop_token_ids=[], decoding=make_decoder("draft", drafter=drafter),
                 draft_dropping="fastv:layer=1,keep_ratio=0.25")
    assert torch.equal(out.token_ids, ar.token_ids) and out.stats.draft_forwards > 0
    assert out.dropping is None and out.draft_dropping.kept_tokens < out.draft_dropping.image_tokens
    view = drafter.pruned("fastv:layer=1,keep_ratio=0.25")  # the same through a pruned view as the drafter
    again = target(PROMPTS, imgs, max_new_tokens=10, stop_token_ids=[], decoding=make_decoder("draft", drafter=view))
    assert torch.equal(again.token_ids, ar.token_ids)


def test_pruned_drafter_is_exact_in_distribution():
    """The first two sampled tokens of 1500 rows, drafted on a pruned image, against the
    target's enumerated joint on the full image (top-k 3: 9 outcomes), chi-square."""
    from scipy.stats import chisquare

    from mmgen.sampling import SamplingConfig

    target, drafter = tiny_llava(0), tiny_llava(1)
    prompt, image = PROMPTS[0], images(1)[0]
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    model = target.token_model()
    state = model.start(target.prepare_inputs([prompt] * 3, [image] * 3), 4, False)
    p0 = sampling.probs(state.first_logits, torch.zeros(3, 1, dtype=torch.long))[0, 0]
    first = p0.topk(3).indices
    p1 = sampling.probs(model.forward(state, first[:, None]), torch.ones(3, 1, dtype=torch.long))[:, 0]
    joint = (p0[first, None] * p1).double()
    rows = 1500
    out = target([prompt] * rows, [image] * rows, max_new_tokens=2, decoding=make_decoder("draft", drafter=drafter, num_draft=2),
                 draft_dropping=FastV(layer=1, keep_ratio=0.25), temperature=1.0, top_k=3, stop_token_ids=[],
                 generator=torch.Generator().manual_seed(0))
    assert out.stats.draft_forwards > 0 and out.draft_dropping.kept_tokens[0] == 4
    counts = torch.zeros_like(joint)
    for a, b in out.token_ids.tolist():
        assert a in first.tolist() and joint[first.tolist().index(a), b] > 0
        counts[first.tolist().index(a), b] += 1
    keep = joint > 0
    assert chisquare(counts[keep].numpy(), (joint[keep] / joint.sum() * rows).numpy()).pvalue > 1e-3


def test_qwen_visionzip_scores_follow_the_prompts_image_tokens(monkeypatch):
    """Qwen2.5-VL runs its vision blocks in window order and has no CLS: VisionZip scores each
    merged token by the attention its patches receive in the last block, in the order of the
    prompt's image tokens. Checked against the tower's own outputs: the merged features in
    block order, matched row by row to the pooled features the LM receives, give the order."""
    from mmgen.vlm import dropping

    pipe, imgs = tiny_qwen(), images(2)
    pipe.model.model.visual.window_size = 16  # windows of 2x2 merged tokens, so block order is not the prompt's
    seen, original = {}, dropping.Prefill._vision_scores
    monkeypatch.setattr(dropping.Prefill, "_vision_scores", lambda self: seen.setdefault("scores", original(self)))
    pipe(PROMPTS[:2], imgs, max_new_tokens=2, stop_token_ids=[], dropping="visionzip:keep_ratio=0.5")

    inputs = pipe.prepare_inputs(PROMPTS[:2], imgs)
    expected = qwen_visionzip_reference(pipe, inputs["pixel_values"], inputs["image_grid_thw"])
    torch.testing.assert_close(seen["scores"], expected, rtol=1e-5, atol=1e-6)
