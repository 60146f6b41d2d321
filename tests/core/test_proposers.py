"""Proposers: spatial draft initialisations, coupled Jacobi and draft-model speculation.

Every lossless combination is checked both ways: greedy outputs token-identical to
autoregressive decoding (batch 1 and 4, with CFG), and sampled outputs matching the exact
enumerated joint by the same chi-square test as SJD (tests/core/test_decoding.py).
"""

import pytest
import torch

from mmgen.decoding import (
    Autoregressive, CoupledJacobi, DraftSpeculative, LeftNeighbourInit, SpeculativeJacobi, make_decoder,
)
from mmgen.decoding.coupled import CounterNoise
from mmgen.decoding.jacobi_init import AboveNeighbourInit, DraftContext
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig

from tests.conftest import tiny_transformer
from tests.core.test_decoding import ALPHA, LENGTH, SAMPLINGS, VOCAB, chi_square_pvalue, enumerable, exact_joint  # noqa: F401
from tests.speculation import assert_confidence_stop_keeps_the_law, assert_confidence_stop_stays_greedy, assert_drafted

DRAFTER = LlamaGenTokenModel(tiny_transformer(seed=7))


def near_drafter(noise: float = 0.2) -> LlamaGenTokenModel:
    """The greedy tests' target (`tiny_transformer()`) with noise on its output head: a drafter
    that agrees with it on many greedy tokens but not all (DRAFTER, another random model, agrees
    on none, so a draft decode beside it is autoregression)."""
    transformer = tiny_transformer()
    with torch.no_grad():
        transformer.output.weight.add_(torch.randn(transformer.output.weight.shape, generator=torch.Generator().manual_seed(7)) * noise)
    return LlamaGenTokenModel(transformer)


NEAR = near_drafter()


def lossless_decoders():
    return {
        "sjd-left": SpeculativeJacobi(window=8, draft_init="left"),
        "sjd-uniform-q": SpeculativeJacobi(window=8, draft_init="random-uniform"),
        "sjd-above": SpeculativeJacobi(window=8, draft_init=AboveNeighbourInit()),
        "coupled-16": CoupledJacobi(window=16),
        "coupled-left": CoupledJacobi(window=4, draft_init=LeftNeighbourInit()),
        "draft-4": DraftSpeculative(drafter=NEAR, num_draft=4),
        "draft-1": DraftSpeculative(drafter=NEAR, num_draft=1),
        "coupled-4096": CoupledJacobi(window=4096),  # clamped to the 64 tokens
        "sjd-window-1": SpeculativeJacobi(window=1),
        "coupled-window-1": CoupledJacobi(window=1),
    }


@pytest.mark.parametrize("labels", [[3], [1, 5, 7, 9]])
@pytest.mark.parametrize("name", sorted(lossless_decoders()))
def test_greedy_is_token_identical_to_ar(name, labels):
    model = LlamaGenTokenModel(tiny_transformer())
    sampling = SamplingConfig(top_k=1, guidance=4.0)
    conditions = torch.tensor(labels)
    ar = Autoregressive().generate(model, conditions, 64, sampling, torch.Generator().manual_seed(0))
    out = lossless_decoders()[name].generate(model, conditions, 64, sampling, torch.Generator().manual_seed(1))
    assert torch.equal(ar.tokens, out.tokens)
    if name.endswith("window-1"):  # no room for a draft: autoregressive steps
        assert out.stats.forwards == ar.stats.forwards
    else:
        assert_drafted(out, ar)


