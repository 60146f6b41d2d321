"""Tiny random Wan components for the video tests (no downloads): a 2-layer transformer, a VAE
with Wan's layout (×8 space, ×4 time), a 1-layer UMT5 encoder and a word-level tokenizer."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from mmgen.video.pipeline import BlockDiffusionVideoPipeline

WORDS = "cat dog face moving left right up down and bouncing a red fish".split()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_transformer(layers: int = 2, heads: int = 2, seed: int = 0, rope: int = 32) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers,
                                 cross_attn_norm=True, rope_max_seq_len=rope).eval()


def tiny_vae(seed: int = 0) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.0, 0.3],
                            latents_std=[1.5, 0.8, 1.0, 1.2]).eval()


def tiny_text_encoder(seed: int = 0) -> UMT5EncoderModel:
    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=len(WORDS) + 3, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return UMT5EncoderModel(config).eval()


def tiny_video_pipeline(layers: int = 2, heads: int = 2, seed: int = 0, **config) -> BlockDiffusionVideoPipeline:
    """32×32 frames (4×4 latents, 4 tokens per latent frame), blocks of 2 latent frames."""
    settings = dict(block_frames=2, num_frames=13, height=32, width=32, fps=8.0, max_sequence_length=8)
    settings.update(config)
    pipe = BlockDiffusionVideoPipeline(tiny_transformer(layers, heads, seed), tiny_vae(seed), tiny_text_encoder(seed),
                                       tiny_tokenizer(), **settings)
    pipe.set_progress_bar_config(disable=True)
    return pipe
