"""transformers' Dia as a frame `TokenModel` of the core: one decoder position per frame of C
codebooks, in Dia's delayed layout.

Dia (nari-labs) predicts all C DAC codebooks of a frame at once from parallel heads, with
codebook c delayed by `delay_pattern[c]` frames, so the core's frame rules apply unchanged
(codebooks are independent given the prefix). Everything Dia's `generate` does to the logits
is done here, as a function of the frame history, so that a window of drafted frames is
scored exactly as `generate` would score each of them one at a time:

- classifier-free guidance as Dia's own *filter*: `cfg = cond + s * (cond - uncond)` selects
  the top-k candidates and the token is drawn from the conditional logits among them
  (`DiaClassifierFreeGuidanceLogitsProcessor`); the unconditional rows read zeroed text;
- only codebook 0 may end the audio, and only when EOS is its most likely token
  (`DiaEOSChannelFilterLogitsProcessor`);
- codebook c is forced to EOS `delay[c]` frames after codebook 0's EOS, or after the frame
  budget forces codebook 0 to end (`DiaEOSDelayPatternLogitsProcessor`); a codebook that has
  ended emits PAD; codebook c is BOS (or the voice prompt's code) for its first `delay[c]`
  frames (the processor's delay mask).

Forced tokens are one-hot distributions, so speculative decoding over them stays exact.
Greedy output equals `DiaForConditionalGeneration.generate(do_sample=False)` frame for frame
(tests/audio/test_dia.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from mmgen.audio.phonemes import spell_text
from mmgen.batch_invariant import rowwise
from mmgen.cache import SlotKVCache, transformers_cache
from mmgen.decoding import Stopping
from mmgen.decoding.window import model_window_cost, model_window_tokens
from mmgen.modeling import DecodeState, place_hidden
from mmgen.sampling import Logits

NEVER = 1 << 40  # "no EOS yet" as a frame index


@dataclass
class DiaConditions:
    """One batch for `DiaTokenModel.start`: text ids [B, S] (right padded) and their mask, the
    delayed decoder template [B, L, C] (BOS, voice-prompt codes, and PAD where frames are to be
    generated; `decoder_input_ids` of `DiaProcessor`) with its mask [B, L] (left padded), the
    frame budget, and Dia's guidance (scale None or 1 turns it off; top-k None keeps every
    candidate)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    decoder_input_ids: torch.Tensor
    decoder_attention_mask: torch.Tensor
    max_new_frames: int
    guidance_scale: Optional[float] = None
    guidance_top_k: Optional[int] = None

    @property
    def guided(self) -> bool:
        return self.guidance_scale is not None and self.guidance_scale != 1


