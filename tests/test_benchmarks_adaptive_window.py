"""`benchmarks/adaptive_window.py` on the bundled emoji64, one repeat: the rows it reports."""

import json

import pytest

from benchmarks.adaptive_window import main


def test_rows_for_ar_fixed_and_adaptive(tmp_path, capsys):
    rows = main(["--model", "emoji64", "--repeats", "1", "--threads", "1", "--methods", "ar", "sjd:adapt=false", "sjd",
                 "--json", str(tmp_path / "rows.json")])
    by = {r["method"]: r for r in rows}
    assert by["ar"]["forwards"] == 64 and by["ar"]["speedup_vs_first"] == 1.0 and by["ar"]["modelled_cost_per_token"] == pytest.approx(1.0)
    assert by["sjd:adapt=false"]["drafts_per_forward"] == 15 and by["sjd:adapt=false"]["step_compression"] > 1
    assert 0 < by["sjd"]["drafts_per_forward"] <= 15  # adaptive by default
    assert 0 < by["ar"]["token_cost"] < 1
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert "| sjd:adapt=false |" in capsys.readouterr().out
