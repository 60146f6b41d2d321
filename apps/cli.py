"""Demo subcommands of `mmgen`: `mmgen demo image` serves the image demo, `mmgen demo text` the
vision-language chat demo (`mmgen demo vlm`, its old name, still works until the next release),
`mmgen demo speech` the text-to-speech demo, `mmgen demo video` the streaming block-diffusion
video demo (Gradio).

Gradio is imported only when a demo runs, so building the `mmgen` parser stays cheap.
"""

from __future__ import annotations

import argparse
import sys

from mmgen.apps.requests.image import MAX_IMAGES
from mmgen.apps.requests import speech as speech_request, video as video_request, text as text_request

MAX_CONCURRENCY = 8
#: The text demo's old subcommand name, still accepted (with a note) until the next release.
OLD_TEXT_DEMO = "vlm"


def register(commands, groups) -> None:
    """Add the `demo` group and its `image`, `text`, `speech` and `video` subcommands."""
    if "demo" not in groups:
        groups["demo"] = commands.add_parser("demo", help="serve a Gradio demo app").add_subparsers(dest="target", required=True)
    image = groups["demo"].add_parser("image", help="class-conditional image generation with every decoding method")
    image.add_argument("--model", action="append", default=None, metavar="NAME_OR_FOLDER",
                       help="a bundled model name or a pipeline folder (repeatable; default: every bundled model). "
                            "Names ending in -draft/-small are companions (drafters, small models) of the model they extend")
    image.add_argument("--max-images", type=bounded_int(1, MAX_IMAGES, "--max-images"), default=4,
                       help=f"images per request, at most (default 4, up to {MAX_IMAGES})")
    _continuous_batch(image, "the images of requests that overlap in time (same model, a method that batches continuously: "
                             "ar or the sjd family, same sampling) in one continuous batch of ROWS rows; image i of a "
                             "request then comes from seed + i")
    _serving(image, "pipelines")
    image.set_defaults(run=run_image_demo)
    register_text(groups["demo"])
    register_speech(groups["demo"])
    register_video(groups["demo"])


def register_text(demos) -> None:
    """`mmgen demo text` (alias `vlm`, the old name): chat about uploaded images with any decoding
    method and token dropping."""
    vlm = demos.add_parser("text", aliases=[OLD_TEXT_DEMO],
                           help=f"chat about images with a vision-language model, every decoding method "
                                f"({OLD_TEXT_DEMO}: the old name, until the next release)")
    vlm.add_argument("--model", action="append", default=None, metavar="NAME_OR_FOLDER",
                     help=f"a bundled model name or a transformers VLM folder (repeatable; default: {text_request.DEFAULT_MODEL} "
                          "with its drafter). Names ending in -draft are drafters of the model they extend")
    vlm.add_argument("--max-images", type=bounded_int(1, text_request.MAX_IMAGES, "--max-images"), default=4,
                     help=f"images per conversation, at most (default 4, up to {text_request.MAX_IMAGES})")
    vlm.add_argument("--max-new-tokens", type=bounded_int(1, text_request.MAX_NEW_TOKENS, "--max-new-tokens"), default=128,
                     help=f"the answer-length slider's maximum (default 128, up to {text_request.MAX_NEW_TOKENS})")
    _continuous_batch(vlm, "the answers of requests that overlap in time (same model, a method that batches continuously: ar or sjd, "
                           "same temperature; no compare mode or token dropping) in one continuous batch of ROWS rows, "
                           "each answer the one its request gives alone")
    _serving(vlm)
    vlm.set_defaults(run=run_text_demo)


def register_speech(demos) -> None:
    """`mmgen demo speech`: speak a text with a text-to-speech model, every frame decoding method."""
    speech = demos.add_parser("speech", help="speak a text with a text-to-speech model, every decoding method")
    speech.add_argument("--model", action="append", default=None, metavar="NAME_OR_FOLDER",
                        help=f"a bundled name or a transformers Dia, CSM or VibeVoice folder (repeatable; default: "
                             f"{speech_request.DEFAULT_MODEL} with its drafter). A folder FOLDER-draft beside it comes "
                             "along as its drafter")
    speech.add_argument("--max-new-frames", type=bounded_int(1, speech_request.MAX_NEW_FRAMES, "--max-new-frames"),
                        default=speech_request.DEFAULT_MAX_NEW_FRAMES,
                        help=f"the frame-budget slider's maximum (default {speech_request.DEFAULT_MAX_NEW_FRAMES}, "
                             f"up to {speech_request.MAX_NEW_FRAMES}; a model's own context bounds it too)")
    _continuous_batch(speech, "the speech of requests that overlap in time (same Dia or CSM model, a method "
                              "that batches continuously: ar or sjd, same sampling; no compare mode) in one continuous batch of ROWS rows, "
                              "each output the one its request gives alone")
    _serving(speech)
    speech.set_defaults(run=run_speech_demo)


