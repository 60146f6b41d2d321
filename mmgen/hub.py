"""Finding and loading checkpoints: local files and folders, Hugging Face repos, official `.pt`.

Safetensors first; `.pt/.pth/.bin` only through `torch.load(weights_only=True)`, so a
checkpoint can never run code. Loading into a model is strict: a mismatch names every
missing, unexpected and mis-shaped key.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from mmgen.files import write_atomic

PathLike = Union[str, os.PathLike]

#: The largest config file (config.json, model_index.json, ...) mmgen reads.
MAX_JSON_BYTES = 16 << 20
#: Where official training scripts nest the weights, in the order they are tried.
NESTED_KEYS = ("model", "module", "state_dict", "model_ema", "generator_ema")
#: Metadata classes that training checkpoints pickle beside the weights and that
#: `weights_only=True` may rebuild: plain attribute bags that run no code (LlamaGen's scripts
#: save their `args`). Nothing else is allowed.
SAFE_METADATA = (argparse.Namespace,)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the model."""


def looks_like_path(name: PathLike) -> bool:
    """Whether `name` is meant as a local path rather than a Hub repo id: it starts with ./, ../,
    / or ~ (or is a PathLike), or it contains a path separator and exists."""
    if isinstance(name, os.PathLike):
        return True
    text = str(name)
    starts = ("./", "../", "/", "~", "." + os.sep, ".." + os.sep, os.sep)
    return text in (".", "..") or text.startswith(starts) or (os.sep in text and Path(text).exists())


def local_path(name: PathLike) -> Optional[Path]:
    """The local file or folder `name` names, or None when it is a Hub repo id. A name that
    looks like a path (`looks_like_path`) must exist: FileNotFoundError otherwise."""
    local = Path(name).expanduser()
    if local.exists():
        return local
    if looks_like_path(name):
        raise FileNotFoundError(f"{name} does not exist (a local path, not a Hugging Face repo id)")
    return None


def resolve_path(path_or_repo: PathLike, filename: Optional[str] = None) -> Path:
    """A local path for a file or folder, downloading from the Hugging Face Hub if needed.

    `path_or_repo` is a local file or folder, or a repo id ("org/name"); with `filename`, one
    file of that folder or repo. Anything that looks like a path (./x, ../x, /x, ~/x) is never
    a repo id. Offline or missing repos give an OSError that says so.
    """
    local = local_path(path_or_repo)
    if local is not None:
        target = local / filename if filename else local
        if not target.exists():
            raise FileNotFoundError(f"{target} does not exist")
        return target
    repo = str(path_or_repo)
    if not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", repo):
        raise FileNotFoundError(f"{repo!r} is neither an existing path nor a Hugging Face repo id")
    try:
        import huggingface_hub

        if filename:
            return Path(huggingface_hub.hf_hub_download(repo, filename))
        return Path(huggingface_hub.snapshot_download(repo))
    except Exception as error:  # the hub raises many types; all mean "not available here"
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached or the repo/file does not exist"
        raise OSError(
            f"could not fetch {repo!r}{' / ' + filename if filename else ''} from the Hugging Face Hub ({hint}): "
            f"{type(error).__name__}: {error}. Download it while online, or pass a local path."
        ) from error


