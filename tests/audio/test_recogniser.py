"""The phoneme recogniser as an evaluation asset: PER (`mmgen.audio.recogniser`), espeak-ng's
phonemes reduced to the inventory (`mmgen.audio.phonemes`), recogniser folders (float16 on disk,
float32 in memory), `mmgen eval per`, and the bundled recogniser. A tiny random recogniser stands
in for the trained one wherever only the mechanics are checked."""

from __future__ import annotations

import json
import shutil

import pytest
import soundfile
import torch
from safetensors.torch import load_file, save_file

from mmgen.audio import phonemes
from mmgen.audio.phonemes import PHONEMES, espeak, reduce_phonemes, text_phonemes
from mmgen.audio.recogniser import BUNDLED, PhonemeRecogniser, collapse, edit_distance, phoneme_error_rate
from mmgen.cli import main

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="Debian's espeak-ng is not installed")
TINY = dict(n_mels=8, n_fft=64, hop=32, channels=8, hidden=8, layers=1, classes=len(PHONEMES) + 1)


def tiny_recogniser(seed: int = 0) -> PhonemeRecogniser:
    torch.manual_seed(seed)
    return PhonemeRecogniser(**TINY).eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny recogniser folder and two espeak-ng recordings (22050 Hz WAV, as espeak writes them)."""
    root = tmp_path_factory.mktemp("recogniser")
    tiny_recogniser().save_pretrained(root / "tiny")
    if shutil.which("espeak-ng"):
        for name, text in (("hello", "Hello there."), ("cat", "the red cat is under the box")):
            (root / f"{name}.wav").write_bytes(espeak(text, audio=True)[1])
    return root


def test_phoneme_error_rate_counts_edits_over_reference_phonemes():
    assert edit_distance("a b c".split(), "a b c".split()) == 0
    assert edit_distance("a b c".split(), "a c".split()) == 1  # a deletion
    assert edit_distance("a b c".split(), "a x c d".split()) == 2  # a substitution and an insertion
    assert edit_distance("k æ t".split(), "t æ k".split()) == 2
    assert edit_distance([], "a b".split()) == 2 and edit_distance("a b".split(), []) == 2
    assert phoneme_error_rate("a b c", "a c") == pytest.approx(1 / 3)
    # Over all pairs together: (1 + 2) edits over (3 + 1) reference phonemes.
    assert phoneme_error_rate(["a b c", "d"], ["a c", "x y"]) == pytest.approx(3 / 4)
    assert phoneme_error_rate(["a b", "c"], ["a b", ""]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no phonemes"):
        phoneme_error_rate([""], ["a"])
    with pytest.raises(ValueError, match="2 references but 1"):
        phoneme_error_rate(["a", "b"], ["a"])


def test_phoneme_error_rate_equals_jiwers_word_error_rate():
    """The figures the benchmarks reported with jiwer (a dev dependency) stay the same."""
    jiwer = pytest.importorskip("jiwer")
    generator = torch.Generator().manual_seed(0)
    draw = lambda n, k: " ".join("abcdef"[i] for i in torch.randint(0, k, (n,), generator=generator).tolist())
    for _ in range(100):
        sizes = torch.randint(0, 9, (6,), generator=generator).tolist()
        refs = [draw(max(1, n), 5) for n in sizes[:3]]
        hyps = [draw(n, 6) for n in sizes[3:]]
        assert phoneme_error_rate(refs, hyps) == pytest.approx(jiwer.wer(refs, hyps), abs=1e-12)


def test_greedy_ctc_merges_repeats_then_drops_blanks():
    blank = 9
    assert collapse([3, 3, 9, 3, 4, 4, 9, 9, 5], blank) == [3, 3, 4, 5]
    assert collapse([9, 9, 9], blank) == [] and collapse([], blank) == []


def test_espeak_ipa_reduces_to_the_inventory():
    assert reduce_phonemes("h ə l ˈoʊ  ð ˈɛɹ") == "h ə l oʊ ð ɛ ɹ".split()  # stress dropped, ɛɹ split
    assert reduce_phonemes("ð ə  k ˈɑːɹ") == "ð ə k ɑ ɹ".split()  # length mark dropped
    assert reduce_phonemes("b ˈʌ ʔ n̩  b ˈɑː ɾ əl  f ˈaɪə  ɹ ᵻ") == "b ʌ ʔ n b ɑ ɾ ə l f aɪ ə ɹ ɪ".split()
    with pytest.raises(ValueError, match="'ɬ'"):
        reduce_phonemes("ɬ a")


@needs_espeak
def test_text_phonemes_follow_the_voices_accent():
    assert text_phonemes("hello there") == "h ə l oʊ ð ɛ ɹ"
    assert text_phonemes("the car") == "ð ə k ɑ ɹ"
    assert text_phonemes("the car", voice="en-gb") == "ð ə k ɑ"  # non-rhotic
    assert text_phonemes("-v x") == "v i ɛ k s"  # a leading dash is text, never an espeak option
    with pytest.raises(ValueError, match="empty"):
        text_phonemes("  ")


def test_a_missing_espeak_is_one_line(monkeypatch):
    monkeypatch.setattr(phonemes, "ESPEAK", "no-such-espeak-ng")
    with pytest.raises(FileNotFoundError) as error:
        text_phonemes("hello")
    assert "no-such-espeak-ng is not installed" in str(error.value) and "\n" not in str(error.value)


def test_folders_hold_float16_and_load_into_float32(tmp_path):
    model = tiny_recogniser(1)
    model.save_pretrained(tmp_path / "r")
    stored = load_file(tmp_path / "r" / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.float16}
    assert not any(k.startswith("mel.") for k in stored)  # the filterbank is computed, not stored
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["inventory"] == list(PHONEMES) and config["blank"] == len(PHONEMES) and config["sample_rate"] == 16000
    loaded = PhonemeRecogniser.from_pretrained(tmp_path / "r")
    for key, tensor in model.state_dict().items():
        assert loaded.state_dict()[key].dtype == torch.float32
        assert torch.equal(loaded.state_dict()[key], tensor.half().float() if not key.startswith("mel.") else tensor), key
    # It transcribes as the float16-rounded model does, at any input rate (resampled to 16 kHz).
    wave = 0.3 * torch.randn(8000, generator=torch.Generator().manual_seed(0))
    rounded = tiny_recogniser(1)
    for tensor in rounded.state_dict().values():
        tensor.copy_(tensor.half().float())
    assert loaded.transcribe([wave], 16000) == rounded.transcribe([wave], 16000)
    import torchaudio

    assert loaded.transcribe([wave], 24000) == loaded.transcribe([torchaudio.functional.resample(wave, 24000, 16000)], 16000)


def test_a_recogniser_that_always_hears_one_phoneme():
    model = tiny_recogniser()
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.fill_(-10).index_fill_(0, torch.tensor([PHONEMES.index("ʃ")]), 10)
    wave = 0.3 * torch.randn(16000, generator=torch.Generator().manual_seed(0))
    # One second: 50 frames of ʃ collapse to one; a wave too short for one mel frame hears nothing.
    assert model.transcribe([wave, wave[:20], wave[:4000]], 16000) == ["ʃ", "", "ʃ"]
    with torch.no_grad():
        model.head.bias.fill_(-10)[model.blank] = 10
    assert model.transcribe([wave], 16000) == [""]
    with pytest.raises(ValueError, match="mono"):
        model.transcribe([wave[None]], 16000)


def test_a_folder_that_holds_no_recogniser_is_one_line(tmp_path, files):
    with pytest.raises(ValueError, match="no config.json"):
        PhonemeRecogniser.from_pretrained(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(files / "tiny", bad)
    (bad / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not a phoneme recogniser config"):
        PhonemeRecogniser.from_pretrained(bad)
    shutil.copy(files / "tiny" / "config.json", bad / "config.json")
    save_file({"head.weight": torch.zeros(2, 2)}, bad / "model.safetensors")
    with pytest.raises(ValueError, match="does not fit its config") as error:
        PhonemeRecogniser.from_pretrained(bad)
    assert "\n" not in str(error.value)


def run(capsys, *argv):
    code = main(["eval", "per", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@needs_espeak
def test_eval_per_scores_a_file_against_its_text(files, capsys):
    code, out, err = run(capsys, files / "hello.wav", "--text", "Hello there.", "--recogniser", files / "tiny")
    assert code == 0
    record = json.loads(err.strip().splitlines()[-1])
    wave, rate = soundfile.read(files / "hello.wav", dtype="float32")
    heard = PhonemeRecogniser.from_pretrained(files / "tiny").transcribe([torch.from_numpy(wave)], rate)[0]
    expected = text_phonemes("Hello there.")
    errors = edit_distance(expected.split(), heard.split())
    (item,) = record["items"]
    assert (item["heard"], item["expected"], item["errors"]) == (heard, expected, errors)
    assert record["per"] == pytest.approx(errors / len(expected.split())) == item["per"]
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"PER {errors / len(expected.split()):.1%}")
    assert lines[1] == f"heard:    {heard}" and lines[2] == f"expected: {expected}"


@needs_espeak
def test_eval_per_takes_pairs_or_a_batch_manifest_alike(files, capsys):
    texts = {"hello": "[S1] Hello there.", "cat": "the red cat is under the box"}  # Dia's speaker tags are not read
    code, out, _ = run(capsys, files / "hello.wav", files / "cat.wav", "--text", texts["hello"], "--text", texts["cat"],
                       "--recogniser", files / "tiny", "--json")
    assert code == 0
    pairs = json.loads(out)
    assert [i["expected"] for i in pairs["items"]] == [text_phonemes("Hello there."), text_phonemes(texts["cat"])]
    errors, total = sum(i["errors"] for i in pairs["items"]), sum(i["phonemes"] for i in pairs["items"])
    assert (pairs["errors"], pairs["phonemes"], pairs["files"]) == (errors, total, 2)
    assert pairs["per"] == pytest.approx(errors / total)
    # A manifest as `mmgen batch` writes it next to its outputs: the file and its job's spec.
    manifest = files / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"file": f"{name}.wav", "sha256": "-", "line": i + 1,
                                            "spec": {"model": "speech-tts", "text": text, "output": name}}) + "\n"
                                for i, (name, text) in enumerate(texts.items())))
    code, out, _ = run(capsys, "--manifest", manifest, "--recogniser", files / "tiny", "--json")
    assert code == 0
    listed = json.loads(out)
    assert [(i["heard"], i["expected"]) for i in listed["items"]] == [(i["heard"], i["expected"]) for i in pairs["items"]]
    assert listed["per"] == pairs["per"]
    code, out, _ = run(capsys, "--manifest", manifest, "--recogniser", files / "tiny")
    lines = out.splitlines()
    assert len(lines) == 3 and lines[-1].startswith(f"PER {pairs['per']:.1%} overall")


@needs_espeak
@pytest.mark.parametrize("case, says", [
    ("missing", "nope.wav: no such file"), ("not audio", "is not audio"), ("no text", "but 0 --text"),
    ("two texts", "but 2 --text"), ("no espeak", "no-such-espeak-ng is not installed"), ("bad voice", "voice does not exist"),
    ("bad recogniser", "is not a phoneme recogniser folder"), ("manifest and files", "not both"),
    ("image manifest", "line 1 is not a speech record")])
def test_eval_per_bad_input_is_one_line(files, capsys, monkeypatch, tmp_path, case, says):
    hello, tiny = files / "hello.wav", files / "tiny"
    (tmp_path / "notes.wav").write_text("not audio")
    (tmp_path / "manifest.jsonl").write_text(json.dumps({"file": "a.png", "spec": {"class_labels": [1]}}) + "\n")
    if case == "no espeak":
        monkeypatch.setattr(phonemes, "ESPEAK", "no-such-espeak-ng")
    argv = {"missing": [tmp_path / "nope.wav", "--text", "hi"], "not audio": [tmp_path / "notes.wav", "--text", "hi"],
            "no text": [hello], "two texts": [hello, "--text", "a", "--text", "b"], "no espeak": [hello, "--text", "hi"],
            "bad voice": [hello, "--text", "hi", "--voice", "xx-nosuch"],
            "bad recogniser": [hello, "--text", "hi", "--recogniser", tmp_path],
            "manifest and files": [hello, "--manifest", tmp_path / "manifest.jsonl"],
            "image manifest": ["--manifest", tmp_path / "manifest.jsonl"]}[case]
    if case not in ("bad recogniser",):
        argv += ["--recogniser", tiny]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and err.startswith("mmgen: error: ")
    assert says in err


@needs_espeak
def test_the_bundled_recogniser_hears_espeak_speech(files):
    """The shipped float16 weights load and transcribe about a second of espeak-ng speech into
    inventory phonemes (how well: its MODEL_CARD.md)."""
    recogniser = PhonemeRecogniser.from_pretrained()
    assert {t.dtype for t in load_file(BUNDLED / "model.safetensors").values()} == {torch.float16}
    wave, rate = soundfile.read(files / "cat.wav", dtype="float32")
    assert 1.0 <= len(wave) / rate <= 3.0
    (heard,) = recogniser.transcribe([torch.from_numpy(wave)], rate)
    assert heard and set(heard.split()) <= set(PHONEMES)
    # Trained weights, not noise: most of what it hears is what espeak said.
    assert phoneme_error_rate(text_phonemes("the red cat is under the box"), heard) < 0.5


def test_the_bundled_recogniser_is_package_data_within_the_size_budget():
    """Every file of the asset matches pyproject's package-data globs (so the wheel ships it), and
    all bundled assets together stay within the 120 MB the project allows."""
    import glob
    import runpy
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[2]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = runpy.run_path(str(root / "setup.py"), run_name="packages")["FOLDERS"]
    shipped = {Path(p) for package, patterns in setuptools["package-data"].items() for pattern in patterns
               for p in glob.glob(str(root / folders[package] / pattern), recursive=True)}
    asset = {p for p in BUNDLED.iterdir() if p.is_file()}
    assert {p.name for p in asset} == {"model.safetensors", "config.json", "MODEL_CARD.md"}
    assert asset <= shipped
    assert sum(p.stat().st_size for p in shipped) <= 120e6


@needs_espeak
def test_a_training_run_becomes_a_measured_recogniser_folder(tmp_path):
    """`train_speech.py phonemes` then `bundle-recogniser`: the run's weights in float16, loadable,
    with a card whose figures are the folder's (here one step of a planned two: flagged as such)."""
    from training.data import speech
    from training.train_speech import load_recogniser
    from training.train_speech import main as train_speech

    speech.main(["--out", str(tmp_path / "speech.npz"), "--limit", "6"])
    train_speech(["phonemes", "--data", str(tmp_path / "speech.npz"), "--out", str(tmp_path / "run"), "--steps", "2",
                  "--run-steps", "1", "--batch-size", "2", "--warmup", "1", "--log-every", "1", "--threads", "1"])
    train_speech(["bundle-recogniser", "--recogniser", str(tmp_path / "run"), "--data", str(tmp_path / "speech.npz"),
                  "--out", str(tmp_path / "bundle")])
    run, shipped = load_recogniser(tmp_path / "run"), PhonemeRecogniser.from_pretrained(tmp_path / "bundle")
    for key, tensor in shipped.state_dict().items():
        assert torch.equal(tensor, run.state_dict()[key].half().float() if not key.startswith("mel.") else run.state_dict()[key])
    card = (tmp_path / "bundle" / "MODEL_CARD.md").read_text()
    assert "step-1 checkpoint, exported while it was still training\ntowards 2 steps" in card
    assert "1 steps on 1 CPU thread(s)" in card
    from training.train_speech import Speech

    held_out = Speech(speech.load_corpus(tmp_path / "speech.npz"), "eval")
    per = phoneme_error_rate(held_out.phonemes, shipped.transcribe(held_out.waves, 16000))
    assert f"| real espeak-ng audio | {per:.2%} |" in card


def test_what_a_waveform_is_heard_as_never_depends_on_the_others_in_the_call():
    """Each waveform is heard alone: beside a longer one (a zero-padded batch would feed the
    padding to its last mel windows and to the convolutions) it reads the same."""
    model = tiny_recogniser(3)
    generator = torch.Generator().manual_seed(1)
    waves = [0.3 * torch.randn(n, generator=generator) for n in (3000, 9000, 4100, 16000)]
    alone = [model.transcribe([wave], 16000)[0] for wave in waves]
    assert model.transcribe(waves, 16000) == alone
    assert model.transcribe(waves[::-1], 16000) == alone[::-1]
