"""The training harness resumes exactly: killed at a checkpoint and restarted, it ends with the
weights of a run that never stopped."""

import json

import numpy as np
import pytest
import torch

from training.train import main


def run(argv, monkeypatch):
    monkeypatch.setattr("sys.argv", ["train", *map(str, argv)])
    main()


def test_resumed_gpt_training_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    codes = tmp_path / "codes.npz"
    np.savez(codes, codes=rng.integers(0, 512, (96, 64)).astype(np.int16), labels=rng.integers(0, 74, 96),
             class_names=np.array([f"c{i}" for i in range(74)]))
    common = ["gpt", "--preset", "draft", "--codes", codes, "--batch-size", 16, "--warmup", 2, "--log-every", 1, "--threads", 1]
    run([*common, "--out", tmp_path / "straight", "--steps", 6], monkeypatch)
    # The same 6-step command stopped by its clock (no minutes left: after one step), then after 3
    # steps (as a kill after a checkpoint would), then again.
    run([*common, "--out", tmp_path / "resumed", "--steps", 6, "--minutes", 0], monkeypatch)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["step"] == 1
    run([*common, "--out", tmp_path / "resumed", "--steps", 6, "--run-steps", 2], monkeypatch)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["step"] == 3
    run([*common, "--out", tmp_path / "resumed", "--steps", 6], monkeypatch)

    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["step"] == resumed["step"] == 6
    for key, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key


