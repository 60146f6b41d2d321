"""Image requests: check a request's inputs (a class of a class-conditional model, or a prompt of a
text-to-image one: LlamaGen t2i, Janus-Pro), run the pipeline (and, in compare mode,
autoregressive decoding on the same seed first), return images and stats. Shared by the image
demo (class-conditional models) and `mmgen serve`'s `/v1/images/generations` (both kinds);
importing it needs no gradio.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Iterator, Optional, Sequence

import torch

from mmgen import registry
from mmgen.decoding import RENAMED_SHORTCUTS, DecodeStats, Request, canonical_decoding, parse_decoding
from mmgen.image_ar.bundled import BUNDLED_MODELS
from mmgen.image_ar.generation import ImageOptions, call_keywords
from mmgen.loading import decoder_from_spec, load_pipeline, pipeline_class_of
from mmgen.sampling import make_generator

from .bounds import LIMITS, MAX_SEED, checked_text, integer, sampler, shown
from .catalog import COMPANION_SUFFIXES, Catalog, model_folder
from .runs import BASELINE_LABEL, PerUnit, Result
from .service import ModalityService, family_call, register_service

MAX_STEPS = 256  # MAR masked steps
MAX_IMAGES = LIMITS.images  # hard cap, whatever --max-images says
MAX_SPEC_CHARS = 200
#: An integer decoder option may be at most this many times its default (window 16 -> 64):
#: a few options set the cost of a forward, and an unbounded window stalls the demo.
MAX_OPTION_FACTOR = 4
MAX_OPTION_MAGNITUDE = 1e4  # any other number
#: The call keywords a request sets through its own fields (the sampler's; a pipeline's
#: `decoder_settings` keywords, MAR's `num_iter`, come from `num_steps`): not family options.
OWN_KEYWORDS = ("guidance_scale", "temperature", "top_k", "top_p")


class ImageCatalog(Catalog):
    """The class-conditional image models a surface offers (`Catalog`): every bundled model
    present by default; names ending in -draft/-small are companions. `conditions`: what the
    models may be conditioned on (a subclass adds prompts: `TextImageCatalog`)."""

    modality = "image"
    conditions: ClassVar[tuple[str, ...]] = ("class",)

    @classmethod
    def discover(cls, models: Optional[Sequence[str]] = None, device: str = "cpu") -> "ImageCatalog":
        """The bundled models present in this installation, or the given bundled names and
        pipeline folders. A bundled main model brings its bundled companions along."""
        if not models:
            entries = [name for name, folder in BUNDLED_MODELS.items() if model_folder(folder, "model_index.json")]
        else:
            entries = [_checked_entry(str(entry), cls.conditions) for entry in models]
            for entry in list(entries):
                for suffix in COMPANION_SUFFIXES:
                    companion = entry + suffix
                    if companion in BUNDLED_MODELS and model_folder(BUNDLED_MODELS[companion], "model_index.json"):
                        entries.append(companion)
        catalog = cls.from_entries(entries, BUNDLED_MODELS, device)
        if not catalog.main:
            raise ValueError("no image models found: the bundled models are missing; pass --model FOLDER")
        return catalog

    def load(self, source: str) -> Any:
        pipe = load_pipeline(source, self.device)
        if pipe.conditions not in self.conditions:
            raise ValueError(f"{source} holds a {type(pipe).__name__}, not a {_kinds(self.conditions)} pipeline")
        return pipe

    def methods(self, model: str) -> list[str]:
        """Every decoder the pipeline declares: a two-model method finds its companion in the
        catalogue, in its options, or bundled beside the model (`decoder_from_spec`)."""
        return list(self.pipeline(model).decoders())


class TextImageCatalog(ImageCatalog):
    """`ImageCatalog` that also offers text-to-image models (LlamaGen t2i pipeline folders and
    transformers Janus-Pro folders), as `mmgen serve` does."""

    conditions = ("class", "prompt")


def _kinds(conditions: Sequence[str]) -> str:
    return " or ".join({"class": "class-conditional", "prompt": "text-to-image"}[c] for c in conditions)


def _checked_entry(entry: str, conditions: Sequence[str] = ("class",)) -> str:
    """A bundled name, or a folder of an image pipeline conditioned as `conditions` allow: an
    mmgen folder (model_index.json) or, for prompts, a transformers Janus folder (config.json)."""
    if entry in BUNDLED_MODELS:
        return entry
    janus = "prompt" in conditions and registry.pipeline_for_model_type(str(_config_type(entry))) is not None
    if not model_folder(entry, "model_index.json") and not janus:
        raise ValueError(f"--model {entry!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) "
                         "nor a pipeline folder with a model_index.json")
    try:
        kind = pipeline_class_of(entry)
    except (OSError, ValueError):
        kind = None
    if kind is None or registry.pipeline_modality(kind) != "image" or kind.conditions not in conditions:
        name = kind.__name__ if kind is not None else "folder mmgen cannot open"
        raise ValueError(f"--model {entry!r} is a {name}; the image demo serves {_kinds(conditions)} pipelines")
    return entry


def _config_type(folder: str) -> Any:
    """A folder's config.json model_type (None when it has none)."""
    from .catalog import folder_field

    return folder_field(folder, "config.json", "model_type") if model_folder(folder) else None


