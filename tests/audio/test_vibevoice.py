"""VibeVoice (next-token diffusion over continuous latents) on the core's cached causal
continuous decoder: the exact sampler reproduces transformers' `generate` with the same draws,
and continuous speculative decoding with a drafter keeps the target's law."""

from __future__ import annotations

import pytest
import torch

from mmgen.audio.vibevoice import VibeVoiceConditions, VibeVoiceLatentModel
from mmgen.decoding import CausalContinuousSpeculative
from mmgen.sampling import SamplingConfig

from tests.audio.tiny import VV_AUDIO, rounding, tiny_vibevoice, tiny_vibevoice_model

PROMPT = 7


def prompt(rows: int, seed: int = 100) -> VibeVoiceConditions:
    ids = torch.randint(0, 256, (rows, PROMPT), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1:2, :2] = 0  # a left-padded row
    return VibeVoiceConditions(ids, mask)


def decode(model, conditions, num, guidance=1.0, seed=0, **kwargs):
    return CausalContinuousSpeculative(**kwargs).generate(model, conditions, num, SamplingConfig(guidance=guidance),
                                                          torch.Generator().manual_seed(seed))


def generate_with(model, conditions, num, table, guidance):
    """transformers' `generate`, its head's initial noise taken from our table: when rows
    `mask` diffuse it draws randn(2 x rows, D) and uses the first half (the conditional rows),
    so row b's i-th latent starts from table[b, i, 0]."""
    import transformers.models.vibevoice.generation_vibevoice as module

    real, counts, diffusing = torch.randn, [0] * table.shape[0], []
    negative_step = model._step_negative_branch  # called with the diffusion mask just before the head

    def step_negative(mask, *args, **kwargs):
        diffusing[:] = mask.nonzero().flatten().tolist()
        return negative_step(mask, *args, **kwargs)

    def randn(*shape, **kwargs):
        if len(shape) == 2 and shape[1] == table.shape[-1]:
            assert 2 * len(diffusing) == shape[0]
            x = torch.zeros(len(diffusing), shape[1])
            for i, b in enumerate(diffusing):
                if counts[b] < table.shape[1]:
                    x[i] = table[b, counts[b], 0]
                counts[b] += 1
            return torch.cat([x, torch.zeros_like(x)])
        return real(*shape, **kwargs)

    # transformers also runs its generic logits CFG (an unconditional pass over the token ids)
    # on the backbone's audio/end choice when guidance_scale != 1; VibeVoice's own code guides
    # the diffusion head only, as mmgen does, so the reference leaves that processor out.
    processors = model._get_logits_processor

    def head_guidance_only(*args, **kwargs):
        from transformers import LogitsProcessorList

        return LogitsProcessorList(p for p in processors(*args, **kwargs) if "ClassifierFreeGuidance" not in type(p).__name__)

    module.torch.randn, model._get_logits_processor, model._step_negative_branch = randn, head_guidance_only, step_negative
    try:
        return model.generate(input_ids=conditions.input_ids, attention_mask=conditions.attention_mask, max_new_tokens=num,
                              guidance_scale=guidance, return_dict_in_generate=True)
    finally:
        module.torch.randn = real
        del model._get_logits_processor, model._step_negative_branch


@pytest.mark.parametrize("guidance,speak,num", [(1.0, 0.03, 16), (1.3, 1.0, 6)])
def test_latents_and_ends_equal_generate(guidance, speak, num):
    model = tiny_vibevoice_model(0, speak=speak)
    latent = VibeVoiceLatentModel(model)
    conditions = prompt(3)
    out = decode(latent, conditions, num, guidance)
    table = torch.randn(3, num, latent.head_steps + 1, latent.token_dim, generator=torch.Generator().manual_seed(0))
    ref = generate_with(model, conditions, num, table, guidance)
    lengths = out.lengths.tolist()
    assert guidance != 1.0 or (len(set(lengths)) > 1 and all(0 < n < num for n in lengths))  # natural ends
    for b, n in enumerate(lengths):
        new = ref.sequences[b, PROMPT:]
        assert (new[:n] == VV_AUDIO).all() and (n == num or new[n] != VV_AUDIO)
        audio = latent.decode(out.tokens[b, :n])
        expected = ref.audio[b][0, : audio.numel()] if n else torch.zeros(0)  # generate may speak again later
        assert audio.shape == expected.shape
        torch.testing.assert_close(audio, expected, atol=rounding(expected) if n else 0, rtol=0)
        assert (out.tokens[b, n:] == 0).all()


