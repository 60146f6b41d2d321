"""Generation under `torch.inference_mode`, handing back ordinary tensors.

`inference_mode` skips autograd's per-operation bookkeeping (version counters, view tracking)
that `torch.no_grad` keeps. A small model's decode step on a CPU is a few hundred small
operations, so the bundled VLM, speech and image models give the same outputs 4-14% sooner on
one thread (docs/history.md, "The machine"); large operations (the video models) gain
nothing. Tensors made in that mode cannot be updated in place or saved for backward outside it,
so what a user receives is cloned into ordinary tensors (`ordinary`) on the way out: `audio *=
0.5` or training on generated tokens works as it does on the output of a `no_grad` call.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def ordinary(value: Any) -> Any:
    """`value` with every inference tensor in it (through dataclasses, lists, tuples and dicts)
    replaced by an ordinary copy; anything else is returned as it is. Safe inside and outside
    inference mode."""
    if isinstance(value, torch.Tensor):
        if not value.is_inference():
            return value
        with torch.inference_mode(False):
            return value.clone()
    if isinstance(value, (list, tuple)):
        items = [ordinary(item) for item in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        items = {key: ordinary(item) for key, item in value.items()}
        return value if all(items[k] is value[k] for k in value) else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for field in dataclasses.fields(value):
            item = getattr(value, field.name)
            new = ordinary(item)
            if new is not item:
                changed[field.name] = new
        if not changed:
            return value
        result = copy.copy(value)  # no __init__ or __post_init__ runs again
        for name, new in changed.items():
            object.__setattr__(result, name, new)  # frozen dataclasses too
        return result
    return value


def inference(fn: F) -> F:
    """Decorate a generation entry point (a pipeline's `__call__`, say): it runs under
    `torch.inference_mode` and returns `ordinary` tensors. Called where inference mode is already
    on (one decorated entry inside another, a server's worker, a caller's own `inference_mode`),
    it runs as it is and copies nothing: the outermost boundary hands back. Not for generator
    functions (a stream): their body runs between the caller's `next()` calls, outside the
    decorator."""
    if inspect.isgeneratorfunction(fn):
        raise TypeError(f"{fn.__qualname__} is a generator function; run its work through a decorated call")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():  # called from a decorated call (or a caller's own
            return fn(*args, **kwargs)         # inference mode): the outermost one hands back
        with torch.inference_mode():
            out = fn(*args, **kwargs)
        return ordinary(out)

    return run  # type: ignore[return-value]


def version(tensor: torch.Tensor) -> int:
    """`tensor._version` for memo keys, -1 for an inference tensor, which keeps no version
    counter. A memo keyed on -1 holds while the tensor is not changed in place: true of what
    the core keys this way (a forward's attention mask, tables derived from weights), which are
    made once and only read."""
    return -1 if tensor.is_inference() else tensor._version
