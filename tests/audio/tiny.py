"""Tiny random transformers speech models built offline (no weights are downloaded)."""

from __future__ import annotations

import torch

V = 64  # codebook size of the tiny codecs
DELAY = (0, 2, 3)
RATE = 16000


def tiny_dac(seed: int = 0, codebooks: int = len(DELAY)):
    from transformers import DacConfig, DacModel

    torch.manual_seed(seed)
    return DacModel(DacConfig(encoder_hidden_size=8, downsampling_ratios=[2, 2], decoder_hidden_size=16, n_codebooks=codebooks,
                              codebook_size=V, codebook_dim=4, sampling_rate=RATE)).eval()


def tiny_dia_model(seed: int = 0, layers: int = 2, hidden: int = 32, delay=DELAY, eos_boost: float = 0.0):
    """A random Dia; `eos_boost` scales codebook 0's EOS logit row so rows end on their own."""
    from transformers import DiaConfig, DiaDecoderConfig, DiaEncoderConfig, DiaForConditionalGeneration

    torch.manual_seed(seed)
    enc = DiaEncoderConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                           intermediate_size=64, vocab_size=256)
    dec = DiaDecoderConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, cross_num_attention_heads=2, cross_head_dim=16,
                           cross_num_key_value_heads=2, cross_hidden_size=32, vocab_size=V + 4, num_channels=len(delay),
                           eos_token_id=V, pad_token_id=V + 1, bos_token_id=V + 2, max_position_embeddings=256)
    model = DiaForConditionalGeneration(DiaConfig(encoder_config=enc, decoder_config=dec, delay_pattern=list(delay))).eval()
    if eos_boost:
        with torch.no_grad():
            model.logits_dense.weight[V] *= eos_boost  # channel 0's EOS row
    return model


def tiny_dia(seed: int = 0, **kwargs):
    from transformers import DiaTokenizer

    from mmgen.audio import pipeline

    return pipeline.TTSPipeline(tiny_dia_model(seed, **kwargs), DiaTokenizer(), tiny_dac(seed))


def dia_processor(pipe):
    """transformers' own DiaProcessor around the pipeline's codec (for reference runs)."""
    from transformers import DiaFeatureExtractor, DiaProcessor, DiaTokenizer

    return DiaProcessor(feature_extractor=DiaFeatureExtractor(sampling_rate=RATE, hop_length=4), tokenizer=DiaTokenizer(),
                        audio_tokenizer=pipe.codec.model)


def dia_audio_kwargs(delay=DELAY) -> dict:
    return dict(bos_token_id=V + 2, eos_token_id=V, pad_token_id=V + 1, delay_pattern=list(delay))


NQ = 4  # Mimi codebooks of the tiny CSM
CSM_MIMI_LENGTHS = {"kernel_sizes": [7, 3, 1, 4, 3, 1, 8, 3, 4], "strides": [1, 1, 1, 2, 1, 1, 4, 1, 2],
                    "dilations": [1] * 9, "use_causal_conv": True}  # the tiny Mimi's encoder, for CsmProcessor


CSM_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>", "<|pad|>")


