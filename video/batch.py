"""`mmgen batch` for video jobs: MP4 files from a JSONL job file, resumable and sharded over the
ranks of a torchrun job, like the image, text and speech jobs.

    mmgen batch clips.jsonl --out videos/ [--batch-size 8] [--on-error stop|skip]

One job per line, each saying `"modality": "video"` (without it, a line with a `prompt` is a
text job, `mmgen.vlm.batch`):

    {"modality": "video", "prompt": "cat face moving left", "output": "cat"}
    {"modality": "video", "prompt": "sun bouncing", "num_frames": 33, "cache_policy": "window:4", "output": "sun"}

Required: `prompt` and `output` (a file-name stem, unique in the file: the video goes to
`<out>/<output>.mp4`), and `modality` ("video") to tell the line from a text job. Optional:
`model` (default the bundled `emoji-motion`), `num_frames`, `block_frames`, `height`, `width`,
`cache_policy`, `decoding`, `guidance_scale`, `negative_prompt`, `cache_threshold`,
`drop_threshold`, `seed` (default 0), as the `mmgen generate video` flags. Every line is checked
before any work (JSON, fields, models load, geometry and specs valid); `--on-error` as for image
jobs.

The old form, the prompt in a `video` field and no `modality` (`{"video": "cat face moving
left", "output": "cat"}`), is still read as a video job until the next release, with a warning
on stderr once per run; a line with both `video` and `prompt` is an error. A run started with
the old form resumes with either form: a job's finished videos count whichever names it uses.

Jobs of one model and options are packed in file order into calls of up to `--batch-size`
videos with one generator seeded from their seeds (`mmgen.batch.group_seed`: a lone job keeps
its own seed, so `--batch-size 1` equals `mmgen generate video --seed`). Files are written
atomically and recorded in the manifest with the decode's stats, profile and group, so a killed
run resumes without losing or duplicating videos.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmgen.batch import (FAMILY_FIELDS, FIELD_KINDS, FileJob, LineError, World, check_schema, family_call, family_fields,
                         load_file_jobs, model_memo, run_file_batch)
from mmgen.cache import CachePolicy
from mmgen.cli import check_seed

MODALITY = "video"
DEFAULT_MODEL = "emoji-motion"
REQUIRED = {"prompt": "text", "output": "str"}
#: Fields read under an old name until the next release: old -> new (`video` held the prompt).
RENAMED = {"video": "prompt"}
OPTIONAL = {"model": "str", "num_frames": "int", "block_frames": "int", "height": "int", "width": "int",
            "cache_policy": "str", "decoding": "str", "guidance_scale": "float", "negative_prompt": "str",
            "cache_threshold": "float", "drop_threshold": "float", "seed": "int"}
KINDS = {**FIELD_KINDS, "text": ("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))}
DEFAULTS = {"model": DEFAULT_MODEL, "num_frames": None, "block_frames": None, "height": None, "width": None,
            "cache_policy": "global", "decoding": "block", "guidance_scale": None, "negative_prompt": None,
            "cache_threshold": None, "drop_threshold": None, "seed": 0}


class VideoJob(FileJob):
    """One valid line, with its defaults filled in (`fields`)."""

    CALL_FIELDS = ("model", "num_frames", "block_frames", "height", "width", "cache_policy", "decoding",
                   "guidance_scale", "negative_prompt", "cache_threshold", "drop_threshold")
    SUFFIX = ".mp4"


def check_fields(value: Any) -> dict:
    """A job object's fields checked for presence and type, defaults filled in (ValueError); the
    old form's `video` is read as the `prompt`."""
    if isinstance(value, dict):
        for old, new in RENAMED.items():
            if old in value and new in value:
                raise ValueError(f'"{old}" is the old name of "{new}": give only "{new}"')
        value = {RENAMED.get(name, name): v for name, v in value.items()}
    check_schema(value, REQUIRED, OPTIONAL, KINDS, modality=MODALITY)
    fields = {**DEFAULTS, **value, FAMILY_FIELDS: family_fields(value, MODALITY, {**REQUIRED, **OPTIONAL})}
    for name in ("guidance_scale", "cache_threshold", "drop_threshold"):
        fields[name] = None if fields[name] is None else float(fields[name])
    check_seed(fields["seed"])
    CachePolicy.parse(fields["cache_policy"])
    for name in ("cache_threshold", "drop_threshold"):
        if fields[name] is not None and not fields[name] >= 0:
            raise ValueError(f"{name} must be >= 0, got {fields[name]}")
    return fields


