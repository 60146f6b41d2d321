"""Next-scale decoders on a toy `ScaleModel`: the schedule, the hand-off, guidance ramps, errors."""

import pytest
import torch

from mmgen.decoding import SCALE_DECODERS, Collaborative, NextScale, resolve_decoder
from mmgen.modeling import ScaleModel, ScaleState
from mmgen.sampling import Logits, RampGuidance, SamplingConfig


class ToyScaleModel:
    """Logits of step k depend on every earlier map through a running token sum; each call
    records which maps it was fed."""

    def __init__(self, vocab_size=6, step_sizes=(1, 4, 9), seed=0):
        self.vocab_size, self.step_sizes = vocab_size, step_sizes
        self.table = torch.randn(len(step_sizes), 50, vocab_size, generator=torch.Generator().manual_seed(seed))
        self.calls, self.starts = [], []

    def start(self, conditions, num_steps, guidance):
        self.starts.append(num_steps)
        return ScaleState(cache=torch.zeros(num_steps), batch_size=len(conditions), guidance=guidance,
                          device=torch.device("cpu"), extra={"sum": conditions.clone().long()})

    def forward(self, state, token_maps):
        self.calls.append([m.shape[1] for m in token_maps])
        for m in token_maps:
            state.extra["sum"] = state.extra["sum"] + m.sum(1) * (state.steps_fed + 1)
            state.steps_fed += 1
        k = state.steps_fed
        rows = self.table[k, state.extra["sum"] % 50]  # [B, V]
        cond = rows[:, None].expand(-1, self.step_sizes[k], -1) + torch.arange(self.step_sizes[k])[None, :, None] * 0.1
        return Logits(cond, cond * 0.3 if state.guidance else None)


def run(decoder, model, seed=0, sampling=None, labels=(1, 2, 3)):
    sampling = sampling or SamplingConfig()
    return decoder.generate(model, torch.tensor(labels), sampling, torch.Generator().manual_seed(seed))


def test_toy_is_a_scale_model():
    assert isinstance(ToyScaleModel(), ScaleModel)


def test_next_scale_feeds_one_map_per_step_and_returns_every_map():
    model = ToyScaleModel()
    out = run(NextScale(), model)
    assert [t.shape for t in out.tokens] == [(3, 1), (3, 4), (3, 9)]
    assert model.calls == [[], [1], [4]] and model.starts == [3]
    assert out.stats.forwards == 3 and out.stats.tokens == 14 and out.stats.stage_forwards == [3]


def test_collaborative_hands_off_with_one_prefill_of_every_large_model_map():
    large, small = ToyScaleModel(seed=1), ToyScaleModel(seed=2)
    out = run(Collaborative(small=small, large_steps=2), large)
    assert large.calls == [[], [1]] and large.starts == [2]  # the large model's cache holds its 2 steps only
    assert small.calls == [[1, 4]] and small.starts == [3]
    assert out.stats.stage_forwards == [2, 1] and out.stats.forwards == 3
    assert out.stats.stage_tokens == [3 * 5, 3 * 9] and out.stats.step_compression == 1.0  # one forward per scale, as AR


def test_collaborative_gives_the_large_model_all_but_the_last_two_steps_by_default():
    for sizes, split in (((1, 4, 9), [1, 2]), ((1, 2, 3, 4, 5, 6), [4, 2]), ((1, 4), [1, 1])):
        large, small = ToyScaleModel(step_sizes=sizes, seed=1), ToyScaleModel(step_sizes=sizes, seed=2)
        assert run(Collaborative(small=small), large).stats.stage_forwards == split


def test_collaborative_with_the_same_model_equals_next_scale():
    for seed in range(5):
        a = run(NextScale(), ToyScaleModel(seed=3), seed=seed, sampling=SamplingConfig(guidance=RampGuidance(2.0, 3)))
        b = run(Collaborative(small=ToyScaleModel(seed=3), large_steps=1), ToyScaleModel(seed=3), seed=seed,
                sampling=SamplingConfig(guidance=RampGuidance(2.0, 3)))
        assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))


def test_three_stage_schedule():
    a, b, c = ToyScaleModel(seed=1), ToyScaleModel(seed=2), ToyScaleModel(seed=3)
    out = run(Collaborative(handoffs=[(None, 0), (b, 1), (c, 2)]), a)
    assert (a.calls, b.calls, c.calls) == ([[]], [[1]], [[1, 4]])
    assert out.stats.stage_forwards == [1, 1, 1]


def test_ramp_guidance_matches_the_official_formula():
    g = RampGuidance(1.5, num_steps=10)
    c, u = torch.randn(2, 5), torch.randn(2, 5)
    for k in range(10):
        t = 1.5 * k / 9
        from mmgen.sampling import apply_guidance

        guided = apply_guidance(Logits(c, u), g.scales(torch.full((2,), k)))
        torch.testing.assert_close(guided, (1 + t) * c - t * u)
    assert g.max_scale == 2.5 and SamplingConfig(guidance=RampGuidance(0.0, 10)).uses_guidance is False


def test_bad_schedules_and_specs_are_clear_errors():
    model = ToyScaleModel()
    with pytest.raises(ValueError, match="needs small="):
        run(Collaborative(), model)
    with pytest.raises(ValueError, match="must start at 0"):
        run(Collaborative(small=ToyScaleModel(), large_steps=3), model)
    with pytest.raises(ValueError, match="share the tokenizer"):
        run(Collaborative(small=ToyScaleModel(vocab_size=7), large_steps=1), model)
    with pytest.raises(ValueError, match="large_steps"):
        Collaborative(large_steps=0)
    assert isinstance(resolve_decoder("collaborative:large_steps=4", SCALE_DECODERS), Collaborative)
    assert isinstance(resolve_decoder("ar", SCALE_DECODERS), NextScale)
    with pytest.raises(ValueError, match="unknown decoding"):
        resolve_decoder("sjd", SCALE_DECODERS)


def test_all_masked_step_is_an_error_not_nan():
    from mmgen.sampling import AllTokensMaskedError

    model = ToyScaleModel()
    model.table[1] = float("nan")
    with pytest.raises(AllTokensMaskedError):
        run(NextScale(), model)


def test_pruning_specs():
    from mmgen.decoding import CachedTokenPruning

    assert CachedTokenPruning.from_spec("8=0.6,9=0.5") == CachedTokenPruning({8: 0.6, 9: 0.5})
    assert CachedTokenPruning.from_spec("-1=0.5@0:").layers == (0, None)
    assert CachedTokenPruning.from_spec("5=0.5@3:-4").layers == (3, -4)
    for bad, message in (("5:0.5", "bad item"), ("", "names no step"), ("5=0.5@a:b", "bad block range"), ("5=1.5", "keep ratio")):
        with pytest.raises(ValueError, match=message):
            CachedTokenPruning.from_spec(bad)