def test_drafting_with_itself_keeps_every_draft():
    model = tiny_vibevoice_model(0, speak=0.03)
    target, drafter = VibeVoiceLatentModel(model, final_std=0.3), VibeVoiceLatentModel(model, final_std=0.3)
    conditions = prompt(3)
    ar = decode(target, conditions, 12, 1.5)
    spec = decode(target, conditions, 12, 1.5, drafter=drafter, num_draft=3)
    assert torch.equal(spec.lengths, ar.lengths)
    torch.testing.assert_close(spec.tokens, ar.tokens, atol=1e-5, rtol=0)
    assert spec.stats.extra.drafted == spec.stats.extra.accepted_drafts > 0
    assert spec.stats.forwards < ar.stats.forwards


def test_speculative_latents_follow_the_target_law():
    """Conditional on the shared noise table, the target's latent is N(m(z), final_std^2): with
    the same seed as a plain decode (the same table, the same first latent) the second latent of
    speculative decoding, standardised by the plain decode's mean, must be standard normal.
    A drafter with a perturbed head keeps some drafts and rejects others (both paths run); the
    flattened acceptance (a lossy ratio) fails the same check, which shows the test's power."""
    import copy

    from scipy.stats import kstest

    from mmgen.decoding import ContinuousAcceptance

    rows, std = 400, 0.1
    model = tiny_vibevoice_model(1, speak=1.0)
    draft_model = copy.deepcopy(model)
    noise = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in draft_model.model.diffusion_head.parameters():
            p.add_(0.5 * p.abs().mean() * torch.randn(p.shape, generator=noise))
    target, drafter = VibeVoiceLatentModel(model, final_std=std), VibeVoiceLatentModel(draft_model, final_std=std)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(3)).expand(rows, -1)
    conditions = VibeVoiceConditions(ids, torch.ones_like(ids))
    plain = decode(target, conditions, 3, 1.0, seed=1).tokens
    table = torch.randn(rows, 3, target.head_steps + 1, target.token_dim, generator=torch.Generator().manual_seed(1))
    mean = plain[:, 1] - std * table[:, 1, -1]

    def standardised(acceptance):
        spec = decode(target, conditions, 3, 1.0, seed=1, drafter=drafter, num_draft=2, acceptance=acceptance)
        assert torch.equal(spec.tokens[:, 0], plain[:, 0])
        return (spec.tokens[:, 1] - mean) / std, spec.stats.extra

    r, counters = standardised(ContinuousAcceptance())
    assert 0.1 * counters.drafted < counters.accepted_drafts < 0.9 * counters.drafted
    assert kstest(r.flatten().numpy(), "norm").pvalue > 1e-3
    assert abs(float(r.mean())) < 0.05 and abs(float(r.std()) - 1) < 0.05
    lossy, counters = standardised(ContinuousAcceptance(flatten=42.0))
    assert counters.accepted_drafts > 0.9 * counters.drafted
    assert kstest(lossy.flatten().numpy(), "norm").pvalue < 1e-6


def test_bad_settings_are_refused():
    model = tiny_vibevoice_model(0)
    with pytest.raises(ValueError, match="final_std"):
        VibeVoiceLatentModel(model, final_std=-1.0)
    model.generation_config.noise_scheduler_config = {"algorithm_type": "sde-dpmsolver++"}
    with pytest.raises(ValueError, match="draws its own noise"):
        VibeVoiceLatentModel(model)


