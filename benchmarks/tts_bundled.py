"""The bundled text-to-speech pair (`speech-tts` and its drafter `speech-tts-draft`) on held-out
utterances: transformers' own `DiaForConditionalGeneration.generate` (and its assisted generation
with the drafter, where Dia's `generate` takes it) against mmgen's frame decoders through
`TTSPipeline` (AR, SJD, prompt lookup, the drafter, entropy switching), on the same weights, in one process.

    python -m benchmarks.tts_bundled --model audio/assets/speech-tts --draft audio/assets/speech-tts-draft \
        --codes runs/speech-codes-long.npz --utterances 20 --threads 1 \
        --out runs/tts-bundled.json [--greedy] [--data data/speech16k.npz]

Sampling is the model's own generation config (read from the pipeline: Dia samples at its
temperature and top-k, with its classifier-free guidance); every method draws from one seed per
utterance (`--seed` + the utterance's index), so they differ only where their draws do. `--greedy`
decodes greedily instead and first checks, per utterance, that mmgen's AR frames equal
`generate`'s (as `tts_decoding.py` does), then reports which methods gave `generate`'s frames.

Methods run interleaved per utterance (order rotated per utterance, so a busy machine slows all
alike) after one untimed warm-up call each, which also finds the methods that cannot run: those
are reported with their error instead of figures. Per method, medians over utterances of: decoder
frames per target forward (prefill included; `generate` takes one per frame), milliseconds per
decoder frame (decode time, from the conditions to the last frame, codec decoding excluded on both
sides, over the frames decoded, the delay tail included) with its spread across utterances (IQR
and min-max: utterance length moves it too), and the real-time factor (decode seconds over
seconds of audio); and the phoneme error rate of the generated audio against the utterances'
reference phonemes under the project's CTC recogniser (`mmgen.audio.recogniser`: the bundled one
unless `--recogniser` names a folder or a `train_speech.py phonemes` run), over all utterances.
Target forwards are the target's alone (the drafter's are in the JSON); under entropy switching the
target runs only where the drafter is unsure, and the share of frames it sampled is printed.
For scale: the PER of the corpus codes decoded by the bundle's codec, and with `--data` of the real
espeak-ng audio.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from training.data.speech import SAMPLE_RATE
from training.train_speech import load_recogniser
from training.train_tts import CodesData, codec_round_trip_per
from mmgen.audio.bench import transformers_generate
from mmgen.audio.recogniser import phoneme_error_rate

GENERATE = "transformers generate"


@dataclass
class Decoded:
    """One method's decode of one utterance: its generated (delayed) frames [n, C], the audio,
    the decode seconds, the forwards of the target and of the drafter, and the frames the target
    sampled (all but the drafter's under entropy switching)."""

    frames: torch.Tensor
    audio: torch.Tensor
    seconds: float
    target_forwards: int
    draft_forwards: int = 0
    target_frames: Optional[int] = None


def held_out(path: str, count: int) -> list[dict[str, Any]]:
    """The first `count` held-out utterances of a codes file: text, reference phonemes, codes [T, C]."""
    data, raw = CodesData(path, "eval"), np.load(path)
    phonemes = raw["phonemes"][np.flatnonzero(raw["is_eval"].astype(bool))]  # CodesData's held-out order
    return [{"text": t, "phonemes": str(p), "codes": c} for t, p, c in zip(data.texts, phonemes, data.codes)][:count]


def methods(target: Any, drafter: Any, greedy: bool, num_draft: int,
            threshold: Optional[float] = None, confidence: tuple[float, ...] = ()) -> dict[str, Callable[..., Decoded]]:
    """name -> f(text, seed, max_new_frames) -> Decoded, for batch-1 calls; one draft row per
    drafter confidence stop in `confidence` (a round ends at the first frame its drafter gave
    less than C)."""
    from mmgen.decoding import DraftSpeculative, EntropySwitch

    adapter = target.adapter

    def hf(**extra):
        def run(text, seed, frames):
            conditions, budget = target.prepare(text, max_new_frames=frames)
            prefix = conditions.decoder_input_ids.shape[1] - max(adapter.delay)  # rows before the first generated frame
            torch.manual_seed(seed)  # transformers draws from the global generator
            begun = time.perf_counter()
            out = transformers_generate(target, conditions, budget, greedy, **extra)
            seconds = time.perf_counter() - begun
            generated = out[0, prefix:]
            codes = adapter.codes(generated)[0]
            audio = target.codec.decode(codes) if codes.shape[1] else torch.zeros(0)
            return Decoded(generated, audio, seconds, len(generated), target_frames=len(generated))
        return run

    def ours(decoding):
        def run(text, seed, frames):
            out = target(text, max_new_frames=frames, decoding=decoding, temperature=0 if greedy else None,
                         generator=torch.Generator().manual_seed(seed))
            stats, n = out.stats, int(out.lengths[0])
            forwards = stats.stage_forwards or [stats.forwards, stats.draft_forwards]  # entropy switch: per model
            sampled = stats.stage_tokens[0] if stats.stage_tokens else n
            return Decoded(out.frames[0, :n], out.audio[0], out.decode_s, forwards[0], forwards[1], sampled)
        return run

    return {
        GENERATE: hf(),
        "transformers assisted (drafter)": hf(assistant_model=drafter.model),
        "mmgen ar": ours("ar"),
        "mmgen sjd": ours("sjd"),
        "mmgen lookup": ours("lookup"),
        f"mmgen draft ({num_draft})": ours(DraftSpeculative(drafter=drafter, num_draft=num_draft)),
        "mmgen entropy-switch": ours(EntropySwitch(small=drafter, **({} if threshold is None else {"threshold": threshold}))),
        **{f"mmgen draft ({num_draft}) confidence {c}": ours(DraftSpeculative(drafter=drafter, num_draft=num_draft, confidence=c))
           for c in confidence},
    }


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and range."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def summarise(name: str, runs: list[Decoded], generated: Optional[list[Decoded]], refs: list[str],
              heard: list[str], rate: int) -> dict[str, Any]:
    """One method's row: per-utterance figures and their medians, PER over all utterances."""
    per_utterance = [{
        "frames": len(d.frames), "audio_s": len(d.audio) / rate, "decode_s": d.seconds,
        "ms_per_frame": 1000 * d.seconds / len(d.frames), "rtf": d.seconds / max(len(d.audio) / rate, 1e-9),
        "frames_per_forward": len(d.frames) / d.target_forwards, "target_forwards": d.target_forwards,
        "draft_forwards": d.draft_forwards, "target_frames": d.target_frames,
        "identical_to_generate": generated is not None and torch.equal(d.frames, generated[i].frames),
        "per": phoneme_error_rate([ref], [hyp]), "heard": hyp,
    } for i, (d, ref, hyp) in enumerate(zip(runs, refs, heard))]
    median = lambda key: statistics.median(r[key] for r in per_utterance)
    total = lambda key: sum(r[key] for r in per_utterance)
    return {"method": name, "frames_per_forward": median("frames_per_forward"),
            "ms_per_frame": spread([r["ms_per_frame"] for r in per_utterance]), "rtf": median("rtf"),
            "per": phoneme_error_rate(refs, heard), "frames": median("frames"), "audio_s": median("audio_s"),
            "draft_forwards_per_frame": total("draft_forwards") / total("frames"),
            "target_frame_share": total("target_frames") / total("frames"),
            "identical_to_generate": total("identical_to_generate") / len(per_utterance), "utterances": per_utterance}


