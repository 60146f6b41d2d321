"""What the image demo does for one request, without any UI: check the inputs, run the pipeline
(and, in compare mode, autoregressive decoding on the same seed), return images and stats.

Kept apart from the Gradio layout (`image_demo.py`) so that it is tested directly and so that
importing it needs no gradio. Every input is checked and bounded here, because the web page's
own limits are no protection: Gradio's HTTP API takes any value.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from mmgen import registry
from mmgen.decoding import DecodeStats, Request, parse_decoding
from mmgen.decoding.batching import check_continuous
from mmgen.hub import read_json
from mmgen.image_ar.bundled import BUNDLED_MODELS, load_class_pipeline
from mmgen.loading import decoder_from_spec
from mmgen.sampling import make_generator

#: Name endings of second models (drafters, refiners): companions, not main choices. The
#: bundled families' (`Pipeline.companions`); a folder is a companion when a main model names it.
COMPANION_SUFFIXES = ("-draft", "-small")

MAX_SEED = 2**31 - 1
MAX_GUIDANCE = 20.0
MAX_TEMPERATURE = 5.0
MAX_STEPS = 256  # MAR masked steps
MAX_IMAGES = 16  # hard cap, whatever --max-images says
MAX_SPEC_CHARS = 200
#: An integer decoder option may be at most this many times its default (window 16 -> 64):
#: a few options set the cost of a forward, and an unbounded window stalls the demo.
MAX_OPTION_FACTOR = 4
MAX_OPTION_MAGNITUDE = 1e4  # any other number


@dataclass
class ModelCatalog:
    """The models a demo offers: `main` (the choices) and `companions` (drafters and refiners
    that two-model methods pair with their main model), each a display name -> bundled name or
    folder. Loaded pipelines are cached; a lock per pipeline keeps two requests off one model."""

    main: dict[str, str]
    companions: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"
    #: Rows of the shared continuous batch (0: off). Requests that overlap in time and ask one
    #: model for the same fixed-window method and sampling then decode their images together,
    #: each image from its own seed (`mmgen demo image --continuous-batch`).
    continuous_batch: int = 0
    _pipelines: dict[str, Any] = field(default_factory=dict, repr=False)
    _servers: dict[tuple, Any] = field(default_factory=dict, repr=False)
    _locks: dict[str, threading.Lock] = field(default_factory=dict, repr=False)
    _loading: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def discover(cls, models: Optional[Sequence[str]] = None, device: str = "cpu") -> "ModelCatalog":
        """The bundled models present in this installation, or the given bundled names and
        pipeline folders; names ending in -draft/-small are companions. A bundled main model
        brings its bundled companions along."""
        if not models:
            entries = [name for name, folder in BUNDLED_MODELS.items() if (Path(folder) / "model_index.json").is_file()]
        else:
            entries = [_checked_entry(str(entry)) for entry in models]
            for entry in list(entries):
                for suffix in COMPANION_SUFFIXES:
                    companion = entry + suffix
                    if companion in BUNDLED_MODELS and (Path(BUNDLED_MODELS[companion]) / "model_index.json").is_file():
                        entries.append(companion)
        catalog = cls.from_entries(entries, BUNDLED_MODELS, device)
        if not catalog.main:
            raise ValueError("no image models found: the bundled models are missing; pass --model FOLDER")
        return catalog

    @classmethod
    def from_entries(cls, entries: Sequence[str], bundled: Any, device: str = "cpu") -> "ModelCatalog":
        """Display names for bundled names and folders (a folder goes by its name, a second
        folder of one name by its path), split into main models and companions by name ending.
        Shared with the VLM demo's catalogue."""
        named: dict[str, str] = {}
        for entry in dict.fromkeys(entries):
            name = entry if entry in bundled else Path(entry).name
            named[entry if name in named else name] = entry  # two folders of one name: the second goes by its path
        main = {n: s for n, s in named.items() if not n.endswith(COMPANION_SUFFIXES)}
        companions = {n: s for n, s in named.items() if n not in main}
        if not main:  # only companions were asked for: offer them as models
            main, companions = companions, {}
        return cls(main, companions, device)

    @property
    def names(self) -> list[str]:
        return [*self.main, *self.companions]

    def companion_of(self, model: str, suffix: str) -> Optional[str]:
        """The catalogue's companion `<model><suffix>` of `model` (its drafter or small model), or None."""
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
                pipe.set_progress_bar_config(disable=True)
                self._pipelines[name], self._locks[name] = pipe, threading.Lock()
            return self._pipelines[name]

    def load(self, source: str) -> Any:
        """Load one model of the catalogue (a subclass loads another kind of pipeline)."""
        return load_class_pipeline(source, self.device)

    def server(self, model: str, method: str, decoder: Any, **options: Any) -> Optional[Any]:
        """The shared continuous batch of `model` for this method and options (its pipeline's
        `serve(decoder, batch_size=..., lock=..., **options)`: sampling, budget caps), or None when
        continuous batching is off or cannot run it (next-scale and continuous models, adaptive
        windows, two-model methods, models that cannot restart a row): those decode alone."""
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
            return self._servers[key]

    @contextmanager
    def using(self, names: Sequence[str]) -> Iterator[None]:
        """Hold these models' locks (in a fixed order, so two requests never deadlock)."""
        with ExitStack() as stack:
            for name in sorted(set(names)):
                self.pipeline(name)
                stack.enter_context(self._locks[name])
            yield


