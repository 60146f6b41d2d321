"""`benchmarks/step_latency.py` at the tiny sizes on the CPU, eager (the compiled step itself is
tested in tests/core/test_compiled_steps.py; compiling one costs tens of seconds on this CPU)."""

import json

import pytest
import torch
from torch import nn

from benchmarks.step_latency import TINY, Case, Step, bandwidth, main, measure, weight_bytes


def test_tiny_preset_reports_every_family(tmp_path, capsys):
    report = main(["--preset", "tiny", "--modes", "eager", "--repeats", "2", "--warmup", "1", "--device", "cpu",
                   "--json", str(tmp_path / "step.json")])
    assert [(r["model"], r["mode"]) for r in report["rows"]] == [(m, "eager") for m in TINY]
    for r in report["rows"]:
        assert r["ar_ms"] > 0 and r["verify_ms"] > 0 and r["floor_ms"] > 0
        assert r["ar_over_floor"] == pytest.approx(r["ar_ms"] / r["floor_ms"])
        assert r["verify_over_ar"] == pytest.approx(r["verify_ms"] / r["ar_ms"])
    assert report["bandwidth_source"] == "measured copy" and report["bandwidth_gbps"] > 0
    assert json.loads((tmp_path / "step.json").read_text())["rows"] == report["rows"]
    # The token work after the forward: the torch path here (the kernels where the dispatch picks them).
    assert sorted((r["backend"], r["width"]) for r in report["token_work"]) == [("torch", 1), ("torch", 16)]
    assert all(r["ms"] > 0 and r["vocab"] == 512 for r in report["token_work"])
    out = capsys.readouterr().out
    assert "Token work after each forward" in out and "| torch |" in out
    assert "| llamagen-tiny |" in out and "| 16-token verify |" in out and "var-tiny: next-scale" in out


def test_rows_skip_modes_and_widths_a_model_lacks():
    steps = []
    step = lambda mode, width: None if width == 16 else steps.append((mode, width)) or Step(lambda: None)
    case = Case("fake", 10, 1000, ("eager",), step)
    (row,) = measure(case, ["eager", "compiled"], 16, torch.device("cpu"), repeats=2, warmup=0, floor=1e-3)
    assert steps == [("eager", 1)]
    assert row["mode"] == "eager" and row["ar_ms"] > 0 and row["verify_ms"] is None and row["verify_over_ar"] is None


def test_floor_reads_every_weight_but_embedding_tables():
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 4, bias=False), nn.Sequential(nn.Linear(4, 4)))
    assert weight_bytes(model) == 4 * (8 * 4 + 4 * 4 + 4)
    assert weight_bytes(model, skip=(model[2],)) == 4 * 8 * 4
    assert bandwidth(torch.device("cpu"), 3350.0) == (3.35e12, "--bandwidth")


def test_a_table_tied_to_the_output_head_is_read_by_every_step():
    embed, head = nn.Embedding(100, 8), nn.Linear(8, 100, bias=False)
    head.weight = embed.weight  # tied, as Qwen2.5-VL-3B's: the head reads all of it every step
    assert weight_bytes(nn.ModuleDict({"embed": embed, "head": head})) == 4 * 100 * 8


def test_the_vlm_case_has_qwen2_5_vl_3b_dimensions():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from benchmarks.step_latency import QWEN2_5_VL_3B

    with torch.device("meta"):  # shapes only: nothing allocated
        model = Qwen2_5_VLForConditionalGeneration._from_config(Qwen2_5_VLConfig(**QWEN2_5_VL_3B), dtype=torch.bfloat16)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 3.75  # the published 3B model's count
    assert 5.7 < weight_bytes(model, skip=(model.model.visual,)) / 2**30 < 5.8  # language model and tied head, bf16
