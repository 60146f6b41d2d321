"""`mmgen batch` for text jobs: answers to prompts about images or videos from a JSONL job file, resumable
and sharded over the ranks of a torchrun job, like the image jobs (`mmgen.image_ar.batch`).

    mmgen batch questions.jsonl --out answers/ [--batch-size 8] [--on-error stop|skip]

One job per line (a job with `"modality": "text"`, or with a `prompt` and no modality, is a text job):

    {"prompt": "What is this emoji?", "images": ["cat.png"], "output": "cat-name"}
    {"modality": "text", "model": "emoji-vlm", "prompt": "Its colour?", "images": ["cat.png"], "decoding": "draft", "output": "colour"}
    {"model": "path/to/qwen2.5-vl", "prompt": "What happens?", "videos": ["clip.mp4"], "output": "clip"}

Required: `prompt` (a question, or a chat conversation in transformers' message format) and
`output` (a file-name stem, unique in the file: the answer goes to `<out>/<output>.json`).
Optional: `model` (default the bundled `emoji-vlm`), `images` (image files, relative to the
working directory as on the command line), `videos` (video files, likewise, after the images;
for the families that take video, as `generate text --video`), `decoding` (a `generate text
--decoding` spec, default "ar"), `seed` (default 0), `max_new_tokens` (default 64),
`temperature`, `top_k`, `top_p`, `dropping`, `keep_ratio`, `draft_dropping` (as the `mmgen
generate text` flags), `modality` ("text", the only value it may take here). Every line is
checked before any work (JSON, fields, images and videos readable, models load and take the
line's videos, decoding and dropping specs valid, `max_new_tokens` within the model's context
with the line's images and videos, `temperature` in [0, 100], `top_k` >= 0, `top_p` in (0, 1]);
`--on-error` as for image jobs. Images are kept from the check to the run; videos are read again
when their group runs (only a group's are in memory at once).

Groups and seeds: jobs of one model and options are packed in file order into calls of up to
`--batch-size` rows with one generator seeded from their seeds (`mmgen.batch.group_seed`: a
lone row keeps its own seed, so `--batch-size 1` equals `mmgen generate text --seed`).
Greedy answers (temperature 0, the default) do not depend on the batch (left padding; tested).

Continuous batching (`--continuous`; fixed-window decoders such as `ar` and `sjd:adapt=false`,
not draft models; no token dropping): `--batch-size` rows keep decoding, and a row whose answer
ends takes the next job of its group (up to 16 x `--batch-size` jobs of one model and options),
prefilled alone. Every answer, sampled ones included, is the one its job gives alone with its
own seed (`mmgen generate text --seed`), whatever it shared forwards with; its file holds that
seed and its own stats. Jobs it cannot run are listed with the other bad lines before any work.

Each answer file holds the prompt, the text, the token ids, the decoder's stats and the group;
files are written atomically and recorded in the manifest, so a killed run resumes without
losing or duplicating answers (`mmgen.batch`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmgen.batch import (FAMILY_FIELDS, FIELD_KINDS, FileJob, LineError, check_schema, family_call, family_fields,
                         load_file_jobs, model_memo, run_file_batch)
from mmgen.cli import check_seed

from mmgen.vlm.cli import DEFAULT_MODEL, dropping_from_flags
from mmgen.vlm.images import read_image
from mmgen.vlm.videos import read_video, video_family_check

MODALITY = "text"
REQUIRED = {"prompt": "prompt", "output": "str"}
OPTIONAL = {"model": "str", "images": "paths", "videos": "paths", "decoding": "str", "seed": "int",
            "max_new_tokens": "int", "temperature": "float", "top_k": "int", "top_p": "float", "dropping": "str",
            "keep_ratio": "float", "draft_dropping": "str"}
KINDS = {
    **FIELD_KINDS,
    "paths": ("a list of file paths", lambda v: isinstance(v, list) and all(isinstance(p, str) for p in v)),
    "prompt": ("a non-empty string or a list of chat messages", lambda v: (isinstance(v, str) and bool(v.strip()))
               or (isinstance(v, list) and bool(v) and all(isinstance(m, dict) for m in v))),
}
DEFAULTS = {"model": DEFAULT_MODEL, "images": [], "videos": [], "decoding": "ar", "seed": 0, "max_new_tokens": 64,
            "temperature": 0.0, "top_k": 0, "top_p": 1.0, "dropping": None, "keep_ratio": None, "draft_dropping": None}


@dataclass(frozen=True, eq=False)
class TextJob(FileJob):
    """One valid line, with its defaults filled in (`fields`), its images read and its videos'
    paths (checked, read when its group runs)."""

    images: tuple = ()
    videos: tuple = ()
    CALL_FIELDS = ("model", "decoding", "max_new_tokens", "temperature", "top_k", "top_p", "dropping", "keep_ratio",
                   "draft_dropping")
    SUFFIX = ".json"


def check_fields(value: Any) -> dict:
    """A job object's fields checked for presence and type, defaults filled in (ValueError)."""
    check_schema(value, REQUIRED, OPTIONAL, KINDS, modality=MODALITY)
    from mmgen.vlm.pipeline import check_budget, check_sampling

    fields = {**DEFAULTS, **value, FAMILY_FIELDS: family_fields(value, MODALITY, {**REQUIRED, **OPTIONAL})}
    for name in ("temperature", "top_p", "keep_ratio"):
        fields[name] = None if fields[name] is None else float(fields[name])
    check_seed(fields["seed"])
    check_budget(fields["max_new_tokens"])
    check_sampling(fields["temperature"], fields["top_k"], fields["top_p"])
    return fields


