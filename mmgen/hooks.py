"""Model hooks: wrap a model's blocks from outside instead of threading arguments through them.

Token dropping (FastVAR's cached token pruning, FastV / MustDrop / VisionZip for VLMs) and
feature caching change what a block computes for one decode, not what the model is. They are
hooks on the blocks, built on diffusers' `ModelHook` / `HookRegistry` (the mechanism behind its
FirstBlockCache and PyramidAttentionBroadcast): a hook may rewrite a block's inputs
(`pre_forward`), its output (`post_forward`) or its whole forward (`new_forward(module, ...)`).

Blocks that hooks need to see inside expose their residual branches as `branches(...)`, so a
hook composes the branches itself (see `image_ar/var/transformer.py`'s FastVAR hook) and the
model's own forward stays the plain one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from diffusers.hooks import HookRegistry, ModelHook

__all__ = ["ModelHook", "attach_hook", "detach_hook", "hooks_attached"]


def attach_hook(module: torch.nn.Module, hook: ModelHook, name: str) -> None:
    """Register `hook` on `module` under `name` (one hook per name per module)."""
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)


def detach_hook(module: torch.nn.Module, name: str) -> None:
    """Remove the hook `name` from `module` (and only from it); nothing if it has none."""
    registry = getattr(module, "_diffusers_hook", None)
    if registry is not None:
        registry.remove_hook(name, recurse=False)


@contextmanager
def hooks_attached(hooks: Mapping[torch.nn.Module, ModelHook], name: str) -> Iterator[None]:
    """Attach each module's hook for the duration of the block, then detach them all, also on
    error: a decode's hooks never outlive it."""
    attached = []
    try:
        for module, hook in hooks.items():
            attach_hook(module, hook, name)
            attached.append(module)
        yield
    finally:
        for module in attached:
            detach_hook(module, name)
