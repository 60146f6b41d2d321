"""What a test that calls a speculative method exact needs besides the law it checks: proof
that the method speculated in that run (drafts judged both ways), and wrong rules that the
same test must reject (negative controls; vLLM tests its rejection sampler the same way).

An adaptive window can turn a distribution test into a test of plain autoregression (at
thousands of rows its cost model takes AR steps), and a drafter that never agrees with its
target never exercises the residual: a test passes then whatever the rule does. So each such
test decodes with a counting rule, asserts `speculated()`, and runs once more with a rule
from `WRONG_RULES`, expecting its check to fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmgen.decoding import DraftSpeculative, ExactAcceptance, SpeculativeJacobi
from mmgen.sampling import Logits


@dataclass(frozen=True)
class CountingAcceptance(ExactAcceptance):
    """The exact rule, counting its decisions up to each row's first rejection: `counts`
    ["accepted"] drafts that passed, ["rejected"] first rejections (frames: per codebook, in
    the loop's flattened order). Rows that had finished are counted too (they idle with fixed
    shapes), so decode enough live rows for the counts to mean something. A wrong rule below
    counts the exact rule's decisions on the same draws, then corrupts them."""

    counts: dict = field(default_factory=lambda: {"accepted": 0, "rejected": 0}, compare=False)

    def __call__(self, p, q, drafts, generator):
        accepted, residual = super().__call__(p, q, drafts, generator)
        passed = accepted.long().cumprod(-1)
        self.counts["accepted"] += int(passed.sum())
        self.counts["rejected"] += int((passed.sum(-1) < accepted.shape[-1]).sum())
        return self.corrupt(accepted, residual, p)

    def corrupt(self, accepted, residual, p):
        return accepted, residual

    def speculated(self) -> bool:
        """Whether drafts were both accepted and rejected."""
        return self.counts["accepted"] > 0 and self.counts["rejected"] > 0


@dataclass(frozen=True)
class ResidualForgotten(CountingAcceptance):
    """A subtly wrong rule: the right acceptance test, but resampling from p, not max(0, p - q)."""

    def corrupt(self, accepted, residual, p):
        return accepted, p


@dataclass(frozen=True)
class AlwaysAccept(CountingAcceptance):
    """A deliberately wrong rule: every draft passes."""

    def corrupt(self, accepted, residual, p):
        return torch.ones_like(accepted), residual


#: The negative controls: a distribution test that passes under one of these cannot fail.
WRONG_RULES = {"residual-forgotten": ResidualForgotten, "always-accept": AlwaysAccept}
#: Parametrisation for a distribution test: (rule name, whether the decode must follow the law).
RULE_CASES = [("exact", True), ("residual-forgotten", False)]


def rule(name: str) -> CountingAcceptance:
    """A fresh counting rule by name: "exact" or one of `WRONG_RULES`."""
    return CountingAcceptance() if name == "exact" else WRONG_RULES[name]()


class Tempered:
    """A token model whose logits are another's divided by `temperature`: a drafter that agrees
    with its target on which tokens are likely but not on how likely, so some of its drafts are
    accepted and some rejected, and the residual at a rejection matters. A frame model that
    completes its frames itself (CSM's depth decoder: `complete_frame`) is tempered there too,
    so every codebook's drafts, not codebook 0's alone, are judged both ways."""

    def __init__(self, model, temperature: float):
        self.model, self.temperature = model, temperature

    def __getattr__(self, name):
        if name == "complete_frame":  # only where the model has one (the loop asks with getattr)
            complete = self.model.complete_frame
            return lambda state, slot, frame, known, probs, generator: complete(
                state, slot, frame, known, lambda logits, k: probs(self._scaled(logits), k), generator)
        return getattr(self.model, name)

    def _scaled(self, logits):
        if isinstance(logits, Logits):
            return Logits(logits.cond / self.temperature, None if logits.uncond is None else logits.uncond / self.temperature)
        return logits / self.temperature

    def start(self, conditions, capacity, guidance):
        state = self.model.start(conditions, capacity, guidance)
        state.first_logits = self._scaled(state.first_logits)
        return state

    def forward(self, state, tokens):
        return self._scaled(self.model.forward(state, tokens))

    def commit(self, state, accepted):
        self.model.commit(state, accepted)

    def rewind(self, state, n):
        self.model.rewind(state, n)


def pinned_decoder(name: str, acceptance: CountingAcceptance, target, window: int = 3):
    """A speculative decoder for a distribution test that always drafts: `sjd` with a fixed
    `window`, or `draft` with 2 drafts from `target` itself at 8x its temperature (`Tempered`)."""
    if name == "draft":
        return DraftSpeculative(drafter=Tempered(target, 8.0), num_draft=2, acceptance=acceptance)
    return SpeculativeJacobi(window=window, adapt=False, acceptance=acceptance)


