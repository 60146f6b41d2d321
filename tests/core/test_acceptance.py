"""Acceptance rules, checked exactly on small vocabularies.

For one position, the output distribution of a rule is enumerable: draft x ~ q is accepted
with probability a(x), else the token comes from the residual r_x. Exact: the output is p.
Bounded lossy rules: the output is exactly their relaxed target pi, which moves at most delta
(LANTERN), at most (lam - 1) p(x) per draft (LANTERN++) or the draft's group mass (GSD)
away from p. The papers' literal rules are shown to break the delta bound when q is spread.
"""

from dataclasses import dataclass

import pytest
import torch

from mmgen.decoding import ExactAcceptance, GroupedAcceptance, RelaxedAcceptance, make_decoder

V = 6


@dataclass
class Tables:
    """A stand-in model offering the per-token tables the lossy rules read."""

    vocab_size: int
    codebook_table: torch.Tensor
    embedding_table: torch.Tensor

    def codebook(self):
        return self.codebook_table

    def token_embeddings(self):
        return self.embedding_table


def random_case(seed, onehot_q=False):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(V, generator=g) ** 3
    if seed % 3 == 0:
        p[p.argsort()[:2]] = 0  # as after top-k: filtered tokens must never be emitted
    p = p / p.sum()
    if onehot_q:
        q = torch.nn.functional.one_hot(torch.randint(V, (1,), generator=g), V)[0].float()
    else:
        q = torch.rand(V, generator=g) ** 2
        q = q / q.sum()
    model = Tables(V, torch.randn(V, 2, generator=g), 0.4 * torch.randn(V, 3, generator=g))
    return p, q, model


def output_distribution(rule, p, q):
    """Exact P(output = y) of one verified position, enumerating the draft x ~ q."""
    drafts = torch.arange(V)[None]  # every possible draft, one per "position"
    accept, residual = rule.probabilities(p.expand(1, V, V), q.expand(1, V, V), drafts)
    accept, residual = accept[0].double(), residual[0].double()
    qd = q.double()
    return torch.diag(qd * accept).sum(0) + ((qd * (1 - accept))[:, None] * residual).sum(0)


def tv(a, b):
    return 0.5 * (a.double() - b.double()).abs().sum().item()


def brute_force_neighbourhood(rule, p, x):
    """N(x) computed with plain loops, independently of the vectorised rule."""
    if p[x] == 0:
        return []  # a token the filters removed claims nothing
    if isinstance(rule, RelaxedAcceptance):
        order = torch.cdist(rule_model.codebook_table[x : x + 1], rule_model.codebook_table)[0]
        order[x] = float("inf")
        budget = rule.delta if rule.lam is None else (rule.lam - 1) * p[x].item()
        members, total = [], 0.0
        for y in order.argsort()[: min(rule.k, V - 1)].tolist():
            if total + p[y].item() > budget + 1e-7:
                break
            members.append(y)
            total += p[y].item()
        return members
    ranks = p.argsort(descending=True).tolist()
    r = ranks.index(x)
    e = rule_model.embedding_table
    return [ranks[rr] for rr in range(max(0, r - rule.rank_window), min(V, r + rule.rank_window + 1))
            if ranks[rr] != x and abs(p[ranks[rr]] - p[x]) < rule.prob_threshold
            and ((e[ranks[rr]] - e[x]) ** 2).sum() < rule.distance_threshold]


def brute_force_mixture(rule, p, q):
    """sum_x q(x) p_x, where p_x moves the mass of N(x) onto x."""
    pi = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        p_x = p.double().clone()
        members = brute_force_neighbourhood(rule, p, x)
        p_x[x] += p_x[members].sum()
        p_x[members] = 0
        pi += q[x].double() * p_x
    return pi


rule_model = None


@pytest.mark.parametrize("seed", range(20))
def test_exact_rule_outputs_the_target(seed):
    p, q, _ = random_case(seed)
    assert tv(output_distribution(ExactAcceptance(), p, q), p) < 1e-6


RULES = {
    "lantern d=0.1": RelaxedAcceptance(delta=0.1),
    "lantern d=0.3 k=2": RelaxedAcceptance(delta=0.3, k=2),
    "lantern++ lam=2": RelaxedAcceptance(lam=2.0),
    "gsd": GroupedAcceptance(),
    "gsd wide": GroupedAcceptance(rank_window=2, prob_threshold=0.5, distance_threshold=2.0),
}


