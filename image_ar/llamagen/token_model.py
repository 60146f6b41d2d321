"""LlamaGen as a `TokenModel`: what the core's decoders need, nothing more."""

from __future__ import annotations

from typing import Optional

import torch

from mmgen.modeling import DecodeState
from mmgen.sampling import Logits

from mmgen.image_ar.llamagen.gpt import LlamaGenTransformer


class LlamaGenTokenModel:
    """Drives a `LlamaGenTransformer` with a per-row static cache.

    With guidance the cache holds 2B rows, conditional then unconditional (the null class for
    class-conditional models, the learned null caption for text-conditional ones), both fed
    the same image tokens, as the official `generate` does.
    """

    def __init__(self, transformer: LlamaGenTransformer, codebook: Optional[torch.Tensor] = None):
        self.transformer = transformer
        self.vocab_size = transformer.config.vocab_size
        self._codebook = codebook

    def token_embeddings(self) -> torch.Tensor:
        """The GPT's input embedding of each image token [V, dim]."""
        return self.transformer.tok_embeddings.weight

    def codebook(self) -> Optional[torch.Tensor]:
        """The VQ codebook vector of each token [V, codebook_embed_dim], if the VQ was given."""
        return self._codebook

    @torch.no_grad()
    def start(self, conditions: torch.Tensor, capacity: int, guidance: bool) -> DecodeState:
        model = self.transformer
        if guidance:
            conditions = torch.cat([conditions, self.null_conditions(conditions)])
        prefix = model.embed_conditions(conditions)
        rows, n = prefix.shape[:2]
        cache = model.setup_cache(rows, n + capacity)
        logits = model.forward_hidden(prefix, cache.positions(n), cache)[:, -1:]
        cache.advance(n)
        batch = rows // 2 if guidance else rows
        return DecodeState(cache, batch, guidance, _split(logits, guidance), extra=n)

    @torch.no_grad()
    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        if state.guidance:
            tokens = torch.cat([tokens, tokens])
        h = self.transformer.tok_embeddings(tokens)
        logits = self.transformer.forward_hidden(h, state.cache.positions(tokens.shape[1]), state.cache)
        return _split(logits, state.guidance)

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        state.cache.advance(torch.cat([accepted, accepted]) if state.guidance else accepted)

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        lengths = num_generated + state.extra  # extra: the condition prefix length
        state.cache.rollback(torch.cat([lengths, lengths]) if state.guidance else lengths)

    def null_conditions(self, conditions: torch.Tensor) -> torch.Tensor:
        embedder = self.transformer.cls_embedding
        if self.transformer.config.model_type == "c2i":
            return torch.full_like(conditions, embedder.num_classes)
        return embedder.uncond_embedding.to(conditions.dtype).expand_as(conditions)


def _split(logits: torch.Tensor, guidance: bool) -> Logits:
    if not guidance:
        return Logits(logits)
    cond, uncond = logits.chunk(2)
    return Logits(cond, uncond)
