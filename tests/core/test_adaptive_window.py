"""The adaptive window: fewer drafts (down to none) when they are not accepted, exactly lossless.

Lossless is checked both ways for any sequence of draft counts (a chooser that cycles through
them, including 0 and the narrower windows that leave Jacobi drafts unread): greedy outputs
token-identical to autoregressive decoding, sampled outputs distributed as the exactly
enumerated law (chi-square). Then the policy itself: it falls back to autoregressive steps when
nothing is accepted (cost within 10% of AR) and keeps the whole window when everything is.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from mmgen.decoding import (AdaptiveWindow, Autoregressive, PromptLookup, SpeculativeJacobi, make_decoder, parse_decoding,
                            row_decoder, row_spec)
from mmgen.decoding.stopping import Stopping, TokenQueueStreamer
from mmgen.decoding.window import (TOKEN_COST, RowWindows, _powers, draft_cost, interpolate_cost, parse_window_cost, parse_window_tokens,
                                   resolve_adaptive)
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.modeling import DecodeState
from mmgen.sampling import Logits, SamplingConfig

from tests.conftest import tiny_transformer
from tests.core.test_decoding import LENGTH, enumerable  # noqa: F401
from tests.core.test_speculative_loop import ToyFrameModel, assert_outputs_follow, stopped_law


@dataclass(frozen=True)
class CyclingWindow(AdaptiveWindow):
    """Draft counts in a fixed cycle, whatever was accepted: every width change the loop and the
    proposers must survive."""

    cycle: tuple = (1, 0, 2, 2, 0, 1)

    def start(self, max_draft, rows_fed, device, window_cost=None, window_tokens=None, length=None):
        return _Cycle([min(d, max_draft) for d in self.cycle])


class _Cycle:
    measuring = True  # `WindowChooser`'s interface: it reads every forward's tokens (and ignores them)

    def __init__(self, cycle):
        self.cycle, self.chosen = cycle, []

    def choose(self):
        self.chosen.append(self.cycle[len(self.chosen) % len(self.cycle)])
        return self.chosen[-1]

    def observe(self, tokens):
        pass

    def shortened(self, drafts):
        self.chosen[-1] = drafts


GREEDY = SamplingConfig(top_k=1, guidance=4.0)


@pytest.mark.parametrize("cycle", [(1, 0, 2, 2, 0, 1), (7, 0, 3, 1, 7, 0, 0), (0,)])
@pytest.mark.parametrize("name", ["sjd", "lookup"])
def test_greedy_with_any_draft_counts_is_token_identical_to_ar(name, cycle):
    model = LlamaGenTokenModel(tiny_transformer())
    conditions = torch.tensor([1, 5, 7])
    ar = Autoregressive().generate(model, conditions, 64, GREEDY, torch.Generator().manual_seed(0))
    adapt = CyclingWindow(cycle=cycle)
    # Lookup's context holds every token, so every row always has a match and drafts.
    decoder = (SpeculativeJacobi(window=8, adapt=adapt) if name == "sjd"
               else PromptLookup(num_draft=7, adapt=adapt, context=torch.arange(32)))
    out = decoder.generate(model, conditions, 64, GREEDY, torch.Generator().manual_seed(1))
    assert torch.equal(ar.tokens, out.tokens)
    assert out.stats.drafts_per_forward[: len(cycle)] == list(cycle)[: out.stats.forwards - 1]


def test_greedy_frames_with_any_draft_counts_equal_ar():
    model = ToyFrameModel(vocab_size=4, scale=3.0)
    sampling = SamplingConfig(temperature=0.0)
    ar = Autoregressive().generate(model, torch.tensor([0, 1, 2]), 24, sampling, torch.Generator())
    out = SpeculativeJacobi(window=6, adapt=CyclingWindow(cycle=(5, 0, 2, 1))).generate(
        model, torch.tensor([0, 1, 2]), 24, sampling, torch.Generator().manual_seed(2))
    assert torch.equal(ar.tokens, out.tokens)


@pytest.mark.parametrize("stop", [None, 2])
@pytest.mark.parametrize("name", ["sjd", "lookup", "sjd-policy"])
def test_sampling_with_changing_draft_counts_matches_exact_distribution(enumerable, name, stop):
    """Every window change, reads of drafts left unread by a narrower forward included, keeps the
    output law exact (LENGTH tokens of VOCAB: every sequence enumerated)."""
    sampling = SamplingConfig(temperature=0.9, guidance=2.0)
    law = stopped_law(enumerable, sampling, stop)
    n = 20000
    adapt = {
        "sjd": CyclingWindow(cycle=(1, 2, 0, 1, 1)),
        "lookup": CyclingWindow(cycle=(2, 0, 1)),
        # The real policy on a batch this large: AR steps, then acceptance-driven probes.
        "sjd-policy": AdaptiveWindow(token_cost=1.0, dwell=1, probe_every=1),
    }[name]
    decoder = PromptLookup(num_draft=2, max_ngram=1, adapt=adapt) if name == "lookup" else SpeculativeJacobi(window=3, adapt=adapt)
    out = decoder.generate(enumerable, torch.full((n,), 1), LENGTH, sampling, torch.Generator().manual_seed(0),
                           stopping=Stopping(stop_tokens=[stop] if stop is not None else []))
    assert 0 in out.stats.drafts_per_forward and max(out.stats.drafts_per_forward) > 0
    assert_outputs_follow(out, law)


def relative_cost(stats, rows_fed: int, token_cost: float, window: int = 16) -> float:
    """The decode's forwards in autoregressive steps under the policy's own cost model."""
    beta = draft_cost(token_cost, rows_fed)
    drafts = stats.drafts_per_forward or [window - 1] * (stats.forwards - 1)
    return (1 + sum(1 + beta * d for d in drafts)) / stats.tokens  # + the prefill


def test_nothing_accepted_falls_back_to_ar_within_ten_percent():
    """A random 4096-token model: random drafts are essentially never accepted."""
    model = LlamaGenTokenModel(tiny_transformer(vocab_size=4096, block_size=256, output_std=0.5))
    sampling = SamplingConfig(temperature=1.0, guidance=2.0)
    conditions = torch.tensor([1, 2])
    policy = AdaptiveWindow(token_cost=0.05)
    out = SpeculativeJacobi(window=16, adapt=policy).generate(model, conditions, 256, sampling, torch.Generator().manual_seed(0))
    fixed = SpeculativeJacobi(window=16, adapt=False).generate(model, conditions, 256, sampling, torch.Generator().manual_seed(0))
    assert fixed.stats.step_compression < 1.05  # the worst case: nothing gained by drafting
    assert relative_cost(out.stats, 4, 0.05) < 1.1
    assert relative_cost(fixed.stats, 4, 0.05) > 1.5
    assert out.stats.drafts_per_forward.count(0) > 0.8 * len(out.stats.drafts_per_forward)


@pytest.mark.parametrize("length", [3, 5, 12])
def test_short_decodes_with_nothing_accepted_stay_within_ten_percent_of_ar(length):
    """A short answer (a VLM's "yes", a name: a stop token long before the budget) is all
    start: its few forwards must not run at the widest window. Batch 1 without guidance at the
    CPU's default token cost, as a VLM decodes."""
    model = LlamaGenTokenModel(tiny_transformer(vocab_size=4096, block_size=64, output_std=0.5))
    sampling = SamplingConfig(temperature=1.0)
    decode = lambda policy: SpeculativeJacobi(window=16, adapt=policy).generate(
        model, torch.tensor([1]), 48, sampling, torch.Generator().manual_seed(0), stopping=Stopping(max_new_tokens=length))
    token_cost = TOKEN_COST["cpu"]
    assert relative_cost(decode(True).stats, 1, token_cost) < 1.1
    # Starting at the widest window (as before `start_cost`) costs every forward of it.
    assert relative_cost(decode(AdaptiveWindow(start_cost=100.0)).stats, 1, token_cost) > 1.1


def test_where_one_draft_costs_too_much_it_starts_autoregressive_and_probes_soon():
    policy = AdaptiveWindow(token_cost=0.2)  # one draft: 1.17 AR steps at batch 1
    chooser = policy.start(15, 1, "cpu")
    assert [chooser.choose() for _ in range(policy.dwell)] == [0] * policy.dwell  # a short decode: AR steps only
    model = ContextFree()  # everything accepted: the probe pays, and the window grows
    out = SpeculativeJacobi(window=16, adapt=policy).generate(model, torch.zeros(1, dtype=torch.long), 256,
                                                              SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    drafts = out.stats.drafts_per_forward
    # An image-like decode (no stop tokens: 256 tokens it will finalise) probes at once, as its
    # probe's extra cost (2 x 0.167 AR steps) is at most 10% of its length; the probe's first
    # forward holds a fresh draft, its second accepts, and the window jumps to the widest.
    assert drafts[:3] == [1, 1, 15] and drafts.count(15) > 0.5 * len(drafts)
    assert policy.start(15, 1, "cpu", length=256).since_probe == chooser.ar_interval
    # Where stop tokens may end it (an answer), once that extra cost is at most 10% of the AR
    # steps before it: after 4; so too where the length is too short to pay for it at once.
    for short in (policy.start(15, 1, "cpu"), policy.start(15, 1, "cpu", length=3)):
        assert short.ar_interval - short.since_probe == 4
    # Where a draft is dear (emoji-vlm's one-thread curve: 1.34 AR steps), not before `dwell`
    # steps: a short answer ends first.
    dear = AdaptiveWindow().start(15, 1, "cpu", {"cpu": {1: 1.0, 2: 1.34, 4: 1.48, 8: 1.58, 16: 1.86}})
    assert dear.home == 0 and dear.ar_interval - dear.since_probe == policy.dwell
    # Where the model's measured tokens chose AR steps (emoji-vlm's: about 1.02 tokens at every
    # width), the first probe keeps the `probe_cost` pace as every later one does.
    vlm_cost, vlm_tokens = {"cpu": {1: 1.0, 2: 1.34, 4: 1.48, 8: 1.58, 16: 1.86}}, {2: 1.015, 4: 1.033, 8: 1.023, 16: 1.023}
    told = AdaptiveWindow().start(15, 1, "cpu", vlm_cost, vlm_tokens)
    assert told.home == 0 and told.since_probe == 0 and told.ar_interval == dear.ar_interval
    # Where everything is accepted its probe pays, and the window jumps to the widest as from any
    # probe from AR steps: such a phase overrules the tokens within a few forwards.
    model = ContextFree()
    model.window_cost, model.window_tokens = vlm_cost, vlm_tokens
    out = SpeculativeJacobi(window=16).generate(model, torch.zeros(1, dtype=torch.long), 64, SamplingConfig(temperature=1.0),
                                                torch.Generator().manual_seed(0))
    n = told.ar_interval
    assert out.stats.drafts_per_forward[:n + 3] == [0] * n + [1, 1, 15] and set(out.stats.drafts_per_forward[n + 2:]) == {15}


class ContextFree:
    """Next-token logits that ignore the context: Jacobi's carried drafts are exact draws from
    the target's own law, so every draft after the first forward is accepted."""

    vocab_size = 16

    def __init__(self):
        self.logits = torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(0))

    def _logits(self, B, n):
        return Logits(self.logits.expand(B, n, -1).clone())

    def start(self, conditions, capacity, guidance):
        return DecodeState(cache=None, batch_size=len(conditions), guidance=False, first_logits=self._logits(len(conditions), 1))

    def forward(self, state, tokens):
        return self._logits(*tokens.shape[:2])

    def commit(self, state, accepted):
        pass

    def rewind(self, state, n):
        pass


def test_everything_accepted_keeps_the_whole_window():
    model = ContextFree()
    sampling = SamplingConfig(temperature=1.0)
    out = SpeculativeJacobi(window=16, adapt=True).generate(model, torch.zeros(2, dtype=torch.long), 256, sampling,
                                                            torch.Generator().manual_seed(0))
    fixed = SpeculativeJacobi(window=16, adapt=False).generate(model, torch.zeros(2, dtype=torch.long), 256, sampling,
                                                  torch.Generator().manual_seed(0))
    drafts = out.stats.drafts_per_forward
    # It starts narrow; the first forward that accepts its whole window (the second: the
    # first's drafts are all fresh) shows the window, not the model, limits it, and it jumps
    # to the widest rather than one width per forward; there it stays.
    assert drafts[0] < 15 and drafts.index(15) == 2
    rest = drafts[drafts.index(15):]
    assert rest.count(15) > 0.85 * len(rest)  # the others: probes of the next narrower window
    assert relative_cost(out.stats, 2, 0.05) < 1.05 * relative_cost(fixed.stats, 2, 0.05)


class Phased:
    """A model whose first `barren` positions follow a sharp random transition table (each
    token's law depends on the one before, so Jacobi's carried drafts, sampled after rejected
    ones, fail) and whose later positions ignore the context (every carried draft passes): a
    decode whose acceptance changes midway, as a trained model's does where it starts to
    repeat itself."""

    vocab_size = 1024  # a random draft passes by chance about one time in a thousand

    def __init__(self, barren: int):
        g = torch.Generator().manual_seed(0)
        self.barren = barren
        self.table = torch.randn(self.vocab_size, self.vocab_size, generator=g) * 8.0
        self.free = torch.randn(self.vocab_size, generator=g)

    def _logits(self, fed, positions):
        law = torch.where((positions < self.barren)[..., None], self.table[fed], self.free)
        return Logits(law)

    def start(self, conditions, capacity, guidance):
        B = len(conditions)
        state = DecodeState(cache=None, batch_size=B, guidance=False,
                            first_logits=self._logits(torch.zeros(B, 1, dtype=torch.long), torch.zeros(B, 1, dtype=torch.long)))
        state.extra = torch.zeros(B, dtype=torch.long)  # tokens committed per row
        return state

    def forward(self, state, tokens):
        positions = state.extra[:, None] + 1 + torch.arange(tokens.shape[1])
        return self._logits(tokens, positions)

    def commit(self, state, accepted):
        state.extra = state.extra + accepted

    def rewind(self, state, n):
        state.extra = n.clone()


def test_a_change_of_acceptance_midway_is_followed_both_ways():
    """Barren for 96 tokens, then everything passes: it falls back to AR steps (probing one
    draft now and then at a bounded cost) and is at the widest window within a few forwards of
    the change, instead of waiting out doubling probe intervals."""
    model, barren = Phased(barren=96), 96
    out = SpeculativeJacobi(window=16, adapt=AdaptiveWindow(token_cost=0.05)).generate(
        model, torch.zeros(1, dtype=torch.long), 256, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    drafts, tokens = out.stats.drafts_per_forward, out.stats.accepted_per_forward[1:]
    finalised = torch.tensor([1.0] + tokens).cumsum(0)  # tokens before each forward
    before = [d for d, at in zip(drafts, finalised.tolist()) if 16 <= at < barren - 16]
    # The barren phase: AR steps between short probes, whose extra cost is bounded (a chance
    # acceptance may send it wide for a few forwards).
    assert before.count(0) > 0.5 * len(before)
    assert sum(draft_cost(0.05, 1) * d for d in before) / len(before) < 0.06
    changed = next(i for i, at in enumerate(finalised.tolist()) if at >= barren)
    assert 15 in drafts[changed : changed + 16]  # the window follows the change
    assert drafts[-3:] == [15, 15, 15] or out.stats.forwards - changed < 20


@pytest.mark.parametrize("batch", [1, 2])
def test_progress_and_streamed_tokens_count_every_token_once_through_ar_steps_and_drafts(batch):
    """A lone row without stop tokens skips the host read in its AR steps (it gains exactly one
    token there); its progress and stream still cover every token once, as a batch's do."""
    model = Phased(barren=40)
    updates, streamer = [], TokenQueueStreamer()

    class Counter:
        def update(self, n):
            updates.append(n)

    out = SpeculativeJacobi(window=16, adapt=AdaptiveWindow(token_cost=0.05)).generate(
        model, torch.zeros(batch, dtype=torch.long), 128, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0),
        progress=Counter(), streamer=streamer)
    drafts = out.stats.drafts_per_forward
    assert drafts.count(0) > 10 and max(drafts) == 15  # AR steps in the barren phase, the widest window after it
    assert sum(updates) == 128 and min(updates) > 0 and max(updates) > 1
    streamed = [[] for _ in range(batch)]
    for row, tokens in streamer:
        streamed[row] += tokens.tolist()
    assert streamed == out.tokens.tolist()


def test_default_widths_are_powers_of_two_windows():
    assert _powers(15) == [0, 1, 3, 7, 15]
    assert _powers(5) == [0, 1, 3, 5]
    assert AdaptiveWindow(widths=(4, 0)).start(2, 1, "cpu").widths == [0, 2]


def test_options_and_errors():
    assert SpeculativeJacobi().adapt is True and make_decoder("lookup").adapt is True  # on by default
    assert make_decoder("sjd", adapt=False).adapt is False
    assert resolve_adaptive(False) is None and resolve_adaptive(None) is None
    assert resolve_adaptive(True) == AdaptiveWindow()
    assert resolve_adaptive(0.2) == AdaptiveWindow(token_cost=0.2)
    name, options = parse_decoding("sjd:adapt=0.1")
    assert make_decoder(name, **options).adapt == 0.1
    assert make_decoder("lantern", adapt=True).adapt is True
    for bad in [dict(token_cost=-1.0), dict(decay=1.0), dict(probe_every=0), dict(dwell=True), dict(widths=())]:
        with pytest.raises(ValueError):
            AdaptiveWindow(**bad)
    with pytest.raises(ValueError, match="adapt must be"):
        SpeculativeJacobi(adapt="often")
    with pytest.raises(ValueError, match="adapt must be"):
        PromptLookup(adapt=[1])
    # A spec sets the adaptive window's fields; `row_spec` adds a continuous batch's rows.
    name, options = parse_decoding("sjd:batch_rows=8,dwell=10")
    assert make_decoder(name, **options).adapt == AdaptiveWindow(batch_rows=8, dwell=10)
    assert make_decoder("sjd", adapt=0.05, batch_rows=2).adapt == AdaptiveWindow(token_cost=0.05, batch_rows=2)
    with pytest.raises(ValueError, match="adapt=false"):
        make_decoder("sjd", adapt=False, batch_rows=8)
    with pytest.raises(ValueError, match="unknown option"):
        make_decoder("draft", batch_rows=8)  # no adaptive window there
    assert row_spec("sjd", 8) == "sjd:batch_rows=8" and row_spec("lantern:delta=0.2", 4) == "lantern:delta=0.2,batch_rows=4"
    assert [row_spec(s, 8) for s in ("ar", "sjd:adapt=false", "sjd:batch_rows=1")] == ["ar", "sjd:adapt=false", "sjd:batch_rows=1"]
    assert row_decoder("sjd", 8) == make_decoder("sjd", batch_rows=8) and row_decoder("ar", 8) == make_decoder("ar")
    name, options = parse_decoding("sjd:adapt=1")  # on, or a cost of 1.0? ambiguous: refused
    with pytest.raises(ValueError, match="decimal"):
        make_decoder(name, **options)


def test_a_barren_first_window_of_one_draft_tries_the_next_width_once_before_ar_steps():
    """A Jacobi window of two carries one stale draft: finding nothing there says little, so the
    next width gets one try (`dwell` judged forwards after its warm-up) before AR steps."""
    policy = AdaptiveWindow()
    chooser = policy.start(15, 2, "cpu")  # guided batch 1 on the CPU default: it starts at one draft
    assert chooser.widths[chooser.home] == 1
    for _ in range(policy.dwell):
        chooser.choose(), chooser.observe(1.0)
    assert chooser.widths[chooser.home] == 3 and chooser.tried_wider
    for _ in range(policy.warmup + policy.dwell):
        chooser.choose(), chooser.observe(1.0)
    assert chooser.home == 0  # barren there too: AR steps, and no second try
    again = policy.start(15, 2, "cpu")
    again.tried_wider = True
    for _ in range(policy.dwell):
        again.choose(), again.observe(1.0)
    assert again.home == 0


def test_a_probe_from_ar_steps_does_not_judge_its_fresh_first_forward():
    """Where one draft costs 1.56 AR steps (a measured CPU curve: the BLAS makes a second row
    dear), every width costs more than `start_cost` and the decode starts with AR steps. A probe's
    first forward verifies a fresh draft; judged with it, a two-forward probe could not pay even
    if every later draft passed ((1 + 2) / 3.12), so a decode whose drafts all pass never left AR
    steps. Its second forward alone decides."""
    curve = {"cpu": {1: 1.0, 2: 1.56, 4: 2.03, 8: 2.10, 16: 2.47}}

    def probe(second: float):
        chooser = AdaptiveWindow().start(15, 2, "cpu", curve)
        assert chooser.home == 0
        ar_steps = 0  # bounded: a chooser that never probes must fail here, not loop forever
        while chooser.choose() == 0:
            chooser.observe(None)
            ar_steps += 1
            assert ar_steps <= chooser.ar_interval, "no probe from AR steps"
        chooser.observe(1.0)  # the fresh draft fails
        assert chooser.choose() == 1
        chooser.observe(second)
        return chooser

    passed = probe(2.0)
    assert passed.widths[passed.home] == 15  # its whole window passed: a jump
    assert probe(1.0).home == 0


def test_a_barren_stretch_after_drafts_paid_steps_one_width_down_still_growing():
    """Once drafts have paid in a decode, a barren stretch above one draft steps down one width,
    still growing, so a draft that passes again widens at once; AR steps come only from one
    draft. Before anything paid, a barren window falls straight back to AR steps."""
    policy = AdaptiveWindow()
    chooser = policy.start(15, 2, "cpu")  # at one draft
    chooser.choose(), chooser.observe(1.5)  # half its drafts passed: it widens (drafts paid)
    assert chooser.widths[chooser.home] == 3 and chooser.paid
    for _ in range(policy.warmup + policy.dwell):
        chooser.choose(), chooser.observe(1.0)
    assert chooser.widths[chooser.home] == 1 and chooser.growing  # barren: one width down
    chooser.choose(), chooser.observe(1.5)
    assert chooser.widths[chooser.home] == 3  # it grows again at once
    for _ in range(policy.warmup + policy.dwell):
        chooser.choose(), chooser.observe(1.0)
    assert chooser.widths[chooser.home] == 1
    for _ in range(policy.dwell):
        chooser.choose(), chooser.observe(1.0)
    assert chooser.home == 0  # from one draft: AR steps (its first-width try was spent)
    fresh = policy.start(15, 2, "cpu")
    fresh._move(3, growing=True)  # at 7 drafts, nothing paid yet
    for _ in range(policy.warmup + policy.dwell):
        fresh.choose(), fresh.observe(1.0)
    assert fresh.home == 0 and not fresh.paid


def test_a_row_of_a_batch_pays_for_widening_the_batch_and_never_probes_where_no_width_can_pay():
    """A continuous batch's row (`batch_rows` = 8) is charged what its width costs the padded
    batch, in its share of an AR step; on the CPU's token cost at 8 rows no width can pay even
    with every draft accepted, so it decodes autoregressively and never probes."""
    row = AdaptiveWindow(batch_rows=8).start(15, 1, "cpu")
    beta = draft_cost(TOKEN_COST["cpu"], 8)
    assert row.cost == pytest.approx([1 + 8 * beta * d for d in row.widths]) and 8 * beta > 1
    assert not row.can_pay and row.home == 0
    assert AdaptiveWindow(batch_rows=8).never_drafts(15, "cpu") and not AdaptiveWindow().never_drafts(15, "cpu")
    # Everything would be accepted, and still no draft: autoregressive steps in the loop, in a
    # cache without the window's room, as `Autoregressive` decodes (the same tokens).
    sampling, seed = SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0)
    out = SpeculativeJacobi(window=16, adapt=AdaptiveWindow(batch_rows=8)).generate(
        ContextFree(), torch.zeros(1, dtype=torch.long), 256, sampling, seed)
    plain = Autoregressive().generate(ContextFree(), torch.zeros(1, dtype=torch.long), 256, sampling, torch.Generator().manual_seed(0))
    assert out.stats.forwards == plain.stats.forwards == 256 and torch.equal(out.tokens, plain.tokens)
    # Where a batch forward is nearly free per token (the CUDA default) the same row drafts.
    assert AdaptiveWindow(batch_rows=8).start(15, 1, "cuda").can_pay
    # One row is a decode of its own; a static batch shares one width and refuses batch_rows.
    assert AdaptiveWindow(batch_rows=1).start(15, 2, "cpu").cost == AdaptiveWindow().start(15, 2, "cpu").cost
    with pytest.raises(ValueError, match="static batch of 2 rows"):
        SpeculativeJacobi(window=16, adapt=AdaptiveWindow(batch_rows=2)).generate(
            ContextFree(), torch.zeros(2, dtype=torch.long), 8, sampling, torch.Generator().manual_seed(0))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="batch_rows"):
            AdaptiveWindow(batch_rows=bad)