@pytest.mark.parametrize("onehot_q", [False, True])
@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("seed", range(15))
def test_bounded_rules_move_at_most_their_budget(name, seed, onehot_q):
    global rule_model
    p, q, rule_model = random_case(seed, onehot_q)
    rule = RULES[name].bind(rule_model)
    out = output_distribution(rule, p, q)
    pi = rule.relaxed_target(p[None, None], q[None, None])[0, 0]
    assert abs(out.sum().item() - 1) < 1e-5 and (out >= -1e-7).all()
    assert (out[p == 0] < 1e-7).all(), "a token the sampling filters removed was emitted"
    assert tv(out, pi) < 1e-5, "the output must be exactly the relaxed target"
    # The relaxed target is the q-mixture of "move N(x) onto x": check against brute force.
    assert tv(pi, brute_force_mixture(rule, p, q)) < 1e-5
    mass = torch.tensor([p[brute_force_neighbourhood(rule, p, x)].sum().item() for x in range(V)])
    assert tv(out, p) <= (q * mass).sum().item() + 1e-5
    if isinstance(rule, RelaxedAcceptance) and rule.lam is None:
        assert tv(out, p) <= rule.delta + 1e-6
    if isinstance(rule, RelaxedAcceptance) and rule.lam is not None:
        assert (out <= rule.lam * p + 1e-6).all()
    if onehot_q:  # one-hot drafts: exactly the papers' rule (x gains p(N(x)), N(x) loses it)
        x = int(q.argmax())
        assert abs(out[x].item() - min(1.0, p[x].item() + mass[x].item())) < 1e-5


def test_literal_lantern_breaks_the_delta_bound_with_a_spread_q():
    """The negative control: the paper's per-draft rule, with carried (non one-hot) drafts."""
    global rule_model
    worst = 0.0
    for seed in range(60):
        p, q, rule_model = random_case(seed)
        rule = RelaxedAcceptance(delta=0.1, bounded=False).bind(rule_model)
        worst = max(worst, tv(output_distribution(rule, p, q), p))
    assert worst > 1.25 * rule.delta, worst


def test_literal_rules_equal_bounded_rules_for_one_hot_drafts_on_acceptance():
    global rule_model
    for seed in range(10):
        p, q, rule_model = random_case(seed, onehot_q=True)
        x = torch.tensor([[int(q.argmax())]])
        for rule in (RelaxedAcceptance(delta=0.2), GroupedAcceptance()):
            bounded = rule.bind(rule_model).probabilities(p[None, None], q[None, None], x)[0]
            literal = type(rule)(**{**_params(rule), "bounded": False}).bind(rule_model).probabilities(p[None, None], q[None, None], x)[0]
            assert torch.allclose(bounded, literal, atol=1e-6)


def _params(rule):
    return {k: getattr(rule, k) for k in ("k", "delta", "lam", "rank_window", "prob_threshold", "distance_threshold") if hasattr(rule, k)}


def test_grouped_rank_window_beyond_the_vocabulary_changes_nothing():
    """Ranks further apart than V have no partner, so windows past V - 1 are skipped (a demo
    request of rank_window=4096 used to loop 8192 times over the vocabulary)."""
    global rule_model
    p, q, rule_model = random_case(4)
    x = torch.tensor([[int(q.argmax())]])
    full, huge = (GroupedAcceptance(rank_window=w, prob_threshold=0.5, distance_threshold=2.0).bind(rule_model)
                  for w in (V - 1, 100 * V))
    assert len(huge._offsets(V)) == 2 * (V - 1)
    assert torch.equal(full.relaxed_target(p[None, None], q[None, None]), huge.relaxed_target(p[None, None], q[None, None]))
    literal = lambda r: type(r)(**{**_params(r), "bounded": False}).bind(rule_model).probabilities(p[None, None], q[None, None], x)
    assert all(torch.equal(a, b) for a, b in zip(literal(full), literal(huge)))


def test_lam_one_and_delta_zero_are_lossless():
    global rule_model
    p, q, rule_model = random_case(3)
    for rule in (RelaxedAcceptance(lam=1.0), RelaxedAcceptance(delta=0.0), GroupedAcceptance(rank_window=0)):
        assert tv(output_distribution(rule.bind(rule_model), p, q), p) < 1e-6


def test_unbound_rule_and_missing_tables_are_clear_errors():
    p = torch.full((1, 1, V), 1 / V)
    with pytest.raises(ValueError, match="not bound"):
        RelaxedAcceptance().probabilities(p, p, torch.zeros(1, 1, dtype=torch.long))

    class NoTables:
        vocab_size = V

    with pytest.raises(ValueError, match="codebook"):
        RelaxedAcceptance().bind(NoTables())
    with pytest.raises(ValueError, match="token_embeddings"):
        GroupedAcceptance().bind(NoTables())


@pytest.mark.parametrize("bad", [dict(delta=-0.1), dict(delta=1.5), dict(lam=0.5), dict(k=0), dict(k=2.5)])
def test_bad_relaxed_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        RelaxedAcceptance(**bad)


