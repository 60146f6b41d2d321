"""The contract every modality's request layer keeps (`ModalityService`), and the registry the
surfaces find them in (`register_service`, `services`, `service`).

A modality's request module (`mmgen.apps.requests.<modality>`, one per key of
`mmgen.registry.MODALITIES`) implements the contract once and registers it once, at import. A
service says what its models are (`catalog`: the `Catalog` subclass that finds, checks and loads
them), what a request is (`request`: a dataclass a surface fills, `parse`), checks a request
before any work (`check`: ValueError with one line, or the checked request) within the limits a
surface may lower (`limits`: `check`'s keywords), and runs a checked one (`stream`: a generator
of progress updates that returns the result). A request module's `check_request` and
`stream_checked` are its service's `check` and `stream`. Each request carries the options of the
model's family (`family_options`, `mmgen.registry.family_options`), which its check turns into
call keywords (`family_call`) and its run passes to the pipeline. `mmgen serve` builds its catalogues,
`/v1/models`, admission and metrics by iterating the services instead of naming each modality; a
modality defined elsewhere (a plugin, a test) registers its own service and is served the same way.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generator, Mapping, Optional, Sequence, TypeVar

from mmgen import registry

from .bounds import LIMITS, check_plain_text, shown
from .catalog import Catalog
from .runs import finish

#: The package whose module `<modality>` holds each built-in modality's service.
REQUEST_PACKAGE = "mmgen.apps.requests"

_services: dict[str, "ModalityService"] = {}

S = TypeVar("S", bound="ModalityService")


class ModalityService(ABC):
    """What a modality's request layer provides every surface (the Gradio demos, `mmgen serve`):

    - `modality`: its name (a key of `mmgen.registry.MODALITIES`, or a plugin's own), its
      catalogue's;
    - `noun`: how messages name its models ("vision-language"); `unit`: what its runs count
      ("token", "frame"), as the server's metrics label it;
    - `catalog`: its `Catalog` subclass (`discover` finds and checks the bundled models or the
      given entries, loading nothing; `load` opens one);
    - `request`: the dataclass of one request (`parse` builds it);
    - `check`: every check of a request, before any work, within the limits its keywords name
      (`limits`); `stream`: run a checked request."""

    noun: ClassVar[str]
    unit: ClassVar[str]
    catalog: ClassVar[type[Catalog]]
    request: ClassVar[type]

    @property
    def modality(self) -> str:
        """Its name: its catalogue's (`Catalog.modality`)."""
        return self.catalog.modality

    def discover(self, models: Optional[Sequence[str]] = None, device: str = "cpu") -> Catalog:
        """The catalogue of the bundled models present (default) or of the given entries; ValueError
        with one line for an entry the modality does not take."""
        return self.catalog.discover(models, device=device)

    def parse(self, **fields: Any) -> Any:
        """The typed request of these fields (`request_of`); its values are checked by `check`."""
        return request_of(self.request, **fields)

    @abstractmethod
    def check(self, request: Any, catalog: Catalog, **limits: int) -> Any:
        """Every check of `request` (ValueError with a one-line message) before any work: the
        checked request, in the model's terms. May load the model; runs nothing. Its keywords
        after the catalogue, each with a default, are the `limits`."""

    @abstractmethod
    def stream(self, checked: Any, catalog: Catalog) -> Generator[Any, None, Any]:
        """Run a checked request: a generator of progress updates that returns the result (a
        `Result` of runs). Closed early, it stops the run and frees the model."""

    def run(self, request: Any, catalog: Catalog, **limits: int) -> Any:
        """Check and run `request` to its end; the result."""
        return finish(self.stream(self.check(request, catalog, **limits), catalog))

    @property
    def limits(self) -> dict[str, Any]:
        """What a surface may bound per call: `check`'s keywords after the catalogue, with their
        defaults (`mmgen serve` passes its `ServerSettings` field of the same name); the request
        layer's hard caps bound each further."""
        keywords = list(inspect.signature(self.check).parameters.values())[2:]
        return {k.name: k.default for k in keywords if k.default is not inspect.Parameter.empty}

    def bounds(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The service's limits, each taken from `given` where it names one (a server's settings)."""
        return {name: given.get(name, default) for name, default in self.limits.items()}


def request_of(cls: type, **fields: Any) -> Any:
    """A request dataclass of these fields, None leaving the request's default; a field it does not
    have is a ValueError (its values are the request layer's to check)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"a {cls.__name__} has no field {shown(unknown[0])}; its fields are {sorted(known)}")
    return cls(**{k: v for k, v in fields.items() if v is not None})


def family_call(modality: str, pipe: Any, given: Any) -> dict[str, Any]:
    """A request's `family_options` (option name -> value; None or empty: none) as keywords of the
    loaded `pipe`'s call: each name an option a family of `modality` declares
    (`registry.family_options`), each value checked by its record (`Option.check`, the wording
    every surface uses; a str within the request layer's text bounds), and each declared by
    `pipe`'s own family (`registry.family_call_options`: the CLI's one-line refusal otherwise).
    ValueError with one line; runs nothing."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ValueError(f"options must be an object of option names and values, got {shown(given)}")
    declared = registry.family_options(modality)
    values = {}
    for name, value in given.items():
        option = declared.get(name) if isinstance(name, str) else None
        if option is None:
            raise ValueError(f"unknown option {shown(name)}; the {modality} families' options are "
                             f"{', '.join(declared) or 'none'}")
        if option.type is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # as number boxes send
        if isinstance(value, str):  # text a model reads: bounded, and plain
            if len(value) > LIMITS.text_chars:
                raise ValueError(f"{name} must be at most {LIMITS.text_chars} characters, got {len(value)}")
            check_plain_text(name, value)
        try:
            values[name] = option.check(value)
        except ValueError:  # the record's wording, the value quoted short
            raise ValueError(f"{name} must be {option.what()}, got {shown(value)}") from None
    return registry.family_call_options(modality, registry.pipeline_family(pipe), values)


def register_service(service: S) -> S:
    """Register a modality's service (once: another service for a registered modality is an error,
    as two would answer its requests). Returns it, for `SERVICE = register_service(...)`."""
    current = _services.get(service.modality)
    if current is not None and type(current) is not type(service):
        raise ValueError(f"the {service.modality!r} modality already has a service ({type(current).__qualname__})")
    _services.setdefault(service.modality, service)
    return _services[service.modality]


def unregister_service(modality: str) -> None:
    """Remove a registered service (a test that registers a toy modality cleans up with this)."""
    _services.pop(modality, None)


def services() -> dict[str, ModalityService]:
    """Every registered service by modality: the built-in ones in `mmgen.registry.MODALITIES`' order
    (their modules imported on first use), then others in the order they were registered."""
    for modality in registry.MODALITIES:
        if modality not in _services:
            importlib.import_module(f"{REQUEST_PACKAGE}.{modality}")
    built_in = {m: _services[m] for m in registry.MODALITIES if m in _services}
    return {**built_in, **_services}


def service(modality: str) -> ModalityService:
    """The service of `modality`; ValueError naming those registered for any other."""
    found = services().get(modality)
    if found is None:
        raise ValueError(f"no modality {shown(modality)}; choose one of {list(services())}")
    return found
