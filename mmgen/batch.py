"""Batch-run machinery that knows no modality: line-numbered JSONL job files, atomic output
files, per-rank manifests that make a run resumable, deterministic grouping and sharding over
torch.distributed ranks, and the progress bar and summary table.

`mmgen batch JOBS --out DIR` is registered here: it reads the job file, picks its modality and
hands the run to that modality's `run_batch` (`registry.batch_runners()`: "image", "text" for
answers about images and videos, "speech", "video"), which validates its own job schema and runs
its pipelines; everything else here is shared so that every modality resumes, shards and reports
the same way. A job line says its modality in a `modality` field; a line without one is told by
the field that marks it (`registry.batch_markers()`: `class_label` -> image, `prompt` -> text,
`text` -> speech), so a video job, whose prompt is a `prompt` too, needs `"modality": "video"`.
A file holds jobs of one modality. Besides its modality's fields, a job may give the options its
model's family declares in its record (`registry.family_options`: VibeVoice's `final_std`, a
plugin's own), checked by `check_schema` and refused by a model of another family.

Durability contract. An output is written to a temp file in its own folder, fsynced and renamed
over its final name (`write_atomic`): it is either absent or complete. Only then is its record
appended, fsynced, to this rank's manifest part `manifest.rank{R}.jsonl`. An output counts as
finished when a manifest record (merged file or any part) names it and its sha256 matches the
file on disk, so a run killed at any point, even by SIGKILL, resumes without a corrupt, missing
or duplicated output: a file written but not yet recorded is simply written again. At the end
rank 0 merges every part into `manifest.jsonl` (one record per output, in job order) and
removes the parts. The done-set never depends on which rank wrote a record, so the world size
may change between runs.

Not supported: two independent runs writing into one folder at the same time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, ClassVar, Collection, Hashable, Iterator, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from mmgen import registry
from mmgen.files import fsync_dir, open_append, remove_stale_temp_files, sha256_file, write_atomic

MANIFEST = "manifest.jsonl"
DEFAULT_BATCH_SIZE = 8
ON_ERROR = ("stop", "skip")
#: Ranks wait at barriers for the slowest one; a crashed rank is torn down by torchrun anyway.
DIST_TIMEOUT = timedelta(days=1)

PathLike = Union[str, os.PathLike]
T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Job files: JSON lines with their line numbers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineError:
    """Why line `line` (1-based) of a job file cannot run."""

    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


def read_jsonl(path: PathLike) -> tuple[list[tuple[int, Any]], list[LineError]]:
    """The non-blank lines of a JSONL file as (line number, value), and the lines that are not
    strict JSON (NaN/Infinity and repeated keys are refused: a typo should not run silently)."""
    values, errors = [], []
    for number, raw in enumerate(Path(path).read_bytes().splitlines(), start=1):
        try:
            text = raw.decode("utf-8")
            if text.strip():
                values.append((number, json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)))
        except UnicodeDecodeError:
            errors.append(LineError(number, "not UTF-8 text"))
        except ValueError as error:  # json.JSONDecodeError is a ValueError
            errors.append(LineError(number, f"invalid JSON: {error}"))
    return values, errors


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"field(s) {repeated} given twice")
    return dict(pairs)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Field kinds of job schemas: kind -> (what a value must be, its test). Modalities add theirs.
FIELD_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", _is_int),
    "float": ("a number", lambda v: _is_int(v) or (isinstance(v, float) and math.isfinite(v))),
}
OUTPUT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The field in which a job line names its modality ("image", "text", ...: `registry.batch_runners`).
MODALITY_FIELD = "modality"


def check_schema(value: Any, required: dict[str, str], optional: dict[str, str],
                 kinds: dict[str, tuple[str, Callable[[Any], bool]]] = FIELD_KINDS, modality: Optional[str] = None) -> dict:
    """A job object's fields checked for presence and kind (`required` / `optional`: field ->
    kind), and its `output` for a safe file-name stem; ValueError otherwise. A runner gives its
    `modality` name: a job may then say it in a `modality` field (any other value is an error), and
    give the options its registered families declare (`registry.family_options`), each checked by
    its record (`Option.check`, the wording every surface uses)."""
    if not isinstance(value, dict):
        raise ValueError(f"a job must be a JSON object, got {type(value).__name__}")
    if modality is not None:
        if value.get(MODALITY_FIELD, modality) != modality:
            raise ValueError(f"{MODALITY_FIELD} must be {json.dumps(modality)} in a file of {modality} jobs, "
                             f"got {json.dumps(value[MODALITY_FIELD])}")
        optional = {**optional, MODALITY_FIELD: "str"}
    family = {name: option for name, option in registry.family_options(modality).items()
              if name not in required and name not in optional} if modality is not None else {}
    unknown = sorted(set(value) - set(required) - set(optional) - set(family))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(required)} and optional {sorted([*optional, *family])}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    for name, kind in {**required, **optional}.items():
        what, test = kinds[kind]
        if name in value and not test(value[name]):
            raise ValueError(f"{name} must be {what}, got {json.dumps(value[name])}")
    for name, option in family.items():
        if name in value:
            option.check(value[name])
    name = value.get("output")
    if isinstance(name, str) and (not OUTPUT_NAME.fullmatch(name) or ".." in name):
        raise ValueError(f"output {name!r} is not a safe file-name stem: 1 to 128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit, without '..' (no folders)")
    return value


#: The `fields` entry of a checked job that holds its family options (`family_fields`); part of
#: a `FileJob`'s key, so that only jobs of equal options share a call.
FAMILY_FIELDS = "family_options"


def family_fields(value: dict, modality: str, own: Collection[str]) -> dict:
    """The options of `modality`'s registered families that a job line (checked by `check_schema`)
    gives, but for the modality's `own` fields (which pass such a keyword already), as call
    keywords' values (a float option's integer as a float)."""
    options = registry.family_options(modality)
    return {name: options[name].check(v) for name, v in value.items() if name in options and name not in own}


def family_call(pipe: Any, fields: dict, modality: str) -> dict:
    """A job's family options (`fields[FAMILY_FIELDS]`) as keywords of `pipe`'s call, once the
    loaded model's family declares each (`registry.family_call_options`; ValueError otherwise)."""
    return registry.family_call_options(modality, registry.pipeline_family(pipe), fields.get(FAMILY_FIELDS, {}))


