"""`benchmarks/window_cost.py` on a copy of the bundled emoji-vlm, two questions, one repeat: it
measures every width's cost and tokens per forward, compares the two cost models and stores both
where loading reads them."""

import json
import shutil

import torch

import mmgen
from benchmarks.window_cost import WIDTHS, main, measure
from mmgen import registry


def test_measures_compares_and_writes_the_curve_and_tokens(tmp_path, capsys):
    folder = tmp_path / "emoji-vlm"
    shutil.copytree(registry.bundled_models()["emoji-vlm"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("mmgen_window_cost")
    config.pop("mmgen_window_tokens", None)
    (folder / "config.json").write_text(json.dumps(config))
    threads = torch.get_num_threads()
    try:  # --threads 1 sets torch's count for the process: the curve is stored, and read, under it
        result = main(["--model", str(folder), "--inputs", "2", "--repeats", "1", "--threads", "1", "--compare", "1", "--write",
                       "--json", str(tmp_path / "out.json")])
        token_model = mmgen.load_pipeline(folder).token_model()
    finally:
        torch.set_num_threads(threads)
    assert list(result["curve"]) == list(WIDTHS) and result["curve"][1] == 1.0 and all(n > 0 for n in result["forwards"].values())
    assert set(result["seconds_per_token"]) == {"ar", "sjd, linear cost", "sjd, measured cost"}
    assert json.loads((tmp_path / "out.json").read_text())["threads"] == 1
    written = json.loads((folder / "config.json").read_text())["mmgen_window_cost"]
    assert written == {"cpu:1": {str(w): c for w, c in result["curve"].items()}}
    assert token_model.window_cost == {"cpu:1": result["curve"]}
    # Every fixed width's mean: at least the one token a forward always finalises, at most its width.
    assert list(result["tokens"]) == list(WIDTHS[1:]) and all(1 <= t <= w for w, t in result["tokens"].items())
    assert json.loads((folder / "config.json").read_text())["mmgen_window_tokens"] == {str(w): t for w, t in result["tokens"].items()}
    assert token_model.window_tokens == result["tokens"]
    assert "| sjd, measured cost |" in capsys.readouterr().out
    # `--steps` times whole decoding steps, width 1 too (AR steps of the same loop).
    steps, _ = measure(mmgen.load_pipeline(folder), 1, 1, steps=True)
    assert set(steps) == set(WIDTHS) and all(len(t) > 0 for t in steps.values())
