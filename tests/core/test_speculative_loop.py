"""The one speculative loop: stopping, streaming, frames of codebooks and prompt lookup.

Lossless is checked both ways, as for every proposer: greedy outputs token-identical to
autoregressive decoding, and sampled outputs matching the exactly enumerated distribution
(chi-square, tests/core/test_decoding.py).
"""

import itertools
import random
import threading

import pytest
import torch
from scipy.stats import chisquare

from mmgen.decoding import Autoregressive, CoupledJacobi, DraftSpeculative, PromptLookup, SpeculativeJacobi
from mmgen.decoding.ngram import NGramIndex
from mmgen.decoding.stopping import Stopping, TokenQueueStreamer
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.modeling import DecodeState
from mmgen.sampling import Logits, SamplingConfig

from tests.conftest import tiny_transformer
from tests.speculation import RULE_CASES, rule
from tests.core.test_decoding import ALPHA, LENGTH, VOCAB, enumerable, exact_joint  # noqa: F401

DRAFTER = LlamaGenTokenModel(tiny_transformer(seed=7))
GREEDY = SamplingConfig(top_k=1, guidance=4.0)


def decoders():
    return {
        "ar": Autoregressive(),
        "sjd": SpeculativeJacobi(window=8),
        "sjd-left": SpeculativeJacobi(window=8, draft_init="left"),
        "coupled": CoupledJacobi(window=8),
        "draft": DraftSpeculative(drafter=DRAFTER, num_draft=4),
        "lookup": PromptLookup(num_draft=6, max_ngram=2),
    }


class Committed:
    """A token model wrapper that counts what each row commits."""

    def __init__(self, model):
        self.model, self.vocab_size = model, model.vocab_size
        self.committed = None

    def start(self, conditions, capacity, guidance):
        state = self.model.start(conditions, capacity, guidance)
        self.committed = torch.zeros(state.batch_size, dtype=torch.long)
        return state

    def forward(self, state, tokens):
        return self.model.forward(state, tokens)

    def commit(self, state, accepted):
        self.committed += accepted
        self.model.commit(state, accepted)

    def rewind(self, state, n):
        self.model.rewind(state, n)


class Collect:
    def __init__(self):
        self.rows, self.ended = None, 0

    def put(self, rows):
        if self.rows is None:
            self.rows = [[] for _ in rows]
        for row, new in zip(self.rows, rows):
            row.extend(new.tolist())

    def end(self):
        self.ended += 1


def greedy_stop_token():
    """A token greedy AR emits mid-sequence in row 0 (and first at index 11 there)."""
    model = LlamaGenTokenModel(tiny_transformer())
    tokens = Autoregressive().generate(model, torch.tensor([1, 5, 7]), 64, GREEDY, torch.Generator()).tokens
    for i in range(8, 40):
        if (tokens[0, :i] != tokens[0, i]).all():
            return int(tokens[0, i]), i, tokens
    raise AssertionError("no fresh token in row 0")


@pytest.mark.parametrize("name", sorted(decoders()))
def test_stop_tokens_end_rows_and_nothing_after_is_committed_or_emitted(name):
    stop, first, full = greedy_stop_token()
    model = Committed(LlamaGenTokenModel(tiny_transformer()))
    stopping = Stopping(stop_tokens=[stop], max_new_tokens=[64, 64, 20], pad_token=-1)
    streamed = Collect()
    out = decoders()[name].generate(model, torch.tensor([1, 5, 7]), 64, GREEDY, torch.Generator().manual_seed(1),
                                    stopping=stopping, streamer=streamed)
    expected = []
    for b in range(3):
        hits = (full[b] == stop).nonzero().flatten().tolist()
        expected.append(min([h + 1 for h in hits] + [64, stopping.max_new_tokens[b]]))
    assert out.lengths.tolist() == expected and expected[0] == first + 1
    for b, n in enumerate(expected):
        assert torch.equal(out.tokens[b, :n], full[b, :n])  # greedy: identical to AR up to the stop
        assert (out.tokens[b, n:] == -1).all()  # nothing after the stop is output
        assert streamed.rows[b] == full[b, :n].tolist()  # streamed exactly once, in order
    assert streamed.ended == 1
    # The model kept every fed token up to the stop and none after it (the last token is never fed).
    assert model.committed.tolist() == [n - 1 for n in expected]
    # Stats count the batch's longest row: what autoregressive decoding of it costs in forwards.
    assert out.stats.tokens == max(expected)
    if name == "ar":
        assert out.stats.forwards == max(expected) and out.stats.step_compression == 1.0


