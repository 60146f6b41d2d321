"""Block-diffusion video on the device (diffusers' Wan transformer): the cached decode equals the
recomputing reference, caching at threshold 0 changes nothing, a seed reproduces a video; the
denoiser trainer runs there on the CPU's randomness."""

from __future__ import annotations

import pytest
import torch

from mmgen.decoding import BlockDenoising
from mmgen.sampling import make_generator

from tests.device.parity import DTYPES

pytestmark = pytest.mark.device

PROMPT = "cat face moving left"


def test_cached_decode_equals_the_recomputing_reference_in_float64(device):
    """`RecomputingWanModel` re-feeds every committed frame; the cached model reads them from
    its K/V cache: the same decoder and noise give the same latents (float64: to rounding)."""
    from mmgen.video.model import PromptEmbeddings, RecomputingWanModel, WanBlockModel
    from tests.video.tiny import tiny_transformer

    transformer = tiny_transformer().double().to(device)
    g = make_generator(0, "cpu")
    text = PromptEmbeddings(torch.randn(2, 5, 16, dtype=torch.float64, generator=g).to(device),
                            torch.zeros(2, 5, 16, dtype=torch.float64, device=device))
    outs = []
    for model in (WanBlockModel(transformer, 2, (4, 4)), RecomputingWanModel(transformer, 2, (4, 4))):
        out = BlockDenoising().generate(model, text, 3, make_generator(0, device), guidance_scale=2.0)
        outs.append(torch.cat(out.latents, 2))
    assert outs[0].device.type == device.type and (outs[0] - outs[1]).abs().max() < 1e-10


@pytest.mark.parametrize("dtype", DTYPES)
def test_video_is_seeded_and_first_block_cache_at_zero_changes_nothing(device, dtype):
    from tests.video.tiny import tiny_video_pipeline

    pipe = tiny_video_pipeline().to(device, dtype)
    out = pipe(PROMPT, generator=make_generator(0, device))
    assert out.frames.shape == (1, 13, 32, 32, 3) and torch.isfinite(out.latents).all()
    assert torch.equal(pipe(PROMPT, generator=make_generator(0, device)).frames, out.frames)
    assert torch.equal(pipe(PROMPT, cache_threshold=0.0, generator=make_generator(0, device)).latents, out.latents)


def test_denoiser_training_runs_on_the_device_with_the_cpus_randomness(device, tmp_path):
    """`train_video target --device`: the same clips, noise levels and noise as on the CPU (drawn
    there, then moved), so the first step's loss agrees up to the device's arithmetic (bf16
    autocast on CUDA); the text encoder freezes and saves from the device."""
    import json

    from training.train_video import main
    from tests.video.test_train_video import fake_latents

    fake_latents(tmp_path / "latents.npz", channels=4)
    common = ["target", "--latents", str(tmp_path / "latents.npz"), "--batch-size", "2", "--warmup", "1", "--log-every", "1",
              "--threads", "1", "--text-steps", "1", "--steps", "2"]
    losses = []
    for run, where in enumerate(("cpu", str(device))):
        out = tmp_path / f"run{run}"
        main([*common, "--device", where, "--out", str(out)])
        losses.append([json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()])
        assert (out / "text_encoder" / "config.json").exists()
    (first_cpu, _), (first_device, _) = losses
    assert abs(first_device - first_cpu) <= (0.0 if device.type == "cpu" else 0.05 * first_cpu)
    assert all(torch.isfinite(torch.tensor(losses[1])))