# A small model's measured curve on a CPU: one more token per row costs a third of a step (the
# BLAS leaves its matrix-vector kernels), more tokens little more. The linear model at the CPU's
# default token cost would start at a 4-token window.
STEEP = {1: 1.0, 2: 1.33, 4: 1.4, 8: 1.47, 16: 1.62}


def test_measured_window_cost_is_interpolated():
    assert [interpolate_cost(STEEP, w) for w in (1, 2, 4, 16)] == [1.0, 1.33, 1.4, 1.62]
    assert interpolate_cost(STEEP, 3) == pytest.approx(1.365)
    assert interpolate_cost(STEEP, 32) == pytest.approx(1.62 + 0.15 / 8 * 16)  # along the last segment
    assert interpolate_cost({1: 2.0, 4: 3.0}, 4) == 1.5  # relative to width 1
    assert interpolate_cost({1: 1.0}, 8) == 1.0


def test_a_measured_curve_replaces_the_linear_model_on_its_device_and_thread_count():
    threads = torch.get_num_threads()
    linear = AdaptiveWindow().start(15, 1, "cpu")
    assert linear.widths[linear.home] == 3  # the CPU default: a 4-token window costs 1.06 steps
    for key in (f"cpu:{threads}", "cpu"):
        chooser = AdaptiveWindow().start(15, 1, "cpu", {key: STEEP})
        assert chooser.cost == [interpolate_cost(STEEP, d + 1) for d in (0, 1, 3, 7, 15)]
        assert chooser.home == 0  # one draft costs 1.33 steps: it starts with AR steps
    for other in ({f"cpu:{threads + 1}": STEEP}, {"cuda": STEEP}):  # measured elsewhere: not used
        assert AdaptiveWindow().start(15, 1, "cpu", other).cost == linear.cost
    assert AdaptiveWindow(token_cost=0.02).start(15, 1, "cpu", {"cpu": STEEP}).cost == linear.cost  # a given cost wins


