"""Layer-skip self-drafting (`skip`): the target with blocks skipped drafts in its own cache.

Checked as every lossless proposer is: greedy output token-identical to `ar` (LlamaGen and
Janus with CFG, Dia's frames, CSM's completed frames, a LLaVA batch with left padding), the
sampled law by chi-square with drafts both accepted and rejected and a wrong rule failing the
same check, continuous batching equal to each request alone (LlamaGen, Dia), and bad `layers`
refused before any work.
`layers=[]` skips nothing: the drafter is then the target itself, and greedy drafts are all
accepted (proof that drafting runs and that the rewound cache is the one verify needs).
"""

import pytest
import torch

from mmgen.decoding import Autoregressive, LayerSkipSpeculative, make_decoder, parse_decoding
from mmgen.decoding.layer_skip import default_skipped
from mmgen.decoding.proposer import DecodeRun
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig

from tests.conftest import tiny_transformer
from tests.core.test_decoding import ALPHA, LENGTH, SAMPLINGS, chi_square_pvalue, enumerable, exact_joint  # noqa: F401
from tests.speculation import (
    RULE_CASES, assert_confidence_stop_keeps_the_law, assert_confidence_stop_stays_greedy, assert_continuous_equals_alone,
    assert_drafted, rule,
)

GREEDY = SamplingConfig(top_k=1, guidance=4.0)
TEXTS = ["[S1] Hello there.", "[S1] Something else entirely, and longer.", "[S1] Three."]


@pytest.mark.parametrize("labels", [[3], [1, 5]])
@pytest.mark.parametrize("layers", [[], [0]])
def test_greedy_llamagen_with_cfg_is_token_identical_to_ar(labels, layers):
    model = LlamaGenTokenModel(tiny_transformer())
    conditions = torch.tensor(labels)
    ar = Autoregressive().generate(model, conditions, 64, GREEDY, torch.Generator().manual_seed(0))
    out = LayerSkipSpeculative(layers=layers).generate(model, conditions, 64, GREEDY, torch.Generator().manual_seed(1))
    assert torch.equal(out.tokens, ar.tokens)
    assert_drafted(out, ar)
    if not layers:  # the drafter is the target: every greedy draft passes
        assert out.stats.accepted_drafts == out.stats.drafted > 0
        assert out.stats.draft_forwards == 3 * (out.stats.forwards - 1)


@pytest.mark.parametrize("layers", ["1", "0"])
def test_greedy_dia_frames_equal_ar(layers):
    """Three rows of different lengths (padded templates), ending at different frames (stop
    tokens): frames drafted with a block skipped, in the SlotKVCache whose skipped layer is
    levelled with zeros after each draft forward (without that its crops cut a layer short)."""
    from tests.audio.tiny import tiny_dia

    pipe = tiny_dia(0, eos_boost=2.0)
    ar = pipe(TEXTS, max_new_frames=30, temperature=0)
    out = pipe(TEXTS, max_new_frames=30, temperature=0, decoding=make_decoder("skip", layers=layers))
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)
    assert_drafted(out, ar)


def test_greedy_csm_completed_frames_equal_ar():
    from tests.audio.tiny import tiny_csm

    pipe = tiny_csm(0)
    ar = pipe(TEXTS[:2], max_new_frames=20, temperature=0)
    out = pipe(TEXTS[:2], max_new_frames=20, temperature=0, decoding=make_decoder("skip", layers=[1]))
    assert torch.equal(out.frames, ar.frames)
    assert_drafted(out, ar)


@pytest.mark.parametrize("compact_ratio", [1.0, 0.0])
def test_greedy_janus_with_cfg_equals_ar(compact_ratio):
    """Janus's SlotKVCache, guided rows twice over; compact_ratio 0 compacts after every commit,
    drafts included (compaction gathers every layer alike: the skipped one filled first)."""
    from mmgen.image_ar.janus import JanusTokenModel

    from tests.image_ar.test_janus import GREEDY_CFG4, conditions, tiny_janus

    model = JanusTokenModel(tiny_janus(seed=1, std=0.05, grid=8), compact_ratio=compact_ratio)
    ar = Autoregressive().generate(model, conditions([0, 1]), 64, GREEDY_CFG4, torch.Generator().manual_seed(0))
    out = LayerSkipSpeculative(layers=[0]).generate(model, conditions([0, 1]), 64, GREEDY_CFG4, torch.Generator().manual_seed(1))
    assert torch.equal(out.tokens, ar.tokens)
    assert_drafted(out, ar)


