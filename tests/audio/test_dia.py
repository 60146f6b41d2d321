"""Dia through `TTSPipeline` on tiny random models: `generate` parity, lossless frame decoders,
exact sampling, streaming audio, voice prompts, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmgen.audio.dia import DiaTokenModel
from mmgen.decoding import DraftSpeculative, Stopping, make_decoder, parse_decoding
from mmgen.sampling import SamplingConfig

from tests.audio.tiny import (
    DELAY, RATE, V, dia_audio_kwargs, dia_processor, jacobi_forwards, perturbed, rounding, text_only, tiny_dia,
)
from tests.speculation import assert_drafted, pinned_decoder, rule

TEXTS = ["[S1] Hello there.", "[S1] Something else entirely, and longer.", "[S1] Three."]
EOS, PAD, BOS = V, V + 1, V + 2


@pytest.fixture(scope="module")
def pipe():
    return tiny_dia(0, eos_boost=2.0)  # rows end on their own, at different frames


def transformers_frames(pipe, texts, frames, guidance_scale=None, audio=None):
    proc = dia_processor(pipe)
    inputs = proc(text=texts, audio=audio, sampling_rate=RATE, **dia_audio_kwargs())
    out = pipe.model.generate(**inputs, max_new_tokens=frames, do_sample=False, guidance_scale=guidance_scale)
    return out[:, inputs["decoder_input_ids"].shape[1] - max(DELAY):]  # the generated frames


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("guidance_scale", [None, 3.0])
def test_greedy_equals_transformers_generate(pipe, rows, guidance_scale):
    out = pipe(TEXTS[:rows], max_new_frames=40, temperature=0, guidance_scale=guidance_scale)
    ref = transformers_frames(pipe, TEXTS[:rows], 40, guidance_scale)
    assert torch.equal(out.frames[:, : ref.shape[1]], ref)
    assert out.lengths.tolist() == [int((r[:, 2] != PAD).sum()) for r in ref]  # each row through its last EOS
    assert len(set(out.lengths.tolist())) == min(rows, 2)  # rows ended at different frames


def test_frame_budget_forces_the_end_as_generate_does():
    pipe = tiny_dia(1)  # never ends on its own
    out = pipe(TEXTS[:2], max_new_frames=12, temperature=0)
    assert torch.equal(out.frames, transformers_frames(pipe, TEXTS[:2], 12))
    assert out.lengths.tolist() == [12, 12] and [c.shape[1] for c in out.codes] == [12 - max(DELAY) - 1] * 2


@pytest.mark.parametrize("decoding", ["sjd", "sjd-coupled", "sjd:window=3", "draft", "lookup"])
def test_lossless_frame_decoders_equal_ar_under_greedy(pipe, decoding):
    ar = pipe(TEXTS, max_new_frames=30, temperature=0)
    # A drafter near the target (another seed's random Dia agrees on no frame: no draft accepted).
    options = {"drafter": perturbed(tiny_dia(0, eos_boost=2.0), ("logits_dense.weight",)), "num_draft": 3} if decoding == "draft" else {}
    name, _, rest = decoding.partition(":")
    decoder = make_decoder(name, **options, **({"window": int(rest.split("=")[1])} if rest else {}))
    out = pipe(TEXTS, max_new_frames=30, temperature=0, decoding=decoder)
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)
    assert all(torch.equal(a, b) for a, b in zip(out.audio, ar.audio))
    if not decoding.startswith("sjd"):  # a random Dia's frames pass as no Jacobi draft: see the next test
        assert_drafted(out, ar)


@pytest.mark.parametrize("decoding", [f"sjd:window={w},draft_init=left,adapt=false" for w in (3, 4, 8)] + ["sjd", "sjd-coupled"])
def test_jacobi_drafts_frames_on_a_model_whose_next_frame_ignores_the_last(decoding):
    """Jacobi decoding drafts Dia's frames: on a `text_only` Dia (each row repeats a frame of its
    text's, BOS and the forced end aside) its carried drafts are right, so with guidance it
    takes fewer forwards than `ar`, exactly as many as the frames predict for a fixed window with
    left-copied drafts (`jacobi_forwards`), and speaks `ar`'s frames."""
    pipe = text_only(tiny_dia(0, eos_boost=2.0))
    call = dict(max_new_frames=30, temperature=0, guidance_scale=3.0)
    ar = pipe(TEXTS, **call)
    assert len({tuple(f.flatten().tolist()) for f in ar.frames}) == len(TEXTS)  # the rows speak differently
    options = parse_decoding(decoding)[1]
    window = options.get("window")  # a fixed window with left-copied drafts: its forwards are known
    out = pipe(TEXTS, decoding=decoding, **call)
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)
    assert_drafted(out, ar)
    if window:
        end = 30 - max(DELAY) - 1  # the frame the budget forces codebook 0 to end at
        assert out.stats.forwards == max(jacobi_forwards(f, window, end=end) for f in ar.frames)


