"""The `mmgen` command.

    mmgen generate image --class-labels cat-face animal-mammal --decoding sjd --seed 0 --out out/
    mmgen generate text --prompt "What colour is it?" --image face.png
    mmgen generate speech --text "Hello there." --out hello.wav
    mmgen generate video --prompt "grinning face moving left" --out clip.mp4
    mmgen convert llamagen --gpt-checkpoint c2i_B_256.pt --vq-checkpoint vq_ds16_c2i.pt --out DIR
    mmgen bench image --methods ar sjd-8 sjd-16 --batch-sizes 1 4 --json out/bench.json
    mmgen calibrate emoji-vlm                            (measure a model's window cost on this machine)
    mmgen batch jobs.jsonl --out out/ --batch-size 8       (torchrun ... -m mmgen.cli batch ... for many GPUs)
    mmgen demo speech                                    (a Gradio app; also image, text, video)
    mmgen serve --model emoji-vlm --model speech-tts     (OpenAI-compatible HTTP routes)
    mmgen eval per hello.wav --text "Hello there."       (speech intelligibility: phoneme error rate)

The core has no static dependency on any modality: each modality package contributes its
subcommands through a `register(commands, groups)` function in a module named in
`COMMAND_MODULES`, imported by name when the parser is built; `mmgen convert`'s subcommands are
built from the families' records (`registry.registered_converters`, `add_converters`).

Options every subcommand shares are checked here, once, before any subcommand runs:
`--device` (`check_device`: the device must exist on this machine) and `--seed` (`seed_arg`,
`check_seed`: 0 <= seed < 2**63). Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional, Sequence

from mmgen.deprecation import show_deprecations

if TYPE_CHECKING:
    import torch

#: Modules that add subcommands (`register(commands, groups)`), one per modality package.
COMMAND_MODULES = ("mmgen.image_ar.cli", "mmgen.batch", "mmgen.calibrate", "mmgen.vlm.cli", "mmgen.audio.cli", "mmgen.audio.eval_cli",
                   "mmgen.video.cli", "mmgen.apps.cli", "mmgen.apps.serve_cli")
#: Seeds are torch generator seeds: 0 <= seed < 2**63.
SEED_LIMIT = 2**63
#: Weight dtypes every `--dtype` flag offers.
DTYPES = ("float32", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`mmgen generate image: error: ...`), as every other bad
    input gets; `--help` still shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_seed(seed: Any, name: str = "seed") -> int:
    """`seed` as an int in [0, 2**63) (what torch.Generator.manual_seed takes); ValueError otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2**63), got {seed!r}")
    return seed