@pytest.mark.parametrize("bad", [dict(rank_window=-1), dict(prob_threshold=-1.0), dict(distance_threshold=float("nan"))])
def test_bad_grouped_parameters_are_rejected(bad):
    with pytest.raises(ValueError):
        GroupedAcceptance(**bad)


def test_make_decoder_routes_options_and_rejects_unknown_ones():
    d = make_decoder("lantern", delta=0.25, window=8, bounded=False)
    assert d.window == 8 and d.acceptance.delta == 0.25 and not d.acceptance.bounded
    assert make_decoder("lantern++").acceptance.lam == 2.0
    with pytest.raises(ValueError, match="valid options"):
        make_decoder("sjd", delat=0.1)
    with pytest.raises(ValueError, match="unknown decoding"):
        make_decoder("medusa")
    with pytest.raises(ValueError, match="window"):
        make_decoder("sjd", window=0)


def test_neighbour_tables_are_reused_and_rebuilt_after_an_update():
    _, _, model = random_case(0)
    first = RelaxedAcceptance(k=3).bind(model).neighbours
    assert RelaxedAcceptance(k=3).bind(model).neighbours is first  # same table, computed once
    with torch.no_grad():
        model.codebook_table[0] = model.codebook_table[1] + 1e-3  # token 0 now sits next to token 1
    rebuilt = RelaxedAcceptance(k=3).bind(model).neighbours
    assert rebuilt is not first and int(rebuilt[0, 0]) == 1


def test_decoding_specs_and_option_routing():
    from mmgen.decoding import SpeculativeJacobi, parse_decoding, resolve_decoder

    rule = make_decoder("lantern", acceptance=GroupedAcceptance(rank_window=3), prob_threshold=0.2).acceptance
    assert isinstance(rule, GroupedAcceptance) and rule.rank_window == 3 and rule.prob_threshold == 0.2
    assert make_decoder("sjd", acceptance=RelaxedAcceptance(), delta=0.2).acceptance.delta == 0.2
    assert parse_decoding("SJD-8") == ("sjd", {"window": 8})
    assert parse_decoding("lantern:delta=.2, bounded=False") == ("lantern", {"delta": 0.2, "bounded": False})
    assert resolve_decoder("lantern++:lam=3").acceptance.lam == 3.0
    assert isinstance(resolve_decoder("sjd-4"), SpeculativeJacobi) and resolve_decoder("sjd-4").window == 4
    with pytest.raises(ValueError, match="given twice"):
        parse_decoding("sjd-8:window=4")
    with pytest.raises(ValueError, match="AcceptanceRule object"):
        make_decoder("sjd", acceptance="gsd")
    with pytest.raises(ValueError, match="delta must be a number"):
        make_decoder("lantern", delta="a lot")
    with pytest.raises(ValueError, match="unknown decoding"):
        make_decoder(SpeculativeJacobi())


