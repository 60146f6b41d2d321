"""Demo subcommands of `mmgen`: `mmgen demo image` serves the image demo (Gradio).

Gradio is imported only when a demo runs, so building the `mmgen` parser stays cheap.
"""

from __future__ import annotations

import argparse

from mmgen.apps.image_request import MAX_IMAGES

MAX_CONCURRENCY = 8


def register(commands, groups) -> None:
    """Add the `demo` group and its `image` subcommand."""
    if "demo" not in groups:
        groups["demo"] = commands.add_parser("demo", help="serve a Gradio demo app").add_subparsers(dest="target", required=True)
    image = groups["demo"].add_parser("image", help="class-conditional image generation with every decoding method")
    image.add_argument("--model", action="append", default=None, metavar="NAME_OR_FOLDER",
                       help="a bundled model name or a pipeline folder (repeatable; default: every bundled model). "
                            "Names ending in -draft/-small are companions (drafters, refiners) of the model they extend")
    image.add_argument("--device", default="cpu", help="torch device of the pipelines (default: cpu)")
    image.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    image.add_argument("--port", type=_bounded(1, 65535, "--port"), default=None, help="default: Gradio's (7860 or the next free)")
    image.add_argument("--share", action="store_true", help="also open a public Gradio share link (off by default)")
    image.add_argument("--max-images", type=_bounded(1, MAX_IMAGES, "--max-images"), default=4,
                       help=f"images per request, at most (default 4, up to {MAX_IMAGES})")
    image.add_argument("--concurrency", type=_bounded(1, MAX_CONCURRENCY, "--concurrency"), default=1,
                       help="requests decoded at once (default 1; one model serves one request at a time)")
    image.set_defaults(run=run_image_demo)


def run_image_demo(args: argparse.Namespace) -> int:
    from mmgen.cli import check_device

    check_device(args.device)  # a bad or missing device fails here, in one line, before any model loads
    from mmgen.apps.image_demo import ModelCatalog, build_demo, launch_demo

    catalog = ModelCatalog.discover(args.model, device=args.device)
    demo = build_demo(catalog, max_images=args.max_images, concurrency=args.concurrency)
    print(f"mmgen demo image: models {list(catalog.main)} (companions {list(catalog.companions)}) on {args.device}")
    launch_demo(demo, host=args.host, port=args.port, share=args.share)
    return 0


def _bounded(low: int, high: int, flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} must be in [{low}, {high}], got {value}")
        return value

    return parse
