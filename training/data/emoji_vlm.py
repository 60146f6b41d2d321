"""Questions and answers about the emoji images (`training/data/emoji.py`) for the bundled VLM.

Every answer needs the image and comes from data this project owns: the emoji's Unicode name
(`emoji-test.txt`), its subgroup (the image set's class, hyphens read as spaces), its dominant
colour computed from the pixels, and whether it is a face (its subgroup is a face subgroup:
`face-*` or `cat-face`). A fifth kind asks for a description, one sentence that combines the
other answers (`describe`; 15-25 tokens of the bundled tokenizer), so speculative decoding has
answers long enough to accelerate. Each kind has a few paraphrases; training draws one,
evaluation asks the first. Everything here is deterministic.

The held-out split is the image set's (`is_eval`): those images are never trained on. Their
questions ship as `vlm/assets/emoji-vlm-eval.jsonl`, one line per (image, kind), keyed by the
row of `image_ar/assets/emoji64-eval.npz` (the same images in the same order), so the
evaluation runs where the emoji font is not installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

#: Question kind -> paraphrases (the first is the one evaluation asks).
QUESTIONS: dict[str, tuple[str, ...]] = {
    "name": ("What is this emoji?", "Name this emoji.", "What is the name of this emoji?", "Which emoji is this?"),
    "subgroup": ("Which subgroup is this emoji in?", "What subgroup does this emoji belong to?",
                 "Name the emoji subgroup.", "What kind of emoji is this?"),
    "colour": ("What is the main colour?", "What colour is this emoji?", "Which colour dominates?",
               "What colour is it mostly?"),
    "face": ("Is it a face?", "Is this emoji a face?", "Does this show a face?"),
    "sentence": ("Describe this emoji.", "Describe this emoji in one sentence.", "What does this emoji show?"),
}
KINDS = tuple(QUESTIONS)
#: The kinds whose answer is one short fact (the bundled VLM's first four; `sentence` combines them).
SHORT_KINDS = ("name", "subgroup", "colour", "face")

#: Named colours a pixel is assigned to (nearest in RGB); the emoji's colour is the most common one.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "orange": (245, 140, 30), "yellow": (250, 205, 50), "green": (60, 170, 70),
    "blue": (50, 110, 220), "purple": (140, 70, 180), "pink": (240, 130, 170), "brown": (130, 80, 40),
    "black": (30, 30, 30), "grey": (140, 140, 140), "beige": (240, 215, 180),
}
#: A pixel is background when all its channels are at least this (the images are drawn on white).
WHITE = 230


def dominant_colours(images: np.ndarray) -> list[str]:
    """The palette colour most of each image's non-background pixels are nearest to
    ([N, H, W, 3] uint8; "white" when the image is all background)."""
    names = list(PALETTE)
    palette = np.array([PALETTE[n] for n in names], dtype=np.int32)
    out = []
    for image in images.reshape(len(images), -1, 3).astype(np.int32):
        pixels = image[(image < WHITE).any(-1)]
        if len(pixels) == 0:
            out.append("white")  # not in the palette: only for an empty image
            continue
        nearest = ((pixels[:, None, :] - palette[None]) ** 2).sum(-1).argmin(-1)
        out.append(names[int(np.bincount(nearest, minlength=len(names)).argmax())])
    return out


def patch_mean_colours(images: np.ndarray, patch: int) -> list[str]:
    """The colour answer a reader of patch means would give: each `patch` x `patch` block's
    non-background pixels averaged, the mean's nearest palette colour counted once per pixel,
    the most common one. A vision tower whose patch embedding is linear (CLIP's) sees a
    projection of each patch, of which the mean colour is the part that survives any
    projection: how far this rule gets is what the tower can read without per-pixel detail."""
    names = list(PALETTE)
    palette = np.array([PALETTE[n] for n in names], dtype=np.float64)
    n, h, w, _ = images.shape
    blocks = images.reshape(n, h // patch, patch, w // patch, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    blocks = blocks.reshape(n, -1, patch * patch, 3).astype(np.float64)
    out = []
    for image in blocks:
        counts = np.zeros(len(names))
        for pixels in image:
            pixels = pixels[(pixels < WHITE).any(-1)]
            if len(pixels):
                counts[((palette - pixels.mean(0)) ** 2).sum(-1).argmin()] += len(pixels)
        out.append(names[int(counts.argmax())] if counts.any() else "white")
    return out


def describe(row: dict[str, str]) -> str:
    """The `sentence` answer: the short answers in one sentence, e.g. "This is grinning face, a
    yellow face from the face smiling subgroup." ("a yellow emoji" where it is not a face)."""
    what = "face" if row["face"] == "yes" else "emoji"
    return f"This is {row['name']}, a {row['colour']} {what} from the {row['subgroup']} subgroup."


def answers(names: Iterable[str], subgroups: Iterable[str], colours: Iterable[str]) -> list[dict[str, str]]:
    """Each image's answer per kind, from its Unicode name, subgroup (class name) and colour."""
    rows = [
        {"name": str(name), "subgroup": str(subgroup).replace("-", " "), "colour": colour,
         "face": "yes" if str(subgroup).startswith("face-") or subgroup == "cat-face" else "no"}
        for name, subgroup, colour in zip(names, subgroups, colours)
    ]
    return [{**row, "sentence": describe(row)} for row in rows]


def image_answers(data: dict) -> list[dict[str, str]]:
    """Answers for every image of a `training.data.emoji.build()` result (or its npz)."""
    subgroups = [str(data["class_names"][label]) for label in data["labels"]]
    return answers([str(n) for n in data["names"]], subgroups, dominant_colours(data["images"]))


def eval_records(data: dict, eval_images: np.ndarray) -> list[dict]:
    """The held-out questions: one record per (held-out image, kind), `index` being the row of
    `eval_images` (the shipped `emoji64-eval.npz`), which must hold the split's images in order."""
    held_out = np.asarray(data["is_eval"])
    if not np.array_equal(np.asarray(data["images"])[held_out], eval_images):
        raise ValueError("the eval images differ from the image set's held-out rows (order or content)")
    rows = [a for a, keep in zip(image_answers(data), held_out) if keep]
    return [{"index": i, "kind": kind, "question": QUESTIONS[kind][0], "answer": row[kind]}
            for i, row in enumerate(rows) for kind in KINDS]


def write_jsonl(records: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line]
