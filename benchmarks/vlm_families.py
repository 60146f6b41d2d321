"""mmgen `ar` against transformers' `generate` for every VLM family, at a real checkpoint's
configuration (issue 34, "Speed"): random weights, float32, CPU, one thread.

    python -m benchmarks.vlm_families [--families llava qwen2_vl ...] [--repeats 3] [--out out.json]
    python -m benchmarks.vlm_families --smoke      # the tiny test configs (tests/vlm/tiny.py), seconds

Per family, one model object at the widths, vocabulary, vision tower widths and processor
geometry of the family's smallest public checkpoint (`CHECKPOINTS`: each number with the
config.json it comes from). Depth is cut where the full model does not fit this box's time (a
2-core CPU shared with other work): the table names the text and vision layers used out of the
checkpoint's. Tokenizers are word-level stand-ins (`tests.vlm.tiny.word_tokenizer`), so a
question is a few tokens, as a real one is; the image tokens are the real processor's count.

Both sides answer the same question about the same image (one image at the checkpoint's base
tile size), 16 new tokens, greedy, the model's end token: mmgen as
`pipe(prompt, image, max_new_tokens=16, decoding="ar")`, transformers as the same processor
call (`pipe.prepare_inputs`), `model.generate(**inputs, do_sample=False, max_new_tokens=16)`
and the tokenizer's decode. The two are interleaved (one warm-up each, then rounds of one run
each, the order alternating), so a busy box slows both alike. Time to first token is from the
call to the first new token reaching a streamer; ms per token is the rest of the call over the
tokens after the first (medians over rounds); the ratio is transformers' whole-answer time over
mmgen's (above 1: mmgen is faster), the median of the rounds' ratios. Every run's tokens must
be the same on both sides.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from PIL import Image

# The test suite's offline builders: word-level stand-in tokenizers with the families' special
# tokens, a plain chat template, the tiny configs (--smoke) and the pipeline wrapper.
from tests.vlm.tiny import BUILDERS, QWEN_TOKENS, chat_template, finish, idefics3_processor, word_tokenizer

QUESTION = "what is the colour of the small cat in this picture ?"


@dataclass
class Checkpoint:
    """A public checkpoint's configuration: `build(text_layers, vision_layers)` -> (model,
    processor) at its real widths with that depth; `text_layers` / `vision_layers` are the
    depths run here, `real_text_layers` / `real_vision_layers` the checkpoint's."""

    name: str
    source: str  # where the numbers come from
    build: Callable[[int, int], tuple[Any, Any]]
    real_text_layers: int
    real_vision_layers: int
    text_layers: int
    vision_layers: int
    image: tuple[int, int]  # (width, height) of the input image
    note: str = ""  # where the processor's default is not followed, and why


# ----------------------------------------------------------------------------- towers
def clip_vision(layers: int) -> dict:
    """CLIP ViT-L/14 at 336 px (openai/clip-vit-large-patch14-336: LLaVA-1.5 and LLaVA-NeXT)."""
    return dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                num_attention_heads=16, image_size=336, patch_size=14, projection_dim=768)


def siglip_vision(layers: int, image_size: int) -> dict:
    """SigLIP so400m/14 (1152 wide, 4304 MLP, 16 heads): OneVision, Gemma3, PaliGemma, AyaVision."""
    return dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=layers,
                num_attention_heads=16, image_size=image_size, patch_size=14, vision_use_head=False)


def hybrid(layers: int, period: int) -> list[str]:
    """Layer kinds of a local/global model cut to `layers`: its sliding layers, then one global
    layer at the end (the real period is `period`: 1 global every `period` layers), so the cut
    model still has both kinds."""
    if layers < 2:
        return ["sliding_attention"] * layers
    kinds = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
    kinds[-1] = "full_attention"
    return kinds