@pytest.mark.parametrize("name", sorted(decoders()))
def test_temperature_zero_decodes_greedily_without_drawing(name):
    """Temperature 0 gives the one-hot laws top-k 1 gives (the same tokens under every decoder),
    and the target draws nothing for them: decoders whose drafts are not random leave the
    generator where it was."""
    conditions = torch.tensor([1, 5, 7])
    expected = Autoregressive().generate(LlamaGenTokenModel(tiny_transformer()), conditions, 48, GREEDY, torch.Generator()).tokens
    generator = torch.Generator().manual_seed(3)
    before = generator.get_state()
    out = decoders()[name].generate(LlamaGenTokenModel(tiny_transformer()), conditions, 48,
                                    SamplingConfig(temperature=0.0, guidance=4.0), generator)
    assert torch.equal(out.tokens, expected)
    if name in ("ar", "lookup"):
        assert torch.equal(generator.get_state(), before)


# Coupled decoding has its own rule (a match of coupled draws) and no residual to get wrong.
STOP_CASES = [(name, *case) for name in ("sjd", "draft", "lookup") for case in RULE_CASES] + [("coupled", "exact", True)]


@pytest.mark.parametrize("name,rule_name,lossless", STOP_CASES)
def test_sampling_with_a_stop_token_matches_exact_distribution(enumerable, name, rule_name, lossless):
    """Rows end at token 2: the outputs (sequence up to and with its stop) follow the exact law,
    and do not under a wrong residual. Fixed windows: at 6000 rows the adaptive window would
    take AR steps and test nothing speculative."""
    sampling = SamplingConfig(temperature=0.9, guidance=2.0)
    stop = 2
    law = stopped_law(enumerable, sampling, stop)
    n = 6000
    acceptance = rule(rule_name)
    drafter = LlamaGenTokenModel(tiny_transformer(vocab_size=VOCAB, block_size=LENGTH, num_classes=3, seed=11))
    decoder = {
        "sjd": SpeculativeJacobi(window=3, adapt=False, acceptance=acceptance),
        "draft": DraftSpeculative(drafter=drafter, num_draft=2, acceptance=acceptance),
        "lookup": PromptLookup(num_draft=2, max_ngram=1, adapt=False, acceptance=acceptance),
        "coupled": CoupledJacobi(window=3),
    }[name]
    out = decoder.generate(enumerable, torch.full((n,), 1), LENGTH, sampling, torch.Generator().manual_seed(0),
                           stopping=Stopping(stop_tokens=[stop]))
    if name == "coupled":
        assert 0 < sum(out.stats.accepted_histogram[2:]) < n * (LENGTH - 1), "coupled drafts were all or never accepted"
    else:
        assert acceptance.speculated(), acceptance.counts
    assert outputs_follow(out, law) == lossless


def stopped_law(model, sampling: SamplingConfig, stop=None) -> dict:
    """P(output) of class 1 under `sampling`, outputs cut just after their first `stop` token."""
    seqs, joint = exact_joint(model, 1, sampling)
    law: dict = {}
    for seq, p in zip(seqs.tolist(), joint.tolist()):
        cut = tuple(seq[: seq.index(stop) + 1] if stop in seq else seq)
        law[cut] = law.get(cut, 0.0) + p
    return law


def outputs_follow(out, law: dict) -> bool:
    """Whether a decode's rows (each up to its length) pass a chi-square test against `law`
    (false alarm rate ALPHA; an output outside the law's support fails)."""
    keys = sorted(law)
    counts = dict.fromkeys(keys, 0)
    for row, length in zip(out.tokens.tolist(), out.lengths.tolist()):
        key = tuple(row[:length])
        if key not in counts:
            return False  # an impossible output
        counts[key] += 1
    observed = torch.tensor([counts[k] for k in keys], dtype=torch.float64)
    expected = torch.tensor([law[k] for k in keys], dtype=torch.float64) * len(out.tokens)
    return chisquare(observed, expected).pvalue > ALPHA


def assert_outputs_follow(out, law: dict) -> None:
    assert outputs_follow(out, law), "the outputs do not follow the law (chi-square)"


