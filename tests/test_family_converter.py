"""A family's converter lives in its record: `mmgen convert <name>` is built from it.

The toy family here (`ConvertedPipeline`, the toy image family of tests/test_family_registry.py)
declares one converter in its `mmgen.registry.register_family` call: `mmgen convert toy
CHECKPOINT --out FOLDER [--classes N]` reads a `.pt` file of the toy model's weights and writes a
pipeline folder. With no other file touched, the subcommand exists, checks its arguments as its
record says (one line, exit status 2), and writes a folder `mmgen.load_pipeline` opens.
"""

from __future__ import annotations

import argparse

import pytest
import torch

import mmgen
from mmgen import registry
from mmgen.cli import main
from mmgen.registry import Converter, Option

from tests.test_family_registry import ToyConfig, ToyLM, ToyPipeline


class ConvertedPipeline(ToyPipeline):
    """The toy family whose folders `mmgen convert toy` writes."""


def convert_toy(args: argparse.Namespace) -> int:
    """The toy converter: weights from a `.pt` file (safely: tensors only) into a pipeline folder."""
    config = ToyConfig(num_classes=args.classes)
    model = ToyLM(config)
    model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=True))
    ConvertedPipeline(model, class_names=[f"class-{i}" for i in range(args.classes)]).save_pretrained(args.out)
    print(f"wrote {args.out}")
    return 0


TOY = Converter("toy", "a toy .pt checkpoint -> a ConvertedPipeline folder", convert_toy, [
    Option("checkpoint", str, help="the toy model's weights (.pt)", positional=True),
    Option("out", str, help="the pipeline folder to write", required=True),
    Option("classes", int, 3, "the checkpoint's class count", minimum=1),
])


@pytest.fixture
def toy_converter():
    registry.register_family("image", pipeline=ConvertedPipeline, converters=[TOY])
    yield
    registry.unregister_family("image", "ConvertedPipeline")


def test_a_family_converter_is_a_working_convert_subcommand(toy_converter, tmp_path, capsys):
    weights = ToyLM(ToyConfig(num_classes=4, seed=3)).state_dict()
    torch.save(weights, tmp_path / "toy.pt")
    out = tmp_path / "folder"
    assert main(["convert", "toy", str(tmp_path / "toy.pt"), "--out", str(out), "--classes", "4"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    pipe = mmgen.load_pipeline(out)
    assert type(pipe) is ConvertedPipeline and pipe.class_names == ["class-0", "class-1", "class-2", "class-3"]
    assert all(torch.equal(pipe.transformer.state_dict()[name], tensor) for name, tensor in weights.items())
    assert len(pipe([0, 3], decoding="ar", generator=torch.Generator().manual_seed(0)).images) == 2


def test_the_converter_record_is_its_help_and_its_checks(toy_converter, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["convert", "--help"])
    assert exit.value.code == 0 and "a toy .pt checkpoint -> a ConvertedPipeline folder" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["convert", "toy", "--help"])
    help_text = capsys.readouterr().out
    assert "the toy model's weights (.pt)" in help_text and "--classes CLASSES" in help_text
    for argv, message in ((["--classes", "0"], "argument --classes: must be an integer >= 1, got 0"),
                          ([], "the following arguments are required: --out")):
        with pytest.raises(SystemExit) as exit:
            main(["convert", "toy", str(tmp_path / "toy.pt"), *(["--out", str(tmp_path / "o")] if argv else []), *argv])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert exit.value.code == 2 and message in line
    assert not (tmp_path / "o").exists()  # refused before any work


def test_the_built_in_converters_come_from_the_family_records():
    commands = registry.registered_converters()
    assert list(commands)[:5] == ["llamagen", "var", "mar", "self-forcing", "causvid"]
    assert all(commands["llamagen"] in registry.family("image", name).converters
               for name in ("LlamaGenPipeline", "LlamaGenText2ImagePipeline"))
    assert commands["self-forcing"].defaults == {"preset": "self-forcing"}


def test_a_converter_name_is_one_record(toy_converter):
    other = Converter("toy", "another toy", convert_toy)
    with pytest.raises(ValueError, match="a converter named 'toy' is already registered"):
        registry.register_family("image", "OtherPipeline", pipeline="OtherPipeline", converters=[other])
    with pytest.raises(ValueError, match="a family option is an optional flag"):
        registry.register_family("image", "OtherPipeline", pipeline="OtherPipeline", options=[Option("path", str, required=True)])
    assert registry.family("image", "OtherPipeline") is None
