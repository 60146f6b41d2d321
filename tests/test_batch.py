"""The modality-free batch machinery and durable files: atomic files, manifests and resume, grouping and sharding,
line-numbered job files, the summary."""

import importlib
import json
import os
import stat

import pytest

from mmgen import batch, files
from mmgen.batch import (
    LineError,
    ManifestWriter,
    Tally,
    World,
    check_lines,
    form_groups,
    merge_manifest,
    part_path,
    read_jsonl,
    read_records,
    verified_records,
)
from mmgen.files import remove_stale_temp_files, sha256_file, write_atomic


def test_write_atomic_writes_the_whole_file_and_returns_its_checksum(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(b"old")
    digest = write_atomic(path, b"new content")
    assert path.read_bytes() == b"new content" and digest == sha256_file(path)
    assert os.listdir(tmp_path) == ["a.png"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # like open(), not mkstemp's 0o600


def test_write_atomic_failure_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "a.png"
    path.write_bytes(b"old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, b"new")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.png"]


def test_remove_stale_temp_files_removes_only_temp_files(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / f".a.png.0123abcd{files.TEMP_SUFFIX}").write_bytes(b"half")
    (tmp_path / ".hidden").write_bytes(b"keep")
    assert remove_stale_temp_files(tmp_path) == 1
    assert sorted(os.listdir(tmp_path)) == [".hidden", "a.png"]


def test_read_jsonl_numbers_lines_and_reports_bad_ones(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n{"a": \n[1, 2]\n{"a": NaN}\n{"a": 1, "a": 2}\n\xff\n"text"\n')
    values, errors = read_jsonl(path)
    assert values == [(1, {"a": 1}), (5, [1, 2]), (9, "text")]
    assert [e.line for e in errors] == [4, 6, 7, 8]
    assert "NaN is not a JSON number" in errors[1].message and "['a'] given twice" in errors[2].message
    assert errors[3].message == "not UTF-8 text" and str(errors[0]).startswith("line 4: invalid JSON")


def test_check_lines_stops_naming_every_bad_line_or_skips_them(capsys):
    errors = [LineError(7, "bad seed"), LineError(2, "bad count")]
    with pytest.raises(ValueError) as raised:
        check_lines(errors, "stop", "jobs.jsonl")
    message = str(raised.value)
    assert "2 invalid line(s) in jobs.jsonl; nothing was run" in message
    assert message.index("line 2: bad count") < message.index("line 7: bad seed")
    check_lines(errors, "skip", "jobs.jsonl")
    assert capsys.readouterr().err.splitlines() == ["mmgen batch: skipping jobs.jsonl line 2: bad count",
                                                    "mmgen batch: skipping jobs.jsonl line 7: bad seed"]
    check_lines(errors, "skip", "jobs.jsonl", quiet=True)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="on_error must be one of"):
        check_lines([], "ignore", "jobs.jsonl")


def _output(folder, name, data):
    """An output written and recorded the way a batch run does."""
    return {"file": name, "sha256": write_atomic(folder / name, data), "order": int(name[0])}


def test_manifest_resume_counts_only_recorded_files_with_matching_checksums(tmp_path):
    with ManifestWriter(tmp_path, 0) as manifest:
        manifest.append(_output(tmp_path, "1.png", b"one"))
        manifest.append(_output(tmp_path, "2.png", b"two"))
        manifest.append(_output(tmp_path, "3.png", b"three"))
    (tmp_path / "2.png").write_bytes(b"corrupted")  # checksum no longer matches
    (tmp_path / "3.png").unlink()  # recorded but gone
    write_atomic(tmp_path / "4.png", b"four")  # written, then killed before its record
    with open(part_path(tmp_path, 0), "ab") as part:  # a record cut short by SIGKILL
        part.write(b'{"file": "5.png", "sha')
    done = verified_records(tmp_path, read_records(tmp_path))
    assert sorted(done) == ["1.png"]
    # Reopening the part drops the cut line, so the next record starts on its own line.
    with ManifestWriter(tmp_path, 0) as manifest:
        manifest.append(_output(tmp_path, "2.png", b"two again"))
    assert [r["file"] for r in read_records(tmp_path)] == ["1.png", "2.png", "3.png", "2.png"]
    assert sorted(verified_records(tmp_path, read_records(tmp_path))) == ["1.png", "2.png"]
    assert sorted(verified_records(tmp_path, read_records(tmp_path), files={"2.png"})) == ["2.png"]
    drop_one = verified_records(tmp_path, read_records(tmp_path), current=lambda r: None if r["file"] == "1.png" else r)
    assert sorted(drop_one) == ["2.png"]


def test_records_never_point_outside_the_folder(tmp_path):
    (tmp_path / "out").mkdir()
    outside = {"file": "../secret", "sha256": write_atomic(tmp_path / "secret", b"s")}
    with ManifestWriter(tmp_path / "out", 0) as manifest:
        manifest.append(outside)
    assert verified_records(tmp_path / "out", read_records(tmp_path / "out")) == {}


def test_manifest_parts_are_never_written_through_a_link_or_into_a_fifo(tmp_path):
    (tmp_path / "out").mkdir()
    target = tmp_path / "victim.txt"
    target.write_bytes(b"the user's file")
    os.symlink(target, part_path(tmp_path / "out", 0))
    with pytest.raises(OSError, match="is a symbolic link"):
        ManifestWriter(tmp_path / "out", 0)
    os.mkfifo(part_path(tmp_path / "out", 1))
    with pytest.raises(OSError, match="not a regular file"):  # and it does not hang
        ManifestWriter(tmp_path / "out", 1)
    assert target.read_bytes() == b"the user's file"


def test_batch_refuses_a_planted_manifest_link_before_any_work(tmp_path, capsys):
    from mmgen.cli import main

    (tmp_path / "out").mkdir()
    target = tmp_path / "victim.txt"
    target.write_bytes(b"the user's file")
    os.symlink(target, part_path(tmp_path / "out", 0))
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"model": "emoji64", "class_label": 1, "output": "a"}) + "\n")
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "manifest.rank0.jsonl is a symbolic link" in err, err
    assert target.read_bytes() == b"the user's file" and os.listdir(tmp_path / "out") == ["manifest.rank0.jsonl"]


