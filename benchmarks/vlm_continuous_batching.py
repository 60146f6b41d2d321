"""Answers per second of a VLM: static batches against continuous batching, the same questions.

Static batching answers the questions in calls of `--batch-size` (one `VLMPipeline` call per
group, left-padded), so each call lasts as long as its longest answer. Continuous batching
(`VLMPipeline.answer_each`) keeps `--batch-size` rows decoding and gives a row the next
question, prefilled alone, as soon as its answer ends. The questions are the bundled
`emoji-vlm`'s held-out ones (an emoji image each; answers of a few words to a sentence). Greedy
by default; every continuous answer is checked against the static one (greedy answers do not
depend on the batch). Modes run in turn within each repeat (interleaved); medians reported.

    python -m benchmarks.vlm_continuous_batching --questions 64 --batch-size 8 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from mmgen.sampling import make_generator

from benchmarks.continuous_batching import compare_modes, pipeline_arguments

METHODS = ["ar", "sjd:adapt=false"]


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="emoji-vlm")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    pipeline_arguments(parser, METHODS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from PIL import Image

    import mmgen.vlm
    from benchmarks.train_vlm import load_eval
    from mmgen.loading import load_pipeline

    pipe = load_pipeline(args.model, "cpu", torch.float32)
    records, pixels = load_eval(Path(mmgen.vlm.__file__).parent / "assets")
    records = records[: args.questions]
    questions = [r["question"] for r in records]
    images = [[Image.fromarray(pixels[r["index"]])] for r in records]
    B, n = args.batch_size, len(records)

    def static(method: str):
        texts, forwards, tokens = [], 0, 0
        for start in range(0, n, B):
            out = pipe(questions[start : start + B], images[start : start + B], max_new_tokens=args.max_new_tokens,
                       decoding=method, generator=make_generator(start))
            texts += out.texts
            forwards, tokens = forwards + out.stats.forwards, tokens + int(out.lengths.sum())
        return texts, forwards, tokens

    def continuous(method: str):
        out = pipe.answer_each(questions, images, [make_generator(i) for i in range(n)], batch_size=B,
                               max_new_tokens=args.max_new_tokens, decoding=method)
        return out.texts, out.stats.forwards, int(out.lengths.sum())

    rows = compare_modes(args.methods, static, continuous, n, B, args.repeats, "answers")
    if args.json:
        Path(args.json).write_text(json.dumps(rows) + "\n")
    return rows


if __name__ == "__main__":
    main()
