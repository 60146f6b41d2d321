"""Finding and loading checkpoints: local files and folders, Hugging Face repos, official `.pt`.

Safetensors first; `.pt/.pth/.bin` only through `torch.load(weights_only=True)`, so a
checkpoint can never run code. Loading into a model is strict: a mismatch names every
missing, unexpected and mis-shaped key.

Model folders are not trusted: every loader reads one through `loading_folder`, which refuses a
folder with a link out of it (`folder_file`, `check_model_folder`) or a config sized past any real
model (`check_config_sizes`) before anything is read, and turns what a bad folder makes
transformers, diffusers or torch raise into one `CheckpointError` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import stat
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from mmgen.files import write_atomic

#: The file that names an mmgen pipeline folder's class and components (diffusers' layout).
MODEL_INDEX = "model_index.json"

PathLike = Union[str, os.PathLike]

#: The largest config file (config.json, model_index.json, ...) mmgen reads.
MAX_JSON_BYTES = 16 << 20
#: Where official training scripts nest the weights, in the order they are tried.
NESTED_KEYS = ("model", "module", "state_dict", "model_ema", "generator_ema")
#: Metadata classes that training checkpoints pickle beside the weights and that
#: `weights_only=True` may rebuild: plain attribute bags that run no code (LlamaGen's scripts
#: save their `args`). Nothing else is allowed.
SAFE_METADATA = (argparse.Namespace,)
#: Why `torch.load(weights_only=True)` refuses a pickle (torch's own message goes on for lines and
#: suggests `weights_only=False`, which mmgen never does).
UNPICKLING_REFUSED = ("it holds pickled objects besides tensors and plain containers, which mmgen does not load "
                      "(torch.load(weights_only=True)), or it is not a torch checkpoint")
#: A model folder holds at most this many files and folders: the walk that checks its links stays short.
MAX_FOLDER_ENTRIES = 10_000
#: Config fields that size a model, by kind (transformers', diffusers' and mmgen's names, in
#: nested configs too), and the most a model folder's config may give each kind: far above every
#: released model (widths up to 53,248, 126 layers, 262,144-token vocabularies, 10M positions),
#: low enough that a skeleton built from them has sizes that fit in int64 and builds in moments.
SIZE_FIELDS = {
    "width": frozenset({
        "dim", "hidden_size", "hidden", "hidden_dim", "d_model", "n_embd", "embed_dim", "intermediate_size", "d_ff",
        "ffn_dim", "encoder_embed_dim", "decoder_embed_dim", "vae_embed_dim", "encoder_hidden_size",
        "decoder_hidden_size", "cross_hidden_size", "caption_dim", "text_dim", "freq_dim", "diffloss_w", "channels",
        "ch", "base_channels", "base_dim", "decoder_base_dim", "z_channels", "z_dim", "cvae", "in_channels",
        "out_channels", "num_channels", "head_dim", "attention_head_dim", "d_kv", "cross_head_dim", "projection_dim",
        "codebook_dim", "codebook_embed_dim", "num_attention_heads", "num_key_value_heads", "n_head", "n_kv_head",
        "num_heads", "encoder_num_heads", "decoder_num_heads", "cross_num_attention_heads",
        "cross_num_key_value_heads"}),
    "depth": frozenset({
        "n_layer", "num_hidden_layers", "num_layers", "depth", "encoder_depth", "decoder_depth", "diffloss_d",
        "num_encoder_layers", "num_decoder_layers", "encoder_layers", "decoder_layers", "layers", "num_res_blocks",
        "n_codebooks", "num_codebooks", "num_quantizers"}),
    "vocabulary": frozenset({"vocab_size", "codebook_size", "num_classes", "class_num", "classes"}),
    "positions": frozenset({"max_position_embeddings", "n_positions", "block_size", "rope_max_seq_len",
                            "image_seq_length", "cls_token_num", "buffer_size"}),
    "pixels": frozenset({"image_size", "img_size", "resolution", "sample_size"}),
    "ratio": frozenset({"mlp_ratio", "ffn_dim_multiplier", "ch_mult", "encoder_ch_mult", "decoder_ch_mult", "dim_mult"}),
}
SIZE_LIMITS = {"width": 1 << 18, "depth": 1 << 12, "vocabulary": 1 << 22, "positions": 1 << 24, "pixels": 1 << 16,
               "ratio": 64}
#: The most parameters a config may describe by the estimate depth x width^2 (2.2 trillion).
MAX_PARAMETERS = 1 << 41
_SIZE_KIND = {name: kind for kind, names in SIZE_FIELDS.items() for name in names}

# torch warns on every pickle of protocol > 2 that `weights_only=True` reads, in lines of its own
# before mmgen's one-line refusal; the warning asks for an issue, which helps no mmgen user.
warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)


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
    file of that folder or repo, never through a link out of it (`folder_file`). Anything that
    looks like a path (./x, ../x, /x, ~/x) is never a repo id. Offline or missing repos give an
    OSError that says so.
    """
    local = local_path(path_or_repo)
    if local is not None:
        target = folder_file(local, filename) if filename else local
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


