"""`mmgen bench speech`: a speech model's decoding methods against autoregressive decoding, and
against transformers' own `generate` on the same weights (Dia), in one process.

    mmgen bench speech --models speech-tts --methods ar sjd lookup draft --inputs 8 --json out/speech.json

Each input is a held-out text of the bundled corpus (`mmgen.audio.heldout`), spoken at batch 1
with the model's own sampling (`--greedy`: greedy) and one seed per text, the same for every
method. Units are decoder frames: frames per target forward (prefill included; `generate`
takes one forward per frame), milliseconds per frame (decode time, codec decoding excluded on
every side), the speedup against the first method (paired per text), the drafter's forwards
per frame, and how many texts gave the first method's frames (all of them, for a lossless
method decoding greedily; sampled, lossless methods draw differently but from the same law).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from mmgen.benchmarking import Run, add_method_arguments, compare_methods, run_methods

GENERATE = "transformers generate"


def transformers_generate(pipe: Any, conditions: Any, frames: int, greedy: bool = True, **options: Any) -> torch.Tensor:
    """transformers' `generate` on the pipeline's conditions: greedy, or sampled as the model's
    generation config says; `options` go to `generate` (assistant_model=, ...)."""
    model = pipe.model
    # The pipeline's conditions are device-free (its token model moves them); generate's are not.
    on_model = lambda t: t.to(model.device)
    sampling = {"do_sample": False} if greedy else {}
    if pipe.adapter.__class__.__name__ == "DiaSpeech":
        return model.generate(input_ids=on_model(conditions.input_ids), attention_mask=on_model(conditions.attention_mask),
                              decoder_input_ids=on_model(conditions.decoder_input_ids),
                              decoder_attention_mask=on_model(conditions.decoder_attention_mask),
                              max_new_tokens=frames, guidance_scale=conditions.guidance_scale, **sampling, **options)
    depth = {"depth_decoder_do_sample": False} if greedy else {}
    return model.generate(input_ids=on_model(conditions.input_ids), attention_mask=on_model(conditions.attention_mask),
                          max_new_tokens=frames, **sampling, **depth, **options)


def register(groups: dict) -> None:
    bench = groups["bench"].add_parser("speech", help="speech models: decoding methods against autoregressive decoding "
                                       "and transformers' generate", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_method_arguments(bench, "speech-tts", ["ar", "sjd", "lookup", "draft"], inputs=8)
    bench.add_argument("--max-new-frames", type=int, default=96, help="decoder frames per text at most")
    bench.add_argument("--greedy", action="store_true", help="decode greedily (default: the model's own sampling)")
    bench.add_argument("--no-transformers", action="store_true", help="leave out transformers' generate (Dia models)")
    bench.set_defaults(run=run_bench)


def rows(pipe: Any, args: argparse.Namespace, progress: Optional[tqdm] = None) -> list[dict]:
    from mmgen.audio.heldout import held_out_texts

    def ours(spec: str):
        def run(text: str, seed: int) -> Run:
            out = pipe(text, decoding=spec, max_new_frames=args.max_new_frames, temperature=0 if args.greedy else None,
                       generator=torch.Generator().manual_seed(seed))
            n, stats = int(out.lengths[0]), out.stats
            forwards = stats.stage_forwards or [stats.forwards, stats.draft_forwards]  # entropy switch: per model
            return Run(out.frames[0, :n], n, out.decode_s, forwards[0], forwards[1])
        return run

    def generate(text: str, seed: int) -> Run:
        conditions, budget = pipe.prepare(text, max_new_frames=args.max_new_frames)
        prefix = conditions.decoder_input_ids.shape[1] - max(pipe.adapter.delay)  # rows before the first generated frame
        torch.manual_seed(seed)  # transformers draws from the global generator
        begun = time.perf_counter()
        out = transformers_generate(pipe, conditions, budget, args.greedy)
        seconds = time.perf_counter() - begun
        generated = out[0, prefix:]
        return Run(generated, len(generated), seconds, len(generated))

    methods = {spec: ours(spec) for spec in args.methods}
    if not args.no_transformers and type(pipe.adapter).__name__ == "DiaSpeech":
        methods[GENERATE] = generate
    return compare_methods(held_out_texts(args.inputs), methods, args.repeats, args.warmup, progress)


def run_bench(args: argparse.Namespace) -> int:
    if args.max_new_frames < 1:
        raise ValueError(f"--max-new-frames must be at least 1, got {args.max_new_frames}")
    print(run_methods(args, lambda pipe, name, progress: rows(pipe, args, progress)))
    return 0
