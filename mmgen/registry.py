"""One registry of pipeline classes, by the name a saved folder gives (diffusers' `_class_name`).

A pipeline folder names its class in model_index.json; a transformers folder names its model in
config.json (`model_type`). Both resolve here, to a class registered with `register_pipeline`,
so that loaders, `mmgen generate`, `mmgen batch`, the demos and the benchmarks ask the class what
it is (`Pipeline.decoder_family`, `conditions`, `default_decoding`, `companions`) instead of
re-deriving it from isinstance checks or class-name strings.

The core imports no modality: a modality package lists its pipelines in `PIPELINE_MODULES`
(class name -> the module that defines and registers it) and the registry imports that module
the first time the name is looked up. A family defined elsewhere (a plugin, a test) registers
its class directly. Likewise `mmgen batch` learns the modalities of job files from the packages'
`BATCH_JOBS` (modality name -> the module that runs them) and `BATCH_MARKERS` (the field that
marks a job line that names no "modality"; `BATCH_OLD_MARKERS` for old forms still read), through
`batch_runners` and `batch_markers`.

Text (vision-language models answering about images and videos), speech and video families
register with `register_family`: one call names what a folder of the family holds (its
config.json `model_type`, or its model_index.json `_class_name` for video), the pipeline that
opens it and, for speech, the adapter that turns texts into the model's conditions. The modality
packages make their built-in families' calls when imported, naming classes as "module:Class" so
nothing heavy loads before it is used; the loaders, `mmgen generate`, `mmgen batch` and the
request layer's entry checks ask `family` and `families` instead of keeping lists of their own.
A modality goes by one name everywhere (these keys, `mmgen generate`, job files, the server's
catalogues and metrics); an old name still accepted is in `RENAMED_MODALITIES`.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar, Union

#: Packages whose `PIPELINE_MODULES` (class name -> module), `PIPELINE_ALIASES` (other name ->
#: class name), `MODEL_TYPES` (transformers model_type -> class name) and `BUNDLED_MODELS`
#: (name of a model shipped as package data -> its folder, relative to the package),
#: `BATCH_JOBS` (a modality name of `mmgen batch` job files -> the module whose `run_batch`
#: runs them), `BATCH_MARKERS` (a field that marks a job line without a "modality" field as one
#: of that package's -> its modality name) and `BATCH_OLD_MARKERS` (likewise, for an old form of
#: job lines still read) the registry reads; importing them registers their families.
MODALITY_PACKAGES = ("mmgen.image_ar", "mmgen.vlm", "mmgen.audio", "mmgen.video")

#: The modalities, by the one name a user types everywhere (`mmgen generate`, `mmgen bench`,
#: `mmgen demo`, job files, the server's catalogues and metrics), each with what it makes. The
#: folders that hold them are named for what they hold (docs/architecture.md, "Layout").
MODALITIES = {"image": "images", "text": "answers about images and videos (vision-language models)",
              "speech": "speech from text", "video": "videos from prompts (block diffusion)"}

#: What names a family in a saved folder, per modality that registers families: a transformers
#: folder's config.json `model_type`, or a pipeline folder's model_index.json `_class_name`.
FAMILY_KEYS = {"text": "model_type", "speech": "model_type", "video": "_class_name"}

#: Old modality name -> its name now: accepted, with a DeprecationWarning, until the next release
#: ("vlm" was the text modality's name in the family registry and the server).
RENAMED_MODALITIES = {"vlm": "text"}

PIPELINES: dict[str, type] = {}
MODEL_TYPE_PIPELINES: dict[str, str] = {}
#: Pipeline class name -> the module that defines and registers it, from "module:Class" names
#: given to `register_family`.
PIPELINE_SOURCES: dict[str, str] = {}
#: modality -> family name -> `Family` (`register_family`).
FAMILIES: dict[str, dict[str, "Family"]] = {modality: {} for modality in FAMILY_KEYS}
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
    return sorted(names | set(PIPELINE_SOURCES))


def is_pipeline_name(name: str) -> bool:
    """Whether `name` is a pipeline class name or alias, without importing the class."""
    indexes = _modality_indexes()  # first: importing a package registers its families
    return name in PIPELINES or name in PIPELINE_SOURCES or any(
        name in getattr(i, "PIPELINE_MODULES", {}) or name in getattr(i, "PIPELINE_ALIASES", {}) for i in indexes
    )


def pipeline_class(name: str) -> type:
    """The pipeline class a folder names (model_index.json's `_class_name`, or an alias such as
    `LlamaGenT2IPipeline`); its module is imported on first use. ValueError for unknown names."""
    if not isinstance(name, str):
        raise ValueError(f"pipeline class names are strings, got {name!r}")
    if name in PIPELINES:
        return PIPELINES[name]
    indexes = _modality_indexes()
    sources = [(name, PIPELINE_SOURCES.get(name))]
    for index in indexes:
        target = getattr(index, "PIPELINE_ALIASES", {}).get(name, name)
        sources.append((target, getattr(index, "PIPELINE_MODULES", {}).get(target)))
    for target, module in sources:
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
    listed = name in index.get("PIPELINE_MODULES", {}) or name in index.get("PIPELINE_ALIASES", {})
    if listed or PIPELINE_SOURCES.get(name, "").startswith(package + "."):
        return pipeline_class(name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


def model_types() -> list[str]:
    """Every transformers `model_type` a registered or listed pipeline opens."""
    types = set(MODEL_TYPE_PIPELINES)
    for index in _modality_indexes():
        types |= set(getattr(index, "MODEL_TYPES", {}))
    return sorted(types | {name for m, key in FAMILY_KEYS.items() if key == "model_type" for name in FAMILIES[m]})


def pipeline_for_model_type(model_type: str) -> Optional[type]:
    """The pipeline class that opens plain transformers folders of `model_type`, or None."""
    indexes = _modality_indexes()
    if model_type in MODEL_TYPE_PIPELINES:
        return pipeline_class(MODEL_TYPE_PIPELINES[model_type])
    for modality, key in FAMILY_KEYS.items():
        if key == "model_type" and model_type in FAMILIES[modality]:
            return pipeline_class(FAMILIES[modality][model_type].pipeline)
    for index in indexes:
        name = getattr(index, "MODEL_TYPES", {}).get(model_type)
        if name is not None:
            return pipeline_class(name)
    return None


def bundled_models() -> dict[str, Path]:
    """Every model shipped inside the package, by name ("emoji64", "emoji-vlm", ...), with its
    folder (which may be missing from a slimmed installation: loaders say so)."""
    models: dict[str, Path] = {}
    for index in _modality_indexes():
        root = Path(index.__file__).parent
        models.update({name: root / folder for name, folder in getattr(index, "BUNDLED_MODELS", {}).items()})
    return models


def batch_runners() -> dict[str, str]:
    """Modality name of `mmgen batch` jobs ("image", "text", ...) -> the module whose `run_batch`
    runs job files of it, in the packages' order."""
    runners: dict[str, str] = {}
    for index in _modality_indexes():
        runners.update(getattr(index, "BATCH_JOBS", {}))
    return runners


