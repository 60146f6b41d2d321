"""MAR's KL-16 VAE against facts produced by the official code (LTH14/mar `models/vae.py`, float32
CPU). The fixture and its JSON description were written by gen_vae_reference.py, which ran the
official modules and no longer exists; /work/compare/mar/check_vae_reference.py (outside the
repository) re-runs the official `models/vae.py` of LTH14/mar at commit
fe470ac24afbee924668d8c5c83e9fec60af3a73 on the stored weights and inputs. On an AMD EPYC (AVX2,
MKL) it differs from the stored outputs by up to 7.4e-6 (mean, |mean| <= 4.2) and 8.3e-6 (sample,
|sample| <= 8.2): the fixture was made with other float32 kernels, and the encoder is
well-conditioned (~2e-6 of the values' scale). No official code is imported here.

- layouts: the official `AutoencoderKL(embed_dim=16, ch_mult=(1,1,2,2,4))` (key -> shape, in
  order, and parameter count), and its use_variational=False variant.
- tiny: an official AutoencoderKL with a small Encoder/Decoder (float8-valued weights) with
  attention in an encoder level and a decoder level; its posterior, a seeded sample, decodes,
  and a DiagonalGaussianDistribution on extreme moments.
"""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmgen.hub import CheckpointError, load_strict, save_safetensors
from mmgen.image_ar.mar.vae import MAR_LATENT_SCALE, OFFICIAL_IGNORED_KEYS, DiagonalGaussian, KLVAE, KLVAEConfig

FIXTURES = Path(__file__).parents[1] / "fixtures"
META = json.loads((FIXTURES / "mar_vae_reference.json").read_text())
# Tolerance of the encoder/decoder outputs, relative to max(1, max |reference|) (`scaled_diff`).
# Error source: float32 convolutions, group norms and attention summed in other orders (oneDNN/MKL
# kernels, thread count, CPU, and ours vs the official op order). Measured: <= 1.8e-6 (encode,
# 7.6e-6 on |mean| <= 4.2) and <= 8e-7 (decode) under OMP_NUM_THREADS=1/2/4,
# ATEN_CPU_CAPABILITY=default/avx2, MKL_ENABLE_INSTRUCTIONS=SSE4_2 and MKL_CBWR=COMPATIBLE; the
# official code on this machine is itself 1.8e-6 away from the stored outputs. 2e-5 leaves > 10x.
TOL = 2e-5


def layout(module):
    return {k: list(v.shape) for k, v in module.state_dict().items()}


def layout_sha(lay):
    return hashlib.sha256("\n".join(sorted(f"{k}:{v}" for k, v in lay.items())).encode()).hexdigest()


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def scaled_diff(ours, ref):
    """max |ours - ref| relative to max(1, max |ref|): float32 rounding scales with the values."""
    return max_diff(ours, ref) / max(1.0, ref.float().abs().max().item())


# --------------------------------------------------------------------------------------------
# 1. Official parameter layouts
# --------------------------------------------------------------------------------------------


def test_kl16_layout_and_parameter_count_are_official():
    ref = META["layouts"]["kl16"]
    with torch.device("meta"):
        ours = KLVAE(KLVAEConfig())
    lay = layout(ours)
    assert sorted(set(ref["layout"]) - set(lay)) == [] and sorted(set(lay) - set(ref["layout"])) == []
    assert list(lay.items()) == list(ref["layout"].items())  # shapes, and the official key order
    assert (len(lay), layout_sha(lay)) == (ref["num_keys"], ref["sha256"])
    assert sum(p.numel() for p in ours.parameters()) == ref["num_parameters"]
    # the official encoder attends in its 16x16 level only; the decoder's levels never attend
    assert any(k.startswith("encoder.down.4.attn.1.q.") for k in lay)
    assert not any(".attn." in k for k in lay if k.startswith(("encoder.down.3.", "decoder.up.")))


def test_not_variational_layout_is_official():
    ref = META["layouts"]["kl16_not_variational"]
    with torch.device("meta"):
        ours = KLVAE(KLVAEConfig(**ref["ours_config"]))
    lay = layout(ours)
    assert (len(lay), layout_sha(lay)) == (ref["num_keys"], ref["sha256"])
    assert sum(p.numel() for p in ours.parameters()) == ref["num_parameters"]


def test_config_defaults_and_round_trip():
    c = KLVAEConfig()
    assert (c.embed_dim, c.z_channels, c.ch, c.ch_mult, c.num_res_blocks, c.resolution, c.double_z) == (
        16, 16, 128, (1, 1, 2, 2, 4), 2, 256, True)
    assert (c.downsample, c.latent_size, MAR_LATENT_SCALE) == (16, 16, 0.2325)
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d and KLVAEConfig.from_dict(d) == c


def test_checkpoint_nested_under_model_with_loss_keys_loads_strictly(tmp_path):
    """kl16.ckpt is {"model": state dict}; `loss.*` (LDM training loss) keys are ignored, any
    other mismatch is an error."""
    c = KLVAEConfig(**META["tiny"]["ours_config"])
    source = KLVAE(c)
    sd = dict(source.state_dict())
    torch.save({"model": {**sd, "loss.logvar": torch.zeros(()), "loss.discriminator.main.0.weight": torch.zeros(2)}},
               tmp_path / "kl.ckpt")
    loaded = KLVAE.from_official(tmp_path / "kl.ckpt", config=c)
    assert not loaded.training
    assert all(torch.equal(v, sd[k]) for k, v in loaded.state_dict().items())
    save_safetensors(sd, tmp_path / "kl.safetensors")
    KLVAE.from_official(tmp_path / "kl.safetensors", config=c)
    with pytest.raises(CheckpointError, match="unexpected keys"):
        load_strict(KLVAE(c), {**sd, "extra.weight": torch.zeros(1)}, ignore=OFFICIAL_IGNORED_KEYS)


