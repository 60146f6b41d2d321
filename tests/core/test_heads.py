"""Draft heads (`heads`): a recurrent head on the target's final hidden state drafts for it.

Checked as every lossless proposer is: greedy output token-identical to `ar` (LlamaGen with
CFG, Dia's frames with guidance, a LLaVA batch with left padding), each run proven to have
drafted (drafts accepted, fewer forwards than `ar`); the sampled law by chi-square with
drafts both accepted and rejected and a wrong rule failing the same check; continuous batching
equal to each request alone; heads found in a model folder's `draft_heads/`; bad heads refused
with one line before any work. Untrained heads start as the identity (their first draft is the
newest token's own law), which on these tiny models already drafts often.
"""

import pytest
import torch

from mmgen.decoding import Autoregressive, DraftHeads, DraftHeadsConfig, HeadsSpeculative, make_decoder
from mmgen.hub import CheckpointError
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig

from tests.conftest import tiny_transformer
from tests.core.test_decoding import ALPHA, LENGTH, SAMPLINGS, chi_square_pvalue, enumerable, exact_joint  # noqa: F401
from tests.speculation import (
    RULE_CASES, assert_confidence_stop_keeps_the_law, assert_confidence_stop_stays_greedy, assert_continuous_equals_alone,
    assert_drafted, assert_streams_its_output, rule,
)

GREEDY = SamplingConfig(top_k=1, guidance=4.0)
TEXTS = ["[S1] Hello there.", "[S1] Something else entirely, and longer.", "[S1] Three."]


def heads_for(hidden_size: int, seed: int = 0, noise: float = 0.05, num_drafts: int = 3) -> DraftHeads:
    """Heads near the identity: random, the same for a seed (their initialisation too, drawn from
    the global generator, is seeded in a fork of it), drafting often on a tiny model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = DraftHeads(DraftHeadsConfig(hidden_size, num_drafts=num_drafts))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise)
    return heads


@pytest.mark.parametrize("labels", [[3], [1, 5]])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_llamagen_with_cfg_is_token_identical_to_ar(labels, seed):
    model = LlamaGenTokenModel(tiny_transformer())
    conditions = torch.tensor(labels)
    ar = Autoregressive().generate(model, conditions, 64, GREEDY, torch.Generator().manual_seed(0))
    out = HeadsSpeculative(heads=heads_for(model.hidden_size, seed)).generate(
        model, conditions, 64, GREEDY, torch.Generator().manual_seed(1))
    assert torch.equal(out.tokens, ar.tokens)
    assert_drafted(out, ar)
    assert 0 < out.stats.accepted_drafts < out.stats.drafted
    assert out.stats.draft_forwards == 3 * (out.stats.forwards - 1)  # three head steps before each verify


@pytest.mark.parametrize("guidance", [None, 3.0])
def test_greedy_dia_frames_equal_ar(guidance):
    """Three rows of different lengths (padded templates) ending at different frames: whole
    frames drafted by the heads (every codebook from the output head at once), Dia's own
    guidance applied to the heads' two halves."""
    from tests.audio.tiny import tiny_dia

    pipe = tiny_dia(0, eos_boost=2.0)
    kwargs = dict(max_new_frames=30, temperature=0, guidance_scale=guidance)
    ar = pipe(TEXTS, **kwargs)
    out = pipe(TEXTS, **kwargs, decoding=HeadsSpeculative(heads=heads_for(pipe.token_model().hidden_size)))
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)
    assert_drafted(out, ar)


def test_greedy_llava_batch_with_padding_equals_ar():
    from tests.vlm.tiny import PROMPTS, images, tiny_llava

    llava = tiny_llava(std=0.1)
    imgs = images(3)
    ar = llava(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[])
    heads = heads_for(llava.token_model().hidden_size, seed=3)  # fixed random heads that draft on this model
    out = llava(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[], decoding=HeadsSpeculative(heads=heads))
    assert torch.equal(out.token_ids, ar.token_ids)
    assert_drafted(out, ar)


@pytest.mark.parametrize("rule_name,lossless", RULE_CASES)
def test_sampled_law_is_exact(enumerable, rule_name, lossless):  # noqa: F811
    """6000 rows with CFG, temperature and top-k: the heads' drafts are accepted and rejected
    (counted), and the outputs follow the enumerated joint; a rule that forgets the residual
    fails the same check."""
    sampling = SAMPLINGS["cfg+temperature+top_k"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    acceptance = rule(rule_name)
    out = HeadsSpeculative(heads=heads_for(enumerable.hidden_size, noise=0.3), num_draft=2, acceptance=acceptance).generate(
        enumerable, torch.full((6000,), 1), LENGTH, sampling, torch.Generator().manual_seed(0))
    assert acceptance.speculated(), acceptance.counts
    assert (chi_square_pvalue(out.tokens, seqs, joint) > ALPHA) == lossless


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0, top_k=16, guidance=3.0), GREEDY], ids=["sampled", "greedy"])
def test_continuous_batching_equals_each_request_alone(sampling):
    """Rows restart on new requests (their heads start from the new prefill's hidden state) and
    the batch narrows and widens: each request decodes what it decodes alone."""
    model = LlamaGenTokenModel(tiny_transformer(output_std=1.5))
    assert_continuous_equals_alone(HeadsSpeculative(heads=heads_for(model.hidden_size)), model, sampling)