def batch_markers(old: bool = True) -> dict[str, str]:
    """Job field -> the modality name of a job line that carries it and no "modality" field
    (`mmgen batch` routes such lines by it); `old`: with the fields of old forms still read."""
    markers: dict[str, str] = {}
    for index in _modality_indexes():
        markers.update(getattr(index, "BATCH_MARKERS", {}))
        markers.update(getattr(index, "BATCH_OLD_MARKERS", {}) if old else {})
    return markers


# ------------------------------------------------------------------------------------ families


def modality_name(modality: str, stacklevel: int = 2) -> str:
    """`modality` by its name now: an old name (`RENAMED_MODALITIES`) becomes the new one, with a
    DeprecationWarning pointing `stacklevel` frames up (2: the caller's caller); others as given."""
    new = RENAMED_MODALITIES.get(modality) if isinstance(modality, str) else None
    if new is None:
        return modality
    warnings.warn(f"modality {modality!r} is now called {new!r}; the old name goes in the next release",
                  DeprecationWarning, stacklevel=stacklevel + 1)
    return new


@dataclass(frozen=True)
class Family:
    """One registered family of a modality: `name` is what its folders name (`FAMILY_KEYS`),
    `pipeline` the class name of the pipeline that opens them, `adapter` what that pipeline
    asks about the family (a speech adapter: `TTSPipeline`'s conditions, stop rule and codes),
    a class or "module:Class" imported on first use; None where the pipeline needs none.
    `capabilities` are the family's facts its pipeline and surfaces ask instead of keeping lists
    of model types (the text modality's "video": "separate" or "stacked" for families whose
    video input mmgen places)."""

    modality: str
    name: str
    pipeline: str
    adapter: Union[type, str, None] = None
    capabilities: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def pipeline_class(self) -> type:
        return pipeline_class(self.pipeline)

    def adapter_class(self) -> Optional[type]:
        if not isinstance(self.adapter, str):
            return self.adapter
        module, _, name = self.adapter.partition(":")
        return getattr(importlib.import_module(module), name)


