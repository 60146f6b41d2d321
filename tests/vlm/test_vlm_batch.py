"""`mmgen batch` with text jobs (answers about images) on tiny VLM folders saved here."""

from __future__ import annotations

import json

import pytest
import torch

from mmgen.cli import main
from tests.vlm.test_vlm_pipeline import PROMPTS, images, tiny_llava


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-batch")
    tiny_llava(0).save_pretrained(root / "llava")
    tiny_llava(1).save_pretrained(root / "llava-draft")
    for i, image in enumerate(images(3)):
        image.save(root / f"img{i}.png")
    return root


def write_jobs(path, jobs):
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def jobs_for(root):
    model, draft = str(root / "llava"), str(root / "llava-draft")
    return [
        {"model": model, "prompt": PROMPTS[i], "images": [str(root / f"img{i}.png")], "output": f"a{i}", "max_new_tokens": 8}
        for i in range(3)
    ] + [
        {"model": model, "prompt": PROMPTS[0], "images": [str(root / "img0.png")], "output": "drafted", "max_new_tokens": 8,
         "decoding": f"draft:drafter={draft}"},
        {"modality": "text", "model": model, "prompt": PROMPTS[1], "output": "no-image", "max_new_tokens": 8, "seed": 3,
         "temperature": 1.0},  # a line may name its modality
    ]


