"""Causal Wan-2.1 generators (Self-Forcing, CausVid) into diffusers' `WanTransformer3DModel`.

Both projects release a few-step, block-causal Wan-2.1-T2V-1.3B generator in the original Wan
layout (`blocks.0.self_attn.q.weight`, `head.modulation`, ...), nested in a training checkpoint:

* Self-Forcing `checkpoints/self_forcing_dmd.pt`: `{"generator": ..., "generator_ema": ...}` (its
  distillation trainer may also save a `"critic"`); the weights of the wrapper, so every key starts
  with `model.`. The EMA (`generator_ema`) is what its README runs (`--use_ema`).
* CausVid `autoregressive_checkpoint/model.pt`: `{"generator": ...}` (+ `"critic"` from the DMD
  trainer), keys `model.` + Wan layout as well; no EMA.

The causal models add no weights to Wan's (rotary tables and the KV cache are run-time state), so
the key mapping is diffusers' own Wan converter; this module only unwraps the nesting and the
training-wrapper prefixes (`model.`, `module.`, `_fsdp_wrapped_module.`, `_orig_mod.`, ...), infers
the config from tensor shapes, and checks the keys against the model before building it.

The block-causal attention, per-frame timesteps and KV cache are inference-time behaviour, not
part of the converted weights or config.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from mmgen.hub import SAFE_METADATA, CheckpointError, load_failure_message, read_json, unwrap_state_dict

PathLike = Union[str, os.PathLike]

#: `which` → the entry of the training checkpoint that holds that generator.
WHICH_KEYS = {"ema": "generator_ema", "generator": "generator"}
#: Path components inserted by training wrappers (FSDP, activation checkpointing, torch.compile).
WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
#: Leading components stripped before the model's own names (Self-Forcing/CausVid's
#: `WanDiffusionWrapper.model`, DDP's `module`, ComfyUI's `model.diffusion_model`, ...).
PREFIX_PARTS = frozenset({"model", "module", "diffusion_model", "transformer", "generator", "generator_ema"})
#: First components of the original Wan layout.
OFFICIAL_ROOTS = frozenset({"patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks", "head",
                            "img_emb"})
#: First components of the diffusers layout (a checkpoint already converted passes through unchanged).
DIFFUSERS_ROOTS = frozenset({"patch_embedding", "condition_embedder", "blocks", "proj_out", "scale_shift_table"})
#: Original Wan config names accepted in `config`, and the `WanTransformer3DModel` names they mean.
CONFIG_ALIASES = {"num_heads": "num_attention_heads", "in_dim": "in_channels", "out_dim": "out_channels"}
#: Original Wan / Self-Forcing settings that are not part of the diffusers model config (`dim` is
#: checked against the weights; the rest are inference-time settings or fixed by the layout).
CONFIG_IGNORED = frozenset({"dim", "model_type", "text_len", "window_size", "local_attn_size", "sink_size"})
#: Attention head width of every released Wan-2.1 model (1.3B: 1536 = 12 x 128, 14B: 5120 = 40 x 128).
DEFAULT_HEAD_DIM = 128


def load_causal_wan_state_dict(path: PathLike, which: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The generator of a Self-Forcing / CausVid checkpoint as a flat dict with root-relative keys.

    `which`: "ema" (`generator_ema`), "generator" (the trained weights), or None: the EMA when the
    checkpoint has one, else the generator, else a flat or `model`/`state_dict`-nested file.
    `.pt/.pth/.bin/.ckpt` load only through `torch.load(weights_only=True)`; `.safetensors` through
    `mmgen.hub.load_state_dict` (keys `generator_ema.` / `generator.` there act as the nesting).
    Wrapper components (`_fsdp_wrapped_module.`, `_orig_mod.`, ...) are dropped and leading
    `model.` / `module.` prefixes stripped, so Self-Forcing's `model.blocks.0.self_attn.q.weight`
    comes back as `blocks.0.self_attn.q.weight`.
    """
    if which is not None and which not in WHICH_KEYS:
        raise ValueError(f"which must be one of {sorted(WHICH_KEYS)} or None, not {which!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    data = _read(path)
    entry = _choose_entry(data, which, str(path))
    tensors = unwrap_state_dict(data, entry, str(path))
    return strip_prefixes(tensors, str(path))


def _read(path: Path) -> Mapping:
    if path.suffix == ".safetensors":
        from mmgen.hub import load_state_dict

        flat = load_state_dict(path)
        nested_names = {k.split(".", 1)[0] for k in flat if "." in k} & (set(WHICH_KEYS.values()) | {"critic"})
        if not nested_names:
            return flat
        nested: dict[str, dict] = {}
        for key, value in flat.items():
            head, _, rest = key.partition(".")
            if head in nested_names and rest:
                nested.setdefault(head, {})[rest] = value
            else:
                nested.setdefault("", {})[key] = value
        return nested
    if path.suffix not in (".pt", ".pth", ".bin", ".ckpt"):
        raise CheckpointError(f"unsupported checkpoint format {path.suffix!r} ({path}); "
                              f"use .pt, .pth, .bin or .safetensors")
    try:
        with torch.serialization.safe_globals(list(SAFE_METADATA)):
            try:  # memory-mapped: of a generator + EMA + critic file only the chosen entry is read
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):  # legacy (non-zip) torch.save format cannot be mapped
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(load_failure_message(path, error)) from error


