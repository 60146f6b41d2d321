"""CSM through `TTSPipeline` on tiny random models: a backbone for codebook 0 and a depth
decoder for the rest of each Mimi frame. `generate` parity, lossless frame decoders over
dependent codebooks (greedy identity and the exact joint of two sampled frames), streaming
audio from a causal codec, voice prompts."""

from __future__ import annotations

from collections import Counter
import numpy as np
import pytest
import torch

from mmgen.audio.csm import CsmTokenModel
from mmgen.decoding import DraftSpeculative, Stopping, make_decoder, parse_decoding
from mmgen.sampling import SamplingConfig

from tests.audio.tiny import CSM_MIMI_LENGTHS, NQ, RATE, jacobi_forwards, perturbed, rounding, text_only, tiny_csm
from tests.speculation import assert_drafted, pinned_decoder, rule

TEXTS = ["Hello there.", "Something else entirely, and longer.", "Three."]


@pytest.fixture(scope="module")
def pipe():
    return tiny_csm(0, eos_boost=3.0)  # rows end on their own, at different frames


def transformers_frames(pipe, conditions, frames):
    extra = {} if conditions.input_values is None else dict(input_values=conditions.input_values,
                                                              input_values_cutoffs=conditions.input_values_cutoffs)
    return pipe.model.generate(input_ids=conditions.input_ids, attention_mask=conditions.attention_mask, max_new_tokens=frames,
                               do_sample=False, depth_decoder_do_sample=False, **extra)


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_equals_transformers_generate(pipe, rows):
    out = pipe(TEXTS[:rows], max_new_frames=16, temperature=0)
    ref = transformers_frames(pipe, pipe.adapter.conditions(TEXTS[:rows], [None] * rows, [None] * rows, 16, (None, None)), 16)
    for b, n in enumerate(out.lengths.tolist()):  # generate keeps decoding finished rows; mmgen pads them
        assert torch.equal(out.frames[b, :n], ref[b, :n])
        ends = (ref[b, :, :-1] == 0).all(-1).nonzero()
        assert n == (int(ends[0]) + 1 if len(ends) else 16)  # through the end frame
    assert rows == 1 or len(set(out.lengths.tolist())) > 1


def test_audio_is_cut_where_generate_cuts_it(pipe):
    out = pipe(TEXTS[0], max_new_frames=30, temperature=0)
    conditions = pipe.adapter.conditions(TEXTS[:1], [None], [None], 30, (None, None))
    audio = pipe.model.generate(input_ids=conditions.input_ids, attention_mask=conditions.attention_mask, max_new_tokens=30,
                                do_sample=False, depth_decoder_do_sample=False, output_audio=True)[0]
    assert torch.allclose(out.audio[0], audio.reshape(-1).float(), atol=rounding(out.audio[0]), rtol=0)


@pytest.mark.parametrize("decoding", ["sjd:window=4", "draft", "draft-self", "lookup"])
def test_lossless_frame_decoders_equal_ar_under_greedy(pipe, decoding):
    ar = pipe(TEXTS, max_new_frames=16, temperature=0)
    if decoding.startswith("draft"):
        # Itself (every draft accepted), or a drafter near it (another seed's random CSM agrees
        # on no frame: no draft accepted).
        drafter = pipe if decoding == "draft-self" else perturbed(tiny_csm(0, eos_boost=3.0), ("lm_head.weight", "depth_decoder.codebooks_head.weight"))
        decoder = DraftSpeculative(drafter=drafter, num_draft=3)
    else:
        name, _, rest = decoding.partition(":")
        decoder = make_decoder(name, **({"window": int(rest.split("=")[1])} if rest else {}))
    out = pipe(TEXTS, max_new_frames=16, temperature=0, decoding=decoder)
    for b, n in enumerate(ar.lengths.tolist()):
        assert out.lengths[b] == n and torch.equal(out.frames[b, :n], ar.frames[b, :n])
    if decoding.startswith("draft"):  # a random CSM's frames pass as no lookup or Jacobi draft (see the next test)
        assert_drafted(out, ar)
    if decoding == "draft-self":  # every drafted frame is accepted: 4 frames per target forward
        assert out.stats.forwards < ar.stats.forwards / 2


