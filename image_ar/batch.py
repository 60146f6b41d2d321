"""`mmgen batch` for image jobs: many class-conditional images from a JSONL job file, resumable,
and sharded over the ranks of a torchrun job (`mmgen.batch.run_batch` sends here the files whose
jobs say `"modality": "image"` or, without a modality, name a `class_label`).

    mmgen batch jobs.jsonl --out out/ [--batch-size 8] [--on-error stop|skip] [--device cuda]

One job per line:

    {"model": "emoji64", "class_label": "cat-face", "seed": 0, "decoding": "sjd", "count": 4, "output": "cat"}
    {"model": "emoji64", "class_label": 25, "seed": 100, "decoding": "ar", "count": 2, "output": "mammal", "top_k": 64}
    {"modality": "image", "model": "emoji64", "class_label": 3, "seed": 5, "decoding": "ar", "count": 1, "output": "face"}

Required fields: `model` (a bundled name or a pipeline folder), `class_label` (id or name),
`seed` (integer >= 0), `decoding` (a `generate image --decoding` spec for that model), `count`
(1 to 10000 images) and `output` (a file-name stem of letters, digits, '.', '_' and '-', unique
in the file; image k is `<out>/<output>_<kkk>.png`). Optional, as the `mmgen generate image`
flags of the same name: guidance_scale, temperature, top_k, top_p, window (Jacobi decoders), and
each option of an image family's record (`mmgen.image_ar`, `registry.family_options("image")`):
cfg_interval (LlamaGen); preset, more_smooth (true or false), pruning, pruning_layers ([start,
stop]) (VAR); num_iter, cfg_schedule (MAR); `modality` ("image", the only value it may take
here). Every line is checked before any work (JSON, fields, types, the model loads, the class
exists, the decoding and sampling options suit the model, output names): `--on-error stop`
(default) lists the bad lines and runs nothing, `--on-error skip` runs the rest.

Groups and seeds. Row k of a job (its k-th image) has seed `seed + k`. Rows of jobs with the
same model and options (decoding, sampling) are packed in file order into groups of up to
`--batch-size` rows, and each group is one pipeline call with one generator, seeded from the
seeds of all its rows (`group_seed`: a group of one row uses that row's seed, a larger group a
hash of its rows' seeds), so every job's seed changes its images. A pipeline call draws its
rows' randomness from that one generator, so an image depends on its own seed *and* on the rows
it is batched with: it is reproduced by its group's command, not by its seed alone, and another
`--batch-size` gives other images (default 8: each forward serves several rows, while a failed
or interrupted group loses at most 8 images; raise it where memory allows). With
`--batch-size 1` row k of a job equals `mmgen generate image --seed <seed + k>` with its class
and options. Groups are formed from the whole job file, before sharding and before skipping
finished work, so an image never depends on the world size or on resumption. Every manifest
record carries its group (the generator's seed, class ids, member files, position), the
`mmgen generate image` command that regenerates that group and, as `command_file`, the name
that command gives this row's image.

Continuous batching (`--continuous`; LlamaGen models; `ar` and the sjd family, `sjd`,
`lantern`, ..., each row choosing its own adaptive window or a fixed one). Groups of up to 16 x `--batch-size` rows are
the unit of sharding and failure; within one, `--batch-size` rows decode at a time and a row
that finishes takes the next waiting row at once (`mmgen.decoding.batching`). Every row draws
from its own generator (seed `seed + k`) and is prefilled alone, so its image is the one
`mmgen generate image --seed <seed + k>` makes with its class and options, whatever rows it
shared forwards with (under the adaptive window, with `batch_rows=<batch size>` added to its
decoding spec: rows judge widths at what they cost the batch, `mmgen.decoding.row_spec`); its
record holds that command (`command`, `command_file`) and its own decode stats. Each image is written as soon as it is decoded, so a failure or a kill loses only
the images still decoding.

Outputs and resume. Files are written atomically, then recorded with their sha256 and the
call's DecodeStats in a per-rank manifest part; at the end rank 0 merges the parts into
`<out>/manifest.jsonl` (one record per image, in job order). Running the same command again
skips every image whose record matches its file's checksum and whose job is unchanged; a group
with some images missing is run again and writes only the missing ones (see `mmgen.batch`).
Jobs added to the file, or another `--batch-size`, keep the finished images (each record says
how its own image was made); an edited job's images are made again; records of jobs no longer
in the file are left out of manifest.jsonl (their files stay). The summary's total rate divides
by the wall time, model loading included.

Several GPUs or nodes (torchrun; each rank takes groups g with g % WORLD_SIZE == RANK):

    torchrun --nproc_per_node 8 -m mmgen.cli batch jobs.jsonl --out out/ --device cuda
    # N nodes, static rendezvous: run on every node with its own --node_rank
    torchrun --nnodes N --node_rank I --nproc_per_node 8 --master_addr HEAD --master_port 29500 \\
        -m mmgen.cli batch jobs.jsonl --out /shared/out --device cuda
    # or elastic rendezvous, the same command on every node
    torchrun --nnodes N --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HEAD:29500 --rdzv_id run1 \\
        -m mmgen.cli batch jobs.jsonl --out /shared/out --device cuda

Across nodes `--out` must be one shared folder (NFS, Lustre, ...) and the job file and models
must be at the same paths everywhere. `--device cuda` gives each rank its LOCAL_RANK's GPU and
the nccl backend; CPU runs use gloo. Re-running with another world size resumes the same way.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mmgen.batch import (CONTINUOUS_GROUP_BATCHES, FIELD_KINDS, GroupRun, LineError, Memo, check_schema, claim_output,
                         family_fields, form_groups, group_seed, model_memo, read_jsonl, run_groups, start_run)
from mmgen.cli import check_seed
from mmgen.decoding import row_spec

from mmgen.image_ar.generation import (
    ImageOptions,
    image_file_names,
    load_image_pipeline,
    png_bytes,
    prepare_call,
)

MODALITY = "image"
MAX_COUNT = 10_000
#: field -> expected kind; the optional ones are the options every image model takes (`ImageOptions`'
#: `COMMON_OPTIONS`; decoding is required). The families' options are fields too, checked by their
#: records (`check_schema`).
REQUIRED = {"model": "str", "class_label": "label", "seed": "int", "decoding": "str", "count": "int", "output": "str"}
OPTIONAL = {"window": "int", "guidance_scale": "float", "temperature": "float", "top_k": "int", "top_p": "float"}
KINDS = {
    **FIELD_KINDS,
    "label": ("a class id or name", lambda v: isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))),
}


# --------------------------------------------------------------------------------------------
# Jobs: checked lines of the job file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ImageJob:
    """One valid line: `spec` is the line's JSON object as written (what a manifest record
    must match for its image to count as finished)."""

    line: int
    spec: dict
    class_id: int
    options: ImageOptions

    @property
    def key(self) -> tuple[str, ImageOptions]:
        """Jobs of one key can share a pipeline call."""
        return self.spec["model"], self.options

    @property
    def category(self) -> tuple[str, str]:
        return self.spec["model"], self.spec["decoding"]

    def file(self, index: int) -> str:
        return f"{self.spec['output']}_{index:03d}.png"


@dataclass(frozen=True)
class Row:
    """Image `index` of a job."""

    job: ImageJob
    index: int

    @property
    def seed(self) -> int:
        return self.job.spec["seed"] + self.index

    @property
    def file(self) -> str:
        return self.job.file(self.index)

    @property
    def order(self) -> tuple[int, int]:
        """Its place in the manifest: job order, then row."""
        return self.job.line, self.index


def check_fields(value: Any) -> dict:
    """A job object's fields checked for presence and type (ValueError otherwise)."""
    check_schema(value, REQUIRED, OPTIONAL, KINDS, modality=MODALITY)
    if not 1 <= value["count"] <= MAX_COUNT:
        raise ValueError(f"count must be in [1, {MAX_COUNT}], got {value['count']}")
    check_seed(value["seed"])
    check_seed(value["seed"] + value["count"] - 1, f"the last row's seed (seed + count - 1 = {value['seed']} + {value['count'] - 1})")
    return value