# ----------------------------------------------------------------------------- families
def llava(text_layers: int, vision_layers: int, next_: bool = False, mistral: bool = False):
    """LLaVA-1.5-7B, or LLaVA-NeXT (v1.6) vicuna-7B / mistral-7B: CLIP-L/336 and a 7B text model."""
    import transformers

    vocab, tok = word_tokenizer({"image_token": "<image>"})
    family = "LlavaNext" if next_ else "Llava"
    pinpoints = {"image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]} if next_ else {}
    images = getattr(transformers, "LlavaNextImageProcessor" if next_ else "CLIPImageProcessor")(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, **pinpoints)
    processor = getattr(transformers, f"{family}Processor")(
        image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chat_template("<image>"))
    if mistral:  # Mistral-7B-Instruct-v0.2 as published with llava-v1.6-mistral (sliding window 4096)
        text = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, sliding_window=4096, max_position_embeddings=32768, rope_theta=1e6)
    else:  # vicuna-7b-v1.5 (Llama-2-7B)
        text = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                    num_key_value_heads=32, max_position_embeddings=4096)
    config = getattr(transformers, f"{family}Config")(
        vision_config=clip_vision(vision_layers),
        text_config=dict(text, num_hidden_layers=text_layers, vocab_size=32064, rms_norm_eps=1e-5, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2),
        image_token_index=vocab["<image>"], vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=False, **pinpoints)
    return getattr(transformers, f"{family}ForConditionalGeneration")(config), processor


def llava_onevision(text_layers: int, vision_layers: int):
    """llava-onevision-qwen2-0.5b-ov: SigLIP so400m/384 (26 layers), any-resolution tiles of 384
    px up to 6 x 6, Qwen2-0.5B."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessor,
                              LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor)

    vocab, tok = word_tokenizer({"image_token": "<image>", "video_token": "<video>"}, ("<video>",))
    pinpoints = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size={"height": 384, "width": 384}, image_grid_pinpoints=pinpoints),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 384, "width": 384}), tokenizer=tok,
        num_image_tokens=729, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
        chat_template=chat_template("<image>", "<video>"))
    config = LlavaOnevisionConfig(
        vision_config=siglip_vision(vision_layers, 384),
        text_config=dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=text_layers,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=152000, rope_theta=1e6,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        image_token_index=vocab["<image>"], video_token_index=vocab["<video>"], image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full", vision_feature_layer=-1, vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=True)
    return LlavaOnevisionForConditionalGeneration(config), processor


def qwen_vl(text_layers: int, vision_layers: int, version: str):
    """Qwen2-VL-2B, Qwen2.5-VL-3B or Qwen3-VL-2B (their own vision towers, M-RoPE text models)."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    vocab, tok = word_tokenizer({"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                 "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}, tuple(QWEN_TOKENS))
    patch = 16 if version == "3" else 14
    geometry = dict(patch_size=patch, temporal_patch_size=2, merge_size=2)
    name = {"2": "Qwen2VL", "2_5": "Qwen2_5_VL", "3": "Qwen3VL"}[version]
    video = getattr(transformers, "Qwen3VLVideoProcessor" if version == "3" else "Qwen2VLVideoProcessor")(**geometry)
    processor = getattr(transformers, f"{name}Processor")(
        image_processor=Qwen2VLImageProcessor(**geometry), video_processor=video, tokenizer=tok,
        chat_template=chat_template("<|vision_start|> <|image_pad|> <|vision_end|>", "<|vision_start|> <|video_pad|> <|vision_end|>"))
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, vocab_size=151936, tie_word_embeddings=True)
    if version == "2":
        text = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1e6)
        vision = dict(depth=vision_layers, embed_dim=1280, mlp_ratio=4, num_heads=16, hidden_size=1536, **_qwen_patches(patch))
    elif version == "2_5":
        text = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, rope_theta=1e6)
        full = [i for i in (7, 15, 23, 31) if i < vision_layers] or [vision_layers - 1]  # full attention every 8th block
        vision = dict(depth=vision_layers, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                      window_size=112, fullatt_block_indexes=full, **_qwen_patches(patch))
    else:
        text = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                    rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                     "mrope_interleaved": True})
        vision = dict(depth=vision_layers, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                      num_position_embeddings=2304, deepstack_visual_indexes=[i for i in (5, 11, 17) if i < vision_layers],
                      **_qwen_patches(patch))
    config = getattr(transformers, f"{name}Config")(
        text_config=dict(text, num_hidden_layers=text_layers, **ids), vision_config=vision,
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"], tie_word_embeddings=True)
    return getattr(transformers, f"{name}ForConditionalGeneration")(config), processor


def _qwen_patches(patch: int) -> dict:
    return dict(patch_size=patch, spatial_merge_size=2, temporal_patch_size=2)


def idefics3(text_layers: int, vision_layers: int, smolvlm: bool = False):
    """SmolVLM-256M-Instruct (model_type idefics3) or SmolVLM2-256M-Video-Instruct (smolvlm):
    SigLIP-B/16 at 512 px, pixel shuffle x4 (64 tokens a tile), SmolLM2-135M."""
    import transformers

    vocab, processor = idefics3_processor(smolvlm, edge=512, image_seq_len=64)
    name = "SmolVLM" if smolvlm else "Idefics3"
    config = getattr(transformers, f"{name}Config")(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=vision_layers, num_attention_heads=12,
                           image_size=512, patch_size=16),
        text_config=dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=text_layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49280, rope_theta=1e5,
                         max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        scale_factor=4, image_token_id=vocab["<image>"])
    return getattr(transformers, f"{name}ForConditionalGeneration")(config), processor


