"""The models that ship inside the package (trained here by `training/train.py`).

`emoji64` is a class-conditional LlamaGen (GPT + VQ) trained on the Noto emoji set rendered at
64x64, with 74 classes (Unicode emoji subgroups); `emoji64-draft` is a much smaller GPT on the
same tokenizer, for draft-model speculation; `emoji64-classifier` scores samples for the
quality proxies; `emoji64-eval.npz` holds the held-out real images. See
`assets/emoji64/MODEL_CARD.md`. `var-emoji64` and `var-emoji64-small` are two VAR transformers
of different depths on one multi-scale VQVAE (`training/train_var.py`; the large model and its
small model for collaborative decoding); see `assets/var-emoji64/MODEL_CARD.md`.
`mar-emoji64` and `mar-emoji64-draft` are two MARs of different sizes on one KL VAE
(`training/train_mar.py`; a target and a drafter for continuous speculative decoding); see
`assets/mar-emoji64/MODEL_CARD.md`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np
import torch

from mmgen.image_ar import BUNDLED_MODELS as _BUNDLED_FOLDERS
from mmgen.loading import load_pipeline

ASSETS = Path(__file__).parent / "assets"
#: The image models by name -> folder (names resolve in `mmgen.loading` for every modality).
BUNDLED_MODELS = {name: Path(__file__).parent / folder for name, folder in _BUNDLED_FOLDERS.items()}
DEFAULT_MODEL = "emoji64"
QUALITY_CLASSIFIER = ASSETS / "emoji64-classifier"
EVAL_SET = ASSETS / "emoji64-eval.npz"


def load_class_pipeline(name_or_path: Union[str, os.PathLike], device="cpu", dtype=torch.float32):
    """A class-conditional pipeline by bundled name or folder (`load_pipeline`; ValueError for
    one conditioned on anything else)."""
    pipe = load_pipeline(name_or_path, device, dtype)
    if pipe.conditions != "class":
        raise ValueError(f"{name_or_path} holds a {type(pipe).__name__}, not a class-conditional pipeline")
    return pipe


def load_eval_set() -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out real images as float [N, 3, 64, 64] in [0, 1], and their labels [N]."""
    data = np.load(EVAL_SET)
    return torch.from_numpy(data["images"]).permute(0, 3, 1, 2).float() / 255, torch.from_numpy(data["labels"]).long()
