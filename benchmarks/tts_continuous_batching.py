"""Utterances per second of a Dia text-to-speech model: static batches against continuous
batching, the same texts.

Static batching speaks the texts in calls of `--batch-size` (one `TTSPipeline` call per group),
so each call lasts as long as its longest utterance. Continuous batching
(`TTSPipeline.speak_each`) keeps `--batch-size` rows decoding and gives a row the next text,
prefilled alone, as soon as its speech ends. The texts are the held-out ones of the bundled
`speech-tts`'s corpus (`benchmarks/data/speech.py`: emoji names, numbers, short sentences;
texts only, nothing is synthesised). Greedy by default, with the model's own guidance; every
continuous utterance's frames are checked against the static call's (greedy frames do not
depend on the batch). `--sampled` samples as the model's generation config says, each text
from its own seed (the modes then draw differently). Codec decoding is included on both sides
(each row's audio is decoded once). Modes run in turn within each repeat (interleaved); medians
reported.

    python -m benchmarks.tts_continuous_batching --texts 32 --batch-size 8 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Optional

import torch

from mmgen.sampling import make_generator

from benchmarks.continuous_batching import compare_modes, pipeline_arguments

METHODS = ["ar", "sjd:adapt=false"]


def held_out_texts(count: int) -> list[str]:
    """The first `count` held-out texts of the speech corpus, in its order."""
    from benchmarks.data.speech import corpus_texts, is_eval

    return [text for _, text in corpus_texts() if is_eval(text)][:count]


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="speech-tts")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--max-new-frames", type=int, default=200)
    parser.add_argument("--sampled", action="store_true", help="sample as the model's generation config says")
    pipeline_arguments(parser, METHODS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmgen.loading import load_pipeline

    pipe = load_pipeline(args.model, "cpu", torch.float32)
    texts = held_out_texts(args.texts)
    B, n = args.batch_size, len(texts)
    options = dict(max_new_frames=args.max_new_frames, **({} if args.sampled else {"temperature": 0.0}))

    def static(method: str):
        frames, forwards, tokens = [], 0, 0
        for start in range(0, n, B):
            out = pipe(texts[start : start + B], decoding=method, generator=make_generator(start), **options)
            frames += [row[:length] for row, length in zip(out.frames, out.lengths.tolist())]
            forwards, tokens = forwards + out.stats.forwards, tokens + int(out.lengths.sum())
        return frames, forwards, tokens

    def continuous(method: str):
        out = pipe.speak_each(texts, generators=[make_generator(i) for i in range(n)], batch_size=B, decoding=method,
                              **options)
        return [row[:length] for row, length in zip(out.frames, out.lengths.tolist())], out.stats.forwards, int(out.lengths.sum())

    rows = compare_modes(args.methods, static, continuous, n, B, args.repeats, "utterances", same=torch.equal)
    if args.json:
        command = "python -m benchmarks.tts_continuous_batching " + shlex.join(sys.argv[1:] if argv is None else argv)
        result = {"command": command, "model": args.model, "threads": torch.get_num_threads(), "sampled": args.sampled,
                  "max_new_frames": args.max_new_frames, "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