class Memo:
    """Results (or the error message) of a loader per key: each model loads once, and every line
    that names a broken one gets the same message (a ValueError naming it)."""

    def __init__(self, load: Callable[[Any], Any]):
        self.load, self.results = load, {}

    def __call__(self, key: Any) -> Any:
        if key not in self.results:
            try:
                self.results[key] = (True, self.load(key))
            except Exception as error:  # any failure makes the lines that use it invalid
                self.results[key] = (False, str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}")
        ok, result = self.results[key]
        if not ok:
            raise ValueError(result)
        return result

    def loaded(self) -> dict:
        """Key -> result, for the keys that loaded."""
        return {key: result for key, (ok, result) in self.results.items() if ok}


def model_memo(load: Callable[[Any], Any]) -> Memo:
    """A `Memo` of the models a job file names: each loads once through `load`, and one that
    fails is the ValueError "cannot load model NAME: why" on every line that names it."""

    def guarded(model):
        try:
            return load(model)
        except Exception as error:
            raise ValueError(f"cannot load model {model!r}: {error}") from error

    return Memo(guarded)


def claim_output(owners: dict[str, int], name: str, line: int) -> None:
    """ValueError when another line already writes the output `name` (case-insensitively: some
    file systems fold case); else `line` owns it."""
    owner = owners.setdefault(name.casefold(), line)
    if owner != line:
        raise ValueError(f"output {name!r} is already used by line {owner}")