def _checked_entry(entry: str) -> str:
    """A bundled name, or a folder whose model_index.json names a class-conditional pipeline."""
    if entry in BUNDLED_MODELS:
        return entry
    index = Path(entry) / "model_index.json"
    if not index.is_file():
        raise ValueError(f"--model {entry!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
                         "nor a pipeline folder with a model_index.json")
    kind = read_json(index).get("_class_name")
    try:
        conditions = registry.pipeline_class(kind).conditions
    except ValueError:
        conditions = None
    if conditions != "class":
        raise ValueError(f"--model {entry!r} is a {kind}; the image demo serves class-conditional pipelines")
    return entry


@dataclass(frozen=True)
class ModelInfo:
    """What the UI shows for a model: its classes, methods, and sampler defaults and bounds."""

    family: str  # the pipeline's decoder family: "token", "scale" or "continuous"
    class_names: list[str]
    methods: list[str]
    default_method: str
    vocab_size: Optional[int]  # None: the model has no top-k/top-p (MAR)
    defaults: dict[str, Any]


def model_info(pipe: Any) -> ModelInfo:
    """A loaded pipeline's classes, methods (the decoders it declares), default method (its
    `default_decoding`) and sampler defaults."""
    methods = list(pipe.decoders())
    names = list(pipe.class_names) if pipe.class_names else [str(i) for i in range(pipe.num_classes)]
    takes_top_k = "top_k" in inspect.signature(pipe.__call__).parameters
    vocab = getattr(getattr(pipe.transformer, "config", None), "vocab_size", None) if takes_top_k else None
    return ModelInfo(pipe.decoder_family, names, methods, pipe.default_decoding, vocab, dict(getattr(pipe, "sampling_defaults", {})))


@dataclass(frozen=True)
class DemoRequest:
    """One press of Generate. None sampler values take the model's defaults."""

    model: str
    class_name: str
    method: str = "sjd"
    options: str = ""  # decoder options: "delta=0.2,window=8"
    seed: int = 0
    num_images: int = 1
    compare: bool = False  # also run autoregressive decoding on the same seed
    guidance_scale: Optional[float] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    num_steps: Optional[int] = None  # MAR masked steps


@dataclass
class DemoRun:
    """One decoding of the request: its label ("sjd", "ar (baseline)"), images and stats. For
    next-scale models also the tokens each step (scale) emits per image and the models of the
    decoder's schedule, in order (`stats.stage_forwards` says how many steps each ran)."""

    label: str
    images: list
    stats: DecodeStats
    step_sizes: tuple[int, ...] = ()
    stage_models: tuple[str, ...] = ()

    def step_rows(self) -> list[dict[str, Any]]:
        """(step, tokens, model) per step of a next-scale run: the tokens the step emitted per
        image and the model that ran it (the decoders record no per-step time). Empty for
        token-by-token runs."""
        if not self.step_sizes:
            return []
        models = [self.stage_models[i] if i < len(self.stage_models) else f"stage {i + 1}"
                  for i, count in enumerate(self.stats.stage_forwards) for _ in range(count)]
        return [{"step": k + 1, "tokens": size, "model": models[k] if k < len(models) else "?"}
                for k, size in enumerate(self.step_sizes)]


@dataclass
class DemoResult:
    """The method's run, and in compare mode the autoregressive baseline's before it."""

    runs: list[DemoRun]

    @property
    def method(self) -> DemoRun:
        return self.runs[-1]

    @property
    def baseline(self) -> Optional[DemoRun]:
        return self.runs[0] if len(self.runs) > 1 else None

    def stats_rows(self) -> list[dict[str, Any]]:
        """One row per run: forwards, step compression, mean accepted length, wall time (and, in
        compare mode, the wall-time speedup over the baseline)."""
        rows = []
        for run in self.runs:
            s = run.stats
            row = {"run": run.label, "forwards": s.forwards, "tokens": s.tokens,
                   "step compression": round(s.step_compression, 2), "mean accepted length": round(s.mean_accepted_length, 2),
                   "time (s)": round(s.wall_time_s, 3)}
            if self.baseline is not None:
                row["speedup"] = round(self.baseline.stats.wall_time_s / s.wall_time_s, 2) if s.wall_time_s else None
            rows.append(row)
        return rows

    def trace_rows(self, run: Optional[DemoRun] = None) -> list[dict[str, Any]]:
        """A run's accepted-length trace (default: the method's) as (forward, accepted) rows;
        autoregressive decoding's is 1 at every forward."""
        run = run or self.method
        return [{"forward": i + 1, "accepted": round(a, 3)} for i, a in enumerate(run.stats.accepted_per_forward)]

    def step_rows(self, run: Optional[DemoRun] = None) -> list[dict[str, Any]]:
        """A next-scale run's (step, tokens, model) rows (default: the method's); see `DemoRun`."""
        return (run or self.method).step_rows()