@pytest.fixture(scope="module")
def llava():
    from tests.vlm.tiny import tiny_llava

    return tiny_llava(std=0.1)


@pytest.mark.parametrize("layers", [[0], []])
def test_greedy_llava_batch_with_padding_equals_ar(llava, layers):
    from tests.vlm.tiny import PROMPTS, images

    imgs = images(3)
    ar = llava(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[])
    out = llava(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[], decoding=LayerSkipSpeculative(layers=layers))
    assert torch.equal(out.token_ids, ar.token_ids)
    assert_drafted(out, ar)


def test_vlm_drop_policies_compose_but_a_decode_stage_eviction_is_refused(llava):
    """FastV prunes in the prefill (no blocks skipped there): greedy `skip` equals `ar`. MustDrop's
    decode-stage eviction would read a draft forward: a one-line error before any work."""
    from tests.vlm.tiny import PROMPTS, images

    imgs = images(3)
    ar = llava(PROMPTS, imgs, max_new_tokens=8, stop_token_ids=[], dropping="fastv:layer=1,keep_ratio=0.5")
    out = llava(PROMPTS, imgs, max_new_tokens=8, stop_token_ids=[], dropping="fastv:layer=1,keep_ratio=0.5",
                decoding=LayerSkipSpeculative(layers=[0]))
    assert torch.equal(out.token_ids, ar.token_ids)
    with pytest.raises(ValueError, match="layer-skip drafting cannot run MustDrop's decode-stage eviction") as error:
        llava(PROMPTS[0], imgs[0], max_new_tokens=4, dropping="mustdrop:layer=1,keep_ratio=0.5", decoding="skip")
    assert "\n" not in str(error.value)


def test_drafting_leaves_every_layer_of_the_shared_cache_as_it_found_it(llava):
    """A skipped block writes no K/V; the store's skipped layers are filled to the others'
    length after each draft forward, and the rewind after drafting leaves every layer exactly
    as before (what the verify forward then extends)."""
    from tests.vlm.tiny import PROMPTS, images

    model = llava.token_model()
    conditions = llava.prepare_inputs(PROMPTS[:2], images(2))
    run = DecodeRun.begin(model, conditions, 16, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0), 3)
    run.tokens[:, 0] = run.state.first_logits.cond[:, 0].argmax(-1)
    store = run.state.cache.kv
    before = [(layer.keys.clone(), layer.values.clone()) for layer in store.layers]
    proposer, _ = LayerSkipSpeculative(layers=[1], num_draft=3).roles(model, 16, run.generator)
    lengths = []
    commit = model.commit
    model.commit = lambda state, accepted: (lengths.append({layer.keys.shape[2] for layer in store.layers}), commit(state, accepted))
    try:
        drafts, q = proposer.propose(run)
    finally:
        del model.commit
    assert drafts.shape == (2, 3) and q.shape[:2] == (2, 3)
    assert [len(s) for s in lengths] == [1, 1, 1]  # one length for every layer at each commit
    for (k, v), layer in zip(before, store.layers):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


@pytest.mark.parametrize("rule_name,lossless", RULE_CASES)
def test_sampled_law_is_exact(enumerable, rule_name, lossless):  # noqa: F811
    """6000 rows with CFG, temperature and top-k: drafts from the target with block 0 skipped
    are accepted and rejected (counted), and the outputs follow the enumerated joint; a rule
    that forgets the residual fails the same check."""
    sampling = SAMPLINGS["cfg+temperature+top_k"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    acceptance = rule(rule_name)
    out = LayerSkipSpeculative(layers=[0], num_draft=2, acceptance=acceptance).generate(
        enumerable, torch.full((6000,), 1), LENGTH, sampling, torch.Generator().manual_seed(0))
    assert acceptance.speculated(), acceptance.counts
    assert (chi_square_pvalue(out.tokens, seqs, joint) > ALPHA) == lossless


def test_skipping_nothing_samples_the_exact_law_and_accepts_almost_every_draft(enumerable):  # noqa: F811
    sampling = SAMPLINGS["cfg+temperature+top_k"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    out = LayerSkipSpeculative(layers=[], num_draft=3).generate(
        enumerable, torch.full((6000,), 1), LENGTH, sampling, torch.Generator().manual_seed(0))
    assert out.stats.drafted > 0 and out.stats.accepted_drafts > 0.99 * out.stats.drafted
    assert chi_square_pvalue(out.tokens, seqs, joint) > ALPHA


def test_a_confidence_stop_drafts_fewer_in_some_rounds_and_stays_exact(enumerable):  # noqa: F811
    """`confidence`: a round stops at a draft the skipping model is unsure of; greedy output
    stays `ar`'s (CFG, a batch of 2), and the sampled law stays exact."""
    out = assert_confidence_stop_stays_greedy(LayerSkipSpeculative(layers=[0], num_draft=4, confidence=0.5),
                                              LlamaGenTokenModel(tiny_transformer()), torch.tensor([1, 5]), num_draft=4)
    assert out.stats.draft_forwards == sum(out.stats.drafts_per_forward)  # no prefill of its own: one per draft
    assert_confidence_stop_keeps_the_law(LayerSkipSpeculative(layers=[0], num_draft=3, confidence=0.35), enumerable, num_draft=3)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0, top_k=16, guidance=3.0), GREEDY], ids=["sampled", "greedy"])
