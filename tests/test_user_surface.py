"""What a new user meets first: file names that never clobber, one device and seed check for
every subcommand, progress on long work, one rule for settings given twice, paths that are
never Hub ids, training checkpoints with metadata, help, --version, and top-level imports."""

import argparse
import io
import json
import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from mmgen.cli import build_parser, check_device, check_seed, main
from mmgen.hub import CheckpointError, load_state_dict, resolve_path

from tests.conftest import tiny_pipeline


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    tiny_pipeline().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mar_dir(tmp_path_factory):
    from mmgen.image_ar.mar import MARPipeline
    from tests.image_ar.test_mar_pipeline import tiny_model, tiny_vae

    path = tmp_path_factory.mktemp("mar") / "tiny-mar"
    MARPipeline(tiny_model(), tiny_vae(), sampling_defaults={"num_iter": 4}).save_pretrained(path)
    return path


def generate(model, out, *extra):
    return main(["generate", "image", "--model", str(model), "--class-labels", "1", "--out", str(out), "--no-progress", *map(str, extra)])


def one_error_line(capsys) -> str:
    """The run's stderr, which must be one line without a traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- 1. no clobbering; names that differ per seed, decoder, options and model ----------------


def test_generate_never_overwrites_without_overwrite(model_dir, tmp_path, capsys):
    assert generate(model_dir, tmp_path, "--seed", 3) == 0
    capsys.readouterr()  # the run's record (stderr)
    (path,) = tmp_path.iterdir()
    assert path.name == "000_class1_tiny_seed3_sjd.png"
    path.write_bytes(b"the user's own file")
    assert generate(model_dir, tmp_path, "--seed", 3) == 2
    assert "already exist(s): pass --overwrite" in one_error_line(capsys)
    assert path.read_bytes() == b"the user's own file"
    assert generate(model_dir, tmp_path, "--seed", 3, "--overwrite") == 0
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_folder_where_an_image_goes_is_named_as_the_problem(model_dir, tmp_path, capsys):
    (tmp_path / "000_class1_tiny_seed0_sjd.png").mkdir()
    for extra in ([], ["--overwrite"]):  # --overwrite cannot help: say so both times
        assert generate(model_dir, tmp_path, *extra) == 2
        line = one_error_line(capsys)
        assert "000_class1_tiny_seed0_sjd.png is a folder" in line and "pass --overwrite" not in line, line


def test_other_seeds_decoders_and_options_get_other_names(model_dir, tmp_path):
    for extra in ([], ["--seed", 4], ["--decoding", "ar"], ["--decoding", "sjd-8"], ["--temperature", "0.5"],
                  ["--decoding", "lantern:delta=0.2,window=8"]):
        assert generate(model_dir, tmp_path, *extra) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "000_class1_tiny_seed0_ar.png", "000_class1_tiny_seed0_lantern-delta=0.2-window=8.png", "000_class1_tiny_seed0_sjd-8.png",
        "000_class1_tiny_seed0_sjd.png", "000_class1_tiny_seed0_sjd_temperature=0.5.png", "000_class1_tiny_seed4_sjd.png"]


def test_every_decoder_and_option_gets_its_own_name():
    """Specs that differ only in characters a file name drops still get different names
    (`lantern++` is not `lantern`; a drafter's path is not another one's); plain specs keep their
    readable names."""
    from mmgen.image_ar.generation import ImageOptions, image_file_names

    specs = ["lantern", "lantern++", "lantern++:delta=0.2", "lantern:delta=0.2", "draft:drafter=./a/b",
             "draft:drafter=./a-b", "draft:drafter=a b", "sjd-8", "sjd:window=8"]
    names = [image_file_names([0], "m", 1, ImageOptions(decoding=spec), spec)[0] for spec in specs]
    assert len(set(names)) == len(specs), names
    assert names[:2] == ["000_class0_m_seed1_lantern.png", "000_class0_m_seed1_lantern++.png"]
    assert names[-1] == "000_class0_m_seed1_sjd-window=8.png"


def is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def test_stdout_is_for_people_and_the_record_for_json(model_dir, tmp_path, capsys):
    """`generate image` prints what it wrote and a summary; its JSON record goes to stderr, or,
    with --json, alone to stdout (the rule of every `mmgen generate`)."""
    assert generate(model_dir, tmp_path / "a") == 0
    out, err = capsys.readouterr()
    assert out.startswith("wrote ") and "mean_accepted_length=" in out
    assert not any(is_json_object(line) for line in out.splitlines()), out
    assert json.loads(err.strip().splitlines()[-1])["stats"]["rows"] == 1
    assert generate(model_dir, tmp_path / "b", "--json") == 0
    out, err = capsys.readouterr()
    (line,) = out.strip().splitlines()
    record = json.loads(line)
    assert record["files"] == [str(tmp_path / "b" / "000_class1_tiny_seed0_sjd.png")] and record["stats"]["rows"] == 1
    assert err == ""


def test_generate_text_follows_the_same_rule_with_the_answer_on_stdout(capsys):
    argv = ["generate", "text", "--prompt", "What is this?", "--max-new-tokens", "4"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    answer = json.loads(err.strip().splitlines()[-1])["text"]
    assert out == answer + "\n"
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    (line,) = out.strip().splitlines()
    assert json.loads(line)["text"] == answer and err == ""
    assert main([*argv, "--json", "--stream"]) == 2
    assert "give one of them" in one_error_line(capsys)


def test_long_settings_are_cut_and_hashed():
    from mmgen.image_ar.generation import ImageOptions, image_file_names

    long = ImageOptions(decoding="draft:drafter=/a/very/long/path/to/some/drafter/folder/that/goes/on/and/on")
    other = ImageOptions(decoding="draft:drafter=/a/very/long/path/to/some/drafter/folder/that/goes/on/and/on2")
    (a,), (b,) = (image_file_names([2], "m", 1, o, o.decoding) for o in (long, other))
    assert a != b and len(a) < 100 and a.startswith("000_class2_m_seed1_draft-drafter=-a-very-long")


# ---- 2. one device check, before any work, for every subcommand ------------------------------


@pytest.mark.parametrize("argv", [
    ["generate", "image", "--class-labels", "1", "--out", "{out}"],
    ["bench", "image", "--batch-sizes", "1", "--repeats", "1"],
    ["batch", "{jobs}", "--out", "{out}"],
    ["demo", "image"],
])
def test_an_unavailable_device_is_one_line_before_any_work(argv, tmp_path, capsys, monkeypatch):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"model": "emoji64", "class_label": 1, "seed": 0, "decoding": "ar", "count": 1, "output": "a"}) + "\n")
    argv = [a.format(out=tmp_path / "out", jobs=jobs) for a in argv]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*argv, "--device", "cuda"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("mmgen: error: --device cuda: no cuda device is available") and "line 1" not in line
    assert main([*argv, "--device", "gpu"]) == 2
    assert "--device 'gpu' is not a device name" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_check_device():
    assert check_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no cuda device"):
            check_device("cuda:0")
    else:
        with pytest.raises(ValueError, match="numbered 0 to"):
            check_device(f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(ValueError, match="mmgen runs on"):
        check_device("meta")


# ---- 3. progress on long work ----------------------------------------------------------------


def test_mar_generation_shows_progress_and_the_bar_changes_no_token(mar_dir):
    from mmgen.decoding import ContinuousSpeculative
    from mmgen.image_ar.mar import MARPipeline

    pipe = MARPipeline.from_pretrained(mar_dir)
    gen = lambda: torch.Generator().manual_seed(0)
    stream = io.StringIO()
    pipe.set_progress_bar_config(file=stream, disable=False, leave=True)
    shown = pipe([1, 2], generator=gen(), output_type="pt")
    assert "tokens" in stream.getvalue() and "16/16" in stream.getvalue()
    cspd = ContinuousSpeculative(drafter=pipe, num_steps=4, num_draft=2)
    stream.truncate(0)
    shown_cspd = pipe([1, 2], decoding=cspd, generator=gen(), output_type="pt")
    assert "16/16" in stream.getvalue()
    pipe.set_progress_bar_config(disable=True)
    assert torch.equal(pipe([1, 2], generator=gen(), output_type="pt").tokens, shown.tokens)
    assert torch.equal(pipe([1, 2], decoding=cspd, generator=gen(), output_type="pt").tokens, shown_cspd.tokens)


@pytest.mark.parametrize("model", ["llamagen", "mar"])
def test_bench_shows_progress(model, model_dir, mar_dir, tmp_path, capsys):
    folder, methods = (model_dir, ["ar", "sjd-4"]) if model == "llamagen" else (mar_dir, ["ar", "ar:num_steps=2"])
    argv = ["bench", "image", "--models", str(folder), "--methods", *methods, "--batch-sizes", "1", "--repeats", "2", "--warmup", "1",
            "--quality-per-class", "0", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "bench" in err and "6/6" in err  # 2 methods x (1 warm-up + 2 repeats)
    assert main([*argv, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


# ---- 4. one rule for a setting given in the spec and as a flag --------------------------------


def test_a_spec_and_a_flag_that_disagree_are_an_error_naming_both(model_dir, tmp_path, capsys):
    assert generate(model_dir, tmp_path, "--decoding", "sjd:window=4", "--window", 8) == 2
    line = one_error_line(capsys)
    assert "the decoding spec 'sjd:window=4' sets window=4 but --window is 8" in line
    assert generate(model_dir, tmp_path, "--decoding", "sjd-8", "--window", 4) == 2
    assert "'sjd-8' sets window=8 but --window is 4" in one_error_line(capsys)
    assert generate(model_dir, tmp_path, "--decoding", "sjd:window=4", "--window", 4) == 0  # agreeing is fine


def test_merge_decoding_options_is_the_one_rule():
    from mmgen.loading import merge_decoding_options

    assert merge_decoding_options("sjd", {}, {"window": 8}) == {"window": 8}
    assert merge_decoding_options("ar", {"num_steps": 2}, {}) == {"num_steps": 2}
    assert merge_decoding_options("ar", {"num_steps": 2}, {"num_steps": 2}) == {"num_steps": 2}  # agreeing is fine
    with pytest.raises(ValueError, match=r"sets num_steps=2 but --num-iter \(num_iter\) is 3"):
        merge_decoding_options("ar:num_steps=2", {"num_steps": 2}, {"num_steps": 3})


def test_mar_steps_default_to_the_models_on_the_command_line_as_for_shortcuts_in_python(mar_dir, tmp_path, capsys):
    from mmgen.image_ar.mar import MARPipeline

    pipe = MARPipeline.from_pretrained(mar_dir)
    python = pipe([1], decoding="ar", generator=torch.Generator().manual_seed(0)).stats.baseline_forwards
    for spec in ("ar", f"cspd:drafter={mar_dir}"):
        assert generate(mar_dir, tmp_path / spec[:2], "--decoding", spec) == 0
        stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])["stats"]
        assert stats["baseline_forwards"] == python == pipe.sampling_defaults["num_iter"] == 4


def test_the_readme_cspd_call_in_python_equals_the_command_line(mar_dir, tmp_path):
    """README: a decoder object that sets no num_steps runs the model's, as the command line
    does, so the images are the same; one that sets them runs its own."""
    from mmgen.decoding import ContinuousSpeculative
    from mmgen.image_ar.generation import png_bytes
    from mmgen.image_ar.mar import MARPipeline

    assert generate(mar_dir, tmp_path, "--decoding", f"cspd:num_draft=2,drafter={mar_dir}") == 0
    (path,) = tmp_path.iterdir()
    pipe, small = MARPipeline.from_pretrained(mar_dir), MARPipeline.from_pretrained(mar_dir)
    pipe.set_progress_bar_config(disable=True)
    out = pipe([1], decoding=ContinuousSpeculative(drafter=small, num_draft=2), generator=torch.Generator().manual_seed(0))
    assert png_bytes(out.images[0]) == path.read_bytes()
    assert out.stats.baseline_forwards == pipe.sampling_defaults["num_iter"] == 4
    own = pipe([1], decoding=ContinuousSpeculative(drafter=small, num_draft=2, num_steps=3), generator=torch.Generator().manual_seed(0))
    assert own.stats.baseline_forwards == 3
    spec = pipe([1], decoding="ar:num_steps=3", generator=torch.Generator().manual_seed(0))  # a spec's own steps count too
    assert spec.stats.baseline_forwards == 3


# ---- 5. paths, seeds and empty specs ------------------------------------------------------------


def test_path_like_names_are_never_hub_ids(model_dir, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("asked the Hub"))
    for name in ("./a", "./a/b", "../a/b", "~/no-such-mmgen-folder"):
        with pytest.raises(FileNotFoundError, match="does not exist \\(a local path, not a Hugging Face repo id\\)"):
            resolve_path(name)
    monkeypatch.chdir(model_dir.parent)
    assert generate("./a/b", tmp_path / "x") == 2
    assert "./a/b does not exist (a local path" in one_error_line(capsys)
    assert generate("./tiny", tmp_path / "rel") == 0  # an existing relative folder
    (tmp_path / "nested").mkdir()
    os.symlink(model_dir, tmp_path / "nested" / "tiny")
    monkeypatch.chdir(tmp_path)
    assert generate(os.path.join("nested", "tiny"), tmp_path / "sep") == 0  # contains a separator and exists


@pytest.mark.parametrize("seed", ["-1", "1e23", str(2**63), "x"])
def test_bad_seeds_are_refused_everywhere(seed, model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "image", "--class-labels", "1", "--out", "o", "--seed", seed])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seed: must be an integer in [0, 2**63)" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "image", "--seed", seed])
    capsys.readouterr()


def test_the_one_seed_check():
    assert check_seed(0) == 0 and check_seed(2**63 - 1) == 2**63 - 1
    for bad in (-1, 2**63, 1.0, True, "1"):
        with pytest.raises(ValueError, match=r"in \[0, 2\*\*63\)"):
            check_seed(bad)
    from mmgen.image_ar.batch import check_fields

    job = {"model": "m", "class_label": 1, "decoding": "ar", "output": "o"}
    assert check_fields({**job, "seed": 2**63 - 2, "count": 2})
    with pytest.raises(ValueError, match="the last row's seed"):
        check_fields({**job, "seed": 2**63 - 1, "count": 2})
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
        check_fields({**job, "seed": -1, "count": 1})


def test_an_empty_decoding_spec_is_an_error(model_dir, tmp_path, capsys):
    assert generate(model_dir, tmp_path, "--decoding", "") == 2
    assert "empty decoding spec ''" in one_error_line(capsys)
    assert generate(model_dir, tmp_path, "--decoding", " ") == 2
    assert "empty decoding spec" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


# ---- 6. training checkpoints with metadata ------------------------------------------------------


class Metadata:
    """A class the loader must never rebuild."""

    def __init__(self):
        self.lr = 1e-4


def training_checkpoint(pipe, extra):
    """What LlamaGen's train_c2i.py saves: weights, optimizer state (tensors and plain values),
    the step and `extra` (its argparse `args`). Zero gradients leave the weights as they are."""
    optimizer = torch.optim.AdamW(pipe.transformer.parameters(), lr=1e-4, weight_decay=0.0)
    for p in pipe.transformer.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in pipe.transformer.parameters():
        p.grad = None
    assert optimizer.state_dict()["state"]  # exp_avg, exp_avg_sq, step
    return {"model": pipe.transformer.state_dict(), "optimizer": optimizer.state_dict(), "steps": 100, **extra}


def test_llamagen_training_checkpoints_with_args_load_weights_only(tmp_path):
    from mmgen.image_ar.llamagen import LlamaGenPipeline

    pipe = tiny_pipeline()
    reference = {k: v.clone() for k, v in tiny_pipeline().transformer.state_dict().items()}
    args = argparse.Namespace(gpt_model="GPT-B", image_size=256, lr=1e-4, results_dir="results", no_compile=False)
    torch.save(training_checkpoint(pipe, {"args": args}), tmp_path / "c2i.pt")
    torch.save({"model": pipe.vq.state_dict(), "args": args}, tmp_path / "vq.pt")
    loaded = LlamaGenPipeline.from_official(tmp_path / "c2i.pt", tmp_path / "vq.pt", pipe.transformer.config, pipe.vq.config)
    for name, tensor in loaded.transformer.state_dict().items():
        assert torch.equal(tensor, reference[name])
    assert set(load_state_dict(tmp_path / "c2i.pt")) == set(reference)


def test_other_pickled_classes_are_still_refused_with_a_clear_error(tmp_path):
    pipe = tiny_pipeline()
    torch.save(training_checkpoint(pipe, {"args": argparse.Namespace(a=1), "config": Metadata()}), tmp_path / "c2i.pt")
    with pytest.raises(CheckpointError) as info:
        load_state_dict(tmp_path / "c2i.pt")
    message = str(info.value)
    assert "\n" not in message and f"{__name__}.Metadata" in message and "weights_only=True" in message
    assert "argparse.Namespace, which" not in message  # the allowed class is not blamed
    torch.save({"model": pipe.vq.state_dict(), "args": argparse.Namespace(opt=Metadata())}, tmp_path / "vq.pt")
    with pytest.raises(CheckpointError, match="Metadata"):  # inside a Namespace too
        load_state_dict(tmp_path / "vq.pt")


# ---- 8. help and --version ------------------------------------------------------------------------


def help_text(*argv, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_help_lists_every_decoder_family_and_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside words such as sjd-8
    text = help_text("generate", "image", capsys=capsys)
    for word in ("cspd", "collaborative:large_steps=4", "(default: sjd", "'sjd-8' is 'sjd:window=8'", "VAR", "MAR", "Janus-Pro", "mar-emoji64",
                 "seed of the random generator", "torch device", "weights' dtype", "--overwrite"):
        assert word in text, word
    assert "'code" not in text and "draft_steps" not in text  # CoDe's old names are read, not taught
    text = help_text("bench", "image", capsys=capsys)
    for word in ("collaborative:large_steps=N[,small=NAME]", "--small-depth", "(default: 5)", "(default: ['ar', 'sjd-8', 'sjd-16'])", "(default: float32)", "(default: cpu)", "--no-progress"):
        assert word in text, word
    assert "(default: None)" not in text


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mmgen {metadata.version('mmgen')}"
    import mmgen

    assert mmgen.__version__ == metadata.version("mmgen")


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "image", "--out", "o"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one of the arguments --class-labels --prompt is required" in err


# ---- 9. top-level pipelines, lazily, and one loader -----------------------------------------------


def test_import_mmgen_imports_no_modality_and_pipelines_come_on_first_use():
    probe = (
        "import sys, mmgen\n"
        "assert not [m for m in sys.modules if m.startswith('mmgen.image_ar') or m in ('transformers', 'diffusers', 'timm')], sorted(sys.modules)\n"
        "from mmgen import LlamaGenPipeline, VARPipeline, MARPipeline, JanusPipeline, LlamaGenT2IPipeline\n"
        "from mmgen.image_ar.llamagen import LlamaGenText2ImagePipeline\n"
        "assert LlamaGenT2IPipeline is LlamaGenText2ImagePipeline and mmgen.LlamaGenPipeline is LlamaGenPipeline\n"
        "assert 'VARPipeline' in dir(mmgen)\n"
        "try:\n    mmgen.NoSuchPipeline\nexcept AttributeError as e:\n    print('ok', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ok module 'mmgen' has no attribute 'NoSuchPipeline'" in result.stdout


def test_importing_mmgen_first_makes_openmp_wait_passively_unless_the_user_chose():
    probe = "import os, mmgen; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def run(code: str, **extra) -> str:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**env, **extra})
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    assert run(probe) == "PASSIVE"
    assert run(probe, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
    assert run("import torch\n" + probe) == "None"  # too late for OpenMP: left alone


def test_the_cli_parser_loads_no_model_library():
    """`mmgen --help` and every command's parsing import no transformers, diffusers, gradio,
    torchaudio or PyAV (diffusers alone, through torch._dynamo, doubled the CLI's start-up)."""
    probe = (
        "import sys, mmgen.cli\n"
        "mmgen.cli.build_parser()\n"
        "print(sorted(m for m in ('transformers', 'diffusers', 'gradio', 'torchaudio', 'av') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_load_pipeline_opens_bundled_names_and_folders(model_dir, mar_dir, tmp_path):
    import mmgen

    assert type(mmgen.load_pipeline("emoji64")) is mmgen.LlamaGenPipeline
    assert type(mmgen.load_pipeline("var-emoji64")) is mmgen.VARPipeline
    assert type(mmgen.load_pipeline("mar-emoji64", dtype=torch.float32)) is mmgen.MARPipeline
    assert type(mmgen.load_pipeline(model_dir)) is mmgen.LlamaGenPipeline
    assert type(mmgen.load_pipeline(str(mar_dir))) is mmgen.MARPipeline
    with pytest.raises(FileNotFoundError, match="a local path"):
        mmgen.load_pipeline("./no/such/folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="is not a pipeline folder"):
        mmgen.load_pipeline(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown pipeline class 'Nope'"):
        mmgen.pipeline_class("Nope")


def test_a_pipeline_call_reads_a_decoding_spec_as_the_command_line_does(tmp_path):
    """`pipe(decoding="draft")` pairs the bundled drafter as `mmgen generate image --decoding
    draft` does (one rule for a spec: `Pipeline.decoder`), loaded once per pipeline, also when
    the pipeline was loaded from the bundled folder's path; a copy elsewhere is told, in one
    line, to name its drafter, and takes it in the spec."""
    import shutil

    import torch

    import mmgen
    from mmgen.decoding import DraftSpeculative

    pipe = mmgen.load_pipeline("emoji64")
    pipe.set_progress_bar_config(disable=True)
    drafter = mmgen.load_pipeline("emoji64-draft")
    by_name = pipe([3], decoding="draft", generator=torch.Generator().manual_seed(0))
    given = pipe([3], decoding=DraftSpeculative(drafter=drafter), generator=torch.Generator().manual_seed(0))
    assert torch.equal(by_name.tokens, given.tokens) and by_name.stats.drafted > 0
    pipe([3], decoding="draft:num_draft=3", generator=torch.Generator().manual_seed(0))
    assert len(pipe._companions) == 1  # loaded once, whatever the options
    bundled = mmgen.registry.bundled_models()
    by_folder = mmgen.load_pipeline(bundled["emoji64"])
    by_folder.set_progress_bar_config(disable=True)
    assert torch.equal(by_folder([3], decoding="draft", generator=torch.Generator().manual_seed(0)).tokens, by_name.tokens)
    for name in ("emoji64", "emoji64-draft"):
        shutil.copytree(bundled[name], tmp_path / name)
    copy = mmgen.load_pipeline(tmp_path / "emoji64")
    copy.set_progress_bar_config(disable=True)
    with pytest.raises(ValueError, match="needs a draft model of the same tokenizer: add drafter="):
        copy([3], decoding="draft")  # one line, before any work
    spec = f"draft:drafter={tmp_path / 'emoji64-draft'}"
    assert torch.equal(copy([3], decoding=spec, generator=torch.Generator().manual_seed(0)).tokens, by_name.tokens)


def test_pipelines_load_in_float32_on_a_cpu_unless_asked():
    """Half-precision weights compute in float32 on a CPU (no fast float16 kernels there), the
    stored dtype on an accelerator, and an asked-for dtype always (`load_dtype`)."""
    from mmgen.pipeline import load_dtype

    assert load_dtype(None) == load_dtype(None, "cpu") == load_dtype(None, torch.device("cpu")) == torch.float32
    assert load_dtype(None, "cuda") == "auto"
    assert load_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    from mmgen import load_pipeline

    pipe = load_pipeline("speech-tts")  # stored in float16
    assert pipe.model.dtype == pipe.codec.dtype == torch.float32
    assert load_pipeline("speech-tts", dtype=torch.float16).model.dtype == torch.float16
