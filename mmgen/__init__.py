"""mmgen: fast multimodal autoregressive generation on one shared decoding core.

Every modality's pipelines are importable from the top, as in diffusers, and imported on first
use (the core imports no modality): images (`LlamaGenPipeline`, `LlamaGenText2ImagePipeline`,
`JanusPipeline`, `VARPipeline`, `MARPipeline`), vision-language models (`VLMPipeline`), speech
(`TTSPipeline`, `LatentTTSPipeline`) and video (`BlockDiffusionVideoPipeline`).
`mmgen.load_pipeline(name_or_folder)` opens a bundled model, a model folder or a Hub repo as the
pipeline class it holds.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

# OpenMP threads that spin between parallel regions steal the core a busy box's other process
# holds: a GPT-B decode step on 2 threads beside one busy process takes 3.4x longer with GNU
# OpenMP's default (spinning) waits than with passive ones, which cost nothing measurable on an
# idle box (docs/history.md, "The machine"). OpenMP reads the policy when
# torch loads, so it is set only where torch is not loaded yet (the `mmgen` command, or
# `import mmgen` first), and never over the user's own setting.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from typing import Any, Optional, Union

from mmgen import registry
from mmgen.cache import StaticKVCache
from mmgen.modeling import ContinuousModel, ContinuousState, DecodeState, HeadSample, ScaleModel, ScaleState, TokenModel
from mmgen.registry import pipeline_class, register_pipeline
from mmgen.sampling import ConstantGuidance, IntervalGuidance, LinearProgressGuidance, Logits, RampGuidance, SamplingConfig

try:
    __version__ = metadata.version("mmgen")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"



#: Names re-exported from `mmgen.decoding`, imported on first use: `import mmgen.kernels` (which
#: the decoding loop imports lazily) then loads no decoder, so neither package loads the other.
_DECODING = ("Autoregressive", "DecodeStats", "ExactAcceptance", "SpeculativeJacobi", "resolve_decoder")


def __getattr__(name: str) -> Any:
    if name in _DECODING:
        import mmgen.decoding

        return getattr(mmgen.decoding, name)
    # Pipeline classes resolve through the registry, importing their module on first use.
    if name.endswith("Pipeline") and registry.is_pipeline_name(name):
        return registry.pipeline_class(name)  # not cached: the registry stays the one truth
    raise AttributeError(f"module 'mmgen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_DECODING) | set(registry.pipeline_names()))


def load_pipeline(name_or_path: Union[str, os.PathLike], device: Union[str, Any, None] = None,
                  dtype: Optional[Any] = None):
    """A bundled model ("emoji64", "var-emoji64", "emoji-vlm", ...), a pipeline folder
    (`save_pretrained` / `mmgen convert`), a transformers folder of a model type mmgen serves
    (Janus-Pro, LLaVA, Qwen2.5-VL, ...) or a Hub repo id, loaded as the pipeline class it holds,
    on `device` and in `dtype` when given (`mmgen.loading.load_pipeline`)."""
    from mmgen.loading import load_pipeline as load

    return load(name_or_path, device=device, dtype=dtype)


__all__ = [
    "Autoregressive",
    "BlockDiffusionVideoPipeline",
    "ConstantGuidance",
    "ContinuousModel",
    "ContinuousState",
    "DecodeState",
    "DecodeStats",
    "ExactAcceptance",
    "HeadSample",
    "IntervalGuidance",
    "JanusPipeline",
    "LatentTTSPipeline",
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
    "TTSPipeline",
    "TokenModel",
    "VARPipeline",
    "VLMPipeline",
    "load_pipeline",
    "pipeline_class",
    "register_pipeline",
    "resolve_decoder",
]