class Measured(ContextFree):
    """ContextFree with a curve on which drafting never pays."""

    window_cost = {"cpu": {1: 1.0, 2: 3.0, 16: 20.0}}


def test_the_loop_reads_the_models_curve_at_batch_one_only():
    sampling = SamplingConfig(temperature=1.0)
    decode = lambda rows: SpeculativeJacobi(window=16, adapt=True).generate(
        Measured(), torch.zeros(rows, dtype=torch.long), 48, sampling, torch.Generator().manual_seed(0), stopping=Stopping(max_new_tokens=6))
    assert decode(1).stats.drafts_per_forward == [0] * 5  # 6 tokens: AR steps before any probe
    linear = AdaptiveWindow().start(15, 2, "cpu")
    assert decode(2).stats.drafts_per_forward[0] == linear.widths[linear.home] > 0  # a batch of 2: the linear model's start


def test_window_cost_errors():
    assert parse_window_cost(None, "x") is None
    assert parse_window_cost({"cpu:2": {"1": 1, "4": "1.5"}}, "x") == {"cpu:2": {1: 1.0, 4: 1.5}}
    for bad in [{}, [1], {"cpu": {"2": 1.0}}, {"cpu": {"1": 0.0}}, {"cpu": {"1": float("nan")}}, {"cpu": {"one": 1.0}},
                {"cpu": {"0": 1.0, "1": 1.0}}, {"cpu": 3}]:
        with pytest.raises(ValueError, match="config.json: window cost must map"):
            parse_window_cost(bad, "config.json")


