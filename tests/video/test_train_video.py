"""The video trainer (`training/train_video.py`): its teacher-forced forward is the cached block
decode (float64), its prompt encoding is the pipeline's, and a killed and resumed run ends with the
weights of one that never stopped (VAE, target with its text-encoder freeze, small); runs log
held-out figures as they go (the VAE's PSNR, the proxies of a denoiser's clips) without changing
what they train."""

import json

import numpy as np
import pytest
import torch

from training.train_video import (MAX_TEXT, PromptEncoder, main, new_text_encoder, new_tokenizer, teacher_forcing_mask,
                                    teacher_forcing_velocity)
from mmgen.video.model import PromptEmbeddings, WanBlockModel
from tests.video.tiny import tiny_transformer, tiny_vae


@pytest.mark.parametrize("block", [1, 2])
def test_teacher_forcing_equals_the_cached_block_decode_in_float64(block):
    """Each noisy block's velocity from the one-forward training sequence equals `WanBlockModel`'s
    velocity for that block after committing the clean blocks before it."""
    torch.manual_seed(0)
    transformer = tiny_transformer().double()
    frames = 4
    text = torch.randn(2, 5, 16, dtype=torch.float64)
    clean = torch.randn(2, 4, frames, 4, 4, dtype=torch.float64)
    noisy = torch.randn(2, 4, frames, 4, 4, dtype=torch.float64)
    sigmas = torch.rand(2, frames // block, dtype=torch.float64)
    with torch.no_grad():
        trained = teacher_forcing_velocity(transformer, clean, noisy, sigmas, text, block)
        for b in range(frames // block):
            for row in range(2):  # the cached decode takes one timestep per call: one row at a time
                model = WanBlockModel(transformer, block, (4, 4))
                state = model.start(PromptEmbeddings(text[row:row + 1]), frames // block, guidance=False)
                try:
                    for c in range(b):
                        model.commit(state, clean[row:row + 1, :, c * block:(c + 1) * block])
                    cached = model.velocity(state, noisy[row:row + 1, :, b * block:(b + 1) * block], 1000.0 * float(sigmas[row, b]))[0]
                finally:
                    model.finish(state)
                assert (cached - trained[row:row + 1, :, b * block:(b + 1) * block]).abs().max() < 1e-12
    assert all(type(blk.attn1.processor).__name__ == "WanAttnProcessor" for blk in transformer.blocks)
    # A first block denoised alone (`--first-frames`' extra samples) is the whole sequence's first block.
    with torch.no_grad():
        alone = teacher_forcing_velocity(transformer, clean[:, :, :block], noisy[:, :, :block], sigmas[:, :1], text, block)
    assert (alone - trained[:, :, :block]).abs().max() < 1e-12
    # frame-level: clean 0, 1, 2 then noisy 0 … 3 (block 1): a noisy frame sees the clean frames before it and itself
    mask = teacher_forcing_mask(4, 1, 1).int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0],
                    [0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0, 1]]


def test_prompt_encoding_is_the_pipelines():
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline

    tokenizer, text_encoder = new_tokenizer(), new_text_encoder().eval()
    pipe = BlockDiffusionVideoPipeline(tiny_transformer(), tiny_vae(), text_encoder, tokenizer, max_sequence_length=MAX_TEXT)
    prompts = ["grinning face moving left and sun moving right", "", "snake bouncing vertically"]
    with torch.no_grad():
        assert torch.equal(PromptEncoder(tokenizer, text_encoder)(prompts), pipe.encode_prompt(prompts))
    ids = tokenizer(prompts)["input_ids"]
    assert ids[1] == [1] and ids[2][-1] == 1 and 2 not in sum(ids, [])  # </s> ends each; no unknown words


def fake_latents(path, n=12, channels=8):
    """A latents file as `latents` writes it: [N, channels, 3, 4, 4] (4 tokens per latent frame)."""
    rng = np.random.default_rng(0)
    captions = [["red heart moving left", "sun bouncing vertically", "snake moving up and airplane moving down"][i % 3] for i in range(n)]
    np.savez(path, latents=rng.standard_normal((n, channels, 3, 4, 4)).astype(np.float16), captions=np.array(captions), indices=np.arange(n))


def straight_and_resumed(tmp_path, common, steps, stops, resumed_options=()):
    """Run `common` for `steps` steps at once, and again stopped after each of `stops` (as a
    kill after a checkpoint would) and resumed, with `resumed_options` added; both checkpoints."""
    main([*common, "--out", str(tmp_path / "straight"), "--steps", str(steps)])
    resumed = [*common, *resumed_options, "--out", str(tmp_path / "resumed"), "--steps", str(steps)]
    for stop in stops:
        main([*resumed, "--run-steps", str(stop)])
    main(resumed)
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["step"] == resumed["step"] == steps
    for key, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    return straight


def test_resumed_transformer_training_equals_an_uninterrupted_run(tmp_path):
    path = tmp_path / "latents.npz"
    fake_latents(path, channels=4)  # the denoisers take the latents' channels
    common = ["--latents", str(path), "--batch-size", "4", "--warmup", "2", "--log-every", "1", "--threads", "1",
              "--text-dropout", "0.5"]
    # The text encoder trains for 2 steps, then is rounded to float16, frozen and saved; a run
    # stopped at step 1 and at step 3 (either side of the freeze) ends as one that never stopped,
    # its weight average included, and the average holds the frozen text encoder exactly.
    target = straight_and_resumed(tmp_path / "target", ["target", *common, "--text-steps", "2", "--ema", "0.9"], 4, [1, 2])
    frozen = {k[len("text_encoder."):]: v for k, v in target["model"].items() if k.startswith("text_encoder.")}
    for run in ("straight", "resumed"):
        saved = torch.load(tmp_path / "target" / run / "checkpoint.pt", weights_only=True)
        assert all(torch.equal(v, target["ema"]["weights"][k]) for k, v in saved["ema"]["weights"].items())
        assert all(torch.equal(saved["ema"]["weights"][f"text_encoder.{k}"], v) for k, v in frozen.items())
        from transformers import UMT5EncoderModel

        snapshot = UMT5EncoderModel.from_pretrained(str(tmp_path / "target" / run / "text_encoder")).state_dict()
        assert all(torch.equal(snapshot[k], v) for k, v in frozen.items())
        assert all(torch.equal(v, v.half().float()) for v in frozen.values())
        assert saved["step"] == 4
    logs = [json.loads(line) for line in (tmp_path / "target" / "straight" / "log.jsonl").read_text().splitlines()]
    assert logs[0] == {"step": 0, "weight_average": {"decay": 0.9}}  # where the average started
    logs = [r for r in logs if "loss" in r]
    assert [r["text"] for r in logs] == ["trained", "trained", "frozen", "frozen"] and all(np.isfinite(r["loss"]) for r in logs)
    # With first blocks of more clips beside each batch (`--first-frames`: more draws per step).
    small = ["small", *common, "--text-encoder", str(tmp_path / "target" / "straight" / "text_encoder"), "--first-frames", "3"]
    state = straight_and_resumed(tmp_path / "small", small, 3, [2])
    assert not any(k.startswith("text_encoder.") for k in state["model"])
    assert state["model"]["transformer.patch_embedding.weight"].shape[1] == 4


def test_resumed_vae_training_equals_an_uninterrupted_run(tmp_path):
    common = ["vae", "--batch-size", "1", "--frames", "5", "--crop", "16", "--full-steps", "0", "--warmup", "1",
              "--log-every", "1", "--threads", "1", "--stats-clips", "2", "--eval-clips", "1",
              "--base-dim", "8", "--z-dim", "4", "--eval-every", "2", "--heldout-clips", "1", "--foreground-weight", "4",
              "--gradient-weight", "1"]
    # Resumed with clips drawn ahead in two worker processes: the same clips, so the same weights.
    straight_and_resumed(tmp_path, common, 3, [1], resumed_options=["--workers", "2"])
    config = json.loads((tmp_path / "straight" / "vae" / "config.json").read_text())
    assert config["z_dim"] == 4 and config["base_dim"] == 8
    assert len(config["latents_std"]) == 4 and all(s > 0 for s in config["latents_std"])
    # The held-out PSNR is logged as it goes (every 2 steps and at the end); best.pt keeps the best.
    for run in ("straight", "resumed"):
        records = [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
        heldout = [r for r in records if "heldout" in r]
        assert [r["step"] for r in heldout] == [2, 3] and all(np.isfinite(r["heldout"]["psnr_db"]) for r in heldout)
        best = json.loads((tmp_path / run / "best.json").read_text())
        assert best["score"] == max(r["heldout"]["score"] for r in heldout)
    assert json.loads((tmp_path / "resumed" / "eval.json").read_text()) == json.loads((tmp_path / "straight" / "eval.json").read_text())
    # A denoiser trained on that VAE's latents logs the proxies of clips it makes as it goes, and
    # the evaluation changes nothing the training computes.
    main(["latents", "--vae", str(tmp_path / "straight"), "--out", str(tmp_path / "latents.npz"), "--clips", "4", "--threads", "1"])
    target = ["target", "--latents", str(tmp_path / "latents.npz"), "--batch-size", "2", "--warmup", "1", "--log-every", "1",
              "--threads", "1", "--text-steps", "1", "--steps", "2"]
    main([*target, "--out", str(tmp_path / "plain")])
    main([*target, "--out", str(tmp_path / "evaluated"), "--eval-every", "2", "--vae", str(tmp_path / "straight"),
          "--eval-clips", "2", "--reference-clips", "8"])
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(v, load("evaluated")[k]) for k, v in load("plain").items())
    records = [json.loads(line) for line in (tmp_path / "evaluated" / "log.jsonl").read_text().splitlines()]
    (figures,) = [r["heldout"] for r in records if "heldout" in r]
    assert 0 <= figures["class_accuracy"] <= 1 and 0 <= figures["direction_accuracy"] <= 1
    assert figures["score"] == (figures["class_accuracy"] + figures["direction_accuracy"]) / 2


def test_foreground_mask_covers_the_sprites_and_not_the_background():
    """`--foreground-weight`'s mask: 1 at every object's centroid in every frame, 0 on most of the
    plain background."""
    from training.train_video import TRAIN_SEED, clips, corpus, foreground_mask

    data = corpus(TRAIN_SEED, length=4)
    mask = foreground_mask(clips(data, torch.arange(4)))
    assert mask.shape == (4, 1, 17, 64, 64) and set(mask.unique().tolist()) <= {0.0, 1.0}
    for i in range(4):
        for track in data[i].tracks:
            for t, (x, y) in enumerate(track):
                assert mask[i, 0, t, int(round(y)), int(round(x))] == 1
        assert mask[i].mean() < 0.4


def test_gradient_difference_is_zero_for_equal_videos_and_penalises_blur():
    from training.train_video import gradient_difference

    video = torch.rand(1, 3, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    blurred = torch.nn.functional.avg_pool3d(video, (1, 3, 3), stride=1, padding=(0, 1, 1), count_include_pad=False)
    assert gradient_difference(video, video) == 0
    assert gradient_difference(blurred, video) > 0.1
    weight = torch.ones(1, 1, 2, 8, 8)
    assert torch.allclose(gradient_difference(blurred, video, weight), gradient_difference(blurred, video))


def test_an_adversarial_branch_lifts_a_plain_run_and_resumes_exactly(tmp_path):
    """`--branch-from` a plain run with `--adversarial-weight`: the VAE starts at the parent's
    weights with a fresh critic beside it, the GAN term starts at `--adversarial-from`, a killed
    and resumed branch (bf16 autocast on the CPU) ends as one that never stopped, and the finished
    VAE loads without the critic."""
    from training.train_video import load_vae_checkpoint

    common = ["vae", "--batch-size", "1", "--frames", "5", "--crop", "16", "--full-steps", "0", "--warmup", "1",
              "--log-every", "1", "--threads", "1", "--stats-clips", "2", "--eval-clips", "1",
              "--base-dim", "8", "--z-dim", "4", "--foreground-weight", "4"]
    main([*common, "--out", str(tmp_path / "plain"), "--steps", "5", "--run-steps", "2"])
    parent = torch.load(tmp_path / "plain" / "checkpoint.pt", weights_only=True)["model"]
    with pytest.raises(SystemExit, match="a plain run's"):  # not resumed as what it is not
        main([*common, "--out", str(tmp_path / "plain"), "--steps", "5", "--adversarial-weight", "0.5"])
    # The branch runs under bf16 autocast on the CPU, which resumes exactly too.
    branch = [*common, "--branch-from", str(tmp_path / "plain"), "--adversarial-weight", "0.5", "--adversarial-from", "3",
              "--autocast", "bf16"]
    state = straight_and_resumed(tmp_path, branch, 5, [1])  # the resumed branch stops at step 3, resumes to 5
    assert any(k.startswith("critic.") for k in state["model"]) and set(parent) == {
        k[len("vae."):] for k in state["model"] if k.startswith("vae.")}
    records = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # the parent's log continues
    assert [("fooled" in r) for r in records] == [False, False, False, True, True]
    assert all(r["balance"] > 0 and np.isfinite(r["critic"]) for r in records[3:])
    vae = load_vae_checkpoint(tmp_path / "straight")
    assert all(torch.equal(v, state["model"][f"vae.{k}"].half().float()) for k, v in vae.state_dict().items())
    assert (tmp_path / "straight" / "vae" / "config.json").exists()


def test_a_decoder_trained_behind_a_frozen_encoder_keeps_its_latents(tmp_path):
    """`--encoder-from RUN --decoder-base-dim N`: a wider decoder trains alone behind RUN's
    finished encoder, so every latent (and the latents' statistics) is RUN's; it resumes exactly,
    and `latents` of the new run are byte-identical to RUN's."""
    from training.train_video import TRAIN_SEED, clips, corpus, latent_foreground, load_vae_run

    common = ["vae", "--batch-size", "1", "--frames", "5", "--crop", "16", "--full-steps", "0", "--warmup", "1",
              "--log-every", "1", "--threads", "1", "--stats-clips", "2", "--eval-clips", "1", "--foreground-weight", "4"]
    main([*common, "--base-dim", "8", "--z-dim", "4", "--out", str(tmp_path / "parent"), "--steps", "2"])
    with pytest.raises(SystemExit, match="not a finished vae run"):
        main([*common, "--encoder-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"), "--steps", "2"])
    child = [*common, "--encoder-from", str(tmp_path / "parent"), "--decoder-base-dim", "12",
             "--adversarial-weight", "0.5", "--adversarial-from", "1"]
    state = straight_and_resumed(tmp_path, child, 3, [1])
    parent, vae = load_vae_run(tmp_path / "parent"), load_vae_run(tmp_path / "straight")
    assert vae.config.decoder_base_dim == 12 and vae.config.base_dim == 8
    assert vae.config.latents_mean == parent.config.latents_mean and vae.config.latents_std == parent.config.latents_std
    theirs, ours = parent.state_dict(), vae.state_dict()
    for key, tensor in ours.items():
        if key.startswith(("encoder.", "quant_conv.")):
            assert torch.equal(tensor, theirs[key]), key
    assert ours["decoder.conv_out.weight"].shape != theirs["decoder.conv_out.weight"].shape
    assert any(k.startswith("critic.") for k in state["model"])
    for run in ("parent", "straight"):
        main(["latents", "--vae", str(tmp_path / run), "--out", str(tmp_path / f"{run}.npz"), "--clips", "2", "--threads", "1"])
    assert (tmp_path / "parent.npz").read_bytes() == (tmp_path / "straight.npz").read_bytes()
    # Two chunks (16 and 2 clips), each clip's latents and caption in its place.
    main(["latents", "--vae", str(tmp_path / "parent"), "--first", "3", "--clips", "18", "--threads", "1",
          "--out", str(tmp_path / "two.npz")])
    written = np.load(tmp_path / "two.npz")
    assert written["latents"].shape[0] == 18 and list(written["indices"]) == list(range(3, 21))
    main(["latents", "--vae", str(tmp_path / "parent"), "--first", "19", "--clips", "2", "--threads", "1",
          "--out", str(tmp_path / "last.npz")])  # the second chunk alone
    last = np.load(tmp_path / "last.npz")
    assert np.array_equal(written["latents"][16:], last["latents"]) and list(written["captions"][16:]) == list(last["captions"])
    assert written["captions"][17] == corpus(TRAIN_SEED)[20].caption
    # the sprites' latent positions ride along, in the same places
    assert written["foreground"].shape == (18, *written["latents"].shape[2:]) and np.array_equal(written["foreground"][16:], last["foreground"])
    assert np.array_equal(written["foreground"][17], latent_foreground(clips(corpus(TRAIN_SEED), torch.tensor([20])), 4)[0].numpy())


def test_the_adversarial_terms_train_each_side_against_the_other():
    """The generator's term moves the reconstruction and not the critic; the critic's hinge term
    moves the critic and not the reconstruction; the balance is VQGAN's gradient-norm ratio."""
    from training.train_video import PatchCritic, adaptive_weight

    torch.manual_seed(0)
    critic, last = PatchCritic(), torch.randn(3, 3, requires_grad=True)
    recon = torch.einsum("dc,bcthw->bdthw", last, torch.randn(2, 3, 2, 16, 16)).tanh()
    real = torch.rand(2, 3, 2, 16, 16) * 2 - 1
    assert critic(recon).shape == (4, 1, 4, 4)
    frozen = {name: w.detach() for name, w in critic.named_parameters()}
    fooled = -torch.func.functional_call(critic, frozen, (recon,)).mean()
    fooled.backward(retain_graph=True)
    assert all(w.grad is None for w in critic.parameters()) and last.grad.abs().sum() > 0
    last.grad = None
    judged = torch.nn.functional.relu(1 - critic(real)).mean() + torch.nn.functional.relu(1 + critic(recon.detach())).mean()
    judged.backward()
    assert last.grad is None and all(w.grad is not None for w in critic.parameters())
    reconstruction = recon.pow(2).mean()
    fooled = -torch.func.functional_call(critic, frozen, (recon,)).mean()
    balance = adaptive_weight(reconstruction, fooled, last)
    assert torch.allclose(adaptive_weight(reconstruction, 10 * fooled, last), balance / 10, rtol=1e-2)  # up to the 1e-4 in the denominator
    assert torch.allclose(adaptive_weight(3 * reconstruction, fooled, last), 3 * balance, rtol=1e-2)


def card_facts(encoder_from: bool) -> dict:
    """What `card` gathers, made up: figures of a decoder-only VAE run or of a whole one."""
    quality = lambda c, d: {"class_accuracy": c, "direction_accuracy": d, "temporal_l1": 0.01, "fid_proxy": 5.0,
                            "class_accuracy_by_sprite": {"red heart": 0.7, "sun": 0.03},
                            "class_accuracy_among_sprites": 2 * c, "class_accuracy_among_sprites_by_frame": [3 * c, 2 * c, c]}
    args = dict(frames=17, crop=32, full_steps=100, foreground_weight=4.0, gradient_weight=0.0, adversarial_weight=0.5,
                adversarial_from=1500, batch_size=8, lr=1e-3, warmup=100, weight_decay=0.05, text_steps=150, shift=3.0,
                base_dim=16, encoder_from="runs/encoder" if encoder_from else None, branch_from=None)
    run = lambda step: {"final": {"step": step, "loss": 0.1}, "args": args}
    runs = {"vae": run(8000), "target": run(8000), "small": run(4000)}
    if encoder_from:
        runs["vae encoder"] = run(9000)
    return {"rows": {"real clips": quality(0.99, 1.0), "real clips through the VAE": quality(0.2, 1.0),
                     "emoji-motion": quality(0.1, 0.8), "emoji-motion-small": quality(0.05, 0.6)},
            "clips": 64, "reference_clips": 256, "steps": 8, "schedule": {"shift": 3.0},
            "vae_eval": {"psnr_db": 26.1, "eval_clips": 64, "stats_clips": 256},
            "vae_config": {"base_dim": 16, "decoder_base_dim": 32 if encoder_from else None, "z_dim": 16, "dim_mult": [1, 2, 2],
                           "scale_factor_spatial": 4, "scale_factor_temporal": 4},
            "latent_shape": "16 x 5 x 16 x 16", "runs": runs, "minutes": {name: 60.0 for name in runs},
            "branched_at": {name: None for name in runs},
            "averaged": {name: {"decay": 0.999, "from_step": 3400} if name == "target" else None for name in runs},
            "params": {"vae": 1_850_000, "vae encoder": 330_000, "text_encoder": 80_000, "target": 1_230_000, "small": 300_000},
            "sizes": {"emoji-motion": 5e6, "emoji-motion-small": 6e5}, "sweep": []}


@pytest.mark.parametrize("encoder_from", [False, True])
def test_the_model_card_states_the_vae_recipe_and_limits_from_the_figures(encoder_from):
    """The card's VAE rows and recipe follow the run (a decoder trained behind another run's
    frozen encoder gets a row for each), and its limits quote the figures, per sprite."""
    from types import SimpleNamespace

    from training.train_video import model_card

    card = model_card(card_facts(encoder_from), SimpleNamespace(training_note="", commands="python -m ..."))
    assert ("| vae encoder | AutoencoderKLWan's encoder, base 16" in card) == encoder_from
    assert ("its decoder, base 32 (trained alone)" in card) == encoder_from
    assert ("frozen since" in card) == encoder_from and ("per-element KL" in card) != encoder_from
    assert "from step 1500 on, VQGAN's hinge GAN term" in card and "weighted 5x" in card
    assert "keep 100% of their motions readable and 20.0% of their objects" in card
    assert "by sprite: red heart 70%, sun 3%" in card and "emoji-motion follows the prompted motion for\n80%" in card
    assert "| emoji-motion | 20.0% | 30.0% → 10.0% | 10.0% | 80.0% | 0.0100 | 5.0 |" in card  # 8-way, its quarters, 74-way
    assert "exponential moving averages of the trained ones (`--ema`): target's from step 3400 (decay 0.999)." in card
    assert "{" not in card.split("## Reproduce")[0]  # no placeholder left unformatted


def test_a_new_run_starts_from_shipped_weights(tmp_path):
    """`--init-from` starts a run from a pipeline folder as it ships (what survives a machine
    that lost its run folders): at learning rate 0 the run's weights stay exactly those."""
    from training.train_video import load_transformer_run

    path = tmp_path / "latents.npz"
    fake_latents(path, channels=4)
    common = ["--latents", str(path), "--batch-size", "4", "--warmup", "2", "--log-every", "1", "--threads", "1", "--steps", "2"]
    main(["target", *common, "--text-steps", "1", "--out", str(tmp_path / "first")])
    transformer, text_encoder = load_transformer_run(tmp_path / "first", with_text_encoder=True)
    shipped = tmp_path / "shipped"
    transformer.to(torch.float16).save_pretrained(shipped / "transformer")
    text_encoder.to(torch.float16).save_pretrained(shipped / "text_encoder")
    with pytest.raises(ValueError, match="--text-steps 0"):
        main(["target", *common, "--init-from", str(shipped), "--out", str(tmp_path / "refused")])
    # export reads a pipeline folder as it reads a run (a continued target beside a shipped small model)
    loaded, loaded_text = load_transformer_run(shipped, with_text_encoder=True)
    assert all(torch.equal(v, transformer.state_dict()[k].half().float()) for k, v in loaded.state_dict().items())
    assert all(torch.equal(v, text_encoder.state_dict()[k].half().float()) for k, v in loaded_text.state_dict().items())
    main(["target", *common, "--init-from", str(shipped), "--text-steps", "0", "--lr", "0", "--out", str(tmp_path / "target")])
    main(["small", *common, "--init-from", str(shipped), "--text-encoder", str(shipped / "text_encoder"), "--lr", "0",
          "--out", str(tmp_path / "small")])
    expected = {**{f"transformer.{k}": v for k, v in transformer.state_dict().items()},
                **{f"text_encoder.{k}": v for k, v in text_encoder.state_dict().items()}}
    for run in ("target", "small"):
        state = torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)
        assert state["step"] == 2 and state["model"].keys() <= expected.keys()
        for key, tensor in state["model"].items():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[key].half().float()), key


