"""One image-generation call from user options, checked before any work runs.

`mmgen generate image` and `mmgen batch` share this: load a pipeline by name
(`load_image_pipeline`), turn decoding and sampling options into a decoder and the pipeline's
keyword arguments (`prepare_call`, which raises ValueError for anything the model cannot take),
run it with a seeded generator (`ImageCall`), and encode the images (`png_bytes`).
`image_file_names` names what `generate image` writes.

A decoder setting that both the spec and a flag give (`--decoding sjd:window=4 --window 8`,
MAR's `--decoding ar:num_steps=8 --num-iter 16`) is an error unless they agree, for every model
family (`mmgen.loading.merge_decoding_options`). MAR's step count is `--num-iter`, else the spec's
`num_steps`, else the model's `sampling_defaults["num_iter"]`.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import io
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from mmgen import registry
from mmgen.sampling import make_generator

from mmgen.image_ar.bundled import DEFAULT_MODEL
from mmgen.loading import decoder_from_spec, load_pipeline


@dataclass(frozen=True)
class ImageOptions:
    """Decoding and sampling options of one call; None takes the model's default. Each field is
    the `mmgen generate image` flag of the same name (`cfg_interval`: --cfg-interval) and the
    `mmgen batch` job field: those every image model takes are the modality's own, the others
    (from `cfg_interval` on) are declared by the built-in families' records (`mmgen.image_ar`)."""

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
    #: Options of a registered family's own (`registry.family_options("image")`), as sorted
    #: (name, value) pairs; each is a flag and a job field of its name too.
    family: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "ImageOptions":
        """The options of `mmgen generate image`'s flags (the families' from `cli.add_family_flags`)."""
        return cls.from_values({name: getattr(args, name) for name in (*COMMON_OPTIONS, *args.family_flags)})

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "ImageOptions":
        """The options of values by name (a job's fields, the flags'; None: not given), checked
        already: this class's fields, the rest a registered family's own (`family`). A list is a
        tuple here, and more_smooth's False (its default) is not given."""
        values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items() if v is not None}
        if values.get("more_smooth") is False:
            del values["more_smooth"]
        own = {f.name for f in fields(cls)} - {"family"}
        return cls(**{name: v for name, v in values.items() if name in own},
                   family=tuple(sorted((name, v) for name, v in values.items() if name not in own)))

    def flags(self) -> list[str]:
        """The `mmgen generate image` arguments that give these options."""
        out = []
        for name, value in [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "family"] + list(self.family):
            flag = "--" + name.replace("_", "-")
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
    options: dict
    spec: str  # the decoding spec the decoder came from (the pipeline's default when none was given)

    def __call__(self, inputs: Sequence[Union[int, str]], seed: int, device: Union[str, torch.device]):
        return self.pipe(list(inputs), decoding=self.decoder, generator=make_generator(seed, device), **self.options)

    def each(self, inputs: Sequence[Union[int, str]], seeds: Sequence[int], device: Union[str, torch.device],
             batch_size: int, on_image) -> Any:
        """One image per input from its own seed, by continuous batching (`on_image(i, image,
        stats)` as each is decoded): image i equals `self([inputs[i]], seeds[i], device)`."""
        generators = [make_generator(seed, device) for seed in seeds]
        return self.pipe(list(inputs), decoding=self.decoder, generator=generators, batch_size=batch_size,
                         on_image=on_image, **self.options)

    def check_continuous(self) -> None:
        """ValueError unless this call can run by continuous batching (`each`)."""
        from mmgen.decoding.batching import check_continuous

        if not hasattr(self.pipe, "generate_each"):
            raise ValueError(f"{type(self.pipe).__name__} has no continuous batching (LlamaGen models have)")
        check_continuous(self.decoder, self.pipe.token_model())


def load_image_pipeline(model, device: str, dtype: torch.dtype):
    """The pipeline a --model names (default: the bundled `emoji64`); see `mmgen.loading.load_pipeline`."""
    return load_pipeline(model or DEFAULT_MODEL, device, dtype)


def prepare_call(pipe, model: Union[str, os.PathLike], options: ImageOptions, device: str, dtype: torch.dtype,
                 prompts: bool = False) -> ImageCall:
    """The decoder and keyword options for `pipe`, every option checked against what the
    pipeline declares (its conditions, its call's keywords, its decoders) and the sampler's
    bounds (ValueError), so that bad input fails before any work. `model` names the pipeline
    for bundled companions (`<model>-draft`)."""
    if prompts != (pipe.conditions == "prompt"):
        raise ValueError(f"this model is conditioned on {'text' if pipe.conditions == 'prompt' else 'class labels'}: "
                         f"use {'--prompt, not --class-labels' if pipe.conditions == 'prompt' else '--class-labels, not --prompt'}")
    given = call_keywords(pipe, options)
    spec = pipe.default_decoding if options.decoding is None else options.decoding
    settings = {"window": options.window, **{setting: given.get(kw) for kw, setting in pipe.decoder_settings.items()}}
    decoder = decoder_from_spec(spec, pipe, model, device, dtype, **{k: v for k, v in settings.items() if v is not None})
    return ImageCall(pipe, decoder, given, spec)


