"""`mmgen batch` end to end on the bundled emoji64 model: validation, resume after SIGKILL,
two torchrun ranks, reproducibility of every image, failures that do not stop the run."""

import hashlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields

import pytest
import torch

from mmgen.cli import main
from mmgen.image_ar.batch import OPTIONAL
from mmgen.image_ar.generation import ImageCall, ImageOptions

JOBS = [
    {"model": "emoji64", "class_label": "cat-face", "seed": 0, "decoding": "ar", "count": 3, "output": "cat"},
    {"model": "emoji64", "class_label": 25, "seed": 100, "decoding": "ar", "count": 2, "output": "mammal", "top_k": 64},
    {"model": "emoji64", "class_label": 3, "seed": 5, "decoding": "sjd", "count": 1, "output": "face"},
    {"model": "emoji64", "class_label": "heart", "seed": 7, "decoding": "ar", "count": 3, "output": "heart"},
    {"model": "emoji64", "class_label": 4, "seed": 9, "decoding": "sjd", "count": 2, "output": "concerned"},
]
#: Every image, in job order. With --batch-size 2 the rows form 6 groups, two of them mixing jobs.
FILES = [f"{job['output']}_{k:03d}.png" for job in JOBS for k in range(job["count"])]


def write_jobs(path, jobs, extra_lines=()):
    path.write_text("".join(json.dumps(job) + "\n" for job in jobs) + "".join(line + "\n" for line in extra_lines))
    return path


def batch_env():
    """One thread per process (two ranks share two cores) and no inherited torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def batch_command(jobs, out, *launcher):
    return [sys.executable, *(launcher or ["-m", "mmgen.cli"]), "batch", str(jobs), "--out", str(out), "--batch-size", "2", "--no-progress"]


def run_batch(jobs, out, *launcher):
    result = subprocess.run(batch_command(jobs, out, *launcher), env=batch_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])["summary"]


def run_here(jobs, out, capsys):
    """The same command in this process (one thread, as in the subprocesses: the same numerics)."""
    assert main(["batch", str(jobs), "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_outputs(out, reference=None):
    """Every job has exactly its images, each listed once in manifest.jsonl (job order) with its
    checksum; no temp files or manifest parts are left; the images equal `reference`'s."""
    assert sorted(os.listdir(out)) == sorted(FILES + ["manifest.jsonl"])
    records = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [r["file"] for r in records] == FILES
    assert all(r["sha256"] == sha256(out / r["file"]) for r in records)
    if reference is not None:
        assert all((out / name).read_bytes() == (reference / name).read_bytes() for name in FILES)
        assert [r["group"] for r in records] == [r["group"] for r in read_manifest(reference)]
    return records