def byte_tokenizer(specials: tuple = CSM_SPECIALS):
    """A byte-level fast tokenizer with special tokens at ids 256.. (CSM's by default; the
    first two are its bos and eos, the last its pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    tk = Tokenizer(models.BPE(vocab=chars, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=specials[0], eos_token=specials[1], pad_token=specials[-1])


def tiny_csm_model(seed: int = 0, layers: int = 2, hidden: int = 32, eos_boost: float = 0.0):
    """A random CSM with a tiny Mimi; `eos_boost` scales the heads' code-0 rows so rows end."""
    from transformers import CsmConfig, CsmDepthDecoderConfig, CsmForConditionalGeneration, MimiConfig

    torch.manual_seed(seed)
    mimi = MimiConfig(hidden_size=16, num_filters=4, upsampling_ratios=[4, 2], codebook_size=V, codebook_dim=16,
                      num_quantizers=NQ, vector_quantization_hidden_dimension=16, upsample_groups=16, num_hidden_layers=1,
                      intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, sliding_window=16,
                      max_position_embeddings=512, sampling_rate=RATE)
    depth = CsmDepthDecoderConfig(num_codebooks=NQ, backbone_hidden_size=hidden, vocab_size=V, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=NQ + 1)
    config = CsmConfig(num_codebooks=NQ, vocab_size=V, text_vocab_size=261, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                       pad_token_id=260, codebook_pad_token_id=V + 2, codebook_eos_token_id=0, bos_token_id=256,
                       audio_token_id=258, audio_eos_token_id=259, depth_decoder_config=depth.to_dict(),
                       codec_config=mimi.to_dict())
    model = CsmForConditionalGeneration(config).eval()
    with torch.no_grad():  # a fresh Mimi's codebooks are all zero (they are learned by EMA): give codes a meaning
        for name, buffer in model.codec_model.named_buffers():
            if name.endswith("codebook.embed_sum"):
                buffer.copy_(torch.randn_like(buffer))
    if eos_boost:
        with torch.no_grad():
            model.lm_head.weight[0] *= eos_boost
            model.depth_decoder.codebooks_head.weight[:, :, 0] *= eos_boost
    return model


def tiny_csm(seed: int = 0, **kwargs):
    from mmgen.audio import pipeline

    model = tiny_csm_model(seed, **kwargs)
    return pipeline.TTSPipeline(model, byte_tokenizer(), model.codec_model)


def rounding(reference: torch.Tensor) -> float:
    """Float32 rounding allowance for audio computed two ways (other windows, batches, thread
    counts): scaled to the signal's peak, so the check means the same on every machine."""
    return 1e-5 * max(float(reference.abs().max()), 1e-3)



# VibeVoice's generation tokens (Qwen2's names), the audio token first: it wins ties.
VV_SPECIALS = ("<|vision_pad|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>")
VV_AUDIO, VV_EOS, VV_AUDIO_BOS, VV_AUDIO_EOS = 256, 257, 258, 259
VV_TEMPLATE = ("{% for turn in messages %}Speaker {{ turn['role'] }}:{% for item in turn['content'] %}"
               "{% if item['type'] == 'text' %} {{ item['text'] }}{% else %} <|vision_start|><|vision_pad|><|vision_end|>"
               "{% endif %}{% endfor %}\n{% endfor %}Speech output:\n<|vision_start|>")


def keep_speaking(model, speak: float) -> None:
    """Make a random VibeVoice's rows talk on: residual channel 0 is held at 1 (every input puts 1
    there, no layer writes to it), so the audio token's logit gains `speak` / rms(hidden) > 0."""
    vv = model.model
    with torch.no_grad():
        vv.language_model.embed_tokens.weight[:, 0] = 1.0
        for projector, bias in ((vv.multi_modal_projector, 1.0), (vv.semantic_connector, 0.0)):
            projector.linear_2.weight[0] = 0.0
            projector.linear_2.bias[0] = bias
        for layer in vv.language_model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[model.config.audio_token_id, 0] = speak


def tiny_vibevoice_model(seed: int = 0, layers: int = 2, hidden: int = 32, latent: int = 8, speak: float = 0.0):
    """A random VibeVoice: Qwen2 backbone, σ-VAE decoder of hop 4, semantic encoder, diffusion head
    (`speak`: `keep_speaking`)."""
    from transformers import VibeVoiceConfig, VibeVoiceForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(model_type="qwen2", vocab_size=261, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    audio = dict(hidden_size=latent, num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1], kernel_size=3)
    semantic = dict(hidden_size=6, num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1], kernel_size=3)
    head = dict(num_hidden_layers=1, intermediate_size=48, frequency_embedding_size=16)
    config = VibeVoiceConfig(text_config=text, audio_config=audio, semantic_model_config=semantic, diffusion_head_config=head,
                             pad_token_id=VV_EOS, eos_token_id=VV_EOS, audio_bos_token_id=VV_AUDIO_BOS,
                             audio_eos_token_id=VV_AUDIO_EOS, audio_token_id=VV_AUDIO)
    model = VibeVoiceForConditionalGeneration(config).eval()
    if speak:
        keep_speaking(model, speak)
    return model


