"""transformers' VibeVoice as a cached causal continuous model (next-token diffusion).

VibeVoice (Peng et al., arXiv 2508.19205) speaks in continuous acoustic latents, 7.5 per
second: a Qwen2 backbone's hidden state conditions a small diffusion head that denoises the
next latent (DPM-Solver++ in `diffusers`, v-prediction, classifier-free guidance against a
second, unconditional pass of the backbone that starts from the audio-start token). The latent
is decoded to audio by the σ-VAE's causal decoder; the next input of the backbone is the
latent's projection plus the projection of the *semantic* encoder run on that audio. Both
convolution stacks stream through caches.

`VibeVoiceLatentModel` is the core's `CausalContinuousModel` over this: `forward` feeds a
window of latents (decoding each through both conv stacks from the committed conv state,
keeping the state after each), runs the conditional and unconditional backbones in one cached
forward each, and `commit` keeps each row's accepted prefix, conv states included. So
`CausalContinuousSpeculative` drafts latents with a smaller VibeVoice and verifies them in one
target forward (CSpD, Wang et al., arXiv 2411.11925).

The head sampler is VibeVoice's own: the scheduler of the model's generation config, stepped
from the table's initial noise; with `final_std` 0 (the default) a latent equals
`VibeVoiceForConditionalGeneration.generate`'s for the same initial noise (tests/audio/
test_vibevoice.py). That ODE sampler is deterministic given its noise, so a drafted latent
could be kept only if it equalled the target's: speculative sampling needs a stochastic last
step. With `final_std` > 0 the head's latent is N(ODE solution, final_std^2), a σ-VAE style
perturbation the acoustic decoder is trained to absorb (its training latents carry Gaussian
noise of scale ~|N(0, vae_std)|), and continuous speculative decoding is exact for that law.

A row ends where the backbone's constrained choice (audio token, audio end, end of text) is
not another audio token: the latents before it are the row's audio (`generate` would go on
emitting end tokens, or start another audio segment; the released checkpoints stop there).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from mmgen.cache import SlotKVCache, transformers_cache
from mmgen.modeling import CausalContinuousState, HeadSample

#: Snapshots of the conv states kept per row: a rewind may go this many latents back.
CONV_HISTORY = 64
#: VibeVoice's default head steps when the generation config names none (transformers' default).
DEFAULT_DIFFUSION_STEPS = 10


@dataclass
class VibeVoiceConditions:
    """The backbone's prompt: ids [B, S] (left padded) with their mask; a voice prompt's samples
    [B, T] and their padding mask (None without one)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    input_values: Optional[torch.Tensor] = None
    padding_mask: Optional[torch.Tensor] = None


@dataclass
class _Run:
    """Per-decode state beside the two KV caches."""

    offset: torch.Tensor  # [B, 1] left padding, subtracted from slot positions
    fed: torch.Tensor  # [B] latents committed
    length: torch.Tensor  # [B] the row's latent count once it ended, else a large number
    history: dict  # conv cache key -> [CONV_HISTORY, B, C, pad]: the state after each fed count
    acoustic: Any = None
    semantic: Any = None
    window: list = field(default_factory=list)  # conv states after each latent of the last forward
    stops: Optional[torch.Tensor] = None  # [B, n]: the backbone ends the row after window latent j
    audio: Optional[torch.Tensor] = None  # [B, n, hop] the last forward's decoded chunks


def scheduler_for(model: Any) -> Any:
    """The noise scheduler `generate` builds from the model's generation config (diffusers)."""
    import diffusers

    config = model.generation_config
    name = getattr(config, "noise_scheduler_class", "DPMSolverMultistepScheduler")
    kwargs = getattr(config, "noise_scheduler_config",
                     {"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"})
    scheduler = getattr(diffusers, name)(**kwargs)
    if "sde" in str(getattr(scheduler.config, "algorithm_type", "")):
        raise ValueError(f"{name} with algorithm {scheduler.config.algorithm_type!r} draws its own noise; "
                         "mmgen samples VibeVoice's head with ODE solvers (given noise only)")
    return scheduler