def read_manifest(out):
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted single-process run."""
    root = tmp_path_factory.mktemp("reference")
    summary = run_batch(write_jobs(root / "jobs.jsonl", JOBS), root / "out")
    assert summary["total"]["outputs"] == len(FILES) and summary["total"]["jobs_done"] == len(JOBS)
    check_outputs(root / "out")
    return root / "out"


@pytest.fixture
def one_thread():
    """In-process runs use one thread, as the subprocess runs do (same numerics, less contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_reference_groups_and_records(reference):
    records = read_manifest(reference)
    groups = {r["group"]["index"]: r["group"]["members"] for r in records}
    assert groups == {0: ["cat_000.png", "cat_001.png"], 1: ["cat_002.png", "heart_000.png"], 2: ["mammal_000.png", "mammal_001.png"],
                      3: ["face_000.png", "concerned_000.png"], 4: ["heart_001.png", "heart_002.png"], 5: ["concerned_001.png"]}
    heart = records[FILES.index("heart_000.png")]
    # the group's generator is seeded from both rows' seeds (cat row 2: 0 + 2; heart row 0: 7)
    expected_seed = int.from_bytes(hashlib.sha256(b"2,7").digest()[:8], "big") >> 1
    assert heart["group"]["seed"] == expected_seed and heart["group"]["row"] == 1 and heart["class_id"] == 8
    assert "seed" not in heart  # a row has no seed of its own in a group of several
    lone = records[FILES.index("concerned_001.png")]
    assert lone["group"]["seed"] == lone["spec"]["seed"] + 1  # a group of one: the row's own seed
    assert heart["spec"] == JOBS[3] and heart["line"] == 4 and heart["stats"]["rows"] == 2 and heart["stats"]["forwards"] == 64


def test_sigkill_midway_then_rerun_resumes_without_corrupt_missing_or_duplicate_files(reference, tmp_path, capsys, one_thread):
    jobs, out = write_jobs(tmp_path / "jobs.jsonl", JOBS), tmp_path / "out"
    stderr = open(tmp_path / "stderr", "w")
    process = subprocess.Popen(batch_command(jobs, out), env=batch_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    part, deadline = out / "manifest.rank0.jsonl", time.monotonic() + 240
    while not (part.is_file() and b"\n" in part.read_bytes()):
        assert process.poll() is None, (tmp_path / "stderr").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    stderr.close()
    assert not (out / "manifest.jsonl").exists()  # killed before the end
    assert len(part.read_bytes().splitlines()) < len(FILES)
    summary = run_batch(jobs, out)
    assert 0 < summary["total"]["outputs"] < len(FILES)
    check_outputs(out, reference)
    again = run_here(jobs, out, capsys)  # nothing left to do
    assert again["total"]["outputs"] == 0 and again["total"]["jobs_skipped"] == len(JOBS)
    check_outputs(out, reference)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_ranks_equal_one_process_and_resume_with_another_world_size(reference, tmp_path, capsys, one_thread):
    jobs, out = write_jobs(tmp_path / "jobs.jsonl", JOBS), tmp_path / "out"
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "mmgen.cli"]
    summary = run_batch(jobs, out, *torchrun)
    assert summary["total"]["outputs"] == len(FILES) and summary["total"]["jobs_done"] == len(JOBS)
    records = check_outputs(out, reference)
    assert {(r["rank"], r["world_size"]) for r in records} == {(0, 2), (1, 2)}
    assert all(r["rank"] == r["group"]["index"] % 2 for r in records)
    # One image deleted, one corrupted: one process regenerates exactly those two.
    (out / "heart_002.png").unlink()
    (out / "cat_000.png").write_bytes(b"not a png")
    summary = run_here(jobs, out, capsys)
    assert summary["total"]["outputs"] == 2 and summary["total"]["jobs_done"] == 2 and summary["total"]["jobs_skipped"] == 3
    check_outputs(out, reference)


def test_batch_size_1_equals_generate_image_with_each_rows_seed(tmp_path, one_thread):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [{"model": "emoji64", "class_label": "cat-face", "seed": 3, "decoding": "sjd",
                                                 "count": 2, "output": "cat", "temperature": 0.9}])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "batch"), "--batch-size", "1", "--no-progress"]) == 0
    for k in range(2):
        assert main(["generate", "image", "--class-labels", "cat-face", "--decoding", "sjd", "--temperature", "0.9",
                     "--seed", str(3 + k), "--out", str(tmp_path / f"gen{k}"), "--no-progress"]) == 0
        generated = tmp_path / f"gen{k}" / f"000_class7_emoji64_seed{3 + k}_sjd_temperature=0.9.png"
        assert (tmp_path / "batch" / f"cat_{k:03d}.png").read_bytes() == generated.read_bytes()


def test_each_record_says_how_to_regenerate_its_group(reference, tmp_path, one_thread):
    record = read_manifest(reference)[FILES.index("concerned_000.png")]
    group = record["group"]
    assert group["members"] == ["face_000.png", "concerned_000.png"] and group["row"] == 1
    seed = int.from_bytes(hashlib.sha256(b"5,9").digest()[:8], "big") >> 1  # face row 0 (seed 5), concerned row 0 (9)
    assert group["seed"] == seed
    assert group["command"] == f"mmgen generate image --model emoji64 --decoding=sjd --seed {seed} --class-labels 3 4 --out OUT"
    argv = shlex.split(group["command"].replace("OUT", str(tmp_path)))[1:]
    assert main([*argv, "--no-progress"]) == 0
    assert record["command_file"] == f"001_class4_emoji64_seed{seed}_sjd.png"
    assert (tmp_path / record["command_file"]).read_bytes() == (reference / "concerned_000.png").read_bytes()