def check_lines(errors: Sequence[LineError], on_error: str, source: PathLike, quiet: bool = False) -> None:
    """Act on a job file's bad lines before any work starts: "stop" raises a ValueError naming
    every bad line; "skip" reports them on stderr (unless `quiet`, e.g. on ranks > 0)."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if not errors:
        return
    errors = sorted(errors, key=lambda e: e.line)
    if on_error == "stop":
        listing = "\n".join(f"  {e}" for e in errors)
        raise ValueError(f"{len(errors)} invalid line(s) in {source}; nothing was run (--on-error skip runs the others):\n{listing}")
    for error in errors if not quiet else ():
        print(f"mmgen batch: skipping {source} {error}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Manifests: one part per rank, merged by rank 0
# --------------------------------------------------------------------------------------------


def part_path(folder: PathLike, rank: int) -> Path:
    return Path(folder) / f"manifest.rank{rank}.jsonl"


class ManifestWriter:
    """Appends records (dicts with at least "file" and "sha256") to one rank's manifest part,
    one fsynced JSON line each. A line cut short by a kill is dropped when the part is reopened,
    so the next record starts on a line of its own."""

    def __init__(self, folder: PathLike, rank: int):
        self.path = part_path(folder, rank)
        self._file = open_append(self.path)  # never through a link planted in the folder
        _drop_partial_tail(self._file)
        fsync_dir(self.path.parent)

    def append(self, record: dict) -> None:
        self._file.write(json.dumps(record, sort_keys=True, allow_nan=False).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ManifestWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_partial_tail(file) -> None:
    file.seek(0)
    data = file.read()
    if data and not data.endswith(b"\n"):
        file.truncate(data.rfind(b"\n") + 1)
        os.fsync(file.fileno())


def read_records(folder: PathLike) -> list[dict]:
    """Every record of the merged manifest and of all parts (any world size), oldest source
    first; lines that do not parse (a kill mid-append) are ignored."""
    folder = Path(folder)
    parts = sorted(folder.glob("manifest.rank*.jsonl"), key=lambda p: _rank_of(p.name))
    records = []
    for path in [folder / MANIFEST, *parts]:
        if not path.is_file():
            continue
        for line in path.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("file"), str) and isinstance(record.get("sha256"), str):
                records.append(record)
    return records


def _rank_of(name: str) -> int:
    match = re.fullmatch(r"manifest\.rank(\d+)\.jsonl", name)
    return int(match.group(1)) if match else -1


def job_identity(spec: Any, renamed: Optional[dict[str, str]] = None) -> Any:
    """What resume compares of a job line and a manifest record's `spec` to tell an unchanged
    job: its fields but `modality` (which only says which runner reads it), the fields a runner
    still reads under an old name (`renamed`: old -> new) under their new one, so that neither
    naming the modality nor moving to the new names makes finished outputs again."""
    if not isinstance(spec, dict):
        return spec
    renamed = renamed or {}
    return {renamed.get(name, name): v for name, v in spec.items() if name != MODALITY_FIELD}


def verified_records(
    folder: PathLike,
    records: Sequence[dict],
    files: Optional[Collection[str]] = None,
    current: Optional[Callable[[dict], Optional[dict]]] = None,
) -> dict[str, dict]:
    """file name -> its record, for the outputs that are finished: a record names the file (one
    of `files`, when given), `current` keeps it (returns the record, possibly updated, or None to
    drop it: e.g. its job was edited since) and its sha256 matches the file on disk. Among
    several matching records of one file the last one wins."""
    folder, hashes, done = Path(folder), {}, {}
    for record in records:
        name = record["file"]
        if (files is not None and name not in files) or Path(name).name != name:
            continue
        record = current(record) if current is not None else record
        if record is None:
            continue
        if name not in hashes:
            path = folder / name
            hashes[name] = sha256_file(path) if path.is_file() else None
        if hashes[name] == record["sha256"]:
            done[name] = record
    return done


def merge_manifest(
    folder: PathLike,
    order: Callable[[dict], Any],
    current: Optional[Callable[[dict], Optional[dict]]] = None,
) -> tuple[Path, int]:
    """Rank 0, after the last barrier: the verified records of every source, one per file,
    sorted by `order`, written atomically to `manifest.jsonl`; then the parts are removed.
    Returns the manifest's path and its number of records."""
    folder = Path(folder)
    records = sorted(verified_records(folder, read_records(folder), current=current).values(), key=order)
    text = "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in records)
    write_atomic(folder / MANIFEST, text.encode())
    for part in folder.glob("manifest.rank*.jsonl"):
        part.unlink()
    return folder / MANIFEST, len(records)


# --------------------------------------------------------------------------------------------
# Grouping and sharding
# --------------------------------------------------------------------------------------------