def call_keywords(pipe, options: ImageOptions) -> dict:
    """`options` as keywords of `pipe`'s call, checked against what its call takes and its
    sampler's bounds (ValueError). The one place the families' options become call keywords:
    VAR's `pruning` and `pruning_layers` make one `pruning` (a CachedTokenPruning)."""
    given = {name: getattr(options, name) for name in CALL_OPTIONS}
    given["pruning"] = parse_pruning(options.pruning, options.pruning_layers)
    given = {k: v for k, v in given.items() if v is not None}
    given.update(registry.family_call_options("image", registry.pipeline_family(pipe), dict(options.family)))
    unsupported = sorted(set(given) - set(inspect.signature(pipe.__call__).parameters))
    if unsupported:
        raise ValueError(f"{type(pipe).__name__} has no option(s) {unsupported}")
    if hasattr(pipe, "sampling_config"):  # the sampler's own bounds (top_p in (0, 1], ...), now rather than mid-run
        accepted = inspect.signature(pipe.sampling_config).parameters
        pipe.sampling_config(**{k: v for k, v in given.items() if k in accepted})
    return given


def compile_companions(pipe, decoder) -> None:
    """`--compile` for the second model a decoder pairs `pipe` with (a drafter, a small model):
    compiled too when it is a pipeline whose steps compile."""
    from mmgen.pipeline import Pipeline

    for companion in pipe.companions.values():
        other = getattr(decoder, companion.option, None)
        if isinstance(other, Pipeline) and other.compilable:
            other.compile()


#: ImageOptions fields every image model takes, the modality's own flags and job fields (the
#: others are the families' options, `registry.family_options("image")`).
COMMON_OPTIONS = ("decoding", "window", "guidance_scale", "temperature", "top_k", "top_p")
#: ImageOptions fields that are keywords of a pipeline call (the rest pick the decoder).
CALL_OPTIONS = ("guidance_scale", "temperature", "top_k", "top_p", "cfg_interval", "preset", "more_smooth", "num_iter",
                "cfg_schedule")


def image_file_names(inputs: Sequence[Union[int, str]], model: Union[str, os.PathLike], seed: int,
                     options: ImageOptions, spec: str, prompts: bool = False) -> list[str]:
    """The PNG names `generate image` writes: position, class id or prompt, model, seed,
    decoding spec and any other option, e.g. `000_class7_emoji64_seed0_sjd.png` or
    `001_class3_var-emoji64_seed2_collaborative-large_steps=4_pruning=5=0.5.png`, so that runs with other
    seeds, decoders, options or models do not collide. Settings longer than 60 characters are
    cut and end in a hash of the whole, and so do settings that name a path or hold characters a
    file name cannot (only the spec's ':' and ',' become '-'), so that no two settings share a
    name: `lantern++` keeps its '+'s. `spec` is the call's decoding spec (`ImageCall.spec`)."""
    flags = [flag.removeprefix("--") for flag in replace(options, decoding=None).flags()]
    text = "_".join([spec, *flags])
    settings = _file_slug(text, keep="+")
    if len(settings) > 60 or settings != re.sub(r"[:,]", "-", text):
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        settings = settings[:51] + "-" + digest
    run = f"{_file_slug(Path(os.fspath(model)).name) or 'model'}_seed{seed}_{settings}"
    labels = [(_file_slug(str(x).lower())[:40] or "prompt") if prompts else f"class{x}" for x in inputs]
    return [f"{i:03d}_{label}_{run}.png" for i, label in enumerate(labels)]


def _file_slug(text: str, keep: str = "") -> str:
    """`text` with every run of characters outside [A-Za-z0-9._=-] (and `keep`) as one '-' (safe
    in file names)."""
    return re.sub(rf"[^A-Za-z0-9._={re.escape(keep)}-]+", "-", text).strip("-.")


def check_targets(paths: Sequence[Path], overwrite: bool) -> None:
    """Refuse to replace existing files unless `overwrite` (before any work)."""
    existing = [p for p in paths if p.exists() or p.is_symlink()]
    folders = [p for p in existing if p.is_dir()]
    if folders:  # first: --overwrite cannot help
        raise IsADirectoryError(f"{folders[0]} is a folder; an image would replace it: move it, or choose another --out")
    if existing and not overwrite:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise FileExistsError(f"{existing[0]}{more} already exist(s): pass --overwrite to replace, or choose another --out")


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