def test_merge_reads_every_world_size_keeps_one_verified_record_per_file_and_sorts(tmp_path):
    # A first run with 3 ranks was killed; rank 2 had written "3.png" with other bytes since replaced.
    with ManifestWriter(tmp_path, 2) as manifest:
        manifest.append(_output(tmp_path, "3.png", b"stale"))
        manifest.append(_output(tmp_path, "1.png", b"one"))
    # The second run has 2 ranks.
    with ManifestWriter(tmp_path, 0) as manifest:
        manifest.append(_output(tmp_path, "3.png", b"three"))
        manifest.append(_output(tmp_path, "1.png", b"one"))  # recorded twice: listed once
    with ManifestWriter(tmp_path, 1) as manifest:
        manifest.append(_output(tmp_path, "2.png", b"two"))
    path, count = merge_manifest(tmp_path, order=lambda r: r["order"])
    assert path == tmp_path / batch.MANIFEST and count == 3
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["file"] for r in records] == ["1.png", "2.png", "3.png"]
    assert records[2]["sha256"] == sha256_file(tmp_path / "3.png")
    assert sorted(p.name for p in tmp_path.glob("manifest*")) == ["manifest.jsonl"]
    assert sorted(verified_records(tmp_path, read_records(tmp_path))) == ["1.png", "2.png", "3.png"]
    # `current` may drop records (a job removed from the file) and update the kept ones.
    merge_manifest(tmp_path, order=lambda r: r["order"], current=lambda r: None if r["file"] == "2.png" else {**r, "order": -r["order"]})
    assert [json.loads(line)["file"] for line in path.read_text().splitlines()] == ["3.png", "1.png"]


