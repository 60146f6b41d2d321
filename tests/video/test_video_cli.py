"""`mmgen generate video` on tiny folders saved here (no downloads), and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from mmgen.cli import main
from mmgen.video.export import read_mp4
from tests.video.tiny import tiny_video_pipeline


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    tiny_video_pipeline().save_pretrained(root / "tiny")
    tiny_video_pipeline(layers=1, seed=1).save_pretrained(root / "tiny-small")
    return root


def run(capsys, *argv):
    code = main(["generate", "video", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_writes_the_pipelines_video(folders, capsys, tmp_path):
    out = tmp_path / "cat.mp4"
    code, _, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat face moving left", "--out", out,
                       "--cache-policy", "sink:1,window:2", "--seed", 3)
    report = json.loads(err.strip().splitlines()[-1])
    assert code == 0 and report["out"] == str(out) and report["frames"] == 13
    assert report["profile"]["first_block_s"] > 0 and report["stats"]["blocks"] == 2
    expected = tiny_video_pipeline()("cat face moving left", cache_policy="sink:1,window:2",
                                     generator=torch.Generator().manual_seed(3)).frames[0]
    video = read_mp4(out)
    assert video.shape == tuple(expected.shape)
    assert abs(video.astype(float) - expected.numpy().astype(float)).mean() < 12  # H.264 at crf 18


def test_collaborative_takes_the_small_model(folders, capsys, tmp_path):
    out = tmp_path / "collab.mp4"
    code, _, err = run(capsys, "--model", folders / "tiny", "--prompt", "dog face", "--out", out, "--decoding",
                       "collaborative", "--small", folders / "tiny-small", "--large-steps", 1, "--frames", 21)
    stats = json.loads(err.strip().splitlines()[-1])["stats"]
    assert code == 0 and stats["denoise_forwards"] == {"large": 3, "small": 9}


@pytest.mark.parametrize("argv, message", [
    (["--frames", "9"], "use num_frames 5 or 13"),
    (["--switch", "12=dog face"], "no block starts at or after it"),
    (["--switch", "40=dog face"], "frames 0 … 12"),
    (["--cache-policy", "window:0"], "cache window"),
    (["--small", "x"], "are for --decoding collaborative"),
    (["--cache-threshold", "-1"], "--cache-threshold must be >= 0"),
    (["--drop-threshold", "-1"], "--drop-threshold must be >= 0"),
    (["--prompt", "cat face " * 11000], "a prompt of 22000 tokens (99000 characters) is longer than this model reads "
                                        "(max_sequence_length 8 tokens)"),
])
def test_bad_input_is_one_line_before_any_work(folders, capsys, tmp_path, argv, message):
    out = tmp_path / "x.mp4"
    code, _, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat", "--out", out, *argv)
    assert code != 0 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_existing_and_unwritable_outputs_are_errors(folders, capsys, tmp_path):
    out = tmp_path / "taken.mp4"
    out.write_bytes(b"mine")
    code, _, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat", "--out", out)
    assert code != 0 and "--overwrite" in err and out.read_bytes() == b"mine"
    code, _, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat", "--out", tmp_path / "missing" / "a.mp4")
    assert code != 0 and "does not exist or is not writable" in err
    code, _, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat", "--out", tmp_path / "a.gif")
    assert code != 0 and ".mp4" in err
    (tmp_path / "dir.mp4").mkdir()
    for extra in ([], ["--overwrite"]):  # a folder is the problem, not a missing --overwrite
        code, _, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat", "--out", tmp_path / "dir.mp4", *extra)
        assert code == 2 and "dir.mp4 is a folder: name a .mp4 file" in err and "--overwrite" not in err, err


def test_stdout_is_for_people_and_the_record_for_json(folders, capsys, tmp_path):
    code, out, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat", "--out", tmp_path / "a.mp4")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'a.mp4'} (13 frames at 8 fps; 2 blocks at")
    assert len(out.strip().splitlines()) == 1 and json.loads(err.strip().splitlines()[-1])["frames"] == 13
    code, out, err = run(capsys, "--model", folders / "tiny", "--prompt", "cat", "--out", tmp_path / "b.mp4", "--json")
    (line,) = out.strip().splitlines()
    assert code == 0 and json.loads(line)["out"] == str(tmp_path / "b.mp4") and err == ""


def test_convert_names_a_missing_checkpoint(capsys, tmp_path):
    code = main(["convert", "self-forcing", str(tmp_path / "none.pt"), "--wan", str(tmp_path), "--out", str(tmp_path / "o")])
    assert code != 0 and "no such file" in capsys.readouterr().err
