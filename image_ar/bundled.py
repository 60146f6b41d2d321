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

import json
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from mmgen.hub import CheckpointError, local_path, resolve_path
from mmgen.pipeline import MODEL_INDEX

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
    """A bundled model's folder for its name; an existing local path as a Path; anything else
    (a Hub repo id) as given. A name that looks like a path (./x, ../x, /x, ~/x; see
    `mmgen.hub.looks_like_path`) is never a repo id: FileNotFoundError when it does not exist."""
    if str(name_or_path) in BUNDLED_MODELS:
        folder = BUNDLED_MODELS[str(name_or_path)]
        if not (folder / "model_index.json").is_file():
            raise FileNotFoundError(f"the bundled model {name_or_path!r} is missing from this installation ({folder})")
        return folder
    local = local_path(name_or_path)
    return name_or_path if local is None else local


def load_pipeline(name_or_path: Union[str, os.PathLike], device=None, dtype=None, prompts: Optional[bool] = None):
    """The pipeline a bundled name, folder or Hub repo holds (`mmgen.load_pipeline`, `mmgen
    generate image --model`): mmgen folders name their class in model_index.json; transformers
    folders whose config.json has model_type "janus" are Janus-Pro checkpoints. A Hub repo id
    is opened as Janus-Pro when `prompts` is True (transformers loads it), else downloaded and
    read as a folder."""
    source = resolve_model(name_or_path)
    if not isinstance(source, Path) and prompts:
        return _janus(source, device, dtype)
    root = resolve_path(source)  # a Hub repo: downloaded (or a clear OSError)
    index, config = root / MODEL_INDEX, root / "config.json"
    if index.is_file():
        class_name = json.loads(index.read_text()).get("_class_name")
        import mmgen

        try:
            cls = mmgen.pipeline_class(class_name)
        except ValueError as error:
            raise CheckpointError(f"{name_or_path}: {error}") from None
        return cls.from_pretrained(root, device=device, dtype=dtype)
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "janus":
        return _janus(root, device, dtype)
    raise CheckpointError(f"{name_or_path} is not a pipeline folder: it has no {MODEL_INDEX} (an mmgen pipeline) "
                          f"and no config.json of model_type 'janus' (a Janus-Pro checkpoint)")


def _janus(source, device, dtype):
    from mmgen.image_ar.janus import JanusPipeline

    return JanusPipeline.from_pretrained(source, torch_dtype=dtype, device=device)


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
    """A class-conditional pipeline (LlamaGen, VAR or MAR) by bundled name or folder
    (`load_pipeline`; ValueError for a text-to-image one)."""
    from mmgen.image_ar.outputs import ClassLabelled

    pipe = load_pipeline(name_or_path, device, dtype, prompts=False)
    if not isinstance(pipe, ClassLabelled):
        raise ValueError(f"{name_or_path} holds a {type(pipe).__name__}, not a class-conditional pipeline")
    return pipe


#: Decoder options that `mmgen generate image` flags (and batch job fields) also set, with the
#: flag's name for messages.
FLAG_OF_OPTION = {"window": "--window", "num_steps": "--num-iter (num_iter)"}


def merge_decoding_options(spec: str, named: dict, given: dict, defaults: Optional[dict] = None) -> dict:
    """The one rule for a decoder setting given twice: `named` (the spec's own options) and
    `given` (the same settings from flags or fields) must agree, else ValueError naming both;
    `defaults` (e.g. the model's step count) fill what neither sets."""
    merged = dict(named)
    for key, value in given.items():
        if key in named and named[key] != value:
            raise ValueError(f"the decoding spec {spec!r} sets {key}={named[key]!r} but {FLAG_OF_OPTION.get(key, key)} "
                             f"is {value!r}: give the setting once")
        merged[key] = value
    for key, value in (defaults or {}).items():
        merged.setdefault(key, value)
    return merged


def decoder_from_spec(spec: str, model: Union[str, os.PathLike], device="cpu", dtype=torch.float32, family: str = "token",
                      defaults: Optional[dict] = None, **overrides):
    """A decoder from a command-line spec ("lantern:delta=0.2", "draft:drafter=emoji64-draft",
    "code:draft_steps=4"); `family` picks the shortcuts of token ("token"), next-scale ("scale",
    VAR) or continuous ("continuous", MAR) models. `overrides` are settings given besides the
    spec (a spec that sets one differently is an error: `merge_decoding_options`); `defaults`
    fill what neither sets. An empty spec is an error.

    Decoders that pair the model with a second one (draft, entropy-switch, code, cspd) take it
    by name or path; without one they use the bundled companion `<model>-draft` /
    `<model>-small` when it exists.
    """
    from mmgen.decoding import CONTINUOUS_DECODERS, DECODERS, SCALE_DECODERS, make_decoder, parse_decoding

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    registry = {"token": DECODERS, "scale": SCALE_DECODERS, "continuous": CONTINUOUS_DECODERS}[family]
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty decoding spec {spec!r}: name a decoder ({', '.join(sorted(registry))})")
    name, named = parse_decoding(spec)
    options = merge_decoding_options(spec, named, overrides, defaults)
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
