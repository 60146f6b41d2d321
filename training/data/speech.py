"""Synthetic English speech for the bundled text-to-speech pair: espeak-ng audio and phonemes.

Every text is one the project makes itself, so the set needs nothing but Debian packages:
  emoji names   from `emoji-test.txt` (Debian `unicode-data`, via `training/data/emoji.py`),
                lower-cased, hyphens and punctuation read as spaces, skin-tone variants dropped
  numbers       0..100 and a fixed hash-chosen subset of 101..9999, spelled out in British style
                ("three hundred and twelve")
  sentences     short templates over small word lists ("the red cat is under the box")
  words         (`--words N`, off by default) N strings of 2-7 words drawn by hash from a broad
                vocabulary: the words of emoji names and of Unicode character names (Debian
                `unicode-data`), with common function words between them; they read as nonsense
                but cover far more sounds and sound sequences than the templates, so a model
                learns to read phonemes rather than a few hundred texts (issue 30)

Each text is spoken once by espeak-ng (Debian `espeak-ng` 1.51) with a voice, speed and pitch
chosen by a hash of the text: four accents (General American, British, RP, Scottish) with male
and female variants, 140-200 words per minute. One espeak call gives both the waveform (22050 Hz
WAV on stdout) and the phonemes it spoke (`--ipa --sep=" " --phonout`), so the phonemes follow
the voice's accent. Audio is scaled by 0.8 (headroom), resampled to 16 kHz, trimmed to 80 ms of
silence at both ends; utterances outside 0.5-3 s are dropped. The held-out split (5%) is a hash
of the text alone. The full set: 5,089 utterances (267 held out), 2.1 hours, about 195 MB.

Phonemes are reduced to the recogniser's fixed inventory (57 symbols) by
`mmgen.audio.phonemes.reduce_phonemes` (stress, length and diacritics dropped, compound symbols
split by longest match; see that module), the same reduction `mmgen eval per` applies to the texts
it scores. An unknown symbol is an error, except in a `words` text, which is then dropped.

Same arguments, same bytes: the order is a hash order of the texts, espeak and the resampler are
deterministic, and the npz is written with fixed zip timestamps.

`--one-voice` speaks every text with one voice at one speed and pitch (General American, 170
words per minute, pitch 50): text alone then decides the speech, the "one voice first" way to
make a small text-to-speech model learn to read (issue 30). Texts and held-out split are the
same, so its held-out utterances say the same texts.

    apt-get install espeak-ng unicode-data
    python -m training.data.speech --out data/speech16k.npz [--limit N]
    python -m training.data.speech --out data/speech16k-en-us.npz --one-voice
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import zipfile
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from pathlib import Path
from typing import Iterable

import numpy as np

from mmgen.audio.phonemes import PHONEMES, espeak, reduce_phonemes

SAMPLE_RATE = 16000
VARIANTS = Path("/usr/lib/x86_64-linux-gnu/espeak-ng-data/voices/!v")
#: Accent + voice variant (espeak-ng-data/voices/!v); the accent decides the phonemes.
VOICES = ("en-us", "en-us+f3", "en-us+m3", "en-gb", "en-gb+f2", "en-gb-x-rp+f4", "en-gb-scotland", "en-gb-scotland+f5")
SPEEDS = tuple(range(140, 201, 10))  # words per minute
PITCHES = tuple(range(35, 66, 5))  # espeak 0-99, 50 is the voice's default
MIN_SECONDS, MAX_SECONDS, MARGIN_SECONDS = 0.5, 3.0, 0.08
GAIN = 0.8  # espeak peaks near full scale; headroom so the resampler's overshoot never clips
EVAL_PERCENT = 5
#: `--one-voice`'s (voice, words per minute, pitch): the middle of the corpus' ranges.
ONE_VOICE = ("en-us", 170, 50)

# ---------------------------------------------------------------------------- texts

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """0..9999 in words, British style: 312 -> "three hundred and twelve", 1005 -> "one thousand and five"."""
    if not 0 <= n <= 9999:
        raise ValueError(f"{n} is outside 0..9999")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        head, rest = f"{_ONES[n // 100]} hundred", n % 100
    else:
        head, rest = f"{_ONES[n // 1000]} thousand", n % 1000
        if rest >= 100:
            return f"{head} {number_words(rest)}"
    return head if rest == 0 else f"{head} and {number_words(rest)}"


def digest(*parts: str) -> bytes:
    return hashlib.sha256("\0".join(parts).encode()).digest()


def hash_order(texts: Iterable[str], salt: str) -> list[str]:
    """`texts` sorted by a salted hash: a fixed pseudo-random order independent of any RNG."""
    return sorted(texts, key=lambda t: digest(salt, t))


def emoji_texts() -> list[str]:
    """Distinct emoji names that read as plain words (no digits, symbols, accents or skin tones)."""
    from training.data.emoji import parse_emoji_test

    names = (re.sub(r"[\s:,.\-]+", " ", name.lower()).strip() for _, name, _, _ in parse_emoji_test() if "skin tone" not in name)
    return sorted({n for n in names if re.fullmatch(r"[a-z ]+", n)})


def number_texts(extra: int = 1100) -> list[str]:
    """0..100, then `extra` numbers from 101..9999 in hash order."""
    chosen = list(range(101)) + [int(s) for s in hash_order(map(str, range(101, 10000)), "number")[:extra]]
    return [number_words(n) for n in sorted(chosen)]


_COLOURS = "red blue green yellow black white pink brown orange grey purple".split()
_SIZES = "big small tiny huge old new".split()
_NOUNS = {n: n + "s" for n in "cat dog ball cup hat bird car book tree chair bed shoe clock key boat lamp frog duck".split()}
_NOUNS.update(box="boxes", fish="fish", bus="buses")
_PLACES = ("on", "under", "behind", "next to", "near", "in front of", "beside", "above")
_COUNTS = [number_words(n) for n in range(2, 13)]
_TEMPLATES = {
    "the {c} {n} is {p} the {m}": dict(c=_COLOURS, n=_NOUNS, p=_PLACES, m=_NOUNS),
    "put the {n} {p} the {c} {m}": dict(n=_NOUNS, p=_PLACES, c=_COLOURS, m=_NOUNS),
    "a {s} {c} {n}": dict(s=_SIZES, c=_COLOURS, n=_NOUNS),
    "{k} {c} {ns}": dict(k=_COUNTS, c=_COLOURS, ns=_NOUNS.values()),
    "the {n} is {c}": dict(n=_NOUNS, c=_COLOURS),
    "where is the {s} {n}": dict(s=_SIZES, n=_NOUNS),
    "i can see {k} {ns} {p} the {n}": dict(k=_COUNTS, ns=_NOUNS.values(), p=_PLACES, n=_NOUNS),
}


def sentence_texts(per_template: int = 400) -> list[str]:
    """Up to `per_template` filled-in sentences of each template, chosen in hash order."""
    out = []
    for template, slots in _TEMPLATES.items():
        filled = {template.format(**dict(zip(slots, values))) for values in product(*slots.values())}
        out += hash_order(filled, template)[:per_template]
    return out


#: Unicode's character names (Debian `unicode-data`): a broad vocabulary without a download.
UNICODE_DATA = Path("/usr/share/unicode/UnicodeData.txt")
#: Common words the `words` kind puts between its content words, so the strings sound like speech.
FUNCTION_WORDS = ("the a an and or of to in on at by for with from is are was it we you they he she my your "
                  "this that there here not no yes please very more some all one two").split()


def vocabulary() -> list[str]:
    """The `words` kind's content words: those of emoji names and Unicode character names that are
    plain lower-case letters, 3-10 long, with a vowel (sorted)."""
    if not UNICODE_DATA.is_file():
        raise FileNotFoundError(f"{UNICODE_DATA} is missing (Debian: apt-get install unicode-data)")
    words = {w for text in emoji_texts() for w in text.split()}
    for line in UNICODE_DATA.read_text(encoding="utf-8").splitlines():
        name = line.split(";")[1]
        if not name.startswith("<"):
            words.update(w.lower() for w in name.split())
    return sorted(w for w in words if re.fullmatch(r"[a-z]{3,10}", w) and re.search(r"[aeiouy]", w))


def word_texts(count: int) -> list[str]:
    """`count` distinct strings of 2-7 words (see the module docstring), each from the hash of
    its index: content words from `vocabulary()`, each followed by a function word one time in
    three."""
    if count <= 0:
        return []
    content = vocabulary()
    out: dict[str, None] = {}
    index = 0
    while len(out) < count:
        h = digest("words", str(index))
        index += 1
        words = []
        for i in range(2 + h[0] % 6):
            pick = int.from_bytes(h[1 + 3 * i: 4 + 3 * i], "little")
            words.append(content[pick % len(content)])
            if pick % 3 == 0 and len(words) < 7:
                words.append(FUNCTION_WORDS[(pick // 3) % len(FUNCTION_WORDS)])
        out.setdefault(" ".join(words[:7]), None)
    return list(out)


def corpus_texts(words: int = 0) -> list[tuple[str, str]]:
    """(kind, text) for every distinct text, in hash order (so `--limit` gives a mix of kinds);
    `words`: that many texts of the `words` kind besides."""
    kinds: dict[str, str] = {}
    for kind, texts in (("emoji", emoji_texts()), ("number", number_texts()), ("sentence", sentence_texts()),
                        ("words", word_texts(words))):
        for text in texts:
            kinds.setdefault(text, kind)
    return [(kinds[t], t) for t in hash_order(kinds, "order")]


def voice_for(text: str) -> tuple[str, int, int]:
    """The (voice, words per minute, pitch) that speaks `text`, from its hash."""
    h = digest("voice", text)
    return VOICES[h[0] % len(VOICES)], SPEEDS[h[1] % len(SPEEDS)], PITCHES[h[2] % len(PITCHES)]


def is_eval(text: str) -> bool:
    return int.from_bytes(digest("eval", text)[:8], "little") % 100 < EVAL_PERCENT


# ---------------------------------------------------------------------------- synthesis


def speak(text: str, voice: str, speed: int, pitch: int) -> tuple[np.ndarray, int, str]:
    """espeak-ng's waveform (int16), its sample rate, and the IPA phonemes it spoke."""
    import soundfile

    ipa, wav = espeak(text, voice, speed, pitch, audio=True)
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    return audio, rate, ipa


