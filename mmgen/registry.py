"""One registry of pipeline classes, by the name a saved folder gives (diffusers' `_class_name`).

A pipeline folder names its class in model_index.json; a transformers folder names its model in
config.json (`model_type`). Both resolve here, to a class registered with `register_pipeline`,
so that loaders, `mmgen generate`, `mmgen batch`, the demos and the benchmarks ask the class what
it is (`Pipeline.decoder_family`, `conditions`, `default_decoding`, `companions`) instead of
re-deriving it from isinstance checks or class-name strings.

The core imports no modality: a modality package names each family's pipeline as
"module:Class" (`register_family`, below) and the registry imports that module the first time
the name is looked up. A family defined elsewhere (a plugin, a test) may register its class
directly. Likewise `mmgen batch` learns the modalities of job files from the packages'
`BATCH_JOBS` (modality name -> the module that runs them) and `BATCH_MARKERS` (the field that
marks a job line that names no "modality"; `BATCH_OLD_MARKERS` for old forms still read), through
`batch_runners` and `batch_markers`.

Every family (image, text: vision-language models answering about images and videos, speech,
video) registers with `register_family`: one call names what a folder of the family holds (its
config.json `model_type`, or its model_index.json `_class_name` for image and video), the pipeline that
opens it and, for speech, the adapter that turns texts into the model's conditions, its
capabilities, its options (`Option`: the keywords its call takes beyond its modality's own,
which `mmgen generate` offers as flags, `mmgen batch` as job fields and the demos as widgets,
all from `family_options`: VAR's `pruning`, MAR's `num_iter`, VibeVoice's `final_std`) and its
converters (`Converter`: the `mmgen convert` subcommands that write its folders from official
checkpoints, built from `registered_converters`). The modality
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

#: Packages whose `PIPELINE_ALIASES` (other name of a pipeline class ->
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

#: What names a family in a saved folder, per modality: a transformers folder's config.json
#: `model_type`, or a pipeline folder's model_index.json `_class_name`.
FAMILY_KEYS = {"image": "_class_name", "text": "model_type", "speech": "model_type", "video": "_class_name"}

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
    """Every pipeline class name known: registered ones and those the modality packages' families name."""
    _modality_indexes()  # importing a package registers its families
    return sorted(set(PIPELINES) | set(PIPELINE_SOURCES))


def is_pipeline_name(name: str) -> bool:
    """Whether `name` is a pipeline class name or alias, without importing the class."""
    indexes = _modality_indexes()  # first: importing a package registers its families
    return name in PIPELINES or name in PIPELINE_SOURCES or any(name in getattr(i, "PIPELINE_ALIASES", {}) for i in indexes)


def pipeline_class(name: str) -> type:
    """The pipeline class a folder names (model_index.json's `_class_name`, or an alias such as
    `LlamaGenT2IPipeline`); its module is imported on first use. ValueError for unknown names."""
    if not isinstance(name, str):
        raise ValueError(f"pipeline class names are strings, got {name!r}")
    if name in PIPELINES:
        return PIPELINES[name]
    indexes = _modality_indexes()
    targets = [name, *(getattr(index, "PIPELINE_ALIASES", {}).get(name, name) for index in indexes)]
    for target in targets:
        module = PIPELINE_SOURCES.get(target)
        if module is not None:
            importlib.import_module(module)
            if target not in PIPELINES:
                raise RuntimeError(f"{module} was listed for {target} but did not register it")
        if target in PIPELINES:
            return PIPELINES[target]
    raise ValueError(f"unknown pipeline class {name!r}; mmgen has {pipeline_names()}")


def listed_pipeline(package: str, name: str) -> type:
    """The pipeline class `name` that modality `package` lists, for that package's module
    `__getattr__` (`from mmgen.audio import TTSPipeline` imports the pipeline's module, and its
    heavy dependencies, on first use only); AttributeError for any other name."""
    index = vars(importlib.import_module(package))  # not getattr: that would come back here
    if name in index.get("PIPELINE_ALIASES", {}) or PIPELINE_SOURCES.get(name, "").startswith(package + "."):
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


