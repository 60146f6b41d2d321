"""The protocols a model implements so the core's decoders can drive it.

Decoders know nothing of any architecture: they see a `TokenModel` that prefills its
conditions, scores n tokens per row at each row's own position, and keeps a given number of
them per row. Models may also offer per-token tables (`token_embeddings()`, `codebook()`)
that some acceptance rules read through `token_table`, a measured `window_cost`
(`mmgen.decoding.window`) that the adaptive window reads instead of its linear cost model, and
measured `window_tokens` that it starts from.
Classifier-free guidance is the model's business (only it knows what "no condition" means);
the decoder receives both halves in a `Logits` and applies the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import torch

from mmgen.inference import version
from mmgen.sampling import Logits


@dataclass
class DecodeState:
    """What a model keeps between calls while decoding one batch.

    `cache` is the model's own (a `StaticKVCache` for mmgen's models, a transformers `Cache`
    behind an adapter); with guidance it holds the conditional rows first and the
    unconditional rows after them, and both halves always advance together. `first_logits`
    predicts generated token 0.
    """

    cache: Any
    batch_size: int
    guidance: bool
    first_logits: Logits
    extra: Any = None
    #: A `HiddenStateModel`'s final hidden states of its latest forward [R, n, D] (the prefill:
    #: its last position only): what draft heads start from.
    hidden: Optional[torch.Tensor] = None

    @property
    def device(self) -> torch.device:
        return self.first_logits.cond.device

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the cache (0 when the cache does not say)."""
        return int(getattr(self.cache, "nbytes", 0))


@runtime_checkable
class TokenModel(Protocol):
    """Discrete tokens generated along one sequence axis (raster image AR, codec TTS, ...)."""

    vocab_size: int

    def start(self, conditions: Any, capacity: int, guidance: bool) -> DecodeState:
        """Prefill the conditions; allocate a cache with `capacity` positions after them.

        With `guidance`, also prefill the unconditional rows of a CFG batch. The decoder asks
        for more positions than it keeps (a draft window can run past the last token); what
        lands there is never read back, but positional tables must cover it.
        """
        ...

    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        """Feed tokens [B, n] at each row's committed length; logits[:, i] predict the token
        after tokens[:, i]. Writes the cache but commits nothing."""
        ...

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        """Keep the first `accepted[b]` tokens of row b from the last forward ([B] int64)."""
        ...

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        """Forget committed tokens: row b keeps its first `num_generated[b]` generated tokens
        ([B] int64, never more than it has). Draft models need it to drop rejected drafts."""
        ...


@runtime_checkable
class HiddenStateModel(Protocol):
    """A `TokenModel` that shows draft heads (Medusa, Hydra) what its output head reads.

    Every `start` and `forward` leaves its final hidden states (after the last norm: what the
    output head reads) in `state.hidden` [R, n, D]: R is every row the model runs, the
    conditional rows first and then, under guidance, their unconditional twins in the same
    order (R = B or 2B). After `restart` (continuous batching) the restarted row's entries at
    index 0 hold its prefill's last hidden state.
    """

    hidden_size: int

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embedding [b, n, D] of tokens [b, n] (frames [b, n, K])."""
        ...

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's raw float32 logits [R, n(, K), V] of hidden states [R, n, D]
        (no guidance, no processing): what heads are trained to match."""
        ...

    def hidden_logits(self, state: DecodeState, hidden: torch.Tensor, fed: torch.Tensor) -> Logits:
        """The logits `forward` would return at its last n positions had it been fed `fed`
        [B, m(, K)] (m >= n) after the committed tokens and its trunk made `hidden` [R, n, D]
        there (guidance and the model's own logits processing applied), without touching the
        state. Draft heads pass their newest state alone (n = 1) with every token fed so far."""
        ...


@runtime_checkable
class TreeModel(Protocol):
    """A `TokenModel` that verifies a token tree in one forward (SpecInfer's tree attention).

    The fed tokens are a tree flattened in slot order: slot 0 the newest committed token, every
    other slot a draft whose ancestors come before it. Each token sits at position "its row's
    next position + `depth`" (so a branch reads as a contiguous continuation) and attends to the
    committed tokens and to the window slots `visible` marks (its ancestors and itself). A model
    that verifies trees only in some configurations also offers `tree_refusal()`: why not (one
    line), or None; the loop asks it before any work.
    """

    def forward_tree(self, state: DecodeState, tokens: torch.Tensor, depth: torch.Tensor,
                     visible: torch.Tensor) -> Logits:
        """Logits [B, n, V] for `tokens` [B, n] at depths `depth` [n] (slot 0: depth 0), slot i
        attending to window slot j where `visible` [n, n] (bool) is True; leaves the forward
        pending as `forward` does (nothing committed) and, for a `HiddenStateModel`, its final
        hidden states in `state.hidden`."""
        ...

    def keep_path(self, state: DecodeState, path: torch.Tensor) -> None:
        """Move the pending forward's slots `path` [B, m] (row b's chosen branch, root first) to
        its first m slots, so that `commit(state, n)` keeps the first n tokens of each row's path."""
        ...


