"""Decode steps under `torch.compile`, opt-in: one static-shape graph per window width.

A decoder calls `model.forward(state, window)` once per step with a window of fixed width (1
token for an autoregressive step, the window for a verify step) against a preallocated cache,
so a step's shapes repeat: each width compiles once (`dynamic=False`), and positions, lengths
and masks are read from the cache's tensors, never from Python numbers the graph would
specialise on. On CUDA the step is also captured in a CUDA graph (`mode="reduce-overhead"`),
which removes the per-kernel launch cost that dominates a batch-1 step; elsewhere it runs
inductor's default code.

`compile_forward(model, device)` does this to any `TokenModel` whose forward traces as one graph
(`fullgraph=True`: a graph break is an error at the first call, not a silent slowdown).
`CachePool` keeps a model's static caches across decodes, so a captured graph keeps reading
the addresses it was captured with instead of being captured again for every decode.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Hashable, Optional, TypeVar, Union

import torch

#: Graphs one compiled step may hold (torch's default of 8 is met by a few window widths times
#: guidance on/off times cache sizes); past it torch falls back to eager for new shapes.
RECOMPILE_LIMIT = 64

Model = TypeVar("Model")


def compile_mode(device: Union[str, torch.device]) -> Optional[str]:
    """`torch.compile`'s mode for decode steps on `device`: CUDA graphs on CUDA, else the default."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


class CompiledStep:
    """`fn` under `torch.compile(fullgraph=True, dynamic=False)` in `compile_mode(device)`.

    Under CUDA graphs every call starts a new graph step and returns copies of the outputs:
    the graph's own output memory is overwritten by the next replay, and decoders may keep a
    step's logits past it.
    """

    def __init__(self, fn: Callable, device: Union[str, torch.device]):
        self.fn = fn
        self.mode = compile_mode(device)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode=self.mode)

    @property
    def cuda_graphs(self) -> bool:
        return self.mode == "reduce-overhead"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.cuda_graphs:
            return self.compiled(*args, **kwargs)
        torch.compiler.cudagraph_mark_step_begin()
        return _owned(self.compiled(*args, **kwargs))


def compile_forward(model: Model, device: Union[str, torch.device]) -> Model:
    """Make `model.forward` (a `TokenModel`'s decode step) a `CompiledStep` for `device`, in
    place; returns the model. Start, commit and rewind stay eager (the prefill's length varies
    with the conditions; commits are a few index updates)."""
    if isinstance(model.forward, CompiledStep):
        return model
    model.forward = CompiledStep(model.forward, device)
    return model


def _owned(out: Any) -> Any:
    """`out` with every tensor copied (tensors, tuples, lists, dicts and dataclasses of them)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_owned(x) for x in out)
    if isinstance(out, dict):
        return {k: _owned(v) for k, v in out.items()}
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: _owned(getattr(out, f.name)) for f in dataclasses.fields(out) if f.init})
    return out


class CachePool:
    """Static caches kept across decodes, one per key (its shape): a decode takes the cache of
    its key, cleared to its freshly allocated state, so graphs captured on it are replayed.

    A cache is lent to one decode state at a time, held by a weak reference: while that state
    is alive (a decode still running, or kept by the caller), the next decode of the same key
    gets a fresh cache instead, which then becomes the pooled one.
    """

    def __init__(self):
        self._entries: dict[Hashable, tuple[Any, Callable[[], Any]]] = {}

    def take(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The pooled cache of `key`, cleared (its `clear()`), if no live state holds it; else
        `make()`. Call `lend` with the state built on it."""
        entry = self._entries.get(key)
        if entry is not None and entry[1]() is None:
            cache = entry[0]
            cache.clear()
            return cache
        return make()

    def lend(self, key: Hashable, cache: Any, state: Any) -> None:
        """Record that `state` holds `cache` (the pooled cache of `key` from now on)."""
        self._entries[key] = (cache, weakref.ref(state))
