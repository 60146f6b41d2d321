"""`mmgen generate speech` on tiny Dia / CSM folders saved here (no downloads)."""

from __future__ import annotations

import json

import pytest
import soundfile
import torch

from mmgen.cli import main
from tests.audio.tiny import RATE, tiny_csm, tiny_dia


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tts")
    tiny_dia(1).save_pretrained(root / "dia")
    tiny_dia(2).save_pretrained(root / "dia-draft")
    tiny_csm(1).save_pretrained(root / "csm")
    soundfile.write(root / "voice.wav", (0.3 * torch.sin(torch.arange(400) / 3.0)).numpy(), RATE)
    return root


def run(capsys, *argv):
    code = main(["generate", "speech", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("family, build", [("dia", tiny_dia), ("csm", tiny_csm)])
def test_writes_the_pipelines_audio_and_streams_the_same_file(folders, capsys, tmp_path, family, build):
    out = tmp_path / "hello.wav"
    code, _, err = run(capsys, "--model", folders / family, "--text", "Hello there.", "--out", out, "--temperature", 0,
                       "--max-new-frames", 40)
    assert code == 0 and json.loads(err.strip().splitlines()[-1])["out"] == str(out)
    expected = build(1)("Hello there.", max_new_frames=40, temperature=0).audio[0]
    audio, rate = soundfile.read(out, dtype="float32")
    assert rate == RATE and audio.shape == expected.shape
    assert abs(audio - expected.clamp(-1, 1).numpy()).max() <= 1 / 32767 + 1e-6  # 16-bit PCM
    streamed = tmp_path / "streamed.wav"
    code, _, _ = run(capsys, "--model", folders / family, "--text", "Hello there.", "--out", streamed, "--temperature", 0,
                     "--max-new-frames", 40, "--stream")
    assert code == 0 and not (tmp_path / "streamed.wav.partial").exists()
    assert abs(soundfile.read(streamed, dtype="float32")[0] - audio).max() <= 2 / 32767


def test_drafting_with_a_smaller_model_writes_the_same_file(folders, capsys, tmp_path):
    args = ["--model", folders / "dia", "--text", "Hello there.", "--temperature", 0, "--max-new-frames", 30]
    run(capsys, *args, "--out", tmp_path / "plain.wav")
    code, _, err = run(capsys, *args, "--out", tmp_path / "drafted.wav", "--decoding", "draft", "--drafter", folders / "dia-draft")
    assert code == 0 and json.loads(err.strip().splitlines()[-1])["stats"]["draft_forwards"] > 0
    assert (tmp_path / "plain.wav").read_bytes() == (tmp_path / "drafted.wav").read_bytes()


def test_a_voice_prompt_is_read_and_resampled(folders, capsys, tmp_path):
    code, _, _ = run(capsys, "--model", folders / "dia", "--text", "Hello.", "--out", tmp_path / "v.wav", "--voice",
                     folders / "voice.wav", "--voice-text", "[S1] Hi.", "--max-new-frames", 20)
    assert code == 0 and (tmp_path / "v.wav").is_file()


@pytest.mark.parametrize("extra, message", [
    (["--out", "{tmp}/x.mp3"], "must name a .wav"),
    (["--out", "{tmp}/exists.wav"], "exists; pass --overwrite"),
    (["--out", "{tmp}/missing/x.wav"], "does not exist"),
    (["--out", "{tmp}/x.wav", "--voice", "{tmp}/nope.wav"], "no such file"),
    (["--out", "{tmp}/x.wav", "--voice-text", "hi"], "give --voice too"),
    (["--out", "{tmp}/x.wav", "--max-new-frames", "0"], "must be >= 1"),
    (["--out", "{tmp}/x.wav", "--voice", "{tmp}/broken.wav"], "cannot read audio"),
    (["--out", "{tmp}/x.wav", "--voice", "{tmp}/broken.wav", "--stream"], "cannot read audio"),
    (["--out", "{tmp}/x.wav", "--decoding", "lantern"], "unknown decoding"),
])
def test_bad_input_is_one_line_and_loses_nothing(folders, capsys, tmp_path, extra, message):
    (tmp_path / "exists.wav").write_bytes(b"keep me")
    (tmp_path / "broken.wav").write_bytes(b"not audio")
    argv = ["--model", folders / "dia", "--text", "Hi.", *[a.format(tmp=tmp_path) for a in extra]]
    code, out, err = run(capsys, *argv)
    assert code != 0 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "exists.wav").read_bytes() == b"keep me"
    assert not (tmp_path / "x.wav").exists() and not (tmp_path / "x.wav.partial").exists()


def test_vibevoice_folder_speaks_through_the_same_command(folders, capsys, tmp_path):
    from tests.audio.tiny import tiny_vibevoice

    tiny_vibevoice(0, speak=1.0).save_pretrained(tmp_path / "vv")
    tiny_vibevoice(0, speak=1.0).save_pretrained(tmp_path / "vv-draft")
    common = ["--model", tmp_path / "vv", "--text", "Hello there.", "--max-new-frames", 6, "--seed", 3]
    code, _, err = run(capsys, *common, "--out", tmp_path / "plain.wav", "--final-std", 0.2)
    assert code == 0 and json.loads(err.strip().splitlines()[-1])["frames"] == 6
    expected = tiny_vibevoice(0, speak=1.0)("Hello there.", max_new_frames=6, final_std=0.2,
                                            generator=torch.Generator().manual_seed(3)).audio[0]
    audio, _ = soundfile.read(tmp_path / "plain.wav", dtype="float32")
    assert audio.shape == expected.shape and abs(audio - expected.clamp(-1, 1).numpy()).max() <= 1 / 32767 + 1e-6
    code, _, err = run(capsys, *common, "--out", tmp_path / "drafted.wav", "--final-std", 0.2, "--decoding", "cspd",
                       "--drafter", tmp_path / "vv-draft")
    assert code == 0 and json.loads(err.strip().splitlines()[-1])["stats"]["draft_forwards"] > 0
    code, _, err = run(capsys, *common, "--out", tmp_path / "x.wav", "--decoding", "cspd", "--drafter", tmp_path / "vv-draft")
    assert code != 0 and "final_std > 0" in err and not (tmp_path / "x.wav").exists()
    code, _, err = run(capsys, "--model", folders / "dia", "--text", "Hi.", "--out", tmp_path / "y.wav", "--final-std", 0.1)
    assert code != 0 and "--final-std is for vibevoice models; this model is a dia" in err


def test_the_bundled_pair_speaks_offline_by_default(capsys, tmp_path):
    code, _, err = run(capsys, "--text", "Hello there.", "--out", tmp_path / "hello.wav", "--max-new-frames", 24)
    report = json.loads(err.strip().splitlines()[-1])
    audio, rate = soundfile.read(tmp_path / "hello.wav", dtype="float32")
    assert code == 0 and rate == 16000 and 0 < report["frames"] <= 24 and len(audio) > 0
    code, _, err = run(capsys, "--text", "Hello there.", "--out", tmp_path / "drafted.wav", "--max-new-frames", 24,
                       "--decoding", "draft")  # the bundled drafter comes along
    assert code == 0 and json.loads(err.strip().splitlines()[-1])["stats"]["draft_forwards"] > 0
