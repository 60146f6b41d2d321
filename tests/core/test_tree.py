"""Token trees (`tree=`): several draft continuations verified in one forward, exactly.

Checked as every lossless decoder is: greedy output token-identical to `ar` (LlamaGen with CFG
at batch 1 and 2, Janus-Pro, LLaVA and Qwen2.5-VL batches with left padding; trees of draft
heads, prompt lookup, a drafter model and layer skipping), each
run proven to gain from its tree (fewer forwards than the same proposer's chain, a branch other
than the first accepted); the sampled law by chi-square with the root's children both accepted
and rejected, a later child accepted (heads, drafter and skip trees), and two wrong rules failing the same check (the residual
forgotten at the root; each child judged against the drafter's law instead of the law it was
drawn from without replacement); the tree forward's logits equal to each branch fed alone; bad
options refused with one line before any work.
"""

import copy

import pytest
import torch

from mmgen.decoding import (Autoregressive, DraftSpeculative, ExactAcceptance,
                            GroupedAcceptance, HeadsSpeculative, LayerSkipSpeculative, PromptLookup, make_decoder,
                            parse_decoding)
from mmgen.decoding import tree as tree_module
from mmgen.decoding.proposer import Proposer
from mmgen.decoding.speculative import speculative_decode
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig

from tests.conftest import tiny_transformer
from tests.core.test_decoding import ALPHA, LENGTH, SAMPLINGS, chi_square_pvalue, enumerable, exact_joint  # noqa: F401
from tests.core.test_heads import heads_for
from tests.speculation import assert_streams_its_output

GREEDY = SamplingConfig(temperature=0, guidance=4.0)


class BranchSpy:
    """Counts which branch each tree forward kept (`TreeStep`), over every row."""

    def __init__(self, monkeypatch):
        self.kept = torch.zeros(16, dtype=torch.long)
        self.roots = {"accepted": 0, "rejected": 0}
        greedy, sampled = tree_module.TreeStep._greedy, tree_module.TreeStep._sampled

        def record(out):
            branch, n_acc, _ = out
            self.kept += torch.bincount(branch[n_acc > 0], minlength=16)
            self.roots["accepted"] += int((n_acc > 0).sum())
            self.roots["rejected"] += int((n_acc == 0).sum())
            return out

        monkeypatch.setattr(tree_module.TreeStep, "_greedy", staticmethod(lambda p, tree: record(greedy(p, tree))))
        monkeypatch.setattr(tree_module.TreeStep, "_sampled", lambda self, run, p, tree: record(sampled(self, run, p, tree)))


@pytest.mark.parametrize("labels", [[3], [1, 5]])
@pytest.mark.parametrize("width", [2, 4])
def test_greedy_heads_tree_equals_ar_and_beats_the_chain(labels, width, monkeypatch):
    model = LlamaGenTokenModel(tiny_transformer())
    conditions = torch.tensor(labels)
    ar = Autoregressive().generate(model, conditions, 64, GREEDY, torch.Generator().manual_seed(0))
    chain = HeadsSpeculative(heads=heads_for(model.hidden_size)).generate(model, conditions, 64, GREEDY, torch.Generator())
    spy = BranchSpy(monkeypatch)
    out = HeadsSpeculative(heads=heads_for(model.hidden_size), tree=width).generate(model, conditions, 64, GREEDY, torch.Generator())
    assert torch.equal(out.tokens, ar.tokens) and torch.equal(chain.tokens, ar.tokens)
    assert out.stats.forwards < chain.stats.forwards < ar.stats.forwards
    assert spy.kept[1:].sum() > 0, spy.kept  # a branch other than the heads' own first choice was kept


@pytest.mark.parametrize("labels", [[3], [1, 5]])
def test_greedy_lookup_tree_equals_ar_and_tries_several_copies(labels, monkeypatch):
    model = LlamaGenTokenModel(tiny_transformer())
    conditions = torch.tensor(labels)
    ar = Autoregressive().generate(model, conditions, 64, GREEDY, torch.Generator())
    chain = PromptLookup(num_draft=4, adapt=False).generate(model, conditions, 64, GREEDY, torch.Generator())
    spy = BranchSpy(monkeypatch)
    out = PromptLookup(num_draft=4, tree=3).generate(model, conditions, 64, GREEDY, torch.Generator())
    assert torch.equal(out.tokens, ar.tokens)
    assert out.stats.forwards < chain.stats.forwards
    assert spy.kept[1:].sum() > 0, spy.kept


