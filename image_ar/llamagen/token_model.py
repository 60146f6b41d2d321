"""LlamaGen as a `TokenModel`: what the core's decoders need, nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from mmgen.compile import CachePool, compile_forward
from mmgen.cache import tree_attention_mask
from mmgen.modeling import DecodeState, place_hidden
from mmgen.sampling import Logits

from mmgen.image_ar.llamagen.gpt import LlamaGenTransformer


@dataclass
class CaptionConditions:
    """What a text-conditional LlamaGen is conditioned on: left-padded caption features.

    `embeddings` [B, T, caption_dim] hold each caption's valid rows at the end and zeros
    before them; `mask` [B, T] (bool) is True at the valid rows. This is the layout of the
    official `sample_t2i.py`, and the mask hides the padding keys from every query, in both
    halves of a CFG batch, as the official `generate` does.
    """

    embeddings: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self):
        if self.embeddings.ndim != 3 or self.mask.shape != self.embeddings.shape[:2]:
            raise ValueError(
                f"caption embeddings must be [B, T, C] with a [B, T] mask; got {tuple(self.embeddings.shape)} "
                f"and {tuple(self.mask.shape)}"
            )
        self.mask = self.mask.bool()

    @classmethod
    def left_padded(cls, embeddings: torch.Tensor, mask: torch.Tensor) -> "CaptionConditions":
        """From a text encoder's output and its attention mask (padding anywhere, usually on the
        right): move each row's valid features to the end, in order, and zero the rest."""
        mask = mask.bool()
        # A stable sort of the mask puts padding (False) first and keeps the valid rows' order.
        order = torch.sort(mask.to(torch.uint8), dim=1, stable=True).indices
        mask = mask.gather(1, order)
        embeddings = embeddings.gather(1, order[..., None].expand_as(embeddings))
        return cls(embeddings * mask[..., None].to(embeddings.dtype), mask)