#: The value types a family option may take, each with what a value must be (in errors), and
#: what a list of them is (an option of `size` > 1).
OPTION_TYPES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
OPTION_LISTS = {int: "integers", float: "numbers", str: "strings"}
_SIZES = {2: "two", 3: "three", 4: "four"}


@dataclass(frozen=True)
class Option:
    """One keyword a family's pipeline call takes beyond what its modality's surfaces already
    offer: the surfaces are built from it (a `mmgen generate <modality>` flag `--name-with-dashes`,
    a `mmgen batch` job field `name`, a demo widget). `type` is bool, int, float or str;
    `default` is what the pipeline uses when it is not given (shown in widgets; surfaces pass
    only values given); `choices` or `minimum`/`maximum` (inclusive) bound the values. `size`
    above 1 makes a value that many of them (a tuple; a JSON list in a job, as many words after
    the flag); `metavar` names them in `--help` (argparse's: a string, or one per value).
    `required` and `positional` are for a converter's arguments (`Converter`) only: a flag that
    must be given, a word without a flag; a family option is always an optional flag."""

    name: str
    type: type
    default: Any = None
    help: str = ""
    choices: tuple = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    size: int = 1
    metavar: Union[str, tuple, None] = None
    required: bool = False
    positional: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"option name {self.name!r} is not a Python identifier (it is a keyword of the call)")
        if self.type not in OPTION_TYPES:
            raise ValueError(f"option {self.name!r}: type must be one of bool, int, float, str, got {self.type!r}")
        if not isinstance(self.size, int) or self.size < 1 or (self.size > 1 and self.type not in OPTION_LISTS):
            raise ValueError(f"option {self.name!r}: size must be an integer >= 1 (1 for bool), got {self.size!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.default is not None:
            object.__setattr__(self, "default", self.check(self.default))

    @property
    def flag(self) -> str:
        """Its `mmgen generate` flag: `--final-std` for `final_std`."""
        return "--" + self.name.replace("_", "-")

    def what(self, one: bool = False) -> str:
        """What a value must be, as errors say it: "a number >= 0", "one of 'a', 'b'", "a list
        of two integers" (`one`: what each of those must be)."""
        if self.choices:
            limits = "one of " + ", ".join(repr(c) for c in self.choices)
        else:
            limits = " and ".join(f"{sign} {bound:g}" for sign, bound in ((">=", self.minimum), ("<=", self.maximum))
                                  if bound is not None)
        if self.size > 1 and not one:
            return f"a list of {_SIZES.get(self.size, self.size)} {OPTION_LISTS[self.type]}" + (f", each {limits}" if limits else "")
        return limits if self.choices else " ".join([OPTION_TYPES[self.type], limits]).strip()

    def check(self, value: Any, name: Optional[str] = None) -> Any:
        """`value` as this option's type (an int is a float here; a list of `size` values a
        tuple), or ValueError in the one wording every surface uses: "`name` must be a number >= 0,
        got -1" (`name`: how the surface calls it, the flag or the field; default the option's name)."""
        if self.size == 1:
            fits, checked = self._fit(value)
        else:
            items = [self._fit(item) for item in value] if isinstance(value, (list, tuple)) and len(value) == self.size else []
            fits, checked = bool(items) and all(ok for ok, _ in items), tuple(item for _, item in items)
        if not fits:
            raise ValueError(f"{name or self.name} must be {self.what()}, got {value!r}")
        return checked

    def _fit(self, value: Any) -> tuple[bool, Any]:
        """Whether one value fits this option's type and bounds, and the value as its type."""
        kind = self.type
        fits = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, fits = float(value), True
        if fits and kind is float:
            fits = value == value and abs(value) != float("inf")
        if fits and self.choices:
            fits = value in self.choices
        if fits and kind in (int, float):
            fits = (self.minimum is None or value >= self.minimum) and (self.maximum is None or value <= self.maximum)
        return fits, value

    def parse(self, text: str, name: Optional[str] = None) -> Any:
        """A command-line word: `text` as this option's type, then checked (ValueError); of an
        option of `size` > 1, one of its values."""
        words = {"true": True, "false": False}
        try:
            value = words[text.strip().lower()] if self.type is bool else self.type(text.strip() if self.type is not str else text)
        except (KeyError, ValueError):
            value = text
        if self.size == 1:
            return self.check(value, name)
        fits, value = self._fit(value)
        if not fits:
            raise ValueError(f"{name or self.name} must be {self.what(one=True)}, got {text!r}")
        return value


@dataclass(frozen=True)
class Family:
    """One registered family of a modality: `name` is what its folders name (`FAMILY_KEYS`),
    `pipeline` the class name of the pipeline that opens them, `adapter` what that pipeline
    asks about the family (a speech adapter: `TTSPipeline`'s conditions, stop rule and codes),
    a class or "module:Class" imported on first use; None where the pipeline needs none.
    `capabilities` are the family's facts its pipeline and surfaces ask instead of keeping lists
    of model types (the text modality's "video": "separate" or "stacked" for families whose
    video input mmgen places). `options` are the keywords its pipeline call takes beyond its
    modality's own (`Option`): every surface offers them from here (`family_options`).
    `converters` are the `mmgen convert` subcommands that write its folders (`Converter`)."""

    modality: str
    name: str
    pipeline: str
    adapter: Union[type, str, None] = None
    capabilities: Mapping[str, Any] = field(default_factory=dict, hash=False)
    options: tuple[Option, ...] = ()
    converters: tuple["Converter", ...] = ()

    def pipeline_class(self) -> type:
        return pipeline_class(self.pipeline)

    def adapter_class(self) -> Optional[type]:
        return _imported(self.adapter)


def _imported(target: Any) -> Any:
    """`target` itself, or the object a "module:name" string names (its module imported now)."""
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Converter:
    """One `mmgen convert <name>` subcommand, declared on the records of the families whose
    folders it writes (official checkpoints -> a pipeline folder): `help` is its line in `mmgen
    convert --help`, `function` (a callable, or "module:function" imported when the command runs)
    runs it, given the parsed arguments (an argparse Namespace: each argument by its name, and
    `defaults`' fixed values) and returning the exit status. `arguments` are `Option`s, in order:
    a flag each (`--name-with-dashes`; a bool is a switch), a word for a `positional` one."""

    name: str
    help: str
    function: Union[Callable[[Any], int], str]
    arguments: tuple[Option, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", tuple(self.arguments))

    def run(self, args: Any) -> int:
        """Run the conversion on parsed arguments (what `mmgen convert <name>` calls)."""
        return _imported(self.function)(args)


def register_family(modality: str, name: Optional[str] = None, *, pipeline: Union[type, str],
                    adapter: Union[type, str, None] = None, capabilities: Optional[Mapping[str, Any]] = None,
                    options: Iterable[Option] = (), converters: Iterable[Converter] = ()) -> Family:
    """Register a family of `modality` ("image", "text", "speech", "video"; the old "vlm" is
    "text", with a DeprecationWarning): its folders' `name` (the transformers `model_type`; for
    image and video, the pipeline's class name, the default), the `pipeline` that opens them (a
    class, registered here too; a registered class name; or "module:Class", imported on first use),
    its `adapter` (a class or "module:Class"), its `capabilities` (`Family.capabilities`), its
    `options` (`Option`s: the surfaces' flags, job fields and widgets) and its `converters`
    (`Converter`s: `mmgen convert` subcommands; families whose folders one converter writes each
    name it). Another family under a taken name, a model_type another modality serves, an option
    another family of the modality declares otherwise, or a converter name another family's
    converter takes is an error (and registers nothing)."""
    modality = modality_name(modality)
    if modality not in FAMILY_KEYS:
        raise ValueError(f"unknown modality {modality!r}; families are registered for {', '.join(FAMILY_KEYS)}")
    options, converters = tuple(options), tuple(converters)
    declared = family_options(modality)
    for option in options:
        if option.required or option.positional:
            raise ValueError(f"option {option.name!r}: a family option is an optional flag (required and positional are "
                             "for converter arguments)")
        if declared.get(option.name, option) != option:
            raise ValueError(f"option {option.name!r} is declared otherwise by another {modality} family: {declared[option.name]}")
    commands = registered_converters()
    for converter in converters:
        if commands.get(converter.name, converter) != converter:
            raise ValueError(f"a converter named {converter.name!r} is already registered (`mmgen convert {converter.name}`)")
    module, _, pipeline_name = ("", "", pipeline.__name__) if isinstance(pipeline, type) else pipeline.rpartition(":")
    if name is None:
        if FAMILY_KEYS[modality] != "_class_name":
            raise ValueError(f"a {modality} family is named by its transformers model_type: give name=")
        name = pipeline_name
    if isinstance(pipeline, type) and PIPELINES.get(pipeline_name, pipeline) is not pipeline:
        raise ValueError(f"a pipeline class named {pipeline_name!r} is already registered ({PIPELINES[pipeline_name].__module__})")
    entry = Family(modality, name, pipeline_name, adapter, dict(capabilities or {}), options, converters)
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
    class of it), else "image" (an image pipeline class registered alone, `register_pipeline`)."""
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


def family_options(modality: str) -> dict[str, Option]:
    """Every option the registered families of `modality` declare, by name (one declaration per
    name: `register_family` sees to it); what `mmgen generate`, `mmgen batch` and the demos offer."""
    return {option.name: option for entry in families(modality).values() for option in entry.options}


def registered_converters() -> dict[str, Converter]:
    """Every registered family's converter, by its `mmgen convert` name (one record per name:
    `register_family` sees to it), in the order registered, modality by modality."""
    _modality_indexes()  # importing the packages registers their families
    return {converter.name: converter for entries in FAMILIES.values() for entry in entries.values()
            for converter in entry.converters}


def option_families(modality: str, name: str) -> list[str]:
    """The families of `modality` that declare option `name`."""
    return [entry.name for entry in families(modality).values() if any(o.name == name for o in entry.options)]


def pipeline_family(pipe: Any) -> Optional[Family]:
    """The registered family a loaded pipeline is of: its transformers model's `model_type`
    (text, speech) or its class name (image, video); None for a class registered alone."""
    modality = pipeline_modality(type(pipe))
    if FAMILY_KEYS[modality] == "_class_name":
        return family(modality, type(pipe).__name__)
    return family(modality, getattr(getattr(getattr(pipe, "model", None), "config", None), "model_type", None))


def family_call_options(modality: str, entry: Optional[Family], given: Mapping[str, Any],
                        spelled: Callable[[Option], str] = lambda option: option.name) -> dict[str, Any]:
    """The family options `given` (name -> value; None: not given) that a model of family `entry`
    takes, as call keywords; ValueError for one its family does not declare, naming the option as
    the surface `spelled` it (a flag, a field)."""
    declared = {option.name for option in entry.options} if entry is not None else set()
    options = family_options(modality)
    for name, value in given.items():
        if value is not None and name not in declared:
            owners = " or ".join(option_families(modality, name)) or "no registered"
            raise ValueError(f"{spelled(options[name])} is for {owners} models; "
                             + (f"this model is a {entry.name}" if entry is not None else "this model's family takes no such option"))
    return {name: value for name, value in given.items() if value is not None}