def gemma3(text_layers: int, vision_layers: int):
    """gemma-3-4b-it: SigLIP so400m at 896 px pooled to 256 tokens, Gemma 3 4B (5 sliding-window
    layers of 1024 tokens to 1 global)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    special = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    vocab, tok = word_tokenizer(special, tuple(special.values()))
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 896, "width": 896}), tokenizer=tok,
                                image_seq_length=256, chat_template=chat_template("<start_of_image>"))
    config = Gemma3Config(
        vision_config=siglip_vision(vision_layers, 896),
        text_config=dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240, num_hidden_layers=text_layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                         layer_types=hybrid(text_layers, 6), pad_token_id=0, bos_token_id=1, eos_token_id=2),
        mm_tokens_per_image=256, boi_token_index=vocab["<start_of_image>"], eoi_token_index=vocab["<end_of_image>"],
        image_token_index=vocab["<image_soft_token>"])
    return Gemma3ForConditionalGeneration(config), processor


def paligemma(text_layers: int, vision_layers: int, version: int = 1):
    """paligemma-3b-pt-224 (Gemma 2B) or paligemma2-3b-pt-224 (Gemma 2 2B: alternating 4096-token
    sliding and global layers, logits soft-capped at 30): SigLIP so400m at 224 px (256 tokens)."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor, SiglipImageProcessor

    vocab, tok = word_tokenizer({"image_token": "<image>"})
    images = SiglipImageProcessor(size={"height": 224, "width": 224})
    images.image_seq_length = 256
    processor = PaliGemmaProcessor(image_processor=images, tokenizer=tok)
    ids = dict(vocab_size=257216, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if version == 2:
        width = 2304
        text = dict(model_type="gemma2", hidden_size=width, intermediate_size=9216, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=256, sliding_window=4096, layer_types=hybrid(text_layers, 2),
                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256)
    else:
        width = 2048
        text = dict(model_type="gemma", hidden_size=width, intermediate_size=16384, num_attention_heads=8,
                    num_key_value_heads=1, head_dim=256)
    vision = dict(siglip_vision(vision_layers, 224), projection_dim=width)
    config = PaliGemmaConfig(vision_config=vision, text_config=dict(text, num_hidden_layers=text_layers, **ids),
                             image_token_index=vocab["<image>"], projection_dim=width, vocab_size=257216)
    return PaliGemmaForConditionalGeneration(config), processor


def internvl(text_layers: int, vision_layers: int):
    """InternVL3-1B-hf: InternViT-300M at 448 px, pixel shuffle to 256 tokens a tile, Qwen2.5-0.5B."""
    from transformers import (GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration, InternVLProcessor,
                              InternVLVideoProcessor)

    special = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
               "video_token": "<video>"}
    vocab, tok = word_tokenizer(special, tuple(special.values()))
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": 448, "width": 448}, crop_to_patches=True, max_patches=12),
        video_processor=InternVLVideoProcessor(size={"height": 448, "width": 448}), tokenizer=tok, image_seq_length=256,
        chat_template=chat_template("<IMG_CONTEXT>"))
    config = InternVLConfig(
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=vision_layers, num_attention_heads=16,
                           image_size=[448, 448], patch_size=[14, 14]),
        text_config=dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=text_layers,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151674, rope_theta=1e6,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2),
        image_token_id=vocab["<IMG_CONTEXT>"], image_seq_length=256, downsample_ratio=0.5, vision_feature_layer=-1)
    return InternVLForConditionalGeneration(config), processor


