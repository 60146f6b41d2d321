"""The distribution maps every top-level folder into the mmgen namespace (docs/architecture.md),
finds every package, pyproject.toml names only files that exist, and the user commands that
measure (`mmgen bench`, `mmgen calibrate`) run from a wheel in a fresh venv, outside any checkout."""

import glob
import json
import re
import runpy
import shutil
import subprocess
import sys
import tomllib
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
FOLDERS = ["mmgen", "image_ar", "vlm", "audio", "video", "kernels", "apps"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the distribution's files (no checkout around it)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "src"
    for name in FOLDERS:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # No build isolation: the build backend comes from the dev extra, nothing is downloaded.
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (path,) = (tmp_path / "dist").glob("mmgen-*.whl")
    return path


def test_wheel_contents_and_imports(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()

    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"mmgen", next(t for t in top_level if t.endswith(".dist-info"))}
    packages = runpy.run_path(str(ROOT / "setup.py"), run_name="packages")["packages"]()
    assert {"mmgen.image_ar.janus", "mmgen.image_ar.bench", "mmgen.apps.requests"} <= set(packages)
    for package in packages:  # every package is found: none is listed by hand
        assert package.replace(".", "/") + "/__init__.py" in names
    for module in ["mmgen/sampling.py", "mmgen/cache.py", "mmgen/cli.py", "mmgen/image_ar/llamagen/gpt.py", "mmgen/image_ar/llamagen/vq.py"]:
        assert module in names
    for asset in ["emoji64/model_index.json", "emoji64/transformer/model.safetensors", "emoji64/vq/model.safetensors",
                  "emoji64-draft/model_index.json", "emoji64-draft/transformer/model.safetensors",
                  "emoji64-classifier/model.safetensors", "emoji64-eval.npz", "emoji64/MODEL_CARD.md"]:
        assert f"mmgen/image_ar/assets/{asset}" in names
    for asset in ["emoji-vlm/config.json", "emoji-vlm/model.safetensors", "emoji-vlm/tokenizer.json", "emoji-vlm/chat_template.jinja",
                  "emoji-vlm/processor_config.json", "emoji-vlm/MODEL_CARD.md", "emoji-vlm-draft/model.safetensors",
                  "emoji-vlm-eval.jsonl"]:
        assert f"mmgen/vlm/assets/{asset}" in names
    for asset in ["speech-tts/config.json", "speech-tts/generation_config.json", "speech-tts/model.safetensors",
                  "speech-tts/codec/config.json", "speech-tts/codec/model.safetensors", "speech-tts/MODEL_CARD.md",
                  "speech-tts-draft/model.safetensors", "speech-tts-draft/codec/model.safetensors"]:
        assert f"mmgen/audio/assets/{asset}" in names
    for asset in ["emoji-motion/model_index.json", "emoji-motion/transformer/config.json",
                  "emoji-motion/transformer/diffusion_pytorch_model.safetensors", "emoji-motion/vae/config.json",
                  "emoji-motion/text_encoder/model.safetensors", "emoji-motion/tokenizer/tokenizer.json",
                  "emoji-motion/MODEL_CARD.md", "emoji-motion-small/model_index.json",
                  "emoji-motion-small/transformer/diffusion_pytorch_model.safetensors"]:
        assert f"mmgen/video/assets/{asset}" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "mmgen = mmgen.cli:main" in entry_points

    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    probe = (
        "import mmgen, mmgen.image_ar.llamagen, mmgen.image_ar.janus, mmgen.image_ar.var, mmgen.image_ar.mar, mmgen.vlm, mmgen.audio, mmgen.video, mmgen.kernels, mmgen.apps;"
        "from mmgen.loading import resolve_model; resolve_model('emoji64'); resolve_model('emoji-vlm'); resolve_model('speech-tts'); resolve_model('emoji-motion');"
        "print(mmgen.image_ar.llamagen.__file__)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(target))


def test_bench_and_calibrate_run_from_the_wheel_in_a_fresh_venv(wheel, tmp_path):
    """A fresh venv that sees the dependencies (a path entry to this environment's site-packages,
    whose .pth files, the editable install's among them, it does not run) and the wheel alone."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([str(python), "-c", "import mmgen; print(mmgen.__file__)"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=300)
    assert where.stdout.strip().startswith(site), where.stderr
    bench = subprocess.run([str(venv / "bin" / "mmgen"), "bench", "image", "--methods", "ar", "sjd-8", "--batch-sizes", "1",
                            "--repeats", "1", "--warmup", "0", "--quality-per-class", "0", "--no-progress",
                            "--json", str(tmp_path / "bench.json")], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert bench.returncode == 0, bench.stderr
    assert [row["method"] for row in json.loads((tmp_path / "bench.json").read_text())["speed"]] == ["ar", "sjd-8"]
    folder = tmp_path / "emoji64"
    shutil.copytree(ROOT / "image_ar" / "assets" / "emoji64", folder)
    calibrate = subprocess.run([str(venv / "bin" / "mmgen"), "calibrate", str(folder), "--inputs", "1", "--repeats", "1",
                                "--threads", "1"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert calibrate.returncode == 0, calibrate.stderr
    assert "cpu:1" in json.loads((folder / "model_index.json").read_text())["config"]["window_cost"]


def test_every_path_pyproject_names_exists():
    text = (ROOT / "pyproject.toml").read_text()
    project = tomllib.loads(text)
    assert (ROOT / project["project"]["readme"]).is_file()
    setuptools = project["tool"]["setuptools"]
    folders = runpy.run_path(str(ROOT / "setup.py"), run_name="packages")["FOLDERS"]
    for folder in folders.values():
        assert (ROOT / folder / "__init__.py").is_file(), folder
    for package, patterns in setuptools["package-data"].items():
        for pattern in patterns:
            assert glob.glob(str(ROOT / folders[package] / pattern), recursive=True), f"{package}: {pattern} matches nothing"
    # Files named in comments too (e.g. "see image_ar/assets/emoji64/MODEL_CARD.md").
    for name in re.findall(r"[\w./-]+\.(?:md|py|json|toml|txt)\b", text):
        assert (ROOT / name).exists(), f"pyproject.toml names {name}, which does not exist"
