"""MAR model pieces against facts produced by the official code (tests/fixtures/mar_*, generated
by /work/compare/mar/gen_diffloss_reference.py and gen_mar_reference.py)."""

import hashlib
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgen.image_ar.mar.diffloss import DiffLoss, space_timesteps
from mmgen.image_ar.mar.mar import MAR, MAR_PRESETS, MARConfig, sample_tokens, truncated_normal_mask_ratio

FIXTURES = Path(__file__).parents[1] / "fixtures"
DL_META = json.loads((FIXTURES / "mar_diffloss_reference.json").read_text())
DL_REF = load_file(str(FIXTURES / "mar_diffloss_reference.safetensors"))


def official_diffloss():
    c = DL_META["config"]
    model = DiffLoss(c["target_channels"], c["z_channels"], c["depth"], c["width"], c["num_sampling_steps"]).eval()
    state = {k[len("state."):]: v for k, v in DL_REF.items() if k.startswith("state.")}
    model.load_state_dict(state, strict=True)
    return model


def test_respacing_is_official():
    for spec, kept in DL_META["respacing"].items():
        assert space_timesteps(1000, spec) == kept, spec
    model = official_diffloss()
    assert model.gen_diffusion.timestep_map == DL_META["gen_timestep_map"]
    assert model.gen_diffusion.timestep_map[-2:] == [989, 999]
    torch.testing.assert_close(model.gen_diffusion.betas[:5], torch.tensor(DL_META["gen_betas_head"], dtype=torch.float64))
    torch.testing.assert_close(model.gen_diffusion.betas[-5:], torch.tensor(DL_META["gen_betas_tail"], dtype=torch.float64))


@pytest.mark.parametrize("case", DL_META["cases"], ids=lambda c: c["name"])
def test_sample_replays_official_noise(case):
    model, n = official_diffloss(), DL_META["config"]["n"]
    z = DL_REF["z"] if case["cfg"] != 1.0 else DL_REF["z"][:n]
    out = model.sample(z, temperature=case["temperature"], cfg=case["cfg"], noise=DL_REF["noise"])
    assert out.x.shape == (n, DL_META["config"]["target_channels"])
    ref = DL_REF[case["name"]]
    # random weights are no denoiser: x0 = x_t / sqrt(abar) explodes at t = 999, so |x| ~ 1e5 and
    # float rounding (which depends on the thread count) is amplified; the agreement is measured
    # relative to max(1, |x|): about 5e-6 with 2 threads, 2.3e-5 with 1
    assert ((out.x - ref).abs() / ref.abs().clamp(min=1)).max() < 1e-4
    # the final step (t = 0) adds no noise: x is its mean, std 0
    assert torch.equal(out.x, out.mean) and not out.std.any() and (out.last_std > 0).all()
    assert out.noise is DL_REF["noise"]


def test_clip_denoised_bounds_the_predicted_x0():
    """The official head blows up (|x| ~ 1e5) unclipped; with the predicted x0 clipped to
    [-c, c] every posterior mean is a convex mix of x0 and x_t, so tokens stay near [-c, c]."""
    model, n = official_diffloss(), DL_META["config"]["n"]
    z = DL_REF["z"][:n]
    free = model.sample(z, noise=DL_REF["noise"])
    model.clip_denoised = 2.0
    clipped = model.sample(z, noise=DL_REF["noise"])
    assert free.x.abs().max() > 1e3 and clipped.x.abs().max() < 4.0
    assert MARConfig().clip_denoised is None  # the official sampler never clips


def test_sample_draws_from_the_generator_only():
    model, n = official_diffloss(), DL_META["config"]["n"]
    z = DL_REF["z"]
    torch.manual_seed(0)
    a = model.sample(z, cfg=2.0, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    b = model.sample(z, cfg=2.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.x, b.x) and a.noise.shape == (101, n, 4)
    c = model.sample(z, cfg=2.0, noise=a.noise)
    assert torch.equal(a.x, c.x)
    with pytest.raises(ValueError):
        model.sample(z, noise=a.noise)  # cfg 1: 2n rows, table has n


def test_training_loss_is_official():
    model = official_diffloss()
    args = DL_REF["train_target"], DL_REF["train_z"], DL_REF["train_t"], DL_REF["train_noise"]
    rows = model.training_losses(*args)
    assert (rows - DL_REF["train_loss_rows"]).abs().max() < 1e-5
    loss = model(args[0], args[1], mask=DL_REF["train_mask"], t=args[2], noise=args[3])
    assert (loss - DL_REF["train_loss_masked"][0]).abs() < 1e-5


# --------------------------------------------------------------------------------------------
# MAR transformer
# --------------------------------------------------------------------------------------------

LAYOUT = json.loads((FIXTURES / "mar_official_layout.json").read_text())
TINY_META = json.loads((FIXTURES / "mar_tiny_reference.json").read_text())
TINY_REF = load_file(str(FIXTURES / "mar_tiny_reference.safetensors"))
PUBLISHED_M = {"mar_base": 208, "mar_large": 479, "mar_huge": 943}  # README, rounded up


def layout_hash(state_dict):
    lines = sorted(f"{k}:{list(v.shape)}:{str(v.dtype).replace('torch.', '')}" for k, v in state_dict.items())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(MAR_PRESETS))