def mistral3(text_layers: int, vision_layers: int):
    """Ministral-3-3B-Instruct-2512: Pixtral's tower (14 px patches merged 2 x 2, up to 1540 px)
    and a Ministral 3 3B text model."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    special = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    vocab, tok = word_tokenizer(special, tuple(special.values()))
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": 1540}, patch_size=14),
                                 tokenizer=tok, patch_size=14, spatial_merge_size=2, chat_template=chat_template("[IMG]"))
    config = Mistral3Config(
        vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=vision_layers,
                           num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14),
        text_config=dict(model_type="ministral3", hidden_size=3072, intermediate_size=9216, num_hidden_layers=text_layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        image_token_index=vocab["[IMG]"], spatial_merge_size=2, vision_feature_layer=-1, multimodal_projector_bias=False,
        tie_word_embeddings=True)
    return Mistral3ForConditionalGeneration(config), processor


def aya_vision(text_layers: int, vision_layers: int):
    """aya-vision-8b: SigLIP2 so400m at 364 px downsampled 2 x 2 (169 tokens a tile), Command R7B
    (Cohere2: 3 sliding-window layers of 4096 tokens to 1 global, 256k vocabulary)."""
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration, AyaVisionProcessor, GotOcr2ImageProcessor

    tokens = ("<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE_GLOBAL")
    vocab, tok = word_tokenizer({"image_token": "<image>", **{f"aya_{i}": t for i, t in enumerate(tokens)}}, tokens)
    processor = AyaVisionProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": 364, "width": 364}, crop_to_patches=True, max_patches=12),
        tokenizer=tok, patch_size=14, img_size=364, downsample_factor=2, chat_template=chat_template("<image>"))
    config = AyaVisionConfig(
        vision_config=siglip_vision(vision_layers, 364),
        text_config=dict(model_type="cohere2", hidden_size=4096, intermediate_size=14336, num_hidden_layers=text_layers,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=256000, logit_scale=0.25,
                         rope_theta=50000, sliding_window=4096, layer_types=hybrid(text_layers, 4),
                         pad_token_id=0, bos_token_id=1, eos_token_id=2),
        downsample_factor=2, alignment_intermediate_size=28672, adapter_layer_norm_eps=1e-6,
        image_token_index=vocab["<|IMG_PATCH|>"], vision_feature_layer=-1, vision_feature_select_strategy="full")
    return AyaVisionForConditionalGeneration(config), processor


HF = "https://huggingface.co/{}/blob/main/config.json"
#: family (as in tests/vlm/tiny.py BUILDERS) -> the checkpoint run. Sources: each checkpoint's
#: config.json (values it leaves out are the transformers config class defaults, which are that
#: checkpoint's: LlamaConfig is Llama-2-7B, MistralConfig Mistral-7B, Qwen2VLVisionConfig
#: Qwen2-VL's tower, Ministral3Config's rope Ministral 3's).
CHECKPOINTS: dict[str, Checkpoint] = {
    "llava": Checkpoint("llava-hf/llava-1.5-7b-hf", HF.format("llava-hf/llava-1.5-7b-hf"),
                        lambda t, v: llava(t, v), 32, 24, 1, 4, (336, 336)),
    "llava_next": Checkpoint("llava-hf/llava-v1.6-vicuna-7b-hf", HF.format("llava-hf/llava-v1.6-vicuna-7b-hf"),
                             lambda t, v: llava(t, v, next_=True), 32, 24, 1, 2, (336, 336)),
    "llava_next_mistral": Checkpoint("llava-hf/llava-v1.6-mistral-7b-hf", HF.format("llava-hf/llava-v1.6-mistral-7b-hf"),
                                     lambda t, v: llava(t, v, next_=True, mistral=True), 32, 24, 1, 2, (336, 336),
                                     "sliding window 4096 as first published (the current config says null)"),
    "llava_onevision": Checkpoint("llava-hf/llava-onevision-qwen2-0.5b-ov-hf",
                                  HF.format("llava-hf/llava-onevision-qwen2-0.5b-ov-hf"), llava_onevision, 24, 26, 4, 2,
                                  (384, 384)),
    "qwen2_vl": Checkpoint("Qwen/Qwen2-VL-2B-Instruct", HF.format("Qwen/Qwen2-VL-2B-Instruct"),
                           lambda t, v: qwen_vl(t, v, "2"), 28, 32, 4, 4, (448, 448)),
    "qwen2_5_vl": Checkpoint("Qwen/Qwen2.5-VL-3B-Instruct", HF.format("Qwen/Qwen2.5-VL-3B-Instruct"),
                             lambda t, v: qwen_vl(t, v, "2_5"), 36, 32, 2, 8, (448, 448)),
    "qwen3_vl": Checkpoint("Qwen/Qwen3-VL-2B-Instruct", HF.format("Qwen/Qwen3-VL-2B-Instruct"),
                           lambda t, v: qwen_vl(t, v, "3"), 28, 24, 4, 6, (448, 448),
                           "text widths as Qwen3-1.7B's config; tower as Qwen3-VL-4B's (24 x 1024), out width 2048"),
    "idefics3": Checkpoint("HuggingFaceTB/SmolVLM-256M-Instruct", HF.format("HuggingFaceTB/SmolVLM-256M-Instruct"),
                           idefics3, 30, 12, 30, 12, (512, 512), "image splitting off: one 512 px tile (64 tokens)"),
    "smolvlm": Checkpoint("HuggingFaceTB/SmolVLM2-256M-Video-Instruct",
                          HF.format("HuggingFaceTB/SmolVLM2-256M-Video-Instruct"),
                          lambda t, v: idefics3(t, v, smolvlm=True), 30, 12, 30, 12, (512, 512),
                          "image splitting off: one 512 px tile (64 tokens)"),
    "gemma3": Checkpoint("google/gemma-3-4b-it", HF.format("google/gemma-3-4b-it"), gemma3, 34, 27, 2, 1, (896, 896),
                         "text layers: 1 sliding + 1 global"),
    "paligemma": Checkpoint("google/paligemma-3b-pt-224", HF.format("google/paligemma-3b-pt-224"),
                            lambda t, v: paligemma(t, v, 1), 18, 27, 2, 6, (224, 224)),
    "paligemma2": Checkpoint("google/paligemma2-3b-pt-224", HF.format("google/paligemma2-3b-pt-224"),
                             lambda t, v: paligemma(t, v, 2), 26, 27, 2, 6, (224, 224), "text layers: 1 sliding + 1 global"),
    "internvl": Checkpoint("OpenGVLab/InternVL3-1B-hf", HF.format("OpenGVLab/InternVL3-1B-hf"), internvl, 24, 24, 8, 4,
                           (448, 448)),
    "mistral3": Checkpoint("mistralai/Ministral-3-3B-Instruct-2512", HF.format("mistralai/Ministral-3-3B-Instruct-2512"),
                           mistral3, 26, 24, 2, 4, (448, 448),
                           "text widths from the checkpoint's published signature; a 448 px image (kept as it is: 256 tokens)"),
    "aya_vision": Checkpoint("CohereLabs/aya-vision-8b", HF.format("CohereLabs/aya-vision-8b"), aya_vision, 32, 27, 2, 3,
                             (364, 364), "text layers: 1 sliding + 1 global"),
}


# ----------------------------------------------------------------------------- timing
class FirstToken:
    """A streamer for both sides: when the first new token arrived. transformers' `generate`
    puts the prompt first (`prompt_first`), then each new token; mmgen puts each row's new tokens."""

    def __init__(self, prompt_first: bool):
        self.skip, self.at = prompt_first, None

    def put(self, value: Any) -> None:
        if self.skip:
            self.skip = False
        elif self.at is None and (len(value) if torch.is_tensor(value) else any(len(row) for row in value)):
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def run_mmgen(pipe: Any, image: Image.Image, budget: int) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, seconds of the whole call) of mmgen's `ar`."""
    streamer = FirstToken(prompt_first=False)
    begin = time.perf_counter()
    out = pipe(QUESTION, image, max_new_tokens=budget, decoding="ar", streamer=streamer)
    end = time.perf_counter()
    return out.token_ids[0, : out.lengths[0]].tolist(), streamer.at - begin, end - begin