def model_root(folder: PathLike) -> Path:
    """The real path that a model folder's files must stay inside: the folder's own, or for a
    snapshot of the Hugging Face cache (`models--org--name/snapshots/REV`, whose files are links
    to `../../blobs/`) the repo's cache folder."""
    real = Path(folder).resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def folder_file(folder: PathLike, name: PathLike, root: Optional[Path] = None) -> Path:
    """`folder / name`, refused (CheckpointError) where its real path leaves the model folder
    (`root`, by default `model_root(folder)`): a model folder is not trusted, and a link in it
    must not make mmgen read, say, a private file or another model's chat template. Links that
    stay inside the folder are fine. The file need not exist (callers say when it is missing)."""
    path = Path(folder) / name
    if not path.resolve().is_relative_to(model_root(folder) if root is None else root):
        raise CheckpointError(f"{path} is a symbolic link out of its model folder; mmgen reads a model's files only "
                              f"from inside its folder (copy the file in, or link to the whole folder instead)")
    return path


def check_model_folder(folder: PathLike, root: Optional[Path] = None) -> Path:
    """A local model folder, checked before mmgen or a library (transformers, diffusers) reads
    anything in it: no entry is a link whose real path leaves it (`folder_file`; `root`, by default
    `model_root(folder)`, is where they must stay) and every config.json in it sizes a model
    within bounds (`check_config_sizes`). CheckpointError otherwise, with one line."""
    folder = Path(folder)
    root = model_root(folder) if root is None else root
    entries = 0
    for parent, folders, files in os.walk(folder):  # links to folders are checked, not entered
        for name in folders + files:
            entries += 1
            if entries > MAX_FOLDER_ENTRIES:
                raise CheckpointError(f"{folder} holds more than {MAX_FOLDER_ENTRIES} files and folders: not a model folder")
            path = folder_file(parent, name, root)
            if name == "config.json" and not path.is_dir():
                check_config_sizes(read_json(path), str(path))
    return folder


def check_config_sizes(config: Mapping, source: str) -> None:
    """CheckpointError (one line) when a config, or a config nested in it, gives a size field
    (`SIZE_FIELDS`: widths, depths, vocabularies, positions, ...) past its kind's limit in
    `SIZE_LIMITS`, or describes more than `MAX_PARAMETERS` parameters (depth x width^2): checked
    before a model is built from it, so a corrupt or hostile config cannot overflow a tensor's
    size, hang building a billion layers or allocate what no machine holds."""

    def check(mapping: Mapping, where: str) -> None:
        widths, depth = [0], 0
        for key, value in mapping.items():
            name = f"{where}{key}"
            if isinstance(value, Mapping):
                check(value, f"{name}.")
                continue
            kind = _SIZE_KIND.get(str(key))
            numbers = value if isinstance(value, list) else [value]
            if kind is None or not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
                if isinstance(value, list):
                    for i, item in enumerate(value):
                        if isinstance(item, Mapping):
                            check(item, f"{name}[{i}].")
                continue
            limit = SIZE_LIMITS[kind]
            if len(numbers) > SIZE_LIMITS["depth"] or any(not n <= limit for n in numbers):  # `not <=`: NaN too
                shown = value if len(numbers) <= 8 else f"a list of {len(numbers)} numbers"
                raise CheckpointError(f"{source}: {name} = {shown} is past what any model has (a {kind} of at most "
                                      f"{limit}); refusing to build it")
            if kind == "width":
                widths.append(max(numbers))
            elif kind == "depth":
                depth += max(numbers)
        if depth * max(widths) ** 2 > MAX_PARAMETERS:
            sizes = f"the sizes of {where.rstrip('.')}" if where else "its sizes"
            raise CheckpointError(f"{source}: {sizes} describe about {depth * max(widths) ** 2:.2g} parameters "
                                  f"(depth x width^2), past the {MAX_PARAMETERS:.2g} mmgen builds")

    check(config, "")


@contextlib.contextmanager
def loading_folder(source: PathLike) -> Iterator[None]:
    """The one guard around loading a model folder (mmgen's own or through transformers or
    diffusers): a local folder is checked first (`check_model_folder`: links, config sizes), and
    what a bad folder makes the libraries raise (a mis-shaped or unreadable weight file, a pickle
    `weights_only=True` refuses, a config field of the wrong type) comes out as one
    CheckpointError line naming the folder. OSError (a missing file, the Hub) and ValueError
    (already a message) pass through."""
    local = local_path(source)
    if local is not None and local.is_dir():
        check_model_folder(local)
    try:
        yield
    except (OSError, ValueError):
        raise
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"{source}: a weight file could not be loaded: {UNPICKLING_REFUSED}") from error
    except Exception as error:  # the libraries raise many types on a bad folder; all mean "cannot load it"
        raise CheckpointError(f"{source} could not be loaded: {type(error).__name__}: {one_line(error)}") from error


def one_line(error: BaseException, limit: int = 400) -> str:
    """An exception's message on one line, at most `limit` characters (the libraries' span many)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
    if isinstance(error, pickle.UnpicklingError):
        return f"{path} could not be loaded: {UNPICKLING_REFUSED}"
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
