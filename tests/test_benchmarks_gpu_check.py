"""`benchmarks/gpu_check.py` on the CPU (`--small`: every section on tiny models), its time
boxes, its bad-input errors, what `import mmgen` and the check import, and the wheel folder of
`benchmarks/gpu_wheels.py` in a fresh venv (the bare GPU machine's environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import SECTIONS, Context, Section, main, run_all

ROOT = Path(__file__).parents[1]


def python(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_small_run_reports_every_section(tmp_path):
    begun = time.perf_counter()
    # The device tests narrowed to two official references: the whole folder runs in the suite anyway.
    result = python("-m", "benchmarks.gpu_check", "--small", "--out", str(tmp_path), "--tests", "official and (llamagen or var)")
    took = time.perf_counter() - begun
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["name"] for s in report["sections"]] == [s.name for s in SECTIONS]
    status = {s["name"]: s["status"] for s in report["sections"]}
    assert status.pop("step:GPT-XL:compiled") == "skipped"  # CUDA graphs: not with --small
    assert set(status.values()) == {"ok"}, {k: v for k, v in status.items() if v != "ok"}
    assert report["small"] and report["device"] == "cpu" and report["seconds"] < report["budget_seconds"] < 60
    result_of = {s["name"]: s["result"] for s in report["sections"]}
    assert result_of["environment"]["torch"] == torch.__version__ and result_of["environment"]["kernels"] == "twin"
    tests = result_of["device_tests"]
    assert tests["passed"] == 3 and tests["failed"] == tests["errors"] == 0 and "MMGEN_TEST_DEVICE=cpu" in tests["command"]
    for name in [s.name for s in SECTIONS if s.name.startswith("step:") and s.small]:
        (row,) = result_of[name]["rows"]
        assert row["mode"] == "eager" and row["ar_ms"] > 0 and row["floor_ms"] > 0, name
        assert (row["verify_ms"] is None) == (name == "step:wan-1.3b"), name  # a video block has no verify window
    assert {(r["rule"], r["case"]) for r in result_of["rule_cost"]["rules"]} >= {("sjd (exact)", "call"), ("gsd", "call")}
    decoders = result_of["decoders"]["rows"]
    assert [(r["method"], r["batch"]) for r in decoders] == [(m, b) for b in (1, 8) for m in ("ar", "sjd", "gsd", "lantern")]
    assert all(r["speedup_vs_ar"] > 0 and r["step_compression"] >= 1 for r in decoders)
    batching = result_of["continuous_batching"]["rows"]
    assert [(r["method"], r["batch"]) for r in batching] == [(m, b) for b in (8, 32) for m in ("ar", "sjd:adapt=false")]
    assert all(r["identical_to_alone"] == "2/2" and r["continuous_images_per_s"] > 0 for r in batching)
    proposers = result_of["proposers"]["rows"]
    assert [(r["proposer"], r["batch"]) for r in proposers] == [(p, b) for b in (1, 8) for p in ("heads", "skip", "heads:tree=3")]
    assert all(r["draft_ms"] > 0 and r["verify_ms"] > 0 and r["ar_ms"] > 0 for r in proposers)
    assert [r["verify_tokens"] for r in proposers[:3]] == [4, 4, 10]  # a chain's window; the tree's 1 + 3 x 3
    goals = {g["what"] for g in report["goals"]}
    assert "llamagen-tiny eager ar_over_floor" in goals and "sjd batch 8 speedup / step compression" in goals
    text = (tmp_path / "report.md").read_text()
    for title in [s.title for s in SECTIONS] + ["## Goals"]:
        assert title in text, title
    assert took < 60
    # A second run does not overwrite the report without --overwrite.
    again = python("-m", "benchmarks.gpu_check", "--small", "--out", str(tmp_path), "--sections", "environment")
    assert again.returncode == 2 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def test_a_failing_or_slow_section_is_written_down_and_the_next_one_runs(monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_SECONDS", 0.1)  # boxes of a second, for a quick test
    # The release after a section collects the process's garbage, seconds in a long test session
    # (CI measured 3-4 s): a section's record counts its own time only.
    released = []
    monkeypatch.setattr(gpu_check, "_release", lambda ctx: (released.append(1), time.sleep(2)))
    def broken(ctx, result):
        result["partial"] = 1
        raise RuntimeError("a broken section")

    def slow(ctx, result):
        result["before"] = True
        time.sleep(5)

    def fine(ctx, result):
        result["ran"] = True

    sections = [Section("broken", "Broken", broken, 5, 5), Section("slow", "Slow", slow, 1, 1), Section("fine", "Fine", fine, 5, 5)]
    ctx = Context(torch.device("cpu"), torch.float32, True, None, Path("."))
    saved = []
    records = run_all(sections, ctx, budget=30, isolate=False, argv=[], on_record=lambda r: saved.append(len(r)))
    assert [r["status"] for r in records] == ["failed", "timed out", "ok"]
    assert "RuntimeError: a broken section" in records[0]["error"] and "Traceback" in records[0]["error"]
    assert records[0]["result"] == {"partial": 1} and records[1]["result"] == {"before": True}
    assert records[1]["seconds"] < 3 and "time.sleep" in records[1]["error"]
    assert records[2]["result"] == {"ran": True} and saved == [1, 2, 3]  # the report is rewritten after each
    assert released == [1, 1, 1] and records[0]["seconds"] < 1.5 and records[2]["seconds"] < 1.5
    # The deadline cuts what does not fit: here nothing is left after the first section.
    records = run_all([Section("a", "A", slow, 1.5, 1.5), sections[2]], ctx, budget=1.5, isolate=False, argv=[])
    assert [r["status"] for r in records] == ["timed out", "skipped"] and "no time left" in records[1]["error"]


def test_an_isolated_section_runs_in_its_own_process(tmp_path):
    result = python("-m", "benchmarks.gpu_check", "--small", "--isolate", "--sections", "environment", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    (section,) = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert section["status"] == "ok" and section["result"]["device"] == "cpu"


@pytest.mark.parametrize("argv, message", [
    (["--sections", "nope"], "unknown section(s) nope"),
    (["--budget", "0"], "--budget must be > 0"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--small", "--out", str(tmp_path), *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_real_sizes_need_a_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device here" in capsys.readouterr().err
    assert main(["--out", str(tmp_path), "--device", "cpu"]) == 2
    assert "would take hours" in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_import_mmgen_and_the_check_leave_gradio_av_and_soundfile_unimported():
    """What the bare GPU machine lacks must stay lazy: `import mmgen`, the check, and the modules
    its sections import (diffusers itself imports soundfile where it is installed, so the
    video section is checked in the bare venv of the next test instead)."""
    code = """