@dataclass(frozen=True)
class ModelInfo:
    """What the UI shows for a model: its classes, methods, and sampler defaults and bounds."""

    decoder_family: str  # the pipeline's decoder family: "token", "scale" or "continuous"
    class_names: list[str]
    methods: list[str]
    default_method: str
    vocab_size: Optional[int]  # None: the model has no top-k/top-p (MAR)
    defaults: dict[str, Any]


def model_info(pipe: Any) -> ModelInfo:
    """A loaded pipeline's classes, methods (the decoders it declares), default method (its
    `default_decoding`) and sampler defaults."""
    methods = list(pipe.decoders())
    if pipe.conditions != "class":  # a prompt says what to draw
        names = []
    else:
        names = list(pipe.class_names) if pipe.class_names else [str(i) for i in range(pipe.num_classes)]
    takes_top_k = "top_k" in inspect.signature(pipe.__call__).parameters
    vocab = _vocab_size(pipe) if takes_top_k else None
    return ModelInfo(pipe.decoder_family, names, methods, pipe.default_decoding, vocab, dict(getattr(pipe, "sampling_defaults", {})))


def _vocab_size(pipe: Any) -> Optional[int]:
    """The image tokens' vocabulary (what top-k counts): the transformer's, or Janus' generation head's."""
    transformer = getattr(pipe, "transformer", None)
    if transformer is not None:
        return getattr(getattr(transformer, "config", None), "vocab_size", None)
    vq = getattr(getattr(getattr(pipe, "model", None), "config", None), "vq_config", None)
    return getattr(vq, "num_embeddings", None)


@dataclass(frozen=True)
class ImageRequest:
    """One press of Generate. None sampler values take the model's defaults."""

    model: str
    class_name: Optional[str] = None  # a class-conditional model's class
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
    prompt: Optional[str] = None  # a text-to-image model's prompt
    family_options: dict = field(default_factory=dict)  # its family's own options (`registry.family_options`)


@dataclass
class ImageRun(PerUnit):
    """One decoding of the request: its label ("sjd", "ar (baseline)"), images and stats. For
    next-scale models also the tokens each step (scale) emits per image and the models of the
    decoder's schedule, in order (`stats.stage_forwards` says how many steps each ran)."""

    label: str
    images: list
    stats: DecodeStats
    step_sizes: tuple[int, ...] = ()
    stage_models: tuple[str, ...] = ()

    @property
    def units(self) -> int:
        """Tokens made: each image's, summed."""
        return self.stats.tokens * len(self.images)

    @property
    def seconds(self) -> float:
        return self.stats.wall_time_s


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
class ImageResult(Result):
    """The method's run, and in compare mode the autoregressive baseline's before it."""

    runs: list[ImageRun]
    unit = "token"

    def stats_rows(self) -> list[dict[str, Any]]:
        """One row per run: forwards, step compression, mean accepted length, wall time, time
        per token (and, in compare mode, the speedup per token over the baseline)."""
        return [{"run": run.label, "forwards": run.stats.forwards, "tokens": run.stats.tokens,
                 "step compression": round(run.stats.step_compression, 2),
                 "mean accepted length": round(run.stats.mean_accepted_length, 2),
                 "time (s)": round(run.seconds, 3), **self.speed_columns(run)} for run in self.runs]

    def trace_rows(self, run: Optional[ImageRun] = None) -> list[dict[str, Any]]:
        """A run's accepted-length trace (default: the method's) as (forward, accepted) rows;
        autoregressive decoding's is 1 at every forward."""
        run = run or self.method
        return [{"forward": i + 1, "accepted": round(a, 3)} for i, a in enumerate(run.stats.accepted_per_forward)]

    def step_rows(self, run: Optional[ImageRun] = None) -> list[dict[str, Any]]:
        """A next-scale run's (step, tokens, model) rows (default: the method's); see `ImageRun`."""
        return (run or self.method).step_rows()


