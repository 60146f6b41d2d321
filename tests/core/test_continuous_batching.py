"""Continuous batching: each request decodes what it would decode alone with its generator.

Identity with batch-1 decodes is the promise (tokens and per-request stats), so it is tested
token for token, greedy and sampled, with stop tokens and per-request budgets; the sampled law
of continuously batched outputs is also checked against the enumerated one (chi-square).

Exact identity also needs the tiny LlamaGen's forward to give a row the same bits whatever rows
share the batch. That holds here (checked at OMP_NUM_THREADS=1 and 4) because MKL's sgemm picks
a row-count-independent kernel at these sizes; a CPU whose BLAS blocks rows differently would
break it without any fault in the batching (docs/benchmarks.md, "Continuous batching").
"""

import pytest
import torch

from mmgen.decoding import Autoregressive, CoupledJacobi, DraftSpeculative, PromptLookup, SpeculativeJacobi, make_decoder
from mmgen.decoding.batching import Request, continuous_decode
from mmgen.decoding.speculative import check_row_feed
from mmgen.decoding.stopping import Stopping
from mmgen.decoding.window import TOKEN_COST, AdaptiveWindow
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig, make_generator

from tests.conftest import tiny_transformer
from tests.core.test_decoding import ALPHA, LENGTH, SAMPLINGS, chi_square_pvalue, enumerable, exact_joint  # noqa: F401
from tests.core.test_speculative_loop import outputs_follow, stopped_law
from tests.speculation import RULE_CASES, rule

SAMPLED = SamplingConfig(temperature=1.0, top_k=16, guidance=3.0)
GREEDY = SamplingConfig(top_k=1, guidance=4.0)
# A random codebook gives LANTERN its neighbours.
MODEL = LlamaGenTokenModel(tiny_transformer(output_std=1.5), codebook=torch.randn(32, 8, generator=make_generator(0)))
LABELS = [1, 5, 7, 2, 9, 0, 3]


def fixed(name: str, **options):
    return make_decoder(name, **options) if name == "ar" else make_decoder(name, adapt=False, window=8, **options)


def solo(decoder, label: int, seed: int, sampling, stopping=None):
    return decoder.generate(MODEL, torch.tensor([label]), 64, sampling, make_generator(seed), stopping=stopping)


@pytest.mark.parametrize("name,sampling", [("ar", SAMPLED), ("sjd", SAMPLED), ("lantern", SAMPLED), ("gsd", SAMPLED),
                                           ("ar", GREEDY), ("sjd", GREEDY)],
                         ids=["ar-sampled", "sjd-sampled", "lantern-sampled", "gsd-sampled", "ar-greedy", "sjd-greedy"])
def test_each_request_decodes_what_it_decodes_alone(name, sampling):
    decoder = fixed(name)
    requests = [Request(torch.tensor([label]), make_generator(10 + i)) for i, label in enumerate(LABELS)]
    done, stats = continuous_decode(decoder, MODEL, requests, 64, sampling, batch_size=3)
    assert [f.index for f in done] == list(range(len(LABELS)))
    for i, label in enumerate(LABELS):
        generator = make_generator(10 + i)
        alone = decoder.generate(MODEL, torch.tensor([label]), 64, sampling, generator)
        assert torch.equal(done[i].tokens, alone.tokens[0]), f"request {i}"
        # Each generator is left as its batch-1 decode leaves it (idle rows draw from another).
        assert torch.equal(requests[i].generator.get_state(), generator.get_state())
        # Its own stats are a batch-1 decode's: the same forwards and accepted lengths.
        assert done[i].stats.accepted_histogram == alone.stats.accepted_histogram
        assert done[i].stats.forwards == alone.stats.forwards and not done[i].masked
    assert stats.rows == len(LABELS)


