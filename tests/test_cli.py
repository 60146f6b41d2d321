import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from PIL import Image

from tests.conftest import tiny_pipeline


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-llamagen"
    tiny_pipeline().save_pretrained(path)
    return path


def mmgen(*args):
    return subprocess.run([sys.executable, "-m", "mmgen.cli", *map(str, args)], capture_output=True, text=True, timeout=300)


def mmgen_here(capsys, *args):
    """The same command in this process, for input refused before any work (no interpreter
    start-up per case): its exit status and output, as `mmgen` returns them."""
    from mmgen.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def positions(folder):
    """"<position>_<class or prompt>" of each file in `folder` (names go on with model, seed, decoding)."""
    return sorted("_".join(p.name.split("_")[:2]) for p in folder.iterdir())


@pytest.mark.parametrize("decoding,slug", [("ar", "ar"), ("sjd", "sjd"), ("sjd-coupled:window=4", "sjd-coupled-window=4"),
                                           ("lantern:delta=0.2", "lantern-delta=0.2")])
def test_generate_image_writes_pngs_and_prints_stats(model_dir, tmp_path, decoding, slug):
    result = mmgen("generate", "image", "--model", model_dir, "--class-labels", 3, 8, "--decoding", decoding,
                   "--seed", 4, "--out", tmp_path, "--no-progress")
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"000_class3_tiny-llamagen_seed4_{slug}.png", f"001_class8_tiny-llamagen_seed4_{slug}.png"]
    assert Image.open(tmp_path / files[0]).size == (8, 8)
    stats = json.loads(result.stderr.strip().splitlines()[-1])["stats"]
    assert stats["tokens"] == 16 and stats["rows"] == 2 and stats["forwards"] >= 1
    assert "mean_accepted_length=" in result.stdout and "wall_time=" in result.stdout


def test_same_seed_same_files(model_dir, tmp_path):
    for name in ("a", "b"):
        assert mmgen("generate", "image", "--model", model_dir, "--class-labels", 1, "--seed", 7, "--out", tmp_path / name, "--no-progress").returncode == 0
    name = "000_class1_tiny-llamagen_seed7_sjd.png"
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--class-labels", 99], "invalid class id 99"),
        (["--class-labels", 1, "--window", 0], "window must be an integer >= 1"),
        (["--class-labels", 1, "--top-p", 2], "top_p must be in (0, 1]"),
        (["--class-labels", 1, "--decoding", "lantern:dleta=0.2"], "unknown option(s) ['dleta']"),
        (["--class-labels", 1, "--decoding", "lantern:delta"], "expected key=value"),
        (["--class-labels", 1, "--decoding", "ar", "--window", 4], "unknown option(s) ['window']"),
        (["--class-labels", 1, "--decoding", "draft"], "needs a draft model"),
        (["--class-labels", 1, "--decoding", "medusa"], "unknown decoding 'medusa'"),
    ],
)
def test_bad_input_exits_with_a_message(model_dir, tmp_path, capsys, args, message):
    result = mmgen_here(capsys, "generate", "image", "--model", model_dir, *args, "--out", tmp_path, "--no-progress")
    assert result.returncode == 2 and message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_bad_input_from_the_shell_is_one_line_without_a_traceback(model_dir, tmp_path):
    result = mmgen("generate", "image", "--model", model_dir, "--class-labels", 99, "--out", tmp_path, "--no-progress")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "mmgen: error: invalid class id 99: expected an integer in [0, 10)"]