def is_old_form(value: dict) -> bool:
    """Whether a job line names a field by its old name (`RENAMED`)."""
    return any(name in value for name in RENAMED)


def old_form_warning(source: Any) -> str:
    """The one line a run whose job file `source` uses the old form prints on stderr."""
    return (f'mmgen batch: {source}: the "video" field of video jobs is now "prompt" with "modality": "video"; '
            "the old form is read until the next release")


@dataclass
class VideoCall:
    """One loaded pipeline with one set of call options (a group's call)."""

    pipe: Any
    options: dict

    def __call__(self, jobs: list[VideoJob], seed: int, device: str):
        from mmgen.sampling import make_generator

        return self.pipe([job.fields["prompt"] for job in jobs], generator=make_generator(seed, device), **self.options)


def prepare_call(pipe, fields: dict, device: str, dtype: torch.dtype) -> VideoCall:
    """The decoder and options of a job key, geometry and specs checked (ValueError) before any work."""
    from mmgen.loading import decoder_from_spec

    from mmgen.video.pipeline import BlockDiffusionVideoPipeline

    if not isinstance(pipe, BlockDiffusionVideoPipeline):
        raise ValueError(f"model {fields['model']!r} holds a {type(pipe).__name__}, not a block-diffusion video model")
    frames = pipe.num_frames if fields["num_frames"] is None else fields["num_frames"]
    block = pipe.block_frames if fields["block_frames"] is None else fields["block_frames"]
    pipe.check_geometry(frames, block, fields["height"] or pipe.height, fields["width"] or pipe.width)
    decoder = decoder_from_spec(fields["decoding"], pipe, fields["model"], device, dtype)
    options = {k: fields[k] for k in ("height", "width", "cache_policy", "guidance_scale", "negative_prompt", "cache_threshold",
                                      "drop_threshold")}
    return VideoCall(pipe, dict(options, num_frames=frames, block_frames=block, decoding=decoder,
                                **family_call(pipe, fields, MODALITY)))


def load_jobs(path: Path, device: str, dtype: torch.dtype) -> tuple[list[VideoJob], dict, list[LineError]]:
    """The valid jobs, the prepared call of each job key, and the bad lines (each model loads once)."""
    from mmgen.loading import load_pipeline
    from mmgen.video.cli import quiet_loaders

    quiet_loaders()

    def load(model: str):
        pipe = load_pipeline(model, device=device, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def check_inputs(job: VideoJob, call: VideoCall) -> None:  # prompts the text encoder would cut
        negative = job.fields["negative_prompt"]
        call.pipe.check_prompts([job.fields["prompt"], *([] if negative is None else [negative])])

    old_form = []  # lines in the old form: one warning for them all

    def check(value: Any) -> dict:
        if isinstance(value, dict) and is_old_form(value):
            old_form.append(value)
        return check_fields(value)

    pipes = model_memo(load)
    loaded = load_file_jobs(path, check, VideoJob, lambda fields: prepare_call(pipes(fields["model"]), fields, device, dtype),
                            check_inputs)
    if old_form and World.from_env().rank == 0:
        print(old_form_warning(path), file=sys.stderr)
    return loaded


def run_batch(args: argparse.Namespace) -> int:
    """Check every line, group, run this rank's share, merge the manifest (rank 0). Exit status
    0, or 1 when some group failed (its files are missing; run again)."""
    from mmgen.video.export import mp4_bytes

    def encode(output, row: int, job: VideoJob, where: dict) -> tuple[bytes, dict]:
        record = {"frames": int(output.frames.shape[1]), "fps": output.fps, "stats": output.stats.to_dict(),
                  "profile": output.profile.to_dict()}
        return mp4_bytes(output.frames[row], output.fps), record

    return run_file_batch(args, load_jobs, encode, renamed=RENAMED)