def test_a_jump_on_one_lucky_forward_goes_back_after_two_barren_ones():
    """A forward that accepts its whole window sends the window to the widest at once; when the
    first two judged forwards there finalise nothing more, it was luck (a random draft that
    happened to pass), and the window returns to where it was rather than dwelling wide, and
    grows from there one width at a time."""
    chooser = AdaptiveWindow(token_cost=0.01).start(15, 1, "cpu")  # starts at 7 drafts (1.07 AR steps)
    assert chooser.choose() == 7
    chooser.observe(8.0)  # every draft accepted
    seen = []
    for tokens in (1.0, 1.0, 1.0):  # the first forward there (fresh drafts, not judged), then two barren ones
        seen.append(chooser.choose())
        chooser.observe(tokens)
    assert seen == [15, 15, 15] and chooser.choose() == 7
    # Back home it still grows on evidence, one width at a time: the lucky forward said
    # nothing against the next width, but a second jump would likely be as lucky.
    chooser = AdaptiveWindow(token_cost=0.01).start(63, 1, "cpu")  # widths 0, 1, 3, 7, 15, 31, 63
    assert chooser.choose() == 7
    chooser.observe(8.0)
    for tokens in (1.0, 1.0, 1.0):
        chooser.choose(), chooser.observe(tokens)
    assert chooser.choose() == 7
    chooser.observe(8.0)  # the whole window again: one width, not a jump
    assert chooser.choose() == 15
    chooser.observe(1.0)  # the new slots' fresh drafts (not judged)
    assert chooser.choose() == 15
    chooser.observe(16.0)
    assert chooser.choose() == 31
    # Had the widest paid, it would have stayed.
    chooser = AdaptiveWindow(token_cost=0.01).start(15, 1, "cpu")
    chooser.choose(), chooser.observe(8.0)
    for tokens in (1.0, 16.0, 1.0, 16.0):
        chooser.choose(), chooser.observe(tokens)
    assert chooser.choose() == 15