def test_bundled_model_is_the_default_and_class_names_work(tmp_path):
    result = mmgen("generate", "image", "--class-labels", "cat-face", 0, "--seed", 1, "--out", tmp_path, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000_class7_emoji64_seed1_sjd.png", "001_class0_emoji64_seed1_sjd.png"]
    assert Image.open(tmp_path / "000_class7_emoji64_seed1_sjd.png").size == (64, 64)
    bad = mmgen("generate", "image", "--class-labels", "no-such-class", "--out", tmp_path / "x", "--no-progress")
    assert bad.returncode == 2 and "unknown class name 'no-such-class'" in bad.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    result = mmgen("generate", "image", "--model", tmp_path / "nope", "--class-labels", 1, "--out", tmp_path)
    assert result.returncode == 2 and "does not exist (a local path, not a Hugging Face repo id)" in result.stderr


@pytest.mark.parametrize("kind", ["t2i", "janus"])
def test_generate_image_from_prompts(tmp_path, kind):
    if kind == "t2i":
        from tests.image_ar.test_llamagen_t2i import tiny_t2i_pipeline

        tiny_t2i_pipeline().save_pretrained(tmp_path / "model")
    else:
        from mmgen.image_ar.janus import JanusPipeline
        from tests.image_ar.test_janus import tiny_janus, tiny_processor

        JanusPipeline(tiny_janus(), tiny_processor()).save_pretrained(tmp_path / "model")
    result = mmgen("generate", "image", "--model", tmp_path / "model", "--prompt", "a red cat", "the blue sky",
                   "--decoding", "sjd:window=4", "--out", tmp_path / "out", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["000_a-red-cat_model_seed0_sjd-window=4.png",
                                                                     "001_the-blue-sky_model_seed0_sjd-window=4.png"]
    wrong = mmgen("generate", "image", "--model", tmp_path / "model", "--class-labels", 1, "--out", tmp_path / "x", "--no-progress")
    assert wrong.returncode == 2 and "use --prompt" in wrong.stderr


def test_prompt_on_a_class_conditional_model_is_a_clear_error(model_dir, tmp_path, capsys):
    result = mmgen_here(capsys, "generate", "image", "--model", model_dir, "--prompt", "a cat", "--out", tmp_path, "--no-progress")
    assert result.returncode == 2 and "use --class-labels" in result.stderr


@pytest.mark.parametrize("t2i", [False, True])
def test_convert_llamagen_passes_the_official_defaults(monkeypatch, tmp_path, t2i):
    """Plumbing only (official-size checkpoints are too big for a test): which loader gets what."""
    import argparse

    from mmgen.image_ar import cli
    from mmgen.image_ar.llamagen import LlamaGenPipeline, LlamaGenText2ImagePipeline

    calls = []

    class Saved:
        def save_pretrained(self, path):
            calls.append(("save", path))

    def fake(name):
        return classmethod(lambda cls, *a, **k: calls.append((name, a, k)) or Saved())

    monkeypatch.setattr(LlamaGenPipeline, "from_official", fake("c2i"))
    monkeypatch.setattr(LlamaGenText2ImagePipeline, "from_official", fake("t2i"))
    args = argparse.Namespace(gpt_checkpoint="g.pt", vq_checkpoint="v.pt", t2i=t2i, text_encoder="t5-folder", gpt_model=None,
                              vq_model="VQ-16", image_size=None, codebook_size=16384, codebook_embed_dim=8, num_classes=1000,
                              out=tmp_path)
    assert cli.convert_llamagen(args) == 0
    name, positional, options = calls[0]
    assert calls[1] == ("save", tmp_path)
    if t2i:
        assert name == "t2i" and positional == ("g.pt", "v.pt", "t5-folder")
        assert options["gpt_model"] == "GPT-XL" and options["image_size"] == 512
    else:
        assert name == "c2i" and positional == ("g.pt", "v.pt") and options["num_classes"] == 1000
        assert options["gpt_model"] == "GPT-B" and options["image_size"] == 256


@pytest.fixture(scope="module")
def var_dirs(tmp_path_factory):
    from tests.image_ar.test_var_pipeline import tiny_transformer, tiny_vqvae
    from mmgen.image_ar.var import VARPipeline

    root = tmp_path_factory.mktemp("var")
    vqvae = tiny_vqvae()
    VARPipeline(tiny_transformer(), vqvae).save_pretrained(root / "large")
    VARPipeline(tiny_transformer(depth=1, width=32, seed=1), vqvae).save_pretrained(root / "small")
    return root


@pytest.mark.parametrize("extra", [[], ["--decoding", "collaborative:large_steps=2,small={small}", "--pruning", "3=0.5", "--pruning-layers", "0", "2"],
                                   ["--preset", "demo", "--more-smooth"]])
def test_generate_image_with_var(var_dirs, tmp_path, extra):
    extra = [a.format(small=var_dirs / "small") for a in extra]
    result = mmgen("generate", "image", "--model", var_dirs / "large", "--class-labels", 3, 8, *extra, "--out", tmp_path, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert positions(tmp_path) == ["000_class3", "001_class8"]
    stats = json.loads(result.stderr.strip().splitlines()[-1])["stats"]
    assert stats["tokens"] == 30 and stats["stage_forwards"] == ([2, 2] if "collaborative" in " ".join(extra) else [4])


def test_old_collaborative_names_on_the_command_line_warn_and_make_the_same_images(var_dirs, tmp_path):
    """`--decoding code:draft_steps=N,refiner=PATH`, CoDe's names before it took the video's, still
    works until 0.3: the same PNGs as `collaborative:large_steps=N,small=PATH`, one warning a name."""
    made = {}
    for spec in ("collaborative:large_steps=2,small={small}", "code:draft_steps=2,refiner={small}"):
        out = tmp_path / spec.partition(":")[0]
        result = mmgen("generate", "image", "--model", var_dirs / "large", "--class-labels", 3, "--decoding",
                       spec.format(small=var_dirs / "small"), "--out", out, "--no-progress")
        assert result.returncode == 0, result.stderr
        made[spec] = ([p.read_bytes() for p in sorted(out.iterdir())], result.stderr)
    (new, quiet), (old, warned) = made.values()
    assert old == new and "deprecated" not in quiet
    for name, instead in (("decoding 'code'", "use 'collaborative'"), ("Collaborative's refiner=", "use small="),
                          ("Collaborative's draft_steps=", "use large_steps=")):
        assert warned.count(f"{name} is deprecated and will be removed in mmgen 0.3: {instead}") == 1, warned


@pytest.mark.parametrize(
    "args,message",
    [
        (["--decoding", "sjd"], "unknown decoding 'sjd'"),
        (["--decoding", "collaborative"], "needs a small model"),
        (["--pruning", "0=0.5"], "step 0 cannot be pruned"),
        (["--pruning", "3:0.5"], "bad --pruning item"),
        (["--cfg-interval", "2"], "VARPipeline has no option(s) ['cfg_interval']"),
    ],
)
def test_var_bad_input_exits_with_a_message(var_dirs, tmp_path, capsys, args, message):
    result = mmgen_here(capsys, "generate", "image", "--model", var_dirs / "large", "--class-labels", 1, *args, "--out", tmp_path, "--no-progress")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def mar_dir(tmp_path_factory):
    from tests.image_ar.test_mar_pipeline import tiny_model, tiny_vae
    from mmgen.image_ar.mar import MARPipeline

    path = tmp_path_factory.mktemp("mar") / "tiny-mar"
    MARPipeline(tiny_model(), tiny_vae()).save_pretrained(path)
    return path


@pytest.mark.parametrize("extra", [["--num-iter", "3", "--cfg-schedule", "constant", "--guidance-scale", "2"],
                                   ["--decoding", "cspd:num_draft=2,drafter={model}", "--num-iter", "4"]])
def test_generate_image_with_mar(mar_dir, tmp_path, extra):
    extra = [a.format(model=mar_dir) for a in extra]
    result = mmgen("generate", "image", "--model", mar_dir, "--class-labels", 3, 8, *extra, "--out", tmp_path, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert positions(tmp_path) == ["000_class3", "001_class8"]
    stats = json.loads(result.stderr.strip().splitlines()[-1])["stats"]
    assert stats["rows"] == 2 and (stats["drafted"] > 0) == ("cspd" in " ".join(extra))
    assert stats["baseline_forwards"] == int(extra[extra.index("--num-iter") + 1])


def test_mar_steps_come_from_the_spec_or_num_iter_never_both(mar_dir, tmp_path, capsys):
    result = mmgen_here(capsys, "generate", "image", "--model", mar_dir, "--class-labels", 1, "--decoding", "ar:num_steps=2",
                        "--out", tmp_path, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stderr.strip().splitlines()[-1])["stats"]["baseline_forwards"] == 2
    result = mmgen_here(capsys, "generate", "image", "--model", mar_dir, "--class-labels", 1, "--decoding", "ar:num_steps=2",
                   "--num-iter", "3", "--out", tmp_path, "--no-progress")
    assert result.returncode == 2 and "'ar:num_steps=2' sets num_steps=2 but --num-iter (num_iter) is 3" in result.stderr


def test_mar_rejects_token_options(mar_dir, tmp_path, capsys):
    result = mmgen_here(capsys, "generate", "image", "--model", mar_dir, "--class-labels", 1, "--top-k", 5, "--out", tmp_path, "--no-progress")
    assert result.returncode == 2 and "has no option(s) ['top_k']" in result.stderr
