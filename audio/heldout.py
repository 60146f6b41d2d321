"""Held-out texts of the bundled speech model's corpus (`assets/speech-tts-eval.json`, the first
texts that `training/data/speech.py` holds out, in its order): what `mmgen calibrate` speaks for
a speech model, and what the model card and benchmarks score."""

from __future__ import annotations

import json
from pathlib import Path

TEXTS = Path(__file__).parent / "assets" / "speech-tts-eval.json"


def held_out_texts(count: int) -> list[str]:
    """The first `count` held-out texts (at most the file's 128)."""
    return json.loads(TEXTS.read_text(encoding="utf-8"))["texts"][:count]