def run_generate(pipe: Any, image: Image.Image, budget: int) -> tuple[list[int], float, float]:
    """The same for transformers: the same processor call, `generate`, the tokenizer's decode."""
    streamer = FirstToken(prompt_first=True)
    begin = time.perf_counter()
    inputs = pipe.prepare_inputs(QUESTION, image)
    out = pipe.model.generate(**inputs, do_sample=False, max_new_tokens=budget, eos_token_id=pipe.eos_token_ids,
                              pad_token_id=pipe.pad_token_id, streamer=streamer)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    pipe.processor.tokenizer.decode(ids, skip_special_tokens=True)
    end = time.perf_counter()
    return ids, streamer.at - begin, end - begin


def measure(pipe: Any, image: Image.Image, budget: int, repeats: int) -> dict:
    """Both sides interleaved (a warm-up each, then `repeats` rounds, the order alternating):
    medians of time to first token, ms per later token and whole-answer time; whether every
    run gave the same tokens."""
    sides = {"mmgen": run_mmgen, "generate": run_generate}
    samples: dict[str, list] = {name: [] for name in sides}
    tokens: dict[str, list] = {name: [] for name in sides}
    for round_ in range(repeats + 1):
        for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
            ids, first, total = sides[name](pipe, image, budget)
            tokens[name].append(ids)
            if round_:  # round 0 is the warm-up
                samples[name].append((first, (total - first) / max(1, len(ids) - 1), total))
    reference = tokens["generate"][0]
    row = {"tokens": len(reference), "identical": all(ids == reference for runs in tokens.values() for ids in runs)}
    for name, runs in samples.items():
        row[f"{name}_ttft_ms"] = round(1000 * statistics.median(r[0] for r in runs), 1)
        row[f"{name}_ms_per_token"] = round(1000 * statistics.median(r[1] for r in runs), 1)
        row[f"{name}_total_ms"] = round(1000 * statistics.median(r[2] for r in runs), 1)
        row[f"{name}_total_spread_ms"] = [round(1000 * min(r[2] for r in runs), 1), round(1000 * max(r[2] for r in runs), 1)]
    # Each round's two runs are adjacent in time: their ratio sees one load, so the median of
    # the rounds' ratios is steadier than the ratio of the medians (both are kept).
    paired = lambda k: round(statistics.median(g[k] / m[k] for m, g in zip(samples["mmgen"], samples["generate"])), 3)
    row["ratio"], row["decode_ratio"] = paired(2), paired(1)
    row["ratio_of_medians"] = round(row["generate_total_ms"] / row["mmgen_total_ms"], 3)
    if not row["identical"]:
        row["mmgen_tokens"], row["generate_tokens"] = tokens["mmgen"], tokens["generate"]
    return row


