"""Continuous batching of speech requests (Dia, and CSM at the end): each text's frames and
audio are what it decodes alone with its generator.

Texts differ in length (a longer text grows the batch's encoder axis mid-run) and in voice
prompts (a longer prompt grows the decoder cache's prompt region); a row whose speech ends takes
the next text, prefilled alone and placed in the row (`DiaTokenModel.restart`): its decoder
cache, positions, encoder states, cross-attention keys, template and frame budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmgen.audio.dia import DiaTokenModel
from mmgen.decoding import make_decoder
from mmgen.decoding.batching import Request, continuous_decode, row_decoder
from mmgen.sampling import SamplingConfig

from tests.audio.tiny import RATE, tiny_csm, tiny_dia
from tests.streams import drain

# Short texts first, so later ones grow the encoder axis; a voice prompt mid-run grows the
# decoder's prompt region.
TEXTS = ["[S1] Hi.", "[S1] Something else entirely, and longer.", "[S1] Three.",
         "[S1] A fourth one, much longer than all the others before it, really.", "[S1] Five.", "[S1] Six and last."]
VOICE = (0.3 * np.sin(np.arange(800) / 7.0)).astype(np.float32)
VOICES = [None, None, (VOICE, RATE), None, (VOICE[:400], RATE), None]
VOICE_TEXTS = [None, None, "[S1] Me.", None, "[S1] A short voice.", None]


@pytest.fixture(scope="module")
def pipe():
    return tiny_dia(0, eos_boost=2.0)  # rows end on their own, at different frames


def generators(seed: int, n: int = len(TEXTS)) -> list:
    return [torch.Generator().manual_seed(seed + k) for k in range(n)]


@pytest.mark.parametrize("decoding,temperature,guidance_scale", [
    ("ar", 0.0, None), ("ar", 1.0, None), ("ar", 1.0, 3.0), ("sjd:window=4,adapt=false", 0.0, 3.0),
    ("sjd:window=4,adapt=false", 1.0, None), ("sjd:window=4,adapt=false", 1.0, 3.0),
    ("sjd:window=4", 0.0, 3.0), ("sjd:window=4", 1.0, 3.0)])  # the adaptive window: each row its own widths
def test_each_text_speaks_what_it_speaks_alone(pipe, decoding, temperature, guidance_scale):
    options = dict(max_new_frames=30, decoding=decoding, temperature=temperature, top_k=20, guidance_scale=guidance_scale)
    heard = []
    out = pipe.speak_each(TEXTS, VOICES, VOICE_TEXTS, generators(7), batch_size=2,
                          on_audio=lambda i, audio, frames, stats: heard.append((i, audio, frames, stats)), **options)
    lengths = []
    for i, text in enumerate(TEXTS):
        # Under the adaptive window, its rows judge widths as rows of 2 (`row_decoder`).
        alone = pipe(text, VOICES[i], VOICE_TEXTS[i], generator=torch.Generator().manual_seed(7 + i),
                     **dict(options, decoding=row_decoder(decoding, 2)))
        n = int(alone.lengths[0])
        lengths.append(n)
        assert int(out.lengths[i]) == n and torch.equal(out.frames[i, :n], alone.frames[0, :n])
        assert torch.equal(out.codes[i], alone.codes[0]) and torch.equal(out.audio[i], alone.audio[0])
        _, audio, frames, stats = next(h for h in heard if h[0] == i)
        assert torch.equal(audio, alone.audio[0]) and torch.equal(frames, alone.frames[0, :n])
        assert stats.forwards == alone.stats.forwards and stats.accepted_histogram == alone.stats.accepted_histogram
        assert stats.drafts_per_forward == alone.stats.drafts_per_forward
    assert sorted(i for i, *_ in heard) == list(range(len(TEXTS)))
    if decoding == "sjd:window=4":  # the rows chose their own widths, each moving between them
        assert sum(len(set(stats.drafts_per_forward)) > 1 for *_, stats in heard) >= 2
    if temperature:  # rows ended at different frames, so rows were refilled mid-run
        assert len(set(lengths)) > 1


@pytest.mark.parametrize("decoding,temperature", [("ar", 1.0), ("sjd:window=4,adapt=false", 0.0),  # greedy: through sjd
                                                  ("sjd:window=4,adapt=false", 1.0), ("sjd:window=4", 1.0)])
def test_csm_speaks_each_text_as_alone_its_depth_decoder_drawing_from_the_rows_generator(decoding, temperature):
    """CSM completes each frame with its depth decoder (`complete_frame`): a restarted row's
    frame 0 is completed from its own prefill state, drawing from its request's generator only
    (the other rows draw from the idle one), and every later completion draws row by row."""
    csm = tiny_csm(0, eos_boost=3.0)  # rows end on their own, at different frames
    texts = [t.removeprefix("[S1] ") for t in TEXTS]
    g = torch.Generator().manual_seed(0)
    voice = ((0.3 * torch.randn(16 * 6, generator=g)).numpy(), RATE)  # 6 frames of the tiny Mimi
    voices, voice_texts = [None, None, voice, None, None, None], [None, None, "Hi.", None, None, None]
    options = dict(max_new_frames=40, decoding=decoding, temperature=temperature, top_k=20)
    out = csm.speak_each(texts, voices, voice_texts, generators(5), batch_size=2, **options)
    lengths = []
    for i, text in enumerate(texts):
        alone = csm(text, voices[i], voice_texts[i], generator=torch.Generator().manual_seed(5 + i),
                    **dict(options, decoding=row_decoder(decoding, 2)))
        n = int(alone.lengths[0])
        lengths.append(n)
        assert int(out.lengths[i]) == n and torch.equal(out.frames[i, :n], alone.frames[0, :n]), f"text {i}"
        assert torch.equal(out.audio[i], alone.audio[0])
    if not temperature:
        assert len(set(lengths)) > 1  # rows ended at different frames, so rows were refilled mid-run


@pytest.mark.parametrize("cycle", [(1, 1, 3, 3, 0), (3, 3, 3, 1)])
def test_csm_rows_narrower_than_the_forward_draw_their_own_last_slot_as_alone(cycle):
    """Rows at different draft counts in one CSM forward (cycled, whatever is accepted): a row
    verifying fewer drafts than the forward ends on its own last slot, where a forward of its
    width holds the placeholders `complete_frame` fills, not scores of a stale draft; Jacobi
    carries that slot's samples on as drafts, so every later frame depends on it."""
    from tests.core.test_adaptive_window import CyclingWindow

    csm = tiny_csm(0, eos_boost=3.0)
    texts = [t.removeprefix("[S1] ") for t in TEXTS]
    decoder = make_decoder("sjd", window=4, adapt=CyclingWindow(cycle=cycle))
    options = dict(max_new_frames=40, decoding=decoder, temperature=1.0, top_k=20)
    out = csm.speak_each(texts, [None] * len(texts), [None] * len(texts), generators(5), batch_size=2, **options)
    for i, text in enumerate(texts):
        alone = csm(text, generator=torch.Generator().manual_seed(5 + i), **options)
        n = int(alone.lengths[0])
        assert int(out.lengths[i]) == n and torch.equal(out.frames[i, :n], alone.frames[0, :n]), f"text {i}"