def test_queue_streamer_yields_rows_as_they_commit():
    model = LlamaGenTokenModel(tiny_transformer())
    streamer = TokenQueueStreamer(timeout=60)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", SpeculativeJacobi(window=4).generate(
        model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator().manual_seed(0), streamer=streamer)))
    thread.start()
    rows = [[], []]
    chunks = 0
    for row, tokens in streamer:
        rows[row].extend(tokens.tolist())
        chunks += 1
    thread.join()
    assert rows == result["out"].tokens.tolist() and chunks > 2


def test_per_row_budgets_without_stop_tokens():
    model = LlamaGenTokenModel(tiny_transformer())
    ar = Autoregressive().generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator())
    out = SpeculativeJacobi(window=8).generate(model, torch.tensor([1, 2]), 32, GREEDY, torch.Generator(),
                                               stopping=Stopping(max_new_tokens=[5, 32]))
    assert out.lengths.tolist() == [5, 32]
    assert torch.equal(out.tokens[0, :5], ar.tokens[0, :5]) and (out.tokens[0, 5:] == 0).all()
    assert torch.equal(out.tokens[1], ar.tokens[1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        Autoregressive().generate(model, torch.tensor([1]), 8, GREEDY, torch.Generator(), stopping=Stopping(max_new_tokens=0))


# ------------------------------------------------------------------------------------------
# Frames: K codebook tokens per position
# ------------------------------------------------------------------------------------------


class ToyFrameModel:
    """K parallel codebook heads over a running mean of the frames so far (the shape of Dia's
    decoder, without its weights). The cache is each row's running sum and length."""

    def __init__(self, vocab_size=2, num_codebooks=4, dim=8, scale=1.5, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.num_codebooks = vocab_size, num_codebooks
        self.embed = torch.randn(num_codebooks, vocab_size, dim, generator=g)
        self.label = torch.randn(4, dim, generator=g)
        self.head = torch.randn(num_codebooks, dim, vocab_size, generator=g) * scale

    def _logits(self, total, count):
        return torch.einsum("bnd,kdv->bnkv", torch.tanh(total / count[..., None]), self.head)

    def start(self, conditions, capacity, guidance):
        total = self.label[conditions][:, None]
        count = torch.ones(len(conditions), 1)
        state = DecodeState(cache=None, batch_size=len(conditions), guidance=False,
                            first_logits=Logits(self._logits(total, count)))
        state.extra = {"total": total[:, 0], "count": count[:, 0], "fed": None}
        return state

    def frame_embeddings(self, frames):  # [B, n, K] -> [B, n, D]
        return sum(self.embed[c][frames[..., c]] for c in range(self.num_codebooks))

    def forward(self, state, frames):
        e = self.frame_embeddings(frames)
        state.extra["fed"] = e
        total = state.extra["total"][:, None] + e.cumsum(1)
        count = state.extra["count"][:, None] + torch.arange(1, frames.shape[1] + 1)
        return Logits(self._logits(total, count))

    def commit(self, state, accepted):
        keep = torch.arange(state.extra["fed"].shape[1])[None] < accepted[:, None]
        state.extra["total"] = state.extra["total"] + (state.extra["fed"] * keep[..., None]).sum(1)
        state.extra["count"] = state.extra["count"] + accepted

    def rewind(self, state, n):
        raise NotImplementedError


def exact_frame_joint(model, label, length, sampling):
    """P(sequence of frames) for every sequence, by teacher forcing."""
    K, V = model.num_codebooks, model.vocab_size
    frames = list(itertools.product(range(V), repeat=K))
    seqs = torch.tensor(list(itertools.product(frames, repeat=length)))  # [N, length, K]
    state = model.start(torch.full((len(seqs),), label), length, False)
    logits = Logits(torch.cat([state.first_logits.cond, model.forward(state, seqs[:, :-1]).cond], 1))
    probs = torch.stack([s.probs(logits[:, :, c], torch.arange(length).expand(len(seqs), -1)) for c, s in enumerate(sampling)], 2)
    joint = probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1).prod(-1)
    return seqs, joint / joint.sum()


@pytest.mark.parametrize("draft_init", ["random", "random-uniform", "left"])
def test_frames_greedy_jacobi_equals_ar(draft_init):
    """Every draft initialiser fills whole frames (left: the frame to the left, all codebooks)."""
    model = ToyFrameModel(vocab_size=4, scale=3.0)
    sampling = SamplingConfig(temperature=0.0)
    ar = Autoregressive().generate(model, torch.tensor([0, 1, 2]), 24, sampling, torch.Generator())
    out = SpeculativeJacobi(window=6, draft_init=draft_init).generate(model, torch.tensor([0, 1, 2]), 24, sampling,
                                                                     torch.Generator().manual_seed(2))
    assert ar.tokens.shape == (3, 24, 4) and torch.equal(ar.tokens, out.tokens)
    assert out.stats.forwards < ar.stats.forwards


@pytest.mark.parametrize("name,rule_name,lossless",
                         [("ar", "exact", True)] + [(name, *case) for name in ("sjd", "lookup") for case in RULE_CASES])
def test_frames_sampling_matches_exact_distribution(name, rule_name, lossless):
    """K = 2 codebooks of 2 tokens, 4 frames: 256 outcomes; per-codebook temperatures. Four
    frames through a 3-frame window: after the first forward's random drafts, the drafts
    verified are the frames the previous forward sampled (Jacobi's carried drafts, drawn under
    another context), where the residual is what keeps the law; the wrong residual fails.
    Prompt lookup drafts the frames that followed the last frame's earlier occurrence (one-hot
    laws: its rejections are where the residual matters)."""
    model = ToyFrameModel(num_codebooks=2)
    sampling = [SamplingConfig(temperature=t) for t in (1.0, 0.8)]
    length, n = 4, 16000
    seqs, joint = exact_frame_joint(model, 1, length, sampling)
    acceptance = rule(rule_name)
    decoder = {"ar": lambda: Autoregressive(),
               "sjd": lambda: SpeculativeJacobi(window=3, adapt=False, acceptance=acceptance),
               "lookup": lambda: PromptLookup(num_draft=2, max_ngram=1, adapt=False, acceptance=acceptance)}[name]()
    out = decoder.generate(model, torch.full((n,), 1), length, sampling, torch.Generator().manual_seed(0))
    if name != "ar":
        assert acceptance.speculated(), acceptance.counts
        # Forwards that accepted both drafted frames, and some that accepted one: carried frames pass too.
        assert min(out.stats.accepted_histogram[2:]) > 0.03 * n, out.stats.accepted_histogram
    weights = 2 ** torch.arange(length * 2).flip(0)
    codes = (out.tokens.reshape(n, -1) * weights).sum(-1)
    order = (seqs.reshape(len(seqs), -1) * weights).sum(-1)
    observed = torch.bincount(codes, minlength=len(seqs)).double()[order]
    expected = joint * n
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    assert (chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > ALPHA) == lossless


# ------------------------------------------------------------------------------------------
# Prompt lookup
# ------------------------------------------------------------------------------------------


def test_lookup_drafts_of_frames_match_whole_frames():
    """Frames [B, S, K]: the latest earlier frame equal in every codebook; a frame equal in one
    codebook only is no match."""
    seq = [(1, 1), (2, 2), (3, 3), (1, 0), (4, 4), (1, 1), (0, 0)]
    drafts, found = NGramIndex(1, seq[:6]).drafts(2)
    assert drafts == [(2, 2), (3, 3)] and found  # [1, 1] last at 0 (not [1, 0] at 3)
    none, found = NGramIndex(1, seq[:5]).drafts(2)
    assert none == [(4, 4), (4, 4)] and not found  # [4, 4] never occurred before: the last frame repeats


def test_lookup_drafts_copy_what_followed_the_latest_match():
    rows = [NGramIndex(2, [1, 2, 3, 9, 1, 2, 3, 7, 1, 2]).drafts(3), NGramIndex(2, [5, 6, 5, 6, 5]).drafts(3)]
    # Row 0 ends "1 2": latest earlier "1 2" at 4 -> "3 7 1". Row 1 ends "6 5": latest earlier at 1 -> "6 5" then
    # nothing valid follows, so the last copied token repeats.
    assert rows == [([3, 7, 1], True), ([6, 5, 5], True)]
    assert NGramIndex(2, [1, 2, 3, 4]).drafts(2) == ([4, 4], False)


def test_the_ngram_index_grown_token_by_token_finds_the_latest_earlier_match():
    """`NGramIndex` as the proposer grows it (a few tokens at a time) against the definition,
    searched from scratch: the latest n-gram equal to the last n tokens that ends before the
    newest token, longest n first; then what followed it, the last copied token repeated."""
    generator = random.Random(0)
    for _ in range(50):
        seq = [generator.randrange(4) for _ in range(40)]
        index, at = NGramIndex(3), 0
        while at < len(seq):
            step = generator.randrange(1, 4)
            index.extend(seq[at:at + step])
            at = min(at + step, len(seq))
            L, expected = at, (seq[at - 1:at] * 5, False)
            for n in range(min(3, L - 1), 0, -1):
                starts = [s for s in range(L - n) if seq[s:s + n] == seq[L - n:L]]
                if starts:
                    follow = seq[:L][starts[-1] + n:starts[-1] + n + 5]
                    expected = (follow + follow[-1:] * (5 - len(follow)), True)
                    break
            assert index.drafts(5) == expected, (seq[:L], index.drafts(5), expected)


class Successor:
    """Greedy decodes walk a fixed cycle through all `vocab_size` tokens (the next token's
    logits peak at the newest token's successor): an answer without repeats, so a lookup over a
    copy of it finds exactly one match for each newest token, and what it drafts is fixed."""

    vocab_size = 64

    def __init__(self):
        order = torch.randperm(self.vocab_size, generator=torch.Generator().manual_seed(0))
        self.successor = torch.empty_like(order)
        self.successor[order] = order.roll(-1)

    def _logits(self, tokens):
        return Logits(torch.nn.functional.one_hot(self.successor[tokens], self.vocab_size).float() * 4.0)

    def start(self, conditions, capacity, guidance):
        return DecodeState(cache=None, batch_size=len(conditions), guidance=False, first_logits=self._logits(conditions[:, None]))

    def forward(self, state, tokens):
        return self._logits(tokens)

    def commit(self, state, accepted):
        pass

    def rewind(self, state, n):
        pass


def test_prompt_lookup_accepts_copies_of_its_context():
    """A context that holds the whole answer without repeats: every forward after the prefill
    drafts the next 8 tokens of the answer and accepts them all (9 tokens a forward), so 64
    tokens take exactly 1 + 7 forwards; a context with two tokens swapped costs more."""
    model, greedy = Successor(), SamplingConfig(top_k=1)
    ar = Autoregressive().generate(model, torch.tensor([3]), 64, greedy, torch.Generator())
    answer = ar.tokens[0]
    assert len(set(answer.tolist())) == 64  # no repeats: one match per token
    decode = lambda context: PromptLookup(num_draft=8, max_ngram=1, adapt=False, context=context).generate(
        model, torch.tensor([3]), 64, greedy, torch.Generator())
    out = decode(answer)
    assert torch.equal(out.tokens, ar.tokens)
    assert out.stats.forwards == 8 and out.stats.accepted_per_forward == [1] + [9] * 7
    wrong = answer.clone()
    wrong[[30, 31]] = answer[[31, 30]]  # still no repeats, but a wrong continuation from token 29 on
    out = decode(wrong)
    assert torch.equal(out.tokens, ar.tokens) and out.stats.forwards > 8


@pytest.mark.parametrize("adapt", [False, True], ids=["fixed", "adaptive"])
def test_prompt_lookup_without_a_match_takes_an_autoregressive_step(adapt):
    """Where the newest token never occurred before (no 1-gram match) lookup has nothing to
    propose and the forward is an autoregressive step; it drafts exactly where one did (the
    fixed window) or only there (the adaptive one); greedy output stays AR's, and the stats
    record each forward's draft count."""
    model = LlamaGenTokenModel(tiny_transformer())
    ar = Autoregressive().generate(model, torch.tensor([3]), 64, GREEDY, torch.Generator())
    out = PromptLookup(num_draft=4, max_ngram=1, adapt=adapt).generate(model, torch.tensor([3]), 64, GREEDY, torch.Generator())
    assert torch.equal(out.tokens, ar.tokens)
    tokens, drafts = out.tokens[0].tolist(), out.stats.drafts_per_forward
    assert len(drafts) == out.stats.forwards - 1
    pos, matched = 0, []
    for d, step in zip(drafts, out.stats.accepted_per_forward[1:]):
        matched.append(tokens[pos] in tokens[:pos])
        assert d == 0 or matched[-1], f"drafted without a match at token {pos}"
        if not adapt:
            assert d == (4 if matched[-1] else 0)
        pos += int(step)
    assert not all(matched) and any(d > 0 for d in drafts)  # both kinds of forward happened
