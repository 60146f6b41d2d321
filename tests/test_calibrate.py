"""`mmgen calibrate` on a copy of the bundled emoji-vlm, two questions, one repeat: it measures
every width's cost and tokens per forward, compares the two cost models and stores both where
loading reads them; bad requests are one line before any model loads."""

import json
import shutil

import pytest
import torch

import mmgen
from mmgen import registry
from mmgen.calibrate import WIDTHS, measure
from mmgen.cli import main


def test_measures_compares_and_writes_the_curve_and_tokens(tmp_path, capsys):
    folder = tmp_path / "emoji-vlm"
    shutil.copytree(registry.bundled_models()["emoji-vlm"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("mmgen_window_cost")
    config.pop("mmgen_window_tokens", None)
    (folder / "config.json").write_text(json.dumps(config))
    threads = torch.get_num_threads()
    try:  # --threads 1 sets torch's count for the process: the curve is stored, and read, under it
        assert main(["calibrate", str(folder), "--inputs", "2", "--repeats", "1", "--threads", "1", "--compare", "1",
                     "--json", str(tmp_path / "out.json")]) == 0
        token_model = mmgen.load_pipeline(folder).token_model()
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "out.json").read_text())
    curve = {int(w): c for w, c in result["curve"].items()}
    tokens = {int(w): t for w, t in result["tokens"].items()}
    assert list(curve) == list(WIDTHS) and curve[1] == 1.0 and all(n > 0 for n in result["forwards"].values())
    assert set(result["seconds_per_token"]) == {"ar", "sjd, linear cost", "sjd, measured cost"}
    assert result["threads"] == 1
    written = json.loads((folder / "config.json").read_text())["mmgen_window_cost"]
    assert written == {"cpu:1": {str(w): c for w, c in curve.items()}}
    assert token_model.window_cost == {"cpu:1": curve}
    # Every fixed width's mean: at least the one token a forward always finalises, at most its width.
    assert list(tokens) == list(WIDTHS[1:]) and all(1 <= t <= w for w, t in tokens.items())
    assert json.loads((folder / "config.json").read_text())["mmgen_window_tokens"] == {str(w): t for w, t in tokens.items()}
    assert token_model.window_tokens == tokens
    assert "| sjd, measured cost |" in capsys.readouterr().out
    # `--steps` times whole decoding steps, width 1 too (AR steps of the same loop).
    steps, _ = measure(mmgen.load_pipeline(folder), 1, 1, steps=True)
    assert set(steps) == set(WIDTHS) and all(len(t) > 0 for t in steps.values())


def test_no_write_leaves_the_folder_as_it_was(tmp_path):
    folder = tmp_path / "speech-tts"
    shutil.copytree(registry.bundled_models()["speech-tts"], folder)
    before = (folder / "config.json").read_bytes()
    threads = torch.get_num_threads()
    try:
        assert main(["calibrate", str(folder), "--inputs", "1", "--repeats", "1", "--threads", "1", "--no-write"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (folder / "config.json").read_bytes() == before


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "emoji64", "--inputs", "0"], "--inputs must be at least 1"),
    (["calibrate", "emoji64", "--repeats", "0"], "--repeats must be at least 1"),
    (["calibrate", "var-emoji64"], "VARPipeline has no adaptive window to calibrate"),
])
def test_bad_requests_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