@pytest.mark.parametrize("decoding", [f"sjd:window={w},draft_init=left,adapt=false" for w in (3, 4, 6)] + ["sjd"])
def test_jacobi_drafts_frames_on_a_model_whose_next_frame_ignores_the_last(decoding):
    """Jacobi decoding drafts CSM's frames: on a `text_only` CSM (frames that change with the
    position and the text, not with the frames before) its carried drafts are right, so it takes
    fewer forwards than `ar`, exactly as many as the frames predict for a fixed window with
    left-copied drafts (`jacobi_forwards`), and speaks `ar`'s frames."""
    pipe = text_only(tiny_csm(2, eos_boost=3.0))
    ar = pipe(TEXTS, max_new_frames=16, temperature=0)
    assert len({tuple(f.flatten().tolist()) for f in ar.frames}) == len(TEXTS)  # the rows speak differently
    assert all(len(set(map(tuple, f.tolist()))) > 2 for f in ar.frames)  # and their frames change
    options = parse_decoding(decoding)[1]
    window = options.get("window")  # a fixed window with left-copied drafts: its forwards are known
    out = pipe(TEXTS, max_new_frames=16, temperature=0, decoding=decoding)
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)
    assert_drafted(out, ar)
    if window:
        assert out.stats.forwards == max(jacobi_forwards(f[:n], window, partial_last=True) for f, n in zip(ar.frames, ar.lengths))


def test_coupled_jacobi_is_refused_for_dependent_codebooks(pipe):
    with pytest.raises(ValueError, match="dependent"):
        pipe(TEXTS[0], max_new_frames=8, decoding="sjd-coupled")


def _support(law, prefix_frames):
    """Every frame of nonzero probability after `prefix_frames`, with its probability: codebook
    by codebook, each law given the frame's codebooks before it (`law(frames, k)` -> [n, V])."""
    frames, probs = torch.zeros(1, NQ, dtype=torch.long), torch.ones(1, dtype=torch.float64)
    for k in range(NQ):
        p = law(frames, k)
        nxt, nprob = [], []
        for i in range(len(frames)):
            for token in p[i].nonzero().flatten().tolist():
                f = frames[i].clone()
                f[k] = token
                nxt.append(f)
                nprob.append(probs[i] * float(p[i, token]))
        frames, probs = torch.stack(nxt), torch.tensor(nprob, dtype=torch.float64)
    return frames, probs


@pytest.mark.slow
@pytest.mark.parametrize("decoding,rule_name,lossless", [
    ("sjd", "exact", True), ("sjd", "always-accept", False), ("draft", "exact", True), ("draft", "residual-forgotten", False)])