def place_hidden(state: DecodeState, rows: Sequence[int], hidden: torch.Tensor) -> None:
    """After a restart: the cache rows `rows` (a row and, under guidance, its unconditional twin)
    hold the prefill's last hidden states `hidden` [len(rows), 1, D] at index 0 of
    `state.hidden` (`HiddenStateModel`); nothing when the model keeps none."""
    if state.hidden is not None:
        state.hidden[list(rows), :1] = hidden.to(state.hidden.dtype)


@dataclass
class ScaleState:
    """What a next-scale model keeps while decoding one batch: its cache (conditional rows
    first, then unconditional ones with guidance) and how many token maps it has been fed."""

    cache: Any
    batch_size: int
    guidance: bool
    device: torch.device
    steps_fed: int = 0
    extra: Any = None

    @property
    def cache_bytes(self) -> int:
        return int(getattr(self.cache, "nbytes", 0))


@runtime_checkable
class ScaleModel(Protocol):
    """Next-scale prediction (VAR and its kin): step k emits a whole token map of
    `step_sizes[k]` tokens at once, conditioned on every coarser map.

    Feeding is decoupled from predicting so that a model can take over mid-way: `forward`
    takes the token maps it has not seen yet (none before step 0, one per step while decoding,
    every earlier map in one pass after a hand-off) and returns the logits of the next step.
    A map is a LongTensor [B, n] of tokens or float weights [B, n, V] over the vocabulary (a
    soft map, e.g. VAR's `more_smooth`).
    """

    vocab_size: int
    step_sizes: tuple[int, ...]

    def start(self, conditions: Any, num_steps: int, guidance: bool) -> ScaleState:
        """Allocate a cache for the first `num_steps` steps (a model that stops early needs
        less); feed nothing yet."""
        ...

    def forward(self, state: ScaleState, token_maps: Sequence[torch.Tensor]) -> Logits:
        """Feed `token_maps` (steps state.steps_fed, ...) and return the logits
        [B, step_sizes[next], V] of the step after them."""
        ...


@dataclass
class ContinuousState:
    """The canvas of a continuous-token decode: `tokens` [B, L, D] and which are `known` [B, L]
    (conditional rows; the model builds its CFG batch itself), with the `conditions` [B, ...]."""

    tokens: torch.Tensor
    known: torch.Tensor
    conditions: torch.Tensor
    guidance: bool

    @property
    def device(self) -> torch.device:
        return self.tokens.device


@dataclass
class HeadSample:
    """A diffusion head's tokens `x` [B, n, D] and the Gaussian of its final denoising step,
    `mean` and `std` [B, n, D] (temperature included): x = mean + std * that step's noise."""

    x: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


@runtime_checkable
class ContinuousModel(Protocol):
    """Continuous tokens sampled by a diffusion head, a set of positions per step: MAR's masked
    random order, or one position per step for a causal model (next-token diffusion).

    Continuous speculative decoding needs two things of it: the head samples with *given* noise
    (the same table for draft and target: denoising-trajectory alignment) and reports its final
    step's Gaussian; and `head_inputs` works on any canvas, so a target can score every drafted
    step, each on the canvas its draft saw, in one batched forward.

    A model may also say how many masked steps it runs unless a decoder sets them
    (`default_num_steps`, optional: MAR's pipelines pass their saved `num_iter`).
    """

    num_tokens: int
    token_dim: int
    head_steps: int

    def start(self, conditions: torch.Tensor, guidance: bool) -> ContinuousState:
        """An empty canvas for the conditions [B, ...] (nothing known)."""
        ...

    def schedule(self, state: ContinuousState, num_steps: int, generator: torch.Generator) -> list[torch.Tensor]:
        """The positions [B, n_s] each step predicts; every position exactly once."""
        ...

    def head_inputs(self, state: ContinuousState, positions: torch.Tensor) -> Any:
        """One backbone forward over the canvas (unknown positions masked); the head's
        conditioning for `positions` [B, n]."""
        ...

    def sample(self, inputs: Any, noise: torch.Tensor, temperature: float, guidance_scale: torch.Tensor) -> HeadSample:
        """Sample the head with the given noise [B, n, head_steps + 1, D] (the initial noise
        first, then one per denoising step) and per-row guidance scales [B]."""
        ...


@dataclass
class CausalContinuousState:
    """What a cached causal continuous model keeps while decoding: its cache, and the head
    conditioning `first_inputs` of generated token 0 (a tensor or tuple of tensors [B, 1, ...])."""

    cache: Any
    batch_size: int
    guidance: bool
    first_inputs: Any
    device: torch.device
    extra: Any = None

    @property
    def cache_bytes(self) -> int:
        return int(getattr(self.cache, "nbytes", 0))


