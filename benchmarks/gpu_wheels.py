"""The folder of wheels a bare GPU machine needs to run the GPU check, prepared here.

The GPU machines we borrow have no network. Their Python 3.12 holds torch 2.11 with its own
requirements (triton 3.6 among them) and numpy, and nothing else we can count on (their
transformers 5.17 is below our floor; no diffusers, gradio, av or soundfile). This script
downloads, for that Python and platform, the wheels of everything else that
`benchmarks.gpu_check` and the device tests (`tests/device/`) import, at the versions installed
here (those the suite passed with), each without its dependencies: the list is closed already.

    python -m benchmarks.gpu_wheels --out gpu-wheels          # cp312, manylinux x86_64, <= 40 MB
    # on the GPU machine, in a copy of the code without */assets/:
    pip install --no-index --no-deps gpu-wheels/*.whl
    pip install --no-index --no-deps --no-build-isolation -e .
    python -m benchmarks.gpu_check --out gpu-report

What is left out, and why: torch and its requirements and numpy (there already; numpy's wheel
alone is 16 MB), torchvision/torchaudio/timm (only MAR and the demos import them; the device
tests skip MAR without timm), gradio, av, soundfile, scipy (never imported by the check or the
device tests), typer and docopt (transformers' and num2words' command lines only) and hf-xet
(Hub downloads: no network).

`--local` downloads for this interpreter and platform instead; `--check-venv DIR` then proves
the folder suffices: a fresh venv that sees only this environment's torch (with its
requirements) and numpy gets the wheels and an editable mmgen from a copy of the code without
assets, then imports mmgen and the check and runs the device tests against transformers' and
the official references (tests/test_benchmarks_gpu_check.py runs this).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[1]
#: What the check and the device tests import beyond torch (pytest runs the device tests;
#: SmolVLM's processor, in the VLM device tests, needs num2words).
NEEDED = ("transformers", "diffusers", "accelerate", "safetensors", "huggingface_hub", "tokenizers", "pillow", "tqdm",
          "pytest", "num2words")
#: What the bare machine has: these and their requirements are never shipped.
PRESENT = ("torch", "numpy")
#: Requirements of NEEDED that nothing the check runs imports: transformers' and num2words'
#: command lines (docopt has no wheel), and the Hub's Xet transfer client (4 MB; no network there).
UNUSED = ("typer", "docopt", "hf-xet")
#: The bare machine's interpreter and platform.
TARGET = {"python_version": "3.12", "platforms": ("manylinux_2_28_x86_64", "manylinux2014_x86_64")}
TARGET_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux", "platform_system": "Linux",
                  "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython"}
LIMIT_BYTES = 40 * 10**6
#: Never importable on the bare machine (and never imported by `import mmgen` or the check).
ABSENT = ("gradio", "av", "soundfile")


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: Iterable[str], markers: Optional[dict] = None, stop: Iterable[str] = ()) -> dict[str, metadata.Distribution]:
    """The installed distributions `roots` need, transitively (requirements whose markers hold
    under `markers`, default this interpreter's; extras never), without descending into `stop`."""
    from packaging.requirements import Requirement

    stop = {_key(s) for s in stop}
    found: dict[str, metadata.Distribution] = {}
    todo = [r for r in roots if _key(r) not in stop]
    while todo:
        name = _key(todo.pop())
        if name in found:
            continue
        try:
            found[name] = dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ValueError(f"{name} is required but not installed here (the wheels take this environment's versions): "
                             "pip install it first") from None
        for line in dist.requires or ():
            req = Requirement(line)
            env = {**(markers or {}), "extra": ""}
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if _key(req.name) not in stop and _key(req.name) not in found:
                todo.append(req.name)
    return found


def shipped(markers: Optional[dict] = None) -> list[str]:
    """`name==version` of every wheel the folder holds: NEEDED's requirements, less what the
    machine has (PRESENT's) and UNUSED's, at this environment's versions."""
    present = closure(PRESENT, markers)
    needed = closure(NEEDED, markers, stop=[*present, *UNUSED])
    return sorted(f"{d.metadata['Name']}=={d.version}" for key, d in needed.items())


def download(pins: list[str], out: Path, local: bool) -> list[Path]:
    """pip download of `pins` (binary wheels, no dependencies) into `out`, for the target
    Python and platform or, with `local`, this interpreter's."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(out)]
    if not local:
        command += ["--python-version", TARGET["python_version"], "--implementation", "cp"]
        command += [arg for p in TARGET["platforms"] for arg in ("--platform", p)]
    result = subprocess.run(command + pins, capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise RuntimeError(f"pip download failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return sorted(out.glob("*.whl"))


def build(out: Path, local: bool = False) -> dict:
    """Fill `out` (new or empty) with the wheels and a manifest; ValueError over LIMIT_BYTES."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: give a new folder (the wheels of another run would mix in)")
    out.mkdir(parents=True, exist_ok=True)
    pins = shipped(None if local else TARGET_MARKERS)
    wheels = download(pins, out, local)
    size = sum(w.stat().st_size for w in wheels)
    manifest = {"target": "this interpreter" if local else TARGET, "pins": pins, "wheels": [w.name for w in wheels],
                "bytes": size, "limit_bytes": LIMIT_BYTES}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if size > LIMIT_BYTES:
        raise ValueError(f"the wheels take {size / 1e6:.1f} MB, over the {LIMIT_BYTES / 1e6:.0f} MB limit")
    return manifest


