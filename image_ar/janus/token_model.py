"""Janus-Pro (arXiv 2501.17811) through transformers, as a `TokenModel` of the core.

The adapter drives `JanusForConditionalGeneration`'s Llama trunk with a transformers
`DynamicCache` and its own 2-D attention mask, so every decoder of the core (autoregressive,
speculative Jacobi with per-row acceptance, ...) runs on Janus without touching transformers.

Cache layout ("holes + crop"): the core's `mmgen.cache.SlotKVCache` over a `DynamicCache`. A
forward appends n slots per row; `commit(accepted)` keeps the first accepted[b] of them for row
b by masking the rest, then crops the slots that no row kept. Attention gives a masked slot
exactly zero weight, and every token carries an explicit position id (its row's logical
position), so a row with holes computes what a contiguous cache would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from mmgen.cache import SlotKVCache, transformers_cache
from mmgen.decoding.window import model_window_cost, model_window_tokens
from mmgen.modeling import DecodeState, normalised_rows
from mmgen.sampling import Logits


@dataclass
class JanusConditions:
    """A tokenized, left-padded prompt batch that already ends with the image-start token.

    This is what `JanusProcessor(text=..., generation_mode="image")` returns; the unconditional
    rows of the CFG batch are derived from it by `JanusTokenModel.start`.
    """

    input_ids: torch.Tensor  # [B, P] int64
    attention_mask: torch.Tensor  # [B, P], 0 on left padding


class JanusTokenModel:
    """`JanusForConditionalGeneration` in image-generation mode as the core's `TokenModel`.

    Conditions are `JanusConditions` (or the processor's dict with `input_ids` and
    `attention_mask`). With guidance the batch holds the conditional rows, then unconditional
    rows built as transformers' `generate(generation_mode="image")` builds them: the same ids
    with every token except BOS and the image-start token replaced by the pad token, and the
    same attention mask. Image tokens enter the LM through `generation_embeddings` and
    `generation_aligner`, and logits come from `generation_head`, all as in transformers.

    Position ids follow transformers' Janus loop too: prompt tokens at their slot index (left
    padding included), generated token t at prompt length + t; greedy outputs match `generate`
    token for token. RoPE only sees differences of positions, so the offset that left padding
    adds changes nothing but rounding.

    `compact_ratio` bounds the holes that rows with uneven acceptance leave (see
    `mmgen.cache.SlotKVCache.compact`); None never compacts.
    """

    def __init__(
        self,
        model,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = None,
        boi_token_id: Optional[int] = None,
        compact_ratio: Optional[float] = 1.0,
    ):
        self.model = model
        self.compact_ratio = compact_ratio
        self.vocab_size = model.config.vq_config.num_embeddings
        gen, text = model.generation_config, model.config.text_config
        self.pad_token_id = _first(pad_token_id, gen.pad_token_id, text.pad_token_id)
        self.bos_token_id = _first(bos_token_id, gen.bos_token_id, text.bos_token_id)
        self.boi_token_id = _first(boi_token_id, config_boi_token_id(gen))
        if self.pad_token_id is None or self.boi_token_id is None:
            raise ValueError(
                "Janus needs the pad and image-start token ids to build its unconditional rows; this model's "
                "generation_config has none: pass pad_token_id= and boi_token_id= (the processor's tokenizer knows them)"
            )
        self._token_embeddings: Optional[torch.Tensor] = None
        self.window_cost = model_window_cost(model)
        self.window_tokens = model_window_tokens(model)

    # ---------------------------------------------------------------- per-token tables
    @torch.no_grad()
    def token_embeddings(self) -> torch.Tensor:
        """What the LM consumes for each image token [V, hidden]: `generation_aligner` applied
        to `generation_embeddings` (the aligner is part of the embedding path in Janus)."""
        if self._token_embeddings is None:
            ids = torch.arange(self.vocab_size, device=self.model.device)
            self._token_embeddings = self.model.prepare_embeddings_for_image_generation(ids)
        return self._token_embeddings

    @torch.no_grad()
    def codebook(self) -> torch.Tensor:
        """The VQ codebook [V, embed_dim], l2-normalised as the VQ decoder looks it up (the same
        tensor while the weight is unchanged, so tables derived from it are built once)."""
        return normalised_rows(self.model.model.vqmodel.quantize.embedding.weight)

    # ---------------------------------------------------------------- TokenModel
    def unconditional_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The CFG "no prompt" rows: every token but BOS and image-start becomes the pad token."""
        keep = (input_ids == self.boi_token_id) | (input_ids == self.bos_token_id)
        return torch.where(keep, input_ids, torch.full_like(input_ids, self.pad_token_id))

    @torch.no_grad()
    def start(self, conditions, capacity: int, guidance: bool) -> DecodeState:
        # `capacity` needs no allocation: the DynamicCache grows on demand, and Llama's RoPE is
        # computed from the position ids, with no table to outgrow.
        from transformers import DynamicCache

        ids, mask = _unpack(conditions)
        ids, mask = ids.to(self.model.device), mask.to(self.model.device).bool()
        if bool((ids[:, -1] != self.boi_token_id).any()):
            raise ValueError(
                f"every prompt must end with the image-start token {self.boi_token_id} (JanusProcessor(..., "
                "generation_mode='image') appends it; pad on the left)"
            )
        batch, length = ids.shape
        if guidance:
            ids, mask = torch.cat([ids, self.unconditional_ids(ids)]), torch.cat([mask, mask])
        rows = ids.shape[0]
        kv = DynamicCache(config=self.model.config.text_config)
        positions = torch.arange(length, device=ids.device).expand(rows, -1)
        embeds = self.model.get_input_embeddings()(ids)
        hidden = self._trunk(embeds, mask, positions, kv)[:, -1:]
        cache = SlotKVCache(kv, mask, prompt_length=length, compact_ratio=self.compact_ratio)
        return DecodeState(cache, batch, guidance, self._logits(hidden, guidance), hidden=hidden)

    @torch.no_grad()
    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        if state.guidance:
            tokens = torch.cat([tokens, tokens])
        mask, positions = state.cache.open(tokens.shape[1])
        embeds = self.model.prepare_embeddings_for_image_generation(tokens)
        state.hidden = self._trunk(embeds, mask, positions, state.cache.kv)
        return self._logits(state.hidden, state.guidance)

    @torch.no_grad()
    def forward_tree(self, state: DecodeState, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor) -> Logits:
        """`TreeModel`: a token tree in one forward, as a 4-D mask to the language model."""
        if state.guidance:
            tokens = torch.cat([tokens, tokens])
        embeds = self.model.prepare_embeddings_for_image_generation(tokens)
        mask, positions = state.cache.open_tree(depth, visible, self.model.config.text_config._attn_implementation, embeds.dtype)
        state.hidden = self._trunk(embeds, mask, positions, state.cache.kv)
        return self._logits(state.hidden, state.guidance)

    def keep_path(self, state: DecodeState, path: torch.Tensor) -> None:
        """`TreeModel`: each row's chosen branch to the first slots of the pending forward."""
        state.cache.keep_path(torch.cat([path, path]) if state.guidance else path)

    @property
    def hidden_size(self) -> int:
        return self.model.config.text_config.hidden_size

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.prepare_embeddings_for_image_generation(tokens)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.generation_head(hidden).float()

    def hidden_logits(self, state: DecodeState, hidden: torch.Tensor, fed: torch.Tensor) -> Logits:
        return self._logits(hidden, state.guidance)

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        state.cache.commit(torch.cat([accepted, accepted]) if state.guidance else accepted)

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        state.cache.rewind(torch.cat([num_generated, num_generated]) if state.guidance else num_generated)

    # ---------------------------------------------------------------- helpers
    def _trunk(self, embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        out = self.model.model.language_model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, **transformers_cache(kv), use_cache=True
        )
        return out.last_hidden_state

    def _logits(self, hidden: torch.Tensor, guidance: bool) -> Logits:
        logits = self.model.model.generation_head(hidden).float()
        if not guidance:
            return Logits(logits)
        cond, uncond = logits.chunk(2)
        return Logits(cond, uncond)

    def decoder_layers(self) -> torch.nn.ModuleList:
        """The language model's blocks, for layer-skip drafting (`mmgen.decoding.layer_skip`)."""
        return self.model.model.language_model.layers


def config_boi_token_id(generation_config) -> Optional[int]:
    """The image-start id where transformers' `generate` reads it (`generation_kwargs`), or the
    `boi_token_id` attribute the conversion script sets."""
    kwargs = getattr(generation_config, "generation_kwargs", None) or {}
    return _first(kwargs.get("boi_token_id"), getattr(generation_config, "boi_token_id", None))


def _first(*values):
    return next((v for v in values if v is not None), None)


def _unpack(conditions) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(conditions, JanusConditions):
        return conditions.input_ids, conditions.attention_mask
    if isinstance(conditions, Mapping) or hasattr(conditions, "keys"):
        ids = conditions["input_ids"]
        mask = conditions.get("attention_mask") if hasattr(conditions, "get") else None
        return ids, torch.ones_like(ids) if mask is None else mask
    if isinstance(conditions, torch.Tensor):
        return conditions, torch.ones_like(conditions)
    raise TypeError(f"Janus conditions must be JanusConditions, a dict with input_ids/attention_mask, or ids; got {type(conditions).__name__}")
