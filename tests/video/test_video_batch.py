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
    jobs = [{"modality": "video", "model": model, "prompt": p, "output": f"v{i}", "seed": i} for i, p in enumerate(PROMPTS)]
    jobs.append({"modality": "video", "model": model, "prompt": "cat", "output": "windowed", "cache_policy": "window:2",
                 "num_frames": 21})
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
    path = write_jobs(tmp_path / "jobs.jsonl", [{"modality": "video", "model": model, **job} for job in [
        {"prompt": "", "output": "empty"},
        {"prompt": "cat", "num_frames": 9, "output": "frames"},
        {"prompt": "cat", "cache_policy": "ring", "output": "policy"},
        {"prompt": "cat", "output": "ok"},
        {"prompt": "cat face " * 50, "output": "long"},
        {"prompt": "cat", "video": "cat", "output": "both"},
    ]])
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "line 1" in err and "line 2" in err and "use num_frames 5 or 13" in err and "line 3" in err
    assert "line 5: a prompt of 100 tokens" in err and "(max_sequence_length 8 tokens)" in err
    assert 'line 6: "video" is the old name of "prompt": give only "prompt"\n' in err
    assert not (tmp_path / "out" / "ok.mp4").exists()


def test_a_prompt_without_the_video_modality_is_a_text_job(root, tmp_path, capsys):
    job = {"model": str(root / "tiny"), "prompt": "cat", "output": "a"}
    path = write_jobs(tmp_path / "jobs.jsonl", [job])
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2  # the text runner reads it
    assert "line 1: model" in (err := capsys.readouterr().err) and "not a vision-language model" in err
    write_jobs(path, [{**job, "modality": "video"}])
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    assert "1 valid job(s)" in capsys.readouterr().out


def test_a_line_with_both_prompt_fields_and_no_modality_is_one_line(root, tmp_path, capsys):
    path = write_jobs(tmp_path / "jobs.jsonl", [{"model": str(root / "tiny"), "prompt": "cat", "video": "cat", "output": "a"}])
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 1 carries the fields of several modalities, prompt (text), video (video)" in err


def test_the_old_video_field_warns_once_and_its_run_resumes_in_either_form(root, tmp_path, capsys):
    model, out = str(root / "tiny"), tmp_path / "out"
    old = [{"model": model, "video": p, "output": f"v{i}", "seed": i} for i, p in enumerate(PROMPTS[:2])]
    path = write_jobs(tmp_path / "old.jsonl", old)
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    warning = (f'mmgen batch: {path}: the "video" field of video jobs is now "prompt" with "modality": "video"; '
               "the old form is read until the next release")
    assert capsys.readouterr().err.splitlines() == [warning]  # one line for the two old lines
    pipe = tiny_video_pipeline()
    alone = pipe(PROMPTS[1], generator=torch.Generator().manual_seed(1)).frames[0]  # the prompt is the old field's
    assert abs(read_mp4(out / "v1.mp4").astype(float) - alone.numpy().astype(float)).mean() < 12
    made = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.glob("*.mp4")}
    # A run killed after v0: the same old file resumes and makes only v1, without a duplicate record.
    (out / "v1.mp4").unlink()
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]["total"]["outputs"] == 1
    assert (out / "v0.mp4").stat().st_mtime_ns == made["v0.mp4"][1] and (out / "v1.mp4").read_bytes() == made["v1.mp4"][0]
    # Moved to the new form, with one more job: the finished videos count, only the new one is made.
    new = [{"modality": "video", "model": model, "prompt": job["video"], "output": job["output"], "seed": job["seed"]}
           for job in old]
    new.append({"modality": "video", "model": model, "prompt": PROMPTS[2], "output": "v2"})
    path = write_jobs(tmp_path / "new.jsonl", new)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.mp4")}
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out.splitlines()[-1])["summary"]["total"]["outputs"] == 1
    assert all((out / name).stat().st_mtime_ns == t for name, t in before.items())
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [(r["file"], r["spec"]) for r in records] == [("v0.mp4", new[0]), ("v1.mp4", new[1]), ("v2.mp4", new[2])]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.jsonl", "v0.mp4", "v1.mp4", "v2.mp4"]