def run_request(request: DemoRequest, catalog: ModelCatalog, max_images: int = 4) -> DemoResult:
    """Check `request` (ValueError with a message for the user), generate, and return images
    and stats; in compare mode autoregressive decoding runs first on the same seed."""
    if request.model not in catalog.main:
        raise ValueError(f"unknown model {shown(request.model)}; choose one of {list(catalog.main)}")
    pipe = catalog.pipeline(request.model)
    info = model_info(pipe)
    label = _class_label(request.class_name, info.class_names)
    seed = _int("seed", request.seed, 0, MAX_SEED)
    count = _int("number of images", request.num_images, 1, max(1, min(max_images, MAX_IMAGES)))
    sampling = _sampling(request, info)
    name, options = _decoding(request.method, request.options, pipe, catalog, request.model)
    companion = pipe.companions.get(name)
    if companion is not None:  # pair with the demo's cached companion unless the options name one
        if companion.option not in options and request.model + companion.suffix in catalog.names:
            options[companion.option] = request.model + companion.suffix
    source = catalog.main[request.model]  # decoder_from_spec looks for bundled companions by this name
    scales: dict[str, Any] = {}
    if info.family == "scale":  # what the chart shows: each step's tokens and the model that ran it
        others = [str(options.get(companion.option, request.model + companion.suffix))] if companion else []
        scales = dict(step_sizes=tuple(pipe.transformer.config.step_sizes), stage_models=(request.model, *others))
    overrides = {}
    family = type(pipe).__name__.removesuffix("Pipeline")
    for keyword, setting in pipe.decoder_settings.items():  # MAR: masked steps come from the steps control
        if setting in options:  # one control per setting: the steps box would silently win
            raise ValueError(f"set {family}'s {setting} with the steps control, not as a decoding option")
        steps = info.defaults.get(keyword) if request.num_steps is None else request.num_steps
        overrides[setting] = sampling[keyword] = _int(f"{family} steps", steps, 1, MAX_STEPS)
    named = companion_options(pipe)
    companions = [v for k, v in options.items() if k in named]
    method = _spec_text(name, request.options)
    with catalog.using([request.model, *companions]):
        built = {k: catalog.pipeline(v) if k in named else v for k, v in options.items()}
        decoder = decoder_from_spec(name, pipe, source, catalog.device, **{**built, **overrides})
        # Compare mode times its two runs, so it never shares a batch with other requests.
        shares = not request.compare and hasattr(pipe, "serve")  # MAR and VAR pipelines decode alone
        server = catalog.server(request.model, method, decoder, sampling=pipe.sampling_config(**sampling)) if shares else None
        plan = [("ar (baseline)", decoder_from_spec("ar", pipe, source, catalog.device, **overrides),
                 {**scales, "stage_models": scales.get("stage_models", ())[:1]})] if request.compare else []
        plan.append((method, decoder, scales))
        runs = []
        for run_label, run_decoder, run_scales in plan if server is None else ():
            output = pipe([label] * count, decoding=run_decoder, generator=make_generator(seed, catalog.device), **sampling)
            runs.append(DemoRun(run_label, list(output.images), output.stats, **run_scales))
    if server is not None:  # outside the model's lock, which the shared batch takes while it decodes
        runs = [shared_run(server, f"{method} (continuous batch)", label, count, seed, pipe.device)]
    return DemoResult(runs)


def shared_run(server: Any, run_label: str, label: int, count: int, seed: int, device: Any) -> DemoRun:
    """Image i of the request, decoded in the shared continuous batch from seed `seed + i`;
    the run's stats sum the images' histograms, take the slowest image's forwards and the
    request's wall time."""
    begun = time.perf_counter()
    futures = [server.submit(Request(torch.tensor([label], device=device), make_generator(seed + i, device)))
               for i in range(count)]
    images, stats = zip(*(future.result() for future in futures))
    width = max(len(s.accepted_histogram) for s in stats)
    histogram = [sum(s.accepted_histogram[k] for s in stats if k < len(s.accepted_histogram)) for k in range(width)]
    merged = DecodeStats(forwards=max(s.forwards for s in stats), tokens=max(s.tokens for s in stats), rows=count,
                         accepted_histogram=histogram, wall_time_s=time.perf_counter() - begun)
    return DemoRun(run_label, list(images), merged)


