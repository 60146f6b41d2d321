"""The training harness resumes exactly: killed at a checkpoint and restarted, it ends with the
weights of a run that never stopped."""

import json

import numpy as np
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
