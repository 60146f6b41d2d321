"""The phonemes a text should sound like: Debian's espeak-ng, reduced to the fixed inventory the
project's phoneme recogniser (`mmgen.audio.recogniser`) hears.

espeak-ng writes IPA with stress and length marks and compound symbols; `reduce_phonemes` maps
that onto `PHONEMES` (57 symbols) the way the speech corpus (`training/data/speech.py`) did for
every training and held-out utterance: stress marks (ˈ ˌ) and length marks (ː) are dropped, and so
are combining diacritics (nasal ɑ̃, syllabic n̩, dental t̪, palatal ʲ); ᵻ (reduced vowel) reads as
ɪ; compound symbols espeak emits for r-coloured or syllabic sounds are split into inventory
symbols by longest match (ɑːɹ -> ɑ ɹ, əl -> ə l, aɪɚ -> aɪ ɚ). An unknown symbol is an error.

Phonemes follow espeak's voice: `en-us` (General American, the default), `en-gb`, `en-gb-x-rp`,
`en-gb-scotland` are the accents the corpus was spoken in.
"""

from __future__ import annotations

import re
import subprocess
from typing import Optional

#: The espeak-ng executable (Debian package `espeak-ng`).
ESPEAK = "espeak-ng"

#: The phoneme inventory (index = class id; a CTC model adds a blank after these).
PHONEMES = (
    # consonants
    "p", "b", "t", "d", "k", "ɡ", "f", "v", "θ", "ð", "s", "z", "ʃ", "ʒ", "h", "tʃ", "dʒ",
    "m", "n", "ŋ", "l", "ɹ", "r", "w", "ʍ", "j", "ɾ", "ʔ", "x",
    # vowels
    "i", "ɪ", "e", "ɛ", "æ", "a", "ɑ", "ɒ", "ɔ", "o", "ʊ", "u", "ʉ", "ʌ", "ə", "ɐ", "ɜ", "ɚ",
    # diphthongs
    "eɪ", "aɪ", "ɔɪ", "aʊ", "oʊ", "əʊ", "ʌʉ", "iə", "eə", "ʊə",
)
#: One ASCII letter per symbol of `PHONEMES` (same order): a phoneme sequence spelled for a
#: byte-level text encoder (Dia's), one token per phoneme.
PHONEME_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ01234"
#: Dia's speaker tags ("[S1]", "[S2]"), kept as they are when a text is spelled in phonemes.
SPEAKER_TAG = re.compile(r"(\[S\d+\])")
#: Stress, length and the combining diacritics the inventory does not distinguish.
_INDEX = {symbol: i for i, symbol in enumerate(PHONEMES)}
DROPPED = re.compile("[ˈˌː:\u0303\u0329\u032a\u02b2]")


def reduce_phonemes(ipa: str) -> list[str]:
    """espeak's space-separated IPA -> symbols of `PHONEMES` (see the module docstring); ValueError
    for a symbol outside the inventory."""
    out = []
    for token in ipa.split():
        token = DROPPED.sub("", token).replace("ᵻ", "ɪ")
        while token:
            match = next((token[:k] for k in (3, 2, 1) if token[:k] in PHONEMES), None)
            if match is None:
                raise ValueError(f"phoneme {token!r} (from {ipa!r}) is not in the inventory")
            out.append(match)
            token = token[len(match):]
    return out


def spell_phonemes(phonemes: str) -> str:
    """Space-separated `PHONEMES` symbols -> one `PHONEME_LETTERS` letter each, so a byte-level
    encoder reads one token per phoneme ("ʌ m b ɹ ɛ l ə" -> "QrbvGuR"); ValueError for a symbol
    outside the inventory."""
    letters = []
    for symbol in phonemes.split():
        if symbol not in _INDEX:
            raise ValueError(f"phoneme {symbol!r} is not in the inventory")
        letters.append(PHONEME_LETTERS[_INDEX[symbol]])
    return "".join(letters)


def espeak(text: str, voice: str = "en-us", speed: Optional[int] = None, pitch: Optional[int] = None,
           audio: bool = False) -> tuple[str, bytes]:
    """The IPA espeak-ng speaks `text` with (space-separated symbols) and, with `audio`, its WAV
    bytes (22050 Hz); `speed` in words per minute, `pitch` 0-99. One call gives both, so the
    phonemes are those of the audio. FileNotFoundError (one line) when espeak-ng is missing."""
    command = [ESPEAK, "-v", voice]
    if speed is not None:
        command += ["-s", str(speed)]
    if pitch is not None:
        command += ["-p", str(pitch)]
    # "--": a text that begins with "-" is text, not options.
    command += ["--ipa", "--sep= ", "--phonout=/dev/stderr", "--stdout" if audio else "-q", "--", text]
    try:
        result = subprocess.run(command, capture_output=True, check=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{ESPEAK} is not installed: it turns text into phonemes (Debian: apt-get install espeak-ng)") from None
    except subprocess.CalledProcessError as error:
        detail = error.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(f"{ESPEAK} -v {voice} failed: {detail[0] if detail else f'exit status {error.returncode}'}") from None
    return result.stderr.decode(), result.stdout


def text_phonemes(text: str, voice: str = "en-us") -> str:
    """The phonemes espeak-ng's `voice` says `text` with, reduced to `PHONEMES`, space-joined (the
    corpus's and the recogniser's form)."""
    if not text.strip():
        raise ValueError("the text is empty")
    return " ".join(reduce_phonemes(espeak(text, voice)[0]))


def spell_text(text: str, voice: str = "en-us") -> str:
    """A text as a phoneme-reading model takes it: each stretch between Dia's speaker tags
    spoken by espeak-ng's `voice` and spelled one letter per phoneme (`spell_phonemes`), the
    tags kept ("[S1] Hello." -> "[S1] oRuZ"). ValueError (one line) when it has nothing to say."""
    parts = []
    for part in SPEAKER_TAG.split(text):
        if SPEAKER_TAG.fullmatch(part):
            parts.append(part)
        elif part.strip():
            spelled = spell_phonemes(" ".join(reduce_phonemes(espeak(part, voice)[0])))
            if spelled:
                parts.append(spelled)
    if not any(not SPEAKER_TAG.fullmatch(p) for p in parts):
        raise ValueError(f"the text {text[:40]!r} has nothing to say (espeak-ng -v {voice} gives it no phonemes)")
    return " ".join(parts)