def test_form_groups_packs_equal_keys_in_order_of_first_items():
    items = ["a1", "b1", "a2", "a3", "b2", "a4", "c1"]
    groups = form_groups(items, key=lambda s: s[0], size=2)
    assert groups == [["a1", "a2"], ["b1", "b2"], ["a3", "a4"], ["c1"]]
    assert form_groups(items, key=lambda s: s[0], size=1) == [[i] for i in items]
    with pytest.raises(ValueError, match="group size must be an integer >= 1"):
        form_groups(items, key=len, size=0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_sharding_gives_each_group_to_exactly_one_rank(world_size):
    worlds = [World(rank, world_size) for rank in range(world_size)]
    owners = [[w.rank for w in worlds if w.owns(g)] for g in range(11)]
    assert owners == [[g % world_size] for g in range(11)]


def test_world_from_env():
    assert World.from_env({}) == World(0, 1, 0)
    world = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert world == World(3, 4, 1) and world.device("cuda") == "cuda:1" and world.device("cuda:0") == "cuda:0"
    assert World().device("cuda") == "cuda" and world.device("cpu") == "cpu"
    with pytest.raises(ValueError, match="bad torchrun environment"):
        World.from_env({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="must be integers"):
        World.from_env({"RANK": "x"})


def test_tally_tells_each_jobs_status_and_the_table_adds_up():
    tally = Tally([("m", "ar"), ("m", "ar"), ("m", "sjd"), ("m", "sjd")])
    tally.add(0, written=2)
    tally.add(1, existing=3)
    tally.add(2, written=1, existing=1)
    tally.add(3, written=1, failed=1)
    tally.add_seconds(("m", "ar"), 2.0)
    tally.add_seconds(("m", "sjd"), 4.0)
    tally.reduce(World())  # one process: unchanged
    summary = tally.summary(("model", "decoding"), wall_s=8.0, invalid_lines=1)
    ar, sjd = summary.to_dict()["rows"]
    assert (ar["jobs_done"], ar["jobs_skipped"], ar["jobs_failed"], ar["outputs"], ar["outputs_per_s"]) == (1, 1, 0, 2, 1.0)
    assert (sjd["jobs_done"], sjd["jobs_skipped"], sjd["jobs_failed"], sjd["outputs"], sjd["outputs_per_s"]) == (1, 0, 1, 2, 0.5)
    assert summary.to_dict()["total"]["outputs"] == 4 and summary.total.outputs_per_s == 0.5 and tally.failed == 1
    table = summary.table().splitlines()
    assert table[0].split() == ["model", "decoding", "done", "skipped", "failed", "images", "seconds", "images/s"]
    assert table[2].split() == ["m", "ar", "1", "1", "0", "2", "2.00", "1.00"]
    assert table[5].split() == ["total", "2", "1", "1", "4", "8.00", "0.50"]
    assert table[-1] == "invalid lines skipped: 1"


# ---- which runner reads a job file: its lines' modality --------------------------------------


def test_a_line_is_routed_by_its_modality_else_by_the_field_that_marks_it():
    from mmgen import registry

    runners, markers = registry.batch_runners(), registry.batch_markers()
    assert list(runners) == ["image", "text", "speech", "video"]

    def modality(*lines):
        return batch.file_modality("jobs.jsonl", list(enumerate(lines, start=1)), runners, markers)

    assert modality({"class_label": 1}, {"modality": "image", "class_label": 2}) == "image"
    assert modality({"prompt": "cat"}) == "text"  # a prompt alone: an answer
    assert modality({"modality": "video", "prompt": "cat"}, {"modality": "video", "prompt": "dog"}) == "video"
    assert modality({"text": "hi"}, {"modality": "speech", "text": "again"}) == "speech"
    assert modality({"video": "cat"}) == "video"  # the old form, read until the next release
    assert modality({"output": "x"}, [1, 2], "text") is None  # nothing names a modality: the first runner lists the fields
    with pytest.raises(ValueError) as raised:
        modality({"modality": "video", "prompt": "cat"}, {"prompt": "dog"})
    assert str(raised.value) == "jobs.jsonl mixes modalities, video (line 1), text (line 2): one modality per file"
    with pytest.raises(ValueError, match=r'^jobs.jsonl line 1 carries the fields of several modalities, prompt \(text\), '
                                         r'video \(video\): say which in its "modality"$'):
        modality({"prompt": "cat", "video": "cat"})


@pytest.mark.parametrize("value", ["sound", "Video", 3, None, ["video"]])
def test_an_unknown_modality_is_one_line_naming_the_modalities_before_any_work(value, tmp_path, capsys):
    from mmgen.cli import main

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "a"})
                    + "\n" + json.dumps({"modality": value, "prompt": "cat", "output": "b"}) + "\n")
    assert main(["batch", str(jobs), "--out", str(tmp_path / "out"), "--on-error", "skip", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"mmgen: error: {jobs} line 2: unknown modality {json.dumps(value)}; it is one of image, text, speech, video\n"
    assert not (tmp_path / "out").exists()


def test_each_runner_takes_the_modality_field_when_it_names_its_own():
    from mmgen import registry

    for name, module in registry.batch_runners().items():
        runner = importlib.import_module(module)
        assert runner.MODALITY == name  # the runner checks lines against the name it is registered under
    required, optional = {"prompt": "str", "output": "str"}, {"seed": "int"}
    job = {"prompt": "cat", "output": "a"}
    assert batch.check_schema({**job, "modality": "text"}, required, optional, modality="text")["modality"] == "text"
    assert batch.check_schema(job, required, optional, modality="text") == job  # optional
    with pytest.raises(ValueError, match=r'^modality must be "text" in a file of text jobs, got "video"$'):
        batch.check_schema({**job, "modality": "video"}, required, optional, modality="text")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['modality'\]"):
        batch.check_schema({**job, "modality": "text"}, required, optional)  # a schema of no runner


def test_a_record_stays_its_jobs_whether_the_job_names_its_modality_or_old_fields():
    old = {"video": "cat", "output": "a", "seed": 1}
    new = {"modality": "video", "prompt": "cat", "output": "a", "seed": 1}
    assert batch.job_identity(old, {"video": "prompt"}) == batch.job_identity(new, {"video": "prompt"})
    assert batch.job_identity({"class_label": 1, "modality": "image"}) == batch.job_identity({"class_label": 1})
    assert batch.job_identity({**new, "seed": 2}, {"video": "prompt"}) != batch.job_identity(old, {"video": "prompt"})
    assert batch.job_identity("not a job") == "not a job"