def test_a_target_of_another_shape_trains_on_a_frozen_text_encoder(tmp_path):
    """`target --shape wide --text-encoder FOLDER --text-steps 0`: a new target of another shape
    beside the shipped small model, reading the text encoder that model was trained on, frozen
    (saved unchanged to <out>/text_encoder); a text encoder given with --text-steps other than 0
    is refused, and so is a shape with --init-from (the shipped transformer's is taken)."""
    from training.train_video import PRESETS, load_text_encoder, load_transformer_run

    path = tmp_path / "latents.npz"
    fake_latents(path, channels=4)
    common = ["--latents", str(path), "--batch-size", "4", "--warmup", "2", "--log-every", "1", "--threads", "1", "--steps", "2"]
    main(["target", *common, "--text-steps", "1", "--out", str(tmp_path / "first")])
    frozen = tmp_path / "first" / "text_encoder"
    with pytest.raises(ValueError, match="--text-steps 0"):
        main(["target", *common, "--shape", "wide", "--text-encoder", str(frozen), "--out", str(tmp_path / "refused")])
    with pytest.raises(ValueError, match="drop --shape"):
        main(["target", *common, "--shape", "wide", "--text-steps", "0", "--init-from", str(tmp_path / "first"),
              "--out", str(tmp_path / "refused")])
    main(["target", *common, "--shape", "wide", "--text-encoder", str(frozen), "--text-steps", "0", "--out", str(tmp_path / "wide")])
    transformer, text_encoder = load_transformer_run(tmp_path / "wide", with_text_encoder=True)
    assert {k: transformer.config[k] for k in PRESETS["wide"]} == PRESETS["wide"]
    before, saved = load_text_encoder(frozen).state_dict(), load_text_encoder(tmp_path / "wide" / "text_encoder").state_dict()
    assert all(torch.equal(before[k], text_encoder.state_dict()[k]) and torch.equal(before[k], saved[k]) for k in before)