BAD_LINES = [
    '{"model": "emoji64", "class_label": "no-such-class", "seed": 0, "decoding": "ar", "count": 1, "output": "x"}',
    '{"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 0, "output": "y"}',
    '{"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "../z"}',
    '{"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "A"}',
    '{"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "lantern:dleta=0.2", "count": 1, "output": "w"}',
    '{"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "v", "num_iter": 4}',
    '{"model": "no/such/model", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "u"}',
    '{"model": "emoji64", "class_label": 1, "seed": "0", "decoding": "ar", "count": 1, "output": "t", "colour": 1}',
    '{"model": "emoji64", "class_label": 1, "decoding": "ar", "count": 1, "output": "s"}',
    '{"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "r", "top_p": 2}',
    '{"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "q", "seed": 1}',
    '{"model": "emoji64", ',
]
BAD_MESSAGES = [
    "line 2: unknown class name 'no-such-class'",
    "line 3: count must be in [1, 10000], got 0",
    "line 4: output '../z' is not a safe file-name stem",
    "line 5: output 'A' is already used by line 1",
    "line 6: unknown option(s) ['dleta']",
    "line 7: LlamaGenPipeline has no option(s) ['num_iter']",
    "line 8: cannot load model 'no/such/model'",
    "line 9: unknown field(s) ['colour']",
    "line 10: missing field(s) ['seed']",
    "line 11: top_p must be in (0, 1], got 2",
    "line 12: invalid JSON: field(s) ['seed'] given twice",
    "line 13: invalid JSON",
]


def test_bad_lines_stop_the_run_before_any_work_or_are_skipped(tmp_path, capsys, one_thread):
    valid = {"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "a"}
    jobs = write_jobs(tmp_path / "jobs.jsonl", [valid], BAD_LINES)
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"mmgen: error: {len(BAD_LINES)} invalid line(s) in {jobs}; nothing was run" in err
    for message in BAD_MESSAGES:
        assert message in err, message
    assert not (tmp_path / "out").exists()
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--on-error", "skip", "--no-progress"]) == 0
    captured = capsys.readouterr()
    for message in BAD_MESSAGES:
        assert f"mmgen batch: skipping {jobs} {message}" in captured.err, message
    assert sorted(os.listdir(tmp_path / "out")) == ["a_000.png", "manifest.jsonl"]
    assert f"invalid lines skipped: {len(BAD_LINES)}" in captured.out


def test_a_failing_group_is_reported_the_run_goes_on_and_a_rerun_finishes_it(tmp_path, capsys, monkeypatch, one_thread):
    jobs = [{"model": "emoji64", "class_label": c, "seed": 10 * c, "decoding": "ar", "count": 1, "output": f"c{c}"} for c in (1, 2, 3)]
    path, out = write_jobs(tmp_path / "jobs.jsonl", jobs), tmp_path / "out"
    call = ImageCall.__call__

    def flaky(self, inputs, seed, device):
        if seed == 10:
            raise RuntimeError("out of memory (simulated)")
        return call(self, inputs, seed, device)

    monkeypatch.setattr(ImageCall, "__call__", flaky)
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "mmgen batch: group 0 (lines 1) failed: RuntimeError: out of memory (simulated)" in captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])["summary"]["total"]
    assert (summary["jobs_done"], summary["jobs_failed"], summary["outputs"]) == (2, 1, 2)
    assert [r["file"] for r in read_manifest(out)] == ["c2_000.png", "c3_000.png"]
    monkeypatch.setattr(ImageCall, "__call__", call)
    # An edited job is regenerated too: its old image no longer counts as finished.
    jobs[2]["class_label"] = 4
    write_jobs(path, jobs)
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]["total"]
    assert (summary["jobs_done"], summary["jobs_skipped"], summary["outputs"]) == (2, 1, 2)
    records = read_manifest(out)
    assert [(r["file"], r["class_id"]) for r in records] == [("c1_000.png", 1), ("c2_000.png", 2), ("c3_000.png", 4)]
    assert sorted(os.listdir(out)) == ["c1_000.png", "c2_000.png", "c3_000.png", "manifest.jsonl"]