def read_json(path: PathLike, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from a config file (config.json, model_index.json, ...), read only if it is
    a regular file of at most `limit` bytes: a folder's files are not trusted, and /dev/zero, a
    FIFO or a huge file would otherwise be read until memory runs out, or forever. A symbolic
    link to a regular file is fine (the Hub cache is made of them). CheckpointError otherwise."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO's open must not wait for a writer
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise CheckpointError(f"{path} is {info.st_size} bytes; a config file is at most {limit}")
        data = file.read(limit + 1)
    try:
        value = json.loads(data)
    except ValueError as error:  # also bad UTF-8
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def tensor_shapes(path: PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a `.safetensors` file, from its header alone (nothing is
    allocated): what a model built from a config is checked against before it is built."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            return {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}
    except Exception as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from error


def load_state_dict(path: PathLike, key: Optional[str] = None) -> dict[str, torch.Tensor]:
    """Read a `.safetensors`, `.pt`, `.pth` or `.bin` file into a flat tensor dict on the CPU.

    Nested training checkpoints are unwrapped: `key` if given, else the first of
    `NESTED_KEYS` present. Pickled code is refused (`weights_only=True`); besides tensors and
    plain containers only the metadata classes of `SAFE_METADATA` (argparse.Namespace) load.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as error:
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from error
    if path.suffix not in (".pt", ".pth", ".bin", ".ckpt"):
        raise CheckpointError(f"unsupported checkpoint format {path.suffix!r} ({path}); use .safetensors, .pt, .pth or .bin")
    try:
        with torch.serialization.safe_globals(list(SAFE_METADATA)):
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(load_failure_message(path, error)) from error
    return unwrap_state_dict(data, key, str(path))


def load_failure_message(path: Path, error: Exception) -> str:
    """One line on why `torch.load(weights_only=True)` refused `path`: the classes it would
    have had to run, when that is the reason. Every loader of `.pt` files raises
    `CheckpointError` with it (`load_state_dict` here, video's converter)."""
    try:
        allowed = {f"{c.__module__}.{c.__qualname__}" for c in SAFE_METADATA}
        unsafe = sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - allowed)
    except Exception:  # not a zip checkpoint, truncated, ...: torch's own message says more
        unsafe = []
    if unsafe:
        return (f"{path} contains pickled objects of {', '.join(unsafe)}, which mmgen does not load (weights_only=True "
                f"allows tensors, plain containers and argparse.Namespace); save the state dict alone, e.g. "
                f"torch.save(checkpoint['model'], 'weights.pt'), in a trusted environment")
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{path} could not be loaded with weights_only=True (truncated or corrupt?): {first}"


def unwrap_state_dict(data: object, key: Optional[str] = None, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{source} holds a {type(data).__name__}, not a state dict")
    if key is not None:
        if key not in data:
            raise CheckpointError(f"{source} has no key {key!r}; top-level keys: {sorted(map(str, data))[:20]}")
        data = data[key]
    elif not _is_tensor_dict(data):
        for candidate in NESTED_KEYS:
            if candidate in data and isinstance(data[candidate], Mapping):
                data = data[candidate]
                break
        else:
            raise CheckpointError(
                f"{source} is not a flat state dict and has none of {list(NESTED_KEYS)}; "
                f"top-level keys: {sorted(map(str, data))[:20]}"
            )
    tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointError(f"{source} contains no tensors")
    return tensors


def _is_tensor_dict(data: Mapping) -> bool:
    return len(data) > 0 and all(isinstance(v, torch.Tensor) for v in data.values())


def load_strict(
    module: nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    ignore: Sequence[str] = (),
    source: str = "checkpoint",
) -> None:
    """`load_state_dict(strict=True)` with a readable error.

    Keys matching a regex in `ignore` are dropped first (run-time state some training
    scripts saved, such as rotary tables). Missing, unexpected and mis-shaped keys are all
    listed in one CheckpointError.
    """
    patterns = [re.compile(p) for p in ignore]
    state_dict = {k: v for k, v in state_dict.items() if not any(p.fullmatch(k) for p in patterns)}
    check_shapes(module, {k: tuple(v.shape) for k, v in state_dict.items()}, source)
    module.load_state_dict(state_dict, strict=True)


def check_shapes(module: nn.Module, shapes: Mapping[str, tuple[int, ...]], source: str = "checkpoint") -> None:
    """CheckpointError listing every missing, unexpected and mis-shaped key of a checkpoint's
    tensor `shapes` against `module`'s state dict (which may live on the meta device)."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    mismatched = sorted(f"{k}: checkpoint {shapes[k]} vs model {expected[k]}"
                        for k in set(expected) & set(shapes) if tuple(shapes[k]) != expected[k])
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"{source} does not match {type(module).__name__}:"
            + _listing("missing keys", missing)
            + _listing("unexpected keys", unexpected)
            + _listing("shape mismatches", mismatched)
        )


def _listing(title: str, items: Iterable[str], limit: int = 25) -> str:
    items = list(items)
    if not items:
        return ""
    shown = ", ".join(items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
    return f"\n  {title} ({len(items)}): {shown}"


def save_safetensors(state_dict: Mapping[str, torch.Tensor], path: PathLike) -> None:
    """Write tensors atomically (temp file + rename), contiguous and on the CPU."""
    from safetensors.torch import save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}))
