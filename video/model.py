"""diffusers' Wan transformer as the core's `BlockDiffusionModel`.

The transformer stays diffusers' own module: a decode swaps in the processors of
`video.attention` (cached block-causal self-attention, cached prompt cross-attention) and, for
cached denoising, diffusers' First Block Cache hooks (ParaAttention's FBCache, after TeaCache:
when the first block's residual barely changes between denoising steps, the other blocks'
residual is reused). Both come off again when the decode ends (`WanBlockModel.attached`).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from mmgen.cache import CachePolicy, FrameKVCache
from mmgen.hooks import hooks_attached
from mmgen.video.attention import (
    BlockContext,
    CachedCrossAttention,
    CachedSelfAttention,
    ContextSlot,
    MaskedSelfAttention,
    block_causal_mask,
    processors_installed,
    rotary_tables,
)
from mmgen.video.dropping import HOOK_NAME as DROPPING_HOOK
from mmgen.video.dropping import DroppingState, StaticTokenHook


def check_rotary_table(config: Any, positions: int, max_frames: int, policy: str, fix: str) -> None:
    """ValueError (before any block runs) when a decode needs more latent-frame positions than
    the model's rotary table has."""
    if positions > config.rope_max_seq_len:
        raise ValueError(f"{max_frames} latent frames overflow the model's rotary table ({config.rope_max_seq_len} "
                         f"frames) under the cache policy {policy}: {fix}")


@dataclass
class PromptEmbeddings:
    """A batch's text-encoder states [B, L, D] and, for guidance, the negative prompt's."""

    cond: torch.Tensor
    uncond: Optional[torch.Tensor] = None


@dataclass
class WanBlockState:
    context: BlockContext
    embeddings: torch.Tensor  # [B (+ B uncond), L, D]
    guided: bool
    batch_size: int
    started: bool = False  # whether the current block had a denoising forward
    hooks: ExitStack = field(default_factory=ExitStack)  # the processors and hooks `start` installed

    @property
    def nbytes(self) -> int:
        return self.context.cache.nbytes

    @property
    def computed_fraction(self) -> Optional[float]:
        """Token-layers computed over all of them, with token dropping (None without)."""
        return None if self.context.dropping is None else self.context.dropping.computed_fraction


