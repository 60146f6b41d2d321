"""Pipelines under `torch.inference_mode` (what they run since `mmgen.inference`) against the same
calls under `torch.no_grad` (what they ran before, and what transformers' `generate` and
diffusers' pipelines run), on the bundled models, in one process.

    python -m benchmarks.inference_mode --threads 1 --repeats 7 [--cases vlm-ar vlm-draft speech image-sjd video]

Each case is one pipeline call repeated over a few inputs (one round); rounds alternate the two
modes (one warm-up round each first), and the table gives each mode's median round with its
spread and the ratio of medians (above 1: inference mode faster). The no_grad side calls the
undecorated body of the same method (`__wrapped__`), so the two differ only in the mode of the
decode (the image VQ decoder and the video prompt encoder, decorated entries of their own, run
under inference mode on both sides); every case checks both modes give the same outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch


def vlm_case(decoding: str, questions: int) -> Callable[[Callable], list]:
    from PIL import Image

    from benchmarks.vlm_decoding import load_eval
    from mmgen.loading import load_pipeline, resolve_model

    pipe = load_pipeline("emoji-vlm")
    records, images = load_eval(Path(resolve_model("emoji-vlm")).parent)
    records = [r for r in records if r["kind"] == "sentence"][:questions]
    pictures = [Image.fromarray(images[r["index"]]) for r in records]

    def run(call: Callable) -> list:
        return [call(pipe, r["question"], p, max_new_tokens=48, decoding=decoding).token_ids[0].tolist()
                for r, p in zip(records, pictures)]

    return run


def speech_case(texts: int) -> Callable[[Callable], list]:
    from benchmarks.train_tts import EVERYDAY_TEXTS
    from mmgen.loading import load_pipeline

    pipe = load_pipeline("speech-tts")

    def run(call: Callable) -> list:
        return [call(pipe, text, generator=torch.Generator().manual_seed(k)).frames.tolist()
                for k, text in enumerate(EVERYDAY_TEXTS[:texts])]

    return run


def image_case(decoding: str, images: int) -> Callable[[Callable], list]:
    from mmgen.loading import load_pipeline

    pipe = load_pipeline("emoji64")
    pipe.set_progress_bar_config(disable=True)

    def run(call: Callable) -> list:
        return [call(pipe, [k], decoding=decoding, generator=torch.Generator().manual_seed(k), output_type="np").tokens.tolist()
                for k in range(images)]

    return run


def video_case() -> Callable[[Callable], list]:
    from mmgen.loading import load_pipeline

    pipe = load_pipeline("emoji-motion")
    pipe.set_progress_bar_config(disable=True)

    def run(call: Callable) -> list:
        return [call(pipe, "cat face moving left", generator=torch.Generator().manual_seed(0), decode="end").frames.tolist()]

    return run


CASES: dict[str, Callable[[argparse.Namespace], Callable]] = {
    "vlm-ar": lambda a: vlm_case("ar", a.questions),
    "vlm-draft": lambda a: vlm_case("draft", a.questions),
    "speech": lambda a: speech_case(a.texts),
    "image-ar": lambda a: image_case("ar", a.images),
    "image-sjd": lambda a: image_case("sjd", a.images),
    "video": lambda a: video_case(),
}


def inference_call(pipe: Any, *args: Any, **kwargs: Any) -> Any:
    return pipe(*args, **kwargs)


def no_grad_call(pipe: Any, *args: Any, **kwargs: Any) -> Any:
    with torch.no_grad():
        return type(pipe).__call__.__wrapped__(pipe, *args, **kwargs)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--questions", type=int, default=16, help="VLM sentence questions per round")
    p.add_argument("--texts", type=int, default=3, help="speech texts per round")
    p.add_argument("--images", type=int, default=2, help="images per round")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    modes = {"no_grad": no_grad_call, "inference_mode": inference_call}
    rows = []
    print("| case | no_grad s (median, spread) | inference_mode s (median, spread) | ratio | same outputs |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        run = CASES[case](args)
        outputs = {mode: run(call) for mode, call in modes.items()}  # warm-up, and the outputs compared
        seconds: dict[str, list[float]] = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in (list(modes) if repeat % 2 == 0 else list(modes)[::-1]):
                begun = time.perf_counter()
                run(modes[mode])
                seconds[mode].append(time.perf_counter() - begun)
        median = {mode: statistics.median(s) for mode, s in seconds.items()}
        row = {"case": case, "seconds": {m: [round(x, 4) for x in s] for m, s in seconds.items()},
               "median_s": {m: round(v, 4) for m, v in median.items()},
               "ratio": round(median["no_grad"] / median["inference_mode"], 3),
               "same_outputs": outputs["no_grad"] == outputs["inference_mode"]}
        rows.append(row)
        spread = {m: f"{min(s):.3f}–{max(s):.3f}" for m, s in seconds.items()}
        print(f"| {case} | {median['no_grad']:.3f} ({spread['no_grad']}) | {median['inference_mode']:.3f} "
              f"({spread['inference_mode']}) | {row['ratio']:.3f}x | {'yes' if row['same_outputs'] else 'NO'} |", flush=True)
    result = {"threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
              "transformers": transformers.__version__, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