# emoji64's measured tokens per forward at its own sampling (`mmgen calibrate`): a
# 4-token window pays best on a CPU whose wider forwards cost much more.
TOKENS = {2: 1.237, 4: 1.478, 8: 1.694, 16: 1.811}
BOX = {1: 1.0, 2: 1.173, 4: 1.317, 8: 1.632, 16: 2.154}


def test_measured_tokens_start_the_decode_where_they_pay_best_and_count_as_prior_forwards():
    """With a model's `window_tokens` the decode starts at the width whose measured tokens per
    unit of cost are highest, not growing, and each width's figure starts as `prior_forwards`
    forwards at the measured tokens, so a few barren forwards do not send it away."""
    chooser = AdaptiveWindow().start(15, 1, "cpu", {"cpu": BOX}, TOKENS)
    assert chooser.widths[chooser.home] == 3 and not chooser.growing  # 1.478 / 1.317 beats 1.237 / 1.173 and 1.694 / 1.632
    assert chooser.prior == [1.0, 1.237, 1.478, 1.694, 1.811]
    for _ in range(6):  # `dwell` forwards that paid less than AR steps (1.2 tokens for 1.317): with the prior it still pays
        assert chooser.choose() == 3
        chooser.observe(1.2)
    assert chooser.choose() == 3
    chooser.observe(1.2)
    without = AdaptiveWindow().start(15, 1, "cpu", {"cpu": BOX})  # no tokens: starts with AR steps (one draft costs 1.17)
    assert without.home == 0 and without.prior is None
    assert AdaptiveWindow(prior_forwards=0).start(15, 1, "cpu", {"cpu": BOX}, TOKENS).home == 0  # the prior turned off
    # The same barren forwards, had they gone on, outweigh the prior as it decays: back to one draft, then AR steps.
    seen = []
    for _ in range(40):
        seen.append(chooser.choose())
        chooser.observe(1.0)
    assert 3 not in seen[-20:] and seen[-1] == 0
    # Tokens below what any width costs: AR steps, with probes. Between measured widths the
    # tokens are interpolated; beyond the widest, they stay its figure.
    assert AdaptiveWindow().start(15, 1, "cpu", {"cpu": BOX}, {2: 1.02, 16: 1.05}).home == 0
    assert AdaptiveWindow().start(31, 1, "cpu", None, {2: 1.5, 8: 6.0}).prior == [1.0, 1.5, 3.0, 6.0, 6.0, 6.0]
    assert AdaptiveWindow().start(15, 1, "cpu", {"cpu": BOX}, {2: 1.05}).home == 0  # one draft measured: no wider width looks better