def test_teacher_forced_sampling_from_the_pipelines_own_past_is_its_decode():
    """`teacher_forced_sample` given the pipeline's own committed blocks as the past and its
    noise draws is the pipeline's guided Euler decode, every block: so `diagnose`'s rows with a
    real past differ from a free rollout only in that past (and its first frame, which has none,
    is the rollout's)."""
    from training.train_video import teacher_forced_sample
    from mmgen.decoding import FlowSchedule
    from tests.video.tiny import tiny_video_pipeline

    schedule = FlowSchedule.uniform(3, 3.0)
    pipe = tiny_video_pipeline(block_frames=1, num_frames=9, timesteps=schedule.timesteps, shift=3.0, stochastic=False,
                               guidance_scale=2.0)
    prompts = ["red fish moving left", "cat face bouncing up and down"]
    out = pipe(prompts, generator=torch.Generator().manual_seed(3), decode="none")
    latents = out.latents  # [2, 4, 3, 4, 4]: three one-frame blocks
    draws = torch.Generator().manual_seed(3)
    noise = torch.cat([torch.randn((2, 4, 1, 4, 4), generator=draws) for _ in range(latents.shape[2])], 2)
    with torch.no_grad():
        text, empty = pipe.encode_prompt(prompts), pipe.encode_prompt([""] * 2)
        sampled = teacher_forced_sample(pipe.transformer, latents, noise, schedule.sigmas(), text, empty, 2.0, block_frames=1)
        first = teacher_forced_sample(pipe.transformer, latents[:, :, :1], noise[:, :, :1], schedule.sigmas(), text, empty, 2.0,
                                      block_frames=1)
    assert latents.abs().max() > 0.1
    assert (sampled - latents).abs().max() < 1e-4
    assert (first - latents[:, :, :1]).abs().max() < 1e-4
    # the past and the guidance both matter here: another past changes the later blocks (not the
    # first, which sees none), and unguided sampling from the same past and noise is another decode
    with torch.no_grad():
        other_past = teacher_forced_sample(pipe.transformer, torch.zeros_like(latents), noise, schedule.sigmas(), text, empty, 2.0,
                                           block_frames=1)
        unguided = teacher_forced_sample(pipe.transformer, latents, noise, schedule.sigmas(), text, block_frames=1)
    assert (other_past[:, :, :1] - latents[:, :, :1]).abs().max() < 1e-4
    assert (other_past[:, :, 1:] - latents[:, :, 1:]).abs().max() > 1e-2
    assert (unguided - latents).abs().max() > 1e-2