# --------------------------------------------------------------------------------------------
# The fresh-venv check
# --------------------------------------------------------------------------------------------


def present_view(dest: Path) -> Path:
    """A folder of links to this environment's installed files of PRESENT's distributions
    (torch with its requirements, numpy): what a bare machine has, and nothing else."""
    site = Path(sysconfig.get_paths()["purelib"])
    dest.mkdir(parents=True)
    for dist in closure(PRESENT).values():
        for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
            if (site / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(site / top)
    return dest


def source_copy(dest: Path) -> Path:
    """The files git tracks or would track (untracked, not ignored), without */assets/: the
    tree that travels to a GPU machine."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True, timeout=60).stdout.split("\0")
    for name in filter(None, listed):
        if "assets" in Path(name).parts[:-1] or not (ROOT / name).is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


#: Run in the fresh venv from the copy's root: what must import there, and what must not.
IMPORT_CHECK = f"""
import sys, importlib.util
import mmgen, benchmarks.gpu_check
import transformers, diffusers
from transformers import DiaForConditionalGeneration, JanusForConditionalGeneration, Qwen2_5_VLForConditionalGeneration
from diffusers import WanTransformer3DModel
from packaging.version import Version
assert Version(transformers.__version__) >= Version("5.23"), transformers.__version__
assert transformers.__file__.startswith(sys.prefix), transformers.__file__
loaded = sorted(m for m in {ABSENT!r} if m in sys.modules)
assert not loaded, f"imported: {{loaded}}"
missing = [m for m in {ABSENT!r} if importlib.util.find_spec(m) is None]
print("ok", transformers.__version__, diffusers.__version__, "absent:", ",".join(missing))
"""


def check_venv(wheels: Path, work: Path, timeout: int = 300) -> dict:
    """Install `wheels` and an editable mmgen (from a copy without assets) into a fresh venv
    that sees only PRESENT's installed files, then import mmgen and the check there and run the
    device tests against transformers' and the official references (the others collect).
    Returns the steps' outputs; RuntimeError on the first failure."""
    venv, src = work / "venv", source_copy(work / "src")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "bare_machine.pth").write_text(str(present_view(work / "present")) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_CONSTRAINT"))}
    env["PIP_CONFIG_FILE"] = os.devnull  # this machine's find-links and constraints are not the bare one's
    steps = {
        "wheels": pip + sorted(str(w) for w in wheels.glob("*.whl")),
        "mmgen": pip + ["--no-build-isolation", "-e", str(src)],
        "imports": [str(python), "-c", IMPORT_CHECK],
        # every device test collects; those against transformers' and the official references run
        "device tests": [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "device", "tests/device", "-k",
                         "generate or official"],
    }
    outputs = {}
    for name, command in steps.items():
        result = subprocess.run(command, cwd=src, env=env, capture_output=True, text=True, timeout=timeout)
        outputs[name] = (result.stdout + result.stderr)[-4000:]
        if result.returncode:
            raise RuntimeError(f"fresh venv, step {name!r} failed (exit {result.returncode}):\n{outputs[name]}")
    return outputs


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="a new (or empty) folder for the wheels")
    parser.add_argument("--local", action="store_true", help="for this interpreter and platform, not the GPU machine's")
    parser.add_argument("--check-venv", type=Path, default=None, metavar="DIR",
                        help="then install the folder into a fresh venv under DIR and import the check there (needs --local)")
    args = parser.parse_args(argv)
    if args.check_venv is not None and not args.local:
        parser.error("--check-venv installs into this machine's Python: add --local")
    try:
        manifest = build(args.out, args.local)
    except (ValueError, RuntimeError) as error:
        print(f"gpu_wheels: {error}", file=sys.stderr)
        return 1
    print(f"{len(manifest['wheels'])} wheels, {manifest['bytes'] / 1e6:.1f} MB in {args.out}")
    if args.check_venv is not None:
        args.check_venv.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=args.check_venv) as work:
            try:
                outputs = check_venv(args.out, Path(work))
            except RuntimeError as error:
                print(f"gpu_wheels: {error}", file=sys.stderr)
                return 1
        print(outputs["imports"].strip())
        print("device tests in the fresh venv:", outputs["device tests"].strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
