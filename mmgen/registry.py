"""One registry of pipeline classes, by the name a saved folder gives (diffusers' `_class_name`).

A pipeline folder names its class in model_index.json; a transformers folder names its model in
config.json (`model_type`). Both resolve here, to a class registered with `register_pipeline`,
so that loaders, `mmgen generate`, `mmgen batch`, the demos and the benchmarks ask the class what
it is (`Pipeline.decoder_family`, `conditions`, `default_decoding`, `companions`) instead of
re-deriving it from isinstance checks or class-name strings.

The core imports no modality: a modality package lists its pipelines in `PIPELINE_MODULES`
(class name -> the module that defines and registers it) and the registry imports that module
the first time the name is looked up. A family defined elsewhere (a plugin, a test) registers
its class directly.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Iterable, Optional, TypeVar

#: Packages whose `PIPELINE_MODULES` (class name -> module), `PIPELINE_ALIASES` (other name ->
#: class name), `MODEL_TYPES` (transformers model_type -> class name) and `BUNDLED_MODELS`
#: (name of a model shipped as package data -> its folder, relative to the package) and
#: `BATCH_JOBS` (the field that marks a job of that modality -> the module whose `run_batch`
#: runs such job files) the registry reads.
MODALITY_PACKAGES = ("mmgen.image_ar", "mmgen.vlm", "mmgen.audio", "mmgen.video")

PIPELINES: dict[str, type] = {}
MODEL_TYPE_PIPELINES: dict[str, str] = {}
_indexes: Optional[list] = None

T = TypeVar("T", bound=type)


def register_pipeline(cls: Optional[T] = None, *, model_types: Iterable[str] = ()) -> Callable[[T], T] | T:
    """Register a pipeline class under its class name (a class decorator); `model_types` are
    the transformers `model_type`s whose plain transformers folders it opens. Registering a
    second class under a taken name is an error (names are what folders store)."""

    def register(klass: T) -> T:
        name = klass.__name__
        if PIPELINES.get(name, klass) is not klass:
            raise ValueError(f"a pipeline class named {name!r} is already registered ({PIPELINES[name].__module__})")
        PIPELINES[name] = klass
        for model_type in model_types:
            MODEL_TYPE_PIPELINES[model_type] = name
        return klass

    return register if cls is None else register(cls)


def unregister_pipeline(name: str) -> None:
    """Remove a registered class (tests that register a toy family clean up with this)."""
    PIPELINES.pop(name, None)
    for model_type in [t for t, n in MODEL_TYPE_PIPELINES.items() if n == name]:
        del MODEL_TYPE_PIPELINES[model_type]


def _modality_indexes() -> list:
    global _indexes
    if _indexes is None:
        _indexes = [importlib.import_module(package) for package in MODALITY_PACKAGES]
    return _indexes


def pipeline_names() -> list[str]:
    """Every pipeline class name known: registered ones and those modality packages list."""
    names = set(PIPELINES)
    for index in _modality_indexes():
        names |= set(getattr(index, "PIPELINE_MODULES", {}))
    return sorted(names)


def is_pipeline_name(name: str) -> bool:
    """Whether `name` is a pipeline class name or alias, without importing the class."""
    return name in PIPELINES or any(
        name in getattr(i, "PIPELINE_MODULES", {}) or name in getattr(i, "PIPELINE_ALIASES", {}) for i in _modality_indexes()
    )


def pipeline_class(name: str) -> type:
    """The pipeline class a folder names (model_index.json's `_class_name`, or an alias such as
    `LlamaGenT2IPipeline`); its module is imported on first use. ValueError for unknown names."""
    if not isinstance(name, str):
        raise ValueError(f"pipeline class names are strings, got {name!r}")
    if name in PIPELINES:
        return PIPELINES[name]
    for index in _modality_indexes():
        target = getattr(index, "PIPELINE_ALIASES", {}).get(name, name)
        module = getattr(index, "PIPELINE_MODULES", {}).get(target)
        if module is not None:
            importlib.import_module(module)
            if target not in PIPELINES:
                raise RuntimeError(f"{module} was listed for {target} but did not register it")
            return PIPELINES[target]
    raise ValueError(f"unknown pipeline class {name!r}; mmgen has {pipeline_names()}")


def listed_pipeline(package: str, name: str) -> type:
    """The pipeline class `name` that modality `package` lists, for that package's module
    `__getattr__` (`from mmgen.audio import TTSPipeline` imports the pipeline's module, and its
    heavy dependencies, on first use only); AttributeError for any other name."""
    index = vars(importlib.import_module(package))  # not getattr: that would come back here
    if name in index.get("PIPELINE_MODULES", {}) or name in index.get("PIPELINE_ALIASES", {}):
        return pipeline_class(name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def model_types() -> list[str]:
    """Every transformers `model_type` a registered or listed pipeline opens."""
    types = set(MODEL_TYPE_PIPELINES)
    for index in _modality_indexes():
        types |= set(getattr(index, "MODEL_TYPES", {}))
    return sorted(types)


def pipeline_for_model_type(model_type: str) -> Optional[type]:
    """The pipeline class that opens plain transformers folders of `model_type`, or None."""
    if model_type not in MODEL_TYPE_PIPELINES:
        for index in _modality_indexes():
            name = getattr(index, "MODEL_TYPES", {}).get(model_type)
            if name is not None:
                return pipeline_class(name)
        return None
    return pipeline_class(MODEL_TYPE_PIPELINES[model_type])


def bundled_models() -> dict[str, Path]:
    """Every model shipped inside the package, by name ("emoji64", "emoji-vlm", ...), with its
    folder (which may be missing from a slimmed installation: loaders say so)."""
    models: dict[str, Path] = {}
    for index in _modality_indexes():
        root = Path(index.__file__).parent
        models.update({name: root / folder for name, folder in getattr(index, "BUNDLED_MODELS", {}).items()})
    return models


def batch_runners() -> dict[str, str]:
    """Job field -> the module that runs job files of that kind (`mmgen batch`)."""
    runners: dict[str, str] = {}
    for index in _modality_indexes():
        runners.update(getattr(index, "BATCH_JOBS", {}))
    return runners