def shown(value: Any, limit: int = 60) -> str:
    """`value` as error messages quote it: its repr, cut to `limit` characters (a request's
    fields may be any size through the API; a message stays one short line). Plain text: the
    page's toast renders it (through Gradio's sanitiser), the API returns it as it is."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _class_label(class_name: Any, names: list[str]) -> int:
    if not isinstance(class_name, str) or class_name not in names:
        listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(f"unknown class {shown(class_name)}; choose one of this model's classes ({listed})")
    return names.index(class_name)


def _int(what: str, value: Any, low: int, high: int) -> int:
    """An integer in [low, high] (whole floats such as 3.0, as number boxes send, are accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {shown(value)}")
    return value


def _float(what: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not (low < value if low_open else low <= value) or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{what} must be a number in {interval}, got {shown(value)}")
    return float(value)


def _sampling(request: DemoRequest, info: ModelInfo) -> dict[str, Any]:
    """The sampler arguments this model's pipeline takes, checked and bounded."""
    out: dict[str, Any] = {}
    if request.guidance_scale is not None:
        out["guidance_scale"] = _float("guidance", request.guidance_scale, 0.0, MAX_GUIDANCE)
    if request.temperature is not None:
        out["temperature"] = _float("temperature", request.temperature, 0.0, MAX_TEMPERATURE)
    if info.vocab_size is not None:  # MAR's pipeline has no top-k/top-p: the UI hides them
        if request.top_k is not None:
            out["top_k"] = _int("top-k", request.top_k, 0, info.vocab_size)
        if request.top_p is not None:
            out["top_p"] = _float("top-p", request.top_p, 0.0, 1.0, low_open=True)
    return out


def companion_options(pipe: Any) -> frozenset:
    """Decoder options that name a second model for this pipeline (draft:drafter=..., code:refiner=...)."""
    return frozenset(c.option for c in pipe.companions.values())


def _decoding(method: Any, text: Any, pipe: Any, catalog: ModelCatalog, model: str) -> tuple[str, dict[str, Any]]:
    """The method (a shortcut the pipeline declares) and its checked options: numbers and
    booleans bounded, strings only for companion models the demo offers (never a path)."""
    shortcuts = pipe.decoders()
    if not isinstance(method, str) or method not in shortcuts:
        raise ValueError(f"unknown decoding method {shown(method)} for this model; choose one of {sorted(shortcuts)}")
    if not isinstance(text, str) or len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"decoding options must be text of at most {MAX_SPEC_CHARS} characters")
    if ":" in text:
        raise ValueError(f"decoding options are key=value pairs separated by commas (e.g. 'delta=0.2,window=8'); "
                         f"pick the method in the list, got {text!r}")
    name, options = parse_decoding(f"{method}:{text}" if text.strip() else method)
    defaults = _option_defaults(shortcuts[name]())
    for key, value in options.items():
        if key in companion_options(pipe):
            if value not in catalog.names or value == model:
                others = [n for n in catalog.names if n != model]
                raise ValueError(f"{key}={value!r}: name one of the demo's other models {others}")
        elif key in defaults and not _is_number(defaults[key]) and defaults[key] is not None:
            raise ValueError(f"decoding option {key!r} takes an object and cannot be set here")
        elif not (_is_number(value) or value is None):
            raise ValueError(f"decoding option {key}={value!r}: expected a number, true, false or null")
        elif not isinstance(value, (bool, type(None))):
            default = defaults.get(key)
            if not abs(value) <= MAX_OPTION_MAGNITUDE:
                raise ValueError(f"decoding option {key}={value!r} is out of range (|value| <= {MAX_OPTION_MAGNITUDE:g})")
            if isinstance(default, int) and not isinstance(default, bool) and default > 0 and value > MAX_OPTION_FACTOR * default:
                raise ValueError(f"decoding option {key}={value!r} is above this demo's limit of {MAX_OPTION_FACTOR * default} "
                                 f"({MAX_OPTION_FACTOR}x its default {default})")
    return name, options


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float))


def _option_defaults(decoder: Any) -> dict[str, Any]:
    """Default values of a decoder's settable fields and of its acceptance rule's."""
    out: dict[str, Any] = {}
    for obj in (getattr(decoder, "acceptance", None), decoder):
        if is_dataclass(obj):
            out.update({f.name: getattr(obj, f.name) for f in fields(obj) if f.repr and f.init})
    return out


def _spec_text(name: str, options: str) -> str:
    return f"{name}:{options.strip()}" if options.strip() else name

