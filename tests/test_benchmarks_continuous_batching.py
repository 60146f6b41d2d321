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


def test_vlm_rows_for_static_and_continuous_batches(tmp_path):
    from benchmarks.vlm_continuous_batching import main as vlm_main

    rows = vlm_main(["--questions", "6", "--batch-size", "2", "--repeats", "1", "--threads", "1", "--methods", "ar",
                     "--max-new-tokens", "12", "--json", str(tmp_path / "vlm.json")])
    (row,) = rows
    assert row["answers_equal_static"] == "6/6" and row["answers"] == 6 and row["same_tokens"] and row["tokens"] > 6
    # One prefill per question, and refilled rows need no more decode forwards than static calls.
    assert row["continuous_forwards"] - 6 <= row["static_forwards"] - 3
    assert row["static_answers_per_s"] > 0 and row["continuous_answers_per_s"] > 0
    assert json.loads((tmp_path / "vlm.json").read_text()) == rows


def test_tts_rows_for_static_and_continuous_batches(tmp_path):
    from benchmarks.tts_continuous_batching import main as tts_main

    rows = tts_main(["--texts", "4", "--batch-size", "2", "--repeats", "1", "--threads", "1", "--methods", "ar",
                     "--max-new-frames", "40", "--json", str(tmp_path / "tts.json")])
    (row,) = rows
    assert row["utterances_equal_static"] == "4/4" and row["same_tokens"] and row["utterances"] == 4
    assert row["continuous_forwards"] - 4 <= row["static_forwards"] - 2
    assert row["static_utterances_per_s"] > 0 and row["continuous_utterances_per_s"] > 0
    written = json.loads((tmp_path / "tts.json").read_text())
    assert written["rows"] == rows and written["threads"] == 1 and not written["sampled"]
    assert written["command"].startswith("python -m benchmarks.tts_continuous_batching --texts 4")