@pytest.mark.parametrize("name", ["sjd-left", "sjd-above", "sjd-uniform-q", "coupled-left", "draft-2"])
def test_sampling_matches_exact_distribution(enumerable, name):
    sampling = SAMPLINGS["cfg+temperature+top_k"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    # Fixed windows: at 6000 rows a draft costs about a whole step, so the adaptive window would
    # decode autoregressively (its own exactness: tests/core/test_adaptive_window.py).
    decoder = {
        "sjd-left": SpeculativeJacobi(window=3, draft_init="left", adapt=False),
        "sjd-uniform-q": SpeculativeJacobi(window=3, draft_init="random-uniform", adapt=False),
        "coupled-left": CoupledJacobi(window=3, draft_init="left"),
        "sjd-above": SpeculativeJacobi(window=3, draft_init=AboveNeighbourInit(row_length=2), adapt=False),
        "draft-2": DraftSpeculative(drafter=LlamaGenTokenModel(tiny_transformer(vocab_size=VOCAB, block_size=LENGTH, num_classes=3, seed=11)), num_draft=2),
    }[name]
    out = decoder.generate(enumerable, torch.full((6000,), 1), LENGTH, sampling, torch.Generator().manual_seed(0))
    assert out.stats.mean_accepted_length > 1.1, "drafts were hardly ever accepted: the test would not exercise the method"
    assert chi_square_pvalue(out.tokens, seqs, joint) > ALPHA


@pytest.mark.parametrize("labels", [[3], [1, 5, 7, 9]])
def test_a_confidence_stop_drafts_fewer_in_some_rounds_and_stays_token_identical(labels):
    """`confidence`: a row drops out of a round at a draft its drafter gave less than that
    probability, and the round stops once fewer than half the rows are left; greedy output stays
    AR's, with CFG, alone and in a batch, and the stats say how many drafts each forward verified."""
    out = assert_confidence_stop_stays_greedy(DraftSpeculative(drafter=NEAR, num_draft=4, confidence=0.4),
                                              LlamaGenTokenModel(tiny_transformer()), torch.tensor(labels), num_draft=4)
    counts = out.stats.drafts_per_forward
    assert min(counts) == 1 and out.stats.draft_forwards == 1 + sum(counts)  # the drafter's prefill, then one per draft
    with pytest.raises(ValueError, match="confidence must be a probability"):
        DraftSpeculative(drafter=DRAFTER, confidence=1.0)


def test_a_confidence_stop_keeps_the_exact_distribution(enumerable):  # noqa: F811
    """Where a round stops depends on the drafts drawn so far (in every row of the batch), so the
    target still judges every draft it is given: the sampled sequences follow the exact joint."""
    drafter = LlamaGenTokenModel(tiny_transformer(vocab_size=VOCAB, block_size=LENGTH, num_classes=3, seed=11))
    assert_confidence_stop_keeps_the_law(DraftSpeculative(drafter=drafter, num_draft=3, confidence=0.7), enumerable, num_draft=3)


def test_coupled_equals_autoregressive_sampling_with_the_same_noise(token_model):
    """Coupled Jacobi is AR sampling with noise fixed in advance (a counter-based function of
    one seed drawn from the generator, row and position), token for token."""
    sampling = SamplingConfig(temperature=1.0, guidance=3.0)
    labels, n = torch.tensor([0, 4, 8]), 64
    out = CoupledJacobi(window=16).generate(token_model, labels, n, sampling, torch.Generator().manual_seed(3))
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(3)))
    noise = CounterNoise(seed, token_model.vocab_size, "cpu")
    state = token_model.start(labels, n + 2, True)
    tokens, logits = [], state.first_logits
    for t in range(n):
        if t:
            logits = token_model.forward(state, tokens[-1][:, None])
            token_model.commit(state, torch.ones(3, dtype=torch.long))
        tokens.append(noise.race(sampling.probs(logits, torch.full((3, 1), t)), torch.full((3, 1), t))[:, 0])
    assert torch.equal(out.tokens, torch.stack(tokens, 1))
    assert out.stats.forwards < n  # and it took fewer forwards than AR


def test_drafter_equal_to_target_accepts_everything(token_model):
    sampling = SamplingConfig(guidance=2.0)
    out = DraftSpeculative(drafter=token_model.__class__(token_model.transformer), num_draft=3).generate(
        token_model, torch.tensor([1, 2]), 64, sampling, torch.Generator().manual_seed(0))
    assert out.stats.accepted_histogram[4] == sum(out.stats.accepted_histogram[1:]) - 2  # all but prefill/last
    assert out.stats.forwards == 1 + 63 // 4 + (63 % 4 > 0)
    assert out.stats.draft_forwards == 1 + 3 * (out.stats.forwards - 1)
    assert out.stats.drafted == out.stats.accepted_drafts == 2 * 3 * (out.stats.forwards - 1)


def test_draft_stats_count_drafted_and_accepted_tokens(token_model):
    """The draft counters agree with the histogram: each verify scores `num_draft` drafts per
    row still decoding, and a forward that finalised k tokens kept k - 1 of them (fixed length,
    no stops; the prefill's entries finalise one token each and verify nothing)."""
    out = DraftSpeculative(drafter=DRAFTER, num_draft=3).generate(
        token_model, torch.tensor([1, 4, 6]), 40, SamplingConfig(), torch.Generator().manual_seed(0))
    stats = out.stats
    assert stats.drafted == 3 * (sum(stats.accepted_histogram) - 3) and stats.to_dict()["drafted"] == stats.drafted
    kept = sum((k - 1) * c for k, c in enumerate(stats.accepted_histogram) if k)
    assert 0 < stats.accepted_drafts == kept < stats.drafted


def test_draft_init_copies():
    window = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    fresh = torch.tensor([[False, False, True, True], [False, True, True, True]])
    positions = torch.tensor([[3, 4, 5, 6], [4, 5, 6, 7]])
    tokens = torch.tensor([[1, 2, 3, 5, 0, 0, 0, 0], [9, 8, 7, 6, 7, 0, 0, 0]])
    ctx = DraftContext(window, fresh, positions, tokens, 10, torch.Generator(), row_length=3)
    left, q = LeftNeighbourInit()(ctx)
    assert left.tolist() == [[5, 6, 6, 6], [7, 7, 7, 7]] and torch.equal(q.argmax(-1), left)
    above, _ = AboveNeighbourInit()(ctx)
    # Row 0: slot positions 5, 6 -> above 2 (finalised: 3), 3 (finalised: 5); row 1: 5, 6, 7 -> 2, 3, 4.
    assert above[0, 2:].tolist() == [3, 5] and above[1, 1:].tolist() == [7, 6, 7]
    with pytest.raises(ValueError, match="row length"):
        AboveNeighbourInit()(DraftContext(window, fresh, positions, tokens, 10, torch.Generator()))


def test_lossy_shortcuts_run_on_a_pipeline_token_model():
    from tests.conftest import tiny_vq

    model = LlamaGenTokenModel(tiny_transformer(), codebook=tiny_vq().quantize.codebook())
    for name in ("gsd", "lantern", "lantern++"):
        out = make_decoder(name, window=8).generate(model, torch.tensor([1, 2]), 64, SamplingConfig(guidance=2.0), torch.Generator().manual_seed(0))
        assert out.tokens.shape == (2, 64) and out.stats.forwards < 64


def test_draft_decoder_errors(token_model):
    sampling = SamplingConfig()
    with pytest.raises(ValueError, match="needs a drafter"):
        DraftSpeculative().generate(token_model, torch.tensor([1]), 8, sampling, torch.Generator())
    with pytest.raises(ValueError, match="vocabulary"):
        DraftSpeculative(drafter=LlamaGenTokenModel(tiny_transformer(vocab_size=16))).generate(
            token_model, torch.tensor([1]), 8, sampling, torch.Generator())
    with pytest.raises(ValueError, match="num_draft"):
        DraftSpeculative(num_draft=0)
    with pytest.raises(ValueError, match="TokenModel"):
        DraftSpeculative(drafter="emoji64-draft").generate(token_model, torch.tensor([1]), 8, sampling, torch.Generator())


class MirroredDrafter:
    """Wraps a drafter and checks every forward against a teacher-forced forward of the tokens
    its cache should hold, mirroring commits and rewinds: a wrong rewind shows up as wrong q."""

    def __init__(self, inner):
        self.inner, self.vocab_size, self.checked, self.truncated = inner, inner.vocab_size, 0, 0

    def start(self, conditions, capacity, guidance):
        self.conditions, self.history = conditions, [[] for _ in conditions]
        return self.inner.start(conditions, capacity, guidance)

    def forward(self, state, tokens):
        logits = self.inner.forward(state, tokens)
        self.fed = tokens.tolist()
        for b, history in enumerate(self.history):
            seq = history + self.fed[b]
            reference, _ = self.inner.transformer(torch.tensor([seq]), self.conditions[b : b + 1])
            assert torch.allclose(logits.cond[b], reference[0, len(history) + 1 :], atol=1e-4), "drafter cache out of sync"
            self.checked += 1
        return logits

    def commit(self, state, accepted):
        for b, n in enumerate(accepted.tolist()):
            self.history[b] += self.fed[b][:n]
        self.inner.commit(state, accepted)

    def rewind(self, state, num_generated):
        for b, n in enumerate(num_generated.tolist()):
            self.truncated += len(self.history[b]) > n
            self.history[b] = self.history[b][:n]
        self.inner.rewind(state, num_generated)