def test_rows_are_refilled_as_they_finish_and_results_stream_in_finishing_order():
    decoder = fixed("sjd")
    seen = []
    requests = [Request(torch.tensor([label]), make_generator(i)) for i, label in enumerate(LABELS)]
    done, stats = continuous_decode(decoder, MODEL, requests, 64, SAMPLED, batch_size=2, on_finish=seen.append)
    assert done == [] and sorted(f.index for f in seen) == list(range(len(LABELS)))
    # Handed over as they finish: a short request admitted second comes out first.
    short = [Request(torch.tensor([1]), make_generator(0)), Request(torch.tensor([2]), make_generator(1), 4)]
    order = []
    continuous_decode(decoder, MODEL, short, 64, SAMPLED, batch_size=2, on_finish=lambda f: order.append(f.index))
    assert order == [1, 0]
    # Static batches of 2 take as many decode forwards as their slower row; refilled rows fewer.
    decode_forwards = [solo(decoder, label, i, SAMPLED).stats.forwards - 1 for i, label in enumerate(LABELS)]
    static = sum(max(decode_forwards[k : k + 2]) for k in range(0, len(LABELS), 2))
    assert stats.forwards - len(LABELS) < static  # the run's forwards count one prefill per request


def test_stop_tokens_budgets_and_requests_that_end_at_their_first_token():
    decoder = fixed("sjd")
    stop = int(solo(decoder, 1, 0, GREEDY).tokens[0, 20])  # a token greedy decoding emits mid-image
    stopping = Stopping(stop_tokens=[stop], pad_token=-1)
    budgets = [64, 1, 30, None, 5, 1, 64]
    requests = [Request(torch.tensor([label]), make_generator(i), budget) for i, (label, budget) in enumerate(zip(LABELS, budgets))]
    done, _ = continuous_decode(decoder, MODEL, requests, 64, SAMPLED, batch_size=3, stopping=stopping)
    for i, (label, budget) in enumerate(zip(LABELS, budgets)):
        alone = solo(decoder, label, i, SAMPLED, Stopping(stop_tokens=[stop], max_new_tokens=budget, pad_token=-1))
        n = int(alone.lengths[0])
        assert len(done[i].tokens) == n and torch.equal(done[i].tokens, alone.tokens[0, :n]), f"request {i}"
    assert [len(done[i].tokens) for i in (1, 5)] == [1, 1]


def test_each_requests_streamer_gets_its_tokens_as_they_commit_and_ends_before_its_result():
    decoder = fixed("sjd")
    events: list = []

    class Recorder:
        def __init__(self, index):
            self.index = index

        def put(self, rows):
            (tokens,) = rows
            events.append(("put", self.index, tokens.tolist()))

        def end(self):
            events.append(("end", self.index))

    budgets = [64, 1, 30, None, 5]  # request 1 ends at its first token
    requests = [Request(torch.tensor([label]), make_generator(i), budget, Recorder(i))
                for i, (label, budget) in enumerate(zip(LABELS, budgets))]
    done, _ = continuous_decode(decoder, MODEL, requests, 64, SAMPLED, batch_size=2,
                                on_finish=lambda f: events.append(("finish", f.index, f.tokens.tolist())))
    for i in range(len(requests)):
        mine = [e for e in events if e[1] == i]
        streamed = [t for kind, _, *rest in mine if kind == "put" for t in rest[0]]
        assert [e[0] for e in mine][-2:] == ["end", "finish"] and sum(e[0] == "end" for e in mine) == 1
        assert streamed == mine[-1][2] and len(streamed) == (budgets[i] or 64)
        puts = [e for e in mine if e[0] == "put"]
        assert all(len(e[2]) >= 1 for e in puts) and (len(puts) > 1 or budgets[i] == 1)  # as they commit, not at the end


@pytest.mark.parametrize("rule_name,lossless", RULE_CASES)
def test_sampled_outputs_follow_the_exact_law(enumerable, rule_name, lossless):  # noqa: F811
    """Thousands of requests through 64 rows with a stop token: the chi-square of the outputs,
    with drafts accepted and rejected, and a wrong residual that the same check rejects. The
    stop token is the rarest first token (3%; token 2 is 87%), so most requests draft."""
    sampling, stop, n = SamplingConfig(temperature=0.9, guidance=2.0), 0, 1500
    law = stopped_law(enumerable, sampling, stop)
    requests = (Request(torch.tensor([1]), make_generator(i)) for i in range(n))
    acceptance = rule(rule_name)
    decoder = SpeculativeJacobi(window=3, adapt=False, acceptance=acceptance)
    done, _ = continuous_decode(decoder, enumerable, requests, 4, sampling, batch_size=64, stopping=Stopping([stop]))
    assert acceptance.speculated(), acceptance.counts
    assert sum(sum(f.stats.accepted_histogram[2:]) for f in done) > 0  # requests finalised more than one token a forward
    lengths = torch.tensor([len(f.tokens) for f in done])
    tokens = torch.stack([torch.cat([f.tokens, f.tokens.new_zeros(4 - len(f.tokens))]) for f in done])
    assert outputs_follow(type("Out", (), {"tokens": tokens, "lengths": lengths}), law) == lossless


