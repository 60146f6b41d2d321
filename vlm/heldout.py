"""The bundled VLM's held-out questions (`assets/emoji-vlm-eval.jsonl`) and their emoji images
(rows of the image package's `emoji64-eval.npz`): what `mmgen calibrate` decodes for a VLM, and
what its model card and benchmarks score, with SQuAD-style token F1."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional, Union

import numpy as np

ASSETS = Path(__file__).parent / "assets"


def load_eval(assets: Optional[Union[str, Path]] = None) -> tuple[list[dict], np.ndarray]:
    """The held-out question records (question, answer, kind, image `index`) and the images
    their `index` points into (uint8, [N, H, W, 3]). `assets`: a folder holding
    `emoji-vlm-eval.jsonl` (default: this package's)."""
    from mmgen import image_ar

    images = np.load(Path(image_ar.__file__).parent / "assets" / "emoji64-eval.npz")["images"]
    path = Path(assets if assets is not None else ASSETS) / "emoji-vlm-eval.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return records, images


def token_f1(prediction: str, answer: str) -> float:
    """SQuAD-style F1 over whitespace words (multiset overlap)."""
    pred, gold = prediction.split(), answer.split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold or common == 0:
        return float(pred == gold)
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)
