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

import inspect
import json
import os
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from mmgen import registry
from mmgen.hub import CheckpointError, local_path, resolve_path
from mmgen.pipeline import MODEL_INDEX, Pipeline

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
    generate image --model`), as the class the registry resolves: mmgen folders name it in
    model_index.json (`_class_name`), transformers folders by config.json's `model_type` (e.g.
    "janus": Janus-Pro). A Hub repo id is opened as Janus-Pro when `prompts` is True
    (transformers loads it), else downloaded and read as a folder."""
    source = resolve_model(name_or_path)
    if not isinstance(source, Path) and prompts:
        return _from_pretrained(registry.pipeline_for_model_type("janus"), source, device, dtype)
    root = resolve_path(source)  # a Hub repo: downloaded (or a clear OSError)
    index, config = root / MODEL_INDEX, root / "config.json"
    if index.is_file():
        try:
            cls = registry.pipeline_class(json.loads(index.read_text()).get("_class_name"))
        except ValueError as error:
            raise CheckpointError(f"{name_or_path}: {error}") from None
        return _from_pretrained(cls, root, device, dtype)
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    cls = registry.pipeline_for_model_type(model_type) if model_type else None
    if cls is None:
        raise CheckpointError(f"{name_or_path} is not a pipeline folder: it has no {MODEL_INDEX} (an mmgen pipeline) "
                              f"and no config.json of a model_type mmgen opens ({', '.join(registry.model_types())})")
    return _from_pretrained(cls, root, device, dtype)


def _from_pretrained(cls, source, device, dtype):
    """`cls.from_pretrained`: mmgen folders take `dtype`, transformers-backed pipelines `torch_dtype`."""
    if "torch_dtype" in inspect.signature(cls.from_pretrained).parameters:
        return cls.from_pretrained(source, torch_dtype=dtype, device=device)
    return cls.from_pretrained(source, device=device, dtype=dtype)


def load_class_pipeline(name_or_path: Union[str, os.PathLike], device="cpu", dtype=torch.float32):
    """A class-conditional pipeline by bundled name or folder (`load_pipeline`; ValueError for
    one conditioned on anything else)."""
    pipe = load_pipeline(name_or_path, device, dtype, prompts=False)
    if pipe.conditions != "class":
        raise ValueError(f"{name_or_path} holds a {type(pipe).__name__}, not a class-conditional pipeline")
    return pipe


#: Decoder options that `mmgen generate image` flags (and batch job fields) also set, with the
#: flag's name for messages.
FLAG_OF_OPTION = {"window": "--window", "num_steps": "--num-iter (num_iter)"}


def merge_decoding_options(spec: str, named: dict, given: dict) -> dict:
    """The one rule for a decoder setting given twice: `named` (the spec's own options) and
    `given` (the same settings from flags or fields) must agree, else ValueError naming both."""
    merged = dict(named)
    for key, value in given.items():
        if key in named and named[key] != value:
            raise ValueError(f"the decoding spec {spec!r} sets {key}={named[key]!r} but {FLAG_OF_OPTION.get(key, key)} "
                             f"is {value!r}: give the setting once")
        merged[key] = value
    return merged


def decoder_from_spec(spec: str, pipe: Union[Pipeline, type], model: Union[str, os.PathLike], device="cpu",
                      dtype=torch.float32, **overrides):
    """A decoder for `pipe` (a pipeline or its class) from a command-line spec ("lantern:delta=0.2",
    "draft:drafter=emoji64-draft", "code:draft_steps=4"), among the shortcuts the pipeline
    declares (`Pipeline.decoders`). `overrides` are settings given besides the spec (a spec that
    sets one differently is an error: `merge_decoding_options`). Settings neither gives take the
    model's own defaults when the decoder runs (MAR's masked steps: `ContinuousDecoder`). An
    empty spec is an error.

    Decoders that pair the model with a second one (`Pipeline.companions`: draft,
    entropy-switch, code, cspd) take it by name or path, loaded as a pipeline of the same
    decoder family; without one they use the bundled companion `<model><suffix>`
    (`emoji64-draft`, `var-emoji64-small`) when it exists.
    """
    from mmgen.decoding import make_decoder, parse_decoding

    shortcuts = pipe.decoders()
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty decoding spec {spec!r}: name a decoder ({', '.join(sorted(shortcuts))})")
    name, named = parse_decoding(spec)
    options = merge_decoding_options(spec, named, overrides)
    companion = pipe.companions.get(name)
    if companion is not None and name in shortcuts:
        other = options.get(companion.option) or (f"{model}{companion.suffix}" if f"{model}{companion.suffix}" in BUNDLED_MODELS else None)
        if other is None:
            raise ValueError(f"decoding {name!r} needs {companion.role} of the same tokenizer: add {companion.option}=NAME_OR_PATH "
                             f"(e.g. '{name}:{companion.option}=PATH')")
        if isinstance(other, (str, os.PathLike)):
            other = load_pipeline(other, device, dtype, prompts=pipe.conditions == "prompt")
        if isinstance(other, Pipeline) and other.decoder_family != pipe.decoder_family:
            raise ValueError(f"{companion.option}={options.get(companion.option)!s}: {type(other).__name__} decodes "
                             f"{other.decoder_family} models, not {pipe.decoder_family} ones like {_class_of(pipe).__name__}")
        options[companion.option] = other
    return make_decoder(name, shortcuts, **options)


def _class_of(pipe) -> type:
    return pipe if isinstance(pipe, type) else type(pipe)


def load_eval_set() -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out real images as float [N, 3, 64, 64] in [0, 1], and their labels [N]."""
    data = np.load(EVAL_SET)
    return torch.from_numpy(data["images"]).permute(0, 3, 1, 2).float() / 255, torch.from_numpy(data["labels"]).long()
