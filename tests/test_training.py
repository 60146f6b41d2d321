"""The training harness resumes exactly: killed at a checkpoint and restarted, it ends with the
weights of a run that never stopped."""

import numpy as np
import torch

from benchmarks.train import main


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