@pytest.mark.parametrize("family", ["llava", "qwen2.5-vl"])
def test_greedy_vlm_batch_with_padding_tree_equals_ar(family, monkeypatch):
    """Three prompts of different lengths (left padding) on LLaVA and on Qwen2.5-VL (M-RoPE
    positions for the tree's depths)."""
    from tests.vlm.tiny import PROMPTS, images, tiny_llava, tiny_qwen

    pipe = tiny_llava(std=0.1) if family == "llava" else tiny_qwen(std=0.1)
    imgs = images(3)
    ar = pipe(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[], temperature=0)
    spy = BranchSpy(monkeypatch)
    heads = heads_for(pipe.token_model().hidden_size, seed=3)
    out = pipe(PROMPTS, imgs, max_new_tokens=16, stop_token_ids=[], temperature=0,
               decoding=HeadsSpeculative(heads=heads, tree=3))
    assert torch.equal(out.token_ids, ar.token_ids)
    assert spy.roots["accepted"] > 0 and spy.kept[1:].sum() > 0, (spy.roots, spy.kept)


def test_greedy_janus_with_cfg_tree_equals_ar(monkeypatch):
    """Janus-Pro's transformers language model, CFG rows and left padding in its slot cache:
    the tree handed over as a 4-D mask."""
    from mmgen.image_ar.janus import JanusTokenModel
    from tests.image_ar.test_janus import conditions, tiny_janus

    greedy = SamplingConfig(temperature=0, guidance=4.0)
    model = JanusTokenModel(tiny_janus(seed=1, std=0.05, grid=8))
    ar = Autoregressive().generate(model, conditions([0, 1]), 64, greedy, torch.Generator())
    spy = BranchSpy(monkeypatch)
    out = HeadsSpeculative(heads=heads_for(model.hidden_size), tree=3).generate(model, conditions([0, 1]), 64, greedy,
                                                                                torch.Generator())
    assert torch.equal(out.tokens, ar.tokens)
    assert out.stats.forwards < ar.stats.forwards and spy.kept[1:].sum() > 0, (out.stats.forwards, spy.kept)


def test_a_tree_forward_scores_each_branch_as_that_branch_fed_alone():
    """The tree mask and depth positions: each slot's logits equal those of its branch fed
    as a chain after the same committed tokens (CFG rows, batch of two)."""
    model = LlamaGenTokenModel(tiny_transformer())
    conditions, W, d = torch.tensor([1, 4]), 3, 2
    tokens = torch.randint(0, 32, (2, W, d), generator=torch.Generator().manual_seed(0))
    newest = torch.tensor([[5], [7]])
    layout = tree_module.TreeLayout(W, d, torch.device("cpu"))
    state = model.start(conditions, 16, True)
    tree = model.forward_tree(state, torch.cat([newest, tokens.flatten(1)], 1), layout.depth, layout.visible)
    for j in range(W):
        alone = model.start(conditions, 16, True)
        chain = model.forward(alone, torch.cat([newest, tokens[:, j]], 1))
        slots = layout.paths[j]
        torch.testing.assert_close(tree.cond[:, slots], chain.cond, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree.uncond[:, slots], chain.uncond, rtol=1e-5, atol=1e-5)
    # Keeping branch 2 and committing it: the next forward sees what a chain would have left.
    model.keep_path(state, layout.paths[2].expand(2, -1))
    model.commit(state, torch.tensor([d + 1, d + 1]))
    alone = model.start(conditions, 16, True)
    model.forward(alone, torch.cat([newest, tokens[:, 2]], 1))
    model.commit(alone, torch.tensor([d + 1, d + 1]))
    nxt = torch.tensor([[3], [9]])
    torch.testing.assert_close(model.forward(state, nxt).cond, model.forward(alone, nxt).cond, rtol=1e-5, atol=1e-5)