class DiaTokenModel:
    """`DiaForConditionalGeneration` under the core: conditions are a `DiaConditions`, tokens
    are delayed frames [B, n, C] over the decoder vocabulary (codes, then EOS, PAD, BOS).

    Every forward runs with batch-invariant attention (`mmgen.batch_invariant.rowwise`): a row
    attends over exactly its own keys, whatever padding, holes or neighbours the batch holds, so
    a request decoded in a static or continuous batch draws what it draws alone."""

    def __init__(self, model: Any, compact_ratio: Optional[float] = 1.0):
        self.model = model
        dec = model.config.decoder_config
        self.num_codebooks = dec.num_channels
        self.vocab_size = dec.vocab_size
        self.hidden_size = dec.hidden_size
        self.eos, self.pad, self.bos = dec.eos_token_id, dec.pad_token_id, dec.bos_token_id
        self.delay = torch.tensor(list(model.config.delay_pattern), dtype=torch.long)
        self.compact_ratio = compact_ratio
        self.window_cost = model_window_cost(model)
        self.window_tokens = model_window_tokens(model)

    def codebook_embeddings(self) -> torch.Tensor:
        """Each codebook's input embedding of each token [C, V, hidden] (grouped acceptance)."""
        return self.model.model.decoder.embeddings.embed.weight.view(self.num_codebooks, self.vocab_size, -1)

    # ---------------------------------------------------------------- protocol
    @torch.no_grad()
    def start(self, conditions: DiaConditions, capacity: int, guidance: bool) -> DecodeState:
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        if guidance:
            raise ValueError("Dia applies its own guidance (DiaConditions.guidance_scale); pass no guidance scale to the sampler")
        c, device = conditions, self.model.device
        ids, mask = c.input_ids.to(device), c.attention_mask.to(device)
        template, dmask = c.decoder_input_ids.to(device).long(), c.decoder_attention_mask.to(device).long()
        if c.guided:
            ids, mask = torch.cat([ids, torch.zeros_like(ids)]), mask.repeat(2, 1)
        rows = ids.shape[0]
        with rowwise(self.model):  # each row attends over its own keys: a row decodes as it does alone
            encoded = self.model.model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        # The prefill is every row of the template before the first frame any row generates.
        valid = template.shape[1] - int((template[:, :, 0] == self.pad).sum(-1).max())
        kv = EncoderDecoderCache(DynamicCache(config=self.model.config), DynamicCache(config=self.model.config))
        B = len(template)
        delay = self.delay.to(device)
        budget_end = c.max_new_frames - int(delay.max()) - 1
        if budget_end < 0:
            raise ValueError(f"max_new_frames must exceed the largest delay ({int(delay.max())}), got {c.max_new_frames}")
        extra = _Run(kv, encoded, mask, template[:, valid:], c.guidance_scale if c.guided else None, c.guidance_top_k,
                     torch.full((B,), budget_end, dtype=torch.long, device=device), delay,
                     torch.full((B, capacity + 1, self.num_codebooks), self.pad, dtype=torch.long, device=device),
                     torch.zeros(rows, dtype=torch.long, device=device))
        self._set_generated(extra, torch.zeros(B, dtype=torch.long, device=device))
        # Prefill: positions are slot indices (Dia's own arange), left padding masked.
        prompt_mask = dmask[:, :valid].repeat(rows // B, 1)
        positions = torch.arange(valid, device=device).expand(rows, -1)
        state = DecodeState(None, B, False, None, extra=extra)
        hidden = self._decode(state, template[:, :valid], prompt_mask, positions)
        state.cache = SlotKVCache(kv.self_attention_cache, prompt_mask, prompt_length=valid, compact_ratio=self.compact_ratio)
        state.first_logits = self._logits(state, hidden[:, -1:], template[:, valid - 1: valid], first=True)
        state.hidden = hidden[:, -1:]
        return state

    @torch.no_grad()
    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        mask, positions = state.cache.open(tokens.shape[1])
        hidden = self._decode(state, tokens, mask, positions + state.extra.offset[:, None])
        state.extra.fed = tokens
        state.hidden = hidden
        return self._logits(state, hidden, tokens)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.model.decoder.embeddings(tokens)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        R, n = hidden.shape[:2]
        return self.model.logits_dense(hidden).view(R, n, self.num_codebooks, self.vocab_size).float()

    def hidden_logits(self, state: DecodeState, hidden: torch.Tensor, fed: torch.Tensor) -> Logits:
        return self._logits(state, hidden, fed)

    @torch.no_grad()
    def restart_rows(self, state: DecodeState, rows: list[int], conditions: list[DiaConditions]) -> list[Logits]:
        """`restart` for several rows at once: requests that share a template (no voice prompt,
        or prompts of one length) and a frame budget are prefilled together, their texts right
        padded (row-wise attention: each row's prefill is the one it has alone), which saves a
        prefill per request when many arrive together. The logits predicting each one's frame 0."""
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(conditions):
            if c.input_ids.shape[0] != 1:
                raise ValueError(f"restart takes one row's conditions per request, got {c.input_ids.shape[0]} rows")
            template = (c.decoder_input_ids.shape[1], int((c.decoder_input_ids[0, :, 0] == self.pad).sum()))
            groups.setdefault((template, c.max_new_frames), []).append(i)
        out: list = [None] * len(conditions)
        for members in groups.values():
            if len(members) == 1:
                out[members[0]] = self.restart(state, rows[members[0]], conditions[members[0]])
                continue
            fresh = self.start(_right_padded([conditions[i] for i in members]), state.extra.history.shape[1] - 1, False)
            for k, i in enumerate(members):
                out[i] = self._place(state, rows[i], fresh, k)
        return out

    @torch.no_grad()
    def restart(self, state: DecodeState, row: int, conditions: DiaConditions) -> Logits:
        """Continuous batching: row `row` of a live decode starts over on one row's conditions.
        Text and template are prefilled alone (`start`); the decoder cache goes to the row's
        cache rows (`SlotKVCache.restart_row`, both halves under guidance) with the positions
        of the prompt alone, and its encoder states and cross-attention keys to the same rows,
        right padded and masked as a static batch pads shorter texts (the encoder axis grows
        for every row when this text is longer). Returns the logits predicting its frame 0."""
        fresh = self.start(conditions, state.extra.history.shape[1] - 1, False)
        if fresh.batch_size != 1:
            raise ValueError(f"restart takes one row's conditions, got {fresh.batch_size} rows")
        return self._place(state, row, fresh, 0)

    def _place(self, state: DecodeState, row: int, fresh: DecodeState, k: int) -> Logits:
        """Row `k` of `fresh` (requests prefilled by `start`) into row `row` of the live decode;
        the logits predicting its frame 0."""
        run: _Run = state.extra
        solo: _Run = fresh.extra
        if (solo.guidance_scale, solo.guidance_top_k) != (run.guidance_scale, run.guidance_top_k):
            raise ValueError("a continuous batch runs one guidance setting: every request needs the batch's guidance "
                             "scale and top-k")
        B, n = state.batch_size, fresh.batch_size
        rows, theirs = ([row, row + B], [k, k + n]) if run.guidance_scale is not None else ([row], [k])
        for r, i in zip(rows, theirs):
            run.offset -= state.cache.restart_row(r, fresh.cache, i)
        # Alone, the row's next position is its prompt length; here its slots count from the
        # live prompt region's.
        run.offset[rows] = fresh.cache.prompt_length - state.cache.prompt_length
        self._place_encoder(run, solo, rows, theirs)
        place_hidden(state, rows, fresh.hidden[theirs])
        run.template[row], run.budget_end[row], run.history[row] = solo.template[k], solo.budget_end[k], self.pad
        self._set_generated(run, run.generated.index_fill(0, torch.tensor([row], device=run.generated.device), 0))
        return fresh.first_logits[k:k + 1]

    def select_rows(self, state: DecodeState, index: torch.Tensor) -> None:
        """Continuous batching whose width follows its requests: keep rows `index` [B'] (indices
        into the current rows, in that order; a repeated one is restarted before it decodes)."""
        run: _Run = state.extra
        B = state.batch_size
        rows = torch.cat([index, index + B]) if run.guidance_scale is not None else index
        state.cache.select_rows(rows)
        for layer in run.kv.cross_attention_cache.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
        run.encoded, run.encoder_mask, run.offset = run.encoded[rows], run.encoder_mask[rows], run.offset[rows]
        run.template, run.budget_end, run.history = run.template[index], run.budget_end[index], run.history[index]
        run.fed = None
        self._set_generated(run, run.generated[index])
        state.batch_size = len(index)

    @staticmethod
    def _place_encoder(run: "_Run", solo: "_Run", rows: list, theirs: list) -> None:
        """A request's encoder states, mask and cross-attention keys/values (rows `theirs` of
        `solo`) into `rows` of the live decode, zero padded and masked on the right."""
        grow = solo.encoded.shape[1] - run.encoded.shape[1]
        if grow > 0:
            run.encoded = torch.cat([run.encoded, run.encoded.new_zeros(run.encoded.shape[0], grow, run.encoded.shape[2])], 1)
            run.encoder_mask = torch.cat([run.encoder_mask, run.encoder_mask.new_zeros(run.encoder_mask.shape[0], grow)], 1)
        n = solo.encoded.shape[1]
        for i, r in zip(theirs, rows):
            run.encoded[r], run.encoder_mask[r] = 0, 0
            run.encoded[r, :n], run.encoder_mask[r, :n] = solo.encoded[i], solo.encoder_mask[i]
        for live, fresh in zip(run.kv.cross_attention_cache.layers, solo.kv.cross_attention_cache.layers):
            for name in ("keys", "values"):
                t, new = getattr(live, name), getattr(fresh, name)
                if grow > 0:
                    t = torch.cat([t, t.new_zeros(*t.shape[:2], grow, t.shape[3])], 2)
                    setattr(live, name, t)
                for i, r in zip(theirs, rows):
                    t[r] = 0
                    t[r, :, :n] = new[i]

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        run: _Run = state.extra
        n = run.fed.shape[1]
        slots = (run.generated[:, None] + torch.arange(n, device=accepted.device)).clamp_max(run.history.shape[1] - 1)
        run.history.scatter_(1, slots[..., None].expand(-1, -1, self.num_codebooks), run.fed)
        self._set_generated(run, run.generated + accepted)
        state.cache.commit(accepted.repeat(state.cache.mask.shape[0] // state.batch_size))

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        self._set_generated(state.extra, num_generated)
        state.cache.rewind(num_generated.repeat(state.cache.mask.shape[0] // state.batch_size))

    def _set_generated(self, run: "_Run", generated: torch.Tensor) -> None:
        """Row b has fed `generated[b]` frames; re-read the EOS history they hold."""
        run.generated = generated
        T = run.history.shape[1]
        seen = (torch.arange(T, device=generated.device)[None] < generated[:, None])[..., None] & (run.history == self.eos)
        run.closed = seen.any(1)
        run.first_eos = torch.where(seen[..., 0], torch.arange(T, device=generated.device), NEVER).amin(1)

    # ---------------------------------------------------------------- internals
    def _decode(self, state: DecodeState, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        run: _Run = state.extra
        rows = mask.shape[0]
        x = tokens.repeat(rows // tokens.shape[0], 1, 1)
        with rowwise(self.model):
            out = self.model.model.decoder(
                input_ids=x, position_ids=positions, attention_mask=mask, encoder_hidden_states=run.encoded,
                encoder_attention_mask=run.encoder_mask, **transformers_cache(run.kv), use_cache=True,
            )
        return out.last_hidden_state

    def _logits(self, state: DecodeState, hidden: torch.Tensor, fed: torch.Tensor, first: bool = False) -> Logits:
        """Dia's processed logits [B, n, C, V] for the frames after each of the last n fed frames
        (`fed` [B, m, C], m >= n: `hidden` holds the last n positions)."""
        run: _Run = state.extra
        B, n, C, V = state.batch_size, hidden.shape[1], self.num_codebooks, self.vocab_size
        logits = self.model.logits_dense(hidden).view(-1, n, C, V).float()
        cond = logits[:B]
        if run.guidance_scale is not None:
            uncond = logits[B:]
            guided = cond + (cond - uncond) * run.guidance_scale
            if run.guidance_top_k is not None:
                keep = torch.zeros_like(cond, dtype=torch.bool)
                # A k at or above the vocabulary keeps every code (as the sampler's top-k does).
                keep.scatter_(-1, guided.topk(min(run.guidance_top_k, V), dim=-1).indices, True)
                cond = cond.masked_fill(~keep, float("-inf"))
            else:
                cond = guided
        neg = float("-inf")
        cond = cond.clone()
        cond[:, :, 1:, self.eos:] = neg  # only codebook 0 may end, no codebook emits PAD / BOS itself
        cond[:, :, 0, self.eos + 1:] = neg
        eos_top = cond[:, :, 0].argmax(-1) == self.eos  # [B, n]
        cond[:, :, 0] = torch.where(eos_top[..., None], cond[:, :, 0].masked_fill(torch.arange(V, device=cond.device) != self.eos, neg),
                                    cond[:, :, 0].masked_fill(torch.arange(V, device=cond.device) == self.eos, neg))
        # Frame history of each predicted frame: the committed frames, then the fed ones before it.
        if first:
            index = torch.zeros(B, 1, dtype=torch.long, device=cond.device)
            first_eos, closed = run.first_eos[:, None], run.closed[:, None]
        else:
            m = fed.shape[1]
            steps = torch.arange(m, device=cond.device)
            fed_eos = fed == self.eos
            seen = torch.where(fed_eos[..., 0], run.generated[:, None] + steps, NEVER).cummin(1).values[:, m - n:]
            closed = (run.closed[:, None] | fed_eos.long().cummax(1).values.bool())[:, m - n:]
            index = run.generated[:, None] + steps[m - n:] + 1  # generated index of each predicted frame
            first_eos = torch.minimum(run.first_eos[:, None], seen)
        end = torch.minimum(torch.minimum(first_eos, torch.where(eos_top, index, NEVER)), run.budget_end[:, None])
        forced = torch.full((B, n, C), -1, dtype=torch.long, device=cond.device)
        forced = torch.where(index[..., None] == end[..., None] + run.delay, self.eos, forced)
        forced = torch.where(closed, self.pad, forced)
        T = run.template.shape[1]
        if T:
            at = index.clamp_max(T - 1)
            known = run.template.gather(1, at[..., None].expand(-1, -1, C))
            forced = torch.where((index < T)[..., None] & (known != self.pad), known, forced)
        one_hot = torch.full_like(cond, neg).scatter(-1, forced.clamp_min(0)[..., None], 0.0)
        return Logits(torch.where((forced >= 0)[..., None], one_hot, cond))

    def decoder_layers(self) -> torch.nn.ModuleList:
        """The decoder's blocks, for layer-skip drafting (`mmgen.decoding.layer_skip`); the
        encoder and the cross-attention caches are left as they are."""
        return self.model.model.decoder.layers


def _right_padded(conditions: list[DiaConditions]) -> DiaConditions:
    """One batch of single-row conditions that share a template and a budget: texts right padded
    (id 0, masked) to the longest."""
    S = max(c.input_ids.shape[1] for c in conditions)
    pad = lambda t: torch.nn.functional.pad(t, (0, S - t.shape[1]))
    head = conditions[0]
    return DiaConditions(torch.cat([pad(c.input_ids) for c in conditions]), torch.cat([pad(c.attention_mask) for c in conditions]),
                         torch.cat([c.decoder_input_ids for c in conditions]), torch.cat([c.decoder_attention_mask for c in conditions]),
                         head.max_new_frames, head.guidance_scale, head.guidance_top_k)


class _Run:
    """Per-decode state: the cross-attention inputs, Dia's guidance, the undecoded part of the
    template [B, T, C], each row's last frame before its budget forces the end (`budget_end`
    [B]), and the frame history the processors read: `history` [B, capacity, C] the fed
    frames, of which `generated` [B] are committed, `first_eos` [B] codebook 0's EOS frame
    among them (NEVER), `closed` [B, C] the codebooks that have emitted EOS; `fed` the last
    forward's frames; `offset` [R] added to each cache row's slot positions (continuous
    batching: a restarted row decodes at its own prompt's positions)."""

    def __init__(self, kv, encoded, encoder_mask, template, guidance_scale, guidance_top_k, budget_end, delay, history, offset):
        self.kv, self.encoded, self.encoder_mask, self.template = kv, encoded, encoder_mask, template
        self.guidance_scale, self.guidance_top_k, self.budget_end, self.delay = guidance_scale, guidance_top_k, budget_end, delay
        self.history, self.offset = history, offset
        self.generated = self.first_eos = self.closed = None
        self.fed: Optional[torch.Tensor] = None


def undelay(frames: torch.Tensor, delay: Sequence[int], start: int, end: int) -> torch.Tensor:
    """Audio codes [C, end - start] from delayed frames [T, C]: code (t, c) sits at frame
    t + delay[c]."""
    return torch.stack([frames[start + d: end + d, c] for c, d in enumerate(delay)])


def delayed_template(prompts: Sequence[torch.Tensor], delay: Sequence[int], bos: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dia's decoder template for a batch of voice-prompt codes ([C, P_b] each, P_b may be 0):
    ids [B, L, C] and mask [B, L] with L = 1 + max P + max delay, left padded (BOS, mask 0) as
    `DiaProcessor` does. Row s of codebook c holds code s - 1 - delay[c] of the prompt, BOS
    before it and PAD (to be generated) after it."""
    longest, lag = max(int(p.shape[1]) for p in prompts), max(delay)
    rows = 1 + longest + lag
    ids = torch.full((len(prompts), rows, len(delay)), bos, dtype=torch.long)
    mask = torch.zeros(len(prompts), rows, dtype=torch.long)
    for b, codes in enumerate(prompts):
        P, left = int(codes.shape[1]), longest - int(codes.shape[1])
        for c, d in enumerate(delay):
            column = torch.full((1 + P + lag,), pad, dtype=torch.long)
            column[: 1 + d] = bos
            column[1 + d: 1 + d + P] = codes[c]
            ids[b, left:, c] = column
        mask[b, left:] = 1
    return ids, mask


#: The key of a Dia config that says what its encoder reads, where it is not the text's bytes:
#: {"kind": "phonemes", "voice": "en-us"} for a model trained on espeak-ng's phonemes spelled one
#: letter each (`mmgen.audio.phonemes.spell_text`; the bundled speech-tts family's trainer
#: writes it). transformers keeps unknown config keys through from_pretrained / save_pretrained.
TEXT_FRONTEND_KEY = "mmgen_text_frontend"


def text_frontend(config: Any) -> Optional[str]:
    """The espeak-ng voice a model's text is spelled in phonemes with (`TEXT_FRONTEND_KEY`), or
    None for a model that reads bytes; ValueError (one line) for a value mmgen does not know."""
    frontend = getattr(config, TEXT_FRONTEND_KEY, None)
    if frontend is None:
        return None
    if not (isinstance(frontend, dict) and frontend.get("kind") == "phonemes" and isinstance(frontend.get("voice"), str)
            and set(frontend) == {"kind", "voice"}):
        raise ValueError(f"config {TEXT_FRONTEND_KEY} must be {{\"kind\": \"phonemes\", \"voice\": VOICE}}, got {frontend!r}")
    return frontend["voice"]


class DiaSpeech:
    """What `TTSPipeline` needs to know of Dia: text and voice prompts to `DiaConditions`, the
    stop rule (the most delayed codebook's EOS closes a frame sequence), and delayed frames back
    to audio codes."""

    @classmethod
    def load(cls, source: str, torch_dtype: Optional[torch.dtype] = None, **kwargs: Any) -> tuple[Any, Any, Any]:
        """Dia's model, its byte-level tokenizer (no files) and its DAC codec from a folder or
        Hub repo (`TTSPipeline.from_pretrained`; `kwargs` go to the model's `from_pretrained`)."""
        from transformers import DacModel, DiaForConditionalGeneration, DiaTokenizer

        from mmgen.audio.pipeline import codec_source

        model = DiaForConditionalGeneration.from_pretrained(source, dtype=torch_dtype, **kwargs)
        codec = DacModel.from_pretrained(codec_source(source), dtype=torch_dtype, trust_remote_code=False)
        return model, DiaTokenizer(), codec

    def __init__(self, model: Any, tokenizer: Any, codec: Any):
        self.model, self.tokenizer, self.codec = model, tokenizer, codec
        dec = model.config.decoder_config
        self.delay = list(model.config.delay_pattern)
        self.eos, self.pad, self.bos = dec.eos_token_id, dec.pad_token_id, dec.bos_token_id
        self.text_context = int(model.config.encoder_config.max_position_embeddings)
        self.frame_context = int(dec.max_position_embeddings)
        self.phoneme_voice = text_frontend(model.config)

    def token_model(self) -> DiaTokenModel:
        return DiaTokenModel(self.model)

    def text_with_speaker(self, text: str) -> str:
        """Dia reads speaker tags; untagged text is spoken by speaker 1. A model that reads
        phonemes (`text_frontend`) gets the text spelled in them, tags kept."""
        text = text if text.lstrip().startswith("[S") else f"[S1] {text.strip()}"
        return text if self.phoneme_voice is None else spell_text(text, self.phoneme_voice)

    saves_tokenizer = False  # byte-level, nothing to save

    def frame_layout(self) -> tuple:
        return ("dia", len(self.delay), self.model.config.decoder_config.vocab_size, tuple(self.delay))

    def default_max_frames(self) -> int:
        return self.frame_context - 1

    def stopping(self, max_new_frames: int) -> Stopping:
        """A row ends with the frame where its most delayed codebook emits EOS."""
        return Stopping(stop_tokens=[self.eos], max_new_tokens=max_new_frames, stop_codebook=self.stop_codebook(),
                        pad_token=self.pad)

    def conditions(self, texts: Sequence[str], voices: Sequence[Optional[torch.Tensor]], voice_texts: Sequence[Optional[str]],
                   max_new_frames: int, guidance: tuple[Optional[float], Optional[int]]) -> DiaConditions:
        """A voice prompt (a waveform at the codec's rate) is encoded into the decoder's prefix;
        its transcript is read before the text, as Dia expects. Texts are right padded to the
        longest, as `DiaProcessor` pads them; each row attends over its own text alone
        (`mmgen.batch_invariant`), so the padding a neighbour brings changes nothing."""
        C = len(self.delay)
        prompts = [torch.zeros(C, 0, dtype=torch.long) if v is None else self.codec.encode(v) for v in voices]
        texts = [self.text_with_speaker(t if vt is None else f"{vt.strip()} {t.strip()}") for t, vt in zip(texts, voice_texts)]
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt")
        if encoded["input_ids"].shape[1] > self.text_context:
            raise ValueError(f"the text is {encoded['input_ids'].shape[1]} bytes long; this model reads at most {self.text_context}")
        ids, mask = delayed_template(prompts, self.delay, self.bos, self.pad)
        prefill = ids.shape[1] - max(self.delay)
        if prefill + max_new_frames > self.frame_context:
            raise ValueError(f"voice prompt ({prefill - 1} frames) + max_new_frames {max_new_frames} exceed the model's "
                             f"{self.frame_context} frames")
        return DiaConditions(encoded["input_ids"], encoded["attention_mask"], ids, mask, max_new_frames, *guidance)

    def stop_codebook(self) -> int:
        return max(range(len(self.delay)), key=lambda c: self.delay[c])

    def codes(self, frames: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(audio codes [C, T] of one row's generated speech, whether it has ended) from its
        generated frames [n, C] so far: only audio frames whose every codebook is known, so
        streaming can call it as frames arrive."""
        lag = max(self.delay)
        ends = (frames[:, 0] == self.eos).nonzero()
        count = len(frames) - lag if not len(ends) else min(int(ends[0]), len(frames) - lag)
        ended = bool(len(ends)) and len(frames) - lag >= int(ends[0])
        # Audio frame t (after the prompt) of codebook c is generated frame t + delay[c].
        if count <= 0:
            return torch.zeros(len(self.delay), 0, dtype=torch.long), ended
        return undelay(frames.cpu().long(), self.delay, 0, count), ended