def test_text_jobs_answer_as_the_pipeline_and_resume(root, tmp_path, capsys):
    jobs = write_jobs(tmp_path / "jobs.jsonl", jobs_for(root))
    out = tmp_path / "out"
    assert main(["batch", str(jobs), "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    pipe = tiny_llava(0)
    for i in range(3):  # greedy answers do not depend on the batch they ran in
        alone = pipe(PROMPTS[i], images(3)[i], max_new_tokens=8)
        answer = json.loads((out / f"a{i}.json").read_text())
        assert answer["text"] == alone.texts[0] and answer["token_ids"] == alone.token_ids[0, : alone.lengths[0]].tolist()
    assert json.loads((out / "drafted.json").read_text())["token_ids"] == json.loads((out / "a0.json").read_text())["token_ids"]
    sampled = json.loads((out / "no-image.json").read_text())
    alone = pipe(PROMPTS[1], None, max_new_tokens=8, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert sampled["token_ids"] == alone.token_ids[0, : alone.lengths[0]].tolist()  # a lone row keeps its own seed
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["file"] for r in records] == ["a0.json", "a1.json", "a2.json", "drafted.json", "no-image.json"]
    capsys.readouterr()
    # A killed run: one answer lost, the manifest gone but for its merged copy; the rerun writes only what is missing.
    (out / "a1.json").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    assert main(["batch", str(jobs), "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["total"]["outputs"] == 1 and (out / "a1.json").is_file()
    assert all((out / name).stat().st_mtime_ns == t for name, t in before.items())


def test_bad_text_jobs_are_listed_before_any_work(root, tmp_path, capsys):
    model = str(root / "llava")
    bad = [
        {"model": model, "prompt": "", "output": "x"},
        {"model": model, "prompt": PROMPTS[0], "images": [str(root / "missing.png")], "output": "y"},
        {"model": model, "prompt": PROMPTS[0], "output": "z", "decoding": "draft"},
        {"model": model, "prompt": PROMPTS[0], "output": "w", "dropping": "zip"},
        {"model": model, "prompt": PROMPTS[0], "output": "ok"},
        {"model": model, "prompt": PROMPTS[0], "output": "OK"},
    ]
    jobs = write_jobs(tmp_path / "bad.jsonl", bad)
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    for line, message in [(1, "prompt must be a non-empty string"), (2, f"image {root / 'missing.png'}: not a readable image"),
                          (3, "decoding 'draft' needs a smaller VLM of the same tokenizer"), (4, "unknown dropping policy 'zip'"),
                          (6, "output 'OK' is already used by line 5")]:
        assert f"line {line}: {message}" in err, err
    assert not (tmp_path / "out").exists()
    mixed = write_jobs(tmp_path / "mixed.jsonl", [bad[4], {"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar",
                                                           "count": 1, "output": "img"}])
    assert main(["batch", str(mixed), "--out", str(tmp_path / "out")]) == 2
    assert f"{mixed} mixes modalities, text (line 1), image (line 2): one modality per file" in capsys.readouterr().err


def test_continuous_answers_equal_each_job_alone_with_its_seed_and_resume(root, tmp_path, capsys):
    from mmgen.sampling import make_generator

    model = str(root / "llava")
    jobs = [{"model": model, "prompt": PROMPTS[k % 3], "images": [str(root / f"img{k % 3}.png")] if k % 2 else [],
             "output": f"s{k}", "max_new_tokens": 6 + k, "seed": 100 + k, "temperature": 1.0, "decoding": "sjd:adapt=false,window=4"}
            for k in range(5)]
    path = write_jobs(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--continuous", "--no-progress"]) == 0
    pipe = tiny_llava(0)
    for k, job in enumerate(jobs):  # sampled, yet each is its job alone with its own seed
        alone = pipe(job["prompt"], images(3)[k % 3] if k % 2 else None, max_new_tokens=job["max_new_tokens"], temperature=1.0,
                     decoding="sjd:adapt=false,window=4", generator=make_generator(job["seed"]))
        answer = json.loads((out / f"s{k}.json").read_text())
        assert answer["token_ids"] == alone.token_ids[0, : alone.lengths[0]].tolist() and answer["text"] == alone.texts[0]
        assert answer["seed"] == job["seed"] and answer["stats"]["forwards"] == alone.stats.forwards
    capsys.readouterr()
    (out / "s3.json").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--continuous", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["total"]["outputs"] == 1 and json.loads((out / "s3.json").read_text())["seed"] == 103
    assert all((out / name).stat().st_mtime_ns == t for name, t in before.items())


def test_continuous_refuses_jobs_it_cannot_run_before_any_work(root, tmp_path, capsys):
    model, draft = str(root / "llava"), str(root / "llava-draft")
    bad = [{"model": model, "prompt": PROMPTS[0], "output": "a", "decoding": "lookup"},
           {"model": model, "prompt": PROMPTS[0], "output": "b", "decoding": f"draft:drafter={draft}"},
           {"model": model, "prompt": PROMPTS[0], "output": "c", "dropping": "fastv"},
           {"model": model, "prompt": PROMPTS[0], "output": "d"}]
    jobs = write_jobs(tmp_path / "bad.jsonl", bad)
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--continuous"]) == 2
    err = capsys.readouterr().err
    for line, message in [(1, "NGramProposer cannot restart rows"), (2, "DraftModelProposer cannot restart rows"),
                          (3, "--continuous decodes without token dropping")]:
        assert f"line {line}: {message}" in err, err
    assert "line 4" not in err
    assert not (tmp_path / "out").exists()


def test_dry_run_checks_every_setting_of_every_line(root, tmp_path, capsys):
    """Budgets and sampling settings are checked per line before any work (at --dry-run too),
    not when their group runs: a budget past the model's context, or absurd, and every
    sampling setting out of its range."""
    model = str(root / "llava")
    settings = [{"max_new_tokens": 10**12}, {"max_new_tokens": 100_000}, {"top_k": -5}, {"temperature": -1},
                {"top_p": 5}, {"temperature": 1e308}, {}]
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"model": model, "prompt": PROMPTS[0], "output": f"o{i}", **extra}
                                                for i, extra in enumerate(settings)])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    for line, message in [(1, "max_new_tokens must be an integer in [1, 1048576]"), (2, "6 tokens + max_new_tokens 100000 exceed the model's context of 2048"),
                          (3, "top_k must be an integer >= 0"), (4, "temperature must be >= 0"), (5, "top_p must be in (0, 1]"),
                          (6, "temperature must be at most 100.0")]:
        assert f"line {line}: " in err and message in err.split(f"line {line}: ")[1].splitlines()[0], err
    assert "line 7" not in err and not (tmp_path / "out").exists()