class LlamaGenTokenModel:
    """Drives a `LlamaGenTransformer` with a per-row static cache.

    With guidance the cache holds 2B rows, conditional then unconditional (the null class for
    class-conditional models, the learned null caption for text-conditional ones), both fed
    the same image tokens, as the official `generate` does. Conditions are class ids [B], or
    for t2i models `CaptionConditions` (or bare caption features [B, T, C], all rows valid).

    `official_attention`: run the attention of the decoding forwards (everything after the
    condition prefix) on SDPA's math backend, as the official `generate` does (its decode loop
    enables only the math kernel; its prefill keeps the default). The backends agree closely in
    float32 but round differently in bfloat16/float16, where greedy outputs then drift apart
    from the official ones. None (the default) turns it on for bfloat16/float16 weights and
    leaves float32 on the default backend.

    `compile`: run `forward` (the decode and verify steps) under `torch.compile`, one graph per
    window width, captured in CUDA graphs on CUDA (`mmgen.compile`); `start` stays eager. Its
    caches are then pooled: a decode reuses the previous one's cache of the same size once that
    decode's state is gone, so the captured graphs keep their addresses. Compiled code rounds
    differently from eager (float32 logits agree to ~1e-6), so sampled tokens can differ where
    two tokens are all but tied.
    """

    def __init__(
        self,
        transformer: LlamaGenTransformer,
        codebook: Optional[torch.Tensor] = None,
        official_attention: Optional[bool] = None,
        compile: bool = False,
    ):
        self.transformer = transformer
        self.vocab_size = transformer.config.vocab_size
        self.hidden_size = transformer.config.dim
        self.row_length = transformer.config.grid_size  # raster order: tokens per image row
        self._codebook = codebook
        if official_attention is None:
            official_attention = transformer.tok_embeddings.weight.dtype in (torch.bfloat16, torch.float16)
        elif not isinstance(official_attention, bool):
            raise ValueError(f"official_attention must be True, False or None (by dtype), got {official_attention!r}")
        #: The SDPA backend of `forward` (the decoding forwards); `start` (the prefix) keeps the default.
        self.decode_attention = "math" if official_attention else "default"
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        self.compiled = compile
        self._caches = CachePool() if compile else None
        if compile:
            compile_forward(self, transformer.tok_embeddings.weight.device)
            self.select_rows = None  # captured graphs and pooled caches keep their batch: fixed-width batches

    def token_embeddings(self) -> torch.Tensor:
        """The GPT's input embedding of each image token [V, dim]."""
        return self.transformer.tok_embeddings.weight

    def codebook(self) -> Optional[torch.Tensor]:
        """The VQ codebook vector of each token [V, codebook_embed_dim], if the VQ was given."""
        return self._codebook

    @torch.no_grad()
    def start(self, conditions: Union[torch.Tensor, CaptionConditions], capacity: int, guidance: bool) -> DecodeState:
        key = None

        def cache_for(rows: int, length: int):
            nonlocal key
            weight = self.transformer.tok_embeddings.weight
            key = (rows, length, weight.dtype, weight.device)
            make = lambda: self.transformer.setup_cache(rows, length)
            return make() if self._caches is None else self._caches.take(key, make)

        cache, logits, n, hidden = self._prefill(conditions, guidance, capacity, cache_for)
        state = DecodeState(cache, cache.batch_size // 2 if guidance else cache.batch_size, guidance, logits, extra=n,
                            hidden=hidden)
        if self._caches is not None:
            self._caches.lend(key, cache, state)
        return state

    @torch.no_grad()
    def restart(self, state: DecodeState, row: int, conditions: Union[torch.Tensor, CaptionConditions]) -> Logits:
        """Continuous batching: row `row` of a live decode starts over on `conditions` (one
        row's). The prefix is prefilled alone, into a fresh cache of the live one's size, and
        copied over the row whole (with its unconditional twin), so the row then holds what a
        batch-1 `start` would: the logits it returns predict the row's token 0."""
        live = state.cache
        cache, logits, n, hidden = self._prefill(conditions, state.guidance, live.max_length - state.extra,
                                                 self.transformer.setup_cache)
        if cache.batch_size != (2 if state.guidance else 1) or n != state.extra:
            raise ValueError(f"restart takes one row's conditions with a {state.extra}-token prefix")
        rows = [row, row + state.batch_size] if state.guidance else [row]
        live.k[:, rows], live.v[:, rows] = cache.k, cache.v
        live.lengths[rows], live.key_padding[rows] = cache.lengths, cache.key_padding
        place_hidden(state, rows, hidden)
        return logits

    def select_rows(self, state: DecodeState, index: torch.Tensor) -> None:
        """Continuous batching whose width follows its requests: keep rows `index` [B'] (into the
        current rows, in that order; a repeated one restarts before it decodes)."""
        state.cache.select_rows(torch.cat([index, index + state.batch_size]) if state.guidance else index)
        state.batch_size = len(index)

    def _prefill(self, conditions, guidance: bool, capacity: int, cache_for) -> tuple[Any, Logits, int, torch.Tensor]:
        """(cache, logits predicting token 0, prefix length n, the final hidden state predicting
        token 0 [rows, 1, dim]): the condition prefix (and with `guidance` the unconditional
        one) fed into `cache_for(rows, n + capacity)`."""
        model = self.transformer
        conditions, mask = self._check_conditions(conditions)
        if guidance:
            conditions = torch.cat([conditions, self.null_conditions(conditions)])
            # Officially the null caption is masked with its prompt's mask (cat([m, m])).
            mask = None if mask is None else torch.cat([mask, mask])
        prefix = model.embed_conditions(conditions)
        rows, n = prefix.shape[:2]
        cache = cache_for(rows, n + capacity)
        if mask is not None:
            cache.key_padding[:, :n] = ~mask[:, :n]
        hidden = model.final_hidden(prefix, cache.positions(n), cache)
        logits = model.output(hidden).float()[:, -1:]
        cache.advance(n)
        return cache, _split(logits, guidance), n, hidden[:, -1:]

    @torch.no_grad()
    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        if state.guidance:
            tokens = torch.cat([tokens, tokens])
        h = self.transformer.tok_embeddings(tokens)
        positions = state.cache.positions(tokens.shape[1])
        hidden = self.transformer.final_hidden(h, positions, state.cache, attention_backend=self.decode_attention)
        if not self.compiled:  # a captured graph's outputs are overwritten by its next replay
            state.hidden = hidden
        return _split(self.transformer.output(hidden).float(), state.guidance)

    @torch.no_grad()
    def forward_tree(self, state: DecodeState, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor) -> Logits:
        """`TreeModel`: a token tree in one forward (slots after each row's committed ones)."""
        if state.guidance:
            tokens = torch.cat([tokens, tokens])
        cache = state.cache
        slots = cache.positions(tokens.shape[1])
        committed = (cache._arange[None, :] < cache.lengths[:, None]) & ~cache.key_padding
        mask = tree_attention_mask(visible, committed, cache.lengths)
        hidden = self.transformer.final_hidden(self.transformer.tok_embeddings(tokens), slots, cache, self.decode_attention,
                                               rope_positions=cache.lengths[:, None] + depth, mask=mask)
        state.hidden = hidden
        return _split(self.transformer.output(hidden).float(), state.guidance)

    def keep_path(self, state: DecodeState, path: torch.Tensor) -> None:
        """`TreeModel`: each row's chosen branch to the slots after its committed tokens."""
        cache = state.cache
        path = torch.cat([path, path]) if state.guidance else path
        cache.move(cache.lengths[:, None] + path, cache.positions(path.shape[1]))

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.transformer.tok_embeddings(tokens)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.transformer.output(hidden).float()

    def hidden_logits(self, state: DecodeState, hidden: torch.Tensor, fed: torch.Tensor) -> Logits:
        return _split(self.output_logits(hidden), state.guidance)

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        state.cache.advance(torch.cat([accepted, accepted]) if state.guidance else accepted)

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        lengths = num_generated + state.extra  # extra: the condition prefix length
        state.cache.rollback(torch.cat([lengths, lengths]) if state.guidance else lengths)

    def _check_conditions(self, conditions) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(class ids or caption features in the model's dtype, caption mask or None)."""
        config = self.transformer.config
        if config.model_type == "c2i":
            if isinstance(conditions, CaptionConditions):
                raise ValueError("this LlamaGen is class-conditional: it takes class ids [B], not captions")
            return conditions, None
        mask = None
        if isinstance(conditions, CaptionConditions):
            conditions, mask = conditions.embeddings, conditions.mask
        rows = self.transformer.cls_embedding.uncond_embedding.shape[0]
        if not isinstance(conditions, torch.Tensor) or conditions.shape[1:] != (rows, config.caption_dim):
            shape = tuple(conditions.shape) if isinstance(conditions, torch.Tensor) else type(conditions).__name__
            raise ValueError(f"a text-conditional LlamaGen takes caption features [B, {rows}, {config.caption_dim}], got {shape}")
        return conditions.to(self.transformer.tok_embeddings.weight.dtype), mask

    def null_conditions(self, conditions: torch.Tensor) -> torch.Tensor:
        embedder = self.transformer.cls_embedding
        if self.transformer.config.model_type == "c2i":
            return torch.full_like(conditions, embedder.num_classes)
        return embedder.uncond_embedding.to(conditions.dtype).expand_as(conditions)

    def decoder_layers(self) -> torch.nn.ModuleList:
        """The GPT's blocks, for layer-skip drafting (`mmgen.decoding.layer_skip`): its static
        cache is slot = position, so a skipped block's stale draft slots are overwritten by the
        verify forward."""
        return self.transformer.layers


def _split(logits: torch.Tensor, guidance: bool) -> Logits:
    if not guidance:
        return Logits(logits)
    cond, uncond = logits.chunk(2)
    return Logits(cond, uncond)