def test_frame_speculation_over_dependent_codebooks_is_exact_in_distribution(pipe, decoding, rule_name, lossless):
    """Two sampled frames (top-k 2 on every codebook: 256 outcomes) of 10000 rows against the
    target's enumerated joint, each codebook's law given the frame's codebooks before it,
    chi-square (and on a marginal); a wrong rule fails it. Fixed windows (at these batch sizes the adaptive window would
    take AR steps); the drafter is the target at a higher temperature on every codebook (its
    depth decoder too: `Tempered`), so each codebook's drafts are accepted and rejected and the
    residual matters (a rule that checked codebook 0 alone fails). Two frames give Jacobi only its first,
    near-uniform drafts, whose residual is close to p: its negative control accepts every
    draft (carried frame drafts: tests/core/test_speculative_loop.py)."""
    from scipy.stats import chisquare

    sampling = SamplingConfig(temperature=0.15, top_k=2)
    model = CsmTokenModel(pipe.model)
    conditions = lambda rows: pipe.adapter.conditions([TEXTS[0]] * rows, [None] * rows, [None] * rows, 20, (None, None))
    zero = lambda n: torch.zeros(n, 1, dtype=torch.long)

    def first_law(frames, k):
        state = model.start(conditions(len(frames)), 4, False)
        logits = model._logits(state.first_logits.cond[:, :, 0], state.extra.hidden, frames[:, None])
        return sampling.probs(logits, zero(len(frames)))[:, 0, k]

    f0s, p0s = _support(first_law, None)
    joint = {}
    for f0, p0 in zip(f0s, p0s):
        def second_law(frames, k, f0=f0):
            state = model.start(conditions(len(frames)), 4, False)
            window = torch.stack([f0.expand(len(frames), -1), frames], 1)
            return sampling.probs(model.forward(state, window), torch.ones(len(frames), 2, dtype=torch.long))[:, 0, k]

        for f1, p1 in zip(*_support(second_law, f0)):
            joint[tuple(f0.tolist() + f1.tolist())] = float(p0 * p1)
    assert len(joint) == 256 and abs(sum(joint.values()) - 1) < 1e-4
    rows = 10000
    acceptance = rule(rule_name)
    decoder = pinned_decoder(decoding, acceptance, CsmTokenModel(pipe.model), window=3)
    out = decoder.generate(model, conditions(rows), 2, sampling, torch.Generator().manual_seed(0),
                           stopping=Stopping(stop_tokens=[], max_new_tokens=2))
    assert acceptance.speculated(), acceptance.counts
    counts = dict.fromkeys(joint, 0)
    for f in out.tokens.reshape(rows, 2 * NQ).tolist():
        if tuple(f) not in counts:  # outside the target's support
            assert not lossless, f
            return
        counts[tuple(f)] += 1

    def passes(part) -> bool:  # chi-square of the counts and the law summed over part(frames)
        observed, law = Counter(), Counter()
        for key in joint:
            observed[part(key)] += counts[key]
            law[part(key)] += joint[key]
        keys = sorted(law)
        expected = np.array([law[k] for k in keys]) / sum(law.values()) * rows
        return chisquare(np.array([observed[k] for k in keys]), expected).pvalue > 1e-3

    # The whole joint, and the first frame with the second's codebook 0, where 32 cells see
    # what 256 spread thin.
    assert (passes(lambda key: key) and passes(lambda key: key[: NQ + 1])) == lossless


def test_streamed_audio_concatenates_to_the_one_shot_audio():
    """Mimi's decoder is causal (its measured reach ahead is 0 frames), so chunks need left
    context only and come out as soon as their frames commit."""
    pipe = tiny_csm(1)  # runs to its budget
    assert pipe.codec.decoder_reach()[0] == 0
    whole = pipe(TEXTS[:2], max_new_frames=40, temperature=0)
    chunks: dict[int, list] = {}
    gen = pipe.stream(TEXTS[:2], max_new_frames=40, temperature=0)
    try:
        while True:
            row, chunk = next(gen)
            chunks.setdefault(row, []).append(chunk)
    except StopIteration as stop:
        output = stop.value
    assert torch.equal(output.frames, whole.frames)
    for row in range(2):
        assert len(chunks[row]) > 1
        assert torch.allclose(torch.cat(chunks[row]), whole.audio[row], atol=rounding(whole.audio[row]), rtol=0)  # float rounding only


def test_voice_prompt_equals_transformers_processor_and_generate(pipe):
    from transformers import CsmProcessor, EncodecFeatureExtractor

    g = torch.Generator().manual_seed(0)
    voice = (0.3 * torch.randn(16 * 6, generator=g)).numpy()  # 6 frames of the tiny Mimi
    out = pipe("Hello there.", voice=(voice, RATE), voice_text="Hi.", max_new_frames=20, temperature=0)
    proc = CsmProcessor(feature_extractor=EncodecFeatureExtractor(feature_size=1, sampling_rate=RATE), tokenizer=pipe.tokenizer)
    inputs = proc(text="<|begin_of_text|>[0]Hi.<|end_of_text|><|AUDIO|><|audio_eos|><|begin_of_text|>[0]Hello there.<|end_of_text|>",
                  audio=[voice], encoded_length_kwargs=CSM_MIMI_LENGTHS, sampling_rate=RATE)
    ours = pipe.adapter.conditions(["Hello there."], [torch.from_numpy(voice)], ["Hi."], 20, (None, None))
    assert torch.equal(ours.input_ids, inputs["input_ids"])
    ref = pipe.model.generate(**inputs, max_new_tokens=20, do_sample=False, depth_decoder_do_sample=False)
    n = int(out.lengths[0])
    assert torch.equal(out.frames[0, :n], ref[0, :n])


def test_guidance_is_refused(pipe):
    with pytest.raises(ValueError, match="no guidance"):
        pipe("hi", guidance_scale=3.0)
