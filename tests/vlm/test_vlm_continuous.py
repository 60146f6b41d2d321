"""Continuous batching of VLM requests: each request's answer is what it decodes alone.

Requests differ in prompt length and images (none, one); a row that finishes takes the next
request, whose prompt is prefilled alone and placed in the row (`VLMTokenModel.restart`,
`SlotKVCache.restart_row`), growing the batch's prompt region when it is the longest yet.
"""

import pytest
import torch

from mmgen.batch_invariant import rowwise
from mmgen.cache import SlotKVCache
from mmgen.decoding import make_decoder
from mmgen.decoding.batching import Request, continuous_decode, row_decoder
from mmgen.decoding.stopping import Stopping
from mmgen.sampling import SamplingConfig, make_generator

from tests.streams import drain, in_threads
from tests.vlm.test_vlm_pipeline import BUILDERS, PROMPTS, images

# Short prompts first, so later requests grow the prompt region.
QUESTIONS = [(PROMPTS[0], None), (PROMPTS[2], 0), (PROMPTS[1], None), (PROMPTS[0], 1), (PROMPTS[1], 2), (PROMPTS[2], None)]


def requests_for(pipe, seed: int, budgets=None):
    pictures = images(3)
    inputs = [pipe.prepare_inputs(q, None if i is None else pictures[i]) for q, i in QUESTIONS]
    budgets = budgets or [None] * len(inputs)
    return [Request(x, make_generator(seed + k), budget) for k, (x, budget) in enumerate(zip(inputs, budgets))]


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("name,temperature", [("ar", 0.0), ("ar", 1.0), ("sjd", 1.0), ("sjd", 0.0), ("heads", 1.0), ("heads", 0.0)],
                         ids=["ar-greedy", "ar-sampled", "sjd-sampled", "sjd-greedy", "heads-sampled", "heads-greedy"])
def test_each_request_answers_what_it_answers_alone(family, name, temperature, monkeypatch):
    pipe = BUILDERS[family]()
    placed = []  # (prompt region growth, the request's prompt slots, the region after) per restart
    restart_row = SlotKVCache.restart_row

    def spy(cache, row, fresh):
        grow = restart_row(cache, row, fresh)
        placed.append((grow, fresh.prompt_length, cache.prompt_length))
        return grow

    monkeypatch.setattr(SlotKVCache, "restart_row", spy)
    if name == "heads":  # a restarted row's heads start from its own prefill's hidden state
        from tests.core.test_heads import heads_for

        decoder = make_decoder(name, heads=heads_for(pipe.token_model().hidden_size, seed=3))
    else:
        decoder = make_decoder(name) if name == "ar" else make_decoder(name, window=4, adapt=False)
    sampling = SamplingConfig(temperature=temperature)
    stopping = Stopping(stop_tokens=pipe.eos_token_ids, max_new_tokens=12, pad_token=pipe.pad_token_id)
    budgets = [None, 5, None, None, 3, None]
    requests = requests_for(pipe, 10, budgets)
    done, stats = continuous_decode(decoder, pipe.token_model(), requests, 12, sampling, batch_size=2, stopping=stopping)
    assert [f.index for f in done] == list(range(len(requests))) and stats.rows == len(requests)
    for k, request in enumerate(requests_for(pipe, 10, budgets)):
        alone = Stopping(stop_tokens=pipe.eos_token_ids, max_new_tokens=budgets[k] or 12, pad_token=pipe.pad_token_id)
        solo = decoder.generate(pipe.token_model(), request.conditions, 12, sampling, request.generator, stopping=alone)
        n = int(solo.lengths[0])
        assert done[k].tokens.tolist() == solo.tokens[0, :n].tolist(), f"request {k}"
        assert done[k].stats.forwards == solo.stats.forwards
    assert any(len(f.tokens) > 1 for f in done)
    # Some requests grew the prompt region, others sat in a region longer than their prompt.
    assert any(grow > 0 for grow, _, _ in placed) and any(slots < region for _, slots, region in placed)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["grows-the-region", "sits-in-a-longer-region"])