def seed_arg(text: str) -> int:
    """argparse type of `--seed`: a decimal integer checked by `check_seed`."""
    try:
        return check_seed(int(text.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text!r}") from None


def check_output_file(path: str, suffix: str, overwrite: bool, flag: str = "--out") -> Path:
    """`path` as a Path, or ValueError when it does not end in `suffix`, names an existing file
    (unless `overwrite`) or a folder, or lies in a folder that is missing or not writable."""
    out = Path(path)
    if out.suffix.lower() != suffix:
        raise ValueError(f"{flag} must name a {suffix} file, got {path}")
    if out.is_dir():  # --overwrite cannot help: a file never replaces a folder
        raise ValueError(f"{flag} {path} is a folder: name a {suffix} file (e.g. {out / ('out' + suffix)})")
    if out.exists() and not overwrite:
        raise ValueError(f"{flag} {path} exists; pass --overwrite to replace it")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise ValueError(f"{flag} {path}: folder {out.parent} does not exist or is not writable")
    return out


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """`--json`, the same on every `mmgen generate` subcommand (see `report`)."""
    parser.add_argument("--json", action="store_true",
                        help="print the run's record (files written, statistics) as one JSON line on stdout, and "
                             "nothing else there (default: stdout is for people, the record goes to stderr)")


def add_family_flags(parser: argparse.ArgumentParser, modality: str) -> None:
    """A flag for each option the registered families of `modality` declare
    (`registry.family_options`: VibeVoice's `--final-std`, a plugin's own) that `parser` does not
    already have (that flag of the modality's own passes the keyword already); unset, it is None
    (the pipeline's default applies). Values are checked as they are parsed (`Option.parse`: one
    line, exit status 2); `--help` shows an option's choices or `metavar`, and an option of `size`
    N takes N words (a list). The names added are `args.family_flags`, which `family_flags` reads."""
    from mmgen import registry

    taken = set(parser._option_string_actions)
    added = [option for option in registry.family_options(modality).values() if option.flag not in taken]
    parser.set_defaults(family_flags=tuple(option.name for option in added))
    for option in added:
        add_option(parser, option, default=None)


def add_option(parser: argparse.ArgumentParser, option: Any, default: Any) -> None:
    """`option` (`registry.Option`) as an argument of `parser`, `default` when not given: a switch
    for a bool, else a flag (a word for a `positional` one) whose value `Option.parse` checks."""
    if option.type is bool:
        parser.add_argument(option.flag, action="store_true", default=default, help=option.help)
        return
    name = option.name if option.positional else option.flag
    required = {} if option.positional else {"required": option.required}
    parser.add_argument(name, type=_option_arg(option, name), default=default, help=option.help,
                        choices=option.choices or None, metavar=option.metavar,
                        nargs=option.size if option.size > 1 else None, **required)


def _option_arg(option: Any, name: str) -> Any:
    def parse(text: str) -> Any:
        try:
            return option.parse(text, name)
        except ValueError as error:  # argparse names the argument itself
            raise argparse.ArgumentTypeError(str(error).removeprefix(name + " ")) from None

    return parse


def add_converters(group: Any) -> None:
    """A `mmgen convert <name>` subcommand per converter the registered families declare
    (`registry.registered_converters`), built from its record: its help line, its arguments
    (`add_option`, with their defaults) and what it runs."""
    from mmgen import registry

    for converter in registry.registered_converters().values():
        command = group.add_parser(converter.name, help=converter.help)
        for option in converter.arguments:
            add_option(command, option, option.default)
        command.set_defaults(run=converter.run, **converter.defaults)


def family_flags(args: argparse.Namespace, modality: str, model: str, cls: type) -> dict:
    """The family option flags given (`add_family_flags`) as call keywords, once the folder of
    `--model` (holding a `cls` pipeline) names a family that declares each: ValueError otherwise,
    before any weights load."""
    from mmgen import registry

    given = {name: getattr(args, name) for name in args.family_flags}
    if all(value is None for value in given.values()):
        return {}
    if registry.FAMILY_KEYS[modality] == "_class_name":
        entry = registry.family(modality, cls.__name__)
    else:  # a transformers folder: its config.json's model_type (of a Hub repo, that file alone)
        from mmgen.hub import read_json, resolve_path
        from mmgen.loading import resolve_model

        entry = registry.family(modality, read_json(resolve_path(resolve_model(model), "config.json")).get("model_type"))
    return registry.family_call_options(modality, entry, given, lambda option: option.flag)


def report(args: argparse.Namespace, lines: Sequence[str], record: dict) -> None:
    """The one output rule of `mmgen generate`: stdout is for people (what was written, a
    summary; for text, the answer), the machine record one JSON line on stderr; with `--json`
    the record alone goes to stdout."""
    if getattr(args, "json", False):
        print(json.dumps(record))
        return
    for line in lines:
        print(line)
    print(json.dumps(record), file=sys.stderr)


def check_device(device: Any) -> "torch.device":
    """`device` as a torch.device that exists on this machine; ValueError with one line otherwise
    (an unknown name, a backend this torch lacks, no GPU, or a GPU index past the last one)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {device!r} is not a device name (e.g. cpu, cuda, cuda:1, mps)") from None
    if parsed.type == "cpu":
        return parsed
    backend = torch.backends.mps if parsed.type == "mps" else getattr(torch, parsed.type, None)
    if backend is None or not callable(getattr(backend, "is_available", None)):
        raise ValueError(f"--device {device}: mmgen runs on cpu, cuda, mps or xpu devices")
    if not backend.is_available():
        raise ValueError(f"--device {device}: no {parsed.type} device is available on this machine (torch "
                         f"{torch.__version__}); use --device cpu")
    count = backend.device_count() if callable(getattr(backend, "device_count", None)) else 1
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} {parsed.type} device(s), "
                         f"numbered 0 to {count - 1}")
    return parsed


def version() -> str:
    """The installed distribution's version (importlib.metadata)."""
    import mmgen

    return mmgen.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mmgen", description="Fast autoregressive generation on one decoding core.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    groups = {
        "generate": commands.add_parser("generate", help="generate samples with a pipeline").add_subparsers(dest="target", required=True),
        "convert": commands.add_parser("convert", help="convert official checkpoints into a pipeline folder").add_subparsers(dest="target", required=True),
        "eval": commands.add_parser("eval", help="measure generated samples (e.g. speech's phoneme error rate)").add_subparsers(dest="target", required=True),
        "bench": commands.add_parser("bench", help="benchmark decoding methods against autoregressive decoding, in one "
                                     "process").add_subparsers(dest="target", required=True),
    }
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands, groups)
    add_converters(groups["convert"])
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    show_deprecations()  # an old name typed on the command line or in a job file is reported
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1].startswith("-") and argv[1] not in ("-h", "--help")):
        # `mmgen bench` benchmarked image models before it took a modality: read until 0.3.
        print("mmgen: `mmgen bench` without a modality is deprecated (removed in 0.3): use `mmgen bench image`",
              file=sys.stderr)
        argv.insert(1, "image")
    args = build_parser().parse_args(argv)
    args.command_line = "mmgen " + shlex.join(argv)  # recorded by reports (e.g. `mmgen bench`)
    try:
        if getattr(args, "device", None) is not None:  # every subcommand, before any work
            check_device(args.device)
        return args.run(args)
    except (ValueError, OSError) as error:
        print(f"mmgen: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