# --------------------------------------------------------------------------------------------
# 2. Tiny model numerics
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    t = load_file(str(FIXTURES / "mar_vae_reference.safetensors"))
    t = {k: v.float() for k, v in t.items()}
    model = KLVAE(KLVAEConfig(**META["tiny"]["ours_config"])).eval()
    load_strict(model, {k[4:]: v for k, v in t.items() if k.startswith("vae.")})
    return model, t


def test_tiny_model_attends_where_the_official_does(reference):
    model, _ = reference
    keys = model.state_dict()
    assert sorted(k for k in keys if k.startswith("encoder.down.") and ".attn." in k) == META["tiny"]["encoder_attn_keys"]
    assert sorted(k for k in keys if k.startswith("decoder.up.") and ".attn." in k) == META["tiny"]["decoder_attn_keys"]


def test_encode_matches_official(reference):
    model, t = reference
    with torch.no_grad():
        post = model.encode(t["input.images"])
    assert post.mean.shape == (2, 4, 8, 8)
    assert scaled_diff(post.mean, t["output.mean"]) < TOL
    assert scaled_diff(post.logvar, t["output.logvar"]) < TOL
    assert scaled_diff(post.std, t["output.std"]) < TOL
    assert torch.equal(post.mode(), post.mean)


def test_decode_matches_official(reference):
    model, t = reference
    with torch.no_grad():
        images = model.decode(t["input.latents"])
        of_sample = model.decode(t["output.sample"])
    assert images.shape == (2, 3, 16, 16)
    assert scaled_diff(images, t["output.decoded"]) < TOL
    assert scaled_diff(of_sample, t["output.decoded_of_sample"]) < TOL


def test_gaussian_clamps_logvar_and_kl_as_official(reference):
    _, t = reference
    dist = DiagonalGaussian(t["input.extreme_moments"])
    assert (dist.logvar.min().item(), dist.logvar.max().item()) == (-30.0, 20.0)
    assert torch.equal(dist.logvar, t["output.extreme.logvar"])  # a clamp of stored values: exact
    # exp is vectorised (SLEEF, <= 1 ulp) or scalar (libm) depending on ATEN_CPU_CAPABILITY: the
    # two may differ by 2 ulp (2.4e-7); rtol 1e-6 allows 8 ulp. Measured: 0 in every setting.
    assert torch.allclose(dist.std, t["output.extreme.std"], rtol=1e-6, atol=0)
    # sums of 27 terms up to exp(20): reduction order and exp's last bits; measured 0, rtol 1e-5
    assert torch.allclose(dist.kl(), t["output.extreme.kl"], rtol=1e-5)
    assert torch.allclose(dist.kl(DiagonalGaussian(t["input.other_moments"])), t["output.extreme.kl_other"], rtol=1e-5)


# --------------------------------------------------------------------------------------------
# 3. Sampling
# --------------------------------------------------------------------------------------------


def test_sample_equals_official_seeded_sample(reference):
    """The official `sample()` draws torch.randn on the CPU default generator; the same seed on
    an explicit CPU generator gives the same sample."""
    model, t = reference
    seed = META["tiny"]["sample_seed"]
    official_posterior = DiagonalGaussian(torch.cat([t["output.mean"], t["output.logvar"]], dim=1))
    # Same noise (torch.randn is bit-exact for a seed), but mean + exp(logvar / 2) * eps goes
    # through exp, whose vectorised (SLEEF) and scalar kernels may differ by 2 ulp of std; with
    # |std * eps| and |sample| <= 8.2 that is <= ~4e-6. Measured: 0 with AVX2 kernels, 3.0e-6 with
    # ATEN_CPU_CAPABILITY=default; 2e-6 of max(1, max |sample|) = 1.6e-5 leaves > 5x.
    assert scaled_diff(official_posterior.sample(torch.Generator().manual_seed(seed)), t["output.sample"]) < 2e-6
    with torch.no_grad():
        post = model.encode(t["input.images"])
    sample = post.sample(torch.Generator().manual_seed(seed))
    # our encoder's float32 differences (see TOL) carried by mean + std * eps (|eps| <= ~3):
    # measured <= 1.4e-5 on |sample| <= 8.2 (1.7e-6 scaled); TOL leaves > 10x
    assert scaled_diff(sample, t["output.sample"]) < TOL


def test_sample_is_reproducible_and_uses_only_the_given_generator(reference):
    model, t = reference
    with torch.no_grad():
        post = model.encode(t["input.images"])
    global_state = torch.get_rng_state()
    a = post.sample(torch.Generator().manual_seed(7))
    b = post.sample(torch.Generator().manual_seed(7))
    c = post.sample(torch.Generator().manual_seed(8))
    assert torch.equal(torch.get_rng_state(), global_state)  # the global generator is untouched
    assert torch.equal(a, b) and not torch.equal(a, c)
    gen = torch.Generator().manual_seed(7)
    first, second = post.sample(gen), post.sample(gen)  # the generator advances
    assert torch.equal(first, a) and not torch.equal(second, a)
    noise = (a - post.mean) / post.std
    assert torch.allclose(noise, torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(7)), atol=1e-4)


def test_bfloat16_model_runs(reference):
    model, t = reference
    bf16 = KLVAE(model.config).eval()
    bf16.load_state_dict(model.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    with torch.no_grad():
        post = bf16.encode(t["input.images"].bfloat16())
        z = post.sample(torch.Generator().manual_seed(0))
        images = bf16.decode(z)
    assert z.dtype == images.dtype == torch.bfloat16
    assert max_diff(post.mean, t["output.mean"]) < 0.2 * t["output.mean"].abs().max().item()