def to_16k(audio: np.ndarray, rate: int) -> np.ndarray:
    """Resampled to 16 kHz (torchaudio's sinc resampler) and trimmed to the speech plus a margin."""
    import torch
    import torchaudio.functional as AF

    wave = AF.resample(torch.from_numpy(audio.astype(np.float32) * (GAIN / 32768)), rate, SAMPLE_RATE).numpy()
    loud = np.flatnonzero(np.abs(wave) > 0.01)
    if len(loud) == 0:
        return np.zeros(0, np.int16)
    margin = int(MARGIN_SECONDS * SAMPLE_RATE)
    wave = wave[max(0, loud[0] - margin): loud[-1] + 1 + margin]
    return np.clip(np.round(wave * 32768), -32768, 32767).astype(np.int16)


def check_voices() -> None:
    """espeak-ng silently ignores an unknown variant; fail instead."""
    for voice in VOICES:
        if "+" in voice and not (VARIANTS / voice.split("+")[1]).exists():
            raise FileNotFoundError(f"espeak-ng voice variant {voice} not found under {VARIANTS}")


def build(limit: int | None = None, workers: int = 2, one_voice: bool = False, words: int = 0) -> dict[str, np.ndarray]:
    """The corpus as arrays (see `main` for the fields); `one_voice`: every text in `ONE_VOICE`;
    `words`: texts of the `words` kind besides the others."""
    import torch

    torch.set_num_threads(1)
    check_voices()
    items = corpus_texts(words)[:limit]
    settings = [ONE_VOICE if one_voice else voice_for(text) for _, text in items]
    # The espeak processes run `workers` at a time; results come back in input order.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        spoken = pool.map(lambda a: speak(a[0][1], *a[1]), zip(items, settings))
        rows = []
        for (kind, text), (voice, speed, pitch), (audio, rate, ipa) in zip(items, settings, spoken):
            wave = to_16k(audio, rate)
            if not MIN_SECONDS <= len(wave) / SAMPLE_RATE <= MAX_SECONDS:
                continue
            try:
                phonemes = " ".join(reduce_phonemes(ipa))
            except ValueError:
                if kind != "words":
                    raise
                continue  # a drawn word espeak reads with a sound outside the inventory (Welsh "ll"): dropped
            rows.append((kind, text, voice, speed, pitch, wave, phonemes))
    lengths = np.array([len(r[5]) for r in rows], dtype=np.int64)
    return {
        "audio": np.concatenate([r[5] for r in rows]) if rows else np.zeros(0, np.int16),
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "text": np.array([r[1] for r in rows], dtype=str),
        "kind": np.array([r[0] for r in rows], dtype=str),
        "phonemes": np.array([r[6] for r in rows], dtype=str),
        "voice": np.array([r[2] for r in rows], dtype=str),
        "speed": np.array([r[3] for r in rows], dtype=np.int16),
        "pitch": np.array([r[4] for r in rows], dtype=np.int16),
        "is_eval": np.array([is_eval(r[1]) for r in rows], dtype=bool),
        "inventory": np.array(PHONEMES, dtype=str),
        "sample_rate": np.array(SAMPLE_RATE, dtype=np.int64),
        "skipped": np.array(len(items) - len(rows), dtype=np.int64),
    }