class WanBlockModel:
    """Block-causal decoding of a `WanTransformer3DModel` over latent blocks [B, C, f, h, w].

    `policy` is the cache's (global, window, sink + window, in latent frames); `max_frames`
    sizes the cache (the whole video under the global policy). `cache_threshold` turns on
    First Block Cache for the denoising forwards (never for the clean pass that writes the
    cache); 0 computes every block, so the output equals no caching. `drop_threshold` turns on
    static-token dropping (`video.dropping`) for the same forwards, 0 likewise.
    """

    def __init__(self, transformer: Any, block_frames: int, latent_size: tuple[int, int],
                 policy: CachePolicy = CachePolicy(), cache_threshold: Optional[float] = None,
                 drop_threshold: Optional[float] = None):
        self.transformer, self.block_frames, self.latent_size = transformer, block_frames, latent_size
        self.policy, self.cache_threshold, self.drop_threshold = policy, cache_threshold, drop_threshold
        config = transformer.config
        p_t, p_h, p_w = config.patch_size
        h, w = latent_size
        if p_t != 1:
            raise ValueError(f"block diffusion caches whole latent frames: the model's temporal patch is {p_t}, not 1")
        if h % p_h or w % p_w:
            raise ValueError(f"latent size {h}×{w} does not divide into the model's patches {tuple(config.patch_size)}")
        if cache_threshold is not None and config.num_layers < 2:
            raise ValueError("First Block Cache needs a transformer of two blocks or more (it reuses the later blocks' residual)")
        self.tokens_per_frame = (h // p_h) * (w // p_w)  # per latent frame
        self.slot = ContextSlot()
        self._rotary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ BlockDiffusionModel
    def start(self, conditions: PromptEmbeddings, num_blocks: int, guidance: bool) -> WanBlockState:
        config = self.transformer.config
        max_frames = num_blocks * self.block_frames
        fix = "use a window policy for longer rollouts" if self.policy.window is None else "use a smaller window"
        check_rotary_table(config, self.policy.held(max_frames) + self.block_frames, max_frames, str(self.policy), fix)
        if guidance and conditions.uncond is None:
            raise ValueError("guidance needs the negative prompt's embeddings")
        batch = conditions.cond.shape[0]
        rows = 2 * batch if guidance else batch
        param = self.transformer.patch_embedding.weight  # the compute dtype (diffusers keeps some modules in float32)
        cache = FrameKVCache(config.num_layers, rows, config.num_attention_heads, config.attention_head_dim,
                             self.tokens_per_frame, max_frames, self.block_frames, self.policy,
                             dtype=param.dtype, device=param.device)
        embeddings = torch.cat([conditions.cond, conditions.uncond]) if guidance else conditions.cond
        dropping = None if self.drop_threshold is None else DroppingState(float(self.drop_threshold))
        state = WanBlockState(BlockContext(cache, dropping=dropping), embeddings.to(param.dtype), guidance, batch)
        state.hooks.enter_context(self.attached(dropping))
        return state

    def finish(self, state: WanBlockState) -> None:
        state.hooks.close()

    def block_shape(self, state: WanBlockState) -> tuple[int, ...]:
        return (state.batch_size, self.transformer.config.in_channels, self.block_frames, *self.latent_size)

    def velocity(self, state: WanBlockState, x: torch.Tensor, timestep: float):
        out = self._forward(state, x, timestep, "denoise", fresh=not state.started)
        state.started = True
        return (out[:state.batch_size], out[state.batch_size:]) if state.guided else (out, None)

    def commit(self, state: WanBlockState, x0: torch.Tensor) -> None:
        self._forward(state, x0, 0.0, "commit", fresh=True)
        state.context.cache.commit(self.block_frames)
        state.started = False

    def condition(self, state: WanBlockState, conditions: PromptEmbeddings) -> None:
        if state.guided and conditions.uncond is None:
            raise ValueError("guidance needs the negative prompt's embeddings")
        embeddings = torch.cat([conditions.cond, conditions.uncond]) if state.guided else conditions.cond
        state.embeddings = embeddings.to(state.embeddings.dtype)
        state.context.prompt_version += 1  # every layer recomputes its prompt keys and values

    # ------------------------------------------------------------------ internals
    def _forward(self, state: WanBlockState, x: torch.Tensor, timestep: float, name: str, fresh: bool) -> torch.Tensor:
        ctx, transformer = state.context, self.transformer
        self.slot.context = ctx
        if ctx.dropping is not None:  # a block's first step and the clean pass compute every token
            ctx.dropping.enabled, ctx.dropping.record = name == "denoise" and not fresh, name == "denoise"
        frames = ctx.cache.frames + self.block_frames
        if frames not in self._rotary:  # a handful of sizes per decode (the held frames stop growing under a window)
            self._rotary[frames] = rotary_tables(transformer, frames, *self.latent_size)
        ctx.rotary = self._rotary[frames]
        if state.guided:
            x = torch.cat([x, x])
        t = torch.full((x.shape[0],), timestep, device=x.device, dtype=torch.float32)
        with ExitStack() as stack:
            if self.cache_threshold is not None:
                if fresh:  # a new block (or the clean pass): nothing of the last block's FBCache state is reused
                    transformer._reset_stateful_cache()
                stack.enter_context(transformer.cache_context(name))
            out = transformer(x.to(ctx.cache.k.dtype), t, encoder_hidden_states=state.embeddings, return_dict=False)[0]
        return out.to(x.dtype)

    @contextmanager
    def attached(self, dropping: Optional[DroppingState] = None) -> Iterator[None]:
        """The cached processors (and FBCache or token-dropping hooks when their thresholds are
        set) for the duration of the block: one decode, from `start` to `finish`."""
        from diffusers.hooks import FirstBlockCacheConfig

        transformer = self.transformer
        hooks = {} if dropping is None else {block: StaticTokenHook(dropping) for block in transformer.blocks}
        with processors_installed(transformer, lambda i: CachedSelfAttention(i, self.slot),
                                  lambda i: CachedCrossAttention(i, self.slot)), hooks_attached(hooks, DROPPING_HOOK):
            if self.cache_threshold is None:
                yield
                return
            transformer.enable_cache(FirstBlockCacheConfig(threshold=float(self.cache_threshold)))
            try:
                yield
            finally:
                transformer.disable_cache()


@dataclass
class RecomputingState:
    embeddings: torch.Tensor
    guided: bool
    batch_size: int
    context: list[torch.Tensor] = field(default_factory=list)  # committed clean blocks
    hooks: ExitStack = field(default_factory=ExitStack)


class RecomputingWanModel:
    """The same block-causal model without a cache, as naive implementations run it: every
    forward feeds all committed clean frames (timestep 0) before the noisy block, under a
    block-causal mask, recomputing the context each time. Equal to `WanBlockModel` under the
    global policy (float64 test); the benchmarks' no-cache baseline."""

    def __init__(self, transformer: Any, block_frames: int, latent_size: tuple[int, int]):
        self.transformer, self.block_frames, self.latent_size = transformer, block_frames, latent_size
        p_t, p_h, p_w = transformer.config.patch_size
        self.tokens_per_frame = (latent_size[0] // p_h) * (latent_size[1] // p_w)
        self.mask = None

    def start(self, conditions: PromptEmbeddings, num_blocks: int, guidance: bool) -> RecomputingState:
        max_frames = num_blocks * self.block_frames  # the last block's forward feeds the whole video
        check_rotary_table(self.transformer.config, max_frames, max_frames, "none",
                           "make a shorter video, or use a window policy for longer rollouts")
        embeddings = torch.cat([conditions.cond, conditions.uncond]) if guidance else conditions.cond
        state = RecomputingState(embeddings.to(self.transformer.patch_embedding.weight.dtype), guidance, conditions.cond.shape[0])
        state.hooks.enter_context(processors_installed(self.transformer, lambda i: MaskedSelfAttention(self)))
        return state

    def finish(self, state: RecomputingState) -> None:
        state.hooks.close()

    def block_shape(self, state: RecomputingState) -> tuple[int, ...]:
        return (state.batch_size, self.transformer.config.in_channels, self.block_frames, *self.latent_size)

    def velocity(self, state: RecomputingState, x: torch.Tensor, timestep: float):
        out = self._forward(state, x, timestep)
        return (out[:state.batch_size], out[state.batch_size:]) if state.guided else (out, None)

    def commit(self, state: RecomputingState, x0: torch.Tensor) -> None:
        state.context.append(x0)

    def condition(self, state: RecomputingState, conditions: PromptEmbeddings) -> None:
        embeddings = torch.cat([conditions.cond, conditions.uncond]) if state.guided else conditions.cond
        state.embeddings = embeddings.to(state.embeddings.dtype)

    def _forward(self, state: RecomputingState, x: torch.Tensor, timestep: float) -> torch.Tensor:
        dtype = state.embeddings.dtype
        seq = torch.cat([*state.context, x], dim=2).to(dtype)
        if state.guided:
            seq = torch.cat([seq, seq])
        frames, tokens = seq.shape[2], self.tokens_per_frame
        clean = (frames - self.block_frames) * tokens
        t = torch.cat([torch.zeros(seq.shape[0], clean), torch.full((seq.shape[0], self.block_frames * tokens), timestep)], 1)
        self.mask = block_causal_mask(frames, self.block_frames, tokens, device=seq.device)
        out = self.transformer(seq, t.to(seq.device), encoder_hidden_states=state.embeddings, return_dict=False)[0]
        return out[:, :, -self.block_frames:].to(x.dtype)
