"""`mmgen batch`: many class-conditional images from a JSONL job file, resumable, and sharded
over the ranks of a torchrun job.

    mmgen batch jobs.jsonl --out out/ [--batch-size 8] [--on-error stop|skip] [--device cuda]

One job per line:

    {"model": "emoji64", "class_label": "cat-face", "seed": 0, "decoding": "sjd", "count": 4, "output": "cat"}
    {"model": "emoji64", "class_label": 25, "seed": 100, "decoding": "ar", "count": 2, "output": "mammal", "top_k": 64}

Required fields: `model` (a bundled name or a pipeline folder), `class_label` (id or name),
`seed` (integer >= 0), `decoding` (a `generate image --decoding` spec for that model), `count`
(1 to 10000 images) and `output` (a file-name stem of letters, digits, '.', '_' and '-',
unique in the file; image k is `<out>/<output>_<kkk>.png`). Optional, as the `mmgen generate
image` flags of the same name: guidance_scale, temperature, top_k, top_p, cfg_interval, window
(LlamaGen); preset, more_smooth (true), pruning, pruning_layers ([start, stop]) (VAR);
num_iter, cfg_schedule (MAR). Every line is checked before any work (JSON, fields, types, the
model loads, the class exists, the decoding and sampling options suit the model, output names):
`--on-error stop` (default) lists the bad lines and runs nothing, `--on-error skip` runs the rest.

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
import hashlib
import json
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from mmgen.batch import (
    ON_ERROR,
    LineError,
    ManifestWriter,
    Tally,
    World,
    check_lines,
    form_groups,
    merge_manifest,
    process_group,
    progress_bar,
    read_jsonl,
    read_records,
    verified_records,
)

from mmgen.cli import DTYPES, check_seed
from mmgen.files import remove_stale_temp_files, write_atomic

from mmgen.image_ar.generation import (
    ImageCall,
    ImageOptions,
    image_file_names,
    load_image_pipeline,
    png_bytes,
    prepare_call,
)

DEFAULT_BATCH_SIZE = 8
MAX_COUNT = 10_000
OUTPUT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: field -> expected kind; the optional ones are ImageOptions' fields (decoding is required).
REQUIRED = {"model": "str", "class_label": "label", "seed": "int", "decoding": "str", "count": "int", "output": "str"}
OPTIONAL = {"window": "int", "guidance_scale": "float", "cfg_interval": "int", "temperature": "float", "top_k": "int",
            "top_p": "float", "preset": "str", "more_smooth": "true", "pruning": "str", "pruning_layers": "pair",
            "num_iter": "int", "cfg_schedule": "str"}
KINDS = {"str": "a string", "int": "an integer", "float": "a number", "label": "a class id or name",
         "true": "true (omit it for the default)", "pair": "a list of two integers"}


def register(commands, groups) -> None:
    batch = commands.add_parser("batch", help="generate images from a JSONL job file (resumable; torchrun for many GPUs)",
                                description="Class-conditional images from a JSONL job file. See `mmgen.image_ar.batch` "
                                            "for the job fields, grouping, resume and multi-node use.")
    batch.add_argument("jobs", help="JSONL file, one job per line")
    batch.add_argument("--out", required=True, help="output folder: images and manifest.jsonl")
    batch.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                       help=f"images per pipeline call, from jobs of one model and options (default {DEFAULT_BATCH_SIZE})")
    batch.add_argument("--on-error", default="stop", choices=ON_ERROR,
                       help="invalid lines: stop before any work (default) or skip them and run the rest")
    batch.add_argument("--device", default="cpu", help="cpu (default) or cuda (under torchrun: each rank's LOCAL_RANK GPU)")
    batch.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    batch.add_argument("--dry-run", action="store_true", help="check the job file and print the plan; generate nothing")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    batch.set_defaults(run=run_batch)


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


def check_fields(value: Any) -> dict:
    """A job object's fields checked for presence and type (ValueError otherwise)."""
    if not isinstance(value, dict):
        raise ValueError(f"a job must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(REQUIRED)} and optional {sorted(OPTIONAL)}")
    missing = [k for k in REQUIRED if k not in value]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    for name, kind in {**REQUIRED, **OPTIONAL}.items():
        if name in value and not _is_kind(value[name], kind):
            raise ValueError(f"{name} must be {KINDS[kind]}, got {json.dumps(value[name])}")
    if not 1 <= value["count"] <= MAX_COUNT:
        raise ValueError(f"count must be in [1, {MAX_COUNT}], got {value['count']}")
    check_seed(value["seed"])
    check_seed(value["seed"] + value["count"] - 1, f"the last row's seed (seed + count - 1 = {value['seed']} + {value['count'] - 1})")
    name = value["output"]
    if not OUTPUT_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"output {name!r} is not a safe file-name stem: 1 to 128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit, without '..' (no folders)")
    return value


