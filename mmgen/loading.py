"""Open a model by name, folder or Hub repo, and a decoder by its command-line spec.

One loader for every modality: a bundled name (`registry.bundled_models()`: "emoji64",
"emoji-vlm", ...), a pipeline folder (model_index.json names its class, as in diffusers) or a
transformers folder (config.json's `model_type`: "janus", "llava", "qwen2_5_vl", ...), locally
or on the Hugging Face Hub. `decoder_from_spec` turns "draft:drafter=NAME" / "lantern:delta=0.2"
into a decoder among the shortcuts a pipeline declares, loading the companion model a spec
needs (a drafter, a small model) the same way.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from mmgen import registry
from mmgen.hub import MODEL_INDEX, CheckpointError, folder_file, local_path, read_json, resolve_path

PathLike = Union[str, os.PathLike]


def resolve_model(name_or_path: PathLike) -> PathLike:
    """A bundled model's folder for its name; an existing local path as a Path; anything else
    (a Hub repo id) as given. A name that looks like a path (./x, ../x, /x, ~/x; see
    `mmgen.hub.looks_like_path`) is never a repo id: FileNotFoundError when it does not exist."""
    bundled = registry.bundled_models()
    if str(name_or_path) in bundled:
        folder = bundled[str(name_or_path)]
        if not (folder / MODEL_INDEX).is_file() and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"the bundled model {name_or_path!r} is missing from this installation ({folder})")
        return folder
    local = local_path(name_or_path)
    return name_or_path if local is None else local


def pipeline_class_of(name_or_path: PathLike) -> type:
    """The pipeline class a bundled name, folder or Hub repo holds, reading only its index:
    model_index.json's `_class_name` (mmgen folders) or config.json's `model_type` (transformers
    folders). A Hub repo is asked for those two small files, never downloaded whole."""
    source = resolve_model(name_or_path)
    local = isinstance(source, Path)  # never through a link out of the folder (`folder_file`)
    index, config = (folder_file(source, MODEL_INDEX), folder_file(source, "config.json")) if local else (None, None)
    if index is None:  # a Hub repo id: its index file, else its config
        try:
            index = resolve_path(source, MODEL_INDEX)
        except OSError:
            config = resolve_path(source, "config.json")  # offline / missing: a clear OSError
    if index is not None and index.exists():  # read_json refuses anything but a small regular file
        try:
            return registry.pipeline_class(read_json(index).get("_class_name"))
        except ValueError as error:
            raise CheckpointError(f"{name_or_path}: {error}") from None
    model_type = read_json(config).get("model_type") if config is not None and config.exists() else None
    cls = registry.pipeline_for_model_type(model_type) if model_type else None
    if cls is None and model_type:
        raise CheckpointError(f"{name_or_path}: model_type {model_type!r} (its config.json) is not one mmgen opens "
                              f"({', '.join(registry.model_types())})")
    if cls is None:
        raise CheckpointError(f"{name_or_path} is not a pipeline folder: it has no {MODEL_INDEX} (an mmgen pipeline) "
                              f"and no config.json of a model_type mmgen opens ({', '.join(registry.model_types())})")
    return cls


def load_pipeline(name_or_path: PathLike, device=None, dtype=None) -> Any:
    """The pipeline a bundled name, folder or Hub repo holds (`mmgen.load_pipeline`, every
    `--model`), as the class `pipeline_class_of` resolves, on `device` and in `dtype` when given."""
    cls = pipeline_class_of(name_or_path)
    source = resolve_model(name_or_path)
    # mmgen folders take `dtype`, transformers-backed pipelines `torch_dtype`.
    if "torch_dtype" in inspect.signature(cls.from_pretrained).parameters:
        pipe = cls.from_pretrained(source, torch_dtype=dtype, device=device)
    else:
        pipe = cls.from_pretrained(source, device=device, dtype=dtype)
    pipe.name_or_path = os.fspath(name_or_path)
    return pipe


def companion_of(model: Optional[PathLike], suffix: str) -> Optional[str]:
    """The companion `<model><suffix>` a model has without being told: the bundled one of a
    bundled model, named or by its installed folder; None for any other model (a folder's
    companion is named in the spec: `draft:drafter=PATH`)."""
    if model is None:
        return None
    bundled = registry.bundled_models()
    name = os.fspath(model)
    if name + suffix in bundled:
        return name + suffix
    folder = Path(name)
    if folder.name in bundled and folder.name + suffix in bundled and Path(bundled[folder.name]).resolve() == folder.resolve():
        return folder.name + suffix
    return None


#: Decoder options that generation flags (and batch job fields) also set, with the flag's name
#: for messages.
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


def decoder_from_spec(spec: str, pipe: Any, model: Optional[PathLike], device="cpu",
                      dtype=torch.float32, companions: Optional[dict] = None, **overrides):
    """A decoder for `pipe` (a pipeline or its class) from a command-line spec ("lantern:delta=0.2",
    "draft:drafter=emoji64-draft", "collaborative:large_steps=4"), among the shortcuts the pipeline
    declares (`Pipeline.decoders`). `overrides` are settings given besides the spec (a spec that
    sets one differently is an error: `merge_decoding_options`). Settings neither gives take the
    model's own defaults when the decoder runs (MAR's masked steps: `ContinuousDecoder`). An
    empty spec is an error.

    Decoders that pair the model with a second one (`Pipeline.companions`: draft,
    entropy-switch, collaborative, cspd) take it by name or path, loaded as a pipeline of the same
    decoder family and checked by `pipe.check_companion` (same tokenizer, ...); without one they
    use `companion_of(model, suffix)`, the bundled companion of a bundled model (`emoji64-draft`,
    `emoji-vlm-draft`). `companions` (a dict) memoises the loaded
    companions by (source, device, dtype) across calls (`Pipeline.decoder` keeps one per pipeline).
    """
    from mmgen.decoding import canonical_decoding, make_decoder, parse_decoding

    shortcuts = pipe.decoders()
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty decoding spec {spec!r}: name a decoder ({', '.join(sorted(shortcuts))})")
    name, named = canonical_decoding(*parse_decoding(spec), shortcuts)  # old names warn here, once
    options = merge_decoding_options(spec, named, overrides)
    companion = pipe.companions.get(name)
    if companion is not None and name in shortcuts:
        other = options.get(companion.option) or companion_of(model, companion.suffix)
        if other is None:
            raise ValueError(f"decoding {name!r} needs {companion.role}: add {companion.option}=NAME_OR_PATH "
                             f"(e.g. '{name}:{companion.option}=PATH')")
        if isinstance(other, (str, os.PathLike)):
            key, memo = (os.fspath(other), str(device), str(dtype)), ({} if companions is None else companions)
            if key not in memo:
                memo[key] = load_pipeline(other, device, dtype)
            other = memo[key]
        if _is_pipeline(other) and other.decoder_family != pipe.decoder_family:
            raise ValueError(f"{companion.option}={options.get(companion.option)!s}: {type(other).__name__} decodes "
                             f"{other.decoder_family} models, not {pipe.decoder_family} ones like {_class_of(pipe).__name__}")
        if _is_pipeline(pipe) and _is_pipeline(other):
            pipe.check_companion(other, companion)
        options[companion.option] = other
    decoder = make_decoder(name, shortcuts, **options)
    return with_draft_heads(decoder, pipe) if _is_pipeline(pipe) else decoder


def with_draft_heads(decoder: Any, pipe: Any) -> Any:
    """`decoder` with the pipeline's own draft heads (`Pipeline.draft_heads`: its model folder's
    `draft_heads/`) where it takes heads (`HeadsSpeculative`) and was given none."""
    from mmgen.decoding.heads import HeadsSpeculative

    if isinstance(decoder, HeadsSpeculative) and decoder.heads is None:
        heads = pipe.draft_heads()
        if heads is not None:
            return dataclasses.replace(decoder, heads=heads)
    return decoder


def _is_pipeline(obj: Any) -> bool:
    """isinstance(obj, mmgen.pipeline.Pipeline), read from the class's bases: that module loads
    companions through this one, so this one does not import it."""
    return any(c.__name__ == "Pipeline" and c.__module__ == "mmgen.pipeline" for c in type(obj).__mro__)


def _class_of(pipe) -> type:
    return pipe if isinstance(pipe, type) else type(pipe)