def group_seed(seeds: Sequence[int]) -> int:
    """The seed of a group call's one generator: a lone row's own seed (so `--batch-size 1`
    reproduces `mmgen generate ... --seed`), else the first 63 bits of a sha256 of every row's
    seed, in order (so every row's seed, and the order, change the group's outputs)."""
    seeds = [int(s) for s in seeds]
    if len(seeds) == 1:
        return seeds[0]
    digest = hashlib.sha256(",".join(map(str, seeds)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def form_groups(items: Sequence[T], key: Callable[[T], Hashable], size: int) -> list[list[T]]:
    """Items of equal `key` packed in order into groups of at most `size`; groups are ordered by
    their first item. Call it on the whole job list (before sharding and before skipping
    finished work) so that a group, and so its outputs, never depends on the world size or on
    what a previous run finished."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"group size must be an integer >= 1, got {size!r}")
    groups: list[list[T]] = []
    filling: dict[Hashable, list[T]] = {}
    for item in items:
        k = key(item)
        group = filling.get(k)
        if group is None or len(group) == size:
            group = filling[k] = []
            groups.append(group)
        group.append(item)
    return groups


@dataclass(frozen=True)
class World:
    """This process's place in a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK); one process
    without them. Group g belongs to rank g % world_size."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> "World":
        env = os.environ if environ is None else environ
        try:
            world = cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))
        except ValueError:
            raise ValueError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them)") from None
        if world.world_size < 1 or not 0 <= world.rank < world.world_size or world.local_rank < 0:
            raise ValueError(f"bad torchrun environment: RANK={world.rank} WORLD_SIZE={world.world_size} LOCAL_RANK={world.local_rank}")
        return world

    def owns(self, index: int) -> bool:
        return index % self.world_size == self.rank

    def device(self, device: str) -> str:
        """A plain "cuda" becomes this process's GPU, "cuda:LOCAL_RANK", when there are several ranks."""
        return f"cuda:{self.local_rank}" if device == "cuda" and self.world_size > 1 else device

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of `tensor` over all ranks (itself for one process)."""
        if self.world_size == 1:
            return tensor
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        total = tensor.to(on)
        dist.all_reduce(total)
        return total.to(tensor.device)


@contextlib.contextmanager
def process_group(world: World, device: str, timeout: timedelta = DIST_TIMEOUT) -> Iterator[None]:
    """The torch.distributed group of a torchrun job (env:// rendezvous): nccl when `device` is a
    GPU, else gloo. Only barriers and one small all-reduce go through it; nothing is pickled.
    A no-op for one process or when the caller already set a group up."""
    if world.world_size == 1 or dist.is_initialized():
        yield
        return
    target = torch.device(device)
    if target.type == "cuda":
        torch.cuda.set_device(target)
        dist.init_process_group("nccl", timeout=timeout, device_id=target)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        if (dist.get_rank(), dist.get_world_size()) != (world.rank, world.world_size):
            raise RuntimeError(f"process group rank {dist.get_rank()}/{dist.get_world_size()} differs from the environment's {world}")
        yield
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Progress and summary
# --------------------------------------------------------------------------------------------


def progress_bar(total: int, enabled: bool = True, desc: str = "batch", unit: str = "img") -> tqdm:
    """A tqdm bar over outputs, with throughput and ETA."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=True, smoothing=0.1)


@dataclass
class SummaryRow:
    """One category's jobs (finished now, found finished, with failures), outputs written and
    the seconds its pipeline calls took (summed over ranks)."""

    category: tuple[str, ...]
    jobs_done: int = 0
    jobs_skipped: int = 0
    jobs_failed: int = 0
    outputs: int = 0
    seconds: float = 0.0

    @property
    def outputs_per_s(self) -> float:
        return self.outputs / self.seconds if self.seconds > 0 else 0.0


@dataclass
class BatchSummary:
    """What a run did, per category and in total. The total's rate divides by the wall time
    (all ranks together); a category's by its summed call time (the rate of one process)."""

    columns: tuple[str, ...]
    rows: list[SummaryRow]
    wall_s: float
    invalid_lines: int = 0

    @property
    def total(self) -> SummaryRow:
        total = SummaryRow(("total",) + ("",) * (len(self.columns) - 1), seconds=self.wall_s)
        for row in self.rows:
            total.jobs_done += row.jobs_done
            total.jobs_skipped += row.jobs_skipped
            total.jobs_failed += row.jobs_failed
            total.outputs += row.outputs
        return total

    def table(self, unit: str = "images") -> str:
        header = [*self.columns, "done", "skipped", "failed", unit, "seconds", f"{unit}/s"]
        lines = [[*r.category, r.jobs_done, r.jobs_skipped, r.jobs_failed, r.outputs, f"{r.seconds:.2f}",
                  f"{r.outputs_per_s:.2f}"] for r in [*self.rows, self.total]]
        cells = [[str(c) for c in line] for line in [header, *lines]]
        widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
        left = len(self.columns)

        def fmt(line):
            return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()

        rule = "-" * len(fmt(cells[0]))
        out = [fmt(cells[0]), rule, *map(fmt, cells[1:-1]), rule, fmt(cells[-1])]
        if self.invalid_lines:
            out.append(f"invalid lines skipped: {self.invalid_lines}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        def row(r: SummaryRow) -> dict:
            return {**dict(zip(self.columns, r.category)), "jobs_done": r.jobs_done, "jobs_skipped": r.jobs_skipped,
                    "jobs_failed": r.jobs_failed, "outputs": r.outputs, "seconds": r.seconds, "outputs_per_s": r.outputs_per_s}

        return {"rows": [row(r) for r in self.rows], "total": row(self.total), "wall_s": self.wall_s,
                "invalid_lines": self.invalid_lines}


@dataclass
class Tally:
    """One rank's counts per job (outputs written this run, found finished, failed) and call
    seconds per category; `reduce` sums them over ranks so rank 0 can tell each job's status
    even when its outputs were split over several ranks."""

    job_categories: list[tuple[str, ...]]
    counts: torch.Tensor = field(init=False)
    seconds: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.categories = list(dict.fromkeys(self.job_categories))  # first-appearance order
        self.counts = torch.zeros(len(self.job_categories), 3, dtype=torch.float64)
        self.seconds = torch.zeros(len(self.categories), dtype=torch.float64)

    def add(self, job: int, written: int = 0, existing: int = 0, failed: int = 0) -> None:
        self.counts[job] += torch.tensor([written, existing, failed], dtype=torch.float64)

    def add_seconds(self, category: tuple[str, ...], seconds: float) -> None:
        self.seconds[self.categories.index(category)] += seconds

    @property
    def failed(self) -> int:
        return int(self.counts[:, 2].sum())

    def reduce(self, world: World) -> None:
        flat = world.all_reduce_sum(torch.cat([self.counts.flatten(), self.seconds]))
        self.counts = flat[: self.counts.numel()].view_as(self.counts).clone()
        self.seconds = flat[self.counts.numel():].clone()

    def summary(self, columns: tuple[str, ...], wall_s: float, invalid_lines: int = 0) -> BatchSummary:
        rows = {c: SummaryRow(c, seconds=float(s)) for c, s in zip(self.categories, self.seconds)}
        for category, (written, existing, failed) in zip(self.job_categories, self.counts.tolist()):
            row = rows[category]
            row.outputs += int(written)
            if failed:
                row.jobs_failed += 1
            elif written:
                row.jobs_done += 1
            else:
                row.jobs_skipped += 1
        return BatchSummary(columns, list(rows.values()), wall_s, invalid_lines)



# --------------------------------------------------------------------------------------------
# The `mmgen batch` command: one entry point, one runner per kind of job
# --------------------------------------------------------------------------------------------


def register(commands, groups) -> None:
    from mmgen import registry
    from mmgen.cli import DTYPES

    # The modalities come from the packages' registrations (modality -> its runner's module, marker field -> modality).
    runners, marked = registry.batch_runners(), registry.batch_markers(old=False)
    modalities = "; ".join(f"{name}: see `{module}`" for name, module in runners.items())
    markers = ", ".join(f"{field} -> {name}" for field, name in marked.items())
    unmarked = ", ".join(name for name in runners if name not in marked.values())
    batch = commands.add_parser("batch", help="run a JSONL job file: images, text answers, speech or videos (resumable; "
                                "torchrun for many GPUs)",
                                description=f"Jobs from a JSONL file, one per line, all of one modality, which a line "
                                            f'names in its "{MODALITY_FIELD}" field ({modalities}); a line without it is '
                                            f"told by the field it carries ({markers})"
                                            + (f", so {unmarked} jobs always name it" if unmarked else "")
                                            + ". Each of those modules describes its jobs' fields, grouping, resume and "
                                            "multi-node use.")
    batch.add_argument("jobs", help="JSONL file, one job per line")
    batch.add_argument("--out", required=True, help="output folder: outputs and manifest.jsonl")
    batch.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                       help=f"rows per pipeline call, from jobs of one model and options (default {DEFAULT_BATCH_SIZE})")
    batch.add_argument("--continuous", action="store_true",
                       help="image jobs of LlamaGen models, text jobs and speech jobs (Dia, CSM), with a "
                            "fixed-window decoder (ar, sjd:adapt=false, ...): keep --batch-size rows decoding and refill "
                            "each as it finishes; every output equals its job run alone with its seed "
                            "(`generate image/text/speech --seed`)")
    batch.add_argument("--on-error", default="stop", choices=ON_ERROR,
                       help="invalid lines: stop before any work (default) or skip them and run the rest")
    batch.add_argument("--device", default="cpu", help="cpu (default) or cuda (under torchrun: each rank's LOCAL_RANK GPU)")
    batch.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    batch.add_argument("--dry-run", action="store_true", help="check the job file and print the plan; generate nothing")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    batch.set_defaults(run=run_batch)


def run_batch(args) -> int:
    """Hand the job file to the runner of its modality (one modality per file)."""
    import importlib

    from mmgen import registry

    path = Path(args.jobs)
    if not path.is_file():
        raise ValueError(f"{args.jobs}: no such job file")
    runners = registry.batch_runners()
    modality = file_modality(args.jobs, read_jsonl(path)[0], runners, registry.batch_markers())
    # A file whose lines name no modality goes to the first runner, which lists every line's missing fields.
    runner = importlib.import_module(runners[modality] if modality else next(iter(runners.values())))
    if getattr(args, "continuous", False) and not getattr(runner, "CONTINUOUS", False):
        raise ValueError(f"--continuous is for image, text and speech jobs; {args.jobs} holds {modality} jobs")
    return runner.run_batch(args)


def file_modality(source: PathLike, values: Sequence[tuple[int, Any]], runners: dict[str, Any],
                  markers: dict[str, str]) -> Optional[str]:
    """The one modality of a job file's lines (`read_jsonl` values): each line's `modality`
    field, or without it the modality its marker fields name (`markers`: field -> modality);
    None when no line names one. ValueError (one line, before any work) for a modality that is
    not one of `runners`, a line marked as several, or a file that mixes modalities."""
    first: dict[str, int] = {}  # modality -> the first line of it
    for line, value in values:
        if not isinstance(value, dict):
            continue
        if MODALITY_FIELD in value:
            named = value[MODALITY_FIELD]
            if not isinstance(named, str) or named not in runners:
                raise ValueError(f"{source} line {line}: unknown {MODALITY_FIELD} {json.dumps(named)}; "
                                 f"it is one of {', '.join(runners)}")
            kinds = {named}
        else:
            marked = {field: markers[field] for field in value if field in markers}
            kinds = set(marked.values())
            if len(kinds) > 1:
                fields = ", ".join(f"{field} ({name})" for field, name in marked.items())
                raise ValueError(f'{source} line {line} carries the fields of several modalities, {fields}: '
                                 f'say which in its "{MODALITY_FIELD}"')
        for name in kinds:
            first.setdefault(name, line)
    if len(first) > 1:
        found = ", ".join(f"{name} (line {line})" for name, line in sorted(first.items(), key=lambda item: item[1]))
        raise ValueError(f"{source} mixes modalities, {found}: one modality per file")
    return next(iter(first), None)


# --------------------------------------------------------------------------------------------
# One rank's run of planned groups: what every modality's batch command shares
# --------------------------------------------------------------------------------------------


@dataclass
class GroupRun:
    """What a modality's group runner gets for one group: `todo` (its outputs not finished
    before) and `record`, which writes one output atomically and records it."""

    out: Path
    todo: list
    world: World
    manifest: ManifestWriter
    tally: Tally
    job_index: dict
    bar: Any
    written: set = field(default_factory=set)

    def record(self, item: Any, data: bytes, fields: dict) -> None:
        """Write `item.file` (atomically), then its manifest record: file, sha256, size, the
        job's line and spec, this rank, and the modality's own `fields`."""
        sha256 = write_atomic(self.out / item.file, data)
        self.manifest.append({"file": item.file, "sha256": sha256, "bytes": len(data), "line": item.job.line,
                              "spec": item.job.spec, **fields, "rank": self.world.rank, "world_size": self.world.world_size})
        self.written.add(item.file)
        self.tally.add(self.job_index[item.job], written=1)
        self.bar.update(1)


@dataclass
class RunStart:
    """A batch run after its job file was checked: `jobs` (the valid ones), `calls` (what the
    modality prepared per job key), the bad lines, and where it runs."""

    started: float
    world: World
    device: str
    jobs: list
    calls: dict
    errors: list


def start_run(args: Any, load_jobs: Callable[[Path, str, torch.dtype], tuple[list, dict, list]]) -> RunStart:
    """The checks every batch command makes before any work: world and device, --batch-size,
    every line of the job file (`load_jobs` -> jobs, calls, bad lines; `check_lines` acts on
    --on-error), and at least one job to run."""
    started = time.perf_counter()
    world = World.from_env()
    device, dtype = world.device(args.device), getattr(torch, args.dtype)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_out_folder(Path(args.out), world.rank)
    jobs, calls, errors = load_jobs(Path(args.jobs), device, dtype)
    check_lines(errors, args.on_error, args.jobs, quiet=world.rank > 0)
    if not jobs:
        raise ValueError(f"{args.jobs} has no job to run")
    return RunStart(started, world, device, jobs, calls, errors)


def check_out_folder(out: Path, rank: int) -> None:
    """ValueError, before any work, for an --out that is not a folder or whose manifest part
    for this rank is a link or not a regular file (the writer refuses those too)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    part = part_path(out, rank)
    if part.is_symlink() or (part.exists() and not part.is_file()):
        raise ValueError(f"{part} is {'a symbolic link' if part.is_symlink() else 'not a regular file'}; "
                         "mmgen batch writes its manifest parts itself: remove it")


@dataclass(frozen=True, eq=False)
class FileJob:
    """One valid line of a job file whose job makes one file, `<output><SUFFIX>` (a recording, an
    answer, a video), with its defaults filled in (`fields`). A modality subclasses it with its
    `CALL_FIELDS` (the options that change the output: jobs that agree on all of them may share a
    call) and `SUFFIX`; it is its own one output in `run_groups`' item protocol."""

    line: int
    spec: dict
    fields: dict
    CALL_FIELDS: ClassVar[tuple[str, ...]] = ()
    SUFFIX: ClassVar[str] = ""

    @property
    def key(self) -> tuple:
        return (*(json.dumps(self.fields[k]) for k in self.CALL_FIELDS), json.dumps(self.fields.get(FAMILY_FIELDS, {})))

    @property
    def category(self) -> tuple[str, str]:
        return self.fields["model"], self.fields["decoding"]

    @property
    def file(self) -> str:
        return f"{self.spec['output']}{self.SUFFIX}"

    @property
    def job(self) -> "FileJob":
        return self

    @property
    def order(self) -> int:
        return self.line


def load_file_jobs(path: Path, check_fields: Callable[[Any], dict], make_job: Callable[[int, dict, dict], FileJob],
                   prepare: Callable[[dict], Any], check_inputs: Optional[Callable[[FileJob, Any], None]] = None,
                   ) -> tuple[list[FileJob], dict, list[LineError]]:
    """Every line of a file-per-job file checked before any work: its fields (`check_fields`),
    its output name unique, the job built (`make_job(line, spec, fields)`, which may read its
    inputs), one call prepared per job key (`prepare(fields)`: loads the model once, checks the
    options) and the job's inputs against that call (`check_inputs(job, call)`). Each raises
    ValueError for a bad line. Returns the valid jobs, the prepared call of each key, the bad lines."""
    values, errors = read_jsonl(path)
    owners, jobs, settings = {}, [], {}
    # One call per job key; `settings` holds the fields that key stands for.
    calls = Memo(lambda key: prepare(settings[key]))
    for line, value in values:
        try:
            fields = check_fields(value)
            claim_output(owners, value["output"], line)
            job = make_job(line, value, fields)
            settings.setdefault(job.key, fields)
            call = calls(job.key)
            if check_inputs is not None:
                check_inputs(job, call)
            jobs.append(job)
        except ValueError as error:
            errors.append(LineError(line, str(error)))
    return jobs, calls.loaded(), errors


#: `--continuous`: a group is the work unit of one rank (sharding, failure), not of one forward:
#: this many batches of rows, so rows are refilled from a long queue.
CONTINUOUS_GROUP_BATCHES = 16


def run_file_batch(args: Any, load_jobs: Callable[[Path, str, torch.dtype], tuple[list, dict, list]],
                   encode: Callable[[Any, int, FileJob, dict], tuple[bytes, dict]], unit: str = "files",
                   bar_unit: str = "file", encode_each: Optional[Callable[[Any, FileJob], tuple[bytes, dict]]] = None,
                   renamed: Optional[dict[str, str]] = None) -> int:
    """A file-per-job batch command: check every line (`start_run`), group jobs of one key in file
    order into calls of up to --batch-size (one generator seeded by `group_seed` of their seeds),
    run this rank's share and write each file the group still lacks: `encode(output, row, job,
    where)` -> (the file's bytes, the manifest record's fields), `where` being the row's group,
    seed and place. Exit status 0, or 1 when some group failed (its files are missing; run again).

    With --continuous (runners with `encode_each`): groups of up to --batch-size x
    `CONTINUOUS_GROUP_BATCHES` jobs, each decoded from its own seed by its call's `each(jobs,
    device, batch_size, on_result)`, which keeps --batch-size rows decoding and hands over each
    job's result as it ends: `encode_each(result, job)` makes its file then. `renamed`: job
    fields the runner still reads under an old name (old -> new), for resume (`job_identity`)."""
    run = start_run(args, load_jobs)
    continuous = getattr(args, "continuous", False)
    size = args.batch_size * (CONTINUOUS_GROUP_BATCHES if continuous else 1)
    groups = form_groups(run.jobs, key=lambda job: job.key, size=size)
    if args.dry_run:
        if run.world.rank == 0:
            print(f"{len(run.jobs)} valid job(s) in {len(groups)} group(s) of up to {size}; "
                  f"{len(run.errors)} invalid line(s)")
        return 0

    def run_each(g: int, group: list[FileJob], progress: GroupRun) -> None:
        todo = progress.todo

        def write(i: int, result: Any) -> None:
            data, fields = encode_each(result, todo[i])
            progress.record(todo[i], data, {"seed": todo[i].fields["seed"], **fields})

        run.calls[group[0].key].each(todo, run.device, args.batch_size, write)

    def run_group(g: int, group: list[FileJob], progress: GroupRun) -> None:
        seed = group_seed([job.fields["seed"] for job in group])
        output = run.calls[group[0].key](group, seed, run.device)
        todo = {job.file for job in progress.todo}
        for row, job in enumerate(group):
            if job.file in todo:
                where = {"index": g, "seed": seed, "row": row, "size": len(group)}
                data, fields = encode(output, row, job, where)
                progress.record(job, data, {"group": where, **fields})

    return run_groups(run.world, run.device, Path(args.out), run.jobs, groups, run_each if continuous else run_group,
                      started=run.started, invalid_lines=len(run.errors), unit=unit, bar_unit=bar_unit,
                      progress=not args.no_progress, renamed=renamed)


def run_groups(world: World, device: str, out: Path, jobs: Sequence[Any], groups: list[list[Any]],
               run_group: Callable[[int, list, GroupRun], None], *, started: float, invalid_lines: int,
               unit: str = "images", bar_unit: str = "img", progress: bool = True,
               renamed: Optional[dict[str, str]] = None) -> int:
    """This rank's share of `groups` (g % world_size == rank), resumable: outputs whose record
    matches their file are skipped, `run_group(g, items, run)` makes the rest of a group
    (`run.todo`) and records each one (`GroupRun.record`); a group that raises is reported and
    counted, and the run goes on. Rank 0 merges the manifest and prints the summary.

    Items are a group's outputs: each has `file`, `order` (its place in the manifest) and `job`
    (with `line`, `spec` and `category`, e.g. (model, decoding)). A record is its job's while
    `job_identity` of its spec and of the job's agree (`renamed`: fields read under an old name).
    Returns the exit status: 0, or 1 when some output failed (run again to finish it)."""
    out.mkdir(parents=True, exist_ok=True)
    plan = {item.file: item for group in groups for item in group}

    def current(record: dict) -> Optional[dict]:
        """A record still describes its file if its job is unchanged; its line and spec follow the file."""
        item = plan.get(record["file"])
        if item is None or job_identity(record.get("spec"), renamed) != job_identity(item.job.spec, renamed):
            return None
        return {**record, "line": item.job.line, "spec": item.job.spec}

    with process_group(world, device):
        mine = [g for g in range(len(groups)) if world.owns(g)]
        done = verified_records(out, read_records(out), {item.file for g in mine for item in groups[g]}, current)
        if world.rank == 0:
            remove_stale_temp_files(out)  # nobody writes before the barrier
        world.barrier()
        job_index = {job: i for i, job in enumerate(jobs)}
        tally = Tally([job.category for job in jobs])
        pending = sum(item.file not in done for g in mine for item in groups[g])
        with ManifestWriter(out, world.rank) as manifest, progress_bar(
            pending, enabled=world.rank == 0 and progress, unit=bar_unit,
            desc="batch" if world.world_size == 1 else f"batch (rank 0 of {world.world_size})",
        ) as bar:
            for g in mine:
                items = groups[g]
                for item in items:
                    if item.file in done:
                        tally.add(job_index[item.job], existing=1)
                run = GroupRun(out, [item for item in items if item.file not in done], world, manifest, tally, job_index, bar)
                if not run.todo:
                    continue
                begun = time.perf_counter()
                try:
                    run_group(g, items, run)
                except Exception as error:  # never stop midway: report, count, go on with the next group
                    lines = ", ".join(map(str, sorted({item.job.line for item in items})))
                    bar.write(f"mmgen batch: group {g} (lines {lines}) failed: {type(error).__name__}: {error}", file=sys.stderr)
                    for item in run.todo:
                        if item.file not in run.written:
                            tally.add(job_index[item.job], failed=1)
                tally.add_seconds(items[0].job.category, time.perf_counter() - begun)
        world.barrier()
        tally.reduce(world)
        if world.rank == 0:
            path, records = merge_manifest(out, order=lambda r: plan[r["file"]].order, current=current)
            summary = tally.summary(("model", "decoding"), time.perf_counter() - started, invalid_lines=invalid_lines)
            print(summary.table(unit=unit))
            print(json.dumps({"summary": summary.to_dict(), "manifest": str(path), "records": records}))
    return 1 if tally.failed else 0