def test_a_model_folder_s_heads_are_found_and_saved_heads_load_back(tmp_path):
    from tests.conftest import tiny_pipeline

    pipe = tiny_pipeline()
    pipe.save_pretrained(tmp_path / "model")
    from mmgen import load_pipeline

    loaded = load_pipeline(tmp_path / "model")
    with pytest.raises(ValueError, match="decoding 'heads' needs draft heads"):
        loaded(class_labels=[1], decoding="heads")
    heads = heads_for(pipe.token_model().hidden_size, num_drafts=2)
    heads.save_pretrained(tmp_path / "model" / "draft_heads")
    loaded = load_pipeline(tmp_path / "model")
    decoder = loaded.decoder("heads")
    assert decoder.drafts == 2
    for a, b in zip(decoder.heads.state_dict().values(), heads.state_dict().values()):
        assert torch.equal(a, b)
    ar = loaded(class_labels=[1, 2], decoding="ar", temperature=0, output_type="pt")
    out = loaded(class_labels=[1, 2], decoding="heads:num_draft=4", temperature=0, output_type="pt")
    assert torch.equal(ar.images, out.images)


def test_bad_heads_are_one_line_errors_before_any_work(tmp_path):
    model = LlamaGenTokenModel(tiny_transformer())
    starts = []
    start = model.start
    model.start = lambda *args: (starts.append(1), start(*args))[1]
    with pytest.raises(ValueError, match="draft heads of hidden size 48 do not fit a model of hidden size") as error:
        HeadsSpeculative(heads=DraftHeads(DraftHeadsConfig(48))).generate(model, torch.tensor([1]), 8, GREEDY, torch.Generator())
    assert "\n" not in str(error.value) and not starts
    with pytest.raises(ValueError, match="num_draft"):
        make_decoder("heads", num_draft=0)
    folder = tmp_path / "heads"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8, "layers": 2}')
    with pytest.raises(CheckpointError, match="not a draft heads config"):
        HeadsSpeculative(heads=str(folder)).generate(model, torch.tensor([1]), 8, GREEDY, torch.Generator())
    assert not starts


def test_greedy_janus_with_cfg_equals_ar():
    """Janus-Pro's image tokens (transformers model, its own generation head and image
    embeddings, CFG rows in the same cache): a left-padded pair."""
    from mmgen.image_ar.janus import JanusTokenModel
    from tests.image_ar.test_janus import GREEDY_CFG4, conditions, tiny_janus

    model = JanusTokenModel(tiny_janus(seed=1, std=0.05, grid=8))
    ar = Autoregressive().generate(model, conditions([0, 1]), 64, GREEDY_CFG4, torch.Generator().manual_seed(0))
    out = HeadsSpeculative(heads=heads_for(model.hidden_size)).generate(
        model, conditions([0, 1]), 64, GREEDY_CFG4, torch.Generator().manual_seed(1))
    assert torch.equal(out.tokens, ar.tokens)
    assert_drafted(out, ar)


def test_a_confidence_stop_drafts_fewer_and_keeps_greedy_output_and_the_law(enumerable):  # noqa: F811
    """`confidence`: a round stops at a draft the heads were unsure of; where it stops depends
    only on drafts already drawn, so greedy output and the sampled law stay the model's."""
    model = LlamaGenTokenModel(tiny_transformer())
    out = assert_confidence_stop_stays_greedy(HeadsSpeculative(heads=heads_for(model.hidden_size), num_draft=4, confidence=0.5),
                                              model, torch.tensor([1, 5]), num_draft=4)
    assert out.stats.draft_forwards == sum(out.stats.drafts_per_forward)  # one heads forward per draft
    assert_confidence_stop_keeps_the_law(HeadsSpeculative(heads=heads_for(enumerable.hidden_size, noise=0.3), num_draft=3,
                                                          confidence=0.6), enumerable, num_draft=3)


def test_heads_stream_stop_and_take_any_acceptance_rule():
    """Streaming hands each row its tokens as they commit (the same as the output), stop tokens
    and per-row budgets end rows mid-window as under `ar`, and a lossy rule (grouped
    acceptance) runs on the heads' drafts and laws, seeded."""
    from mmgen.decoding import GroupedAcceptance, Stopping

    model = LlamaGenTokenModel(tiny_transformer())
    heads = heads_for(model.hidden_size)
    assert_streams_its_output(HeadsSpeculative(heads=heads), model, GREEDY)

    ar = Autoregressive().generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator())
    stop = int(ar.tokens[0, 6])  # row 0 ends at its first such token
    stopping = Stopping(stop_tokens=[stop], max_new_tokens=[32, 9])
    expected = Autoregressive().generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator(), stopping=stopping)
    out = HeadsSpeculative(heads=heads).generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator(), stopping=stopping)
    assert torch.equal(out.lengths, expected.lengths) and torch.equal(out.tokens, expected.tokens)

    sampling = SamplingConfig(temperature=1.0, top_k=8, guidance=2.0)
    run = lambda: HeadsSpeculative(heads=heads, acceptance=GroupedAcceptance()).generate(
        model, torch.tensor([1, 2]), 32, sampling, torch.Generator().manual_seed(5))
    a, b = run(), run()
    assert torch.equal(a.tokens, b.tokens) and a.stats.accepted_drafts > 0
