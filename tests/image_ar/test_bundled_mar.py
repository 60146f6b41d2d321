"""The bundled MAR models: offline loading, seeded generation, continuous speculative decoding
with the bundled drafter (and with the target as its own drafter, on trained weights), the
bench rows, and a quality check that can fail."""

import json

import pytest
import torch

from mmgen.image_ar.bench.mar import mar_diffusion_loss
from mmgen.decoding import ContinuousAcceptance, ContinuousSpeculative, MaskedContinuous
from mmgen.image_ar.bundled import load_eval_set
from mmgen.loading import resolve_model
from mmgen.image_ar.mar import MARPipeline


@pytest.fixture(scope="module")
def pipes():
    target = MARPipeline.from_pretrained(resolve_model("mar-emoji64"))
    draft = MARPipeline.from_pretrained(resolve_model("mar-emoji64-draft"))
    for p in (target, draft):
        p.set_progress_bar_config(disable=True)
    return target, draft


def test_bundled_mar_models_load_offline_and_generate_deterministically(pipes):
    target, draft = pipes
    assert target.image_size == 64 and target.num_classes == len(target.class_names) == 74
    assert target.transformer.seq_len == 64 and target.transformer.config.token_embed_dim == 4
    assert all(torch.equal(a, b) for a, b in zip(target.vae.state_dict().values(), draft.vae.state_dict().values()))
    assert sum(p.numel() for p in draft.transformer.parameters()) < sum(p.numel() for p in target.transformer.parameters()) / 4
    labels = [target.class_index("face-smiling"), 3]
    a, b = (target(labels, num_iter=8, generator=torch.Generator().manual_seed(0), output_type="pt") for _ in range(2))
    c = target(labels, num_iter=8, generator=torch.Generator().manual_seed(1), output_type="pt")
    assert a.images.shape == (2, 3, 64, 64) and torch.equal(a.images, b.images) and not torch.equal(a.images, c.images)
    assert a.stats.forwards == 8 and torch.isfinite(a.tokens).all()


def test_cspd_with_the_target_as_drafter_keeps_every_token_on_trained_weights(pipes):
    """Identical heads under shared noise give identical samples: everything is kept and the
    output equals the masked sampler on the same (stochastic-last-step) model."""
    target, _ = pipes
    model = target.continuous_model(stochastic_last_step=True)
    labels, sampling = torch.tensor([0, 5, 40]), target.sampling_config()
    plain = MaskedContinuous(num_steps=12).generate(model, labels, sampling, torch.Generator().manual_seed(3))
    spec = ContinuousSpeculative(drafter=model, num_steps=12, num_draft=4).generate(model, labels, sampling,
                                                                                    torch.Generator().manual_seed(3))
    assert spec.stats.accepted_drafts == spec.stats.drafted > 0 and spec.stats.fallbacks == 0
    assert torch.equal(spec.tokens, plain.tokens)  # kept drafts are the drafter's own samples
    assert spec.stats.forwards < plain.stats.forwards


def test_cspd_with_the_bundled_drafter_exact_and_flattened(pipes):
    """Exact acceptance commits every step once; flattening the exponent (the reference's
    inner temperature, lossy) keeps more drafts and needs fewer target forwards."""
    target, draft = pipes
    run = lambda flatten: target([1, 2, 3, 4], generator=torch.Generator().manual_seed(0), output_type="pt",
                                 decoding=ContinuousSpeculative(drafter=draft, num_steps=16, num_draft=4,
                                                                acceptance=ContinuousAcceptance(flatten=flatten))).stats
    exact, flat = run(1.0), run(1000.0)
    for s in (exact, flat):
        assert s.baseline_forwards == 16 and s.draft_forwards > 0 and s.fallbacks == 0
        assert sum(s.accepted_per_forward) == pytest.approx(16)  # every step committed once
    assert flat.accepted_drafts / flat.drafted > 0.5 > exact.accepted_drafts / exact.drafted
    assert flat.forwards < exact.forwards <= 16


def test_the_target_explains_real_images_better_than_the_drafter(pipes):
    target, draft = pipes
    images, labels = load_eval_set()
    latents = target.vae.encode(images * 2 - 1).mode() * target.vae.config.scaling_factor
    loss_target, loss_draft = (mar_diffusion_loss(p.transformer, latents, labels) for p in (target, draft))
    shuffled = latents[torch.randperm(len(latents), generator=torch.Generator().manual_seed(0))]
    assert loss_target < loss_draft
    # Real latents against latents of the wrong class: the class conditioning carries information.
    assert mar_diffusion_loss(target.transformer, shuffled, labels) > loss_target


def test_mar_bench_reports_speed_and_quality(tmp_path):
    from mmgen.cli import main

    path = tmp_path / "bench.json"
    argv = ["bench", "image", "--models", "mar-emoji64", "--methods", "ar", "ar:num_steps=4", "cspd:num_draft=4",
            "--batch-sizes", "2", "--repeats", "1", "--warmup", "0", "--quality-per-class", "1", "--quality-classes", "16",
            "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    speed = {r["method"]: r for r in report["speed"]}
    assert speed["ar"]["steps"] == speed["ar"]["target_forwards"] == 16 and speed["ar"]["speedup"] == 1.0
    assert speed["ar:num_steps=4"]["target_forwards"] == 4
    cspd = speed["cspd:num_draft=4"]
    assert cspd["steps"] == 16 and cspd["target_forwards"] <= 16 and 0 <= cspd["kept_drafts"] < 1
    quality = {r["method"]: r for r in report["quality"]}
    assert len(quality) == 3
    for row in quality.values():
        assert row["num_images"] == 16 and row["accuracy"] > 1 / 74  # the first 16 of 74 classes
