"""A transformers image-text-to-text model (LLaVA and its kin) as a `TokenModel` of the core.

The prefill runs the whole model once, so transformers itself merges the image features into
the prompt; every later forward runs only its language model on token embeddings. The cache is
the core's `SlotKVCache` over a transformers `DynamicCache` (the Janus adapter's layout), so rows
advance by their own accepted counts and speculative decoders can rewind. Positions follow
transformers' `generate`: prompt tokens at `cumsum(attention_mask) - 1`, new tokens right after
their row's own prompt (its slot minus the row's left padding). Models with multimodal rotary
positions (Qwen2-VL / Qwen2.5-VL / Qwen3-VL M-RoPE: a `get_rope_index`) compute an image or
video prompt's 3-D positions themselves in the prefill; each new token then sits at the row's own
prompt length plus its `rope_deltas` on all three axes, as in transformers (the deltas count
from the unpadded prompt; a text-only prompt is the text's positions on all three axes).

Every layer caches every slot (transformers' sliding-window layers cannot rewind past their
window); sliding-window and hybrid local/global language models (Mistral, Gemma 2 / 3, Cohere2)
get their windows as 4-D masks counted in each row's own tokens (`mmgen.vlm.masks`). Logits are
the model's forward's: `lm_head`, its soft-capping where its forward applies one, and its
generation config's processing (`mmgen.vlm.logits`) at the prefill and every decode position.
Greedy output equals `model.generate(do_sample=False)` token for token at any batch size, under
every lossless decoder (tests/vlm/test_families.py, every family). `restart` starts one row
over on a new prompt (continuous batching).

With a `dropping` policy (`mmgen.vlm.dropping`: FastV, VisionZip, MustDrop) the prefill runs
with that policy's hooks; the cache then holds only the kept prompt slots, while decode
positions stay those of the unpruned prompt (a per-row offset, added to `rope_deltas` for
M-RoPE). `last_report` describes the latest prefill and `prefill_done_at` says when it ended.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import torch

from mmgen.cache import SlotKVCache, transformers_cache
from mmgen.decoding.window import model_window_cost, model_window_tokens
from mmgen.hooks import hooks_attached
from mmgen.modeling import DecodeState, place_hidden
from mmgen.sampling import Logits

from mmgen.vlm.dropping import Capture, MustDrop, Prefill, decode_eviction, gather_seq, make_dropping
from mmgen.vlm.layout import TextModelLayout, check_layout, logit_softcap, text_trunk
from mmgen.vlm.logits import GenerationRules
from mmgen.vlm.masks import FULL, attention_layers, takes_mask_dict, window_masks


class VLMTokenModel:
    """`AutoModelForImageTextToText` models with a text trunk (`model.language_model`, or
    `model.text_model` in Idefics3 / SmolVLM) and an `lm_head`: every family of
    `mmgen.vlm.MODEL_TYPES` (the layout `mmgen.vlm.layout.TextModelLayout` states, checked here).
    Conditions are the processor's batch (`input_ids`, `attention_mask` with left padding,
    `pixel_values` and any other image inputs, `pixel_values_videos` and the other video inputs)."""

    def __init__(self, model: TextModelLayout, compact_ratio: Optional[float] = 1.0, dropping: Any = None):
        check_layout(model)  # a model without a part read below is refused in one line, before any decoding
        self.model = model
        self.compact_ratio = compact_ratio
        self.dropping = make_dropping(dropping)
        self.last_report = None  # DroppingReport of the latest prefill (None without dropping)
        self.prefill_done_at = 0.0  # perf_counter() when it ended
        self.vocab_size = model.lm_head.out_features
        self.hidden_size = model.lm_head.in_features
        self.trunk = text_trunk(model)
        self.embed = model.get_input_embeddings()  # looked up once: the lookup walks the wrappers (12 us a forward on CPU)
        self.window_cost = model_window_cost(model)
        self.window_tokens = model_window_tokens(model)
        text_config = model.config.get_text_config()
        self.layers = attention_layers(text_config)
        self.sliding = any(kind != FULL for kind, _ in self.layers)
        self.mask_dict = self.sliding and takes_mask_dict(self.trunk)
        self.softcap = logit_softcap(model)
        self.rules = GenerationRules.of(model)  # its generation config's logits processing

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
        kv = DynamicCache()  # full-attention layers (sliding windows are masks here: `mmgen.vlm.masks`)
        mrope = callable(getattr(self.model.model, "get_rope_index", None))
        # M-RoPE models place image and video tokens in 3-D themselves; without them the prompt's
        # positions are the text's on all three axes (rope_deltas 0), as transformers' generate
        # does, and the model's own cached rope_deltas (from an earlier prompt) must not be read.
        spatial = mrope and any(inputs.get(k) is not None for k in ("image_grid_thw", "video_grid_thw"))
        if not spatial:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            inputs["position_ids"] = positions.unsqueeze(0).expand(3, -1, -1) if mrope else positions
        policy = None if self.dropping is None or self.dropping.identity else self.dropping
        prefill = Prefill(policy, self.model, self.trunk, ids, mask) if policy is not None else None
        last: list = []  # the trunk's final hidden state at the last prompt position (draft heads start there)
        keep_last = self.trunk.register_forward_hook(lambda module, args, out: last.append(out.last_hidden_state[:, -1:]))
        try:
            if prefill is None:
                out = self.model(**inputs, **transformers_cache(kv), use_cache=True, logits_to_keep=1)
            else:
                with prefill.hooks():
                    out = self.model(**inputs, **transformers_cache(kv), use_cache=True, logits_to_keep=1)
        finally:
            keep_last.remove()
        if prefill is None:
            slots, kept_mask = ids.shape[1], mask
        else:
            prefill.finish(kv)
            slots, kept_mask = prefill.valid.shape[1], prefill.valid.long()
        cache = SlotKVCache(kv, kept_mask, prompt_length=slots, compact_ratio=self.compact_ratio)
        # A row's first new token follows its unpruned prompt: at its count of prompt tokens
        # (left padding not counted, as the prefill's positions and transformers' generate), the
        # cache's slots starting at `slots` for every row. M-RoPE's rope_deltas say the same for
        # prompts placed in 3-D (the padded length S plus delta is the row's next position).
        offset = mask.long().sum(1, keepdim=True) - slots
        if spatial:  # rope_deltas count from the row's own (unpadded) prompt length
            offset = offset + self.model.model.rope_deltas.to(mask.device).long()  # [B, 1]
        extra = _Extra(offset, mrope, prefill)
        first = out.logits[:, -1:].float()
        if not self.rules.identity:
            extra.rules = self.rules.start(ids, mask, first.shape[-1])
            first = self.rules.first(first, extra.rules)
        if prefill is not None:
            self.last_report = prefill.report()
            extra.evict = isinstance(policy, MustDrop) and policy.decode_keep < 1
        if mask.device.type == "cuda":
            torch.cuda.synchronize(mask.device)
        self.prefill_done_at = time.perf_counter()
        return DecodeState(cache, ids.shape[0], False, Logits(first), extra=extra, hidden=last[-1] if last else None)

    @torch.no_grad()
    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        extra: _Extra = state.extra
        mask, positions = state.cache.open(tokens.shape[1])
        positions = positions + extra.offset
        if extra.mrope:  # M-RoPE: text tokens advance on all three axes together
            positions = positions.unsqueeze(0).expand(3, -1, -1)
        embeds = self.embed(tokens)
        attention = mask
        if self.sliding:
            attention = window_masks(mask, tokens.shape[1], self.layers, self.model.config.get_text_config()._attn_implementation,
                                     embeds.dtype, self.mask_dict)
        elif (tokens.shape[1] == 1 or mask.device.type == "cpu") and bool(mask.all()):
            # No masked slot: no mask, and transformers builds the causal mask from the cache.
            # Given the mask, it reaches the same masks after checks per forward (it reads the
            # mask to the host, as here, and asks CUDA whether a graph is capturing: 0.1-0.2 ms on
            # a CPU, 5% of a small model's step). On an accelerator that read is a sync it makes
            # only for one-token queries, so the check stays off wider windows there.
            attention = None
        run = lambda: self.trunk(
            inputs_embeds=embeds, attention_mask=attention, position_ids=positions, **transformers_cache(state.cache.kv), use_cache=True
        ).last_hidden_state
        if not extra.evict:
            hidden = run()
        else:  # MustDrop's output-aware eviction, once, from the newest committed token (query 0)
            store: dict = {}
            with hooks_attached({self.trunk.layers[self.dropping.layer].self_attn: Capture(store, "decode")}, "mmgen_dropping"):
                hidden = run()
            cache = state.cache
            sees = cache.mask & (torch.arange(cache.length, device=mask.device) <= cache.length - cache.pending)
            visual = extra.prefill.valid & gather_seq(extra.prefill.image, extra.prefill.index, 1)
            drop = decode_eviction(self.dropping, self.trunk, store, cache.kv, sees, visual)
            cache.evict(drop)
            self.last_report.evicted_tokens = drop.sum(1).tolist()
            extra.evict = False
        state.hidden = hidden
        logits = self.hidden_logits(state, hidden, tokens)
        if extra.rules is not None:
            extra.rules.pending = tokens
        return logits

    @torch.no_grad()
    def forward_tree(self, state: DecodeState, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor) -> Logits:
        """`TreeModel`: a token tree in one forward, handed to the trunk as a 4-D mask (full-attention
        language models under sdpa or eager attention, without logits processing or decode-time
        eviction)."""
        refusal = self.tree_refusal()
        if refusal is not None:
            raise ValueError(refusal)
        extra: _Extra = state.extra
        embeds = self.embed(tokens)
        attention, positions = state.cache.open_tree(depth, visible, self.model.config.get_text_config()._attn_implementation,
                                                     embeds.dtype)
        positions = positions + extra.offset
        if extra.mrope:
            positions = positions.unsqueeze(0).expand(3, -1, -1)
        hidden = self.trunk(inputs_embeds=embeds, attention_mask=attention, position_ids=positions,
                            **transformers_cache(state.cache.kv), use_cache=True).last_hidden_state
        state.hidden = hidden
        return Logits(self.head(hidden))

    def keep_path(self, state: DecodeState, path: torch.Tensor) -> None:
        """`TreeModel`: each row's chosen branch to the first slots of the pending forward."""
        state.cache.keep_path(path)

    def tree_refusal(self) -> Optional[str]:
        """Why this model cannot verify token trees (one line; the loop asks before any work), or
        None: trees need full attention under sdpa or eager, no logits processing (it reads each
        row's tokens in order) and no decode-time eviction."""
        implementation = self.model.config.get_text_config()._attn_implementation
        why = ("sliding-window layers" if self.sliding else
               "its generation config's logits processing" if not self.rules.identity else
               "MustDrop's decode-time eviction" if isinstance(self.dropping, MustDrop) and self.dropping.decode_keep < 1 else
               f"{implementation} attention (load it with attn_implementation='sdpa')"
               if implementation not in ("sdpa", "eager") else None)
        return None if why is None else f"{type(self.model).__name__} cannot verify a token tree: it has {why}"

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def hidden_logits(self, state: DecodeState, hidden: torch.Tensor, fed: torch.Tensor) -> Logits:
        logits = self.head(hidden)
        rules = state.extra.rules
        return Logits(logits if rules is None else self.rules.step(logits, rules, fed))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the trunk's hidden states, as the model's own forward makes them
        (its `lm_head`, then its final logit soft-capping where it has one: PaliGemma 2)."""
        logits = self.model.lm_head(hidden).float()
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def restart(self, state: DecodeState, row: int, conditions: Mapping[str, torch.Tensor]) -> Logits:
        """Continuous batching: row `row` of a live decode starts over on one row's processor
        inputs. The prompt is prefilled alone (`start`) and its cache placed in the row
        (`SlotKVCache.restart_row`), with the row's decode positions those of the prompt alone;
        returns the logits predicting its token 0."""
        if self.dropping is not None and not self.dropping.identity:
            raise ValueError("continuous batching does not run visual token dropping (each row's prefill would prune "
                             "its own prompt); decode such requests in static batches")
        fresh = self.start(conditions, 0, False)
        if fresh.batch_size != 1:
            raise ValueError(f"restart takes one row's inputs, got {fresh.batch_size} rows")
        extra, solo = state.extra, fresh.extra
        grow = state.cache.restart_row(row, fresh.cache)
        extra.offset -= grow
        # Alone, the row's next position is fresh's prompt length plus its offset; here its slots
        # count from the live prompt region's length.
        extra.offset[row] = solo.offset[0] + fresh.cache.prompt_length - state.cache.prompt_length
        if extra.rules is not None:
            extra.rules.restart(row, solo.rules)
        place_hidden(state, [row], fresh.hidden)
        return fresh.first_logits

    def select_rows(self, state: DecodeState, index: torch.Tensor) -> None:
        """Continuous batching whose width follows its requests: keep rows `index` [B'] (into the
        current rows, in that order; a repeated one restarts before it decodes)."""
        extra: _Extra = state.extra
        state.cache.select_rows(index)
        extra.offset = extra.offset[index]
        if extra.rules is not None:
            extra.rules.select_rows(index)
        state.batch_size = len(index)

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        state.cache.commit(accepted)
        if state.extra.rules is not None:
            state.extra.rules.commit(accepted)

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        state.cache.rewind(num_generated)
        if state.extra.rules is not None:
            state.extra.rules.rewind(num_generated)

    def decoder_layers(self) -> torch.nn.ModuleList:
        """The text trunk's blocks, for layer-skip drafting (`mmgen.decoding.layer_skip`).
        MustDrop's decode-stage eviction reads the first decode forward, which would be a draft
        forward with blocks skipped: refused."""
        if isinstance(self.dropping, MustDrop) and self.dropping.decode_keep < 1:
            raise ValueError("layer-skip drafting cannot run MustDrop's decode-stage eviction (decode_keep < 1): "
                             "its first decode forward would be a draft's; set decode_keep=1 or use another decoding")
        return self.trunk.layers


class _Extra:
    """Per-decode position bookkeeping: `offset` [B, 1] added to each slot position (unpruned
    prompt length minus kept slots, plus M-RoPE's `rope_deltas`), and MustDrop's pending
    decode-stage eviction."""

    def __init__(self, offset: torch.Tensor, mrope: bool, prefill: Any):
        self.offset, self.mrope, self.prefill, self.evict = offset, mrope, prefill, False
        self.rules = None  # the generation config's per-row history (`mmgen.vlm.logits.RuleState`)