def test_diagnose_scores_each_row_of_a_saved_pipeline(tmp_path):
    """`diagnose` on a pipeline folder: the VAE round trip, one-step rows, the teacher-forced
    rollout and the first frame alone, each with its class accuracy (74-way and among the eight
    sprites) per frame position (17 frames for clips; the first frame scored as a clip of it twice)."""
    from mmgen.decoding import FlowSchedule
    from tests.video.tiny import tiny_video_pipeline

    schedule = FlowSchedule.uniform(2, 3.0)
    pipe = tiny_video_pipeline(block_frames=1, num_frames=17, height=64, width=64, max_sequence_length=12,
                               timesteps=schedule.timesteps, shift=3.0, stochastic=False, guidance_scale=2.0)
    pipe.save_pretrained(tmp_path / "pipe")
    out = tmp_path / "diagnose.json"
    main(["diagnose", "--pipeline", str(tmp_path / "pipe"), "--clips", "2", "--reference-clips", "4", "--sigmas", "0.5",
          "--out", str(out), "--threads", "1"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["real clips through the VAE", "one step from sigma 0.5, real past",
                                        "sampled (2 steps, guidance 2), real past", "first frame from the prompt"]
    assert [len(r["class_accuracy_by_frame"]) for r in rows] == [17, 17, 17, 2]
    assert [len(r["class_accuracy_8_by_frame"]) for r in rows] == [17, 17, 17, 2]
    assert all(0 <= r["class_accuracy"] <= r["class_accuracy_8"] <= 1 for r in rows)
    assert "direction_accuracy" in rows[0] and "direction_accuracy" not in rows[-1]
    # Its VAE row is the round trip `vae-quality` scores, on the same clips.
    from training.train_video import eval_prompts, scorer, through_vae

    reference = scorer(4)(through_vae(pipe.vae, 2), eval_prompts(2))
    for key, theirs in (("class_accuracy", "class_accuracy"), ("class_accuracy_8", "class_accuracy_among_sprites"),
                        ("direction_accuracy", "direction_accuracy"), ("fid_proxy", "fid_proxy")):
        assert rows[0][key] == pytest.approx(reference[theirs], abs=1e-4)
    # A second run does not replace the report without --overwrite (one line, before any work).
    before = out.read_bytes()
    with pytest.raises(SystemExit) as refused:
        main(["diagnose", "--pipeline", str(tmp_path / "missing"), "--out", str(out)])
    assert refused.value.code == 2 and out.read_bytes() == before


def test_compare_scores_pipelines_frame_by_frame_and_draws_their_sheet(tmp_path, capsys):
    """`compare`: per pipeline (a folder at its own steps or at @STEPS) the proxies with the
    eight-way class accuracy of every frame, whose quarters are the first and last four; the
    PNG sheet puts each prompt's pipelines one under another; bad entries and an existing sheet
    are refused in one line before any work."""
    from PIL import Image

    from mmgen.decoding import FlowSchedule
    from tests.video.tiny import tiny_video_pipeline

    schedule = FlowSchedule.uniform(2, 3.0)
    pipe = tiny_video_pipeline(block_frames=1, num_frames=17, height=64, width=64, max_sequence_length=12,
                               timesteps=schedule.timesteps, shift=3.0, stochastic=False, guidance_scale=2.0)
    pipe.save_pretrained(tmp_path / "pipe")
    out = tmp_path / "compare.json"
    command = ["compare", "--pipelines", f"two={tmp_path / 'pipe'}", f"one={tmp_path / 'pipe'}@1", "--clips", "3",
               "--sheet-prompts", "2", "--reference-clips", "4", "--out", str(out), "--threads", "1"]
    main(command)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["pipeline"], r["steps_per_block"]) for r in rows] == [("two", 2), ("one", 1)]
    for r in rows:
        assert len(r["class_8_by_frame"]) == 17 and r["class_8_first_quarter"] == pytest.approx(np.mean(r["class_8_by_frame"][:4]), abs=2e-3)
        assert r["class_8_last_quarter"] == pytest.approx(np.mean(r["class_8_by_frame"][-4:]), abs=2e-3)
        assert r["class_accuracy_8"] >= r["class_accuracy"]
    assert np.asarray(Image.open(out.with_suffix(".png"))).shape == (2 * 2 * 64, 17 * 64, 3)
    capsys.readouterr()
    for bad, message in (([f"x={tmp_path}"], "not a pipeline folder"), ([f"x={tmp_path / 'pipe'}@0"], "positive integer"),
                         (["x"], "NAME=FOLDER")):
        with pytest.raises(SystemExit) as refused:
            main(["compare", "--pipelines", *bad, "--out", str(tmp_path / "other.json")])
        assert refused.value.code == 2 and message in capsys.readouterr().err
    out.unlink()  # the report gone, its sheet still there: not replaced without --overwrite
    with pytest.raises(SystemExit):
        main(command)
    assert "compare.png exists" in capsys.readouterr().err and not out.exists()


