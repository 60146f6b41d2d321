"""The models that ship inside the package (trained here by `benchmarks/train.py`).

`emoji64` is a class-conditional LlamaGen (GPT + VQ) trained on the Noto emoji set rendered at
64x64, with 74 classes (Unicode emoji subgroups); `emoji64-draft` is a much smaller GPT on the
same tokenizer, for draft-model speculation; `emoji64-classifier` scores samples for the
quality proxies; `emoji64-eval.npz` holds the held-out real images. See
`assets/emoji64/MODEL_CARD.md`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np
import torch

ASSETS = Path(__file__).parent / "assets"
BUNDLED_MODELS = {"emoji64": ASSETS / "emoji64", "emoji64-draft": ASSETS / "emoji64-draft"}
DEFAULT_MODEL = "emoji64"
QUALITY_CLASSIFIER = ASSETS / "emoji64-classifier"
EVAL_SET = ASSETS / "emoji64-eval.npz"


def resolve_model(name_or_path: Union[str, os.PathLike]) -> Union[str, os.PathLike]:
    """A bundled model's folder for its name; anything else is returned as given (a path or repo id)."""
    if str(name_or_path) in BUNDLED_MODELS:
        folder = BUNDLED_MODELS[str(name_or_path)]
        if not (folder / "model_index.json").is_file():
            raise FileNotFoundError(f"the bundled model {name_or_path!r} is missing from this installation ({folder})")
        return folder
    return name_or_path


def decoder_from_spec(spec: str, model: Union[str, os.PathLike], device="cpu", dtype=torch.float32, **overrides):
    """A decoder from a command-line spec ("lantern:delta=0.2", "draft:drafter=emoji64-draft").

    A draft model is named like any model; without one, "draft" uses the bundled
    `<model>-draft` when it exists.
    """
    from mmgen.decoding import make_decoder, parse_decoding

    name, options = parse_decoding(spec)
    options.update(overrides)
    if name == "draft":
        drafter = options.get("drafter") or (f"{model}-draft" if f"{model}-draft" in BUNDLED_MODELS else None)
        if drafter is None:
            raise ValueError("decoding 'draft' needs a draft model: add drafter=NAME_OR_PATH (e.g. 'draft:drafter=emoji64-draft')")
        if isinstance(drafter, (str, os.PathLike)):
            from mmgen.image_ar.llamagen import LlamaGenPipeline

            drafter = LlamaGenPipeline.from_pretrained(resolve_model(drafter), device=device, dtype=dtype)
        options["drafter"] = drafter
    return make_decoder(name, **options)


def load_eval_set() -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out real images as float [N, 3, 64, 64] in [0, 1], and their labels [N]."""
    data = np.load(EVAL_SET)
    return torch.from_numpy(data["images"]).permute(0, 3, 1, 2).float() / 255, torch.from_numpy(data["labels"]).long()
