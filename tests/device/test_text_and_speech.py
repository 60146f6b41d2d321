"""VLMs (every family of tests/vlm/tiny.py) and speech (Dia) on the device, through
transformers' own models.

Greedy output equals transformers' `generate` (every VLM family); every lossless decoder equals
AR (Qwen2.5-VL in float32 and bfloat16, Dia); sampled decodes are reproduced by their seed;
continuous batching gives each request what it decodes alone.
"""

from __future__ import annotations

import pytest
import torch

from mmgen.decoding import make_decoder
from mmgen.sampling import SamplingConfig, make_generator

from mmgen.audio.bench import transformers_generate
from tests.audio.tiny import DELAY, tiny_dia
from tests.device.parity import DTYPES, assert_greedy_identical
from tests.vlm.tiny import BUILDERS, PROMPTS, images, tiny_qwen

pytestmark = pytest.mark.device

DIA_TEXTS = ["[S1] Hello there.", "[S1] Something else entirely, and longer."]


def vlm(build, *args, **kwargs):
    """A tiny VLM pipeline, or a skip where its transformers processor needs torchvision and
    torchvision is not installed (the GPU check's bare machine: benchmarks/gpu_wheels.py)."""
    try:
        return build(*args, **kwargs)
    except ImportError as error:
        if "torchvision" in str(error).lower():
            pytest.skip(f"{build.__name__}: its transformers processor needs torchvision, not installed here")
        raise


@pytest.fixture(scope="module")
def qwen():
    built = {}
    return lambda device, dtype: built.setdefault((device, dtype), vlm(tiny_qwen).to(device, dtype))


@pytest.fixture(scope="module")
def dia():
    built = {}
    return lambda device: built.setdefault(device, tiny_dia(0, eos_boost=2.0).to(device))  # rows end at different frames


# --------------------------------------------------------------------------------------------
# VLM
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(BUILDERS))
def test_vlm_greedy_equals_transformers_generate(device, family):
    """Two prompts of different lengths with images of different sizes (left padding), the
    family tests' weights (std 0.1)."""
    pipe, pictures = vlm(BUILDERS[family], 0, std=0.1).to(device), images(2, [(40, 36), (24, 48)])
    inputs = {k: v.to(device) for k, v in pipe.prepare_inputs(PROMPTS[:2], pictures).items()}
    reference = pipe.model.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=pipe.pad_token_id, eos_token_id=[])
    out = pipe(PROMPTS[:2], pictures, max_new_tokens=10, stop_token_ids=[])
    assert torch.equal(out.token_ids, reference[:, inputs["input_ids"].shape[1]:].to(out.token_ids.device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_vlm_lossless_decoders_equal_ar_under_greedy(device, qwen, dtype):
    pipe, pictures = qwen(device, dtype), images(3)
    ar = pipe(PROMPTS, pictures, max_new_tokens=10, stop_token_ids=[])
    assert len(ar.token_ids.unique()) > 3
    inputs = pipe.prepare_inputs(PROMPTS, pictures)
    for decoding in ("sjd", "lookup", "sjd-coupled"):
        out = pipe(PROMPTS, pictures, max_new_tokens=10, stop_token_ids=[], decoding=decoding)
        assert_greedy_identical(pipe.token_model(), inputs, SamplingConfig(temperature=0.0), ar.token_ids, out.token_ids, dtype,
                                f"qwen2.5-vl {decoding} {dtype}")


def test_vlm_answers_each_prompt_as_alone_and_repeats_its_seed(device, qwen):
    pipe, pictures = qwen(device, torch.float32), images(3)
    per_prompt = [[pictures[0]], [], [pictures[1], pictures[2]]]
    options = dict(max_new_tokens=8, decoding="sjd:adapt=false,window=4", temperature=1.0)
    out = pipe.answer_each(PROMPTS, per_prompt, [make_generator(20 + k, device) for k in range(3)], batch_size=2, **options)
    for k, (prompt, pics) in enumerate(zip(PROMPTS, per_prompt)):
        alone = pipe(prompt, pics or None, generator=make_generator(20 + k, device), **options)
        again = pipe(prompt, pics or None, generator=make_generator(20 + k, device), **options)
        assert torch.equal(alone.token_ids, again.token_ids)
        assert torch.equal(out.token_ids[k], alone.token_ids[0]), f"prompt {k}"


# --------------------------------------------------------------------------------------------
# Speech (Dia)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("guidance_scale", [None, 3.0])
def test_dia_greedy_equals_transformers_generate(device, dia, guidance_scale):
    pipe = dia(device)
    conditions, budget = pipe.prepare(DIA_TEXTS, max_new_frames=30, guidance_scale=guidance_scale)
    reference = transformers_generate(pipe, conditions, 30)[:, conditions.decoder_input_ids.shape[1] - max(DELAY):]
    out = pipe(DIA_TEXTS, max_new_frames=30, temperature=0, guidance_scale=guidance_scale)
    for row, n in enumerate(out.lengths.tolist()):
        assert torch.equal(out.frames[row, :n], reference[row, :n].to(out.frames.device)), f"row {row}"
    assert len(set(out.lengths.tolist())) == 2  # rows ended at different frames


def test_dia_lossless_frame_decoders_equal_ar_and_sampling_repeats_its_seed(device, dia):
    pipe = dia(device)
    ar = pipe(DIA_TEXTS, max_new_frames=30, temperature=0)
    drafter = tiny_dia(3, eos_boost=2.0).to(device)
    decoders = {"sjd": make_decoder("sjd"), "sjd window 3": make_decoder("sjd", window=3),
                "draft": make_decoder("draft", drafter=drafter, num_draft=3)}
    for name, decoder in decoders.items():
        out = pipe(DIA_TEXTS, max_new_frames=30, temperature=0, decoding=decoder)
        assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths), name
    for decoding in ("ar", "sjd"):
        run = lambda: pipe(DIA_TEXTS, max_new_frames=20, temperature=1.0, top_k=20, decoding=decoding,
                           generator=make_generator(3, device))
        a, b = run(), run()
        assert torch.equal(a.frames, b.frames) and all(torch.equal(x, y) for x, y in zip(a.audio, b.audio)), decoding


def test_dia_coupled_jacobi_equals_ar_at_batch_two(device, dia):
    pipe = dia(device)
    ar = pipe(DIA_TEXTS, max_new_frames=30, temperature=0)
    out = pipe(DIA_TEXTS, max_new_frames=30, temperature=0, decoding="sjd-coupled")
    assert torch.equal(out.frames, ar.frames) and torch.equal(out.lengths, ar.lengths)


def test_dia_speaks_each_text_as_alone(device, dia):
    pipe = dia(device)
    texts = DIA_TEXTS + ["[S1] Three."]
    options = dict(max_new_frames=20, decoding="sjd:window=4,adapt=false", temperature=1.0, top_k=20, guidance_scale=3.0)
    out = pipe.speak_each(texts, generators=[make_generator(7 + k, device) for k in range(3)], batch_size=2, **options)
    for k, text in enumerate(texts):
        alone = pipe(text, generator=make_generator(7 + k, device), **options)
        n = int(alone.lengths[0])
        assert int(out.lengths[k]) == n and torch.equal(out.frames[k, :n], alone.frames[0, :n]), f"text {k}"