def _choose_entry(data: object, which: Optional[str], source: str) -> Optional[str]:
    """The top-level key holding the requested generator (None: let `unwrap_state_dict` decide)."""
    if not isinstance(data, Mapping):
        raise CheckpointError(f"{source} holds a {type(data).__name__}, not a state dict")
    top = sorted(map(str, data))
    if which is not None:
        entry = WHICH_KEYS[which]
        if entry not in data:
            hint = ""
            if which == "ema" and "generator" in data:
                hint = " (CausVid releases only the generator: which='generator')"
            raise CheckpointError(f"{source} has no {entry!r} entry for which={which!r}{hint}; "
                                  f"top-level keys: {top[:20]}")
        return entry
    for entry in ("generator_ema", "generator"):
        if entry in data and isinstance(data[entry], Mapping):
            return entry
    return None


def strip_prefixes(state_dict: Mapping[str, torch.Tensor], source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Keys relative to the transformer: wrapper components dropped anywhere, then leading
    `PREFIX_PARTS` removed until a Wan (or diffusers) root name starts the key. Keys that never
    reach one are kept as they are (the key check names them)."""
    roots = OFFICIAL_ROOTS | DIFFUSERS_ROOTS
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, value in state_dict.items():
        parts = [p for p in key.split(".") if p not in WRAPPER_PARTS]
        start = 0
        while start < len(parts) - 1 and parts[start] not in roots and parts[start] in PREFIX_PARTS:
            start += 1
        new = ".".join(parts[start:]) if parts[start] in roots else ".".join(parts)
        if new in out:
            raise CheckpointError(f"{source}: keys {origin[new]!r} and {key!r} both map to {new!r}")
        out[new], origin[new] = value, key
    return out


def convert_causal_wan(state_dict: Mapping[str, torch.Tensor], config: Optional[Mapping] = None,
                       source: str = "checkpoint") -> tuple[dict[str, torch.Tensor], dict]:
    """Original-layout Wan weights → (`WanTransformer3DModel` state dict, its config).

    Keys may still carry training prefixes (they are stripped). The renaming is diffusers'
    `convert_wan_transformer_to_diffusers`; a state dict already in the diffusers layout passes
    through. The config is inferred from the shapes (width, FFN width, layers, text / time /
    channel sizes, patch, norms); the head count is not in the shapes: `config` may give
    `num_attention_heads` or `attention_head_dim` (original names `num_heads`, `in_dim`, `out_dim`
    are accepted), else heads of 128 channels, as in every released Wan-2.1 model. The keys and
    shapes are checked against the model (built on the meta device, no memory): missing,
    unexpected and mis-shaped keys are named in one CheckpointError line.
    """
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    state_dict = strip_prefixes(state_dict, source)
    if not state_dict:
        raise CheckpointError(f"{source} contains no tensors")
    origin = {id(v): k for k, v in state_dict.items()}
    firsts = {k.split(".", 1)[0] for k in state_dict}
    if firsts & {"condition_embedder", "proj_out"} and not firsts & {"text_embedding", "time_embedding", "head"}:
        converted = dict(state_dict)
    else:
        converted = convert_wan_transformer_to_diffusers(dict(state_dict))
    renamed_from = {k: origin.get(id(v), k) for k, v in converted.items()}
    full = _resolve_config(_infer_config(converted, source), config, source)
    _check_keys(converted, full, renamed_from, source)
    return converted, full


def _infer_config(sd: Mapping[str, torch.Tensor], source: str) -> dict:
    def shape(key: str, official: str) -> tuple[int, ...]:
        if key not in sd:
            raise CheckpointError(f"{source}: cannot infer the Wan config, {official!r} is missing "
                                  f"(not a Wan-2.1 transformer checkpoint?); first keys: {sorted(sd)[:8]}")
        return tuple(sd[key].shape)

    inner, in_channels, *patch = shape("patch_embedding.weight", "patch_embedding.weight")
    if len(patch) != 3:
        raise CheckpointError(f"{source}: patch_embedding.weight has shape {(inner, in_channels, *patch)}, "
                              f"not a Conv3d weight")
    layers = sorted({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    if not layers:
        raise CheckpointError(f"{source}: cannot infer the Wan config, no 'blocks.N.' keys")
    config = {
        "patch_size": tuple(patch),
        "in_channels": in_channels,
        "out_channels": shape("proj_out.weight", "head.head.weight")[0] // max(1, patch[0] * patch[1] * patch[2]),
        "text_dim": shape("condition_embedder.text_embedder.linear_1.weight", "text_embedding.0.weight")[1],
        "freq_dim": shape("condition_embedder.time_embedder.linear_1.weight", "time_embedding.0.weight")[1],
        "ffn_dim": shape("blocks.0.ffn.net.0.proj.weight", "blocks.0.ffn.0.weight")[0],
        "num_layers": layers[-1] + 1,
        "cross_attn_norm": "blocks.0.norm2.weight" in sd,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in sd else None,
        "eps": 1e-6,
        "image_dim": None,
        "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024,
        "pos_embed_seq_len": None,
        "_inner_dim": inner,
    }
    if "condition_embedder.image_embedder.norm1.weight" in sd:
        config["image_dim"] = int(sd["condition_embedder.image_embedder.norm1.weight"].shape[0])
    if "blocks.0.attn2.add_k_proj.weight" in sd:
        config["added_kv_proj_dim"] = int(sd["blocks.0.attn2.add_k_proj.weight"].shape[1])
    return config


def _resolve_config(inferred: dict, given: Optional[Mapping], source: str) -> dict:
    from diffusers import WanTransformer3DModel

    inner = inferred.pop("_inner_dim")
    allowed = set(inspect.signature(WanTransformer3DModel.__init__).parameters) - {"self"}
    overrides: dict = {}
    for key, value in dict(given or {}).items():
        if key.startswith("_"):
            continue
        if key == "dim" and value != inner:
            raise ValueError(f"config dim={value} but the checkpoint's width is {inner} (patch_embedding.weight)")
        if key in CONFIG_IGNORED:
            continue
        name = CONFIG_ALIASES.get(key, key)
        if name not in allowed:
            raise ValueError(f"unknown config key {key!r}; WanTransformer3DModel takes {sorted(allowed)}")
        if name == "qk_norm" and isinstance(value, bool):
            value = "rms_norm_across_heads" if value else None
        if name == "patch_size":
            value = tuple(value)
        overrides[name] = value
    config = {**inferred, **overrides}
    heads, head_dim = config.get("num_attention_heads"), config.get("attention_head_dim")
    if heads is None and head_dim is None:
        head_dim = DEFAULT_HEAD_DIM
    if heads is None:
        if inner % head_dim:
            raise ValueError(f"{source}: width {inner} is not a multiple of attention_head_dim {head_dim}; "
                             f"pass config={{'num_attention_heads': ...}}")
        heads = inner // head_dim
    if head_dim is None:
        if inner % heads:
            raise ValueError(f"{source}: width {inner} is not divisible by num_attention_heads={heads}")
        head_dim = inner // heads
    if heads * head_dim != inner:
        raise ValueError(f"{source}: num_attention_heads={heads} x attention_head_dim={head_dim} != width {inner}")
    if head_dim % 2:
        raise ValueError(f"{source}: attention_head_dim={head_dim} must be even (3D rotary embedding)")
    config["num_attention_heads"], config["attention_head_dim"] = int(heads), int(head_dim)
    return config


def _check_keys(sd: Mapping[str, torch.Tensor], config: dict, renamed_from: Mapping[str, str], source: str) -> None:
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in WanTransformer3DModel(**config).state_dict().items()}
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    shapes = sorted(f"{k} {tuple(sd[k].shape)} vs {expected[k]}" for k in set(sd) & set(expected)
                    if tuple(sd[k].shape) != expected[k])

    def named(key: str) -> str:
        return key if renamed_from.get(key, key) == key else f"{renamed_from[key]} (as {key})"

    parts = []
    for title, items in (("missing", missing), ("unexpected", [named(k) for k in unexpected]),
                         ("mis-shaped", shapes)):
        if items:
            parts.append(f"{len(items)} {title}: " + ", ".join(items[:12]) + (", ..." if len(items) > 12 else ""))
    if parts:
        names = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim")
        brief = ", ".join(f"{k}={config[k]}" for k in names)
        raise CheckpointError(f"{source} does not match WanTransformer3DModel({brief}): " + "; ".join(parts))


def convert_to_pipeline_transformer(path: PathLike, out_folder: PathLike, which: Optional[str] = None,
                                    config: Optional[Mapping] = None, dtype: Optional[torch.dtype] = None,
                                    overwrite: bool = False) -> Path:
    """Convert a Self-Forcing / CausVid checkpoint into a diffusers `WanTransformer3DModel` folder
    (`config.json` + safetensors, what `WanTransformer3DModel.from_pretrained(out_folder)` reads).

    `which` as in `load_causal_wan_state_dict`; `dtype` defaults to the checkpoint's floating dtype
    (Self-Forcing's EMA is float32). A non-empty `out_folder` is an error unless `overwrite=True`.
    Returns `out_folder`.
    """
    from diffusers import WanTransformer3DModel
    from diffusers.models.modeling_utils import no_init_weights

    out = Path(out_folder)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {out} is not empty; pass overwrite=True to write into it")
    if which is not None and which not in WHICH_KEYS:
        raise ValueError(f"which must be one of {sorted(WHICH_KEYS)} or None, not {which!r}")
    state_dict = load_causal_wan_state_dict(path, which)
    converted, full = convert_causal_wan(state_dict, config, source=str(path))
    if dtype is None:
        floats = {v.dtype for v in converted.values() if v.is_floating_point()}
        dtype = floats.pop() if len(floats) == 1 else torch.float32
    with no_init_weights():
        model = WanTransformer3DModel(**full)
    model = model.to(dtype)
    try:  # convert_causal_wan already compared keys and shapes; this is the strict load itself
        model.load_state_dict(converted, strict=True)
    except RuntimeError as error:
        reason = " ".join(str(error).split())
        raise CheckpointError(f"{path} does not load into WanTransformer3DModel: {reason}") from error
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


#: Pipeline settings of the released causal generators (their inference configs): blocks of 3
#: latent frames, 81 frames at 480×832 and 16 fps, the few-step re-noising sampler. Self-Forcing
#: warps [1000, 750, 500, 250] through the shift-5 flow schedule (σ = 1, 0.9375, 0.833, 0.625);
#: CausVid's list [1000, 757, 522] is used as is (shift 1 here: no warp).
PRESETS = {
    "self-forcing": dict(block_frames=3, num_frames=81, height=480, width=832, fps=16.0,
                         timesteps=(1000.0, 750.0, 500.0, 250.0), shift=5.0, stochastic=True),
    "causvid": dict(block_frames=3, num_frames=81, height=480, width=832, fps=16.0,
                    timesteps=(1000.0, 757.0, 522.0), shift=1.0, stochastic=True),
}


def convert_to_pipeline(path: PathLike, wan: PathLike, out_folder: PathLike, preset: str = "self-forcing",
                        which: Optional[str] = None, config: Optional[Mapping] = None, overwrite: bool = False) -> Path:
    """A `BlockDiffusionVideoPipeline` folder from a Self-Forcing / CausVid checkpoint and the
    diffusers Wan-2.1 folder (or Hub id) whose VAE, UMT5 encoder and tokenizer it was trained
    with (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers). The transformer loads strictly; its head count
    comes from `config`, else from the Wan folder's transformer/config.json, else 128-wide heads."""
    import tempfile

    from mmgen.video.pipeline import BlockDiffusionVideoPipeline, wan_folder

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, not {preset!r}")
    out = Path(out_folder)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise ValueError(f"output {out} exists and is not an empty folder; pass overwrite=True to write into it")
    base = wan_folder(wan, with_transformer=False) / "transformer" / "config.json"
    if config is None and base.is_file():
        config = {"num_attention_heads": read_json(base)["num_attention_heads"]}
    with tempfile.TemporaryDirectory() as scratch:
        transformer = convert_to_pipeline_transformer(path, Path(scratch) / "transformer", which=which, config=config)
        pipe = BlockDiffusionVideoPipeline.from_wan(wan, transformer=transformer, **PRESETS[preset])
        pipe.save_pretrained(out)
    return out