def _is_kind(value: Any, kind: str) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return {
        "str": isinstance(value, str),
        "int": is_int,
        "float": is_int or (isinstance(value, float) and math.isfinite(value)),
        "label": is_int or isinstance(value, str),
        "true": value is True,
        "pair": isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
    }[kind]


def options_of(spec: dict) -> ImageOptions:
    """A job's options as `generate image` parses its flags (numbers of float fields as floats)."""
    given = {k: float(spec[k]) if OPTIONAL[k] == "float" else spec[k] for k in OPTIONAL if k in spec}
    if "pruning_layers" in given:
        given["pruning_layers"] = tuple(given["pruning_layers"])
    return ImageOptions(decoding=spec["decoding"], **given)


class _Memo:
    """Results (or the error message) of a loader per key: each model loads once, and every line
    that names a broken one gets the same message."""

    def __init__(self, load):
        self.load, self.results = load, {}

    def __call__(self, key):
        if key not in self.results:
            try:
                self.results[key] = (True, self.load(key))
            except Exception as error:  # any failure makes the lines that use it invalid
                self.results[key] = (False, str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}")
        ok, result = self.results[key]
        if not ok:
            raise ValueError(result)
        return result


def load_jobs(path: Path, device: str, dtype: torch.dtype) -> tuple[list[ImageJob], dict, list[LineError]]:
    """The valid jobs of a job file, the prepared call of each job key, and the bad lines.
    Loads each model the file names once (on `device`), as generation will use them."""
    values, errors = read_jsonl(path)
    checked, owners = [], {}
    for line, value in values:
        try:
            spec = check_fields(value)
            owner = owners.setdefault(spec["output"].casefold(), line)
            if owner != line:
                raise ValueError(f"output {spec['output']!r} is already used by line {owner}")
            checked.append((line, spec))
        except ValueError as error:
            errors.append(LineError(line, str(error)))

    def load(model):
        try:
            pipe = load_image_pipeline(model, False, device, dtype)
        except Exception as error:
            raise ValueError(f"cannot load model {model!r}: {error}") from error
        pipe.set_progress_bar_config(disable=True)
        return pipe

    pipes = _Memo(load)
    calls = _Memo(lambda key: prepare_call(pipes(key[0]), key[0], key[1], device, dtype))
    jobs = []
    for line, spec in checked:
        try:
            options = options_of(spec)
            call = calls((spec["model"], options))
            jobs.append(ImageJob(line, spec, call.pipe.class_index(spec["class_label"]), options))
        except ValueError as error:
            errors.append(LineError(line, str(error)))
    return jobs, {key: ok_call for key, (ok, ok_call) in calls.results.items() if ok}, errors


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run_batch(args: argparse.Namespace) -> int:
    """Check every line, plan the groups, run this rank's share, merge the manifest (rank 0).
    Exit status 0, or 1 when some group failed (its images are missing; run again)."""
    started = time.perf_counter()
    world = World.from_env()
    device, dtype = world.device(args.device), getattr(torch, args.dtype)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    jobs, calls, errors = load_jobs(Path(args.jobs), device, dtype)
    check_lines(errors, args.on_error, args.jobs, quiet=world.rank > 0)
    if not jobs:
        raise ValueError(f"{args.jobs} has no job to run")
    rows = [Row(job, k) for job in jobs for k in range(job.spec["count"])]
    groups = form_groups(rows, key=lambda row: row.job.key, size=args.batch_size)
    if args.dry_run:
        if world.rank == 0:
            print(f"{len(jobs)} valid job(s), {len(rows)} image(s) in {len(groups)} group(s) of up to {args.batch_size}; "
                  f"{len(errors)} invalid line(s)")
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = {row.file: row for row in rows}

    def current(record: dict) -> Optional[dict]:
        """A record still describes its file if its job is unchanged; line numbers follow the file."""
        row = plan.get(record["file"])
        if row is None or record.get("spec") != row.job.spec:
            return None
        return {**record, "line": row.job.line}

    with process_group(world, device):
        mine = [g for g in range(len(groups)) if world.owns(g)]
        done = verified_records(out, read_records(out), {row.file for g in mine for row in groups[g]}, current)
        if world.rank == 0:
            remove_stale_temp_files(out)  # nobody writes before the barrier
        world.barrier()
        tally = Tally([job.category for job in jobs])
        pending = sum(row.file not in done for g in mine for row in groups[g])
        with ManifestWriter(out, world.rank) as manifest, progress_bar(
            pending, enabled=world.rank == 0 and not args.no_progress,
            desc="batch" if world.world_size == 1 else f"batch (rank 0 of {world.world_size})",
        ) as bar:
            run = _RankRun(out, done, tally, {job: i for i, job in enumerate(jobs)}, device, args, world, manifest, bar)
            for g in mine:
                run.group(g, groups[g], calls[groups[g][0].job.key])
        world.barrier()
        tally.reduce(world)
        if world.rank == 0:
            path, records = merge_manifest(out, order=lambda r: (plan[r["file"]].job.line, plan[r["file"]].index), current=current)
            summary = tally.summary(("model", "decoding"), time.perf_counter() - started, invalid_lines=len(errors))
            print(summary.table())
            print(json.dumps({"summary": summary.to_dict(), "manifest": str(path), "records": records}))
    return 1 if tally.failed else 0