@runtime_checkable
class CausalContinuousModel(Protocol):
    """Next-token diffusion with a cache (VibeVoice's speech latents, causal MAR): continuous
    tokens [B, n, D] left to right, each sampled by a diffusion head from the backbone's
    conditioning at its position. The `TokenModel` shape (start / forward / commit / rewind)
    over continuous tokens, plus the head's `sample` with given noise (as `ContinuousModel`),
    so speculative decoding verifies k drafted tokens in one cached forward and rolls back by
    not committing, instead of re-running and cloning a canvas."""

    token_dim: int
    head_steps: int

    def start(self, conditions: Any, capacity: int, guidance: bool) -> CausalContinuousState:
        """Prefill the conditions; a cache with `capacity` positions after them."""
        ...

    def forward(self, state: CausalContinuousState, tokens: torch.Tensor) -> Any:
        """Feed tokens [B, n, D] at each row's committed length; returns the head conditioning
        of the n positions after each fed token (tensors [B, n, ...], or a tuple of them, e.g.
        conditional and unconditional halves). Commits nothing."""
        ...

    def commit(self, state: CausalContinuousState, accepted: torch.Tensor) -> None:
        """Keep the first `accepted[b]` tokens of row b from the last forward."""
        ...

    def rewind(self, state: CausalContinuousState, num_generated: torch.Tensor) -> None:
        """Row b keeps its first `num_generated[b]` generated tokens."""
        ...

    def sample(self, inputs: Any, noise: torch.Tensor, temperature: float, guidance_scale: torch.Tensor) -> HeadSample:
        """Sample the head with given noise [B, n, head_steps + 1, D] and guidance [B, n]."""
        ...


def normalised_rows(weight: torch.Tensor) -> torch.Tensor:
    """`weight` with l2-normalised rows (a VQ codebook as the decoder looks it up).

    Outside autograd the result is memoised on the parameter itself (tensors cannot key a
    weak dictionary: their == is element-wise) while its storage and version are unchanged (`mmgen.inference.version`), so a model returns the same tensor on every call and the tables acceptance rules
    derive from it (neighbour lists) are built once. Under autograd it is computed afresh.
    """
    if torch.is_grad_enabled():
        return torch.nn.functional.normalize(weight, p=2, dim=-1)
    state = (weight.data_ptr(), version(weight), weight.dtype, weight.device)
    hit = getattr(weight, "_mmgen_normalised_rows", None)
    if hit is None or hit[0] != state:
        hit = (state, torch.nn.functional.normalize(weight, p=2, dim=-1))
        weight._mmgen_normalised_rows = hit
    return hit[1]


def token_table(model: TokenModel, name: str) -> torch.Tensor:
    """One of the optional per-token tables a model may offer to acceptance rules, detached,
    [vocab_size, D] in the model's dtype: `token_embeddings` (the model's input embedding of each token, used by
    grouped acceptance) or `codebook` (the tokenizer's latent vector of each token, used by
    relaxed acceptance). A clear error names what the model lacks."""
    method = getattr(model, name, None)
    table = method() if callable(method) else None
    if table is None:
        raise ValueError(f"{type(model).__name__} does not provide `{name}()`, which this acceptance rule needs")
    if table.ndim != 2 or table.shape[0] != model.vocab_size:
        raise ValueError(f"{type(model).__name__}.{name}() has shape {tuple(table.shape)}; expected [{model.vocab_size}, D]")
    return table.detach()


class BlockDiffusionModel(Protocol):
    """Semi-autoregressive block diffusion (CausVid, Yin et al. 2024; Self-Forcing, Huang et al.
    2025): a sequence of latent blocks, each denoised from noise by a flow-matching model that
    attends to the committed blocks through a cache, then committed by one clean pass that
    writes the block into the cache. Guidance is the model's business, as for `TokenModel`:
    `velocity` returns the conditional and (when guided) the unconditional prediction."""

    def start(self, conditions: Any, num_blocks: int, guidance: bool) -> Any:
        """Encode the conditions and allocate a cache for `num_blocks` blocks; returns the state."""
        ...

    def block_shape(self, state: Any) -> tuple[int, ...]:
        """Shape of one block's latents (batch first)."""
        ...

    def velocity(self, state: Any, x: torch.Tensor, timestep: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The flow v ≈ noise − x0 of the noisy block `x` at `timestep` (σ × 1000), given the
        committed blocks: (conditional, unconditional or None). Commits nothing."""
        ...

    def commit(self, state: Any, x0: torch.Tensor) -> None:
        """Write the clean block `x0` into the cache (the context of later blocks)."""
        ...

    def condition(self, state: Any, conditions: Any) -> None:
        """Condition the blocks from the next one on `conditions` (a prompt switch)."""
        ...

    def finish(self, state: Any) -> None:
        """Release what `start` installed (called once the decode ends, also on error)."""
        ...