def test_measured_tokens_count_at_any_batch_and_for_a_row_of_a_continuous_batch():
    """What a row accepts does not depend on the batch, so the tokens hold where the curve does
    not (the curve is batch 1's): the cost stays the linear model's."""
    linear = AdaptiveWindow().start(15, 4, "cpu")
    chooser = AdaptiveWindow().start(15, 4, "cpu", None, TOKENS)
    assert chooser.cost == linear.cost and chooser.prior is not None
    row = AdaptiveWindow(batch_rows=8).start(15, 2, "cpu", {"cpu": BOX}, TOKENS)
    assert row.cost == AdaptiveWindow(batch_rows=8).start(15, 2, "cpu").cost and row.prior is not None
    # The continuous loop's per-row choosers start from the model's tokens too.
    rows = RowWindows(AdaptiveWindow(batch_rows=2), 15, True, "cpu", {"cpu": BOX}, SimpleNamespace(batch_size=2), TOKENS)
    rows.restart([0, 1])
    assert all(c.prior == row.prior for c in rows.choosers)


class MeasuredTokens(ContextFree):
    """ContextFree (every carried draft passes) carrying measured tokens that say drafting pays."""

    window_tokens = {2: 1.9, 4: 3.8, 8: 7.5, 16: 15.0}


def test_with_measured_tokens_greedy_decodes_equal_ar_and_sampled_ones_follow_the_law(enumerable):
    """The tokens only move the draft counts, which depend on earlier forwards alone: greedy
    decodes stay token-identical to AR, and sampled ones exact in law (with drafts accepted and
    rejected in the run, as the enumerable model's are)."""
    model = MeasuredTokens()
    for sampling in (SamplingConfig(top_k=1), SamplingConfig(temperature=1.0)):
        ar = Autoregressive().generate(model, torch.zeros(2, dtype=torch.long), 40, sampling, torch.Generator().manual_seed(3))
        out = SpeculativeJacobi(window=16, adapt=True).generate(model, torch.zeros(2, dtype=torch.long), 40, sampling,
                                                                 torch.Generator().manual_seed(3))
        assert out.stats.drafts_per_forward[0] == 15  # the tokens start it at the widest window
        if sampling.top_k == 1:
            assert torch.equal(ar.tokens, out.tokens)
    enumerable.window_tokens = {2: 1.5, 4: 2.0}
    try:
        sampling = SamplingConfig(temperature=0.9, guidance=2.0)
        out = SpeculativeJacobi(window=3, adapt=AdaptiveWindow(token_cost=1e-6)).generate(  # a batch this large: drafts cheap
            enumerable, torch.full((20000,), 1), LENGTH, sampling, torch.Generator().manual_seed(0),
            stopping=Stopping(stop_tokens=[]))
    finally:
        del enumerable.window_tokens
    assert out.stats.drafts_per_forward[0] == 2 and sum(out.stats.accepted_histogram[2:]) > 0 and out.stats.accepted_histogram[1] > 0
    assert_outputs_follow(out, stopped_law(enumerable, sampling, None))