def perturbed(model: LlamaGenTokenModel, noise: float = 0.3, seed: int = 0) -> LlamaGenTokenModel:
    """A drafter that agrees with `model` on much but not all: its copy with a noisy output head."""
    drafter = copy.deepcopy(model.transformer)
    with torch.no_grad():
        drafter.output.weight.add_(torch.randn(drafter.output.weight.shape, generator=torch.Generator().manual_seed(seed)) * noise)
    return LlamaGenTokenModel(drafter)


def tree_decoder(kind: str, model, width: int, num_draft: int = 2):
    """A tree decoder of each proposer that drafts trees, on `model` (a tiny LlamaGen)."""
    if kind == "heads":
        return HeadsSpeculative(heads=heads_for(model.hidden_size, noise=0.3), num_draft=num_draft, tree=width)
    if kind == "draft":
        return DraftSpeculative(drafter=perturbed(model), num_draft=num_draft, tree=width)
    return LayerSkipSpeculative(layers=[0], num_draft=num_draft, tree=width)


def _sampled_tree(model, sampling, monkeypatch, kind="heads"):
    spy = BranchSpy(monkeypatch)
    out = tree_decoder(kind, model, 2).generate(model, torch.full((6000,), 1), LENGTH, sampling, torch.Generator().manual_seed(0))
    return out, spy


@pytest.mark.parametrize("kind", ["heads", "draft", "skip"])
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_sampled_tree_law_is_exact(enumerable, name, kind, monkeypatch):  # noqa: F811
    """6000 rows: the root's children are accepted and rejected, the second child is kept in
    some rows, and the outputs follow the enumerated joint."""
    sampling = SAMPLINGS[name]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    out, spy = _sampled_tree(enumerable, sampling, monkeypatch, kind)
    assert spy.roots["accepted"] > 0 and spy.roots["rejected"] > 0 and spy.kept[1] > 0, (spy.roots, spy.kept)
    assert out.stats.accepted_drafts > 0
    assert chi_square_pvalue(out.tokens, seqs, joint) > ALPHA


@pytest.mark.parametrize("kind", ["draft", "skip"])
@pytest.mark.parametrize("labels", [[3], [1, 5]])
def test_greedy_draft_and_skip_trees_equal_ar(kind, labels, monkeypatch):
    """A drafter model's tree (drafted by tree forwards of its own, its chosen branch kept in its
    cache) and the target's own with a block skipped: token-identical, and a later branch kept."""
    model = LlamaGenTokenModel(tiny_transformer(output_std=1.0))
    conditions = torch.tensor(labels)
    ar = Autoregressive().generate(model, conditions, 64, GREEDY, torch.Generator())
    spy = BranchSpy(monkeypatch)
    out = tree_decoder(kind, model, 3, num_draft=3).generate(model, conditions, 64, GREEDY, torch.Generator())
    assert torch.equal(out.tokens, ar.tokens)
    assert out.stats.forwards < ar.stats.forwards and spy.kept[1:].sum() > 0, (out.stats.forwards, spy.kept)


