"""`mmgen batch` for speech jobs: WAV files from a JSONL job file, resumable and sharded over the
ranks of a torchrun job, like the image and text jobs.

    mmgen batch lines.jsonl --out speech/ [--batch-size 8] [--on-error stop|skip]

One job per line (a job with `"modality": "speech"`, or with a `text` and no modality, is a speech job):

    {"model": "path/to/dia", "text": "[S1] Hello there.", "output": "hello"}
    {"modality": "speech", "model": "path/to/dia", "text": "Again.", "voice": "me.wav", "voice_text": "[S1] Me.", "output": "again"}

Required: `model` (a `mmgen generate speech --model`), `text` and `output` (a file-name stem,
unique in the file: the audio goes to `<out>/<output>.wav`). Optional: `voice` and `voice_text`,
`decoding` (default "ar"), `seed` (default 0), `max_new_frames`, `temperature`, `top_k`,
`top_p`, `guidance_scale` (as the `mmgen generate speech` flags; unset ones take the model's
generation config), `modality` ("speech", the only value it may take here). Every line is
checked before any work (JSON, fields, voice files readable, models load, decoding specs valid);
`--on-error` as for image jobs.

Jobs of one model and options (and all with or all without a voice) are packed in file order
into calls of up to `--batch-size` rows, with one generator seeded from their seeds
(`mmgen.batch.group_seed`). With `--continuous` (`ar` or the sjd family, adaptive
windows chosen per row) `--batch-size` rows keep decoding and each row takes the next job as its
speech ends; every file then equals its job run alone with its seed (`mmgen generate speech
--seed`; under the adaptive window with `batch_rows=<batch size>` added to its decoding spec,
`mmgen.decoding.row_spec`), and its record holds that seed. Files are written atomically and recorded in the
manifest with the decoder's stats and the group, so a killed run resumes without losing or
duplicating files.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from mmgen.batch import (FAMILY_FIELDS, FIELD_KINDS, FileJob, LineError, check_schema, family_call, family_fields,
                         load_file_jobs, model_memo, run_file_batch)
from mmgen.cli import check_seed

from mmgen.audio.waveform import read_audio, wav_bytes

MODALITY = "speech"
REQUIRED = {"model": "str", "text": "text", "output": "str"}
OPTIONAL = {"voice": "str", "voice_text": "str", "decoding": "str", "seed": "int", "max_new_frames": "int",
            "temperature": "float", "top_k": "int", "top_p": "float", "guidance_scale": "float"}
KINDS = {**FIELD_KINDS, "text": ("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))}
DEFAULTS = {"voice": None, "voice_text": None, "decoding": "ar", "seed": 0, "max_new_frames": None, "temperature": None,
            "top_k": None, "top_p": None, "guidance_scale": None}


@dataclass(frozen=True, eq=False)
class SpeechJob(FileJob):
    """One valid line, with its defaults filled in (`fields`) and its voice prompt read."""

    voice: Optional[torch.Tensor] = None
    CALL_FIELDS = ("model", "decoding", "max_new_frames", "temperature", "top_k", "top_p", "guidance_scale")
    SUFFIX = ".wav"

    @property
    def key(self) -> tuple:
        return (*super().key, self.voice is not None)


def check_fields(value: Any) -> dict:
    """A job object's fields checked for presence and type, defaults filled in (ValueError)."""
    check_schema(value, REQUIRED, OPTIONAL, KINDS, modality=MODALITY)
    fields = {**DEFAULTS, **value, FAMILY_FIELDS: family_fields(value, MODALITY, {**REQUIRED, **OPTIONAL})}
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

        return self.pipe([job.fields["text"] for job in jobs], voice=_voices(jobs, self.pipe),
                         voice_text=[job.fields["voice_text"] for job in jobs], generator=make_generator(seed, device),
                         **self.options)

    def each(self, jobs: list[SpeechJob], device: str, batch_size: int, on_result) -> None:
        """`--continuous`: every job from its own seed, `batch_size` rows at a time; on_result(i,
        (audio, frames, stats, sampling rate)) as job i's speech ends."""
        from mmgen.sampling import make_generator

        self.pipe.speak_each([job.fields["text"] for job in jobs], _voices(jobs, self.pipe),
                             [job.fields["voice_text"] for job in jobs],
                             [make_generator(job.fields["seed"], device) for job in jobs], batch_size,
                             lambda i, audio, frames, stats: on_result(i, (audio, frames, stats, self.pipe.sampling_rate)),
                             **self.options)


