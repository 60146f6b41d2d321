"""The models a surface offers, loaded once and shared: a `Catalog` per modality names its main
models and their companions (drafters, small models), caches each loaded pipeline with a lock,
and holds the continuous-batching servers that requests of one model and compatible settings
share (the `MAX_SERVERS` most recently used: a server's worker thread lives only while it has
requests, so neither threads nor servers grow with the sampling settings clients send). The
demos and `mmgen serve` use the same catalogue class of each modality.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Optional, Sequence

from mmgen.decoding.batching import check_continuous
from mmgen.hub import read_json

from .bounds import shown

#: Name endings of second models (drafters, small models): companions, not main
#: choices. A bundled main model brings its bundled companions; a folder X brings X-draft / X-small beside it.
COMPANION_SUFFIXES = ("-draft", "-small")
#: A model folder may say which lossless method measured fastest on it, and with which settings
#: (`decoding.json`: {"default": "draft", "options": {"num_draft": 5}, "measured": "<the command>"});
#: surfaces start there, and that method runs with those settings where a request sets none.
MEASURED_DEFAULT = "decoding.json"
#: Continuous-batching servers a catalogue keeps (one per model, method and sampling settings in
#: use); the least recently used beyond them is let go of (its running requests still finish).
MAX_SERVERS = 8


@dataclass
class Catalog:
    """The models a surface offers: `main` (the choices) and `companions`, each a display name ->
    bundled name or folder. `continuous_batch` rows (0: off) are shared by requests that overlap
    in time and ask one model for the same fixed-window method and sampling. A subclass says how
    a modality's models are found (`discover`) and loaded (`load`)."""

    main: dict[str, str]
    companions: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    continuous_batch: int = 0
    modality: ClassVar[str] = ""  # "image", "text", "speech", "video": what the subclass serves
    _pipelines: dict[str, Any] = field(default_factory=dict, repr=False)
    _servers: "OrderedDict[tuple, Any]" = field(default_factory=OrderedDict, repr=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)
    _loading: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_entries(cls, entries: Sequence[str], bundled: Any, device: str = "cpu") -> "Catalog":
        """Display names for bundled names and folders (a folder goes by its name, a second
        folder of one name by its path), split into main models and companions by name ending."""
        named: dict[str, str] = {}
        for entry in dict.fromkeys(entries):
            name = entry if entry in bundled else Path(entry).name
            named[entry if name in named else name] = entry
        main = {n: s for n, s in named.items() if not n.endswith(COMPANION_SUFFIXES)}
        companions = {n: s for n, s in named.items() if n not in main}
        if not main:  # only companions were asked for: offer them as models
            main, companions = companions, {}
        return cls(main, companions, device)

    def load(self, source: str) -> Any:
        """Load one model of the catalogue (each modality's subclass loads its kind of pipeline)."""
        raise NotImplementedError

    @property
    def names(self) -> list[str]:
        return [*self.main, *self.companions]

    def companion_of(self, model: str, suffix: str) -> Optional[str]:
        """The catalogue's companion `<model><suffix>` of `model`, or None."""
        name = model + suffix
        return name if name in self.companions else None

    def pipeline(self, name: str) -> Any:
        """The loaded (cached) pipeline of a main or companion model."""
        source = {**self.main, **self.companions}.get(name)
        if source is None:
            raise ValueError(f"unknown model {shown(name)}; choose one of {list(self.main)}")
        with self._loading:
            if name not in self._pipelines:
                pipe = self.load(source)
                if hasattr(pipe, "set_progress_bar_config"):
                    pipe.set_progress_bar_config(disable=True)
                self._pipelines[name], self._locks[name] = pipe, threading.Lock()
            return self._pipelines[name]

    def main_pipeline(self, model: Any) -> Any:
        """The pipeline of a main model, by name (a companion is not a choice)."""
        if not isinstance(model, str) or model not in self.main:
            raise ValueError(f"unknown model {shown(model)}; choose one of {list(self.main)}")
        return self.pipeline(model)

    def methods(self, model: str) -> list[str]:
        """The decoding methods `model` runs: those its pipeline declares, less those that pair
        a second model where the catalogue has none for it."""
        pipe = self.pipeline(model)
        return [name for name in pipe.decoders()
                if name not in pipe.companions or self.companion_of(model, pipe.companions[name].suffix) is not None]

    def default_method(self, model: str) -> str:
        """The method a surface starts at: the fastest lossless one measured on this model (its
        folder's `decoding.json`), else its pipeline's default, else the first offered."""
        offered = self.methods(model)
        measured = self.measured(model).get("default")
        pipe = self.pipeline(model)
        return next((m for m in (measured, getattr(pipe, "default_decoding", None)) if m in offered), offered[0])

    def measured(self, model: str) -> dict:
        """The model folder's `decoding.json` ({} where it has none or it is not a JSON object)."""
        try:
            record = read_json(Path(str(self.pipeline_source(model))) / MEASURED_DEFAULT)
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def measured_options(self, model: str, method: str) -> dict:
        """The settings `decoding.json` measured `method` with, where it is the measured default
        (a mapping of setting -> number, string or bool; {} otherwise)."""
        record = self.measured(model)
        options = record.get("options")
        if record.get("default") != method or not isinstance(options, dict):
            return {}
        return {str(k): v for k, v in options.items() if isinstance(v, (int, float, str, bool))}

    def pipeline_source(self, name: str) -> Any:
        """Where a model's files are: its folder (a bundled name resolved)."""
        from mmgen import registry

        source = {**self.main, **self.companions}[name]
        return registry.bundled_models().get(source, source)

    def decoder(self, name: str, model: str, **options: Any) -> Any:
        """The decoder of method `name` for `model` (`decoder_from_spec`), with the settings the
        model's `decoding.json` measured it with where `options` set none; a method that pairs a
        second model gets the catalogue's companion unless `options` name one."""
        from mmgen.loading import decoder_from_spec

        options = {**self.measured_options(model, name), **options}
        pipe = self.pipeline(model)
        companion = pipe.companions.get(name)
        if companion is not None and companion.option not in options:
            other = self.companion_of(model, companion.suffix)
            if other is None:
                raise ValueError(f"decoding {name!r} needs {companion.role}: start with a folder {model}{companion.suffix} "
                                 "beside the model")
            options[companion.option] = self.pipeline(other)
        return decoder_from_spec(name, pipe, self.main[model], self.device, **options)

    def server(self, model: str, method: str, decoder: Any, **options: Any) -> Optional[Any]:
        """The shared continuous batch of `model` for this method and options (its pipeline's
        `serve(decoder, batch_size=..., lock=..., **options)`), or None when continuous batching
        is off or cannot run it (two-model methods, models that cannot restart a row): those
        decode alone. Only the `MAX_SERVERS` most recently used are kept."""
        pipe = self.pipeline(model)
        if not self.continuous_batch or not hasattr(pipe, "serve"):
            return None
        try:
            check_continuous(decoder)  # the decoder first: a pipeline of continuous latents has no token model
            check_continuous(decoder, pipe.token_model())
        except ValueError:
            return None
        key = (model, method, repr(sorted(options.items())))
        with self._loading:
            if key not in self._servers:
                self._servers[key] = pipe.serve(decoder, batch_size=self.continuous_batch, lock=self._locks[model], **options)
                while len(self._servers) > MAX_SERVERS:
                    self._servers.popitem(last=False)
            self._servers.move_to_end(key)
            return self._servers[key]

    @contextmanager
    def using(self, names: Sequence[str]) -> Iterator[None]:
        """Hold these models' locks (in a fixed order, so two requests never deadlock)."""
        with ExitStack() as stack:
            for name in sorted(set(names)):
                self.pipeline(name)
                stack.enter_context(self._locks[name])
            yield


def model_folder(folder: Any, index: str = "config.json") -> bool:
    """Whether `folder` holds a model's `index` file (config.json or model_index.json)."""
    return (Path(folder) / index).is_file()


def folder_field(folder: Any, index: str, key: str) -> Any:
    """One field of a model folder's index file (None when it cannot be read)."""
    try:
        return read_json(Path(folder) / index).get(key)
    except (OSError, ValueError, AttributeError):
        return None