def test_techniques_and_quality_score_each_row_of_an_exported_pair(tmp_path):
    """`techniques`: one row per technique (the baseline first at 1.00x), the proxies beside the
    seconds, a report docs/make_tables.py renders; `quality`: the card's rows and its table."""
    import importlib.util
    from pathlib import Path

    from mmgen.decoding import FlowSchedule
    from tests.video.tiny import tiny_video_pipeline

    schedule = FlowSchedule.uniform(2, 3.0)
    pipe = tiny_video_pipeline(block_frames=1, num_frames=17, height=64, width=64, max_sequence_length=12,
                               timesteps=schedule.timesteps, shift=3.0, stochastic=False, guidance_scale=2.0)
    for name in ("emoji-motion", "emoji-motion-small"):
        pipe.save_pretrained(tmp_path / "assets" / name)
    out = tmp_path / "techniques.json"
    main(["techniques", "--assets", str(tmp_path / "assets"), "--clips", "2", "--repeats", "2", "--other-steps", "2", "1",
          "--large-steps", "1", "--cache-policies", "window:1", "--cache-thresholds", "0.1", "--drop-thresholds", "0.1",
          "--reference-clips", "4",
          "--out", str(out), "--threads", "1"])
    report = json.loads(out.read_text())
    methods = [r["method"] for r in report["rows"]]
    assert methods == ["block (2 steps, guidance 2)", "block (1 steps)", "collaborative, large first 1 of 2 steps",
                       "block, cache window:1", "block, First Block Cache 0.1", "block, static-token dropping 0.1",
                       "block, guidance 1", "block (2 steps, guidance 2)"]
    assert report["rows"][0]["vs_baseline"] == 1.0 and report["baseline"] == methods[0]
    assert all(r["seconds_per_clip"] > 0 and 0 <= r["class_accuracy"] <= r["class_accuracy_8"] <= 1 for r in report["rows"])
    spec = importlib.util.spec_from_file_location("make_tables", Path(__file__).parents[2] / "docs" / "make_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    tables.RESULTS = tmp_path
    out.rename(tmp_path / "video_emoji-motion_cpu.json")
    table = tables.video()
    assert table.count("\n| emoji-motion |") == 7 and "| emoji-motion-small | block (2 steps, guidance 2) |" in table

    main(["quality", "--assets", str(tmp_path / "assets"), "--clips", "2", "--large-steps", "1", "--reference-clips", "4",
          "--out", str(tmp_path / "quality.json"), "--threads", "1"])
    rows = json.loads((tmp_path / "quality.json").read_text())
    assert list(rows)[:5] == ["real clips", "real clips through the VAE", "emoji-motion", "emoji-motion-small",
                              "collaborative, large first 1 of 2"]
    assert all("class_accuracy_among_sprites_by_frame" in r for r in rows.values())


def test_the_sprites_latent_positions_and_the_weighted_flow_loss(tmp_path):
    """`latent_foreground`: the latent cell of every object's centroid, in frame 0 and in each
    4-frame chunk, and a minority of the cells. `--foreground-weight`: a weighted mean of the
    squared errors, which equals the plain loss where the weight is uniform (all or no cells
    under a sprite) and not otherwise; files without the positions are refused for it."""
    from training.train_video import TRAIN_SEED, Latents, clips, corpus, flow_loss, latent_foreground, new_transformer

    data = corpus(TRAIN_SEED, length=4)
    cells = latent_foreground(clips(data, torch.arange(4)), 4)
    assert cells.shape == (4, 5, 16, 16) and cells.dtype == torch.bool
    for i in range(4):
        for track in data[i].tracks:
            for t, (x, y) in enumerate(track):
                assert cells[i, 0 if t == 0 else (t - 1) // 4 + 1, int(round(y)) // 4, int(round(x)) // 4]
        assert cells[i].float().mean() < 0.5

    fake_latents(tmp_path / "latents.npz", channels=4)
    latents = Latents([str(tmp_path / "latents.npz")])
    assert latents.foreground is None
    transformer = new_transformer("small", channels=4)
    prompts = PromptEncoder(new_tokenizer(), new_text_encoder().eval())
    loss = lambda weight: flow_loss(transformer, prompts, latents, torch.arange(4), torch.Generator().manual_seed(0), 0.1, 3.0,
                                    train_text=False, foreground_weight=weight).item()
    with pytest.raises(ValueError, match="sprites' positions"):
        loss(4.0)
    # The trainer refuses such files for the option before any work (no run folder).
    with pytest.raises(ValueError, match="sprites' positions"):
        main(["small", "--latents", str(tmp_path / "latents.npz"), "--text-encoder", str(tmp_path / "absent"),
              "--foreground-weight", "4", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()
    plain = loss(0.0)
    for value in (True, False):
        latents.foreground = torch.full((12, 3, 4, 4), value)
        assert loss(4.0) == pytest.approx(plain, rel=1e-6)
    latents.foreground = torch.zeros(12, 3, 4, 4, dtype=torch.bool)
    latents.foreground[:, :, :2] = True
    assert loss(4.0) != pytest.approx(plain, rel=1e-3)
