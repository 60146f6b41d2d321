"""Triton kernels with torch reference twins for the decoding core's hot non-matmul work.

- `sample_logits`: CFG + temperature + top-k/top-p + softmax + sampling of [N, V] logits in one
  kernel (`kernels/sampling.py`).
- `verify_exact`: exact-rule acceptance of a batch of drafts and the finalised token after the
  accepted prefix in one kernel (`kernels/verify.py`).

Each op is one function of `kernels/dispatch.py`: the Triton kernel on CUDA tensors, the twin
(the core's own torch code) elsewhere, `backend=` or MMGEN_KERNELS to force either. Randomness
is always the caller's (noise drawn from its torch.Generator), so both paths give the same
tokens. Importing this package never imports triton.

- `relaxed_target`: a bounded lossy rule's relaxed target pi, against which the rule is the
  exact verify: GSD's rank groups in one kernel (`kernels/grouped.py`, the twin's bits),
  LANTERN's codebook neighbourhoods in two (`kernels/relaxed.py`, to float32 rounding).
- `step.ExactStep`: these ops as one decode step, in the torch path's draw order; the decoding
  loop runs its one-token-per-slot steps (no rule, the exact rule, bounded GSD / LANTERN /
  LANTERN++) through it on CUDA.
"""

from mmgen.kernels.dispatch import BACKENDS, backend_for, relaxed_target, sample_logits, verify_exact
from mmgen.sampling import exponential_noise  # the noise the ops take: `sample`'s own draws

__all__ = ["BACKENDS", "backend_for", "exponential_noise", "relaxed_target", "sample_logits", "verify_exact"]
