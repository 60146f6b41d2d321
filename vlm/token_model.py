"""A transformers image-text-to-text model (LLaVA and its kin) as a `TokenModel` of the core.

The prefill runs the whole model once, so transformers itself merges the image features into
the prompt; every later forward runs only its language model on token embeddings. The cache is
the core's `SlotKVCache` over a transformers `DynamicCache` (the Janus adapter's layout), so rows
advance by their own accepted counts and speculative decoders can rewind. Positions follow
transformers' `generate`: prompt tokens at `cumsum(attention_mask) - 1`, new tokens at their
slot. Models with multimodal rotary positions (Qwen2-VL / Qwen2.5-VL M-RoPE: a
`get_rope_index`) compute the prompt's 3-D positions themselves in the prefill; each new token
then sits at its slot plus the row's `rope_deltas` on all three axes, as in transformers. Greedy
output equals `model.generate(do_sample=False)` token for token (tested for both kinds).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from mmgen.cache import SlotKVCache
from mmgen.modeling import DecodeState
from mmgen.sampling import Logits


class VLMTokenModel:
    """`AutoModelForImageTextToText` models with a text trunk (`model.language_model`, or
    `model.text_model` in Idefics3 / SmolVLM) and an `lm_head`: LLaVA, Qwen2-VL / Qwen2.5-VL,
    Idefics3. Conditions are the processor's batch (`input_ids`, `attention_mask` with left
    padding, `pixel_values` and any other image inputs)."""

    def __init__(self, model: Any, compact_ratio: Optional[float] = 1.0):
        self.model = model
        self.compact_ratio = compact_ratio
        self.vocab_size = model.lm_head.out_features
        inner = model.model
        self.trunk = inner.language_model if hasattr(inner, "language_model") else inner.text_model

    def token_embeddings(self) -> torch.Tensor:
        """The language model's input embedding of each token [V, hidden] (grouped acceptance)."""
        return self.model.get_input_embeddings().weight[: self.vocab_size]

    @torch.no_grad()
    def start(self, conditions: Mapping[str, torch.Tensor], capacity: int, guidance: bool) -> DecodeState:
        # `capacity` needs no allocation: the DynamicCache grows, RoPE follows the position ids.
        from transformers import DynamicCache

        if guidance:
            raise ValueError("vision-language decoding takes no classifier-free guidance (guidance scale 1)")
        inputs = {k: v.to(self.model.device) if torch.is_tensor(v) else v for k, v in conditions.items()}
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        kv = DynamicCache(config=self.model.config.get_text_config())
        mrope = callable(getattr(self.model.model, "get_rope_index", None))
        if not mrope:
            inputs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(**inputs, past_key_values=kv, use_cache=True, logits_to_keep=1)
        cache = SlotKVCache(kv, mask, prompt_length=ids.shape[1], compact_ratio=self.compact_ratio)
        deltas = self.model.model.rope_deltas if mrope else None  # [B, 1]: 3-D position minus slot
        return DecodeState(cache, ids.shape[0], False, Logits(out.logits[:, -1:].float()), extra=deltas)

    @torch.no_grad()
    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        mask, positions = state.cache.open(tokens.shape[1])
        if state.extra is not None:  # M-RoPE: text tokens advance on all three axes together
            positions = (positions + state.extra).unsqueeze(0).expand(3, -1, -1)
        embeds = self.model.get_input_embeddings()(tokens)
        hidden = self.trunk(
            inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=state.cache.kv, use_cache=True
        ).last_hidden_state
        return Logits(self.model.lm_head(hidden).float())

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        state.cache.commit(accepted)

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        state.cache.rewind(num_generated)