def assert_drafted(out, ar) -> None:
    """That a lossless decode equal to autoregressive decoding (`ar`) also speculated: some row
    finalised more than one token in a forward, and the decode took fewer forwards than AR's
    (a decoder that never drafts, or whose drafts are never accepted, is AR and passes any
    greedy identity test)."""
    assert sum(out.stats.accepted_histogram[2:]) > 0, f"no draft was accepted: {out.stats.accepted_histogram}"
    assert out.stats.forwards < ar.stats.forwards, (out.stats.forwards, ar.stats.forwards)


def assert_continuous_equals_alone(decoder, model, sampling, labels=(1, 5, 7, 2, 9), num_tokens: int = 64) -> None:
    """Continuous batching at two rows (restarts, a batch that narrows and widens): each
    class-conditional request decodes exactly what it decodes alone from its own generator,
    and drafts were accepted along the way."""
    from mmgen.decoding.batching import Request, continuous_decode
    from mmgen.sampling import make_generator

    requests = [Request(torch.tensor([label]), make_generator(10 + i)) for i, label in enumerate(labels)]
    done, _ = continuous_decode(decoder, model, requests, num_tokens, sampling, batch_size=2)
    for i, label in enumerate(labels):
        generator = make_generator(10 + i)
        alone = decoder.generate(model, torch.tensor([label]), num_tokens, sampling, generator)
        assert torch.equal(done[i].tokens, alone.tokens[0]), f"request {i}"
        assert torch.equal(requests[i].generator.get_state(), generator.get_state())
        assert done[i].stats.accepted_histogram == alone.stats.accepted_histogram
    assert sum(sum(f.stats.accepted_histogram[2:]) for f in done) > 0, "no draft was accepted"


def assert_confidence_stop_stays_greedy(decoder, model, conditions, num_draft: int, sampling=None, num_tokens: int = 64):
    """A decoder with a confidence stop (`confidence=`) under greedy `sampling` (CFG 4 by
    default): token-identical to autoregressive decoding, drafted, and some of its rounds stopped
    early while others drafted all `num_draft` (`drafts_per_forward`: one count per forward after
    the prefill). Returns the decode, for checks of the proposer's own draft forwards."""
    from mmgen.decoding import Autoregressive
    from mmgen.sampling import SamplingConfig

    sampling = sampling or SamplingConfig(top_k=1, guidance=4.0)
    ar = Autoregressive().generate(model, conditions, num_tokens, sampling, torch.Generator().manual_seed(0))
    out = decoder.generate(model, conditions, num_tokens, sampling, torch.Generator().manual_seed(1))
    assert torch.equal(out.tokens, ar.tokens)
    assert_drafted(out, ar)
    counts = out.stats.drafts_per_forward
    assert len(counts) == out.stats.forwards - 1 and min(counts) < num_draft == max(counts), counts
    return out


def assert_confidence_stop_keeps_the_law(decoder, enumerable, num_draft: int, batches: int = 500) -> None:
    """A decoder with a confidence stop samples the exact joint of `enumerable` (chi-square, CFG,
    temperature and top-k), in batches of 12 where rounds do stop (at thousands of rows, half of
    them are never unsure at once), and the stop both cut rounds to one draft and let others run
    to `num_draft`, with drafts accepted."""
    from tests.core.test_decoding import ALPHA, LENGTH, SAMPLINGS, chi_square_pvalue, exact_joint

    sampling = SAMPLINGS["cfg+temperature+top_k"]
    seqs, joint = exact_joint(enumerable, 1, sampling)
    generator, samples, counts, accepted = torch.Generator().manual_seed(0), [], [], 0
    for _ in range(batches):
        out = decoder.generate(enumerable, torch.full((12,), 1), LENGTH, sampling, generator)
        samples.append(out.tokens)
        counts += out.stats.drafts_per_forward
        accepted += out.stats.accepted_drafts
    assert min(counts) == 1 and max(counts) == num_draft and accepted > 0, (min(counts), max(counts), accepted)
    assert chi_square_pvalue(torch.cat(samples), seqs, joint) > ALPHA


def assert_streams_its_output(decoder, model, sampling, labels=(1, 2), num_tokens: int = 32) -> None:
    """Streaming (`TokenQueueStreamer`, read from another thread) hands each row exactly the
    tokens of the decode's output, as they commit."""
    import threading

    from mmgen.decoding import TokenQueueStreamer

    streamer, result = TokenQueueStreamer(timeout=60), {}
    thread = threading.Thread(target=lambda: result.setdefault("out", decoder.generate(
        model, torch.tensor(list(labels)), num_tokens, sampling, torch.Generator().manual_seed(0), streamer=streamer)))
    thread.start()
    rows = [[] for _ in labels]
    for row, tokens in streamer:
        rows[row].extend(tokens.tolist())
    thread.join()
    assert rows == result["out"].tokens.tolist()
