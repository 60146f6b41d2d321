"""A served speech batch under the bundled model's own sampler (temperature 1, top-k 32, Dia's
guidance 3): each request equals its decode alone for its seed, whatever its neighbour's text
length, frame budget or arrival time (the load benchmark's mismatch scenario, on a tiny Dia)."""

from __future__ import annotations

import pytest
import torch

from mmgen.decoding.stopping import TokenQueueStreamer
from tests.audio.tiny import tiny_dia

TEXTS = ["[S1] Hi.", "[S1] Something else entirely, and longer.", "[S1] Three, a middle one."]
SAMPLER = dict(temperature=1.0, top_k=32, top_p=1.0, guidance_scale=3.0)


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_dia(0, eos_boost=2.0)  # rows end on their own, at different frames
    # Dia's guidance keeps the top-k codes of the guided logits: k = 8 of 64 codes (the bundled
    # model keeps 32 of 256), so the unconditional row changes which codes can be drawn.
    pipe.model.generation_config.top_k = 8
    return pipe


@pytest.mark.parametrize("first,second,join", [((0, 40), (1, 24), 0), ((1, 24), (2, 40), 6), ((2, 12), (0, 40), 3)])
def test_a_guided_sampled_request_decodes_as_alone_beside_any_neighbour(pipe, first, second, join):
    server = pipe.serve("ar", batch_size=4, max_new_frames=40, **SAMPLER)
    (a, budget_a), (b, budget_b) = first, second
    frames = TokenQueueStreamer(timeout=60)
    futures = {a: server.submit(TEXTS[a], generator=torch.Generator().manual_seed(100 + a), max_new_frames=budget_a,
                                streamer=frames)}
    seen = 0
    for _, new in frames:  # the second request arrives once the first has `join` frames out
        seen += len(new)
        if b not in futures and seen >= join:
            futures[b] = server.submit(TEXTS[b], generator=torch.Generator().manual_seed(100 + b), max_new_frames=budget_b)
    futures.setdefault(b, server.submit(TEXTS[b], generator=torch.Generator().manual_seed(100 + b), max_new_frames=budget_b))
    for k, budget in ((a, budget_a), (b, budget_b)):
        alone = pipe(TEXTS[k], max_new_frames=budget, generator=torch.Generator().manual_seed(100 + k), **SAMPLER)
        audio, served, _ = futures[k].result(timeout=120)
        n = int(alone.lengths[0])
        assert len(served) == n and torch.equal(served, alone.frames[0, :n])
        assert torch.equal(audio, alone.audio[0])


def test_the_bundled_model_samples_as_alone_beside_a_longer_text():
    """A sampled request beside a neighbour with a longer text: the batch pads its text, and
    with batched attention the longer encoder axis rounded differently (a draw near a boundary
    flipped); each row now attends over its own text only."""
    from mmgen.audio.heldout import held_out_texts
    from mmgen.loading import load_pipeline

    texts = held_out_texts(5)  # 2: "file folder", 4: "sixty one" (the shorter text)
    bundled = load_pipeline("speech-tts")
    alone = bundled(texts[4], max_new_frames=48, decoding="ar", generator=torch.Generator().manual_seed(1004))
    server = bundled.serve("ar", batch_size=2, max_new_frames=48)
    futures = [server.submit(texts[k], generator=torch.Generator().manual_seed(1000 + k), max_new_frames=48) for k in (2, 4)]
    _, frames, _ = futures[1].result(timeout=300)
    futures[0].result(timeout=300)
    n = int(alone.lengths[0])
    assert len(frames) == n and torch.equal(frames, alone.frames[0, :n])


def test_the_bundled_model_samples_as_alone_when_it_joins_a_live_batch():
    """A request that joins a batch already decoding has its cache at the batch's slots, after
    the holes other rows left (SlotKVCache): with batched attention it reduced over a longer key
    axis than alone and a draw flipped (from frame 6 on here). Row-wise attention attends over
    its own keys only (`mmgen.batch_invariant`)."""
    from mmgen.audio.heldout import held_out_texts
    from mmgen.loading import load_pipeline

    texts = held_out_texts(6)  # 1: "the black clock is near the key", 5: "the black shoe is beside the duck"
    bundled = load_pipeline("speech-tts")
    server = bundled.serve("ar", batch_size=4, max_new_frames=96)
    frames = TokenQueueStreamer(timeout=120)
    first = server.submit(texts[1], generator=torch.Generator().manual_seed(101), max_new_frames=96, streamer=frames)
    seen, joined = 0, None
    for _, new in frames:  # the second request arrives once the first has 20 frames out
        seen += len(new)
        if joined is None and seen >= 20:
            joined = server.submit(texts[5], generator=torch.Generator().manual_seed(105), max_new_frames=96)
    first.result(timeout=300)
    _, served, _ = joined.result(timeout=300)
    alone = bundled(texts[5], max_new_frames=96, decoding="ar", generator=torch.Generator().manual_seed(105))
    n = int(alone.lengths[0])
    assert len(served) == n and torch.equal(served, alone.frames[0, :n])


@pytest.mark.parametrize("decoding", ["ar", "sjd:window=3,adapt=false"])
def test_the_batch_width_follows_its_requests_and_each_decodes_as_alone(pipe, decoding, monkeypatch):
    """A served batch starts as wide as its waiting requests, grows when more arrive than it has
    rows, and narrows once at most half its rows run (`FeedRows.fit`); the rows that stay keep
    their caches, encoder states, budgets and draws, so every request still equals its decode
    alone."""
    from tests.streams import recorded_widths

    widths = recorded_widths(monkeypatch)
    server = pipe.serve(decoding, batch_size=4, max_new_frames=40, **SAMPLER)
    budgets = {0: 40, 1: 12, 2: 40, 3: 30}
    submit = lambda k, **kw: server.submit(TEXTS[k % 3], generator=torch.Generator().manual_seed(200 + k),
                                           max_new_frames=budgets[k], **kw)
    frames = TokenQueueStreamer(timeout=60)
    futures, seen = {0: submit(0, streamer=frames)}, 0
    for _, new in frames:  # two more join after 4 frames (the batch grows), the last after 20
        seen += len(new)
        if seen >= 4 and 1 not in futures:
            futures[1], futures[2] = submit(1), submit(2)
        if seen >= 20 and 3 not in futures:
            futures[3] = submit(3)
    for k in range(4):
        futures.setdefault(k, submit(k))
    for k, future in futures.items():
        alone = pipe(TEXTS[k % 3], max_new_frames=budgets[k], decoding=decoding,
                     generator=torch.Generator().manual_seed(200 + k), **SAMPLER)
        audio, served, stats = future.result(timeout=120)
        n = int(alone.lengths[0])
        assert len(served) == n and torch.equal(served, alone.frames[0, :n]) and torch.equal(audio, alone.audio[0])
        assert stats.forwards == alone.stats.forwards
    grew, narrowed = any(b > a for a, b in zip([1] + widths, widths)), any(b < a for a, b in zip([1] + widths, widths))
    assert grew and narrowed, widths
