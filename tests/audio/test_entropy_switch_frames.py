"""Entropy switching on codec frames (Dia: parallel codebooks; CSM: codebooks completed by the
model's depth decoder), through `TTSPipeline` and directly on the token models: per-row ends,
greedy and seeded parity with autoregressive decoding, honest stage counters, streaming."""

from __future__ import annotations

import math

import pytest
import torch

from mmgen.decoding import EntropySwitch
from mmgen.sampling import SamplingConfig

from tests.audio.tiny import tiny_csm, tiny_dia

TEXTS = {"dia": ["[S1] Hello there.", "[S1] Something else entirely, and longer.", "[S1] Three."],
         "csm": ["Hello there.", "Something else entirely, and longer.", "Three."]}
GREEDY_FRAMES = {"dia": 30, "csm": 16}
# A mix of small and large frames with rows that end on their own. The tiny random CSM is almost
# uniform over its top 3 codes (frames just under ln 3 nats), so its threshold sits just below.
MIXED = {"dia": dict(max_new_frames=30, temperature=1.0, top_k=8, threshold=2.0),
         "csm": dict(max_new_frames=24, temperature=1.0, top_k=3, threshold=math.log(3) - 0.002)}


@pytest.fixture(scope="module")
def pipes():
    """(large, a distinct small) per family; rows end on their own at different frames."""
    return {"dia": (tiny_dia(0, eos_boost=2.0), tiny_dia(3, eos_boost=2.0)),
            "csm": (tiny_csm(0, eos_boost=3.0), tiny_csm(5, eos_boost=3.0))}


def stop_frames(stopping, frames: torch.Tensor) -> torch.Tensor:
    """Which frames [n, K] end a row under `stopping` (its stop codebook, or all of a tuple)."""
    codebooks = stopping.stop_codebook
    codebooks = list(codebooks) if isinstance(codebooks, tuple) else [codebooks]
    return torch.isin(frames[:, codebooks], torch.tensor(stopping.stop_tokens)).all(-1)


def assert_rows_end_at_their_stop_frame(pipe, frames: torch.Tensor, lengths: torch.Tensor, budget: int) -> None:
    stopping = pipe.adapter.stopping(budget)
    for b, n in enumerate(lengths.tolist()):
        stops = stop_frames(stopping, frames[b, :n])
        assert not stops[:-1].any() and (bool(stops[-1]) or n == budget)  # through the first stop frame only
        assert (frames[b, n:] == stopping.pad_token).all()
    assert (lengths < budget).any()  # some row ended on its own


@pytest.mark.parametrize("family", ["dia", "csm"])
@pytest.mark.parametrize("threshold", [0.0, math.inf])
def test_greedy_with_the_model_as_its_own_small_model_equals_ar(pipes, family, threshold):
    """Greedy laws are one-hot (0 nats), so even threshold 0 leaves every frame to the small
    model, which here is the large one with its own cache: AR's frames, ends and padding."""
    pipe, texts, frames = pipes[family][0], TEXTS[family], GREEDY_FRAMES[family]
    ar = pipe(texts, max_new_frames=frames, temperature=0)
    out = pipe(texts, max_new_frames=frames, temperature=0, decoding=EntropySwitch(small=pipe, threshold=threshold))
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)
    assert all(torch.equal(a, b) for a, b in zip(out.audio, ar.audio))
    assert len(set(ar.lengths.tolist())) > 1 and out.stats.tokens == ar.stats.tokens
    assert out.stats.stage_forwards == [1, ar.stats.forwards] and out.stats.stage_tokens == [0, int(ar.lengths.sum())]
    assert_rows_end_at_their_stop_frame(pipe, out.frames, out.lengths, frames)


@pytest.mark.parametrize("family, small, threshold", [("dia", "other", 0.0), ("dia", "self", math.inf),
                                                       ("csm", "self", math.inf)])
def test_sampled_frames_are_ar_frames_for_the_same_seed(pipes, family, small, threshold):
    """One draw per frame from the chosen model's law, as AR draws it: threshold 0 is the large
    model's AR output (every sampled frame has entropy), threshold inf the small model's. CSM's
    small model draws and completes its frame before the switch decides, as AR does."""
    pipe, other = pipes[family]
    kwargs = dict(max_new_frames=MIXED[family]["max_new_frames"], temperature=1.0, top_k=3)
    ar = pipe(TEXTS[family], generator=torch.Generator().manual_seed(1), **kwargs)
    decoder = EntropySwitch(small=other if small == "other" else pipe, threshold=threshold)
    out = pipe(TEXTS[family], generator=torch.Generator().manual_seed(1), decoding=decoder, **kwargs)
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)
    total = int(ar.lengths.sum())
    assert out.stats.stage_tokens == ([total, 0] if threshold == 0 else [0, total])