def test_a_tree_that_forgets_the_root_residual_fails_the_law(enumerable, monkeypatch):  # noqa: F811
    sampling = SAMPLINGS["plain"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    monkeypatch.setattr(tree_module, "residual_distribution", lambda p, q: p)
    out, _ = _sampled_tree(enumerable, sampling, monkeypatch)
    assert chi_square_pvalue(out.tokens, seqs, joint) <= ALPHA


def test_children_judged_against_the_drafter_law_fail_the_law(enumerable, monkeypatch):  # noqa: F811
    """Drawn without replacement, child j's law is q without the children before it; judging
    it against q itself is the with-replacement rule on draws that are not, and biased."""
    sampling = SAMPLINGS["plain"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    distinct = tree_module.distinct_children

    def with_replacement_laws(q, width, generator, greedy, ranking=None):
        tokens, laws, valid = distinct(q, width, generator, greedy, ranking)
        return tokens, q[:, None].expand(-1, width, -1), valid

    monkeypatch.setattr(tree_module, "distinct_children", with_replacement_laws)
    out, _ = _sampled_tree(enumerable, sampling, monkeypatch)
    assert chi_square_pvalue(out.tokens, seqs, joint) <= ALPHA


def test_bad_tree_options_are_one_line_errors_before_any_work():
    model = LlamaGenTokenModel(tiny_transformer())
    starts = []
    start = model.start
    model.start = lambda *args: (starts.append(1), start(*args))[1]
    for bad in (1, -2, 2.5, True):
        with pytest.raises(ValueError, match="tree must be 0"):
            HeadsSpeculative(heads=heads_for(model.hidden_size), tree=bad)
    with pytest.raises(ValueError, match="leave confidence out"):
        HeadsSpeculative(heads=heads_for(model.hidden_size), tree=2, confidence=0.3)
    with pytest.raises(ValueError, match="proposes no trees") as error:
        speculative_decode(model, torch.tensor([1]), 8, GREEDY, torch.Generator(), Proposer(), ExactAcceptance(), tree=2)
    assert "\n" not in str(error.value) and not starts
    with pytest.raises(ValueError, match="exact rule"):
        HeadsSpeculative(heads=heads_for(model.hidden_size), tree=2, acceptance=GroupedAcceptance()).generate(
            model, torch.tensor([1]), 8, GREEDY, torch.Generator())
    assert not starts
    name, options = parse_decoding("heads:tree=3")
    assert make_decoder(name, **options).tree == 3
    assert make_decoder(*parse_decoding("lookup:tree=2")[:1], **parse_decoding("lookup:tree=2")[1]).tree == 2


def test_continuous_batching_refuses_a_tree_before_any_work():
    from mmgen.decoding.batching import Request, continuous_decode

    model = LlamaGenTokenModel(tiny_transformer())
    with pytest.raises(ValueError, match="token trees decode static batches"):
        continuous_decode(HeadsSpeculative(heads=heads_for(model.hidden_size), tree=2), model,
                          [Request(torch.tensor([1]), torch.Generator())], 8, GREEDY, batch_size=2)


def test_trees_stream_stop_and_reproduce_their_seed():
    """Streaming hands each row its tokens as they commit, stop tokens and per-row budgets end
    rows inside a kept branch as under `ar`, and a sampled tree decode repeats under its seed."""
    from mmgen.decoding import Stopping

    model = LlamaGenTokenModel(tiny_transformer())
    decoder = HeadsSpeculative(heads=heads_for(model.hidden_size), tree=3)
    assert_streams_its_output(decoder, model, GREEDY)

    ar = Autoregressive().generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator())
    stopping = Stopping(stop_tokens=[int(ar.tokens[0, 6])], max_new_tokens=[32, 9])
    expected = Autoregressive().generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator(), stopping=stopping)
    out = decoder.generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator(), stopping=stopping)
    assert torch.equal(out.lengths, expected.lengths) and torch.equal(out.tokens, expected.tokens)

    sampling = SamplingConfig(temperature=1.0, top_k=8, guidance=2.0)
    a, b = (decoder.generate(model, torch.tensor([1, 2]), 32, sampling, torch.Generator().manual_seed(5)) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens) and a.stats.accepted_drafts > 0


def test_a_vlm_that_cannot_verify_trees_is_refused_before_its_prefill(monkeypatch):
    """Sliding-window layers (Gemma 3 mixes them with full ones) or the generation config's
    logits processing: one line, before the prompt is prefilled."""
    from tests.vlm.tiny import PROMPTS, images, tiny_gemma3, tiny_llava

    gemma = tiny_gemma3()
    llava = tiny_llava()
    llava.model.generation_config.repetition_penalty = 1.3  # logits processing that reads each row's tokens in order
    for pipe, why in ((gemma, "sliding-window layers"), (llava, "logits processing")):
        model = pipe.token_model()
        starts = []
        monkeypatch.setattr(type(model), "start", lambda self, *a, **k: starts.append(1))
        with pytest.raises(ValueError, match=why) as error:
            pipe(PROMPTS[:1], images(1), max_new_tokens=4, temperature=0,
                 decoding=HeadsSpeculative(heads=heads_for(model.hidden_size), tree=2))
        assert "\n" not in str(error.value) and not starts
        monkeypatch.undo()