@dataclass(frozen=True)
class CheckedImage:
    """An image request whose every input passed its checks (`check_request`), in the model's
    terms. Making one loads the model's pipeline if needed, and runs nothing; the decoding
    options themselves are read when the decoder is built."""

    request: ImageRequest
    pipe: Any
    label: Any  # the class id, or the prompt of a text-to-image model
    seed: int
    count: int
    sampling: dict
    name: str  # the decoding method
    options: dict  # its options, the catalogue's companion paired in
    overrides: dict  # MAR: its masked steps, from the steps control
    scales: dict  # next-scale models: each step's tokens and the models that run them
    method: str  # the run's label: the method and its options as given
    family: dict  # the family's own options, as call keywords (`family_call`)


def check_request(request: ImageRequest, catalog: ImageCatalog, max_images: int = 4) -> CheckedImage:
    """Every check of `request` (ValueError with a message for the user) but the decoding
    options' own, before any work: the server calls it before the request waits for its model."""
    pipe = catalog.main_pipeline(request.model)
    info = model_info(pipe)
    if pipe.conditions == "prompt":
        if request.class_name is not None:
            raise ValueError("this model draws what a prompt says: give a prompt, not a class")
        label = checked_text("the prompt", request.prompt, empty="type a prompt (the prompt is empty)")
    else:
        if request.prompt is not None:
            raise ValueError("this model is class-conditional: give one of its classes, not a prompt")
        label = _class_label(request.class_name, info.class_names)
    family_options = family_call("image", pipe, request.family_options)
    clash = sorted(family_options.keys() & {*OWN_KEYWORDS, *pipe.decoder_settings})
    if clash:  # the call would get it twice
        raise ValueError(f"{clash[0]} is set by the request's own fields (the sampler's, the steps), not as a family option")
    # As the command line's: VAR's pruning and pruning_layers become one CachedTokenPruning.
    family_options = call_keywords(pipe, ImageOptions.from_values(family_options))
    seed = integer("seed", request.seed, 0, MAX_SEED)
    count = integer("number of images", request.num_images, 1, max(1, min(max_images, MAX_IMAGES)))
    sampling = sampler(request.temperature, request.top_k, request.top_p, info.vocab_size, request.guidance_scale)
    name, options = _decoding(request.method, request.options, pipe, catalog, request.model)
    companion = pipe.companions.get(name)
    if companion is not None:  # pair with the demo's cached companion unless the options name one
        if companion.option not in options and request.model + companion.suffix in catalog.names:
            options[companion.option] = request.model + companion.suffix
    scales: dict[str, Any] = {}
    if info.decoder_family == "scale":  # what the chart shows: each step's tokens and the model that ran it
        others = [str(options.get(companion.option, request.model + companion.suffix))] if companion else []
        scales = dict(step_sizes=tuple(pipe.transformer.config.step_sizes), stage_models=(request.model, *others))
    overrides = {}
    family = type(pipe).__name__.removesuffix("Pipeline")
    for keyword, setting in pipe.decoder_settings.items():  # MAR: masked steps come from the steps control
        if setting in options:  # one control per setting: the steps box would silently win
            raise ValueError(f"set {family}'s {setting} with the steps control, not as a decoding option")
        steps = info.defaults.get(keyword) if request.num_steps is None else request.num_steps
        overrides[setting] = sampling[keyword] = integer(f"{family} steps", steps, 1, MAX_STEPS)
    return CheckedImage(request, pipe, label, seed, count, sampling, name, options, overrides, scales,
                        _spec_text(request.method, request.options), family_options)