def test_continuous_batching_equals_each_request_alone(sampling):
    model = LlamaGenTokenModel(tiny_transformer(output_std=1.5))
    assert_continuous_equals_alone(LayerSkipSpeculative(layers=[1]), model, sampling)


@pytest.mark.parametrize("temperature,guidance_scale", [(0.0, 3.0), (1.0, None)])
def test_continuous_dia_speaks_each_text_as_alone(temperature, guidance_scale):
    """Rows restarted on new texts (voice prompts grow the prompt region of every layer, the
    skipped ones included) speak what each speaks alone."""
    from tests.audio.test_speech_continuous import TEXTS as SPOKEN, VOICE_TEXTS, VOICES, generators
    from tests.audio.tiny import tiny_dia

    pipe = tiny_dia(0, eos_boost=2.0)
    options = dict(max_new_frames=30, decoding="skip:layers=1", temperature=temperature, top_k=20, guidance_scale=guidance_scale)
    out = pipe.speak_each(SPOKEN, VOICES, VOICE_TEXTS, generators(7), batch_size=2, **options)
    for i, text in enumerate(SPOKEN):
        alone = pipe(text, VOICES[i], VOICE_TEXTS[i], generator=torch.Generator().manual_seed(7 + i), **options)
        n = int(alone.lengths[0])
        assert int(out.lengths[i]) == n and torch.equal(out.frames[i, :n], alone.frames[0, :n]), f"text {i}"
    assert sum(out.stats.accepted_histogram[2:]) > 0  # frames were drafted and accepted


def test_layers_by_spec_and_default():
    assert make_decoder("skip").layers is None and make_decoder("skip").num_draft == 3
    name, options = parse_decoding("skip:layers=3+1,num_draft=2")
    assert make_decoder(name, **options).layers == (1, 3)
    assert make_decoder("skip", layers=2).layers == (2,)
    assert default_skipped(8) == [1, 3, 5] and default_skipped(2) == []


class _Spy(LlamaGenTokenModel):
    """A token model that counts its prefills: a refused decode starts none."""

    starts = 0

    def start(self, *args):
        _Spy.starts += 1
        return super().start(*args)


@pytest.mark.parametrize("layers,match", [
    ([2], r"layers \[2\] are out of range: _Spy has 2 decoder blocks \(0..1\)"),
    ([0, 5, 1], r"layers \[5\] are out of range"),
    ([1.5], "layers must be decoder block indices"),
    ([True], "layers must be decoder block indices"),
    ([-1], "layers must be decoder block indices"),
    ("1+x", "layers must be decoder block indices"),
    ("one", "layers must be decoder block indices"),
    ([1, 1], "layers names a block twice"),
])
def test_bad_layers_are_one_line_errors_before_any_work(layers, match):
    model = _Spy(tiny_transformer())
    with pytest.raises(ValueError, match=match) as error:
        LayerSkipSpeculative(layers=layers).generate(model, torch.tensor([1]), 8, GREEDY, torch.Generator())
    assert "\n" not in str(error.value) and _Spy.starts == 0


def test_a_model_without_decoder_blocks_is_refused_before_any_work():
    class NoBlocks:
        vocab_size = 32

        def start(self, *args):
            raise AssertionError("no work may start")

    with pytest.raises(ValueError, match=r"NoBlocks does not expose its decoder blocks \(`decoder_layers\(\)`\)"):
        LayerSkipSpeculative().generate(NoBlocks(), torch.tensor([1]), 8, GREEDY, torch.Generator())
    with pytest.raises(ValueError, match="num_draft"):
        LayerSkipSpeculative(num_draft=0)
    with pytest.raises(ValueError, match="confidence must be a probability"):
        LayerSkipSpeculative(confidence=1.0)