def test_a_restarted_row_decodes_at_its_solo_positions_with_its_solo_logits(family, order):
    """`VLMTokenModel.restart` places a request in a live row (whose other row has decoded two
    tokens): its first logits and its next forward's positions (3-D under M-RoPE) are those of
    its prompt decoded alone, bit for bit, and so are its next logits wherever rounding is the
    same, whether its prompt grows the batch's prompt region or sits in a longer one."""
    pipe = BUILDERS[family]()
    short, long = pipe.prepare_inputs(PROMPTS[0], None), pipe.prepare_inputs(PROMPTS[2], images(1)[0])
    first, later = [(short, long)[i] for i in order]
    model, positions = pipe.token_model(), []
    model.trunk.register_forward_pre_hook(lambda module, args, kwargs: positions.append(kwargs["position_ids"]), with_kwargs=True)
    row = lambda p, b: p[..., b, :]  # [B, n], or [3, B, n] under M-RoPE

    def restarted_row():
        """The first logits of `later` restarted in row 1 of a live batch, and its next logits."""
        live = model.start(first, 0, False)
        model.select_rows(live, torch.tensor([0, 0]))
        for token in (3, 4):
            model.forward(live, torch.tensor([[token], [token]]))
            model.commit(live, torch.tensor([1, 1]))
        restarted = model.restart(live, 1, later)
        return restarted.cond, model.forward(live, torch.tensor([[5], [6]])).cond[1]

    restarted, logits = restarted_row()
    batch_positions = positions[-1]
    solo = model.start(later, 0, False)
    alone = model.forward(solo, torch.tensor([[6]])).cond
    assert torch.equal(restarted, solo.first_logits.cond)
    assert torch.equal(row(batch_positions, 1), row(positions[-1], 0)), (batch_positions, positions[-1])
    # Its next logits: the batch forward attends over the padded prompt region (the VLM forward's
    # attention is not batch-invariant) and its matmuls run at batch 2 (CPU kernels round
    # differently at batch 1), so they differ from the solo forward's in the last bit or two
    # (at most 4.5e-8 here, logits below 0.32); one position off moves them 1e-4.
    torch.testing.assert_close(logits, alone[0], rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(alone.abs().max()))
    # Bit for bit where the rounding is the same: batch-invariant attention, and the solo prompt
    # in a batch of two.
    with rowwise(model.model):
        _, logits = restarted_row()
        pair = model.start(later, 0, False)
        model.select_rows(pair, torch.tensor([0, 0]))
        assert torch.equal(logits, model.forward(pair, torch.tensor([[5], [6]])).cond[1])


def test_dropping_is_refused_at_the_first_row():
    pipe = BUILDERS["llava"]()
    requests = requests_for(pipe, 0)
    with pytest.raises(ValueError, match="does not run visual token dropping"):
        continuous_decode(make_decoder("ar"), pipe.token_model(dropping="fastv:layer=1,keep_ratio=0.5"), requests, 4,
                          SamplingConfig(), batch_size=2)


@pytest.mark.parametrize("decoding", ["sjd:adapt=false,window=4", "sjd:window=4"], ids=["fixed-window", "adaptive-window"])
def test_the_pipeline_answers_each_prompt_as_alone_and_hands_answers_over_as_they_end(decoding):
    pipe = BUILDERS["llava"]()
    pictures = images(3)
    prompts = [q for q, _ in QUESTIONS]
    per_prompt = [[] if i is None else [pictures[i]] for _, i in QUESTIONS]
    seen = []
    out = pipe.answer_each(prompts, per_prompt, [make_generator(20 + k) for k in range(len(prompts))], batch_size=2,
                           on_answer=lambda i, text, ids, stats: seen.append((i, text, ids.tolist(), stats.forwards)),
                           max_new_tokens=10, decoding=decoding, temperature=1.0)
    assert sorted(i for i, *_ in seen) == list(range(len(prompts)))
    for k, (prompt, pics) in enumerate(zip(prompts, per_prompt)):
        alone = pipe(prompt, pics or None, max_new_tokens=10, decoding=row_decoder(decoding, 2), temperature=1.0,
                     generator=make_generator(20 + k))
        n = int(alone.lengths[0])
        assert out.texts[k] == alone.texts[0] and int(out.lengths[k]) == n
        assert torch.equal(out.token_ids[k], alone.token_ids[0])  # padded alike after the answer
        i, text, ids, forwards = next(s for s in seen if s[0] == k)
        assert text == alone.texts[0] and ids == alone.token_ids[0, :n].tolist() and forwards == alone.stats.forwards
    assert out.stats.rows == len(prompts)


@pytest.mark.parametrize("options,message", [
    (dict(decoding="lookup"), "cannot restart rows"),
    (dict(generators=[make_generator(0)]), "1 generators for 2 prompts"),
    (dict(max_new_tokens=0), r"max_new_tokens must be an integer in \[1, 1048576\]"),
])
def test_bad_continuous_calls_are_clear_errors(options, message):
    pipe = BUILDERS["llava"]()
    args = dict(generators=[make_generator(0), make_generator(1)], **{k: v for k, v in options.items() if k != "generators"})
    args["generators"] = options.get("generators", args["generators"])
    with pytest.raises(ValueError, match=message):
        pipe.answer_each([PROMPTS[0], PROMPTS[1]], None, **args)