@dataclass
class TextCall:
    """One loaded pipeline with one set of call options (a group's call)."""

    pipe: Any
    options: dict

    def __call__(self, jobs: list[TextJob], seed: int, device: str):
        from mmgen.sampling import make_generator

        return self.pipe([job.fields["prompt"] for job in jobs], _per_job([job.images for job in jobs]),
                         videos=_per_job([job.videos for job in jobs]), generator=make_generator(seed, device),
                         **self.options)

    def each(self, jobs: list[TextJob], device: str, batch_size: int, on_result) -> None:
        """`--continuous`: every job from its own seed, `batch_size` rows at a time; on_result(i,
        (text, token ids, stats)) as job i's answer ends."""
        from mmgen.sampling import make_generator

        options = {name: v for name, v in self.options.items() if name not in ("dropping", "draft_dropping")}
        self.pipe.answer_each([job.fields["prompt"] for job in jobs], _per_job([job.images for job in jobs]),
                              [make_generator(job.fields["seed"], device) for job in jobs], batch_size,
                              lambda i, text, ids, stats: on_result(i, (text, ids, stats)),
                              videos=_per_job([job.videos for job in jobs]), **options)


def _per_job(inputs: list[tuple]) -> Any:
    """The pipeline's `images` or `videos` argument from each job's: None without any, one
    prompt's list for one job, else one list per job."""
    lists = [list(x) for x in inputs]
    if not any(lists):
        return None
    return lists[0] if len(lists) == 1 else lists


def prepare_call(pipe, fields: dict, device: str, dtype: torch.dtype, continuous: bool = False) -> TextCall:
    """The decoder and options of a job key, every spec checked (ValueError) before any work;
    `continuous`: the job must also suit `--continuous`."""
    from mmgen.decoding.batching import check_continuous
    from mmgen.loading import decoder_from_spec

    from mmgen.vlm.pipeline import VLMPipeline

    if not isinstance(pipe, VLMPipeline):
        raise ValueError(f"model {fields['model']!r} holds a {type(pipe).__name__}, not a vision-language model")
    decoder = decoder_from_spec(fields["decoding"], pipe, fields["model"], device, dtype)
    if continuous:
        check_continuous(decoder, pipe.token_model())
        if fields["dropping"] is not None or fields["draft_dropping"] is not None:
            raise ValueError("--continuous decodes without token dropping (each row's prefill runs alone): drop the "
                             "dropping fields or run without --continuous")
    options = dict(max_new_tokens=fields["max_new_tokens"], decoding=decoder, temperature=fields["temperature"],
                   top_k=fields["top_k"], top_p=fields["top_p"],
                   dropping=dropping_from_flags(fields["dropping"], fields["keep_ratio"]),
                   draft_dropping=dropping_from_flags(fields["draft_dropping"], None), **family_call(pipe, fields, MODALITY))
    return TextCall(pipe, options)


def load_jobs(path: Path, device: str, dtype: torch.dtype, continuous: bool = False) -> tuple[list[TextJob], dict, list[LineError]]:
    """The valid jobs, the prepared call of each job key, and the bad lines (each model loads once);
    `continuous`: every job must also suit `--continuous`."""
    import transformers

    from mmgen.loading import load_pipeline

    transformers.utils.logging.disable_progress_bar()  # the summary and errors stay the only output
    pipes = model_memo(lambda model: load_pipeline(model, device=device, dtype=dtype))

    def make_job(line: int, spec: dict, fields: dict) -> TextJob:
        return TextJob(line, spec, fields, tuple(read_image(p, f"image {p}") for p in fields["images"]),
                       tuple(fields["videos"]))

    def check_inputs(job: TextJob, call: TextCall) -> None:
        # The model's family takes video, then each video through the pipeline's reader (dropped after the check).
        videos = None
        if job.videos:
            video_family_check(getattr(call.pipe.model.config, "model_type", None))
            videos = [read_video(p, f"video {p}") for p in job.videos]
        # Conversations and placeholders, and the prompt plus its budget within the model's context.
        inputs = call.pipe.prepare_inputs(job.fields["prompt"], list(job.images) or None, videos)
        call.pipe.check_context(inputs, job.fields["max_new_tokens"])

    return load_file_jobs(path, check_fields, make_job,
                          lambda fields: prepare_call(pipes(fields["model"]), fields, device, dtype, continuous), check_inputs)


#: `--continuous`: this runner refills rows as they finish (`mmgen.batch.run_batch` asks).
CONTINUOUS = True


def run_batch(args: argparse.Namespace) -> int:
    """Check every line, group, run this rank's share, merge the manifest (rank 0). Exit status
    0, or 1 when some group failed (its answers are missing; run again)."""
    continuous = getattr(args, "continuous", False)

    def encode(output, row: int, job: TextJob, where: dict) -> tuple[bytes, dict]:
        n = int(output.lengths[row])
        return answer_file(job, output.texts[row], output.token_ids[row, :n], output.stats, group=where), {}

    def encode_each(result, job: TextJob) -> tuple[bytes, dict]:
        text, token_ids, stats = result
        return answer_file(job, text, token_ids, stats, seed=job.fields["seed"]), {}

    return run_file_batch(args, lambda path, device, dtype: load_jobs(path, device, dtype, continuous), encode,
                          unit="answers", bar_unit="answer", encode_each=encode_each)


def answer_file(job: TextJob, text: str, token_ids: torch.Tensor, stats, **where) -> bytes:
    """An answer's JSON file: prompt, text, token ids, model, decoding, the decoder's stats, and
    where it was decoded (`group`, or under --continuous its own `seed`)."""
    answer = {"prompt": job.fields["prompt"], "text": text, "token_ids": token_ids.tolist(), "model": job.fields["model"],
              "decoding": job.fields["decoding"], "stats": stats.to_dict(per_forward=False), **where}
    return (json.dumps(answer, ensure_ascii=False, indent=1) + "\n").encode()