@dataclass
class _RankRun:
    """One rank's work: where images and records go, what was finished before, what happens now."""

    out: Path
    done: dict
    tally: Tally
    job_index: dict
    device: str
    args: argparse.Namespace
    world: World
    manifest: ManifestWriter
    bar: Any

    def group(self, g: int, rows: list[Row], call: ImageCall) -> None:
        """Generate group `g` in one call and write the images it still lacks; a failure is
        reported and counted, and the run goes on."""
        todo = [row for row in rows if row.file not in self.done]
        for row in rows:
            if row.file in self.done:
                self.tally.add(self.job_index[row.job], existing=1)
        if not todo:
            return
        started, written = time.perf_counter(), set()
        group = {"index": g, "seed": group_seed(rows), "class_ids": [row.job.class_id for row in rows],
                 "members": [row.file for row in rows]}
        group["command"] = reproduce_command(rows, group["seed"], self.args)
        command_files = image_file_names(group["class_ids"], rows[0].job.spec["model"], group["seed"], rows[0].job.options,
                                         call.pipe.default_decoding)
        try:
            output = call(group["class_ids"], group["seed"], self.device)
            if len(output.images) != len(rows):
                raise RuntimeError(f"the pipeline returned {len(output.images)} images for {len(rows)} rows")
            stats = output.stats.to_dict()
            del stats["accepted_per_forward"]  # one float per forward, repeated in every row's record: the histogram suffices
            for position, (row, image) in enumerate(zip(rows, output.images)):
                if row.file in self.done:
                    continue
                data = png_bytes(image)
                sha256 = write_atomic(self.out / row.file, data)
                self.manifest.append({
                    "file": row.file, "sha256": sha256, "bytes": len(data), "line": row.job.line, "index": row.index,
                    "spec": row.job.spec, "class_id": row.job.class_id, "group": {**group, "row": position},
                    "command_file": command_files[position], "stats": stats, "rank": self.world.rank, "world_size": self.world.world_size,
                })
                written.add(row.file)
                self.tally.add(self.job_index[row.job], written=1)
                self.bar.update(1)
        except Exception as error:  # never stop midway: report, count, go on with the next group
            lines = ", ".join(map(str, sorted({row.job.line for row in rows})))
            self.bar.write(f"mmgen batch: group {g} (lines {lines}) failed: {type(error).__name__}: {error}", file=sys.stderr)
            for row in todo:
                if row.file not in written:
                    self.tally.add(self.job_index[row.job], failed=1)
        self.tally.add_seconds(rows[0].job.category, time.perf_counter() - started)


def group_seed(rows: list[Row]) -> int:
    """The seed of a group's generator: a lone row's own seed (so `--batch-size 1` reproduces
    `generate image --seed`), else the first 63 bits of a sha256 of every row's seed, in order."""
    if len(rows) == 1:
        return rows[0].seed
    digest = hashlib.sha256(",".join(str(row.seed) for row in rows).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def reproduce_command(rows: list[Row], seed: int, args: argparse.Namespace) -> str:
    """The `mmgen generate image` command that regenerates a group (it names its images by
    `generation.image_file_names`; each record holds its own as `command_file`)."""
    job = rows[0].job
    command = ["mmgen", "generate", "image", "--model", job.spec["model"], *job.options.flags(), "--seed", str(seed),
               "--class-labels", *(str(row.job.class_id) for row in rows), "--out", "OUT"]
    command += [] if args.device == "cpu" else ["--device", args.device]
    command += [] if args.dtype == "float32" else ["--dtype", args.dtype]
    return shlex.join(command)

