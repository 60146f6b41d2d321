"""The built-in image families are records (`mmgen.image_ar`): the options only some of them take
are declared there once, and `mmgen generate image`'s flags and `mmgen batch`'s job fields are
built from those records, unchanged for users (names, defaults, help, types)."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest

from mmgen import registry
from mmgen.cli import build_parser, main
from mmgen.image_ar.batch import check_fields, options_of

#: Each built-in family's own options, by name.
OWN = {
    "LlamaGenPipeline": ["cfg_interval"],
    "LlamaGenText2ImagePipeline": ["cfg_interval"],
    "VARPipeline": ["preset", "more_smooth", "pruning", "pruning_layers"],
    "MARPipeline": ["num_iter", "cfg_schedule"],
    "JanusPipeline": [],
}
#: The flags as they were hand-written before the records: help, choices, metavar, nargs.
FLAGS = {
    "--cfg-interval": ("guide tokens t <= N + 1 only (default: the model's)", None, None, None),
    "--preset": ("VAR: the official sampler settings", ("fid", "demo"), None, None),
    "--more-smooth": ("VAR: Gumbel-softmax soft maps (official visualisation option)", None, None, 0),
    "--pruning": ("VAR: FastVAR cached token pruning, keep ratios per scale step and optionally the block range, e.g. "
                  "'4=0.6,5=0.5' or '5=0.5@0:' (negative steps count from the last: --pruning=-2=0.6,-1=0.5)",
                  None, "STEP=KEEP,...[@START:STOP]", None),
    "--pruning-layers": ("VAR: the block range that prunes (default 3 -4, FastVAR's)", None, ("START", "STOP"), 2),
    "--num-iter": ("MAR: masked steps (default: the model's, officially 64)", None, None, None),
    "--cfg-schedule": ("MAR: guidance schedule", ("linear", "constant"), None, None),
}
JOB = {"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "a"}


def image_parser():
    """`mmgen generate image`'s parser, built now (from the records as they are now)."""
    parser = build_parser()
    generate = next(a for a in parser._actions if a.dest == "command").choices["generate"]
    return next(a for a in generate._actions if a.dest == "target").choices["image"]


def flag(parser, name: str):
    return parser._option_string_actions[name]


def with_option(monkeypatch, family: str, name: str, **changes) -> registry.Option:
    """Family `family`'s record with its option `name` changed (for this test only)."""
    entry = registry.families("image")[family]
    option = replace(next(o for o in entry.options if o.name == name), **changes)
    options = tuple(option if o.name == name else o for o in entry.options)
    monkeypatch.setitem(registry.FAMILIES["image"], family, replace(entry, options=options))
    return option


def test_each_built_in_image_family_is_one_record_of_the_options_its_call_takes():
    families = registry.families("image")
    assert {name: [o.name for o in families[name].options] for name in OWN} == OWN
    for name, entry in OWN.items():
        assert registry.family("image", name).pipeline_class() is registry.pipeline_class(name)
        takes = inspect.signature(registry.pipeline_class(name).__call__).parameters
        # pruning_layers is the block range of VAR's `pruning` (one CachedTokenPruning keyword)
        assert all(option in takes for option in entry if option != "pruning_layers"), name
    # Options every image model takes stay the modality's own, in no record.
    assert not {"guidance_scale", "temperature", "top_k", "top_p", "window", "decoding"} & set(registry.family_options("image"))


def test_generate_image_flags_are_the_records_options_unchanged_for_users(capsys):
    parser = image_parser()
    options = registry.family_options("image").values()
    assert {option.flag for option in options} == set(FLAGS)
    for option in options:
        action = flag(parser, option.flag)
        shown = (action.help, tuple(action.choices) if action.choices else None, action.metavar, action.nargs)
        assert shown == FLAGS[option.flag] and action.help == option.help and action.default is None, option.flag
    args = parser.parse_args(["--class-labels", "1", "--out", "o", "--pruning-layers", "3", "-4", "--more-smooth",
                              "--preset", "demo", "--num-iter", "4", "--pruning=-2=0.6", "--cfg-interval", "2"])
    assert (args.pruning_layers, args.more_smooth, args.preset, args.num_iter, args.pruning, args.cfg_interval) == \
        ([3, -4], True, "demo", 4, "-2=0.6", 2)
    with pytest.raises(SystemExit, match="2"):
        main(["generate", "image", "--class-labels", "1", "--out", "o", "--cfg-schedule", "cosine"])
    assert "argument --cfg-schedule: must be one of 'linear', 'constant', got 'cosine' (see" in capsys.readouterr().err


def test_a_records_change_is_the_flags_and_the_job_fields(monkeypatch, capsys):
    with_option(monkeypatch, "VARPipeline", "preset", help="VAR: sampler settings, as the record now says",
                choices=("fid",))
    with_option(monkeypatch, "MARPipeline", "num_iter", minimum=1)
    assert flag(image_parser(), "--preset").help == "VAR: sampler settings, as the record now says"
    with pytest.raises(SystemExit):
        main(["generate", "image", "--help"])
    assert "VAR: sampler settings, as the record now says" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):
        main(["generate", "image", "--class-labels", "1", "--out", "o", "--preset", "demo"])
    assert "argument --preset: must be one of 'fid', got 'demo'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^preset must be one of 'fid', got 'demo'$"):
        check_fields({**JOB, "preset": "demo"})
    with pytest.raises(ValueError, match=r"^num_iter must be an integer >= 1, got 0$"):
        check_fields({**JOB, "num_iter": 0})


def test_job_fields_of_the_records_fill_image_options():
    options = options_of(check_fields({**JOB, "pruning": "3=0.5", "pruning_layers": [0, 2], "more_smooth": True,
                                       "num_iter": 3, "cfg_interval": 2}))
    assert (options.pruning, options.pruning_layers, options.more_smooth, options.num_iter, options.cfg_interval,
            options.family) == ("3=0.5", (0, 2), True, 3, 2, ())
    assert options_of(check_fields({**JOB, "more_smooth": False})).more_smooth is None  # its default: not given
    with pytest.raises(ValueError, match=r"^pruning_layers must be a list of two integers, got \[1\]$"):
        check_fields({**JOB, "pruning_layers": [1]})