def tiny_vibevoice(seed: int = 0, **kwargs):
    """A `LatentTTSPipeline` over a tiny VibeVoice with a byte tokenizer and a small chat
    template of VibeVoice's shape (the released checkpoints ship their own)."""
    from transformers import VibeVoiceAcousticTokenizerFeatureExtractor, VibeVoiceProcessor

    from mmgen.audio.latent_pipeline import LatentTTSPipeline

    tokenizer = byte_tokenizer(VV_SPECIALS + ("<|pad|>",))
    tokenizer.pad_token = "<|endoftext|>"
    features = VibeVoiceAcousticTokenizerFeatureExtractor(sampling_rate=RATE, pad_to_multiple_of=4)
    processor = VibeVoiceProcessor(features, tokenizer, chat_template=VV_TEMPLATE)
    return LatentTTSPipeline(tiny_vibevoice_model(seed, **kwargs), processor)


def perturbed(pipe, heads: tuple, noise: float = 0.1, seed: int = 7):
    """`pipe` with relative noise on the named output heads' weights: a drafter near its unperturbed
    twin, whose greedy frames agree with the target's often but not always (another seed's random
    model agrees on none, and a draft decode beside it is autoregression)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in pipe.model.named_parameters():
            if name in heads:
                weight.add_(torch.randn(weight.shape, generator=g) * noise * weight.std())
    return pipe


def text_only(pipe):
    """`pipe` with every audio code's input embedding zeroed (CSM's depth decoder shares the
    table): each frame position reads the same input, so the next frame depends on the text and
    the position alone, never on the frames before it. Jacobi's drafts carried after a
    rejection are then the target's true next frames (its iteration converges in one step), so
    Jacobi must draft on it, where a random model's carried drafts are never right."""
    with torch.no_grad():
        pipe.token_model().codebook_embeddings().zero_()
    return pipe


def jacobi_forwards(frames: torch.Tensor, window: int, end=None, partial_last: bool = False) -> int:
    """Forwards (prefill included) of Jacobi decoding with a fixed `window` and left-copied
    initial drafts for one row's greedy frames [N, K] on a `text_only` model, counted from the
    frames alone: every slot predicts the true frame, so a draft passes iff it is the truth and
    the frames carried after a rejection are the truth, except
    - Dia (`end`: the frame its budget forces codebook 0 to end): its end rule reads the drafted
      history, so after a wrong draft of frame `end` the frames carried past it are wrong;
    - CSM (`partial_last`): the window's last slot predicts codebook 0 only (the depth decoder
      completes no draft there), so the frame carried from it is wrong."""
    N, n, forwards, drafts = len(frames), 1, 1, []
    while n < N:
        drafts += [drafts[-1] if drafts else frames[n - 1]] * (window - 1 - len(drafts))  # left copies
        a = 0
        while a < len(drafts) and n + a < N and drafts[a] is not None and torch.equal(drafts[a], frames[n + a]):
            a += 1
        blind = end is not None and n <= end < n + len(drafts) and not (drafts[end - n] is not None and torch.equal(drafts[end - n], frames[end]))
        drafts = [None if blind and j > end else frames[j] for j in range(n + a + 1, min(n + window, N))]
        if partial_last and a < window - 1 and n + window - 1 < N:
            drafts[-1] = None
        n, forwards = n + a + 1, forwards + 1
    return forwards