def register_video(demos) -> None:
    """`mmgen demo video`: make a video block by block with a block-diffusion model, each block shown as it is made."""
    video = demos.add_parser("video", help="make a video block by block with a block-diffusion model, streaming each block")
    video.add_argument("--model", action="append", default=None, metavar="NAME_OR_FOLDER",
                       help=f"a bundled name or a BlockDiffusionVideoPipeline folder (repeatable; default: "
                            f"{video_request.DEFAULT_MODEL} with its small model). A folder FOLDER-small beside it comes "
                            "along as its small model, for collaborative denoising")
    video.add_argument("--max-frames", type=bounded_int(1, video_request.MAX_FRAMES, "--max-frames"),
                       default=video_request.DEFAULT_MAX_FRAMES,
                       help=f"the longest video offered, in frames (default {video_request.DEFAULT_MAX_FRAMES}, "
                            f"up to {video_request.MAX_FRAMES})")
    _serving(video)
    video.set_defaults(run=run_video_demo)


def _continuous_batch(demo, what: str) -> None:
    demo.add_argument("--continuous-batch", type=bounded_int(0, 64, "--continuous-batch"), default=0, metavar="ROWS",
                      help=f"decode {what}. Use with --concurrency > 1 (default 0: off)")


def _serving(demo, models: str = "models") -> None:
    """What every demo takes besides its own settings: the device of its models, where it
    listens, and how many requests it decodes at once."""
    demo.add_argument("--device", default="cpu", help=f"torch device of the {models} (default: cpu)")
    demo.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    demo.add_argument("--port", type=bounded_int(1, 65535, "--port"), default=None, help="default: Gradio's (7860 or the next free)")
    demo.add_argument("--share", action="store_true", help="also open a public Gradio share link (off by default)")
    demo.add_argument("--concurrency", type=bounded_int(1, MAX_CONCURRENCY, "--concurrency"), default=1,
                      help="requests decoded at once (default 1; one model serves one request at a time)")


def run_image_demo(args: argparse.Namespace) -> int:
    from mmgen.cli import check_device

    check_device(args.device)  # a bad or missing device fails here, in one line, before any model loads
    from mmgen.apps.image_demo import ImageCatalog, build_demo, launch_demo

    catalog = ImageCatalog.discover(args.model, device=args.device)
    catalog.continuous_batch = args.continuous_batch
    demo = build_demo(catalog, max_images=args.max_images, concurrency=args.concurrency)
    print(f"mmgen demo image: models {list(catalog.main)} (companions {list(catalog.companions)}) on {args.device}")
    launch_demo(demo, host=args.host, port=args.port, share=args.share)
    return 0


def run_text_demo(args: argparse.Namespace) -> int:
    from mmgen.cli import check_device

    if args.target == OLD_TEXT_DEMO:
        print(f"mmgen demo: note: `mmgen demo {OLD_TEXT_DEMO}` is now `mmgen demo text`; the old name goes in the "
              "next release", file=sys.stderr)
    check_device(args.device)
    catalog = text_request.VLMCatalog.discover(args.model, device=args.device)  # bad names fail before gradio loads
    catalog.continuous_batch = args.continuous_batch
    from mmgen.apps.text_demo import build_demo, launch_demo

    demo = build_demo(catalog, max_images=args.max_images, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency)
    print(f"mmgen demo text: models {list(catalog.main)} (drafters {list(catalog.companions)}) on {args.device}")
    launch_demo(demo, host=args.host, port=args.port, share=args.share)
    return 0


def run_speech_demo(args: argparse.Namespace) -> int:
    from mmgen.cli import check_device

    check_device(args.device)
    catalog = speech_request.SpeechCatalog.discover(args.model, device=args.device)  # bad folders fail before gradio loads
    catalog.continuous_batch = args.continuous_batch
    from mmgen.apps.speech_demo import build_demo, launch_demo

    demo = build_demo(catalog, max_new_frames=args.max_new_frames, concurrency=args.concurrency)
    print(f"mmgen demo speech: models {list(catalog.main)} (drafters {list(catalog.companions)}) on {args.device}")
    launch_demo(demo, host=args.host, port=args.port, share=args.share)
    return 0


def run_video_demo(args: argparse.Namespace) -> int:
    from mmgen.cli import check_device

    check_device(args.device)
    catalog = video_request.VideoCatalog.discover(args.model, device=args.device)  # bad folders fail before gradio loads
    from mmgen.apps.video_demo import build_demo, launch_demo

    demo = build_demo(catalog, max_frames=args.max_frames, concurrency=args.concurrency)
    print(f"mmgen demo video: models {list(catalog.main)} (small models {list(catalog.companions)}) on {args.device}")
    launch_demo(demo, host=args.host, port=args.port, share=args.share)
    return 0


def bounded_int(low: int, high: int, flag: str):
    """An argparse type: an integer in [low, high], refused in one line naming `flag`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} must be in [{low}, {high}], got {value}")
        return value

    return parse