@pytest.mark.parametrize("name,sampling", [("sjd", SAMPLED), ("sjd", GREEDY), ("lantern", SAMPLED)],
                         ids=["sjd-sampled", "sjd-greedy", "lantern-sampled"])
def test_under_the_adaptive_window_each_row_chooses_its_own_widths_as_alone(name, sampling):
    """The default sjd (adaptive window) in continuous batching: each row's chooser sees only
    its own tokens, so each request verifies the draft counts of its decode alone with the
    batch's policy (`batch_rows` = 3: rows at different widths in one forward) and decodes its
    tokens, stats and draws."""
    decoder = make_decoder(name, window=8)
    requests = [Request(torch.tensor([label]), make_generator(10 + i)) for i, label in enumerate(LABELS)]
    done, _ = continuous_decode(decoder, MODEL, requests, 64, sampling, batch_size=3)
    single = make_decoder(name, window=8, adapt=AdaptiveWindow(batch_rows=3))
    for i, label in enumerate(LABELS):
        generator = make_generator(10 + i)
        alone = single.generate(MODEL, torch.tensor([label]), 64, sampling, generator)
        assert torch.equal(done[i].tokens, alone.tokens[0]), f"request {i}"
        assert done[i].stats.drafts_per_forward == alone.stats.drafts_per_forward, f"request {i}"
        assert done[i].stats.accepted_histogram == alone.stats.accepted_histogram
        assert torch.equal(requests[i].generator.get_state(), generator.get_state())
    # The rows did not share one width: their sequences differ, and each moved between widths.
    chosen = [tuple(f.stats.drafts_per_forward) for f in done]
    assert len(set(chosen)) > 2 and all(len(set(c)) > 1 for c in chosen)
    assert any(c[j] != d[j] for c in chosen for d in chosen for j in range(min(len(c), len(d))))


