"""`mmgen eval per`: how intelligible speech is, as the phoneme error rate (PER) of what the
project's phoneme recogniser hears against the phonemes espeak-ng gives for its text.

    mmgen eval per hello.wav --text "Hello there."
    mmgen eval per a.wav b.wav --text "First text." --text "Second text."    # one --text per file, in order
    mmgen eval per --manifest speech/manifest.jsonl                         # an `mmgen batch` speech run
        [--voice en-gb] [--recogniser FOLDER] [--json]

PER = (substitutions + deletions + insertions) / expected phonemes, over all files together; each
file gets its own line. Expected phonemes come from Debian's `espeak-ng` (its `--voice`, default
en-us), reduced to the recogniser's inventory (`mmgen.audio.phonemes`); Dia's speaker tags
("[S1]") are not read. The recogniser is the bundled one (`audio/assets/phoneme-recogniser`, see
its MODEL_CARD.md: English, espeak voices) unless `--recogniser` names another folder. Any audio
file soundfile reads works, at any sampling rate (resampled to the recogniser's). Every input is
checked before the recogniser runs; a bad one is one line and exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mmgen.cli import add_json_flag, report


def register(commands, groups) -> None:
    per = groups["eval"].add_parser("per", help="phoneme error rate of speech against its text (intelligibility)")
    per.add_argument("audio", nargs="*", metavar="AUDIO", help="audio files (WAV, FLAC, ...) to score")
    per.add_argument("--text", action="append", default=[],
                     help="what AUDIO should say; once per AUDIO, in the same order")
    per.add_argument("--manifest", default=None, metavar="MANIFEST.jsonl",
                     help="score every output of an `mmgen batch` speech run (its manifest.jsonl) against its job's text")
    per.add_argument("--voice", default="en-us",
                     help="espeak-ng voice whose accent gives the expected phonemes (default en-us; also en-gb, "
                          "en-gb-x-rp, en-gb-scotland)")
    per.add_argument("--recogniser", default=None, metavar="FOLDER",
                     help="a phoneme recogniser folder (model.safetensors + config.json; default the bundled one)")
    add_json_flag(per)
    per.set_defaults(run=eval_per)


def manifest_items(path: Path) -> list[tuple[Path, str]]:
    """(audio file, text) of every record of an `mmgen batch` manifest; files are relative to the
    manifest's folder. ValueError naming the first bad line."""
    from mmgen.batch import read_jsonl

    if not path.is_file():
        raise ValueError(f"--manifest {path}: no such file")
    records, errors = read_jsonl(path)
    if errors:
        raise ValueError(f"--manifest {path}: {errors[0]}")
    items = []
    for line, record in records:
        spec = record.get("spec") if isinstance(record, dict) else None
        if not isinstance(spec, dict) or not isinstance(record.get("file"), str) or not isinstance(spec.get("text"), str):
            raise ValueError(f"--manifest {path}: line {line} is not a speech record (a file and its job's text)")
        items.append((path.parent / record["file"], spec["text"]))
    if not items:
        raise ValueError(f"--manifest {path} holds no records")
    return items


def read_wave(path: Path) -> tuple[Any, int]:
    """A file's mono float32 waveform and its sampling rate (channels averaged); ValueError (one
    line) for a file that is missing or not audio. Silence is audio: it scores as nothing heard."""
    import soundfile
    import torch

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        data, rate = soundfile.read(path, dtype="float32", always_2d=True)
    except Exception as error:  # soundfile raises LibsndfileError, RuntimeError, TypeError ...
        raise ValueError(f"{path} is not audio soundfile can read ({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    wave = torch.from_numpy(data).mean(1)
    if not torch.isfinite(wave).all():
        raise ValueError(f"{path} holds samples that are not finite")
    return wave, int(rate)


def eval_per(args: argparse.Namespace) -> int:
    from mmgen.audio.phonemes import text_phonemes
    from mmgen.audio.pipeline import SPEAKER_TAG
    from mmgen.audio.recogniser import PhonemeRecogniser, edit_distance

    if args.manifest is not None:
        if args.audio or args.text:
            raise ValueError("give either AUDIO files with --text, or --manifest, not both")
        items = manifest_items(Path(args.manifest))
    else:
        if not args.audio:
            raise ValueError("give AUDIO files with one --text each, or --manifest")
        if len(args.text) != len(args.audio):
            raise ValueError(f"{len(args.audio)} AUDIO file(s) but {len(args.text)} --text: give one --text per file, in order")
        items = [(Path(a), t) for a, t in zip(args.audio, args.text)]
    # Every input first: the files read as audio, the texts turn into phonemes, the recogniser loads.
    waves = [read_wave(path) for path, _ in items]
    text_phonemes("a", args.voice)  # an unknown voice fails here, not as if one text were at fault
    expected = []
    for path, text in items:
        try:
            expected.append(text_phonemes(SPEAKER_TAG.sub(" ", text), args.voice))
        except ValueError as error:
            raise ValueError(f"{path}: text {text!r}: {error}") from None
    recogniser = PhonemeRecogniser.from_pretrained(args.recogniser)
    # One call per file: files may differ in sampling rate.
    heard = [recogniser.transcribe([wave], rate)[0] for wave, rate in waves]

    rows = []
    for (path, text), ref, hyp in zip(items, expected, heard):
        errors, phonemes = edit_distance(ref.split(), hyp.split()), len(ref.split())
        rows.append({"audio": str(path), "text": text, "per": errors / phonemes if phonemes else None, "errors": errors,
                     "phonemes": phonemes, "expected": ref, "heard": hyp})
    errors, phonemes = sum(r["errors"] for r in rows), sum(r["phonemes"] for r in rows)
    if phonemes == 0:
        raise ValueError("the texts hold no phonemes to compare with")
    record = {"per": errors / phonemes, "errors": errors, "phonemes": phonemes, "files": len(rows),
              "voice": args.voice, "recogniser": str(args.recogniser or "bundled"), "items": rows}
    share = lambda r: "n/a" if r["per"] is None else f"{r['per']:.1%}"
    if len(rows) == 1:
        row = rows[0]
        lines = [f"PER {share(row)} ({row['errors']} errors / {row['phonemes']} phonemes) {row['audio']}",
                 f"heard:    {row['heard']}", f"expected: {row['expected']}"]
    else:
        lines = [f"PER {share(r):>6} ({r['errors']}/{r['phonemes']}) {r['audio']}" for r in rows]
        lines.append(f"PER {record['per']:.1%} overall ({errors} errors / {phonemes} phonemes, {len(rows)} files)")
    report(args, lines, record)
    return 0
