"""`mmgen generate speech`: speak a text with a text-to-speech model into a WAV file.

    mmgen generate speech --text "Hello there." --out hello.wav            # the bundled speech-tts, offline
    mmgen generate speech --model FOLDER_OR_REPO --text "Hello there." --out hello.wav
        [--voice prompt.wav --voice-text "transcript"] [--decoding draft --drafter SMALLER] [--stream]

The bundled `speech-tts` (a small Dia-layout model trained here on espeak-ng speech, with its
drafter `speech-tts-draft`) runs by default; any transformers Dia, CSM or VibeVoice folder or Hub
repo works too (a Dia's codec comes from the folder's `codec/`, or the one its processor names). `--stream` writes `OUT.partial` as frames commit (a
playable, growing WAV) and renames it to OUT at the end. An existing OUT is an error unless
`--overwrite`. The pipeline (and transformers) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mmgen.cli import DTYPES, add_family_flags, add_json_flag, check_output_file, family_flags, report, seed_arg

#: The bundled model `mmgen generate speech` speaks with when given none.
DEFAULT_MODEL = "speech-tts"


def register(commands, groups) -> None:
    from mmgen.audio.bench import register as register_bench

    register_bench(groups)
    speech = groups["generate"].add_parser("speech", help="speak a text into a WAV file (text-to-speech models)")
    speech.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME_OR_FOLDER",
                        help=f"the bundled {DEFAULT_MODEL} (default; its drafter is {DEFAULT_MODEL}-draft), or a "
                             "transformers Dia, CSM or VibeVoice folder, or a Hugging Face repo id")
    speech.add_argument("--text", required=True, help="what to say (Dia reads speaker tags: '[S1] ... [S2] ...')")
    speech.add_argument("--out", required=True, metavar="PATH.wav", help="the WAV file to write")
    speech.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (default: an error)")
    speech.add_argument("--voice", default=None, metavar="AUDIO", help="a voice prompt to continue from (any audio file)")
    speech.add_argument("--voice-text", default=None, help="the transcript of --voice")
    speech.add_argument("--decoding", default="ar", metavar="SPEC",
                        help="a frame decoder: ar (default), sjd, gsd, draft or entropy-switch (with --drafter); for "
                             "VibeVoice ar or cspd (with --drafter and --final-std); options as NAME:key=value,...")
    speech.add_argument("--drafter", default=None, metavar="NAME_OR_FOLDER",
                        help="for --decoding draft, entropy-switch or cspd: a smaller model of the same codec")
    add_family_flags(speech, "speech")  # each family's own options, from its record (VibeVoice: --final-std)
    speech.add_argument("--max-new-frames", type=int, default=None, help="decoder frames at most (default: the model's context)")
    speech.add_argument("--temperature", type=float, default=None, help="default the model's generation config; 0 is greedy")
    speech.add_argument("--top-k", type=int, default=None, help="sampling: keep the k most likely codes (default the model's)")
    speech.add_argument("--top-p", type=float, default=None, help="sampling: nucleus mass (default the model's)")
    speech.add_argument("--guidance-scale", type=float, default=None, help="Dia's classifier-free guidance (default the model's)")
    speech.add_argument("--seed", type=seed_arg, default=0, help="seed of the random generator, in [0, 2**63) (default 0)")
    speech.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N, mps")
    speech.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    speech.add_argument("--stream", action="store_true", help="write OUT.partial as audio is decoded, then rename it")
    add_json_flag(speech)
    speech.set_defaults(run=generate_speech)


def generate_speech(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from mmgen.decoding import parse_decoding
    from mmgen.loading import decoder_from_spec, load_pipeline, pipeline_class_of
    from mmgen.sampling import make_generator

    out = check_output_file(args.out, ".wav", args.overwrite)
    partial = out.with_name(out.name + ".partial")
    if args.stream and (partial.exists() or partial.is_symlink()):  # never written through, nor replaced unasked
        raise ValueError(f"{partial} exists (left by an interrupted --stream run?): remove it, or stream to another --out")
    if args.max_new_frames is not None and args.max_new_frames < 1:
        raise ValueError(f"--max-new-frames must be >= 1, got {args.max_new_frames}")
    if not args.text.strip():
        raise ValueError("--text is empty")
    if args.voice_text is not None and args.voice is None:
        raise ValueError("--voice-text is the transcript of --voice: give --voice too")
    if args.voice is not None and not Path(args.voice).is_file():
        raise ValueError(f"--voice {args.voice}: no such file")
    cls = pipeline_class_of(args.model)
    from mmgen.audio.pipeline import TTSPipeline

    if not issubclass(cls, TTSPipeline):
        raise ValueError(f"--model {args.model} holds a {cls.__name__}, not a text-to-speech model")
    method = parse_decoding(args.decoding)[0]
    if args.drafter is not None and method not in cls.companions:
        raise ValueError(f"--drafter is for --decoding {' or '.join(sorted(cls.companions))}, not {args.decoding!r}")
    options = family_flags(args, "speech", args.model, cls)
    transformers.utils.logging.disable_progress_bar()  # errors and the report stay the only output lines
    transformers.utils.logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    pipe = load_pipeline(args.model, device=args.device, dtype=dtype)
    given = {cls.companions[method].option: args.drafter} if args.drafter is not None else {}
    decoder = decoder_from_spec(args.decoding, pipe, args.model, args.device, dtype, **given)
    call = dict(voice=args.voice, voice_text=args.voice_text, max_new_frames=args.max_new_frames, decoding=decoder,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, guidance_scale=args.guidance_scale,
                generator=make_generator(args.seed, args.device), **options)
    if args.stream:
        output = _stream_to_file(pipe, args.text, out, call)
    else:
        from mmgen.audio.waveform import write_wav

        output = pipe(args.text, **call)
        write_wav(out, output.audio[0], output.sampling_rate)
    seconds = output.audio[0].numel() / output.sampling_rate
    report(args, [f"wrote {out} ({seconds:.2f} s of speech, {int(output.lengths[0])} frames)", output.stats.summary()],
           {"out": str(out), "seconds": round(seconds, 3), "frames": int(output.lengths[0]),
            "decode_s": round(output.decode_s, 3), "real_time_factor": round(output.real_time_factor, 3),
            "stats": output.stats.to_dict()})
    return 0


def _stream_to_file(pipe, text: str, out: Path, call: dict):
    """Append chunks to OUT.partial as they come (a WAV whose header is rewritten on each
    flush, so players can follow it), then rename it to OUT."""
    import soundfile

    from mmgen.files import fsync_dir

    partial = out.with_name(out.name + ".partial")
    try:
        with soundfile.SoundFile(partial, "w", samplerate=pipe.sampling_rate, channels=1, format="WAV", subtype="PCM_16") as file:
            stream = pipe.stream(text, **call)
            while True:
                try:
                    _, chunk = next(stream)
                except StopIteration as stop:
                    output = stop.value
                    break
                file.write(chunk.clamp(-1, 1).numpy())
                file.flush()
    except BaseException:
        partial.unlink(missing_ok=True)  # a failed or interrupted run leaves no half file behind
        raise
    os.replace(partial, out)
    fsync_dir(out.parent)
    return output