def test_drafter_cache_follows_every_rejection(token_model):
    drafter = MirroredDrafter(LlamaGenTokenModel(tiny_transformer(seed=7)))
    out = DraftSpeculative(drafter=drafter, num_draft=3).generate(
        token_model, torch.tensor([1, 4, 6]), 40, SamplingConfig(), torch.Generator().manual_seed(0))
    assert drafter.checked > 50 and drafter.truncated > 10  # rejections happened and were rewound
    for b, history in enumerate(drafter.history):  # what the drafter holds is the output's prefix
        assert history == out.tokens[b, : len(history)].tolist()


def test_more_drafts_than_tokens_are_clamped_and_stay_exact():
    model = LlamaGenTokenModel(tiny_transformer())
    sampling, conditions = SamplingConfig(top_k=1, guidance=4.0), torch.tensor([1, 5])
    ar = Autoregressive().generate(model, conditions, 8, sampling, torch.Generator().manual_seed(0))
    out = DraftSpeculative(drafter=DRAFTER, num_draft=4096).generate(model, conditions, 8, sampling, torch.Generator().manual_seed(1))
    assert torch.equal(ar.tokens, out.tokens) and len(out.stats.accepted_histogram) == 8 + 2


def test_coupled_races_give_each_codebook_of_a_frame_its_own_noise():
    """Frames [B, n, K, V]: the K codebooks of a frame draw from independent noise (one shared
    noise would give every codebook of a uniform law the same token), at any batch size; tokens
    [B, n, V] keep lane = row, the draws they always had."""
    noise = CounterNoise(7, 1000, "cpu")
    uniform = torch.full((2, 3, 8, 1000), 1e-3)
    positions = torch.tensor([[4, 5, 6], [9, 10, 11]])
    frames = noise.race(uniform, positions)
    assert frames.shape == (2, 3, 8)
    assert all(len(set(frames[b, i].tolist())) > 4 for b in range(2) for i in range(3))
    # Row b, codebook k is lane b*K + k: the token race of that lane at the same positions.
    lanes = torch.arange(16).view(2, 8)
    for k in (0, 5):
        tokens = torch.stack([(uniform[:, i, k] / noise.exponential(lanes[:, k], positions[:, i])).argmax(-1) for i in range(3)], 1)
        assert torch.equal(frames[:, :, k], tokens)
    probs = torch.softmax(torch.randn(2, 3, 1000, generator=torch.Generator().manual_seed(0)), -1)
    rows = torch.arange(2)
    assert torch.equal(noise.race(probs, positions),
                       torch.stack([(probs[:, i] / noise.exponential(rows, positions[:, i])).argmax(-1) for i in range(3)], 1))


def test_counter_noise_is_exponential_and_addressed_by_row_and_position():
    """E(row, position, token) ~ Exp(1) i.i.d.: mean and variance 1, P(E > 1) = 1/e, no
    correlation between neighbouring rows, positions or tokens; any window reads the same."""
    noise = CounterNoise(12345, 4096, "cpu")
    rows, positions = torch.arange(8)[:, None].expand(8, 64), torch.arange(64).expand(8, 64)
    e = noise.exponential(rows, positions).double()  # [8, 64, 4096]
    n = e.numel()
    assert abs(e.mean() - 1) < 5 / n**0.5 and abs(e.var() - 1) < 10 / n**0.5
    assert abs((e > 1).double().mean() - torch.e ** -1) < 5 / n**0.5
    for a, b in [(e[1:], e[:-1]), (e[:, 1:], e[:, :-1]), (e[..., 1:], e[..., :-1])]:
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 5 / a.numel() ** 0.5
    assert torch.equal(noise.exponential(rows[2:4, 10:12], positions[2:4, 10:12]).double(), e[2:4, 10:12])
    assert not torch.equal(CounterNoise(12346, 4096, "cpu").exponential(rows, positions).double(), e)
