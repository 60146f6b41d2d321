"""One image-generation call from user options, checked before any work runs.

`mmgen generate image` and `mmgen batch` share this: load a pipeline by name
(`load_image_pipeline`), turn decoding and sampling options into a decoder and the pipeline's
keyword arguments (`prepare_call`, which raises ValueError for anything the model cannot take),
run it with a seeded generator (`ImageCall`), and encode the images (`png_bytes`).
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from mmgen.decoding import parse_decoding
from mmgen.sampling import make_generator

from mmgen.image_ar.bundled import DEFAULT_MODEL, decoder_from_spec, resolve_model
from mmgen.image_ar.llamagen import LlamaGenPipeline

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ImageOptions:
    """Decoding and sampling options of one call; None takes the model's default. Each field is
    the `mmgen generate image` flag of the same name (`cfg_interval`: --cfg-interval)."""

    decoding: Optional[str] = None
    window: Optional[int] = None
    guidance_scale: Optional[float] = None
    cfg_interval: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    preset: Optional[str] = None  # VAR
    more_smooth: Optional[bool] = None  # VAR
    pruning: Optional[str] = None  # VAR, "STEP=KEEP,...[@START:STOP]"
    pruning_layers: Optional[tuple[int, int]] = None  # VAR
    num_iter: Optional[int] = None  # MAR
    cfg_schedule: Optional[str] = None  # MAR

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "ImageOptions":
        given = {f.name: getattr(args, f.name) for f in fields(cls)}
        given["more_smooth"] = given["more_smooth"] or None  # a store_true flag: False means "not given"
        if given["pruning_layers"] is not None:
            given["pruning_layers"] = tuple(given["pruning_layers"])
        return cls(**given)

    def flags(self) -> list[str]:
        """The `mmgen generate image` arguments that give these options."""
        out = []
        for f in fields(self):
            value, flag = getattr(self, f.name), "--" + f.name.replace("_", "-")
            if value is None or value is False:
                continue
            if value is True:
                out.append(flag)
            elif isinstance(value, tuple):
                out += [flag, *map(str, value)]
            else:
                out.append(f"{flag}={value}")  # "=": values such as "-2=0.6" must not read as flags
        return out


@dataclass
class ImageCall:
    """A pipeline with its decoder and checked keyword options: call it with the inputs (class
    ids or prompts) and a seed."""

    pipe: Any
    decoder: Any
    family: str  # "token", "scale" (VAR), "continuous" (MAR) or "prompt" (text-to-image)
    options: dict

    def __call__(self, inputs: Sequence[Union[int, str]], seed: int, device: Union[str, torch.device]):
        return self.pipe(list(inputs), decoding=self.decoder, generator=make_generator(seed, device), **self.options)


def load_image_pipeline(model, prompts: bool, device: str, dtype: torch.dtype):
    """The pipeline a --model names: mmgen folders say their class in model_index.json;
    transformers folders (config.json of model_type "janus") and, with --prompt, Hub ids are
    Janus-Pro checkpoints."""
    source = Path(resolve_model(model or DEFAULT_MODEL))
    index, config = source / "model_index.json", source / "config.json"
    class_name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    is_janus = config.is_file() and json.loads(config.read_text()).get("model_type") == "janus"
    if class_name == "MARPipeline":
        from mmgen.image_ar.mar import MARPipeline

        return MARPipeline.from_pretrained(source, device=device, dtype=dtype)
    if class_name == "VARPipeline":
        from mmgen.image_ar.var import VARPipeline

        return VARPipeline.from_pretrained(source, device=device, dtype=dtype)
    if class_name == "LlamaGenText2ImagePipeline":
        from mmgen.image_ar.llamagen import LlamaGenText2ImagePipeline

        return LlamaGenText2ImagePipeline.from_pretrained(source, device=device, dtype=dtype)
    if is_janus or (prompts and class_name is None):
        from mmgen.image_ar.janus import JanusPipeline

        return JanusPipeline.from_pretrained(model, torch_dtype=dtype, device=device)
    return LlamaGenPipeline.from_pretrained(source, device=device, dtype=dtype)


def model_family(pipe) -> str:
    """Which decoder shortcuts a pipeline takes: "token" (LlamaGen), "scale" (VAR),
    "continuous" (MAR), or "prompt" for text-to-image pipelines (token decoders)."""
    from mmgen.image_ar.mar import MARPipeline
    from mmgen.image_ar.var import VARPipeline

    if isinstance(pipe, VARPipeline):
        return "scale"
    if isinstance(pipe, MARPipeline):
        return "continuous"
    return "token" if isinstance(pipe, LlamaGenPipeline) else "prompt"


def masked_steps(spec: str, default: int, num_iter: Optional[int] = None) -> dict:
    """The `num_steps` a continuous decoder built from `spec` must get: `num_iter` when given,
    else none when the spec names its own, else the model's `default`. A spec and `num_iter`
    that disagree are an error rather than one silently winning."""
    named = parse_decoding(spec)[1].get("num_steps")
    if named is not None and num_iter is not None and named != num_iter:
        raise ValueError(f"the decoding spec sets num_steps={named} but num_iter is {num_iter}: give one of them")
    if named is not None:
        return {}
    return {"num_steps": default if num_iter is None else num_iter}


def prepare_call(pipe, model: Union[str, os.PathLike], options: ImageOptions, device: str, dtype: torch.dtype,
                 prompts: bool = False) -> ImageCall:
    """The decoder and keyword options for `pipe`, every option checked against the model's
    family and the sampler's bounds (ValueError), so that bad input fails before any work.
    `model` names the pipeline for bundled companions (`<model>-draft`)."""
    family = model_family(pipe)
    is_var, is_mar = family == "scale", family == "continuous"
    overrides = {} if options.window is None else {"window": options.window}
    spec = options.decoding or ("ar" if is_var or is_mar else "sjd")
    if is_mar:
        overrides.update(masked_steps(spec, pipe.sampling_defaults["num_iter"], options.num_iter))
    decoder = decoder_from_spec(spec, model, device, dtype, family="token" if family == "prompt" else family, **overrides)
    sampling = dict(guidance_scale=options.guidance_scale, temperature=options.temperature, top_k=options.top_k,
                    top_p=options.top_p, cfg_interval=options.cfg_interval)
    var_options = dict(preset=options.preset, more_smooth=options.more_smooth,
                       pruning=parse_pruning(options.pruning, options.pruning_layers))
    if not is_var and any(v is not None for v in var_options.values()):
        raise ValueError("--preset, --more-smooth and --pruning are VAR options; this model is not a VAR model")
    if prompts and family != "prompt":
        raise ValueError("this model is class-conditional: use --class-labels, not --prompt")
    if not prompts and family == "prompt":
        raise ValueError("this model is text-to-image: use --prompt, not --class-labels")
    if is_var and options.cfg_interval is not None:
        raise ValueError("--cfg-interval is a LlamaGen option; VAR ramps guidance over the scales")
    given = {**sampling, **(var_options if is_var else {}), "num_iter": options.num_iter, "cfg_schedule": options.cfg_schedule}
    given = {k: v for k, v in given.items() if v is not None}
    unsupported = sorted(set(given) - set(inspect.signature(pipe.__call__).parameters))
    if unsupported:
        raise ValueError(f"{type(pipe).__name__} has no option(s) {unsupported}")
    if hasattr(pipe, "sampling_config"):  # the sampler's own bounds (top_p in (0, 1], ...), now rather than mid-run
        accepted = inspect.signature(pipe.sampling_config).parameters
        pipe.sampling_config(**{k: v for k, v in given.items() if k in accepted})
    return ImageCall(pipe, decoder, family, given)


def parse_pruning(spec: Optional[str], layers: Optional[Sequence[int]]):
    """`--pruning "4=0.6,5=0.5[@START:STOP]"` (+ `--pruning-layers`) -> a CachedTokenPruning, or None."""
    from mmgen.decoding import CachedTokenPruning

    if spec is None:
        if layers is not None:
            raise ValueError("--pruning-layers needs --pruning")
        return None
    try:
        pruning = CachedTokenPruning.from_spec(spec)
    except ValueError as error:
        raise ValueError(f"bad --pruning item: {error}") from None
    return replace(pruning, layers=tuple(layers)) if layers is not None else pruning


def png_bytes(image) -> bytes:
    """A PIL image as PNG file bytes (what `mmgen` writes, and hashes, for every image)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
