"""The `mmgen` command.

    mmgen generate image --class-labels cat-face animal-mammal --decoding sjd --seed 0 --out out/
    mmgen generate image --model DIR --class-labels 1 2 3 --out out/
    mmgen convert llamagen --gpt-checkpoint c2i_B_256.pt --vq-checkpoint vq_ds16_c2i.pt --out DIR
    mmgen bench --methods ar sjd-8 sjd-16 --batch-sizes 1 4 --json out/bench.json
    mmgen batch jobs.jsonl --out out/ --batch-size 8       (torchrun ... -m mmgen.cli batch ... for many GPUs)

The core has no static dependency on any modality: each modality package contributes its
subcommands through a `register(commands, groups)` function in a module named in
`COMMAND_MODULES`, imported by name when the parser is built.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from typing import Optional, Sequence

#: Modules that add subcommands (`register(commands, groups)`), one per modality package.
COMMAND_MODULES = ("mmgen.image_ar.cli", "mmgen.image_ar.batch", "mmgen.apps.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmgen", description="Fast autoregressive generation on one decoding core.")
    commands = parser.add_subparsers(dest="command", required=True)
    groups = {
        "generate": commands.add_parser("generate", help="generate samples with a pipeline").add_subparsers(dest="target", required=True),
        "convert": commands.add_parser("convert", help="convert official checkpoints into a pipeline folder").add_subparsers(dest="target", required=True),
    }
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands, groups)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = "mmgen " + shlex.join(argv)  # recorded by reports (e.g. `mmgen bench`)
    try:
        return args.run(args)
    except (ValueError, OSError) as error:
        print(f"mmgen: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
