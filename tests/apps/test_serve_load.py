"""`benchmarks/serve_load.py` in its smallest form: a real `mmgen serve` subprocess for the
bundled speech model, two clients with one (text, seed) pair asked twice, and a client that
leaves mid-stream. Every answer must arrive once and be the same for the same seed, the
vanished client's row must be freed, and the report must carry the figures the benchmark
promises."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from benchmarks import serve_load  # noqa: E402

LEVEL_KEYS = {"concurrency", "requests", "ok", "errors", "lost", "duplicated", "mismatched", "first_output_s", "latency_s",
              "requests_per_s", "units_per_s", "unit", "wall_s", "rows_running_after", "per_request"}


def test_speech_load_and_a_vanished_client(tmp_path):
    out = tmp_path / "results.json"
    report = serve_load.main(["--modality", "speech", "--concurrency", "2", "--requests", "2", "--max-new-frames", "24",
                              "--configs", "continuous", "--faults", "vanish", "--threads", "1", "--timeout", "120",
                              "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report) == {"modality", "model", "unit", "settings", "configs", "faults", "answers", "goals"}
    assert report["model"] == "speech-tts" and report["unit"] == "audio s"

    (level,) = report["configs"]["continuous"]["levels"]
    assert set(level) == LEVEL_KEYS
    assert level["concurrency"] == 2 and level["requests"] == level["ok"] == 2 and level["errors"] == {}
    assert level["lost"] == level["duplicated"] == level["mismatched"] == 0
    assert [r["key"] for r in level["per_request"]] == [0, 0]  # one pair asked twice: the same answer twice
    assert len({r["answer"] for r in level["per_request"]}) == 1
    assert 0 < level["first_output_s"]["p50"] < level["latency_s"]["p50"]  # the first audio comes before the end
    assert level["units_per_s"] > 0 and level["rows_running_after"] == 0

    vanish = report["faults"]["vanish"]
    assert vanish["vanished_after_first_output"] == 2 * vanish["vanishing_clients"] and vanish["vanish_errors"] == {}
    assert vanish["rows_running_after_vanishing"] == 0 and vanish["rows_running_after"] == 0
    others = vanish["others"]
    assert others["ok"] == others["requests"] == vanish["reading_clients"]
    assert others["lost"] == others["duplicated"] == others["mismatched"] == 0
    assert vanish["next_request_ok"]
    assert report["answers"]["mismatched"] == 0


def test_answers_are_checked_within_each_server_and_counted_against_the_lone_one():
    """A key answered alike within each server is no mismatch, even where two servers answer it
    differently (the adaptive window's rows judge widths at the batch's cost); that difference
    is counted apart, and a server whose own answers disagree is a mismatch."""
    Outcome = serve_load.Outcome
    same = lambda digest, key=0: Outcome(index=0, key=key, digest=digest, complete=True)
    runs = {"continuous": [({}, [same("a"), same("a"), same("c", 1)])], "alone": [({}, [same("b"), same("b"), same("c", 1)])]}
    faults = [({}, [same("a")])]
    answers = serve_load.check_answers(runs, faults, "continuous")
    assert answers == {"keys": 2, "answers": 7, "mismatched": 0, "keys_differing_from_alone": {"continuous": 1}}
    runs["alone"][0][1].append(same("x"))
    assert serve_load.check_answers(runs, faults, "continuous")["mismatched"] == 1