def _voices(jobs: list[SpeechJob], pipe) -> list:
    return [None if job.voice is None else (job.voice.numpy(), pipe.sampling_rate) for job in jobs]


def prepare_call(pipe, fields: dict, device: str, dtype: torch.dtype, continuous: bool = False) -> SpeechCall:
    """The decoder and options of a job key, every spec checked (ValueError) before any work;
    `continuous`: the job must also suit `--continuous`."""
    from mmgen.decoding.batching import check_continuous
    from mmgen.loading import decoder_from_spec

    from mmgen.audio.pipeline import TTSPipeline

    if not isinstance(pipe, TTSPipeline):
        raise ValueError(f"model {fields['model']!r} holds a {type(pipe).__name__}, not a text-to-speech model")
    decoder = decoder_from_spec(fields["decoding"], pipe, fields["model"], device, dtype)
    if continuous:
        check_continuous(decoder, pipe.token_model())
    options = {k: fields[k] for k in ("max_new_frames", "temperature", "top_k", "top_p", "guidance_scale")}
    return SpeechCall(pipe, dict(options, decoding=decoder, **family_call(pipe, fields, MODALITY)))


def load_jobs(path: Path, device: str, dtype: torch.dtype,
              continuous: bool = False) -> tuple[list[SpeechJob], dict, list[LineError]]:
    """The valid jobs, the prepared call of each job key, and the bad lines (each model loads once);
    `continuous`: every job must also suit `--continuous`."""
    import transformers

    from mmgen.loading import load_pipeline

    transformers.utils.logging.disable_progress_bar()  # the summary and errors stay the only output
    pipes = model_memo(lambda model: load_pipeline(model, device=device, dtype=dtype))

    def make_job(line: int, spec: dict, fields: dict) -> SpeechJob:
        rate = pipes(fields["model"]).sampling_rate
        return SpeechJob(line, spec, fields, None if fields["voice"] is None else read_audio(fields["voice"], rate))

    def check_inputs(job: SpeechJob, call: SpeechCall) -> None:
        voice = None if job.voice is None else (job.voice.numpy(), call.pipe.sampling_rate)
        f = job.fields  # text length and context checked here
        call.pipe.prepare(f["text"], voice, f["voice_text"], f["max_new_frames"], f["guidance_scale"])

    return load_file_jobs(path, check_fields, make_job,
                          lambda fields: prepare_call(pipes(fields["model"]), fields, device, dtype, continuous), check_inputs)


#: `--continuous`: this runner refills rows as they finish (`mmgen.batch.run_batch` asks).
CONTINUOUS = True


def run_batch(args: argparse.Namespace) -> int:
    """Check every line, group, run this rank's share, merge the manifest (rank 0). Exit status
    0, or 1 when some group failed (its files are missing; run again)."""
    continuous = getattr(args, "continuous", False)

    def encode(output, row: int, job: SpeechJob, where: dict) -> tuple[bytes, dict]:
        return speech_file(output.audio[row], int(output.lengths[row]), output.sampling_rate, output.stats)

    def encode_each(result, job: SpeechJob) -> tuple[bytes, dict]:
        audio, frames, stats, rate = result
        return speech_file(audio, len(frames), rate, stats)

    return run_file_batch(args, lambda path, device, dtype: load_jobs(path, device, dtype, continuous), encode,
                          encode_each=encode_each)


def speech_file(audio: torch.Tensor, frames: int, rate: int, stats) -> tuple[bytes, dict]:
    """A job's WAV bytes and its manifest record's fields."""
    record = {"frames": frames, "seconds": audio.numel() / rate, "stats": stats.to_dict(per_forward=False)}
    return wav_bytes(audio, rate), record