def reference_per(pipe: Any, recogniser: Any, utterances: list[dict[str, Any]], data: Optional[str]) -> dict[str, float]:
    """PER of the utterances' corpus codes decoded by the pipeline's codec and (`data`: the
    corpus waveforms) of the real espeak-ng audio."""
    refs = [u["phonemes"] for u in utterances]
    out = {"codec round trip": codec_round_trip_per(pipe.codec, [u["codes"] for u in utterances], refs, recogniser)}
    if data:
        from training.data.speech import load_corpus, utterance

        corpus = load_corpus(data)
        index = np.flatnonzero(corpus["is_eval"])[: len(utterances)]
        if [str(corpus["text"][i]) for i in index] != [u["text"] for u in utterances]:
            raise ValueError(f"{data} is not the corpus of the codes file")
        waves = [torch.from_numpy(utterance(corpus, i).astype(np.float32) / 32768) for i in index]
        out["real espeak-ng audio"] = phoneme_error_rate(refs, recogniser.transcribe(waves, SAMPLE_RATE))
    return out


def report(result: dict[str, Any]) -> None:
    """The markdown table, the setting and the command line."""
    sampling = result["sampling"]
    columns = "| method | frames/forward | ms/frame | ms/frame IQR | ms/frame min–max | RTF | PER | = generate |"
    print(columns)
    print("|" + "---|" * (columns.count("|") - 1))
    for r in result["rows"]:
        t = r["ms_per_frame"]
        print(f"| {r['method']} | {r['frames_per_forward']:.2f} | {t['median']:.2f} | {t['q1']:.2f}–{t['q3']:.2f} | "
              f"{t['min']:.2f}–{t['max']:.2f} | {r['rtf']:.3f} | {r['per']:.1%} | {r['identical_to_generate']:.0%} |")
    for name, error in result["failures"].items():
        print(f"| {name} | {error} |")
    for name, per in result["reference_per"].items():
        print(f"| ({name}) | | | | | | {per:.1%} | |")
    print(f"\n{result['utterances']} held-out utterances, medians over utterances (PER over all of them); "
          f"{'greedy' if result['greedy'] else 'sampled'} (temperature {sampling['temperature']}, top-k {sampling['top_k']}, "
          f"guidance {sampling['guidance_scale']}), {result['threads']} thread(s), {result['dtype']}; "
          "= generate: share of utterances whose frames equal generate's (same seed)")
    for r in result["rows"]:
        if r["target_frame_share"] < 1:
            print(f"{r['method']}: the target sampled {r['target_frame_share']:.1%} of the frames, the drafter the rest")
    print(result["command"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target's pipeline folder (speech-tts)")
    p.add_argument("--draft", required=True, help="the drafter's pipeline folder (speech-tts-draft)")
    p.add_argument("--codes", required=True, help="codes file of `train_speech.py tokenize` (text, phonemes, is_eval)")
    p.add_argument("--recogniser", default=None, help="a phoneme recogniser folder or a run of `train_speech.py "
                   "phonemes` (default: the bundled audio/assets/phoneme-recogniser)")
    p.add_argument("--data", default=None, help="the corpus waveforms (data/speech16k.npz): also report the PER of real audio")
    p.add_argument("--utterances", type=int, default=20, help="the first N held-out utterances")
    p.add_argument("--max-frames", type=int, default=None, help="frame budget per utterance (default: the model's context)")
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--confidence", type=float, nargs="+", default=[], metavar="C",
                   help="also time draft with a drafter confidence stop at C (rows 'mmgen draft (K) confidence C')")
    p.add_argument("--entropy-threshold", type=float, default=None, help="entropy switching's threshold in nats "
                   "(default the decoder's; a frame's entropy under top-k k is at most ln k)")
    p.add_argument("--greedy", action="store_true", help="greedy instead of the generation config's sampling")
    p.add_argument("--seed", type=int, default=0, help="utterance i draws from seed + i (every method)")
    p.add_argument("--dtype", choices=("float32", "bundle"), default="float32",
                   help="compute dtype (bundle: as saved, float16, slower on CPU)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default=None, help="comma-separated subset of the method names (default: all)")
    p.add_argument("--out", default=None, help="JSON of the results")
    args = p.parse_args(argv)
    import transformers

    from mmgen.audio.pipeline import TTSPipeline

    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dtype = torch.float32 if args.dtype == "float32" else None
    target, drafter = TTSPipeline.from_pretrained(args.model, dtype), TTSPipeline.from_pretrained(args.draft, dtype)
    recogniser = load_recogniser(args.recogniser)
    utterances = held_out(args.codes, args.utterances)
    refs = [u["phonemes"] for u in utterances]
    runs = methods(target, drafter, args.greedy, args.num_draft, args.entropy_threshold, tuple(args.confidence))
    if args.methods:
        chosen = [m.strip() for m in args.methods.split(",")]
        unknown = [m for m in chosen if m not in runs]
        if unknown:
            raise SystemExit(f"unknown method(s) {unknown}: choose from {list(runs)}")
        runs = {name: run for name, run in runs.items() if name in chosen}
    failures = {}
    with torch.no_grad():
        for name in list(runs):  # warm-up; a method that cannot run on this model is reported, not timed
            try:
                runs[name](utterances[0]["text"], args.seed, 16)
            except Exception as error:
                first = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                failures[name] = f"not supported by transformers' Dia generate: {first}" if name.startswith("transformers") else first
                del runs[name]
        names = list(runs)
        decoded: dict[str, list[Decoded]] = {n: [] for n in names}
        for i, u in enumerate(utterances):  # interleaved: each utterance runs every method once
            for name in names[i % len(names):] + names[: i % len(names)]:
                decoded[name].append(runs[name](u["text"], args.seed + i, args.max_frames))
            if args.greedy:
                assert torch.equal(decoded["mmgen ar"][i].frames, decoded[GENERATE][i].frames), \
                    f"utterance {i}: greedy mmgen ar differs from generate"
    rate = target.sampling_rate
    rows = [summarise(name, decoded[name], decoded.get(GENERATE), refs,
                      recogniser.transcribe([d.audio for d in decoded[name]], rate), rate) for name in names]
    references = reference_per(target, recogniser, utterances, args.data)
    command = "python -m benchmarks.tts_bundled " + shlex.join(sys.argv[1:] if argv is None else argv)
    sampling = target.sampling(0.0 if args.greedy else None, None, None)
    result = {"command": command, "model": args.model, "draft": args.draft, "utterances": len(utterances),
              "threads": torch.get_num_threads(), "dtype": str(target.model.dtype), "greedy": args.greedy,
              "seed": args.seed, "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k,
                                               "top_p": sampling.top_p, "guidance_scale": target.model.generation_config.guidance_scale},
              "max_frames": args.max_frames, "num_draft": args.num_draft, "entropy_threshold": args.entropy_threshold,
              "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows, "failures": failures,
              "reference_per": references}
    report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return result


if __name__ == "__main__":
    main()
