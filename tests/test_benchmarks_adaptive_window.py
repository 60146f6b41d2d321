"""`benchmarks/adaptive_window.py` on the bundled emoji64, one repeat: the rows it reports (the
adaptive window as the model ships and with the curve and tokens its warm-up measured), the
cost curve it measures and the comparison with the best fixed window of its sweep."""

import json

import pytest

from benchmarks.adaptive_window import main


def test_rows_curve_and_summary(tmp_path, capsys):
    result = main(["--case", "emoji64", "--repeats", "1", "--threads", "1", "--sweep", "4", "16", "--tokens", "32",
                   "--json", str(tmp_path / "result.json")])
    rows = result["rows"]
    assert list(rows) == ["ar", "sjd", "sjd, measured curve and tokens", "sjd:adapt=false,window=4", "sjd:adapt=false,window=16"]
    assert rows["ar"]["forwards"] == 32 and rows["ar"]["modelled"] == pytest.approx(1.0)
    assert rows["sjd:adapt=false,window=16"]["mean_drafts"] == 15 and rows["sjd:adapt=false,window=16"]["step_compression"] > 1
    assert 0 <= rows["sjd"]["mean_drafts"] <= 15  # adaptive by default
    assert result["curve"][1] == 1.0 and set(result["curve"]) >= {1, 4, 16}  # every width that ran, timed
    assert set(result["window_tokens"]) == {4, 16} and all(1 <= t <= w for w, t in result["window_tokens"].items())
    summary = result["summary"]
    assert summary["best_fixed"] in rows and summary["adaptive_vs_ar"] == pytest.approx(rows["sjd"]["seconds"] / rows["ar"]["seconds"])
    assert summary["measured_vs_ar_modelled"] == pytest.approx(rows["sjd, measured curve and tokens"]["modelled"])
    # One decode per method: its mean is its median.
    assert rows["sjd"]["modelled_mean"] == pytest.approx(rows["sjd"]["modelled"])
    assert summary["adaptive_vs_best_fixed_modelled_mean"] == pytest.approx(summary["adaptive_vs_best_fixed_modelled"])
    # One repeat: its own ratio is the ratio of the medians.
    assert summary["adaptive_vs_ar_paired"] == pytest.approx(summary["adaptive_vs_ar"])
    assert json.loads((tmp_path / "result.json").read_text())["summary"] == summary
    out = capsys.readouterr().out
    assert "| sjd:adapt=false,window=4 |" in out and "the best fixed window" in out


def test_a_bundled_pair_through_its_pipeline(capsys):
    """The emoji-vlm case: batch-1 calls on held-out sentence questions, figures per generated
    token; its `sjd` row runs with the curve the model ships with."""
    result = main(["--case", "emoji-vlm", "--inputs", "1", "--repeats", "1", "--threads", "1", "--sweep", "2"])
    rows = result["rows"]
    assert list(rows) == ["ar", "sjd", "sjd, measured curve and tokens", "sjd:adapt=false,window=2"]
    assert rows["ar"]["modelled"] == pytest.approx(1.0) and rows["ar"]["unit"] == "s / token"
    assert rows["sjd:adapt=false,window=2"]["mean_drafts"] == 1
    assert set(result["window_tokens"]) == {2}  # the warm-up's fixed window, its tokens per forward
    assert "| method | ms / token" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="batch-1"):
        main(["--case", "speech-tts", "--batch-size", "2"])


def test_a_given_curve_weighs_the_modelled_columns(capsys):
    """`--curve`: the modelled columns weigh each decode's forwards by another machine's curve."""
    result = main(["--case", "emoji64", "--repeats", "1", "--threads", "1", "--sweep", "4", "--tokens", "16",
                   "--curve", "2:1.5", "4:2.0", "8:3.0", "16:5.0"])
    assert result["curve"] == {1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0, 16: 5.0}
    fixed = result["rows"]["sjd:adapt=false,window=4"]
    assert fixed["modelled"] == pytest.approx((1 + 2.0 * (fixed["forwards"] - 1)) / 16)
    assert "cost curve given (--curve)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="WIDTH:COST"):
        main(["--case", "emoji64", "--curve", "2=1.5"])


def test_the_lookup_family(capsys):
    """`--family lookup`: prompt lookup's adaptive default against its fixed windows."""
    result = main(["--case", "emoji64", "--family", "lookup", "--repeats", "2", "--threads", "1", "--sweep", "2", "4",
                   "--tokens", "16"])
    rows, summary = result["rows"], result["summary"]
    assert list(rows) == ["ar", "lookup", "lookup:adapt=false,num_draft=1", "lookup:adapt=false,num_draft=3"]
    assert result["family"] == "lookup" and summary["best_fixed"].startswith("lookup:adapt=false")
    assert summary["adaptive_vs_ar"] == pytest.approx(rows["lookup"]["seconds"] / rows["ar"]["seconds"])
    assert summary["adaptive_vs_ar_paired"] > 0 and "measured_vs_ar" not in summary
    assert "adaptive lookup:" in capsys.readouterr().out
