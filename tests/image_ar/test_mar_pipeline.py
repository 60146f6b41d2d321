"""MARPipeline on tiny random models: generation, CSpD through the pipeline, official loading."""

import pytest
import torch

from mmgen.decoding import ContinuousSpeculative
from mmgen.hub import CheckpointError
from mmgen.image_ar.mar import KLVAE, KLVAEConfig
from mmgen.image_ar.mar.pipeline import MARPipeline

from tests.image_ar.test_mar_model import tiny_model


def tiny_vae(seed=0) -> KLVAE:
    torch.manual_seed(seed)
    return KLVAE(KLVAEConfig(embed_dim=4, z_channels=4, ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1, resolution=32,
                             encoder_attn_resolutions=(), decoder_attn_resolutions=())).eval()


@pytest.fixture(scope="module")
def pipe():
    return MARPipeline(tiny_model(), tiny_vae(), class_names=[f"c{i}" for i in range(10)],
                       sampling_defaults={"num_iter": 4, "guidance_scale": 2.0})


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_generates_images_deterministically(pipe):
    out = pipe([1, 2], generator=gen(), output_type="pt")
    assert out.images.shape == (2, 3, 32, 32) and out.tokens.shape == (2, 16, 4)
    assert torch.equal(out.tokens, pipe([1, 2], generator=gen(), output_type="pt").tokens)
    assert not torch.equal(out.tokens, pipe([1, 2], generator=gen(1), output_type="pt").tokens)
    assert out.stats.forwards == 4 and len(pipe(3, generator=gen()).images) == 1
    assert pipe([1], num_iter=3, generator=gen()).stats.forwards == 3


def test_cspd_through_the_pipeline(pipe):
    from tests.image_ar.test_mar_continuous import bounded_model

    bounded = MARPipeline(bounded_model(), pipe.vae)
    out = bounded([1, 2], decoding=ContinuousSpeculative(drafter=bounded, num_steps=6, num_draft=2), generator=gen(), output_type="pt")
    assert out.stats.accepted_drafts == out.stats.drafted > 0  # the model drafting for itself
    with pytest.raises(ValueError, match="drafter"):
        pipe([1], decoding="cspd", generator=gen())


def test_save_load_and_bad_inputs(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "mar")
    loaded = MARPipeline.from_pretrained(tmp_path / "mar")
    assert loaded.sampling_defaults["num_iter"] == 4 and loaded.class_names == pipe.class_names
    assert torch.equal(loaded([3], generator=gen(), output_type="pt").tokens, pipe([3], generator=gen(), output_type="pt").tokens)
    with pytest.raises(ValueError, match="invalid class id"):
        pipe([10])
    with pytest.raises(ValueError, match="cfg_schedule"):
        pipe([1], cfg_schedule="cosine")
    with pytest.raises(ValueError, match="guidance_scale"):
        pipe([1], guidance_scale=0.5)
    with pytest.raises(ValueError, match="latents"):
        MARPipeline(tiny_model(), KLVAE(KLVAEConfig(embed_dim=8, z_channels=8, ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1,
                                                     resolution=32, encoder_attn_resolutions=(), decoder_attn_resolutions=())))


def test_from_official_reads_the_ema_weights_strictly(pipe, tmp_path):
    mar_state = pipe.transformer.state_dict()
    noisy = {k: v + 1.0 for k, v in mar_state.items()}
    torch.save({"model": noisy, "model_ema": mar_state, "epoch": 799}, tmp_path / "checkpoint-last.pth")
    torch.save({"model": {**pipe.vae.state_dict(), "loss.logvar": torch.zeros(())}}, tmp_path / "kl16.ckpt")
    loaded = MARPipeline.from_official(tmp_path / "checkpoint-last.pth", tmp_path / "kl16.ckpt", model=pipe.transformer.config,
                                       vae=pipe.vae.config)
    for k, v in loaded.transformer.state_dict().items():
        assert torch.equal(v, mar_state[k]), k
    torch.save({"model_ema": {k: v for k, v in mar_state.items() if k != "mask_token"}}, tmp_path / "broken.pth")
    with pytest.raises(CheckpointError, match="mask_token"):
        MARPipeline.from_official(tmp_path / "broken.pth", tmp_path / "kl16.ckpt", model=pipe.transformer.config, vae=pipe.vae.config)
