"""The models that ship inside the package (trained here by `benchmarks/train.py`).

`emoji64` is a class-conditional LlamaGen (GPT + VQ) trained on the Noto emoji set rendered at
64x64, with 74 classes (Unicode emoji subgroups); `emoji64-draft` is a much smaller GPT on the
same tokenizer, for draft-model speculation; `emoji64-classifier` scores samples for the
quality proxies; `emoji64-eval.npz` holds the held-out real images. See
`assets/emoji64/MODEL_CARD.md`. `var-emoji64` and `var-emoji64-small` are two VAR transformers
of different depths on one multi-scale VQVAE (`benchmarks/train_var.py`; a large drafter and a
small refiner for collaborative decoding); see `assets/var-emoji64/MODEL_CARD.md`.
`mar-emoji64` and `mar-emoji64-draft` are two MARs of different sizes on one KL VAE
(`benchmarks/train_mar.py`; a target and a drafter for continuous speculative decoding); see
`assets/mar-emoji64/MODEL_CARD.md`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np
import torch

ASSETS = Path(__file__).parent / "assets"
BUNDLED_MODELS = {
    "emoji64": ASSETS / "emoji64",
    "emoji64-draft": ASSETS / "emoji64-draft",
    "var-emoji64": ASSETS / "var-emoji64",
    "var-emoji64-small": ASSETS / "var-emoji64-small",
    "mar-emoji64": ASSETS / "mar-emoji64",
    "mar-emoji64-draft": ASSETS / "mar-emoji64-draft",
}
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


#: Decoders that pair the model with a second one: option name, the bundled companion's
#: suffix, and what it is (for the error message).
COMPANIONS = {
    "draft": ("drafter", "-draft", "a draft model"),
    "entropy-switch": ("small", "-draft", "a small model"),
    "code": ("refiner", "-small", "a small refiner model"),
    "cspd": ("drafter", "-draft", "a draft model"),
}
#: Which decoder shortcuts each kind of model takes.
FAMILIES = ("token", "scale", "continuous")


def load_class_pipeline(name_or_path: Union[str, os.PathLike], device="cpu", dtype=torch.float32):
    """A class-conditional pipeline (LlamaGen, VAR or MAR, as its model_index.json says) by
    bundled name or folder."""
    import json

    from mmgen.image_ar.llamagen import LlamaGenPipeline
    from mmgen.image_ar.mar import MARPipeline
    from mmgen.image_ar.var import VARPipeline

    source = Path(resolve_model(name_or_path))
    index = source / "model_index.json"
    class_name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    cls = {"VARPipeline": VARPipeline, "MARPipeline": MARPipeline}.get(class_name, LlamaGenPipeline)
    return cls.from_pretrained(source, device=device, dtype=dtype)


def decoder_from_spec(spec: str, model: Union[str, os.PathLike], device="cpu", dtype=torch.float32, family: str = "token",
                      **overrides):
    """A decoder from a command-line spec ("lantern:delta=0.2", "draft:drafter=emoji64-draft",
    "code:draft_steps=4"); `family` picks the shortcuts of token ("token"), next-scale ("scale",
    VAR) or continuous ("continuous", MAR) models.

    Decoders that pair the model with a second one (draft, entropy-switch, code, cspd) take it
    by name or path; without one they use the bundled companion `<model>-draft` /
    `<model>-small` when it exists.
    """
    from mmgen.decoding import CONTINUOUS_DECODERS, DECODERS, SCALE_DECODERS, make_decoder, parse_decoding

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    registry = {"token": DECODERS, "scale": SCALE_DECODERS, "continuous": CONTINUOUS_DECODERS}[family]
    name, options = parse_decoding(spec)
    options.update(overrides)
    if name in COMPANIONS and name in registry:
        option, suffix, noun = COMPANIONS[name]
        companion = options.get(option) or (f"{model}{suffix}" if f"{model}{suffix}" in BUNDLED_MODELS else None)
        if companion is None:
            raise ValueError(f"decoding {name!r} needs {noun} of the same tokenizer: add {option}=NAME_OR_PATH (e.g. '{name}:{option}=PATH')")
        if isinstance(companion, (str, os.PathLike)):
            companion = load_class_pipeline(companion, device, dtype)
        options[option] = companion
    return make_decoder(name, registry, **options)


def load_eval_set() -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out real images as float [N, 3, 64, 64] in [0, 1], and their labels [N]."""
    data = np.load(EVAL_SET)
    return torch.from_numpy(data["images"]).permute(0, 3, 1, 2).float() / 255, torch.from_numpy(data["labels"]).long()
