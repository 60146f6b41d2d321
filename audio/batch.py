"""`mmgen batch` for speech jobs: WAV files from a JSONL job file, resumable and sharded over the
ranks of a torchrun job, like the image and text jobs.

    mmgen batch lines.jsonl --out speech/ [--batch-size 8] [--on-error stop|skip]

One job per line (a job with a `text` is a speech job):

    {"model": "path/to/dia", "text": "[S1] Hello there.", "output": "hello"}
    {"model": "path/to/dia", "text": "Again.", "voice": "me.wav", "voice_text": "[S1] It's me.", "output": "again"}

Required: `model` (a `mmgen generate speech --model`), `text` and `output` (a file-name stem,
unique in the file: the audio goes to `<out>/<output>.wav`). Optional: `voice` and
`voice_text`, `decoding` (default "ar"), `seed` (default 0), `max_new_frames`, `temperature`,
`top_k`, `top_p`, `guidance_scale` (as the `mmgen generate speech` flags; unset ones take the
model's generation config). Every line is checked before any work (JSON, fields, voice files
readable, models load, decoding specs valid); `--on-error` as for image jobs.

Jobs of one model and options (and all with or all without a voice) are packed in file order
into calls of up to `--batch-size` rows, with one generator seeded from their seeds
(`mmgen.batch.group_seed`). Files are written atomically and recorded in the manifest with the
decoder's stats and the group, so a killed run resumes without losing or duplicating files.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from mmgen.batch import (FIELD_KINDS, GroupRun, LineError, Memo, check_schema, claim_output, form_groups, group_seed,
                         model_memo, read_jsonl, run_groups, start_run)
from mmgen.cli import check_seed

from mmgen.audio.waveform import read_audio, wav_bytes

REQUIRED = {"model": "str", "text": "text", "output": "str"}
OPTIONAL = {"voice": "str", "voice_text": "str", "decoding": "str", "seed": "int", "max_new_frames": "int",
            "temperature": "float", "top_k": "int", "top_p": "float", "guidance_scale": "float"}
KINDS = {**FIELD_KINDS, "text": ("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))}
#: Options that change the audio: jobs that agree on all of them may share a call.
CALL_FIELDS = ("model", "decoding", "max_new_frames", "temperature", "top_k", "top_p", "guidance_scale")
DEFAULTS = {"voice": None, "voice_text": None, "decoding": "ar", "seed": 0, "max_new_frames": None, "temperature": None,
            "top_k": None, "top_p": None, "guidance_scale": None}


@dataclass(frozen=True, eq=False)
class SpeechJob:
    """One valid line, with its defaults filled in (`fields`) and its voice prompt read."""

    line: int
    spec: dict
    fields: dict
    voice: Optional[torch.Tensor]

    @property
    def key(self) -> tuple:
        return (*(json.dumps(self.fields[k]) for k in CALL_FIELDS), self.voice is not None)

    @property
    def category(self) -> tuple[str, str]:
        return self.fields["model"], self.fields["decoding"]

    @property
    def file(self) -> str:
        return f"{self.spec['output']}.wav"

    @property
    def job(self) -> "SpeechJob":
        """A speech job is its own one output (the driver's item protocol: `mmgen.batch.run_groups`)."""
        return self

    @property
    def order(self) -> int:
        return self.line


def check_fields(value: Any) -> dict:
    """A job object's fields checked for presence and type, defaults filled in (ValueError)."""
    check_schema(value, REQUIRED, OPTIONAL, KINDS)
    fields = {**DEFAULTS, **value}
    for name in ("temperature", "top_p", "guidance_scale"):
        fields[name] = None if fields[name] is None else float(fields[name])
    check_seed(fields["seed"])
    if fields["max_new_frames"] is not None and fields["max_new_frames"] < 1:
        raise ValueError(f"max_new_frames must be >= 1, got {fields['max_new_frames']}")
    if fields["voice_text"] is not None and fields["voice"] is None:
        raise ValueError("voice_text is the transcript of a voice: give voice too")
    return fields


@dataclass
class SpeechCall:
    """One loaded pipeline with one set of call options (a group's call)."""

    pipe: Any
    options: dict

    def __call__(self, jobs: list[SpeechJob], seed: int, device: str):
        from mmgen.sampling import make_generator

        voices = [None if job.voice is None else (job.voice.numpy(), self.pipe.sampling_rate) for job in jobs]
        return self.pipe([job.fields["text"] for job in jobs], voice=voices, voice_text=[job.fields["voice_text"] for job in jobs],
                         generator=make_generator(seed, device), **self.options)


def prepare_call(pipe, fields: dict, device: str, dtype: torch.dtype) -> SpeechCall:
    """The decoder and options of a job key, every spec checked (ValueError) before any work."""
    from mmgen.loading import decoder_from_spec

    from mmgen.audio.pipeline import TTSPipeline

    if not isinstance(pipe, TTSPipeline):
        raise ValueError(f"model {fields['model']!r} holds a {type(pipe).__name__}, not a text-to-speech model")
    decoder = decoder_from_spec(fields["decoding"], pipe, fields["model"], device, dtype)
    options = {k: fields[k] for k in ("max_new_frames", "temperature", "top_k", "top_p", "guidance_scale")}
    return SpeechCall(pipe, dict(options, decoding=decoder))


def load_jobs(path: Path, device: str, dtype: torch.dtype) -> tuple[list[SpeechJob], dict, list[LineError]]:
    """The valid jobs, the prepared call of each job key, and the bad lines (each model loads once)."""
    import transformers

    from mmgen.loading import load_pipeline

    transformers.utils.logging.disable_progress_bar()  # the summary and errors stay the only output
    values, errors = read_jsonl(path)

    pipes = model_memo(lambda model: load_pipeline(model, device=device, dtype=dtype))
    owners, jobs, settings = {}, [], {}
    calls = Memo(lambda key: prepare_call(pipes(settings[key]["model"]), settings[key], device, dtype))
    for line, value in values:
        try:
            fields = check_fields(value)
            claim_output(owners, value["output"], line)
            pipe = pipes(fields["model"])
            voice = None if fields["voice"] is None else read_audio(fields["voice"], pipe.sampling_rate)
            job = SpeechJob(line, value, fields, voice)
            settings.setdefault(job.key, fields)
            calls(job.key)
            pipe.prepare(fields["text"], None if voice is None else (voice.numpy(), pipe.sampling_rate), fields["voice_text"],
                         fields["max_new_frames"], fields["guidance_scale"])  # text length and context checked here
            jobs.append(job)
        except ValueError as error:
            errors.append(LineError(line, str(error)))
    return jobs, calls.loaded(), errors


def run_batch(args: argparse.Namespace) -> int:
    """Check every line, group, run this rank's share, merge the manifest (rank 0). Exit status
    0, or 1 when some group failed (its files are missing; run again)."""
    run = start_run(args, load_jobs)
    world, device, jobs, calls, errors = run.world, run.device, run.jobs, run.calls, run.errors
    groups = form_groups(jobs, key=lambda job: job.key, size=args.batch_size)
    if args.dry_run:
        if world.rank == 0:
            print(f"{len(jobs)} valid job(s) in {len(groups)} group(s) of up to {args.batch_size}; {len(errors)} invalid line(s)")
        return 0

    def run_group(g: int, group: list[SpeechJob], run: GroupRun) -> None:
        """Speak group `g` in one call and write the files it still lacks."""
        seed = group_seed([job.fields["seed"] for job in group])
        output = calls[group[0].key](group, seed, device)
        stats = output.stats.to_dict()
        del stats["accepted_per_forward"]  # one float per forward: the histogram suffices
        todo = {job.file for job in run.todo}
        for row, job in enumerate(group):
            if job.file in todo:
                where = {"index": g, "seed": seed, "row": row, "size": len(group)}
                record = {"group": where, "frames": int(output.lengths[row]), "seconds": output.audio[row].numel() / output.sampling_rate,
                          "stats": stats}
                run.record(job, wav_bytes(output.audio[row], output.sampling_rate), record)

    return run_groups(world, device, Path(args.out), jobs, groups, run_group, started=run.started, invalid_lines=len(errors),
                      unit="files", bar_unit="file", progress=not args.no_progress)