class Recording:
    """A frame token model that records each forward: each row's committed frames before it,
    the frames fed, and codebook 0's logits after the last of them; and for a model that
    completes frames (CSM), the fed position each completion starts from."""

    def __init__(self, inner):
        self.inner, self.calls, self.fed, self.slots = inner, [], None, []
        if hasattr(inner, "complete_frame"):
            self.complete_frame = self._complete_frame

    def _complete_frame(self, state, slot, *args):
        self.slots.append((len(self.calls), slot.clone()))
        return self.inner.complete_frame(state, slot, *args)

    def __getattr__(self, name):  # num_codebooks, vocab_size, complete_frame (CSM), rewind
        return getattr(self.inner, name)

    def start(self, conditions, capacity, guidance):
        state = self.inner.start(conditions, capacity, guidance)
        self.fed = torch.zeros(state.batch_size, dtype=torch.long)
        return state

    def forward(self, state, tokens):
        logits = self.inner.forward(state, tokens)
        self.calls.append((self.fed.clone(), tokens.shape[1], logits.cond[:, -1, 0].clone()))
        return logits

    def commit(self, state, accepted):
        self.fed += accepted.cpu()
        self.inner.commit(state, accepted)


@pytest.mark.parametrize("family", ["dia", "csm"])
def test_mixed_threshold_ends_rows_and_counts_the_large_model_honestly(pipes, family):
    """A distinct small model: rows end at their stop frame, the large model catches up on
    several frames in one forward with the logits of a teacher-forced pass, and the stage
    counters are its real forwards and the frames each model sampled."""
    pipe, small = pipes[family]
    mixed = MIXED[family]
    conditions, budget = pipe.prepare(TEXTS[family], max_new_frames=mixed["max_new_frames"])
    large = Recording(pipe.token_model())
    out = EntropySwitch(small=small, threshold=mixed["threshold"]).generate(
        large, conditions, budget, pipe.sampling(mixed["temperature"], mixed["top_k"], None),
        torch.Generator().manual_seed(0), stopping=pipe.adapter.stopping(budget))
    assert_rows_end_at_their_stop_frame(pipe, out.tokens, out.lengths, budget)
    lengths, stats = out.lengths, out.stats
    total = int(lengths.sum())
    assert stats.tokens == int(lengths.max())
    assert stats.stage_forwards == [1 + len(large.calls), stats.tokens]  # the small model runs once per frame
    assert stats.forwards == sum(stats.stage_forwards)
    assert sum(stats.stage_tokens) == total and len(large.calls) <= stats.stage_tokens[0] < total
    assert any(n > 1 for _, n, _ in large.calls)  # a catch-up over several frames
    reference = pipe.token_model()
    state = reference.start(conditions, budget + 2, False)
    history = out.tokens[:, :-1].masked_fill(out.tokens[:, :-1] >= reference.vocab_size, 0)  # CSM's padding is no code
    full = reference.forward(state, history).cond[:, :, 0]  # compared only where rows were still decoding
    # CSM: one completion per frame the large model takes (after each of its forwards, or after
    # its prefill at frame 0), from the newest frame fed.
    assert len(large.slots) - len(large.calls) in (0, 1) if family == "csm" else not large.slots
    for forwards, slot in large.slots:
        assert (slot == (large.calls[forwards - 1][1] - 1 if forwards else 0)).all()
    for fed, n, last in large.calls:
        t = int(fed.max()) + n  # the frame these logits predict
        rows = lengths > t  # rows still decoding then: every frame before t is theirs
        assert (fed[rows] == t - n).all()
        torch.testing.assert_close(last[rows], full[rows, t - 1], rtol=1e-4, atol=1e-4)


class Collect:
    """A streamer keeping every row's chunks."""

    def __init__(self):
        self.chunks: dict[int, list] = {}
        self.puts = self.ends = 0

    def put(self, rows):
        self.puts += 1
        for b, new in enumerate(rows):
            self.chunks.setdefault(b, []).append(new.clone())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("family", ["dia", "csm"])
def test_streamer_receives_the_output_frames(pipes, family):
    pipe, small = pipes[family]
    mixed = dict(MIXED[family])
    decoder = EntropySwitch(small=small, threshold=mixed.pop("threshold"))
    streamer = Collect()
    out = pipe(TEXTS[family], decoding=decoder, generator=torch.Generator().manual_seed(0), streamer=streamer, **mixed)
    assert streamer.ends == 1 and streamer.puts == out.stats.tokens  # after the prefill's frame, then every step
    for b, n in enumerate(out.lengths.tolist()):
        assert torch.equal(torch.cat(streamer.chunks[b]), out.frames[b, :n])
        assert sum(len(c) > 0 for c in streamer.chunks[b]) == n  # one frame per step while the row decodes


def test_small_model_of_another_frame_layout_is_refused(pipes):
    dia, csm = pipes["dia"][0], pipes["csm"][1]
    with pytest.raises(ValueError, match="another codec layout"):  # the pipeline's companion check
        dia(TEXTS["dia"][0], max_new_frames=8, decoding=EntropySwitch(small=csm))
    conditions, budget = dia.prepare(TEXTS["dia"][0], max_new_frames=8)
    with pytest.raises(ValueError, match="must decode the same frames"):  # the decoder's own
        EntropySwitch(small=csm.token_model()).generate(dia.token_model(), conditions, budget, SamplingConfig(temperature=0.0),
                                                        torch.Generator().manual_seed(0))