def register_family(modality: str, name: Optional[str] = None, *, pipeline: Union[type, str],
                    adapter: Union[type, str, None] = None, capabilities: Optional[Mapping[str, Any]] = None) -> Family:
    """Register a family of `modality` ("text", "speech", "video"; the old "vlm" is "text", with a
    DeprecationWarning): its folders' `name` (the transformers `model_type`; for video, the
    pipeline's class name, the default), the `pipeline` that opens them (a class, registered here
    too; a registered class name; or "module:Class", imported on first use) and its `adapter` (a
    class or "module:Class") and its `capabilities` (`Family.capabilities`). Another family under a
    taken name, or a model_type another modality serves, is an error (and registers nothing)."""
    modality = modality_name(modality)
    if modality not in FAMILY_KEYS:
        raise ValueError(f"unknown modality {modality!r}; families are registered for {', '.join(FAMILY_KEYS)}")
    module, _, pipeline_name = ("", "", pipeline.__name__) if isinstance(pipeline, type) else pipeline.rpartition(":")
    if name is None:
        if FAMILY_KEYS[modality] != "_class_name":
            raise ValueError(f"a {modality} family is named by its transformers model_type: give name=")
        name = pipeline_name
    entry = Family(modality, name, pipeline_name, adapter, dict(capabilities or {}))
    taken = FAMILIES[modality].get(name, entry)
    if taken != entry:
        raise ValueError(f"a {modality} family named {name!r} is already registered (opened by {taken.pipeline})")
    if FAMILY_KEYS[modality] == "model_type":
        other = next((m for m, key in FAMILY_KEYS.items() if m != modality and key == "model_type" and name in FAMILIES[m]),
                     None)
        if other is not None or MODEL_TYPE_PIPELINES.get(name, pipeline_name) != pipeline_name:
            raise ValueError(f"model_type {name!r} is already registered ({other or MODEL_TYPE_PIPELINES[name]})")
    if module and PIPELINE_SOURCES.get(pipeline_name, module) != module:
        raise ValueError(f"a pipeline class named {pipeline_name!r} is already listed in {PIPELINE_SOURCES[pipeline_name]}")
    if isinstance(pipeline, type):
        register_pipeline(pipeline)  # the last check: a class under a taken name
    elif module:
        PIPELINE_SOURCES[pipeline_name] = module
    FAMILIES[modality][name] = entry
    return entry


def unregister_family(modality: str, name: str) -> None:
    """Remove a registered family (tests that register a toy family clean up with this); a
    video family also takes its pipeline class with it (its name is the class's)."""
    modality = modality_name(modality)
    entry = FAMILIES.get(modality, {}).pop(name, None)
    if entry is not None and FAMILY_KEYS[modality] == "_class_name":
        unregister_pipeline(entry.pipeline)


def pipeline_modality(cls: type) -> str:
    """The modality a pipeline class serves: the one whose registered family opens it (or a base
    class of it), else "image" (image pipelines register their classes, not families)."""
    _modality_indexes()  # importing the packages registers their families
    names = {c.__name__ for c in cls.__mro__}
    return next((modality for modality, entries in FAMILIES.items() if any(f.pipeline in names for f in entries.values())),
                "image")


def families(modality: str) -> dict[str, Family]:
    """Every registered family of `modality`, by name (built-in ones included)."""
    modality = modality_name(modality)
    _modality_indexes()  # importing a modality package registers its families
    return dict(sorted(FAMILIES.get(modality, {}).items()))


def family(modality: str, name: Any) -> Optional[Family]:
    """The family of `modality` a folder names (a model_type, a pipeline class name), or None."""
    modality = modality_name(modality)  # here, so that the warning names this function's caller
    return families(modality).get(name) if isinstance(name, str) else None