def test_preset_layout_and_parameter_count_are_official(name):
    with torch.device("meta"):
        model = MAR(MARConfig.from_preset(name))
    sd = model.state_dict()
    assert len(sd) == LAYOUT["num_keys"][name]
    assert layout_hash(sd) == LAYOUT["sha256"][name]
    if name in LAYOUT["layout"]:
        assert [(k, list(v.shape)) for k, v in sd.items()] == list(LAYOUT["layout"][name].items())
    count = sum(p.numel() for p in model.parameters())
    assert count == LAYOUT["param_counts"][name]
    assert math.ceil(count / 1e6) == PUBLISHED_M[name]


def test_config_round_trips_and_rejects_unknown():
    config = MARConfig.from_preset("mar_huge", class_num=10)
    assert (config.seq_len, config.token_embed_dim, config.diffloss_w) == (256, 16, 1536)
    assert MARConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ValueError):
        MARConfig.from_dict({"depth": 2})
    with pytest.raises(ValueError):
        MARConfig.from_preset("mar_tiny")


def tiny_model(**overrides):
    model = MAR(MARConfig(**{**TINY_META["config"], **overrides})).eval()
    model.load_state_dict({k[6:]: v for k, v in TINY_REF.items() if k.startswith("state.")}, strict=True)
    return model


def test_patchify_and_z_are_official():
    model = tiny_model()
    assert torch.equal(model.patchify(TINY_REF["latent"]), TINY_REF["patches"])
    assert torch.equal(model.unpatchify(TINY_REF["patches"]), TINY_REF["latent"])
    with torch.no_grad():
        z = model.compute_z(TINY_REF["tokens"], TINY_REF["mask"], TINY_REF["labels"])
    assert (z - TINY_REF["z"]).abs().max() < 1e-5


def test_training_loss_uses_only_the_generator():
    model = tiny_model(attn_dropout=0.0, proj_dropout=0.0).train()  # nn.Dropout has no generator
    latent = TINY_REF["latent"]
    labels = torch.tensor([1, 2])
    torch.manual_seed(0)
    a = model(latent, labels, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    b = model(latent, labels, generator=torch.Generator().manual_seed(5))
    assert torch.isfinite(a) and torch.equal(a, b)
    a.backward()
    assert model.diffloss.net.input_proj.weight.grad is not None


def test_truncated_normal_mask_ratio_range():
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([truncated_normal_mask_ratio(0.7, g) for _ in range(2000)])
    assert draws.min() >= 0.7 and draws.max() <= 1.0
    assert abs(draws.mean().item() - 0.8670) < 0.01  # scipy truncnorm(-1.2, 0, loc=1, scale=0.25).mean()


@pytest.mark.parametrize("case", TINY_META["sample_cases"], ids=lambda c: c["name"])
def test_sample_tokens_replays_official(case):
    model = tiny_model()
    noise = TINY_REF[f"{case['name']}.noise"]
    starts = [0] + list(itertools.accumulate(case["rows_per_step"]))

    def head_noise(step, rows):
        assert rows == case["rows_per_step"][step]
        return noise[:, starts[step]:starts[step + 1]]

    out = sample_tokens(model, torch.tensor([3, 7]), num_iter=case["num_iter"], cfg=case["cfg"],
                        cfg_schedule=case["cfg_schedule"], temperature=case["temperature"],
                        orders=TINY_REF[f"{case['name']}.orders"], head_noise=head_noise)
    ref = TINY_REF[f"{case['name']}.out"]
    assert ((out - ref).abs() / ref.abs().clamp(min=1)).max() < 1e-4  # see test_sample_replays_official_noise


@torch.no_grad()
def test_rows_with_different_known_counts_equal_running_each_row_alone():
    """A batch of canvases at different steps (continuous speculative decoding's verification)
    runs in one forward: known tokens packed and padded, padding masked as attention keys."""
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    L = model.seq_len
    tokens = torch.randn(4, L, model.config.token_embed_dim, generator=g)
    mask = torch.ones(4, L)
    for row, count in enumerate((3, 7, 7, 12)):
        mask[row, torch.randperm(L, generator=g)[:count]] = 0
    labels = torch.tensor([1, 2, model.config.class_num, 4])
    z = model.compute_z(tokens, mask, labels)
    alone = torch.cat([model.compute_z(tokens[i : i + 1], mask[i : i + 1], labels[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(z, alone, rtol=1e-5, atol=1e-5)