@pytest.mark.parametrize("vocab, k, lam", [(512, 32, None), (4096, 300, None), (4096, 300, 2.0)])
def test_relaxed_target_over_the_support_is_bit_identical_to_the_dense_pass(vocab, k, lam):
    """Under top-k sampling only tokens in supp(p) ∩ supp(q) contribute, so the sparse pass
    drops exact zeros only: the same bits as the [V, k] pass (the fixtures rely on it)."""
    g = torch.Generator().manual_seed(vocab + k)
    neighbours = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(vocab)])
    rule = RelaxedAcceptance(k=k, lam=lam, neighbours=neighbours)

    def probs(top_k: int) -> torch.Tensor:
        logits = torch.randn(6, vocab, generator=g) * 3
        kth = logits.topk(top_k, -1).values[:, -1:]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    p, q = probs(vocab // 8), probs(vocab // 4)  # different supports, as Jacobi carry-over gives
    q[0] = p[0]  # a row whose q is its p
    support = (p > 0) & (q > 0)
    assert not support.all() and support.any(1).all()
    sparse = rule._relaxed_target_on(support, p, q, neighbours)
    assert torch.equal(sparse, rule._relaxed_target_dense(p, q, neighbours))
    assert torch.equal(rule.relaxed_target(p.view(2, 3, vocab), q.view(2, 3, vocab)), sparse.view(2, 3, vocab))


@pytest.mark.parametrize("vocab, top_k", [(512, 64), (4096, 300), (4096, 0)])
def test_grouped_target_over_the_support_ranks_is_bit_identical_to_all_ranks(vocab, top_k):
    """Ranks past every row's support hold p = 0: dropping them drops exact zeros only."""
    from mmgen.decoding.acceptance import close_pairs

    g = torch.Generator().manual_seed(vocab + top_k)
    embeddings = torch.randn(vocab, 4, generator=g)
    rule = GroupedAcceptance(distance_threshold=2.0, prob_threshold=0.5, close=close_pairs(embeddings, 2.0))
    assert len(rule.close.codes) > 4 * vocab  # groups are not trivial

    def probs(k: int) -> torch.Tensor:
        logits = torch.randn(6, vocab, generator=g)
        if k:
            logits = logits.masked_fill(logits < logits.topk(k, -1).values[:, -1:], float("-inf"))
        return logits.softmax(-1)

    p, q = probs(top_k), probs(2 * top_k)
    q[0] = p[0]
    restricted = rule.relaxed_target(p, q)
    assert torch.equal(restricted, rule._relaxed_target_ranks(p, q, restrict=False))
    assert (restricted != p).any()  # the groups moved mass


@pytest.mark.parametrize("vocab, k, lam, top_k", [(512, 32, None, 64), (4096, 300, None, 500), (4096, 300, 2.0, 500),
                                                  (512, 511, None, 0), (512, 100, 3.0, 0), (512, 128, None, 0)])
def test_relaxed_draws_equal_the_whole_target_where_the_loop_reads_them(vocab, k, lam, top_k):
    """`__call__` builds pi only at the drafts up to each row's first rejection and there: the
    same accept decisions up to it and, at it, the same residual bits as `probabilities`."""
    g = torch.Generator().manual_seed(vocab + k)
    neighbours = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(vocab)])
    rule = RelaxedAcceptance(k=k, lam=lam, neighbours=neighbours)

    def probs(kk: int) -> torch.Tensor:
        logits = torch.randn(4, 6, vocab, generator=g) * 2
        if kk:
            logits = logits.masked_fill(logits < logits.topk(kk, -1).values[..., -1:], float("-inf"))
        return logits.softmax(-1)

    p, q = probs(top_k), probs(2 * top_k)
    q[0] = p[0]  # drafts from the target itself: everything accepted in row 0
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(4, 6)
    accept, residual = rule.probabilities(p, q, drafts)
    pi_x = rule.relaxed_target(p, q).gather(-1, drafts[..., None]).reshape(-1)
    assert torch.equal(rule._target_at(p.reshape(-1, vocab), q.reshape(-1, vocab), drafts.reshape(-1)), pi_x)
    accepted, lazy = rule(p, q, drafts, torch.Generator().manual_seed(5))
    assert_same_prefix_decisions(accepted, torch.rand(drafts.shape, generator=torch.Generator().manual_seed(5)) < accept)
    assert accepted[0].all() and (~accepted).any()
    for b in range(4):
        if not accepted[b].all():
            j = int((~accepted[b]).long().argmax())
            assert torch.equal(lazy[b, j], residual[b, j])


def assert_same_prefix_decisions(lazy: torch.Tensor, whole: torch.Tensor) -> None:
    """A rule that stops at each row's first rejection: the same decisions up to and at it
    (what the loop reads), and none after it."""
    for row_lazy, row_whole in zip(lazy, whole):
        n = int(row_whole.long().cumprod(-1).sum())  # accepted prefix
        assert torch.equal(row_lazy[: n + 1], row_whole[: n + 1]) and not row_lazy[n + 1 :].any()


@pytest.mark.parametrize("bounded", [True, False])
def test_grouped_draws_stop_at_each_rows_first_rejection_with_the_whole_passs_bits(bounded):
    """GSD's `__call__` scores positions left to right and stops at each row's first rejection:
    the decisions up to it and the residual at it are those of `probabilities` (the literal
    rule scores every position at once, as before)."""
    from mmgen.decoding.acceptance import close_pairs

    g = torch.Generator().manual_seed(11)
    vocab = 1024
    rule = GroupedAcceptance(distance_threshold=2.0, prob_threshold=0.5, bounded=bounded,
                             close=close_pairs(torch.randn(vocab, 4, generator=g), 2.0))
    logits = torch.randn(4, 6, vocab, generator=g)
    p = logits.masked_fill(logits < logits.topk(100, -1).values[..., -1:], float("-inf")).softmax(-1)
    q = (logits + torch.randn(4, 6, vocab, generator=g)).softmax(-1)
    q[0] = p[0]
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(4, 6)
    accept, residual = rule.probabilities(p, q, drafts)
    accepted, drawn = rule(p, q, drafts, torch.Generator().manual_seed(5))
    whole = torch.rand(drafts.shape, generator=torch.Generator().manual_seed(5)) < accept
    if bounded:
        assert_same_prefix_decisions(accepted, whole)
    else:
        assert torch.equal(accepted, whole)
    assert accepted[0].all() and (~accepted).any()
    for b in range(4):
        if not accepted[b].all():
            j = int((~accepted[b]).long().argmax())
            assert torch.equal(drawn[b, j], residual[b, j])
