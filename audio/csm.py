"""transformers' CSM (Sesame) as a frame `TokenModel` whose codebooks depend on each other.

CSM's backbone predicts codebook 0 of the next Mimi frame; a small depth decoder, started from
the backbone's hidden state, predicts codebooks 1..K-1 one after another. So a frame's law is
not K independent distributions, and the core asks two things of the model:

- `forward` scores fed frames with the backbone and, for every *drafted* frame in the window,
  the depth decoder teacher-forced on that frame's own codebooks: codebook k's law given the
  draft's codebooks before it. Verification over (frame, codebook) pairs left to right is then
  exact. The window's last position has no drafted frame after it; its codebooks 1.. are
  placeholders.
- `complete_frame` samples the codebooks the loop could not finalise (all but codebook 0 of a
  new frame, or those after the first rejected codebook) with the depth decoder, as
  `generate` does for every frame.

A frame whose first K-1 codebooks are all 0 ends the audio (it is kept, as in `generate`);
the audio is the frames before the first all-zero frame. Greedy output equals
`CsmForConditionalGeneration.generate(do_sample=False, depth_decoder_do_sample=False)`
(tests/audio/test_csm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from mmgen.batch_invariant import rowwise
from mmgen.cache import SlotKVCache, transformers_cache
from mmgen.decoding import Stopping
from mmgen.decoding.window import model_window_cost, model_window_tokens
from mmgen.modeling import DecodeState
from mmgen.sampling import Logits, sample


@dataclass
class CsmConditions:
    """The backbone's prompt: text ids [B, S] (left padded, <|AUDIO|> placeholders for voice
    prompt frames) with their mask, and the voice prompts' samples [B, 1, S'] with per-row
    cut-offs [B, 1] (None without voice prompts)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    input_values: Optional[torch.Tensor] = None
    input_values_cutoffs: Optional[torch.Tensor] = None