def options_of(spec: dict) -> ImageOptions:
    """A job's options as `generate image` parses its flags (numbers of float fields as floats)."""
    given = {k: float(spec[k]) if OPTIONAL[k] == "float" else spec[k] for k in OPTIONAL if k in spec}
    family = family_fields(spec, MODALITY, {**REQUIRED, **OPTIONAL})  # the families' options, by their records
    return ImageOptions.from_values({"decoding": spec["decoding"], **given, **family})


def load_jobs(path: Path, device: str, dtype: torch.dtype, continuous: bool = False) -> tuple[list[ImageJob], dict, list[LineError]]:
    """The valid jobs of a job file, the prepared call of each job key, and the bad lines.
    Loads each model the file names once (on `device`), as generation will use them.
    `continuous`: a job must also suit continuous batching (`--continuous`)."""
    values, errors = read_jsonl(path)
    checked, owners = [], {}
    for line, value in values:
        try:
            spec = check_fields(value)
            claim_output(owners, spec["output"], line)
            checked.append((line, spec))
        except ValueError as error:
            errors.append(LineError(line, str(error)))

    def load(model):
        pipe = load_image_pipeline(model, device, dtype)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    pipes = model_memo(load)
    calls = Memo(lambda key: prepare_call(pipes(key[0]), key[0], key[1], device, dtype))
    jobs = []
    for line, spec in checked:
        try:
            options = options_of(spec)
            call = calls((spec["model"], options))
            if continuous:
                call.check_continuous()
            jobs.append(ImageJob(line, spec, call.pipe.class_index(spec["class_label"]), options))
        except ValueError as error:
            errors.append(LineError(line, str(error)))
    return jobs, calls.loaded(), errors


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