def extra_operators(pipe: Any, image: Image.Image, budget: int, top: int = 6) -> dict:
    """Where mmgen's call differs from generate's in work, not in load: one call of each side
    under torch.profiler, and the operators mmgen calls more often than generate (or
    generate more often than mmgen), by the self CPU time of the difference: {operator:
    [mmgen ms, mmgen calls, generate ms, generate calls]}."""
    from torch.profiler import ProfilerActivity, profile

    seen = {}
    for name, run in (("mmgen", run_mmgen), ("generate", run_generate)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(pipe, image, budget)
        seen[name] = {e.key: (e.self_cpu_time_total / 1000, e.count) for e in prof.key_averages()}
    ops = {}
    for op in set(seen["mmgen"]) | set(seen["generate"]):
        (m_ms, m_n), (g_ms, g_n) = seen["mmgen"].get(op, (0.0, 0)), seen["generate"].get(op, (0.0, 0))
        if m_n != g_n:
            ops[op] = [round(m_ms, 1), m_n, round(g_ms, 1), g_n]
    return dict(sorted(ops.items(), key=lambda kv: -abs(kv[1][0] - kv[1][2]))[:top])


def image_for(size: tuple[int, int], seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    w, h = size
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy())


def bench_family(family: str, budget: int, repeats: int, smoke: bool, text_layers: Optional[int],
                 vision_layers: Optional[int], profile: bool = False) -> dict:
    """One family's row: build (seeded), measure, free."""
    begin = time.perf_counter()
    if smoke:
        pipe = BUILDERS[family](0)
        row = {"family": family, "checkpoint": "tiny test config (tests/vlm/tiny.py)", "source": "", "note": ""}
        image = image_for((40, 36))
    else:
        spec = CHECKPOINTS[family]
        text_layers = text_layers or spec.text_layers
        vision_layers = vision_layers or spec.vision_layers
        torch.manual_seed(0)
        model, processor = spec.build(text_layers, vision_layers)
        pipe = finish(model, processor, 0, None)  # eval mode, end token 2, pad 0 (the stand-in tokenizer's)
        row = {"family": family, "checkpoint": spec.name, "source": spec.source, "note": spec.note,
               "text_layers": [text_layers, spec.real_text_layers], "vision_layers": [vision_layers, spec.real_vision_layers]}
        image = image_for(spec.image)
    inputs = pipe.prepare_inputs(QUESTION, image)
    row["prompt_tokens"] = int(inputs["input_ids"].shape[1])
    row["params_m"] = round(sum(p.numel() for p in pipe.model.parameters()) / 1e6, 1)
    row["dtype"] = str(next(pipe.model.parameters()).dtype).replace("torch.", "")
    row["build_s"] = round(time.perf_counter() - begin, 1)
    row["load_before"] = [round(x, 2) for x in os.getloadavg()]
    row.update(measure(pipe, image, budget, repeats))
    if profile:
        row["extra_operators"] = extra_operators(pipe, image, budget)
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    row["seconds"] = round(time.perf_counter() - begin, 1)
    del pipe, inputs
    gc.collect()
    return row


def table(rows: list[dict], smoke: bool) -> str:
    """The markdown table of `rows`."""
    lines = ["| family | checkpoint config | layers used (text, vision) | prompt tokens | params | mmgen TTFT ms | "
             "generate TTFT ms | mmgen ms/token | generate ms/token | ratio | same tokens |",
             "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r.get('checkpoint', '')} | fails: {r['error']} |")
            continue
        layers = "tiny" if smoke else f"{r['text_layers'][0]}/{r['text_layers'][1]}, {r['vision_layers'][0]}/{r['vision_layers'][1]}"
        lines.append(f"| {r['family']} | {r['checkpoint']} | {layers} | {r['prompt_tokens']} | {r['params_m']}M | "
                     f"{r['mmgen_ttft_ms']} | {r['generate_ttft_ms']} | {r['mmgen_ms_per_token']} | "
                     f"{r['generate_ms_per_token']} | {r['ratio']}x | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=None, metavar="FAMILY", help=f"default: all ({', '.join(CHECKPOINTS)})")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per family after one warm-up each")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="the tiny test configs instead of the checkpoints' (seconds)")
    p.add_argument("--text-layers", type=int, default=None, help="override every family's text depth")
    p.add_argument("--vision-layers", type=int, default=None, help="override every family's vision depth")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one call of each side: the operators one calls more often than the other")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    families = args.families or list(CHECKPOINTS)
    unknown = [f for f in families if f not in CHECKPOINTS]
    if unknown:
        raise SystemExit(f"unknown family {unknown}; choose from {list(CHECKPOINTS)}")
    if args.repeats < 1 or args.max_new_tokens < 2:
        raise SystemExit("--repeats must be >= 1 and --max-new-tokens >= 2")
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    began = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for family in families:
        try:
            rows.append(bench_family(family, args.max_new_tokens, args.repeats, args.smoke, args.text_layers, args.vision_layers,
                                     args.profile))
        except Exception as error:  # a family that cannot run is reported, not timed
            rows.append({"family": family, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
        print(table(rows[-1:], args.smoke).splitlines()[-1], flush=True)
        for op, (m_ms, m_n, g_ms, g_n) in rows[-1].get("extra_operators", {}).items():
            print(f"    {op}: mmgen {m_ms} ms in {m_n} calls, generate {g_ms} ms in {g_n} calls", flush=True)
    result = {"smoke": args.smoke, "repeats": args.repeats, "load_at_start": load_at_start, "max_new_tokens": args.max_new_tokens, "threads": 1,
              "question": QUESTION, "torch": torch.__version__, "transformers": transformers.__version__,
              "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "seconds": round(time.perf_counter() - began, 1), "load_at_end": [round(x, 2) for x in os.getloadavg()],
              "rows": rows}
    print(table(rows, args.smoke))
    mismatched = [r["family"] for r in rows if r.get("identical") is False]
    if mismatched:
        print(f"different tokens from generate: {mismatched}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