import sys
import mmgen, benchmarks.gpu_check
import mmgen.image_ar.llamagen, mmgen.image_ar.janus, mmgen.image_ar.var, mmgen.image_ar.bench, mmgen.vlm.token_model
import mmgen.audio.pipeline, mmgen.audio.dia, mmgen.kernels
import benchmarks.step_latency, benchmarks.rule_cost, benchmarks.continuous_batching, benchmarks.tts_decoding
print(sorted(m for m in ("gradio", "av", "soundfile") if m in sys.modules))
"""
    result = python("-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_wheel_folder_installs_into_a_fresh_venv_and_the_check_imports_there(tmp_path):
    """`benchmarks.gpu_wheels --local --check-venv`: the wheels for this interpreter (downloaded
    through pip: its cache, or the index), installed with --no-index --no-deps into a venv that
    sees only this environment's torch (with its requirements) and numpy, then mmgen from a copy
    of the code without assets; mmgen and the check import there without gradio, av or
    soundfile, and the device tests against transformers' and the official references pass."""
    result = python("-m", "benchmarks.gpu_wheels", "--local", "--out", str(tmp_path / "wheels"), "--check-venv", str(tmp_path),
                    timeout=600)
    if result.returncode and "pip download failed" in result.stderr and any(
            s in result.stderr for s in ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution")):
        pytest.skip("the package index is unreachable from here")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    manifest = json.loads((tmp_path / "wheels" / "manifest.json").read_text())
    assert manifest["bytes"] <= manifest["limit_bytes"] and any(p.startswith("transformers==") for p in manifest["pins"])
    assert not any(p.split("==")[0].lower() in ("torch", "numpy", "gradio", "av", "soundfile", "scipy") for p in manifest["pins"])
    assert "ok 5." in result.stdout and "absent: gradio,av,soundfile" in result.stdout
    ran = next(line for line in result.stdout.splitlines() if line.startswith("device tests in the fresh venv:"))
    assert " passed" in ran and "failed" not in ran and "error" not in ran, ran