def test_a_served_batch_answers_each_request_as_alone_and_streams_it():
    """`VLMPipeline.serve`: prompts submitted from threads share one continuous batch; each
    answer (sampled, its own budget) is the one its prompt gives alone with its generator, and
    its streamed pieces concatenate to it."""
    from mmgen.decoding import TokenQueueStreamer
    from mmgen.vlm.pipeline import text_pieces

    pipe = BUILDERS["llava"]()
    pictures = images(3)
    server = pipe.serve("sjd:adapt=false,window=4", batch_size=2, max_new_tokens=10, temperature=1.0)
    budgets = [10, 4, 7, 10, 3, 9]  # 3: below the window (see the last check)
    futures, queues = [], []
    for k, (question, i) in enumerate(QUESTIONS):
        queue = TokenQueueStreamer(timeout=120)
        queues.append(queue)
        futures.append(server.submit(question, None if i is None else pictures[i], make_generator(30 + k), budgets[k], queue))
    streamed = {}

    def read(k):
        streamed[k] = "".join(piece for _, piece in text_pieces(pipe.processor.tokenizer, queues[k]))

    in_threads(read, range(len(QUESTIONS)))
    for k, (question, i) in enumerate(QUESTIONS):
        text, tokens, stats = futures[k].result(timeout=120)
        assert streamed[k] == text
        if budgets[k] < 4:
            continue
        alone = pipe(question, None if i is None else pictures[i], max_new_tokens=budgets[k], decoding="sjd:adapt=false,window=4",
                     temperature=1.0, generator=make_generator(30 + k))
        n = int(alone.lengths[0])
        assert text == alone.texts[0] and tokens.tolist() == alone.token_ids[0, :n].tolist() and stats.forwards == alone.stats.forwards
    # A budget below the window: a call would narrow its window to the budget, so the request
    # decodes as its prompt alone at the server's cap, stopped at its budget.
    decoder, request = make_decoder("sjd", window=4, adapt=False), requests_for(pipe, 30)[4]
    stopping = Stopping(stop_tokens=pipe.eos_token_ids, max_new_tokens=3, pad_token=pipe.pad_token_id)
    solo = decoder.generate(pipe.token_model(), request.conditions, 10, SamplingConfig(temperature=1.0), request.generator,
                            stopping=stopping)
    assert futures[4].result()[1].tolist() == solo.tokens[0, : int(solo.lengths[0])].tolist()
    chunks, (text, _, _) = drain(server.stream(PROMPTS[1], None, make_generator(3), 5))
    assert "".join(chunks) == text == pipe(PROMPTS[1], max_new_tokens=5, decoding="sjd:adapt=false,window=4", temperature=1.0,
                                            generator=make_generator(3)).texts[0]


def test_a_served_batch_refuses_bad_requests_and_a_failed_decode_ends_the_stream(monkeypatch):
    from mmgen.vlm.token_model import VLMTokenModel

    pipe = BUILDERS["llava"]()
    with pytest.raises(ValueError, match="cannot restart rows"):
        pipe.serve("lookup", batch_size=2)
    server = pipe.serve("ar", batch_size=2, max_new_tokens=6)
    with pytest.raises(ValueError, match="exceeds the server's cap of 6"):
        server.submit(PROMPTS[0], max_new_tokens=7)
    with pytest.raises(ValueError, match="submit takes one prompt"):
        server.submit([PROMPTS[0], PROMPTS[1]])

    def broken(self, conditions, capacity, guidance):  # every prefill: the batch's and each row's
        raise RuntimeError("the prefill broke")

    monkeypatch.setattr(VLMTokenModel, "start", broken)
    with pytest.raises(RuntimeError, match="the prefill broke"):  # not a wait for the stream's timeout
        for _ in server.stream(PROMPTS[0], generator=make_generator(0)):
            pass


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
@pytest.mark.parametrize("name,temperature", [("ar", 1.0), ("sjd", 1.0)], ids=["ar-sampled", "sjd-sampled"])
def test_a_live_batch_grows_and_narrows_and_each_request_answers_as_alone(family, name, temperature, monkeypatch):
    """A server's queue whose requests arrive mid-decode: the batch's width follows them
    (`FeedRows.fit`: grows for waiting requests, narrows to the running ones), and each row
    keeps its cache, positions (M-RoPE offsets included) and draws: answers equal alone."""
    from tests.streams import arrivals, recorded_widths

    widths, seen = recorded_widths(monkeypatch), {}
    pipe = BUILDERS[family]()
    requests = requests_for(pipe, 50, budgets=[12, 3, 10, 12, 5, 8])
    queue = arrivals({2: requests[1:3], 4: requests[3:]}, seen)
    queue.arrive(requests[0])
    if name == "heads":  # a restarted row's heads start from its own prefill's hidden state
        from tests.core.test_heads import heads_for

        decoder = make_decoder(name, heads=heads_for(pipe.token_model().hidden_size, seed=3))
    else:
        decoder = make_decoder(name) if name == "ar" else make_decoder(name, window=4, adapt=False)
    sampling = SamplingConfig(temperature=temperature)
    stopping = Stopping(stop_tokens=pipe.eos_token_ids, max_new_tokens=12, pad_token=pipe.pad_token_id)
    continuous_decode(decoder, pipe.token_model(), queue, 12, sampling, batch_size=3, stopping=stopping)
    assert sorted(seen) == list(range(len(requests)))
    for k, request in enumerate(requests_for(pipe, 50, budgets=[12, 3, 10, 12, 5, 8])):
        budget = Stopping(stop_tokens=pipe.eos_token_ids, max_new_tokens=request.max_new_tokens, pad_token=pipe.pad_token_id)
        alone = decoder.generate(pipe.token_model(), request.conditions, 12, sampling, request.generator, stopping=budget)
        n = int(alone.lengths[0])
        assert seen[k].tokens.tolist() == alone.tokens[0, :n].tolist(), f"request {k}"
    steps = list(zip([1] + widths, widths))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps), widths