class CsmTokenModel:
    """`CsmForConditionalGeneration` under the core: tokens are Mimi frames [B, n, K]. The
    backbone runs with batch-invariant attention (`mmgen.batch_invariant.rowwise`): a row's
    padding, the holes a joined row sits after and its neighbours never reach its reductions."""

    def __init__(self, model: Any, compact_ratio: Optional[float] = 1.0):
        self.model = model
        self.num_codebooks = model.config.num_codebooks
        self.vocab_size = model.config.vocab_size
        self.compact_ratio = compact_ratio
        self.window_cost = model_window_cost(model)
        self.window_tokens = model_window_tokens(model)

    def codebook_embeddings(self) -> torch.Tensor:
        """Each codebook's input embedding of each code [K, V, hidden] (grouped acceptance)."""
        return self.model.backbone_model.embed_tokens.embed_audio_tokens.weight.view(self.num_codebooks, self.vocab_size, -1)

    @torch.no_grad()
    def start(self, conditions: CsmConditions, capacity: int, guidance: bool) -> DecodeState:
        from transformers import DynamicCache

        if guidance:
            raise ValueError("CSM takes no classifier-free guidance")
        device = self.model.device
        ids, mask = conditions.input_ids.to(device), conditions.attention_mask.to(device)
        kv = DynamicCache(config=self.model.config)
        extra = {}
        if conditions.input_values is not None:
            extra = dict(input_values=conditions.input_values.to(device, self.model.dtype),
                         input_values_cutoffs=conditions.input_values_cutoffs.to(device))
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with rowwise(self.model):  # each row attends over its own keys: a row decodes as it does alone
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **transformers_cache(kv),
                             use_cache=True, output_hidden_states=True, logits_to_keep=1, **extra)
        cache = SlotKVCache(kv, mask, prompt_length=ids.shape[1], compact_ratio=self.compact_ratio)
        # Generated frames sit at slot positions shifted back by each row's left padding.
        offset = (mask.long().sum(1) - ids.shape[1])[:, None]
        state = DecodeState(cache, ids.shape[0], False, None, extra=_Run(offset))
        hidden = out.hidden_states[-1][:, -1:]
        state.extra.hidden = hidden
        state.first_logits = self._logits(out.logits[:, -1:], hidden, None)
        return state

    @torch.no_grad()
    def forward(self, state: DecodeState, tokens: torch.Tensor) -> Logits:
        mask, positions = state.cache.open(tokens.shape[1])
        with rowwise(self.model):
            hidden = self.model.backbone_model(input_ids=tokens, attention_mask=mask, position_ids=positions + state.extra.offset,
                                               **transformers_cache(state.cache.kv), use_cache=True).last_hidden_state
        state.extra.hidden = hidden
        return self._logits(self.model.lm_head(hidden), hidden, tokens[:, 1:])

    @torch.no_grad()
    def restart(self, state: DecodeState, row: int, conditions: CsmConditions) -> Logits:
        """Continuous batching: row `row` of a live decode starts over on one row's conditions.
        The prompt is prefilled alone (`start`) and its cache placed in the row
        (`SlotKVCache.restart_row`) with the positions of the prompt alone; its last hidden state
        goes to slot 0 of the row, where `complete_frame` reads it for frame 0. Returns the
        logits predicting its frame 0."""
        fresh = self.start(conditions, 0, False)
        if fresh.batch_size != 1:
            raise ValueError(f"restart takes one row's conditions, got {fresh.batch_size} rows")
        run, solo = state.extra, fresh.extra
        run.offset -= state.cache.restart_row(row, fresh.cache)
        run.offset[row] = solo.offset[0] + fresh.cache.prompt_length - state.cache.prompt_length
        run.hidden[row, 0] = solo.hidden[0, 0]
        return fresh.first_logits

    def commit(self, state: DecodeState, accepted: torch.Tensor) -> None:
        state.cache.commit(accepted)

    def rewind(self, state: DecodeState, num_generated: torch.Tensor) -> None:
        state.cache.rewind(num_generated)

    @torch.no_grad()
    def complete_frame(self, state: DecodeState, slot: torch.Tensor, frame: torch.Tensor, known: torch.Tensor,
                       probs: Callable[[Logits, int], torch.Tensor], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample codebooks known[b].. of row b's `frame` [B, K] with the depth decoder, from the
        backbone state after fed position `slot[b]` of the last forward (or the prefill);
        `probs(logits, k)` is the sampler of codebook k. Returns the frame and the laws [B, K, V]
        its codebooks were drawn from (zero rows where they were known)."""
        from transformers import DynamicCache

        hidden = state.extra.hidden.gather(1, slot.view(-1, 1, 1).expand(-1, 1, state.extra.hidden.shape[-1]))[:, 0]
        depth = self.model.depth_decoder
        cache = DynamicCache(config=depth.config)
        frame = frame.clone()
        laws = torch.zeros(*frame.shape, self.vocab_size, device=frame.device)
        x = torch.stack([torch.zeros_like(frame[:, 0]), frame[:, 0]], 1)
        for k in range(1, self.num_codebooks):
            logits = depth(input_ids=x, backbone_last_hidden_state=hidden if k == 1 else None, **transformers_cache(cache),
                           use_cache=True, logits_to_keep=1).logits[:, -1:]
            p = probs(Logits(logits.float()), k)  # [B, 1, V]
            drawn = sample(p, generator)[:, 0]
            free = known <= k
            frame[:, k] = torch.where(free, drawn, frame[:, k])
            laws[:, k] = torch.where(free[:, None], p[:, 0], 0.0)
            x = frame[:, k: k + 1]
        return frame, laws

    def _logits(self, first: torch.Tensor, hidden: torch.Tensor, drafted: Optional[torch.Tensor]) -> Logits:
        """[B, n, K, V]: codebook 0 from the backbone at every position; codebooks 1.. of each
        drafted frame teacher-forced through the depth decoder; zeros (placeholders) at the last
        position, which `complete_frame` fills."""
        B, n, _ = hidden.shape
        K, V = self.num_codebooks, self.vocab_size
        out = torch.zeros(B, n, K, V, device=hidden.device)
        out[:, :, 0] = first.float()
        if drafted is not None and drafted.shape[1]:
            m = drafted.shape[1]
            h = hidden[:, :m].reshape(B * m, -1)
            frames = drafted.reshape(B * m, K)
            x = torch.cat([torch.zeros_like(frames[:, :1]), frames[:, : K - 1]], 1)
            # An explicit mask: without one, transformers probes batch-1 inputs for packed sequences
            # and fails on the depth decoder's 1-D positions.
            depth = self.model.depth_decoder(input_ids=x, backbone_last_hidden_state=h, attention_mask=torch.ones_like(x),
                                             use_cache=False, logits_to_keep=0)
            out[:, :m, 1:] = depth.logits.float().view(B, m, K - 1, V)
        return Logits(out)

    def decoder_layers(self) -> torch.nn.ModuleList:
        """The backbone's blocks, for layer-skip drafting (`mmgen.decoding.layer_skip`); the
        depth decoder always runs whole."""
        return self.model.backbone_model.layers


class _Run:
    """Per-decode state: position `offset` [B, 1] of generated slots (left padding), and the
    backbone's hidden states of the last forward [B, n, H] for `complete_frame`."""

    def __init__(self, offset: torch.Tensor):
        self.offset = offset
        self.hidden: Optional[torch.Tensor] = None


class CsmSpeech:
    """What `TTSPipeline` needs to know of CSM: texts and voice prompts to `CsmConditions`, the
    end-of-audio frame, and frames back to Mimi codes."""

    saves_tokenizer = True

    @classmethod
    def load(cls, source: str, torch_dtype: Optional[torch.dtype] = None, **kwargs: Any) -> tuple[Any, Any, Any]:
        """CSM's model, its tokenizer and its own Mimi codec from a folder or Hub repo
        (`TTSPipeline.from_pretrained`; `kwargs` go to the model's `from_pretrained`)."""
        from transformers import AutoTokenizer, CsmForConditionalGeneration

        model = CsmForConditionalGeneration.from_pretrained(source, dtype=torch_dtype, **kwargs)
        return model, AutoTokenizer.from_pretrained(source, trust_remote_code=False), model.codec_model

    def __init__(self, model: Any, tokenizer: Any, codec: Any):
        self.model, self.tokenizer, self.codec = model, tokenizer, codec
        self.num_codebooks = model.config.num_codebooks
        self.context = int(model.config.max_position_embeddings)

    def token_model(self) -> CsmTokenModel:
        return CsmTokenModel(self.model)

    def frame_layout(self) -> tuple:
        return ("csm", self.num_codebooks, self.model.config.vocab_size)

    def default_max_frames(self) -> int:
        return min(self.context // 2, 1024)

    def stopping(self, max_new_frames: int) -> Stopping:
        """A frame whose first K-1 codebooks are all the EOS code ends the row (and is kept)."""
        return Stopping(stop_tokens=[self.model.config.codebook_eos_token_id], max_new_tokens=max_new_frames,
                        stop_codebook=tuple(range(self.num_codebooks - 1)), pad_token=self.model.config.codebook_pad_token_id)

    def turn(self, text: str) -> list[int]:
        """One speaker turn's ids: <bos>[speaker]text<eos>; untagged text is speaker 0."""
        text = text.strip()
        tagged = text.startswith("[") and "]" in text[:6] and text[1: text.index("]")].isdigit()
        tok = self.tokenizer
        return tok(f"{tok.bos_token}{text if tagged else f'[0]{text}'}{tok.eos_token}", add_special_tokens=False)["input_ids"]

    def conditions(self, texts: Sequence[str], voices: Sequence[Optional[torch.Tensor]], voice_texts: Sequence[Optional[str]],
                   max_new_frames: int, guidance: Any) -> CsmConditions:
        """Left-padded ids; a voice prompt (a waveform at the codec's rate) is a context turn:
        its transcript, its audio frames as <|AUDIO|> placeholders the model fills from
        `input_values`, then <|audio_eos|>."""
        if guidance[0] not in (None, 1, 1.0):
            raise ValueError("CSM takes no guidance_scale")
        cfg = self.model.config
        rows, values = [], []
        for text, wave, voice_text in zip(texts, voices, voice_texts):
            ids = []
            if wave is not None:
                wave = torch.nn.functional.pad(wave, (0, (-wave.numel()) % self.codec.hop_length))  # whole frames
                frames = self.codec.encode(wave).shape[1]
                ids += self.turn(voice_text or "") + [cfg.audio_token_id] * frames + [cfg.audio_eos_token_id]
                values.append(wave)
            ids += self.turn(text)
            rows.append(ids)
        longest = max(len(r) for r in rows)
        if longest + max_new_frames > self.context:
            raise ValueError(f"prompt ({longest} positions) + max_new_frames {max_new_frames} exceed the model's {self.context}")
        pad = cfg.pad_token_id
        input_ids = torch.tensor([[pad] * (longest - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
        if not values:
            return CsmConditions(input_ids, mask)
        if len(values) != len(texts):
            raise ValueError("with CSM, give a voice prompt for every row or for none")
        size = max(v.numel() for v in values)
        input_values = torch.stack([torch.nn.functional.pad(v, (0, size - v.numel())) for v in values])[:, None]
        cutoffs = torch.tensor([[v.numel()] for v in values])
        return CsmConditions(input_ids, mask, input_values, cutoffs)

    def codes(self, frames: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(Mimi codes [K, T] of one row, whether it has ended) from its frames [n, K] so far:
        the frames before the first end frame (first K-1 codebooks all EOS); audio is cut at
        the first all-EOS frame, as `generate(output_audio=True)` does."""
        eos = self.model.config.codebook_eos_token_id
        ended = bool((frames[:, :-1] == eos).all(-1).any())
        silent = (frames == eos).all(-1).nonzero()
        count = int(silent[0]) if len(silent) else len(frames)
        return frames[:count].T.cpu().long(), ended