def test_restart_grows_the_encoder_axis_and_the_prompt_region(pipe, monkeypatch):
    """The first two requests are short texts without voices; later ones are longer (the encoder
    axis grows for every row) and voiced (the decoder's prompt region grows)."""
    seen = []
    place = DiaTokenModel._place_encoder

    def spy(run, solo, rows, theirs):
        before = run.encoded.shape[1]
        place(run, solo, rows, theirs)
        seen.append((before, solo.encoded.shape[1], run.encoded.shape[1], run.kv.cross_attention_cache.layers[0].keys.shape[2]))

    monkeypatch.setattr(DiaTokenModel, "_place_encoder", staticmethod(spy))
    model = pipe.token_model()
    conditions = [pipe.prepare(t, v, vt, 30)[0] for t, v, vt in zip(TEXTS, VOICES, VOICE_TEXTS)]
    sampling, stopping = SamplingConfig(temperature=1.0, top_k=20), pipe.adapter.stopping(30)
    done, _ = continuous_decode(make_decoder("ar"), model, [Request(c, g) for c, g in zip(conditions, generators(3))], 30, sampling, 2, stopping=stopping)
    assert any(after > before for before, _, after, _ in seen)  # the encoder axis grew
    assert all(after == keys == max(before, solo) for before, solo, after, keys in seen)
    assert [f.index for f in done] == list(range(len(TEXTS)))


def test_requests_must_share_the_batch_guidance(pipe):
    model = pipe.token_model()
    first = pipe.prepare(TEXTS[0], max_new_frames=20, guidance_scale=3.0)[0]
    second = pipe.prepare(TEXTS[1], max_new_frames=20, guidance_scale=2.0)[0]
    with pytest.raises(ValueError, match="one guidance setting"):
        continuous_decode(make_decoder("ar"), model, [Request(first, torch.Generator()), Request(second, torch.Generator())], 20,
                          SamplingConfig(temperature=0), 1, stopping=pipe.adapter.stopping(20))


def test_bad_calls_are_refused_before_any_work(pipe, monkeypatch):
    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(DiaTokenModel, "start", no_forward)
    with pytest.raises(ValueError, match="its own fixed noise"):
        pipe.speak_each(TEXTS[:2], generators=generators(0, 2), decoding="sjd-coupled")
    with pytest.raises(ValueError, match="one generator per text"):
        pipe.speak_each(TEXTS[:2], generators=generators(0, 1))
    with pytest.raises(ValueError, match="a non-empty string or a list of them"):
        pipe.speak_each([], generators=[])
    with pytest.raises(ValueError, match="max_new_frames"):
        pipe.speak_each(TEXTS[:2], generators=generators(0, 2), max_new_frames=0)