def test_dry_run_checks_and_plans_without_writing(tmp_path, capsys):
    jobs = write_jobs(tmp_path / "jobs.jsonl", JOBS)
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--batch-size", "2", "--dry-run"]) == 0
    assert "5 valid job(s), 11 image(s) in 6 group(s) of up to 2; 0 invalid line(s)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_image_jobs_may_name_their_modality_and_naming_it_later_remakes_nothing(tmp_path, capsys, one_thread):
    jobs = [{"model": "emoji64", "class_label": c, "seed": c, "decoding": "ar", "count": 1, "output": f"c{c}"} for c in (1, 2)]
    jobs[0]["modality"] = "image"
    path, out = write_jobs(tmp_path / "jobs.jsonl", jobs), tmp_path / "out"
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    capsys.readouterr()
    made = {name: (out / name).stat().st_mtime_ns for name in ("c1_000.png", "c2_000.png")}
    jobs[1]["modality"] = "image"
    write_jobs(path, jobs)
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "1", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]["total"]
    assert (summary["jobs_skipped"], summary["outputs"]) == (2, 0)
    assert all((out / name).stat().st_mtime_ns == t for name, t in made.items())
    assert [r["spec"] for r in read_manifest(out)] == jobs  # the records follow the file


def test_job_fields_are_the_generate_image_options():
    # The modality's own fields and the built-in families' options (their records, `mmgen.image_ar`); `family`
    # holds a plugin family's own options, each a job field of its own name (tests/test_family_records.py)
    from mmgen import registry

    fields_ = set(OPTIONAL) | set(registry.family_options("image")) | {"decoding", "family"}
    assert fields_ == {f.name for f in fields(ImageOptions)}


def test_var_and_mar_jobs_take_their_family_options_and_records_reproduce_them(tmp_path, capsys, one_thread):
    from tests.image_ar.test_mar_pipeline import tiny_model, tiny_vae
    from tests.image_ar.test_var_pipeline import tiny_transformer, tiny_vqvae
    from mmgen.image_ar.mar import MARPipeline
    from mmgen.image_ar.var import VARPipeline

    VARPipeline(tiny_transformer(), tiny_vqvae()).save_pretrained(tmp_path / "var")
    MARPipeline(tiny_model(), tiny_vae()).save_pretrained(tmp_path / "mar")
    var, mar = str(tmp_path / "var"), str(tmp_path / "mar")
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        {"model": var, "class_label": 3, "seed": 1, "decoding": "ar", "count": 2, "output": "v", "preset": "demo",
         "more_smooth": True, "pruning": "3=0.5", "pruning_layers": [0, 2]},
        {"model": mar, "class_label": 2, "seed": 1, "decoding": "ar", "count": 2, "output": "m", "num_iter": 3,
         "cfg_schedule": "constant", "guidance_scale": 2},
    ], [json.dumps({"model": mar, "class_label": 2, "seed": 1, "decoding": "ar", "count": 1, "output": "x", "top_k": 3}),
        json.dumps({"model": var, "class_label": 2, "seed": 1, "decoding": "ar", "count": 1, "output": "y", "cfg_interval": 3})])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--on-error", "skip", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "line 3: MARPipeline has no option(s) ['top_k']" in err and "line 4: VARPipeline has no option(s) ['cfg_interval']" in err
    records = read_manifest(tmp_path / "out")
    assert [r["file"] for r in records] == ["v_000.png", "v_001.png", "m_000.png", "m_001.png"]
    seed = records[1]["group"]["seed"]  # rows 0 and 1 of a job of seed 1: seeded from both, "1,2"
    assert seed == int.from_bytes(hashlib.sha256(b"1,2").digest()[:8], "big") >> 1 == records[3]["group"]["seed"]
    assert f"--preset=demo --more-smooth --pruning=3=0.5 --pruning-layers 0 2 --seed {seed}" in records[1]["group"]["command"]
    assert f"--guidance-scale=2.0 --num-iter=3 --cfg-schedule=constant --seed {seed}" in records[3]["group"]["command"]
    for record in (records[1], records[3]):
        argv = shlex.split(record["group"]["command"].replace("OUT", str(tmp_path / "again")))[1:]
        assert main([*argv, "--no-progress"]) == 0
        again = tmp_path / "again" / record["command_file"]
        assert again.name.startswith(f"{record['group']['row']:03d}_class{record['class_id']}_")
        assert again.read_bytes() == (tmp_path / "out" / record["file"]).read_bytes()