def run_request(request: ImageRequest, catalog: ImageCatalog, max_images: int = 4) -> ImageResult:
    """Check `request` (ValueError with a message for the user), generate, and return images
    and stats; in compare mode autoregressive decoding runs first on the same seed."""
    return run_checked(check_request(request, catalog, max_images), catalog)


def run_checked(checked: CheckedImage, catalog: ImageCatalog) -> ImageResult:
    """`run_request` of a request `check_request` passed."""
    request, pipe, options, scales = checked.request, checked.pipe, checked.options, checked.scales
    source = catalog.main[request.model]  # decoder_from_spec looks for bundled companions by this name
    named = companion_options(pipe)
    companions = [v for k, v in options.items() if k in named]
    with catalog.using([request.model, *companions]):
        built = {k: catalog.pipeline(v) if k in named else v for k, v in options.items()}
        decoder = decoder_from_spec(checked.name, pipe, source, catalog.device, **{**built, **checked.overrides})
        # Compare mode times its two runs, so it never shares a batch with other requests.
        # MAR, VAR and text-to-image pipelines decode alone, as does a call with its family's own options.
        shares = not request.compare and not checked.family and hasattr(pipe, "serve") and pipe.conditions == "class"
        server = catalog.server(request.model, checked.method, decoder, sampling=pipe.sampling_config(**checked.sampling)) \
            if shares else None
        plan = [(BASELINE_LABEL, decoder_from_spec("ar", pipe, source, catalog.device, **checked.overrides),
                 {**scales, "stage_models": scales.get("stage_models", ())[:1]})] if request.compare else []
        plan.append((checked.method, decoder, scales))
        runs = []
        for run_label, run_decoder, run_scales in plan if server is None else ():
            output = pipe([checked.label] * checked.count, decoding=run_decoder,
                          generator=make_generator(checked.seed, catalog.device), **checked.sampling, **checked.family)
            runs.append(ImageRun(run_label, list(output.images), output.stats, **run_scales))
    if server is not None:  # outside the model's lock, which the shared batch takes while it decodes
        runs = [shared_run(server, f"{checked.method} (continuous batch)", checked.label, checked.count, checked.seed,
                           pipe.device)]
    return ImageResult(runs)


class ImageService(ModalityService):
    """The image modality's request layer (`mmgen.apps.requests.service`): class-conditional and
    text-to-image models; the images come whole, so its stream has no updates."""

    noun, unit = "image", ImageResult.unit
    catalog, request = TextImageCatalog, ImageRequest
    check = staticmethod(check_request)

    def stream(self, checked: CheckedImage, catalog: ImageCatalog) -> Iterator[Any]:
        yield from ()
        return run_checked(checked, catalog)


SERVICE = register_service(ImageService())


def shared_run(server: Any, run_label: str, label: int, count: int, seed: int, device: Any) -> ImageRun:
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
    return ImageRun(run_label, list(images), merged)


def _class_label(class_name: Any, names: list[str]) -> int:
    if not isinstance(class_name, str) or class_name not in names:
        listed = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(f"unknown class {shown(class_name)}; choose one of this model's classes ({listed})")
    return names.index(class_name)


def companion_options(pipe: Any) -> frozenset:
    """Decoder options that name a second model for this pipeline (draft:drafter=..., collaborative:small=...)."""
    return frozenset(c.option for c in pipe.companions.values())


def _decoding(method: Any, text: Any, pipe: Any, catalog: ImageCatalog, model: str) -> tuple[str, dict[str, Any]]:
    """The method (a shortcut the pipeline declares) and its checked options: numbers and
    booleans bounded, strings only for companion models the demo offers (never a path). An old
    method or option name is read as its new one, with a DeprecationWarning."""
    shortcuts = pipe.decoders()
    if not isinstance(method, str) or RENAMED_SHORTCUTS.get(pipe.decoder_family, {}).get(method, method) not in shortcuts:
        raise ValueError(f"unknown decoding method {shown(method)} for this model; choose one of {sorted(shortcuts)}")
    if not isinstance(text, str) or len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"decoding options must be text of at most {MAX_SPEC_CHARS} characters")
    if ":" in text:
        raise ValueError(f"decoding options are key=value pairs separated by commas (e.g. 'delta=0.2,window=8'); "
                         f"pick the method in the list, got {text!r}")
    name, options = canonical_decoding(*parse_decoding(f"{method}:{text}" if text.strip() else method), shortcuts)
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