class VibeVoiceLatentModel:
    """`VibeVoiceForConditionalGeneration` under the core: tokens are acoustic latents [B, n, D]
    (as the diffusion head produces them, i.e. scaled)."""

    def __init__(self, model: Any, num_diffusion_steps: Optional[int] = None, final_std: float = 0.0):
        if not isinstance(final_std, (int, float)) or not final_std >= 0:
            raise ValueError(f"final_std must be a number >= 0, got {final_std!r}")
        self.model = model
        config = model.config
        self.token_dim = config.audio_config.hidden_size
        steps = num_diffusion_steps or getattr(model.generation_config, "num_diffusion_steps", None)
        self.head_steps = int(steps or DEFAULT_DIFFUSION_STEPS)
        self.final_std = float(final_std)
        self.scheduler = scheduler_for(model)
        self.audio_token = config.audio_token_id
        self.choices = torch.tensor(sorted({config.audio_bos_token_id, config.audio_eos_token_id, config.audio_token_id,
                                            config.eos_token_id}))
        self.hop = config.audio_config.hop_length

    # ------------------------------------------------------------------ backbone
    def _continues(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, n] whether the backbone's choice among VibeVoice's four generation tokens is another
        audio token (`generate` takes the argmax of exactly these over the whole vocabulary, so
        the smallest id wins ties: `choices` are sorted, and argmax keeps the first maximum)."""
        choices = self.choices.to(hidden.device)
        logits = torch.nn.functional.linear(hidden, self.model.lm_head.weight[choices])  # 4 rows, not the vocabulary
        picked = choices[logits.float().argmax(-1)]
        return picked == self.audio_token

    def _backbone(self, cache: SlotKVCache, embeds: torch.Tensor, offset: Any) -> torch.Tensor:
        mask, positions = cache.open(embeds.shape[1])
        return self.model.model.language_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions + offset,
                                               **transformers_cache(cache.kv), use_cache=True).last_hidden_state

    @torch.no_grad()
    def start(self, conditions: VibeVoiceConditions, capacity: int, guidance: bool) -> CausalContinuousState:
        from transformers import DynamicCache

        vv = self.model.model
        device = self.model.device
        ids, mask = conditions.input_ids.to(device), conditions.attention_mask.to(device)
        B = ids.shape[0]
        extra = {}
        if conditions.input_values is not None:
            extra = dict(input_values=conditions.input_values.to(device, self.model.dtype),
                         padding_mask=conditions.padding_mask.to(device), sample=False)
        kv = DynamicCache(config=self.model.config.get_text_config())
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = vv(input_ids=ids, attention_mask=mask, position_ids=positions, **transformers_cache(kv), use_cache=True,
                    **extra).last_hidden_state[:, -1:]
        cache = SlotKVCache(kv, mask, prompt_length=ids.shape[1])
        negative = None
        if guidance:  # the unconditional branch: the audio-start token alone
            nkv = DynamicCache(config=self.model.config.get_text_config())
            bos = torch.full((B, 1), self.model.config.audio_bos_token_id, device=device)
            first = vv.language_model(input_ids=bos, **transformers_cache(nkv), use_cache=True).last_hidden_state
            negative = (SlotKVCache(nkv, torch.ones(B, 1, dtype=torch.bool, device=device), prompt_length=1), first)
        big = torch.iinfo(torch.long).max
        length = torch.where(self._continues(hidden)[:, 0], big, 0)
        run = _Run(offset=(mask.long().sum(1) - ids.shape[1])[:, None], fed=torch.zeros(B, dtype=torch.long, device=device),
                   length=length, history=self._empty_history(B, device))
        state = CausalContinuousState((cache, None if negative is None else negative[0]), B, guidance,
                                      (hidden, None if negative is None else negative[1]), device, extra=run)
        return state

    def _empty_history(self, batch: int, device: torch.device) -> dict:
        """Zero conv states (what a fresh streaming cache holds) for every cache key of both
        stacks, learnt from one throwaway latent."""
        from transformers.models.vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer import (
            VibeVoiceAcousticTokenizerConv1dPaddingCache as PaddingCache)

        acoustic, semantic = PaddingCache(), PaddingCache()
        self._decode(torch.zeros(batch, 1, self.token_dim, device=device, dtype=self.model.dtype), acoustic, semantic)
        return {(name, key): torch.zeros(CONV_HISTORY, *layer.cache.shape, device=device, dtype=layer.cache.dtype)
                for name, cache in (("acoustic", acoustic), ("semantic", semantic)) for key, layer in cache.layers.items()}

    def _decode(self, latents: torch.Tensor, acoustic: Any, semantic: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One latent per row [B, 1, D] through the acoustic decoder and the semantic encoder
        (streaming) -> (audio [B, hop], semantic features [B, 1, Ds])."""
        vv = self.model.model
        scaled = latents / vv.latent_scaling_factor - vv.latent_bias_factor
        audio = vv.audio_tower.decode(scaled, padding_cache=acoustic, use_cache=True).audio
        features = vv.semantic_tokenizer_encoder(audio, padding_cache=semantic, use_cache=True).latents
        return audio[:, 0], features

    def _caches(self, run: _Run) -> tuple[Any, Any]:
        """Streaming conv caches holding each row's committed state."""
        from transformers.models.vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer import (
            VibeVoiceAcousticTokenizerConv1dPaddingCache as PaddingCache)

        caches = {"acoustic": PaddingCache(), "semantic": PaddingCache()}
        rows = torch.arange(run.fed.shape[0], device=run.fed.device)
        for (name, key), table in run.history.items():
            layer = caches[name].layers.setdefault(key, _layer())
            layer.cache = table[run.fed % CONV_HISTORY, rows].clone()
            layer.left_pad, layer.in_channels, layer.is_initialized = layer.cache.shape[-1], layer.cache.shape[1], True
        return caches["acoustic"], caches["semantic"]

    @torch.no_grad()
    def forward(self, state: CausalContinuousState, tokens: torch.Tensor) -> tuple:
        run: _Run = state.extra
        vv = self.model.model
        acoustic, semantic = self._caches(run)
        audio, features, run.window = [], [], []
        for j in range(tokens.shape[1]):
            a, f = self._decode(tokens[:, j: j + 1].to(self.model.dtype), acoustic, semantic)
            audio.append(a)
            features.append(f)
            run.window.append({(name, key): layer.cache.clone() for name, cache in (("acoustic", acoustic), ("semantic", semantic))
                               for key, layer in cache.layers.items()})
        run.audio = torch.stack(audio, 1)
        x = tokens.to(self.model.dtype)
        embeds = vv.multi_modal_projector(x) + vv.semantic_connector(torch.cat(features, 1))
        positive, negative = state.cache
        hidden = self._backbone(positive, embeds, run.offset)
        run.stops = ~self._continues(hidden)
        unconditional = None if negative is None else self._backbone(negative, embeds, 0)
        return hidden, unconditional

    def commit(self, state: CausalContinuousState, accepted: torch.Tensor) -> None:
        run: _Run = state.extra
        for cache in state.cache:
            if cache is not None:
                cache.commit(accepted)
        n = len(run.window)
        if n:
            # Each row's conv state after each kept latent, into the history ring.
            for j, snapshot in enumerate(run.window):
                kept = accepted > j
                at = (run.fed + j + 1) % CONV_HISTORY
                rows = kept.nonzero().flatten()
                for key, value in snapshot.items():
                    run.history[key][at[rows], rows] = value[rows]
            # A row ends after window latent j when the backbone stops there.
            j = torch.arange(n, device=accepted.device)
            stop_at = torch.where(run.stops & (j < accepted[:, None]), j, n).min(1).values
            ended = stop_at < n
            run.length = torch.where(ended & (run.length > run.fed + stop_at + 1), run.fed + stop_at + 1, run.length)
        run.fed = run.fed + accepted
        run.window = []

    def rewind(self, state: CausalContinuousState, num_generated: torch.Tensor) -> None:
        run: _Run = state.extra
        if bool((run.fed - num_generated > CONV_HISTORY - 1).any()):
            raise ValueError(f"VibeVoice keeps the conv state of its last {CONV_HISTORY - 1} latents; a rewind went further")
        for cache in state.cache:
            if cache is not None:
                cache.rewind(num_generated)
        run.fed = num_generated.clone()
        run.window = []

    def lengths(self, state: CausalContinuousState) -> torch.Tensor:
        """[B] each row's latent count where the backbone ended it (a large number while it speaks)."""
        return state.extra.length

    # ------------------------------------------------------------------ head
    @torch.no_grad()
    def sample(self, inputs: tuple, noise: torch.Tensor, temperature: float, guidance_scale: torch.Tensor) -> HeadSample:
        """VibeVoice's head sampler from the table's initial noise (slot 0) [B, n, steps + 1, D];
        with `final_std` > 0 the latent is the ODE solution plus final_std x temperature x the
        table's last slot."""
        conditional, unconditional = inputs
        B, n, H = conditional.shape
        head = self.model.model.diffusion_head
        dtype = conditional.dtype
        x = noise[:, :, 0].reshape(B * n, -1).to(dtype)
        cond = conditional.reshape(B * n, H)
        if unconditional is not None:
            cond = torch.cat([cond, unconditional.reshape(B * n, H)])
            scale = guidance_scale.to(cond.device, torch.float32).expand(B, n).reshape(B * n, 1)
        scheduler = copy.deepcopy(self.scheduler)  # the solver keeps its history of model outputs
        scheduler.set_timesteps(num_inference_steps=self.head_steps)
        for t in scheduler.timesteps:
            if unconditional is None:
                eps = head(x, t.repeat(B * n).to(x), condition=cond)
            else:
                both = head(torch.cat([x, x]), t.repeat(2 * B * n).to(x), condition=cond)
                c, u = both.float().split(B * n)
                eps = (u + scale * (c - u)).to(dtype)
            x = scheduler.step(eps, t, x).prev_sample
        mean = x.float().view(B, n, -1)
        std = torch.full((1, 1, 1), self.final_std * float(temperature), device=mean.device)
        return HeadSample(mean + std * noise[:, :, -1].float(), mean, std)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, cache: Any = None) -> torch.Tensor:
        """A row's latents [T, D] -> its waveform [T x hop] (the causal decoder in one call; with a
        streaming `cache`, the continuation of what it decoded before)."""
        vv = self.model.model
        if not latents.shape[0]:
            return torch.zeros(0)
        scaled = latents[None].to(self.model.dtype) / vv.latent_scaling_factor - vv.latent_bias_factor
        return vv.audio_tower.decode(scaled, padding_cache=cache, use_cache=cache is not None).audio[0, 0].float()