def write_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """An npz that `np.load` reads, byte-identical for identical arrays (fixed zip timestamps), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, array in arrays.items():
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)
    os.replace(tmp, path)


def load_corpus(path: str | Path) -> dict[str, np.ndarray]:
    return dict(np.load(path))


def utterance(data: dict[str, np.ndarray], i: int) -> np.ndarray:
    """Utterance `i`'s int16 samples."""
    return data["audio"][data["offsets"][i]: data["offsets"][i + 1]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/speech16k.npz")
    parser.add_argument("--limit", type=int, help="only the first LIMIT texts (in the corpus's hash order)")
    parser.add_argument("--workers", type=int, default=2, choices=(1, 2), help="espeak processes at a time")
    parser.add_argument("--one-voice", action="store_true", help="every text in one voice, speed and pitch "
                        f"({ONE_VOICE[0]}, {ONE_VOICE[1]} words per minute, pitch {ONE_VOICE[2]})")
    parser.add_argument("--words", type=int, default=0, metavar="N", help="also N texts of the `words` kind (broad "
                        "vocabulary, for reading beyond the templates)")
    args = parser.parse_args(argv)
    data = build(args.limit, args.workers, args.one_voice, args.words)
    write_npz(args.out, data)
    n, held_out = len(data["text"]), int(data["is_eval"].sum())
    hours = len(data["audio"]) / SAMPLE_RATE / 3600
    print(f"wrote {args.out}: {n} utterances ({held_out} held out), {hours:.2f} h, "
          f"{int(data['skipped'])} texts dropped for length; sha256[:16]="
          f"{hashlib.sha256(Path(args.out).read_bytes()).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