def test_a_drafter_that_agrees_has_every_frame_accepted():
    """The model as its own drafter: under greedy every drafted frame is accepted, so each
    target forward finalises num_draft + 1 frames."""
    pipe = tiny_dia(1)  # runs to its budget
    out = pipe(TEXTS[:1], max_new_frames=40, temperature=0, decoding=DraftSpeculative(drafter=tiny_dia(1), num_draft=3))
    assert out.stats.forwards == 1 + -(-39 // 4)  # the prefill, then 4 frames per forward
    assert torch.equal(out.frames, pipe(TEXTS[:1], max_new_frames=40, temperature=0).frames)


@pytest.mark.slow
@pytest.mark.parametrize("decoding,rule_name,lossless", [
    ("sjd", "exact", True), ("sjd", "always-accept", False), ("draft", "exact", True), ("draft", "residual-forgotten", False)])
def test_frame_speculation_is_exact_in_distribution(pipe, decoding, rule_name, lossless):
    """Three sampled frames (top-k 2: codebook 0 in every frame, codebook 1 from frame 2 on its
    delay, the rest forced) of 3000 rows against the enumerated joint of Dia's processed
    distribution (CFG filter included), chi-square; a wrong rule fails it. Fixed windows (at
    3000 rows the adaptive window would take AR steps). The drafter is the target at a higher
    temperature: it shares the target's top 2, so its frames are accepted and rejected and the
    residual matters (an unrelated random drafter's frames were never accepted). Jacobi's
    drafts here are mostly its first, near-uniform ones, whose residual is close to p, so its
    negative control accepts every draft; the residual of carried frame drafts is tested on a
    model built for it (tests/core/test_speculative_loop.py)."""
    from scipy.stats import chisquare

    sampling = SamplingConfig(temperature=0.15, top_k=2)
    model = DiaTokenModel(pipe.model)

    def conditions(rows):
        return pipe.adapter.conditions([TEXTS[0]] * rows, [None] * rows, [None] * rows, 20, (3.0, 50))

    state = model.start(conditions(4), 8, False)
    p0 = sampling.probs(state.first_logits, torch.zeros(4, 1, dtype=torch.long))[0, 0, 0]
    a = p0.topk(2).indices
    frame = lambda ch0: torch.tensor([int(ch0), BOS, BOS])
    # Rows (a_i, b_j): the second frame's law given a_i, the third's given (a_i, b_j).
    first = model.forward(state, torch.stack([frame(a[i // 2]) for i in range(4)])[:, None])
    p1 = sampling.probs(first, torch.ones(4, 1, dtype=torch.long))[:, 0, 0]  # ch0 given a
    b = torch.stack([p1[2 * i].topk(2).indices for i in range(2)])  # [2, 2]
    model.commit(state, torch.ones(4, dtype=torch.long))
    fed = torch.stack([frame(b[i // 2, i % 2]) for i in range(4)])[:, None]
    p2 = sampling.probs(model.forward(state, fed), torch.full((4, 1), 2, dtype=torch.long))[:, 0]  # [4, C, V]
    joint = {}
    for i in range(4):
        pa, pb = p0[a[i // 2]], p1[2 * (i // 2)][b[i // 2, i % 2]]
        for x0 in p2[i, 0].nonzero().flatten().tolist():
            for x1 in p2[i, 1].nonzero().flatten().tolist():
                joint[(int(a[i // 2]), int(b[i // 2, i % 2]), x0, x1)] = float(pa * pb * p2[i, 0, x0] * p2[i, 1, x1])
    rows = 3000
    acceptance = rule(rule_name)
    decoder = pinned_decoder(decoding, acceptance, DiaTokenModel(pipe.model), window=2)
    out = decoder.generate(model, conditions(rows), 3, sampling, torch.Generator().manual_seed(0),
                           stopping=Stopping(stop_tokens=[EOS], max_new_tokens=3, stop_codebook=2, pad_token=PAD))
    assert acceptance.speculated(), acceptance.counts
    counts = dict.fromkeys(joint, 0)
    for f in out.tokens.tolist():
        key = (f[0][0], f[1][0], f[2][0], f[2][1])
        assert f[2][2] == BOS  # delays respected
        if key not in counts:  # outside the target's support
            assert not lossless, key
            return
        counts[key] += 1
    keys = sorted(joint)
    expected = np.array([joint[k] for k in keys]) / sum(joint.values()) * rows
    assert (chisquare(np.array([counts[k] for k in keys]), expected).pvalue > 1e-3) == lossless


def test_streamed_audio_concatenates_to_the_one_shot_audio():
    """The default window covers the DAC decoder's measured reach (both sides: it is not
    causal), so the stream is the one-shot audio; chunks come out while frames commit."""
    pipe = tiny_dia(1)
    whole = pipe(TEXTS[:2], max_new_frames=100, temperature=0)
    chunks: dict[int, list] = {}
    gen = pipe.stream(TEXTS[:2], max_new_frames=100, temperature=0)
    while True:
        try:
            row, chunk = next(gen)
        except StopIteration as stop:
            output = stop.value
            break
        chunks.setdefault(row, []).append(chunk)
    assert torch.equal(output.frames, whole.frames)
    for row in range(2):
        streamed = torch.cat(chunks[row])
        assert len(chunks[row]) > 1 and streamed.shape == whole.audio[row].shape
        assert torch.allclose(streamed, whole.audio[row], atol=rounding(whole.audio[row]), rtol=0)  # float rounding only


def test_a_short_stream_context_is_approximate_within_a_bound(pipe):
    """DAC's decoder sees both sides: without context a stream differs near chunk edges only."""
    from mmgen.audio.codec import CodecStream, StreamChunking

    codes = tiny_dia(1)(TEXTS[1], max_new_frames=40, temperature=0).codes[0]  # runs to its budget
    before, after = pipe.codec.decoder_reach()
    assert before > 0 and after > 0
    stream = CodecStream(pipe.codec, StreamChunking(0, 0))
    approx = torch.cat([stream.push(codes[:, i: i + 4]) for i in range(0, codes.shape[1], 4)] + [stream.flush()])
    exact = pipe.codec.decode(codes)
    assert approx.shape == exact.shape and not torch.allclose(approx, exact, atol=rounding(exact), rtol=0)
    far = torch.ones_like(exact, dtype=torch.bool).view(-1, pipe.codec.hop_length)
    for edge in range(4, codes.shape[1], 4):  # samples farther than the reach from any chunk edge are exact
        far[max(0, edge - before): edge + after] = False
    assert torch.allclose(approx.view_as(far)[far], exact.view_as(far)[far], atol=rounding(exact), rtol=0)


def test_the_old_stream_window_names_still_work_and_warn():
    """`StreamWindow` and `window=` are the names of `StreamChunking` and `chunking=` until
    the next release: the same chunks, with a DeprecationWarning."""
    import mmgen.audio.codec as codec

    with pytest.warns(DeprecationWarning, match="StreamWindow is now StreamChunking"):
        assert codec.StreamWindow is codec.StreamChunking
    call, speaker = dict(max_new_frames=40, temperature=0), tiny_dia(1)  # runs to its budget
    new = [chunk for _, chunk in speaker.stream(TEXTS[1], chunking=codec.StreamChunking(0, 0, 4), **call)]
    with pytest.warns(DeprecationWarning, match=r"window= argument is now chunking="):
        old = [chunk for _, chunk in speaker.stream(TEXTS[1], window=codec.StreamChunking(0, 0, 4), **call)]
    assert len(new) == len(old) > 1 and all(torch.equal(a, b) for a, b in zip(new, old))


def test_a_model_that_reads_phonemes_gets_the_text_spelled_in_them():
    """A config with `mmgen_text_frontend` (the bundled trainer's phoneme runs) reads the text as
    espeak-ng's phonemes one letter each, speaker tags kept; a voice transcript too; a text with
    nothing to say and an unknown front end are one line each."""
    from mmgen.audio.phonemes import spell_text
    from mmgen.audio.pipeline import TTSPipeline

    reader = tiny_dia(0)
    reader.model.config.mmgen_text_frontend = {"kind": "phonemes", "voice": "en-us"}
    reader = TTSPipeline(reader.model, reader.tokenizer, reader.codec.model)
    ids = lambda text: bytes(reader.prepare(text, max_new_frames=8)[0].input_ids[0].tolist()).rstrip(b"\0")
    spelled = spell_text("[S1] Hello there. [S2] Fine.")
    assert spelled.startswith("[S1] ") and " [S2] " in spelled
    assert ids("[S1] Hello there. [S2] Fine.") == bytes(reader.tokenizer(spelled)["input_ids"])
    assert ids("Hello there.") == ids("[S1] Hello there.")
    with pytest.raises(ValueError, match="has nothing to"):
        reader.prepare("?!", max_new_frames=8)
    reader.model.config.mmgen_text_frontend = {"kind": "graphemes"}
    with pytest.raises(ValueError, match=r"^config mmgen_text_frontend must be"):
        TTSPipeline(reader.model, reader.tokenizer, reader.codec.model)


def test_voice_prompt_equals_transformers_generate(pipe):
    g = torch.Generator().manual_seed(0)
    voice = (0.3 * torch.randn(96, generator=g)).numpy()  # 24 frames of the tiny codec
    out = pipe("Hello there.", voice=(voice, RATE), voice_text="[S1] Hi.", max_new_frames=30, temperature=0)
    ref = transformers_frames(pipe, ["[S1] Hi. Hello there."], 30, audio=[voice])
    assert torch.equal(out.frames[:, : ref.shape[1]], ref)


def test_voice_prompts_are_resampled_and_checked(pipe, tmp_path):
    from mmgen.audio.waveform import AudioError, write_wav

    wave = 0.3 * torch.sin(torch.arange(441) / 5.0)  # 10 ms: 40 frames of the tiny codec at 16 kHz
    path = write_wav(tmp_path / "voice.wav", wave, 44100)
    out = pipe("Hi.", voice=path, voice_text="[S1] Yes.", max_new_frames=20, temperature=0)
    assert out.frames.shape[0] == 1
    write_wav(tmp_path / "silent.wav", torch.zeros(800), RATE)
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    for voice, match in [(tmp_path / "silent.wav", "silent"), (tmp_path / "bad.wav", "cannot read audio"),
                         (tmp_path / "missing.wav", "cannot read audio")]:
        with pytest.raises(AudioError, match=match):
            pipe("Hi.", voice=voice)


@pytest.mark.parametrize("kwargs, match", [
    (dict(text=""), "non-empty"),
    (dict(text="a" * 3000), "too long"),
    (dict(text="hi", voice_text="[S1] yes"), "give the voice too"),
    (dict(text="hi", max_new_frames=3), "largest delay"),
    (dict(text="hi", max_new_frames=0), "max_new_frames"),
    (dict(text=["a", "b"], voice_text=["x"]), "2 texts need 2"),
])
def test_bad_input_is_a_clear_error(pipe, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pipe(**kwargs)


def test_a_drafter_with_another_codec_layout_is_refused(pipe):
    other = tiny_dia(4, delay=(0, 1, 2))
    with pytest.raises(ValueError, match="another codec layout"):
        pipe("hi", decoding=DraftSpeculative(drafter=other), max_new_frames=8)


def test_saved_folder_loads_through_the_registry(pipe, tmp_path):
    from mmgen.loading import load_pipeline

    pipe.save_pretrained(tmp_path / "tts")
    loaded = load_pipeline(str(tmp_path / "tts"))
    assert type(loaded).__name__ == "TTSPipeline"
    a, b = pipe(TEXTS[0], max_new_frames=20, temperature=0), loaded(TEXTS[0], max_new_frames=20, temperature=0)
    assert torch.equal(a.frames, b.frames) and torch.allclose(a.audio[0], b.audio[0])


def test_sampling_is_reproducible_from_the_generator(pipe):
    run = lambda: pipe(TEXTS[:2], max_new_frames=30, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(run().frames, run().frames)


def test_grouped_acceptance_groups_each_codebook_by_its_own_embeddings(pipe):
    """GSD on frames: one rule per codebook, bound to that codebook's embedding table. Under
    greedy only the argmax has mass, so nothing is grouped and the frames are AR's; under
    sampling wide groups accept more drafts than the exact rule."""
    from mmgen.decoding.acceptance import ExactAcceptance, GroupedAcceptance, PerCodebook

    rule = GroupedAcceptance().bind(DiaTokenModel(pipe.model))
    assert isinstance(rule, PerCodebook) and len(rule.rules) == len(DELAY)
    ar = pipe(TEXTS, max_new_frames=30, temperature=0)
    assert torch.equal(pipe(TEXTS, max_new_frames=30, temperature=0, decoding="gsd").frames, ar.frames)
    from mmgen.decoding import DraftSpeculative

    drafter = tiny_dia(3, eos_boost=2.0)  # another model: the exact rule rejects often

    def accepted_per_forward(acceptance):
        out = pipe(TEXTS * 2, max_new_frames=20, temperature=1.0, top_k=8, generator=torch.Generator().manual_seed(0),
                   decoding=DraftSpeculative(drafter=drafter, num_draft=3, acceptance=acceptance))
        h = out.stats.accepted_histogram
        return sum(i * n for i, n in enumerate(h)) / sum(h)

    wide = GroupedAcceptance(prob_threshold=1.0, distance_threshold=1e9)
    assert accepted_per_forward(wide) > accepted_per_forward(ExactAcceptance())


def test_the_adapter_was_called_family_and_that_name_warns():
    """`TTSPipeline.adapter` is the family's adapter object; the old name `family` still
    returns it for one release, with a DeprecationWarning."""
    from mmgen.audio.dia import DiaSpeech

    pipe = tiny_dia(0)
    assert isinstance(pipe.adapter, DiaSpeech)
    with pytest.warns(DeprecationWarning, match="TTSPipeline.family is now TTSPipeline.adapter"):
        assert pipe.family is pipe.adapter
