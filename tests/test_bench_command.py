"""`mmgen bench MODALITY` runs the installed harness (`mmgen.image_ar.bench`, ...): building the
parser imports neither it nor a pipeline, and the old form without a modality still reads as
image with a one-line notice. (Running it from a wheel: tests/test_packaging.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmgen.cli import build_parser, main

ROOT = Path(__file__).parents[1]


def test_building_the_parser_imports_no_pipeline_and_no_benchmark_code():
    probe = ("import sys, mmgen.cli\n"
             "mmgen.cli.build_parser()\n"
             "print(sorted(m for m in sys.modules if m.startswith(('benchmarks', 'training', 'mmgen.image_ar.bench', "
             "'mmgen.image_ar.llamagen', 'mmgen.image_ar.var', 'mmgen.image_ar.mar', 'mmgen.image_ar.janus'))))\n")
    # From the repository root, where `benchmarks` and `training` are importable: the parser leaves them alone.
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_old_form_reads_as_image_with_a_notice(monkeypatch, capsys):
    import mmgen.image_ar.bench as bench

    seen = []
    monkeypatch.setattr(bench, "run", lambda args: seen.append(args.methods) or "report")
    assert main(["bench", "--methods", "ar"]) == 0
    out, err = capsys.readouterr()
    assert seen == [["ar"]] and out == "report\n"
    assert err.count("\n") == 1 and "use `mmgen bench image`" in err
    assert build_parser().parse_args(["bench", "image", "--methods", "ar"]).target == "image"


def run_bench(argv: list[str], tmp_path: Path) -> list[dict]:
    path = tmp_path / "bench.json"
    assert main([*argv, "--repeats", "1", "--warmup", "0", "--threads", "1", "--no-progress", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["environment"]["command"].startswith("mmgen bench")
    return report["speed"]


def test_text_bench_runs_methods_and_generate_on_the_same_answers(tmp_path):
    rows = run_bench(["bench", "text", "--methods", "ar", "draft", "gsd:nonsense=1", "--inputs", "2", "--max-new-tokens", "8"],
                     tmp_path)
    by = {row["method"]: row for row in rows}
    assert list(by) == ["ar", "draft", "gsd:nonsense=1", "transformers generate"]
    # Greedy: the drafted answers and generate's are AR's, token for token; the drafter drafted.
    assert by["draft"]["identical_to_ar"] == by["transformers generate"]["identical_to_ar"] == 1.0
    assert by["draft"]["units_per_forward"] > 1 and by["draft"]["draft_forwards_per_unit"] > 0
    assert by["ar"]["units_per_forward"] == 1.0 and by["ar"]["speedup_vs_ar"] == 1.0
    assert "nonsense" in by["gsd:nonsense=1"]["error"]  # a method that cannot run is a row with its error


def test_speech_bench_greedy_lossless_rows_equal_ar(tmp_path):
    rows = run_bench(["bench", "speech", "--methods", "ar", "sjd", "--inputs", "2", "--max-new-frames", "16", "--greedy"],
                     tmp_path)
    by = {row["method"]: row for row in rows}
    assert list(by) == ["ar", "sjd", "transformers generate"]
    assert by["sjd"]["identical_to_ar"] == by["transformers generate"]["identical_to_ar"] == 1.0
    assert by["ar"]["units"] == by["sjd"]["units"] > 0


def test_video_bench_crosses_methods_and_cache_policies(tmp_path):
    rows = run_bench(["bench", "video", "--methods", "block", "--cache-policies", "global", "sink:1,window:1", "--inputs", "1",
                      "--num-frames", "9"], tmp_path)
    by = {row["method"]: row for row in rows}
    assert list(by) == ["block cache=global", "block cache=sink:1,window:1"]
    # Nine frames are one block: no policy has anything to evict, so both make the same video.
    assert by["block cache=sink:1,window:1"]["identical_to_block cache=global"] == 1.0
    assert all(row["units"] == 9 and row["units_per_forward"] > 0 for row in rows)


def test_video_bench_streams_with_switches(tmp_path):
    path = tmp_path / "stream.json"
    assert main(["bench", "video", "--stream", "3", "--switches", "1", "--methods", "block", "--cache-policies", "global",
                 "--threads", "1", "--no-progress", "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["speed"]
    assert row["method"] == "block cache=global" and row["blocks"] >= 2 and row["first_block_s"] > 0
    assert row["steady_fps"] > 0 and row["rss_max_mib"] >= row["rss_first_mib"] > 0
    assert 0 <= row["class_accuracy_first_prompt"] <= 1 and len(row["blocks_until_switch_shows"]) == 1
    with pytest.raises(SystemExit):
        main(["bench", "video", "--stream", "x"])
    assert main(["bench", "video", "--stream", "-1"]) == 2


def test_image_bench_interleaves_methods_and_pairs_each_ratio(tmp_path, monkeypatch):
    """`mmgen bench image`: repeat r decodes seed r under every method in turn (so the machine's
    load reaches all of them alike), and `speedup_vs_ar` is the median of the paired ratios;
    `--threads` sets torch's threads."""
    import json

    import torch

    from mmgen.cli import main
    from mmgen.decoding.speculative import SpeculativeDecoder

    order = []
    generate = SpeculativeDecoder.generate

    def spy(self, model, conditions, num_tokens, sampling, generator, *args, **kwargs):
        order.append((type(self).__name__, generator.initial_seed()))
        return generate(self, model, conditions, num_tokens, sampling, generator, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "image", "--models", "emoji64", "--methods", "ar", "sjd-4", "--batch-sizes", "1", "--repeats", "2",
                     "--warmup", "0", "--quality-per-class", "0", "--threads", "1", "--no-progress",
                     "--json", str(tmp_path / "b.json")]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert order == [("Autoregressive", 0), ("SpeculativeJacobi", 0), ("Autoregressive", 1), ("SpeculativeJacobi", 1)]
    rows = json.loads((tmp_path / "b.json").read_text())["speed"]
    assert [r["method"] for r in rows] == ["ar", "sjd-4"] and rows[0]["speedup_vs_ar"] == 1.0 and rows[1]["speedup_vs_ar"] > 0


def test_video_bench_adds_diffusers_skyreels_df_on_the_same_weights(tmp_path):
    """`--diffusers`: diffusers' SkyReels-V2 diffusion forcing on the tiny model's own weights, a
    row beside `block` with a finite paired ratio over the same frames (its sampler differs by
    design, so its videos are not block decoding's)."""
    from tests.video.tiny import tiny_video_pipeline

    tiny_video_pipeline().save_pretrained(tmp_path / "tiny")
    rows = run_bench(["bench", "video", "--models", str(tmp_path / "tiny"), "--methods", "block", "--diffusers",
                      "--inputs", "1"], tmp_path)
    by = {row["method"]: row for row in rows}
    assert list(by) == ["block cache=global", "diffusers SkyReels-V2 DF"]
    peer = by["diffusers SkyReels-V2 DF"]
    assert "error" not in peer and peer["units"] == by["block cache=global"]["units"] == 13
    assert 0 < peer["speedup_vs_block cache=global"] < float("inf") and peer["identical_to_block cache=global"] == 0.0
