"""benchmarks/inference_mode.py runs both modes on a bundled model and compares their outputs."""

from benchmarks import inference_mode


def test_both_modes_run_and_give_the_same_images(tmp_path):
    out = tmp_path / "modes.json"
    result = inference_mode.main(["--cases", "image-ar", "--repeats", "1", "--images", "1", "--json", str(out)])
    (row,) = result["rows"]
    assert row["same_outputs"] and row["ratio"] > 0 and out.exists()
    assert set(row["median_s"]) == {"no_grad", "inference_mode"}
