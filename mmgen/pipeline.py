"""The `Pipeline` base: diffusers' surface (from_pretrained, save_pretrained, .to, progress bar).

A saved pipeline is a folder:

    model_index.json          {"_class_name": ..., "components": {name: class}, "config": {...}}
    <component>/config.json   the component's config dataclass as JSON
    <component>/model.safetensors

Components are `nn.Module`s built from a config dataclass (with `to_dict` / `from_dict`); a
subclass lists them in `component_types` as name -> (module class, config class).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from mmgen.hub import CheckpointError, load_state_dict, load_strict, resolve_path, save_safetensors

MODEL_INDEX = "model_index.json"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


class Pipeline:
    """Base class of every mmgen pipeline."""

    #: name -> (nn.Module class, config dataclass); the module is built as ModuleClass(config).
    component_types: ClassVar[dict[str, tuple[type, type]]] = {}

    def __init__(self, **components: nn.Module):
        missing = sorted(set(self.component_types) - set(components))
        if missing:
            raise ValueError(f"{type(self).__name__} needs components {missing}")
        self.components = components
        for name, module in components.items():
            setattr(self, name, module.eval())
        self._progress_bar_config: dict[str, Any] = {}

    # ---------------------------------------------------------------- device and dtype
    @property
    def device(self) -> torch.device:
        for module in self.components.values():
            for p in module.parameters():
                return p.device
        return torch.device("cpu")

    def to(self, device: Union[str, torch.device, None] = None, dtype: Optional[torch.dtype] = None) -> "Pipeline":
        """Move every component (and cast it when `dtype` is given); returns self."""
        for module in self.components.values():
            module.to(device=device, dtype=dtype)
        return self

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

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """Write the folder layout above; weights as safetensors, written atomically."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, module in self.components.items():
            folder = path / name
            folder.mkdir(exist_ok=True)
            _write_json(folder / CONFIG_NAME, module.config.to_dict())
            save_safetensors(module.state_dict(), folder / WEIGHTS_NAME)
        index = {
            "_class_name": type(self).__name__,
            "components": {name: type(m).__name__ for name, m in self.components.items()},
            "config": self.pipeline_config(),
        }
        _write_json(path / MODEL_INDEX, index)

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: Union[str, os.PathLike],
        device: Union[str, torch.device, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> "Pipeline":
        """Load a folder written by `save_pretrained` (a local path or a Hugging Face repo id)."""
        root = resolve_path(path_or_repo)
        index_path = root / MODEL_INDEX
        if not index_path.is_file():
            raise CheckpointError(f"{root} is not an mmgen pipeline folder: {MODEL_INDEX} is missing")
        index = json.loads(index_path.read_text())
        if index.get("_class_name") != cls.__name__:
            raise CheckpointError(f"{root} holds a {index.get('_class_name')!r}, not a {cls.__name__}")
        components = {}
        for name, (module_cls, config_cls) in cls.component_types.items():
            saved_cls = index.get("components", {}).get(name)
            if saved_cls != module_cls.__name__:
                raise CheckpointError(f"{root}: component {name!r} is {saved_cls!r}, expected {module_cls.__name__}")
            config = config_cls.from_dict(json.loads((root / name / CONFIG_NAME).read_text()))
            module = module_cls(config)
            load_strict(module, load_state_dict(root / name / WEIGHTS_NAME), source=str(root / name / WEIGHTS_NAME))
            components[name] = module
        pipe = cls(**components, **cls.config_from_index(index.get("config", {})))
        return pipe.to(device, dtype) if (device is not None or dtype is not None) else pipe

    @classmethod
    def config_from_index(cls, config: dict) -> dict:
        """Keyword arguments for `__init__` from the saved `pipeline_config()`."""
        return dict(config)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
