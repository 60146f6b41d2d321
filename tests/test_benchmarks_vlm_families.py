"""`benchmarks/vlm_families.py --smoke` on two families (the tiny test configs, one timed round):
each row times both sides, and mmgen's `ar` gives transformers' own greedy tokens."""

import json

from benchmarks.vlm_families import CHECKPOINTS, main


def test_smoke_rows_time_both_sides_with_the_same_tokens(tmp_path):
    out = tmp_path / "families.json"
    result = main(["--smoke", "--families", "llava", "qwen2_vl", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = {r["family"]: r for r in result["rows"]}
    assert set(rows) == {"llava", "qwen2_vl"}
    for row in rows.values():
        assert row["identical"] and row["tokens"] >= 1
        for side in ("mmgen", "generate"):
            assert 0 < row[f"{side}_ttft_ms"] <= row[f"{side}_total_ms"]
        assert row["ratio_of_medians"] == round(row["generate_total_ms"] / row["mmgen_total_ms"], 3)
        # One round: its ratio is the medians', up to the rounding of each total to 0.1 ms (a few
        # percent on a tiny model's few-millisecond answers) and of each ratio to 3 decimals.
        g, m = row["generate_total_ms"], row["mmgen_total_ms"]
        assert abs(row["ratio"] - row["ratio_of_medians"]) <= row["ratio"] * (0.05 / g + 0.05 / m) * 1.01 + 0.001



def test_every_registered_family_has_a_checkpoint():
    from tests.vlm.tiny import BUILDERS

    assert set(CHECKPOINTS) == set(BUILDERS)
    for spec in CHECKPOINTS.values():
        assert 1 <= spec.text_layers <= spec.real_text_layers and 1 <= spec.vision_layers <= spec.real_vision_layers
