"""mmgen: fast multimodal autoregressive generation on one shared decoding core.

Pipelines are importable from the top, as in diffusers, and imported on first use (the core
imports no modality): `from mmgen import LlamaGenPipeline, VARPipeline, MARPipeline,
JanusPipeline, LlamaGenT2IPipeline`. `mmgen.load_pipeline(name_or_folder)` opens a bundled
model, a pipeline folder or a Hub repo as the pipeline class it was saved as.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata
from typing import Any, Optional, Union

from mmgen.cache import StaticKVCache
from mmgen.decoding import Autoregressive, DecodeStats, ExactAcceptance, SpeculativeJacobi, resolve_decoder
from mmgen.modeling import ContinuousModel, ContinuousState, DecodeState, HeadSample, ScaleModel, ScaleState, TokenModel
from mmgen.sampling import ConstantGuidance, IntervalGuidance, LinearProgressGuidance, Logits, RampGuidance, SamplingConfig

try:
    __version__ = metadata.version("mmgen")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

#: Lazily imported names: attribute -> (module, name in that module). Pipeline folders name
#: their class in model_index.json (`_class_name`); `pipeline_class` looks it up here.
LAZY: dict[str, tuple[str, str]] = {
    "LlamaGenPipeline": ("mmgen.image_ar.llamagen", "LlamaGenPipeline"),
    "LlamaGenText2ImagePipeline": ("mmgen.image_ar.llamagen", "LlamaGenText2ImagePipeline"),
    "LlamaGenT2IPipeline": ("mmgen.image_ar.llamagen", "LlamaGenText2ImagePipeline"),
    "VARPipeline": ("mmgen.image_ar.var", "VARPipeline"),
    "MARPipeline": ("mmgen.image_ar.mar", "MARPipeline"),
    "JanusPipeline": ("mmgen.image_ar.janus", "JanusPipeline"),
}
#: The module whose `load_pipeline` opens bundled names and folders (image_ar holds every
#: pipeline today).
PIPELINE_LOADER = "mmgen.image_ar.bundled"


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module 'mmgen' has no attribute {name!r}")
    module, attribute = LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY))


def pipeline_class(class_name: str) -> type:
    """The pipeline class a saved folder names (model_index.json's `_class_name`)."""
    if class_name not in LAZY or not class_name.endswith("Pipeline"):
        known = sorted(k for k, (_, v) in LAZY.items() if k == v)
        raise ValueError(f"unknown pipeline class {class_name!r}; mmgen has {known}")
    return __getattr__(class_name)


def load_pipeline(name_or_path: Union[str, os.PathLike], device: Union[str, Any, None] = None,
                  dtype: Optional[Any] = None):
    """A bundled model ("emoji64", "var-emoji64", "mar-emoji64", ...), a pipeline folder
    (`save_pretrained` / `mmgen convert`), a Janus-Pro transformers folder or a Hub repo id,
    loaded as the pipeline class it holds, on `device` and in `dtype` when given."""
    return importlib.import_module(PIPELINE_LOADER).load_pipeline(name_or_path, device=device, dtype=dtype)


__all__ = [
    "Autoregressive",
    "ConstantGuidance",
    "ContinuousModel",
    "ContinuousState",
    "DecodeState",
    "DecodeStats",
    "ExactAcceptance",
    "HeadSample",
    "IntervalGuidance",
    "JanusPipeline",
    "LinearProgressGuidance",
    "LlamaGenPipeline",
    "LlamaGenT2IPipeline",
    "LlamaGenText2ImagePipeline",
    "Logits",
    "MARPipeline",
    "RampGuidance",
    "SamplingConfig",
    "ScaleModel",
    "ScaleState",
    "SpeculativeJacobi",
    "StaticKVCache",
    "TokenModel",
    "VARPipeline",
    "load_pipeline",
    "pipeline_class",
    "resolve_decoder",
]
