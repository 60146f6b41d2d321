"""The one dispatch point: each op runs its Triton kernel on CUDA tensors when triton imports,
and its torch twin (the core's own code path) everywhere else.

`backend=` on a call, or the environment variable MMGEN_KERNELS, overrides the choice:
"auto" (the default), "twin" or "triton". Forcing "triton" on CPU tensors runs Triton's
interpreter, which needs TRITON_INTERPRET=1 set before triton is first imported (the tests do
that in a subprocess). Nothing here imports triton or the kernel modules until an op runs, so
`import mmgen.kernels` works without triton (and without the decoders: it loads the sampling
module alone). The kernel modules import the core's rules (`mmgen.decoding.acceptance`,
`mmgen.decoding.finalise`), never the decoding loop, which imports this package and `step.py`
when a decode starts: the two never import each other's modules in a cycle
(tests/test_import_rules.py).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional, Union

import torch

from mmgen.sampling import Logits

BACKENDS = ("auto", "twin", "triton")


def backend_for(where: Union[torch.Tensor, torch.device, str], backend: Optional[str] = None) -> str:
    """"triton" or "twin" for an op on a tensor (or device): `backend`, else $MMGEN_KERNELS,
    else auto."""
    choice = backend or os.environ.get("MMGEN_KERNELS", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {choice!r} (argument or MMGEN_KERNELS)")
    cuda = torch.device(where.device if isinstance(where, torch.Tensor) else where).type == "cuda"
    if choice == "auto":
        return "triton" if cuda and importlib.util.find_spec("triton") is not None else "twin"
    if choice == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (set before triton is imported)")
    return choice


def sample_logits(logits: Logits, scale: Optional[torch.Tensor], noise: torch.Tensor, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, *, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CFG (per-row `scale` [...], float32; unused without `logits.uncond`), temperature (0: greedy),
    top-k, top-p, softmax and the exponential race with Exp(1) `noise` [..., V]
    (`exponential_noise`): (float32 probabilities [..., V], tokens [...]), exactly what
    `SamplingConfig.probs` and `sample` give for that scale and noise."""
    from mmgen.kernels import sampling

    if logits.uncond is not None:
        if scale is None:
            raise ValueError("guided logits (with uncond) need a guidance scale per row")
        scale = torch.as_tensor(scale, dtype=torch.float32, device=logits.cond.device)
    if backend_for(logits.cond, backend) == "triton":
        return sampling.sample_logits_triton(logits, scale, noise, temperature, top_k, top_p)
    return sampling.sample_logits_twin(logits, scale, noise, temperature, top_k, top_p)


def verify_exact(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor,
                 bonus: torch.Tensor, *, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact-rule verify and finalise of drafts [B, n] drawn from q [B, n, V] against p
    [B, n, V] with `uniforms` [B, n], residual noise [B, n, V] and bonus tokens [B]:
    (accepted prefix length n_acc [B], the token finalised after it [B])."""
    from mmgen.kernels import verify

    if backend_for(p, backend) == "triton":
        return verify.verify_exact_triton(p, q, drafts, uniforms, noise, bonus)
    return verify.verify_exact_twin(p, q, drafts, uniforms, noise, bonus)



def relaxed_target(rule, p: torch.Tensor, q: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
    """A bounded lossy rule's relaxed target pi [..., V] for target laws p and draft laws q
    [..., V] (`NeighbourhoodAcceptance.relaxed_target`; the rule is the exact verify against
    pi). Where the dispatch picks Triton: GSD's groups in one kernel (with the rule's close-pair
    bitset: vocabularies up to 16384), LANTERN's neighbourhoods in two. The twin, and every
    other case, is the rule's own torch code."""
    from mmgen.decoding.acceptance import GroupedAcceptance, RelaxedAcceptance

    if backend_for(p, backend) == "triton":
        if type(rule) is GroupedAcceptance and rule.close is not None and rule.close.bits is not None:
            from mmgen.kernels import grouped

            return grouped.grouped_target_triton(rule, p, q)
        if type(rule) is RelaxedAcceptance and rule.neighbours is not None:
            from mmgen.kernels import relaxed

            return relaxed.relaxed_target_triton(rule, p, q)
    return rule.relaxed_target(p, q)