def test_pipeline_speaks_saves_and_reopens(tmp_path):
    from mmgen.audio.latent_pipeline import LatentTTSPipeline
    from mmgen.audio.pipeline import TTSPipeline

    pipe = tiny_vibevoice(0, speak=0.03)
    out = pipe(["hello there", "hi", "a longer sentence"], max_new_frames=16, generator=torch.Generator().manual_seed(0))
    hop = pipe.model.config.audio_config.hop_length
    assert [a.numel() for a in out.audio] == [n * hop for n in out.lengths.tolist()] and out.lengths.max() > 0
    assert out.sampling_rate == pipe.sampling_rate and out.real_time_factor > 0
    pipe.save_pretrained(tmp_path)
    again = TTSPipeline.from_pretrained(tmp_path)
    assert isinstance(again, LatentTTSPipeline)
    same = again(["hello there", "hi", "a longer sentence"], max_new_frames=16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(same.lengths, out.lengths)
    for a, b in zip(same.audio, out.audio):
        torch.testing.assert_close(a, b, atol=rounding(b) if b.numel() else 0, rtol=0)


def test_pipeline_speculative_with_a_drafter_pipeline():
    pipe, drafter = tiny_vibevoice(0, speak=1.0), tiny_vibevoice(0, speak=1.0)
    run = lambda decoding: pipe(["hello", "hi there"], max_new_frames=8, final_std=0.2, decoding=decoding,
                                generator=torch.Generator().manual_seed(3))
    plain = run("ar")
    spec = run(CausalContinuousSpeculative(drafter=drafter, num_draft=3))
    torch.testing.assert_close(spec.frames, plain.frames, atol=1e-5, rtol=0)
    assert spec.stats.extra.accepted_drafts == spec.stats.extra.drafted > 0


def test_pipeline_bad_input_is_refused():
    import numpy as np

    pipe = tiny_vibevoice(0)
    wave = (np.sin(np.arange(800) / 3) * 0.3).astype(np.float32)
    cases = [
        (dict(decoding=CausalContinuousSpeculative(drafter=tiny_vibevoice(1))), "final_std > 0"),
        (dict(decoding=CausalContinuousSpeculative(drafter=tiny_vibevoice(1, latent=6)), final_std=0.1), "another codec layout"),
        (dict(voice=(wave, 16000), voice_text="the words"), "without voice_text"),
        (dict(top_k=5), "top-k"),
        (dict(decoding="sjd"), "unknown decoding"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            pipe("hello", max_new_frames=4, **kwargs)
    with pytest.raises(ValueError, match="text"):
        pipe("  ")


@pytest.mark.parametrize("drafted", [False, True])
def test_streamed_chunks_concatenate_to_the_one_shot_audio(drafted):
    pipe = tiny_vibevoice(0, speak=0.03)
    texts = ["hello there", "hi", "a longer sentence"]
    decoding = CausalContinuousSpeculative(drafter=tiny_vibevoice(0, speak=0.03), num_draft=3) if drafted else "ar"
    kwargs = dict(max_new_frames=16, final_std=0.2, decoding=decoding, generator=torch.Generator().manual_seed(5))
    stream = pipe.stream(texts, **kwargs)
    chunks: dict = {}
    while True:
        try:
            row, chunk = next(stream)
        except StopIteration as stop:
            output = stop.value
            break
        chunks.setdefault(row, []).append(chunk)
    assert len(chunks[max(chunks, key=lambda r: len(chunks[r]))]) > 1  # audio came out in several chunks
    expected = pipe(texts, **{**kwargs, "generator": torch.Generator().manual_seed(5)})
    for b, audio in enumerate(expected.audio):
        got = torch.cat(chunks[b]) if b in chunks else torch.zeros(0)
        assert got.shape == audio.shape == output.audio[b].shape
        torch.testing.assert_close(got, audio, atol=rounding(audio) if audio.numel() else 0, rtol=0)
