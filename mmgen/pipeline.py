"""The `Pipeline` base: diffusers' surface (from_pretrained, save_pretrained, .to, progress bar).

A saved pipeline is a folder:

    model_index.json          {"_class_name": ..., "components": {name: class}, "config": {...},
                               "shared": {name: "../other-pipeline/<component>"}}
    <component>/config.json   the component's config dataclass as JSON
    <component>/model.safetensors

A component listed under "shared" is read from a sibling pipeline folder instead (two
pipelines that share a tokenizer ship it once).

Components are `nn.Module`s built from a config dataclass (with `to_dict` / `from_dict`); a
subclass lists them in `component_types` as name -> (module class, config class). A component
whose config class is None saves and loads itself (transformers models and tokenizers): its
folder is whatever its `save_pretrained(folder)` writes, read back by `Class.from_pretrained`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from mmgen.decoding.window import parse_window_cost, parse_window_tokens
from mmgen.files import write_atomic
from mmgen.hub import (
    MODEL_INDEX,
    CheckpointError, check_model_folder, folder_file, check_shapes, load_state_dict, load_strict, loading_folder, model_root, read_json,
    resolve_path, save_safetensors, tensor_shapes,
)
from mmgen.sampling import make_generator

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class Companion:
    """A second model that a decoder pairs with the pipeline's own (a drafter, a small model): the
    decoder option that takes it, the name suffix of a bundled model's companion
    (`emoji64` -> `emoji64-draft`), and what it is, for messages."""

    option: str
    suffix: str
    role: str


class Pipeline:
    """Base class of every mmgen pipeline.

    A subclass declares what it is, once, for every tool that drives pipelines generically
    (`mmgen generate`, `mmgen batch`, the demos, the benchmarks), and registers itself with
    `mmgen.registry.register_pipeline` so that saved folders resolve to it by name.
    """

    #: name -> (nn.Module class, config dataclass); the module is built as ModuleClass(config).
    #: A config of None: the class has its own `from_pretrained` (and its objects `save_pretrained`).
    component_types: ClassVar[dict[str, tuple[type, Optional[type]]]] = {}
    #: The decoder family whose shortcuts `decoding=` takes (`FAMILY_DECODERS`): "token",
    #: "scale" (next-scale: VAR), "continuous" (masked continuous tokens: MAR),
    #: "causal-continuous" (next-token diffusion: VibeVoice) or "block-diffusion" (video).
    decoder_family: ClassVar[str] = "token"
    #: What a call is conditioned on: "class" (ids or names, `ClassLabelled`) or "prompt" (text).
    conditions: ClassVar[str] = "class"
    #: The shortcut a call uses when given no decoding.
    default_decoding: ClassVar[str] = "ar"
    #: Decoder shortcut -> the second model it pairs with.
    companions: ClassVar[dict[str, Companion]] = {}
    #: Call keyword -> the decoder setting it also sets (MAR: `num_iter` is `num_steps`); a
    #: decoding spec and the keyword that give one setting differently are an error.
    decoder_settings: ClassVar[dict[str, str]] = {}
    #: Whether `compile()` applies: the pipeline's decode steps trace as one static graph.
    compilable: ClassVar[bool] = False
    #: Set by `compile()`: later calls run their decode steps compiled.
    compile_steps: bool = False
    #: The model's measured forward costs by window width (`mmgen.decoding.window.WindowCost`),
    #: saved in model_index.json's config; a subclass's `token_model()` hands it on (LlamaGen).
    window_cost: Optional[dict] = None
    #: The model's measured tokens per forward by window width (`mmgen.decoding.window.WindowTokens`),
    #: saved beside `window_cost`.
    window_tokens: Optional[dict] = None
    #: Where the pipeline was loaded from (a bundled name, a folder, a Hub id; set by the loaders):
    #: a shortcut that pairs a second model finds its bundled or sibling companion by it.
    name_or_path: Optional[str] = None

    @classmethod
    def decoders(cls) -> dict[str, Any]:
        """The decoder shortcuts this pipeline takes (name -> factory)."""
        from mmgen.decoding import FAMILY_DECODERS

        return FAMILY_DECODERS[cls.decoder_family]

    def decoder(self, decoding: Any) -> Any:
        """The decoder a call's `decoding` names, one rule for every pipeline and surface: a
        decoder object of this pipeline's family as given; a shortcut or spec ("sjd",
        "lantern:delta=0.2", "draft") as the command line reads it (`mmgen.loading.decoder_from_spec`),
        so a method that pairs a second model takes the one its spec names, else the bundled
        companion of a bundled model (`emoji64` -> `emoji64-draft`), loaded once per pipeline."""
        from mmgen.decoding import resolve_decoder

        from mmgen.loading import decoder_from_spec, with_draft_heads

        if not isinstance(decoding, str):
            return with_draft_heads(resolve_decoder(decoding, self.decoders()), self)
        parameter = next((p for m in self.module_components() for p in m.parameters()), None)
        dtype = parameter.dtype if parameter is not None else torch.float32
        loaded = self.__dict__.setdefault("_companions", {})
        return decoder_from_spec(decoding, self, self.name_or_path, self.device, dtype, companions=loaded)

    def draft_heads(self) -> Optional[Any]:
        """The model's draft heads (`mmgen.decoding.heads`): the `draft_heads/` folder beside its
        weights (a bundled model's, a local folder's), loaded once; None where it has none."""
        if "_draft_heads" not in self.__dict__:
            from mmgen.decoding.heads import HEADS_FOLDER, DraftHeads
            from mmgen.loading import resolve_model

            source = resolve_model(self.name_or_path) if self.name_or_path is not None else None
            folder = folder_file(source, HEADS_FOLDER) if isinstance(source, Path) else None
            self._draft_heads = DraftHeads.from_pretrained(folder, self.device) if folder is not None and folder.is_dir() else None
        return self._draft_heads

    def check_companion(self, other: "Pipeline", companion: Companion) -> None:
        """ValueError when `other` cannot serve as this pipeline's `companion` beyond sharing
        the decoder family (a VLM's drafter must share its tokenizer, say). Called by loaders
        before any decoding."""

    def __init__(self, **components: Any):
        missing = sorted(set(self.component_types) - set(components))
        if missing:
            raise ValueError(f"{type(self).__name__} needs components {missing}")
        self.components = components
        for name, component in components.items():
            setattr(self, name, component.eval() if isinstance(component, nn.Module) else component)
        self._progress_bar_config: dict[str, Any] = {}

    def compile(self, enabled: bool = True) -> "Pipeline":
        """Run the decode steps of later calls under `torch.compile` (`mmgen.compile`: one graph
        per window width, CUDA graphs on CUDA); `enabled=False` goes back to eager. Returns self.

        Opt-in: the first call of each window width pays the compilation (seconds on a GPU, tens
        of seconds on a CPU), later ones run the compiled step. ValueError for a pipeline whose
        steps do not compile (`compilable` is False).
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"compile takes True or False, got {enabled!r}")
        if enabled and not self.compilable:
            raise ValueError(f"{type(self).__name__} has no compiled decode steps (LlamaGen pipelines have them)")
        self.compile_steps = enabled
        return self

    def module_components(self) -> list[nn.Module]:
        """The components that hold tensors (a tokenizer, say, holds none)."""
        return [c for c in self.components.values() if isinstance(c, nn.Module)]

    # ---------------------------------------------------------------- device and dtype
    @property
    def device(self) -> torch.device:
        for module in self.module_components():
            for p in module.parameters():
                return p.device
        return torch.device("cpu")

    def to(self, device: Union[str, torch.device, None] = None, dtype: Optional[torch.dtype] = None) -> "Pipeline":
        """Move every module component (and cast it when `dtype` is given); returns self."""
        for module in self.module_components():
            module.to(device=device, dtype=dtype)
        return self

    def generator_for(self, generator: Union[torch.Generator, Sequence[torch.Generator], None],
                      per_output: bool = False) -> Union[torch.Generator, list[torch.Generator]]:
        """`generator`, checked to live on the pipeline's device; a fresh one when None. Where
        the pipeline takes one generator per output (`per_output`, as diffusers' lists), a list
        comes back as a list, each checked."""
        device = self.device
        if generator is None:
            return make_generator(None, device)
        if isinstance(generator, (list, tuple)):
            if not per_output:
                raise ValueError(f"{type(self).__name__} takes one torch.Generator, not a list")
            if not generator or not all(isinstance(g, torch.Generator) for g in generator):
                raise ValueError("generator must be a torch.Generator or a non-empty list of them (one per output)")
            return [self.generator_for(g) for g in generator]
        if generator.device.type != device.type:
            raise ValueError(f"generator is on {generator.device} but the pipeline runs on {device}: create it there")
        return generator

    def calibration_calls(self, count: int) -> list[Callable[[str], Any]]:
        """`count` batch-1 calls on held-out inputs, each taking a decoding spec and returning the
        pipeline's output: what `mmgen calibrate` decodes to measure a model's window cost. Token
        pipelines override it; others have no adaptive window to calibrate."""
        raise ValueError(f"{type(self).__name__} has no adaptive window to calibrate (token models do: LlamaGen, "
                         "vision-language and codec speech models)")

    # ---------------------------------------------------------------- progress bar
    def set_progress_bar_config(self, **kwargs: Any) -> None:
        """tqdm options for later calls, e.g. `disable=True`."""
        self._progress_bar_config = dict(kwargs)

    def progress_bar(self, total: int, desc: str = "decoding") -> tqdm:
        return tqdm(total=total, desc=desc, **{"leave": False, **self._progress_bar_config})

    # ---------------------------------------------------------------- save / load
    def pipeline_config(self) -> dict:
        """Extra settings a subclass saves beside its components (JSON-serialisable)."""
        return {}

    def save_pretrained(
        self,
        path: Union[str, os.PathLike],
        dtypes: Optional[dict[str, torch.dtype]] = None,
        shared: Optional[dict[str, str]] = None,
    ) -> None:
        """Write the folder layout above; weights as safetensors, written atomically.

        `dtypes` stores a component's floating tensors in another dtype (e.g. float16 to halve
        a tokenizer's size; loading casts back). `shared` writes no weights for a component,
        only a reference to a sibling folder ("../other/vq") that already holds them.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        shared = dict(shared or {})
        for name, module in self.components.items():
            if name in shared:
                _check_shared(path, name, shared[name])
                continue
            folder = path / name
            if self.component_types[name][1] is None:
                if name in (dtypes or {}):
                    raise ValueError(f"dtypes: {name!r} saves itself through its own save_pretrained; cast it with .to()")
                module.save_pretrained(folder)
                continue
            folder.mkdir(exist_ok=True)
            _write_json(folder / CONFIG_NAME, module.config.to_dict())
            state = module.state_dict()
            dtype = (dtypes or {}).get(name)
            if dtype is not None:
                state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            save_safetensors(state, folder / WEIGHTS_NAME)
        index = {
            "_class_name": type(self).__name__,
            "components": {name: type(m).__name__ for name, m in self.components.items()},
            "config": {**self.pipeline_config(), **({"window_cost": self.window_cost} if self.window_cost else {}),
                       **({"window_tokens": self.window_tokens} if self.window_tokens else {})},
            "shared": shared,
        }
        _write_json(path / MODEL_INDEX, index)

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: Union[str, os.PathLike],
        device: Union[str, torch.device, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "Pipeline":
        """Load a folder written by `save_pretrained` (a local path or a Hugging Face repo id),
        checked first (`mmgen.hub.loading_folder`: no link out of it, sizes within bounds); a
        bad folder is one CheckpointError line."""
        root = resolve_path(path_or_repo)
        with loading_folder(root):
            pipe = cls._load(root)
        pipe.name_or_path = os.fspath(path_or_repo)
        return pipe.to(device, dtype) if (device is not None or dtype is not None) else pipe

    @classmethod
    def _load(cls, root: Path) -> "Pipeline":
        """The pipeline in the checked local folder `root`, its components in float32."""
        index_path = root / MODEL_INDEX
        if not index_path.exists():  # anything else there, read_json refuses unless a small regular file
            raise CheckpointError(f"{root} is not an mmgen pipeline folder: {MODEL_INDEX} is missing")
        index = read_json(index_path)
        if index.get("_class_name") != cls.__name__:
            raise CheckpointError(f"{root} holds a {index.get('_class_name')!r}, not a {cls.__name__}")
        components = {}
        for name, (module_cls, config_cls) in cls.component_types.items():
            saved_cls = index.get("components", {}).get(name)
            folder = _check_shared(root, name, index["shared"][name]) if name in index.get("shared", {}) else root / name
            if config_cls is None:  # its own format; the loader (e.g. AutoTokenizer) picks the class
                if not folder.is_dir():
                    raise CheckpointError(f"{root}: component folder {name!r} is missing")
                # transformers' loaders never run a folder's own code (`auto_map`); diffusers'
                # model classes have none to run.
                remote = {"trust_remote_code": False} if module_cls.__module__.startswith("transformers") else {}
                component = module_cls.from_pretrained(str(folder), **remote)
                if isinstance(component, nn.Module):  # built in float32 like the others; `.to` casts below
                    component = component.to(torch.float32)
                if type(component).__name__ != saved_cls:
                    raise CheckpointError(f"{root}: component {name!r} loaded as {type(component).__name__}, saved as {saved_cls!r}")
                components[name] = component
                continue
            if saved_cls != module_cls.__name__:
                raise CheckpointError(f"{root}: component {name!r} is {saved_cls!r}, expected {module_cls.__name__}")
            config = config_cls.from_dict(read_json(folder / CONFIG_NAME))
            components[name] = _build_checked(module_cls, config, folder / WEIGHTS_NAME)
        config = dict(index.get("config", {}))
        window_cost = parse_window_cost(config.pop("window_cost", None), f"{index_path} window_cost")
        window_tokens = parse_window_tokens(config.pop("window_tokens", None), f"{index_path} window_tokens")
        pipe = cls(**components, **cls.config_from_index(config))
        pipe.window_cost, pipe.window_tokens = window_cost, window_tokens
        return pipe

    @classmethod
    def config_from_index(cls, config: dict) -> dict:
        """Keyword arguments for `__init__` from the saved `pipeline_config()`."""
        return dict(config)


def load_dtype(dtype: Optional[torch.dtype], device: Union[str, torch.device, None] = None) -> Union[torch.dtype, str]:
    """The dtype a transformers or diffusers model loads in: `dtype` when given; otherwise
    float32 on a CPU and the stored dtype ("auto") on an accelerator. Weights are often stored in
    half precision to stay small, and CPUs run half-precision matmuls and convolutions on slow
    fallback kernels: the bundled Dia decoded 2.3x slower at 16 rows in float16, its DAC decoder
    4x (docs/history.md). mmgen folders build their modules in float32 the same way."""
    if dtype is not None:
        return dtype
    return torch.float32 if device is None or torch.device(device).type == "cpu" else "auto"


def _build_checked(module_cls: type, config: Any, weights: Path) -> nn.Module:
    """`module_cls(config)` with `weights` loaded strictly, allocated only once the weight file
    is known to hold exactly the tensors the config asks for: the module is first built on the
    meta device and checked against the file's header, so a config cannot make mmgen allocate
    what the weights do not back (a config of dim 98304 with no weights stops here, small)."""
    shapes = tensor_shapes(weights)
    with torch.device("meta"):
        skeleton = module_cls(config)
    check_shapes(skeleton, shapes, source=str(weights))
    module = module_cls(config)
    load_strict(module, load_state_dict(weights), source=str(weights))
    return module


def _check_shared(root: Path, name: str, reference: str) -> Path:
    """The folder a shared component points to; it must be a sibling pipeline's component
    (a folder its model_index.json lists, whatever format the component saves in)."""
    target = (root / reference).resolve()
    index = target.parent / MODEL_INDEX
    listed = index.is_file() and target.name in read_json(index).get("components", {})
    if target.parent.parent != root.resolve().parent or not (listed and target.is_dir()):
        raise CheckpointError(f"{root}: shared component {name!r} -> {reference!r} is not a component folder of a sibling pipeline")
    return check_model_folder(target, model_root(target.parent))  # no link out of the sibling either


def _write_json(path: Path, data: dict) -> None:
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())