#: `--continuous`: this runner refills rows as they finish (`mmgen.batch.run_batch` asks).
CONTINUOUS = True


def run_batch(args: argparse.Namespace) -> int:
    """Check every line, plan the groups, run this rank's share, merge the manifest (rank 0).
    Exit status 0, or 1 when some group failed (its images are missing; run again)."""
    continuous = getattr(args, "continuous", False)
    run = start_run(args, lambda path, device, dtype: load_jobs(path, device, dtype, continuous))
    world, device, jobs, calls, errors = run.world, run.device, run.jobs, run.calls, run.errors
    rows = [Row(job, k) for job in jobs for k in range(job.spec["count"])]
    size = args.batch_size * (CONTINUOUS_GROUP_BATCHES if continuous else 1)
    groups = form_groups(rows, key=lambda row: row.job.key, size=size)
    if args.dry_run:
        if world.rank == 0:
            print(f"{len(jobs)} valid job(s), {len(rows)} image(s) in {len(groups)} group(s) of up to {size}; "
                  f"{len(errors)} invalid line(s)")
        return 0

    def run_group(g: int, rows: list[Row], run: GroupRun) -> None:
        """Generate group `g` in one call and write the images it still lacks."""
        call = calls[rows[0].job.key]
        group = {"index": g, "seed": group_seed([row.seed for row in rows]), "class_ids": [row.job.class_id for row in rows],
                 "members": [row.file for row in rows]}
        group["command"] = reproduce_command(rows, group["seed"], args)
        command_files = image_file_names(group["class_ids"], rows[0].job.spec["model"], group["seed"], rows[0].job.options,
                                         call.spec)
        output = call(group["class_ids"], group["seed"], device)
        if len(output.images) != len(rows):
            raise RuntimeError(f"the pipeline returned {len(output.images)} images for {len(rows)} rows")
        stats = output.stats.to_dict(per_forward=False)
        todo = {row.file for row in run.todo}
        for position, (row, image) in enumerate(zip(rows, output.images)):
            if row.file in todo:
                run.record(row, png_bytes(image), {"index": row.index, "class_id": row.job.class_id,
                                                   "group": {**group, "row": position},
                                                   "command_file": command_files[position], "stats": stats})

    def run_continuous(g: int, rows: list[Row], run: GroupRun) -> None:
        """Generate the images group `g` still lacks, `--batch-size` rows at a time, each from
        its own seed, writing each as soon as it is decoded."""
        call, todo = calls[rows[0].job.key], run.todo
        model = rows[0].job.spec["model"]
        # Each row decodes as alone with the rows' window policy (`row_spec`: the adaptive
        # window judged at what it costs the batch), which its command names.
        spec = row_spec(call.spec, args.batch_size)

        def write(i: int, image, stats) -> None:
            row = todo[i]
            options = replace(row.job.options, decoding=spec) if spec != call.spec else row.job.options
            run.record(row, png_bytes(image), {
                "index": row.index, "class_id": row.job.class_id, "seed": row.seed,
                "command": reproduce_command([row], row.seed, args, options),
                "command_file": image_file_names([row.job.class_id], model, row.seed, options, spec)[0],
                "stats": stats.to_dict(per_forward=False)})

        call.each([row.job.class_id for row in todo], [row.seed for row in todo], device, args.batch_size, write)

    return run_groups(world, device, Path(args.out), jobs, groups, run_continuous if continuous else run_group,
                      started=run.started, invalid_lines=len(errors), progress=not args.no_progress)


def reproduce_command(rows: list[Row], seed: int, args: argparse.Namespace, options: Any = None) -> str:
    """The `mmgen generate image` command that regenerates a group (it names its images by
    `generation.image_file_names`; each record holds its own as `command_file`), with the job's
    options or `options`."""
    job = rows[0].job
    options = options or job.options
    command = ["mmgen", "generate", "image", "--model", job.spec["model"], *options.flags(), "--seed", str(seed),
               "--class-labels", *(str(row.job.class_id) for row in rows), "--out", "OUT"]
    command += [] if args.device == "cpu" else ["--device", args.device]
    command += [] if args.dtype == "float32" else ["--dtype", args.dtype]
    return shlex.join(command)

