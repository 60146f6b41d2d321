"""Per-frame latency of text-to-speech decoding: transformers' `generate` against mmgen's frame
decoders on the same weights, in one process, interleaved, medians.

    python -m benchmarks.tts_decoding --family dia --size official --frames 24 --repeats 3 --threads 2
    python -m benchmarks.tts_decoding --family csm --size official --frames 8 --repeats 3 --threads 2
    python -m benchmarks.tts_decoding --family dia --size tiny --frames 64 --repeats 5

`official` builds random weights in the official configurations (transformers' config
defaults are Dia-1.6B and CSM-1B); `tiny` the test models. Reported per method: seconds per
frame (wall time of the whole decode over its frames, prefill included, codec decoding
excluded on both sides), frames per target forward, and, for the core's token model, one AR step against one 16-frame verify forward on
a warm cache (what a speculative window costs). Greedy outputs of every method are checked to
be identical to `generate`'s before any time is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mmgen.audio.bench import transformers_generate


def build(family: str, size: str):
    """(pipeline, text) with random weights."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    from tests.audio import tiny

    if size == "tiny":
        return (tiny.tiny_dia(0), "[S1] Hello there, how are you today?") if family == "dia" else (tiny.tiny_csm(0), "Hello there.")
    from mmgen.audio.pipeline import TTSPipeline

    torch.manual_seed(0)
    if family == "dia":
        from transformers import DacConfig, DacModel, DiaConfig, DiaForConditionalGeneration, DiaTokenizer

        model = DiaForConditionalGeneration(DiaConfig()).eval()
        codec = DacModel(DacConfig(sampling_rate=44100, downsampling_ratios=[2, 4, 8, 8])).eval()
        return TTSPipeline(model, DiaTokenizer(), codec), "[S1] Hello there, how are you today?"
    from transformers import CsmConfig, CsmForConditionalGeneration

    model = CsmForConditionalGeneration(CsmConfig(text_vocab_size=261, bos_token_id=256, audio_token_id=258,
                                                  audio_eos_token_id=259, pad_token_id=260)).eval()
    return TTSPipeline(model, tiny.byte_tokenizer(), model.codec_model), "Hello there."


def step_latency(pipe, conditions, width: int, repeats: int) -> float:
    """Median seconds of one forward of `width` frames on a cache warmed with 8 frames."""
    model = pipe.token_model()
    times = []
    for _ in range(repeats):
        state = model.start(conditions, 64, False)
        frames = state.first_logits.cond.argmax(-1)
        for _ in range(8):
            frames = model.forward(state, frames[:, -1:]).cond.argmax(-1)
            model.commit(state, torch.ones(state.batch_size, dtype=torch.long))
        window = frames[:, -1:].expand(-1, width, -1).contiguous()
        start = time.perf_counter()
        model.forward(state, window)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=("dia", "csm"), default="dia")
    p.add_argument("--size", choices=("tiny", "official"), default="tiny")
    p.add_argument("--frames", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe, text = build(args.family, args.size)
    params = sum(p.numel() for p in pipe.model.parameters() if p is not pipe.codec.model)
    conditions, budget = pipe.prepare(text, max_new_frames=args.frames)
    from mmgen.decoding import resolve_decoder
    from mmgen.sampling import SamplingConfig

    def mmgen(spec):  # the frames only, as `generate` returns them: no codec decode in the timing
        decoder = resolve_decoder(spec)
        return lambda: decoder.generate(pipe.token_model(), conditions, budget, SamplingConfig(temperature=0),
                                        torch.Generator().manual_seed(0), stopping=pipe.adapter.stopping(budget))

    methods = {
        "transformers generate": lambda: transformers_generate(pipe, conditions, args.frames),
        "mmgen ar": mmgen("ar"),
        "mmgen sjd": mmgen("sjd:window=8"),  # the adaptive window (the default)
        "mmgen sjd, fixed window 8": mmgen("sjd:window=8,adapt=false"),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    results = {}
    with torch.no_grad():
        for _ in range(args.repeats):  # interleaved: each repeat runs every method once
            for name, run in methods.items():
                start = time.perf_counter()
                results[name] = run()
                times[name].append(time.perf_counter() - start)
    reference = results["transformers generate"]
    reference = reference[:, -args.frames:] if args.family == "dia" else reference
    for name in (name for name in methods if name.startswith("mmgen")):
        out = results[name]
        n = int(out.lengths[0])
        assert torch.equal(out.tokens[0, :n], reference[0, :n]), f"{name} differs from generate"
    frames = int(results["mmgen ar"].lengths[0])
    report = {"family": args.family, "size": args.size, "parameters": params, "frames": frames, "threads": torch.get_num_threads(),
              "methods": {}}
    for name, values in times.items():
        entry = {"s_per_frame": statistics.median(values) / frames, "spread": (max(values) - min(values)) / statistics.median(values)}
        if name != "transformers generate":
            entry["frames_per_forward"] = results[name].stats.to_dict()["step_compression"]
        report["methods"][name] = entry
    step, verify = step_latency(pipe, conditions, 1, args.repeats), step_latency(pipe, conditions, 16, args.repeats)
    report["ar_step_s"], report["verify16_s"], report["verify16_over_step"] = step, verify, verify / step
    print(json.dumps(report, indent=1))
    base = report["methods"]["transformers generate"]["s_per_frame"]
    print(f"| {args.family} {args.size} ({params / 1e6:.1f}M) | " + " | ".join(
        f"{name}: {m['s_per_frame'] * 1000:.1f} ms/frame ({base / m['s_per_frame']:.2f}x)" for name, m in report["methods"].items())
        + f" | AR step {step * 1000:.1f} ms, 16-frame verify {verify * 1000:.1f} ms ({verify / step:.2f}x) |")


if __name__ == "__main__":
    main()