@pytest.mark.parametrize("rule_name,lossless", RULE_CASES)
def test_adaptive_rows_sample_the_exact_law(enumerable, rule_name, lossless):  # noqa: F811
    """Per-row adaptive windows through 64 rows, 2,000 requests: the chi-square of the outputs,
    with drafts accepted and rejected, and a wrong residual that the same check rejects."""
    sampling = SAMPLINGS["cfg+temperature+top_k"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    acceptance = rule(rule_name)
    # The adaptive window, each row judged as a decode of its own (at 64 rows' costs no draft
    # would pay, and the rows would decode autoregressively) at the linear CPU cost (the default
    # curve's dear drafts would not probe within these few tokens).
    decoder = SpeculativeJacobi(window=3, acceptance=acceptance, adapt=AdaptiveWindow(token_cost=TOKEN_COST["cpu"], batch_rows=1))
    requests = (Request(torch.tensor([1]), make_generator(i)) for i in range(2000))
    done, _ = continuous_decode(decoder, enumerable, requests, LENGTH, sampling, batch_size=64)
    assert acceptance.speculated(), acceptance.counts
    assert len({tuple(f.stats.drafts_per_forward) for f in done}) > 1  # the rows chose their own widths
    samples = torch.stack([f.tokens for f in done])
    assert (chi_square_pvalue(samples, seqs, joint) > ALPHA) == lossless


def test_rows_judge_widths_at_the_batch_cost_and_draft_nothing_where_no_width_can_pay():
    """A row's width widens the whole padded forward: at 8 guided rows on the CPU's token cost
    a draft costs the batch more than a token, so the rows decode autoregressively (no probe),
    each as a batch-1 decode with `batch_rows=8` does; at 2 rows they still draft."""
    decoder = make_decoder("sjd", window=8)
    requests = [Request(torch.tensor([label]), make_generator(10 + i)) for i, label in enumerate(LABELS)]
    done, stats = continuous_decode(decoder, MODEL, requests, 64, SAMPLED, batch_size=8)
    assert all(f.stats.mean_accepted_length == 1 for f in done)
    single = make_decoder("sjd", window=8, adapt=AdaptiveWindow(batch_rows=8))
    for i, label in enumerate(LABELS):
        alone = single.generate(MODEL, torch.tensor([label]), 64, SAMPLED, make_generator(10 + i))
        assert torch.equal(done[i].tokens, alone.tokens[0]), f"request {i}"
        assert done[i].stats.forwards == alone.stats.forwards == 64
    two, _ = continuous_decode(decoder, MODEL, [Request(r.conditions, make_generator(10 + i)) for i, r in enumerate(requests)],
                               64, SAMPLED, batch_size=2)
    assert any(max(f.stats.drafts_per_forward) > 0 for f in two)
    # A policy that names its own batch_rows keeps it (1: each row as a decode of its own).
    own, _ = continuous_decode(make_decoder("sjd", window=8, adapt=AdaptiveWindow(batch_rows=1)), MODEL,
                               [Request(torch.tensor([1]), make_generator(3))], 64, SAMPLED, batch_size=8)
    alone = make_decoder("sjd", window=8).generate(MODEL, torch.tensor([1]), 64, SAMPLED, make_generator(3))
    assert own[0].stats.drafts_per_forward == alone.stats.drafts_per_forward and max(alone.stats.drafts_per_forward) > 0


def test_what_cannot_be_batched_continuously_is_refused_before_any_work():
    requests = [Request(torch.tensor([1]), make_generator(0))]
    cases = {
        "cannot restart rows": PromptLookup(adapt=False),
        "its own fixed noise": CoupledJacobi(),
    }
    cases["cannot restart rows, "] = DraftSpeculative(drafter=MODEL, num_draft=2)
    for message, decoder in cases.items():
        with pytest.raises(ValueError, match=message):
            continuous_decode(decoder, MODEL, requests, 64, SAMPLED, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        continuous_decode(Autoregressive(), MODEL, requests, 64, SAMPLED, batch_size=0)
    with pytest.raises(ValueError, match="Request objects"):
        continuous_decode(Autoregressive(), MODEL, [torch.tensor([1])], 64, SAMPLED, batch_size=2)

    proposer, _ = SpeculativeJacobi().roles(MODEL, 8, make_generator(0))
    proposer.adapts_per_row = False  # a proposer that restarts rows but keeps one window for all
    with pytest.raises(ValueError, match="needs a fixed draft window"):
        check_row_feed(MODEL, proposer, AdaptiveWindow())

    class NoRestart:
        vocab_size = MODEL.vocab_size
        start, forward, commit, rewind = MODEL.start, MODEL.forward, MODEL.commit, MODEL.rewind

    with pytest.raises(ValueError, match="no `restart`"):
        continuous_decode(Autoregressive(), NoRestart(), requests, 64, SAMPLED, batch_size=2)
    assert continuous_decode(Autoregressive(), MODEL, [], 64, SAMPLED, batch_size=2)[0] == []


def test_a_narrowed_row_draws_what_its_own_width_draws():
    """`RowGenerators.narrowed`: row b's uniforms and Exp(1) noise over `short[b]` fewer slots
    are the draws a decode at that width makes, the rest 1.0 (accepts nothing), and the
    generator is left where that decode leaves it."""
    from mmgen.sampling import RowGenerators, exponential_noise, uniform

    rows = RowGenerators([make_generator(b) for b in range(3)])
    with rows.narrowed([0, 2, 3]):
        u, noise = uniform((3, 3), rows, "cpu"), exponential_noise((3, 4, 5), rows, "cpu")
    for b, short in enumerate([0, 2, 3]):
        own = make_generator(b)
        assert torch.equal(u[b, : 3 - short], torch.rand(1, 3 - short, generator=own)[0])
        assert torch.equal(noise[b, : 4 - short], torch.empty(1, 4 - short, 5).exponential_(generator=own)[0])
        assert bool((u[b, 3 - short :] == 1).all() and (noise[b, 4 - short :] == 1).all())
        assert torch.equal(rows[b].get_state(), own.get_state())
    assert rows.short is None  # only within the block


def test_requests_that_arrive_while_others_decode_start_at_the_next_forward():
    """A server's queue: the second request appears after four forwards and takes the free row
    at once (free rows ask every forward), decoding what it decodes alone."""
    from mmgen.decoding.speculative import feed_decode
    from mmgen.sampling import RowGenerators

    class LateQueue:
        def __init__(self, requests):
            self.waiting, self.asked, self.done, self.index = list(requests), 0, {}, {}

        def refill(self, rows):
            self.asked += 1
            if not self.waiting or (self.asked > 1 and self.asked < 5):
                return []
            self.index[rows[0]] = 2 - len(self.waiting)
            return [(rows[0], self.waiting.pop(0))]

        def finish(self, row, tokens, stats, masked):
            self.done[self.index.pop(row)] = (tokens, stats)

    decoder = fixed("sjd")
    queue = LateQueue([Request(torch.tensor([1]), make_generator(0)), Request(torch.tensor([5]), make_generator(1))])
    proposer, rule = decoder.roles(MODEL, 64, None)
    rows = RowGenerators([torch.Generator(), torch.Generator()])
    out = feed_decode(MODEL, queue, torch.tensor([1, 1]), 64, SAMPLED, rows, proposer, rule, decoder.capacity(64))
    alone = [solo(decoder, label, i, SAMPLED) for i, label in enumerate([1, 5])]
    for i in range(2):
        assert torch.equal(queue.done[i][0], alone[i].tokens[0])
    # The second request overlapped the first: fewer forwards than one after the other.
    assert out.stats.forwards < sum(a.stats.forwards - 1 for a in alone)


def test_a_request_with_nothing_to_sample_raises_what_its_batch_one_decode_raises():
    """The loop flags such a request (`Finished.masked`); pipelines raise for it through `checked()`."""
    from mmgen.decoding import DecodeStats
    from mmgen.decoding.batching import Finished
    from mmgen.sampling import AllTokensMaskedError

    clean = Finished(0, torch.zeros(3, dtype=torch.long), DecodeStats())
    assert clean.checked() is clean
    with pytest.raises(AllTokensMaskedError, match="every token was masked"):
        Finished(1, torch.zeros(3, dtype=torch.long), DecodeStats(), masked=True).checked()


def test_a_live_queue_hands_each_request_its_arrival_index_and_its_alone_tokens():
    from mmgen.decoding.batching import LiveQueue

    queue, seen = LiveQueue(), {}
    decoder = fixed("sjd")
    for i, label in enumerate([1, 5, 7]):
        queue.put(Request(torch.tensor([label]), make_generator(i)), lambda f: seen.__setitem__(f.index, f), None)
    _, stats = continuous_decode(decoder, MODEL, queue, 64, SAMPLED, batch_size=2)
    assert sorted(seen) == [0, 1, 2] and stats.rows == 3
    for i, label in enumerate([1, 5, 7]):
        assert torch.equal(seen[i].tokens, solo(decoder, label, i, SAMPLED).tokens[0])


@pytest.mark.parametrize("name,sampling", [("ar", SAMPLED), ("sjd", SAMPLED), ("sjd", GREEDY)],
                         ids=["ar-sampled", "sjd-sampled", "sjd-greedy"])
@pytest.mark.parametrize("first", [2, 4], ids=["arrive-at-start", "arrive-later"])
def test_a_live_batch_grows_and_narrows_with_its_requests_and_each_decodes_as_alone(name, sampling, first, monkeypatch):
    """A server's queue (`LiveQueue`): the batch starts as wide as the requests waiting, grows
    (up to `batch_size`) when more arrive than it has free rows, also while its first rows are
    being started, and narrows to its running rows once they fill at most half of it
    (`FeedRows.fit`); every request still decodes what it decodes alone, stats included."""
    from tests.streams import arrivals, recorded_widths

    widths, seen, labels = recorded_widths(monkeypatch), {}, [1, 5, 7, 2, 9, 0]
    request = lambda i: Request(torch.tensor([labels[i]]), make_generator(30 + i))
    queue = arrivals({first: [request(2), request(3)], 6: [request(4), request(5)]}, seen)
    for i in (0, 1):  # the batch starts with two rows
        queue.arrive(request(i))
    decoder = fixed(name)
    continuous_decode(decoder, MODEL, queue, 64, sampling, batch_size=4)
    assert sorted(seen) == list(range(len(labels)))
    for i, label in enumerate(labels):
        alone = solo(decoder, label, 30 + i, sampling)
        assert torch.equal(seen[i].tokens, alone.tokens[0]), f"request {i}"
        assert seen[i].stats.forwards == alone.stats.forwards
    steps = list(zip([2] + widths, widths))  # it starts with two rows
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps) and max(widths) == 4, widths