def test_every_rows_seed_reaches_its_groups_generator():
    """A job's seed changes its images wherever it sits in a group (not only when first)."""
    from mmgen.batch import group_seed as seed_of
    from mmgen.image_ar.batch import ImageJob, Row

    group_seed = lambda rows: seed_of([row.seed for row in rows])  # noqa: E731

    job = lambda seed: ImageJob(1, {"seed": seed, "output": "x"}, 0, ImageOptions(decoding="ar"))
    first = Row(job(0), 0)
    assert group_seed([first, Row(job(9), 0)]) != group_seed([first, Row(job(10), 0)])
    assert group_seed([Row(job(9), 0), first]) != group_seed([first, Row(job(9), 0)])  # order is part of the call
    assert group_seed([Row(job(9), 2)]) == 11  # alone: its own seed, as `generate image --seed 11`
    assert 0 <= group_seed([first, Row(job(2**63 - 2), 0)]) < 2**63


CONTINUOUS_JOBS = [
    {"model": "emoji64", "class_label": "cat-face", "seed": 3, "decoding": "sjd:adapt=false", "count": 3, "output": "cat"},
    {"model": "emoji64", "class_label": 25, "seed": 40, "decoding": "sjd", "count": 2, "output": "mammal"},  # adaptive
    {"model": "emoji64", "class_label": 4, "seed": 9, "decoding": "ar", "count": 1, "output": "concerned"},
]


def test_continuous_batching_gives_every_image_its_seeds_image_and_resumes(tmp_path, capsys, one_thread):
    """--continuous: each image equals `generate image --seed <its seed>` whatever rows it shared
    forwards with; records hold that command; a rerun after deleting an image remakes only it."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", CONTINUOUS_JOBS)
    out = tmp_path / "out"
    command = ["batch", str(jobs), "--out", str(out), "--batch-size", "2", "--continuous", "--no-progress"]
    assert main(command) == 0
    records = read_manifest(out)
    assert [r["file"] for r in records] == ["cat_000.png", "cat_001.png", "cat_002.png", "mammal_000.png", "mammal_001.png",
                                            "concerned_000.png"]
    for record in records[1:4:2] + records[5:]:  # one row of each job
        assert record["stats"]["rows"] == 1
        argv = shlex.split(record["command"].replace("OUT", str(tmp_path / "gen")))[1:]
        assert main([*argv, "--no-progress"]) == 0
        assert (tmp_path / "gen" / record["command_file"]).read_bytes() == (out / record["file"]).read_bytes()
    assert "--seed 4 " in records[1]["command"]
    # The adaptive window's rows judge widths at the batch's cost: the command names its rows.
    assert "--decoding=sjd:batch_rows=2 --seed 40 " in records[3]["command"]
    before = {r["file"]: r["sha256"] for r in records}
    (out / "mammal_001.png").unlink()
    capsys.readouterr()
    assert main(command) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["total"]["outputs"] == 1
    assert {r["file"]: r["sha256"] for r in read_manifest(out)} == before


def test_continuous_batching_refuses_jobs_it_cannot_run_before_any_work(tmp_path, capsys):
    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        {"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "lookup", "count": 1, "output": "a"},
        {"model": "var-emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "b"},
    ])
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--continuous", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "line 1: " in err and "cannot restart rows" in err
    assert "line 2: VARPipeline has no continuous batching" in err
    assert not (tmp_path / "out").exists()
