"""`benchmarks/continuous_batching.py` on the bundled emoji64, one repeat: the rows it reports."""

import json

from benchmarks.continuous_batching import main


def test_rows_for_static_and_continuous_batches(tmp_path):
    rows = main(["--model", "emoji64", "--requests", "4", "--batch-size", "2", "--repeats", "1", "--threads", "1",
                 "--methods", "ar", "sjd:adapt=false", "--check", "2", "--json", str(tmp_path / "rows.json")])
    by = {r["method"]: r for r in rows}
    # AR rows all end together: continuous batching adds one prefill per request and saves nothing.
    assert by["ar"]["static_forwards"] == 2 * 64 and by["ar"]["continuous_forwards"] == 4 + 2 * 63
    assert by["sjd:adapt=false"]["continuous_forwards"] < 4 * 64
    assert by["ar"]["continuous_row_utilisation"] == 1.0 and 0 < by["sjd:adapt=false"]["static_row_utilisation"] <= 1
    assert all(r["identical_to_alone"] == "2/2" and r["continuous_images_per_s"] > 0 for r in rows)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows

