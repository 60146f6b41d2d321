"""Digests of every bundled model's outputs under every decoder it takes: the check that a
reshaping change changed no behaviour.

    python -m benchmarks.outputs_digest --out before.json      (on the old tree)
    python -m benchmarks.outputs_digest --out after.json --compare before.json

Each bundled target (images: LlamaGen, VAR, MAR; the VLM; speech; video) decodes small fixed
inputs with a fixed seed under each of its `Pipeline.decoders()` (companions: the bundled ones),
greedy and sampled where the modality samples (a call that fails records its error); the digest is the SHA-256 of the output tokens
(frames' codes, latents) as bytes, so identical digests mean identical outputs. `--compare`
prints the entries that differ and exits 1 when any does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


def digest(tensor: Any) -> str:
    tensor = torch.as_tensor(tensor).detach().cpu().contiguous()
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()[:16]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def image_runs(pipe: Any, name: str) -> Iterator[tuple[str, Callable[[], Any]]]:
    kind = type(pipe).__name__
    for decoding in pipe.decoders():
        if kind == "MARPipeline":
            yield decoding, lambda d=decoding: pipe([3, 40], decoding=d, num_iter=8, generator=seeded(0), output_type="pt").tokens
        else:
            yield decoding, lambda d=decoding: pipe([3, 40], decoding=d, generator=seeded(0), output_type="pt").tokens


def vlm_runs(pipe: Any, name: str) -> Iterator[tuple[str, Callable[[], Any]]]:
    from PIL import Image

    from mmgen.vlm.heldout import load_eval

    records, images = load_eval()
    questions = [records[0]["question"], records[5]["question"]]
    pictures = [Image.fromarray(images[records[0]["index"]]), Image.fromarray(images[records[5]["index"]])]
    for decoding in pipe.decoders():
        yield decoding, lambda d=decoding: pipe(questions, pictures, decoding=d, max_new_tokens=24).token_ids
        yield f"{decoding}, sampled", lambda d=decoding: pipe(questions, pictures, decoding=d, max_new_tokens=24, temperature=1.0,
                                                              generator=seeded(1)).token_ids


def speech_runs(pipe: Any, name: str) -> Iterator[tuple[str, Callable[[], Any]]]:
    from mmgen.audio.heldout import held_out_texts

    texts = held_out_texts(2)
    for decoding in pipe.decoders():
        yield decoding, lambda d=decoding: torch.cat([c.flatten() for c in pipe(texts, decoding=d, max_new_frames=48, generator=seeded(2)).codes])


def video_runs(pipe: Any, name: str) -> Iterator[tuple[str, Callable[[], Any]]]:
    for decoding in pipe.decoders():
        yield decoding, lambda d=decoding: pipe("grinning face moving left", decoding=d, num_frames=9, decode="none",
                                                generator=seeded(3)).latents


RUNS = {"LlamaGenPipeline": image_runs, "VARPipeline": image_runs, "MARPipeline": image_runs, "VLMPipeline": vlm_runs,
        "TTSPipeline": speech_runs, "BlockDiffusionVideoPipeline": video_runs}
TARGETS = ("emoji64", "var-emoji64", "mar-emoji64", "emoji-vlm", "speech-tts", "emoji-motion")


@torch.no_grad()
def digests(models: list[str]) -> dict[str, str]:
    import mmgen

    found = {}
    for name in models:
        pipe = mmgen.load_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        for label, run in RUNS[type(pipe).__name__](pipe, name):
            try:
                found[f"{name} {label}"] = digest(run())
            except Exception as error:  # a failure is an outcome to compare too
                found[f"{name} {label}"] = f"error: {type(error).__name__}: {str(error)[:120]}"
            print(f"{name} {label}: {found[f'{name} {label}']}", file=sys.stderr)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(TARGETS))
    parser.add_argument("--out", required=True, help="write the digests here (JSON)")
    parser.add_argument("--compare", help="digests of another tree: print what differs, exit 1 if anything does")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found = digests(args.models)
    Path(args.out).write_text(json.dumps(found, indent=1) + "\n")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        differ = sorted(k for k in before.keys() | found.keys() if before.get(k) != found.get(k))
        for key in differ:
            print(f"differs: {key}: {before.get(key)} -> {found.get(key)}")
        print(f"{len(found) - len(differ)} of {len(found)} identical")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