def test_a_served_batch_speaks_each_request_as_alone_and_streams_it(pipe):
    """`TTSPipeline.serve`: texts submitted together share one continuous batch; each output
    (sampled, its own frame budget, voiced or not) is the one its text gives alone with its
    generator, and its streamed chunks make up its audio."""
    server = pipe.serve("sjd:window=4,adapt=false", batch_size=2, max_new_frames=30, temperature=1.0, top_k=20)
    budgets = [30, 12, 25, 30, 8, 20]
    futures = [server.submit(t, v, vt, torch.Generator().manual_seed(40 + k), budgets[k])
               for k, (t, v, vt) in enumerate(zip(TEXTS, VOICES, VOICE_TEXTS))]
    for k, (text, voice, voice_text) in enumerate(zip(TEXTS, VOICES, VOICE_TEXTS)):
        audio, frames, stats = futures[k].result(timeout=120)
        alone = pipe(text, voice, voice_text, max_new_frames=budgets[k], decoding="sjd:window=4,adapt=false", temperature=1.0,
                     top_k=20, generator=torch.Generator().manual_seed(40 + k))
        n = int(alone.lengths[0])
        assert torch.equal(frames, alone.frames[0, :n]) and torch.equal(audio, alone.audio[0])
        assert stats.forwards == alone.stats.forwards
    chunks, (audio, _, _) = drain(server.stream(TEXTS[3], generator=torch.Generator().manual_seed(3)))
    assert len(chunks) > 1 and torch.allclose(torch.cat(chunks), audio, atol=1e-6, rtol=0)


def test_a_served_batch_refuses_bad_requests_and_a_failed_decode_ends_the_stream(pipe, monkeypatch):
    with pytest.raises(ValueError, match="its own fixed noise"):
        pipe.serve("sjd-coupled", batch_size=2)
    server = pipe.serve("ar", batch_size=2, max_new_frames=20)
    with pytest.raises(ValueError, match=r"max_new_frames must be an integer in \[1, 20\]"):
        server.submit(TEXTS[0], max_new_frames=21)
    with pytest.raises(ValueError, match="submit takes one text"):
        server.submit(TEXTS[:2])

    def broken(self, conditions, capacity, guidance):  # every prefill: the batch's and each row's
        raise RuntimeError("the prefill broke")

    monkeypatch.setattr(DiaTokenModel, "start", broken)
    with pytest.raises(RuntimeError, match="the prefill broke"):  # not a wait for the stream's timeout
        for _ in server.stream(TEXTS[0], generator=torch.Generator()):
            pass


def test_requests_that_start_together_are_prefilled_together_and_speak_as_alone(pipe, monkeypatch):
    """Rows started in one pass share a prefill where their templates and budgets match
    (`DiaTokenModel.restart_rows`: texts right padded, row-wise attention), a voiced one alone;
    each still speaks what it speaks alone."""
    sizes = []
    start = DiaTokenModel.start
    monkeypatch.setattr(DiaTokenModel, "start", lambda self, c, *a: (sizes.append(c.input_ids.shape[0]), start(self, c, *a))[1])
    options = dict(max_new_frames=30, decoding="ar", temperature=1.0, top_k=20, guidance_scale=3.0)
    out = pipe.speak_each(TEXTS[:4], VOICES[:4], VOICE_TEXTS[:4], generators(11, 4), batch_size=4, **options)
    assert 3 in sizes  # texts 0, 1 and 3 (no voice) in one prefill; text 2's voice prompt alone
    for i in range(4):
        alone = pipe(TEXTS[i], VOICES[i], VOICE_TEXTS[i], generator=torch.Generator().manual_seed(11 + i), **options)
        n = int(alone.lengths[0])
        assert int(out.lengths[i]) == n and torch.equal(out.frames[i, :n], alone.frames[0, :n])


def test_a_batch_of_one_is_prefilled_once(pipe, monkeypatch):
    """A shared batch that starts with one request starts on that request's own conditions: its
    row needs no second prefill (a lone request in a server costs what it costs alone)."""
    calls = []
    start = DiaTokenModel.start
    monkeypatch.setattr(DiaTokenModel, "start", lambda self, c, *a: (calls.append(c), start(self, c, *a))[1])
    server = pipe.serve("ar", batch_size=4, max_new_frames=20)
    _, frames, _ = server.submit(TEXTS[0], generator=torch.Generator().manual_seed(5)).result(timeout=60)
    assert len(calls) == 1
    alone = pipe(TEXTS[0], max_new_frames=20, decoding="ar", generator=torch.Generator().manual_seed(5))
    assert torch.equal(frames, alone.frames[0, : int(alone.lengths[0])])
