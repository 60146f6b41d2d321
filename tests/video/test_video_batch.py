"""`mmgen batch` with video jobs on a tiny folder saved here."""

from __future__ import annotations

import json

import pytest
import torch

from mmgen.cli import main
from mmgen.video.export import read_mp4
from tests.video.tiny import tiny_video_pipeline

PROMPTS = ["cat face moving left", "dog face moving up", "red fish bouncing"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-batch")
    tiny_video_pipeline().save_pretrained(root / "tiny")
    return root


def write_jobs(path, jobs):
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def test_video_jobs_match_the_pipeline_and_resume(root, tmp_path):
    model = str(root / "tiny")
    jobs = [{"model": model, "video": p, "output": f"v{i}", "seed": i} for i, p in enumerate(PROMPTS)]
    jobs.append({"model": model, "video": "cat", "output": "windowed", "cache_policy": "window:2", "num_frames": 21})
    path = write_jobs(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    pipe = tiny_video_pipeline()
    alone = pipe(PROMPTS[1], generator=torch.Generator().manual_seed(1)).frames[0]  # --batch-size 1: the job's own seed
    video = read_mp4(out / "v1.mp4")
    assert video.shape == tuple(alone.shape) and abs(video.astype(float) - alone.numpy().astype(float)).mean() < 12
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["file"] for r in manifest) == ["v0.mp4", "v1.mp4", "v2.mp4", "windowed.mp4"]
    assert next(r for r in manifest if r["file"] == "windowed.mp4")["frames"] == 21
    kept = (out / "v0.mp4").read_bytes()
    (out / "v2.mp4").unlink()  # a run killed before this file: the next run makes only it
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    assert (out / "v0.mp4").read_bytes() == kept and (out / "v2.mp4").is_file()


def test_bad_lines_are_reported_before_any_work(root, tmp_path, capsys):
    model = str(root / "tiny")
    path = write_jobs(tmp_path / "jobs.jsonl", [
        {"model": model, "video": "", "output": "empty"},
        {"model": model, "video": "cat", "num_frames": 9, "output": "frames"},
        {"model": model, "video": "cat", "cache_policy": "ring", "output": "policy"},
        {"model": model, "video": "cat", "output": "ok"},
        {"model": model, "video": "cat face " * 50, "output": "long"},
    ])
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "line 1" in err and "line 2" in err and "use num_frames 5 or 13" in err and "line 3" in err
    assert "line 5: a prompt of 100 tokens" in err and "(max_sequence_length 8 tokens)" in err
    assert not (tmp_path / "out" / "ok.mp4").exists()