def test_the_weight_average_averages_trained_weights_and_copies_frozen_ones():
    """`WeightAverage`: trained parameters follow the warmed-up decay, a part frozen mid-run is
    copied (so it stays exactly what the rest trained against), and `swapped_in` gives the model
    back its own weights after."""
    from training.train import WeightAverage

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    average = WeightAverage(model, decay=0.9)
    expected = model[0].weight.detach().clone()
    for k in range(5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        if k == 2:
            model[1].requires_grad_(False)
        average.update()
        decay = min(0.9, (1 + k) / (10 + k))
        expected = decay * expected + (1 - decay) * model[0].weight.detach()
    assert torch.allclose(average.weights["0.weight"], expected, atol=1e-6)
    assert torch.equal(average.weights["1.weight"], model[1].weight)  # frozen: copied
    own = model[0].weight.detach().clone()
    with average.swapped_in():
        assert torch.equal(model[0].weight, average.weights["0.weight"])
    assert torch.equal(model[0].weight, own)


def test_a_run_with_a_weight_average_resumes_exactly_and_loads_the_average(tmp_path, monkeypatch):
    from training.train import LlamaGenTransformer, gpt_config, load_trained
    from training.train_video import load_vae_checkpoint, main as video_main, weight_average

    rng = np.random.default_rng(0)
    codes = tmp_path / "codes.npz"
    np.savez(codes, codes=rng.integers(0, 512, (96, 64)).astype(np.int16), labels=rng.integers(0, 74, 96),
             class_names=np.array([f"c{i}" for i in range(74)]))
    common = ["gpt", "--preset", "draft", "--codes", codes, "--batch-size", 16, "--warmup", 2, "--log-every", 1,
              "--threads", 1, "--ema", 0.99]
    run([*common, "--out", tmp_path / "straight", "--steps", 4], monkeypatch)
    run([*common, "--out", tmp_path / "resumed", "--steps", 4, "--run-steps", 2], monkeypatch)
    run([*common, "--out", tmp_path / "resumed", "--steps", 4], monkeypatch)
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["ema"]["updates"] == resumed["ema"]["updates"] == 4
    for key, tensor in straight["ema"]["weights"].items():
        assert torch.equal(tensor, resumed["ema"]["weights"][key]), key
    assert any(not torch.equal(v, straight["model"][k]) for k, v in straight["ema"]["weights"].items())
    # load_trained gives the average
    model = load_trained(LlamaGenTransformer(gpt_config("draft", 74)), str(tmp_path / "straight"))
    assert all(torch.equal(v, straight["ema"]["weights"][k]) for k, v in model.state_dict().items())
    # Held-out figures and best.pt are the average's: a VAE run scored after its only step.
    video_main(["vae", "--batch-size", "1", "--frames", "5", "--crop", "16", "--full-steps", "0", "--warmup", "1",
                "--log-every", "1", "--threads", "1", "--stats-clips", "2", "--eval-clips", "1", "--base-dim", "8",
                "--z-dim", "4", "--eval-every", "1", "--heldout-clips", "1", "--ema", "0.5", "--steps", "1",
                "--out", str(tmp_path / "vae")])
    state = torch.load(tmp_path / "vae" / "checkpoint.pt", weights_only=True)
    best = torch.load(tmp_path / "vae" / "best.pt", weights_only=True)["model"]
    assert all(torch.equal(v, state["ema"]["weights"][k]) for k, v in best.items())
    assert weight_average(tmp_path / "vae") == {"decay": 0.5, "from_step": 0} and weight_average(tmp_path / "straight") is not None
    vae = load_vae_checkpoint(tmp_path / "vae")
    assert all(torch.equal(v, state["ema"]["weights"][k].half().float()) for k, v in vae.state_dict().items())


def test_wall_clock_sums_the_invocations_of_a_resumed_run(tmp_path):
    from training.train import wall_clock

    # Two invocations (the second restarts the clock); held-out records carry no seconds.
    records = [{"step": 50, "seconds": 10.0}, {"step": 100, "seconds": 20.0}, {"step": 100, "heldout": {}},
               {"step": 150, "seconds": 12.5}, {"step": 200, "seconds": 25.0}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert wall_clock(tmp_path) == (45.0, 2)


def test_self_forcing_trains_on_its_own_rollouts_resumes_exactly_and_refuses_bad_arguments(tmp_path, capsys, monkeypatch):
    """`train_video self-forcing` from a tiny random pipeline folder: its gradient forward is the
    cached decode's forward (the same velocity, through `GradientCache`), a 3-step run stopped after
    step 1 and resumed ends with an uninterrupted run's weights, the past it trains on is the model's own
    rollout, and a bad argument is refused with one line before any work."""
    from mmgen.decoding.block_diffusion import BlockRollout
    from mmgen.video.model import PromptEmbeddings, WanBlockModel
    from training.train_video import GradientCache, main as video_main, new_text_encoder, new_transformer, new_vae, vae_config

    pair = tmp_path / "pair"
    transformer = new_transformer("small", channels=4).to(torch.float16)  # shipped in float16, trained in float32
    transformer.save_pretrained(pair / "transformer")
    new_text_encoder().to(torch.float16).save_pretrained(pair / "text_encoder")
    transformer = transformer.float()
    rng = np.random.default_rng(0)
    latents = tmp_path / "latents.npz"
    captions = ["red heart moving left", "sun bouncing vertically", "snake moving up and airplane moving down"]
    np.savez(latents, latents=rng.standard_normal((8, 4, 3, 4, 4)).astype(np.float16),
             captions=np.array([captions[i % 3] for i in range(8)]), indices=np.arange(8))

    # The forward with gradients computes what the inference decode computes after the same past.
    model = WanBlockModel(transformer, 1, (4, 4))
    text = torch.randn(2, 12, 64)
    state = model.start(PromptEmbeddings(text, torch.zeros_like(text)), 3, guidance=True)
    try:
        with torch.no_grad():
            for _ in range(2):
                model.commit(state, torch.randn(2, 4, 1, 4, 4))
            x = torch.randn(2, 4, 1, 4, 4)
            plain = model.velocity(state, x, 750.0)
        cache, state.context.cache = state.context.cache, GradientCache(state.context.cache)
        trained = model.velocity(state, x, 750.0)
        state.context.cache = cache
    finally:
        model.finish(state)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, trained)) and trained[0].requires_grad

    common = ["self-forcing", "--init-from", str(pair), "--latents", str(latents), "--batch-size", "2", "--warmup", "1",
              "--log-every", "1", "--threads", "1", "--steps-per-block", "2", "--steps", "3", "--lr", "1e-3"]
    # The uninterrupted run also logs held-out figures (at its start and end), which change nothing it trains.
    vae = new_vae(config=dict(vae_config(base_dim=8, z_dim=4), latents_std=[1.0, 2.0, 1.0, 2.0]))
    vae.save_pretrained(str(pair / "vae"))
    rollout_blocks = []
    step = BlockRollout.step
    monkeypatch.setattr(BlockRollout, "step", lambda self, *a: rollout_blocks.append(1) or step(self, *a))
    video_main([*common, "--out", str(tmp_path / "straight"), "--eval-every", "3", "--vae", str(pair), "--eval-clips", "2",
                "--reference-clips", "8"])
    monkeypatch.undo()
    video_main([*common, "--out", str(tmp_path / "resumed"), "--run-steps", "1"])
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["step"] == 1
    video_main([*common, "--out", str(tmp_path / "resumed")])
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["step"] == resumed["step"] == 3 and straight["optimizer"]["state"]
    for key, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), key
    start = {f"transformer.{k}": v for k, v in transformer.state_dict().items()}
    assert any(not torch.equal(v, start[k]) for k, v in straight["model"].items() if k in start)  # it trained
    shipped = new_text_encoder().to(torch.float16).float().state_dict()
    assert all(torch.equal(straight["model"][f"text_encoder.{k}"], v) for k, v in shipped.items())  # the text encoder stays frozen
    records = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    heldout = [r for r in records if "heldout" in r]
    assert [r["step"] for r in heldout] == [0, 3] and heldout[0]["init_from"] == str(pair)
    assert all(0 <= r["heldout"][k] <= 1 for r in heldout for k in ("class_accuracy_8", "class_8_first_quarter", "class_8_last_quarter"))
    records = [r for r in records if "loss" in r]
    assert len(records) == 3 and all(np.isfinite(r["loss"]) and 0 <= r["block"] < 3 for r in records)
    # The past after the anchored first block is the model's own rollout through the cached decode.
    assert all(r["own_blocks"] == max(0, r["block"] - 1) for r in records)
    assert len(rollout_blocks) == sum(r["own_blocks"] for r in records) + 2 * 5  # and 5 blocks per held-out measurement

    # Bad arguments: one line on stderr, exit status 2, nothing written.
    bad = [(["--steps-per-block", "0"], "--steps-per-block must be >= 1"),
           (["--init-from", str(tmp_path / "missing")], "not a pipeline folder"),
           (["--eval-every", "1"], "--eval-every needs --vae"),
           (["--latents", str(tmp_path / "none.npz")], "no such file")]
    for options, message in bad:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            video_main([*common, *options, "--out", str(tmp_path / "refused")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "refused").exists()
    # --levels continuous trains at any noise level, not only the 2-step schedule's (1 and 0.75 at shift 3).
    video_main([*common, "--levels", "continuous", "--out", str(tmp_path / "continuous")])
    records = [json.loads(line) for line in (tmp_path / "continuous" / "log.jsonl").read_text().splitlines()]
    assert all(0 <= r["sigma"] <= 1 for r in records) and not {r["sigma"] for r in records} <= {1.0, 0.75}
    with pytest.raises(SystemExit, match="--anchor-blocks 3 leaves none"):  # known once the latents' length is
        video_main([*common, "--anchor-blocks", "3", "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()


def test_self_forcing_distillation_regresses_the_student_onto_the_teacher_on_the_same_past(tmp_path, capsys):
    """`self-forcing --objective distill`: the student at its last exit step, where its schedule is
    the teacher's and its weights the teacher's, makes exactly the teacher's block (the same past
    committed into both caches, the same noise): the loss is zero there and not for another
    teacher; other exit steps give nonzero losses (an x0 prediction from higher noise). A run
    resumes exactly and its past is the student's own rollout; `--teacher` puts another model in
    the teacher's place."""
    import copy

    from mmgen.decoding import FlowSchedule
    from mmgen.decoding.block_diffusion import BlockRollout
    from mmgen.video.model import WanBlockModel
    from training.train_video import (Latents, PromptEncoder, main as video_main, new_text_encoder, new_tokenizer,
                                      new_transformer, self_forcing_distill_loss)

    rng = np.random.default_rng(0)
    latents = tmp_path / "latents.npz"
    captions = ["red heart moving left", "sun bouncing vertically", "snake moving up and airplane moving down"]
    np.savez(latents, latents=rng.standard_normal((8, 4, 3, 4, 4)).astype(np.float16),
             captions=np.array([captions[i % 3] for i in range(8)]), indices=np.arange(8))
    data = Latents([str(latents)])
    transformer = new_transformer("small", channels=4).double()
    prompts = PromptEncoder(new_tokenizer(), new_text_encoder().double().eval())
    student = WanBlockModel(transformer, 1, (4, 4))
    schedule = FlowSchedule.uniform(2, 3.0)
    data.latents = data.latents.double()
    losses = {}
    for seed in range(12):
        for name, weights in (("same", transformer), ("other", new_transformer("small", seed=1, channels=4).double())):
            teacher = WanBlockModel(copy.deepcopy(weights).requires_grad_(False), 1, (4, 4))
            loss, info = self_forcing_distill_loss(student, teacher, prompts, data, torch.arange(2),
                                                   torch.Generator().manual_seed(seed), schedule, schedule, 3.0, anchor_blocks=0)
            assert loss.requires_grad and info["own_blocks"] == info["block"]
            losses.setdefault((name, info["exit_step"]), []).append(float(loss.detach()))
    assert max(losses[("same", 1)]) < 1e-20 and min(losses[("other", 1)]) > 1e-6
    assert min(losses[("same", 0)]) > 1e-6  # the first step's x0 is not yet the sample

    pair = tmp_path / "pair"
    transformer.float().to(torch.float16).save_pretrained(pair / "transformer")
    new_text_encoder().to(torch.float16).save_pretrained(pair / "text_encoder")
    common = ["self-forcing", "--objective", "distill", "--teacher-steps", "3", "--anchor-blocks", "0", "--init-from",
              str(pair), "--latents", str(latents), "--batch-size", "2", "--warmup", "1", "--log-every", "1",
              "--threads", "1", "--steps-per-block", "2", "--steps", "3", "--lr", "1e-3"]
    rollout_blocks = []
    step = BlockRollout.step
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockRollout, "step", lambda self, *a: rollout_blocks.append(1) or step(self, *a))
        video_main([*common, "--out", str(tmp_path / "straight")])
    video_main([*common, "--out", str(tmp_path / "resumed"), "--run-steps", "1"])
    video_main([*common, "--out", str(tmp_path / "resumed")])
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["step"] == resumed["step"] == 3
    assert all(torch.equal(tensor, resumed["model"][key]) for key, tensor in straight["model"].items())
    records = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    assert all(0 <= r["exit_step"] < 2 and np.isfinite(r["loss"]) for r in records)
    assert len(rollout_blocks) == sum(r["own_blocks"] for r in records)

    # --teacher: another model teaches (the first step's loss differs from the self-taught run's)
    other = tmp_path / "other"
    new_transformer("small", seed=1, channels=4).to(torch.float16).save_pretrained(other / "transformer")
    video_main([*common, "--out", str(tmp_path / "taught"), "--teacher", str(other), "--steps", "1"])
    first = lambda name: json.loads((tmp_path / name / "log.jsonl").read_text().splitlines()[0])["loss"]
    assert first("taught") != first("straight")
    for extra, message in ((["--objective", "student-forcing", "--teacher", str(other)], "--teacher is for --objective distill"),
                           (["--teacher", str(tmp_path)], "neither a pipeline folder with transformer/ nor a target run")):
        with pytest.raises(SystemExit):
            video_main([*common, "--out", str(tmp_path / "refused"), *extra])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_draft_heads_train_on_the_frozen_model_resume_exactly_and_export(tmp_path, capsys):
    """`training/train_heads.py` on the bundled emoji64: two recorded calls, four steps; stopped
    after two and run again, it ends with the weights and log of an uninterrupted run; the
    exported heads load and decode exactly; bad arguments and changed settings are one line."""
    from mmgen import load_pipeline
    from mmgen.decoding import DraftHeads
    from training import train_heads

    common = ["emoji64", "--sequences", "2", "--steps", "4", "--eval-every", "2", "--batch", "32"]
    train_heads.main([*common, "--out", str(tmp_path / "straight")])
    train_heads.main([*common, "--out", str(tmp_path / "resumed"), "--run-steps", "2"])
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["step"] == 2
    assert not (tmp_path / "resumed" / "log.json").exists()
    model = tmp_path / "model"
    model.mkdir()
    train_heads.main([*common, "--out", str(tmp_path / "resumed"), "--export", str(model)])
    load = lambda name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
    straight, resumed = load("straight"), load("resumed")
    assert straight["step"] == resumed["step"] == 4
    for key, tensor in straight["heads"].items():
        assert torch.equal(tensor, resumed["heads"][key]), key
    log = lambda name: [{k: v for k, v in r.items() if k != "seconds"} for r in json.loads(load(name)["log"])]
    assert log("straight") == log("resumed") and [r["step"] for r in log("straight")] == [0, 2, 4]
    heads = DraftHeads.from_pretrained(model / "draft_heads")
    assert torch.equal(heads.up.weight, resumed["heads"]["up.weight"])
    pipe = load_pipeline("emoji64")
    ar = pipe([3], decoding="ar", temperature=0, output_type="np")
    out = pipe([3], decoding=f"heads:heads={model / 'draft_heads'}", temperature=0, output_type="np")
    assert np.array_equal(ar.images, out.images)

    capsys.readouterr()
    with pytest.raises(SystemExit):
        train_heads.main([*common, "--out", str(tmp_path / "bad"), "--steps", "0"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--steps must be at least 1")
    with pytest.raises(SystemExit, match="was started with other settings"):
        train_heads.main([*common, "--out", str(tmp_path / "straight"), "--lr", "0.5"])
    with pytest.raises(SystemExit):
        train_heads.main(["var-emoji64", "--out", str(tmp_path / "var")])
    assert "no training inputs for 'var-emoji64'" in capsys.readouterr().err
    assert not (tmp_path / "var").exists()
