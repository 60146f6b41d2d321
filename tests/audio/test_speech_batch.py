"""`mmgen batch` with speech jobs on a tiny Dia folder saved here."""

from __future__ import annotations

import json

import pytest
import soundfile
import torch

from mmgen.cli import main
from tests.audio.tiny import RATE, tiny_dia

TEXTS = ["[S1] Hello there.", "[S1] Something else entirely.", "[S1] Three."]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tts-batch")
    tiny_dia(0, eos_boost=2.0).save_pretrained(root / "dia")
    soundfile.write(root / "voice.wav", (0.3 * torch.sin(torch.arange(400) / 3.0)).numpy(), RATE)
    return root


def write_jobs(path, jobs):
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def test_speech_jobs_match_the_pipeline_and_resume(root, tmp_path):
    model = str(root / "dia")
    jobs = [{"model": model, "text": t, "output": f"s{i}", "max_new_frames": 30, "temperature": 0} for i, t in enumerate(TEXTS)]
    jobs[2]["modality"] = "speech"  # a line may name its modality
    jobs.append({"model": model, "text": "[S1] Hi.", "voice": str(root / "voice.wav"), "voice_text": "[S1] Yes.",
                 "output": "voiced", "max_new_frames": 20})
    path = write_jobs(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    pipe = tiny_dia(0, eos_boost=2.0)
    for i, text in enumerate(TEXTS):  # greedy speech does not depend on the batch it ran in
        alone = pipe(text, max_new_frames=30, temperature=0).audio[0]
        audio, rate = soundfile.read(out / f"s{i}.wav", dtype="float32")
        assert rate == RATE and audio.shape == alone.shape and abs(audio - alone.clamp(-1, 1).numpy()).max() <= 1 / 32767 + 1e-6
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["file"] for r in manifest) == ["s0.wav", "s1.wav", "s2.wav", "voiced.wav"]
    kept = (out / "s0.wav").read_bytes()
    (out / "s1.wav").unlink()  # a run killed before this file: the next run makes only it
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    assert (out / "s0.wav").read_bytes() == kept and (out / "s1.wav").is_file()


def test_bad_lines_are_reported_before_any_work(root, tmp_path, capsys):
    model = str(root / "dia")
    path = write_jobs(tmp_path / "jobs.jsonl", [
        {"model": model, "text": "", "output": "empty"},
        {"model": model, "text": "hi", "voice": str(tmp_path / "missing.wav"), "output": "novoice"},
        {"model": model, "text": "hi", "voice_text": "x", "output": "nov"},
        {"model": model, "text": "hi", "output": "ok"},
    ])
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "line 1" in err and "line 2" in err and "line 3" in err and not (tmp_path / "out" / "ok.wav").exists()


def test_continuous_speech_equals_each_job_alone_with_its_seed_and_resumes(root, tmp_path, capsys):
    from mmgen.sampling import make_generator

    model = str(root / "dia")
    jobs = [{"model": model, "text": TEXTS[k % 3], "output": f"s{k}", "max_new_frames": 24, "seed": 50 + k, "temperature": 1.0,
             "top_k": 20, "decoding": "sjd:window=4,adapt=false"} for k in range(5)]
    path = write_jobs(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--continuous", "--no-progress"]) == 0
    pipe = tiny_dia(0, eos_boost=2.0)
    records = {r["file"]: r for r in map(json.loads, (out / "manifest.jsonl").read_text().splitlines())}
    for k, job in enumerate(jobs):  # sampled, yet each is its job alone with its own seed
        alone = pipe(job["text"], max_new_frames=24, temperature=1.0, top_k=20, decoding="sjd:window=4,adapt=false",
                     generator=make_generator(job["seed"]))
        audio, rate = soundfile.read(out / f"s{k}.wav", dtype="float32")
        expected = alone.audio[0].clamp(-1, 1).numpy()
        assert rate == RATE and audio.shape == expected.shape and abs(audio - expected).max() <= 1 / 32767 + 1e-6
        record = records[f"s{k}.wav"]
        assert record["seed"] == job["seed"] and record["frames"] == int(alone.lengths[0])
        assert record["stats"]["forwards"] == alone.stats.forwards
    capsys.readouterr()
    (out / "s3.wav").unlink()  # a run killed before this file: the next run makes only it
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.wav")}
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--continuous", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["total"]["outputs"] == 1 and (out / "s3.wav").is_file()
    assert all((out / name).stat().st_mtime_ns == t for name, t in before.items())


def test_continuous_refuses_speech_jobs_it_cannot_run_before_any_work(root, tmp_path, capsys):
    model = str(root / "dia")
    jobs = write_jobs(tmp_path / "bad.jsonl", [
        {"model": model, "text": "[S1] Hi.", "output": "a", "decoding": "sjd-coupled"},
        {"model": model, "text": "[S1] Hi.", "output": "b", "decoding": f"draft:drafter={model}"},
        {"model": model, "text": "[S1] Hi.", "output": "c"},
    ])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--continuous"]) == 2
    err = capsys.readouterr().err
    assert "line 1: " in err and "its own fixed noise" in err, err
    assert "line 2: DraftModelProposer cannot restart rows" in err, err
    assert "line 3" not in err and not (tmp_path / "out").exists()