def test_prompt_lookup_does_not_start_from_jacobi_s_measured_tokens():
    """A model's `window_tokens` are what Jacobi windows finalised: lookup's n-gram drafts are
    accepted otherwise, so its window starts where it would without them (and Jacobi's does not)."""
    model, plain = MeasuredTokens(), ContextFree()

    def decode(m, decoder):
        out = decoder.generate(m, torch.zeros(1, dtype=torch.long), 40, SamplingConfig(top_k=1), torch.Generator().manual_seed(3))
        return out.stats.drafts_per_forward

    assert decode(model, PromptLookup(num_draft=15)) == decode(plain, PromptLookup(num_draft=15))
    assert decode(model, SpeculativeJacobi(window=16))[0] == 15 != decode(plain, SpeculativeJacobi(window=16))[0]


def test_window_tokens_errors():
    assert parse_window_tokens(None, "x") is None
    assert parse_window_tokens({"2": "1.5", "16": 3}, "x") == {2: 1.5, 16: 3.0}
    for bad in [{}, [1], {"1": 1.0}, {"2": 0.5}, {"2": 2.5}, {"4": float("nan")}, {"two": 1.5}, 3]:
        with pytest.raises(ValueError, match="config.json: window tokens must map"):
            parse_window_tokens(bad, "config.json")
    with pytest.raises(ValueError, match="prior_forwards must be"):
        AdaptiveWindow(prior_forwards=-1.0)