def _layer() -> Any:
    from transformers.models.vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer import (
        VibeVoiceAcousticTokenizerConv1dCacheLayer)

    return VibeVoiceAcousticTokenizerConv1dCacheLayer()


#: Latents a call may speak when none is given: one minute at VibeVoice's 7.5 latents per second.
DEFAULT_MAX_LATENTS = 450


class VibeVoiceSpeech:
    """Texts and voices -> VibeVoice's prompt, through its processor's chat template (one speaker,
    role "0"; a voice prompt is an audio item of that turn, cloned without a transcript)."""

    saves_tokenizer = True

    def __init__(self, model: Any, processor: Any):
        self.model, self.processor = model, processor

    @property
    def sampling_rate(self) -> int:
        return int(self.processor.feature_extractor.sampling_rate)

    def frame_layout(self) -> tuple:
        """What a drafter must share: latents of the same acoustic tokenizer."""
        audio = self.model.config.audio_config
        return ("vibevoice", audio.hidden_size, audio.hop_length)

    def default_max_frames(self) -> int:
        return int(getattr(self.model.generation_config, "max_new_tokens", None) or DEFAULT_MAX_LATENTS)

    def conditions(self, texts, voices, voice_texts, budget: int, guidance: Any) -> VibeVoiceConditions:
        if any(t is not None for t in voice_texts):
            raise ValueError("VibeVoice clones a voice from its audio alone: give voice without voice_text")
        turns = []
        for text, wave in zip(texts, voices):
            content = [{"type": "text", "text": text}]
            if wave is not None:
                content.append({"type": "audio", "audio": wave.numpy()})
            turns.append([{"role": "0", "content": content}])
        # The waves are at the feature extractor's rate already (read_audio resampled them).
        inputs = self.processor.apply_chat_template(turns, tokenize=True, return_dict=True, return_tensors="pt",
                                                    processor_kwargs={"padding": True, "padding_side": "left"})
        values = inputs.get("input_values")
        return VibeVoiceConditions(inputs["input_ids"], inputs["attention_mask"], values,
                                   inputs.get("padding_mask") if values is not None else None)
