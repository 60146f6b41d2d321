"""Tiny random VLMs of every family `VLMPipeline` serves, built offline (no downloads): each
family's own transformers model, processor and image processor over a word-level tokenizer.

`BUILDERS[family](seed, std=None, small=False)` returns a `VLMPipeline`; `std` re-draws the
language model's weights with that standard deviation (sharp enough that answers depend on the
positions: a row decoded at the wrong positions gives other tokens), `small` builds the family's
drafter (one layer fewer where there are two, same tokenizer). Images are a few dozen pixels, the
language models 1 to 2 layers of width 32 (16 where the family allows).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from PIL import Image

from mmgen.vlm.pipeline import VLMPipeline
from mmgen.vlm.layout import text_trunk

V = 48
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "USER:", "ASSISTANT:", "what", "is", "this", "a", "cat", "dog", "?",
         "colour", "shape", "red", "blue", "the", "of", "and", "small", "big", "picture"]
QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
PROMPTS = ["what is this ?", "what colour is the small cat and the big dog ?", "shape of this picture ?"]


def word_tokenizer(special: dict, extra_words=(), size: int = V):
    """A whitespace word-level tokenizer over WORDS + `extra_words` (+ fillers up to `size`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [w for w in extra_words if w not in WORDS]
    vocab = {w: i for i, w in enumerate(words + [f"w{i}" for i in range(size - len(words))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return vocab, PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                          unk_token="<unk>", extra_special_tokens=special)


def chat_template(image: str, video: str = "<video>") -> str:
    return ("{% for m in messages %}{{ m['role'].upper() + ': ' }}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
            + image + " {% elif c['type'] == 'video' %}" + video + " {% else %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}"
            "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def text(layers: int = 2, hidden: int = 32, **extra) -> dict:
    """A language model's config fields: `layers` layers of width `hidden`, ids of WORDS."""
    return dict(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def finish(model, processor, seed: int, std) -> VLMPipeline:
    """The pipeline, its language model re-drawn with std `std` when given (seeded)."""
    model = model.eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    if std is not None:
        g = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for p in [*text_trunk(model).parameters(), model.get_input_embeddings().weight, model.lm_head.weight]:
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
    return VLMPipeline(model, processor)


# ------------------------------------------------------------------------------------- families
def tiny_llava(seed: int = 0, any_resolution: bool = False, std=None, small: bool = False, text_model: str = "llama"):
    """A tiny LLaVA-1.5 (CLIP tower + Llama), or with `any_resolution` a LLaVA-NeXT of the same
    sizes whose images are tiled over three grid pinpoints; `text_model="mistral"`: a Mistral
    language model with a sliding window of 8 tokens (llava-v1.6-mistral's layout)."""
    import transformers
    from transformers import CLIPVisionConfig

    family = "LlavaNext" if any_resolution else "Llava"
    vocab, tokenizer = word_tokenizer({"image_token": "<image>"})
    pinpoints = {"image_grid_pinpoints": [[32, 32], [32, 64], [64, 32]]} if any_resolution else {}
    image_processor = getattr(transformers, "LlavaNextImageProcessor" if any_resolution else "CLIPImageProcessor")(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, **pinpoints)
    processor = getattr(transformers, f"{family}Processor")(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chat_template("<image>"))
    torch.manual_seed(seed)
    extra = {"sliding_window": 8} if text_model == "mistral" else {}
    config = getattr(transformers, f"{family}Config")(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                       image_size=32, patch_size=8),
        text_config=dict(model_type=text_model, **text(1 if small else 2, **extra)),
        image_token_index=vocab["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default", **pinpoints)
    model = getattr(transformers, f"{family}ForConditionalGeneration")(config)
    return finish(model, processor, seed, std)


def tiny_llava_next(seed: int = 0, std=None, small: bool = False):
    return tiny_llava(seed, any_resolution=True, std=std, small=small)


def tiny_llava_next_mistral(seed: int = 0, std=None, small: bool = False):
    return tiny_llava(seed, any_resolution=True, std=std, small=small, text_model="mistral")


def tiny_qwen(seed: int = 0, std=None, small: bool = False, version: str = "2_5"):
    """Qwen2.5-VL (`version="2_5"`), Qwen2-VL ("2") or Qwen3-VL ("3"): their vision towers and
    M-RoPE language models, 16-pixel patches merged 2 x 2."""
    import transformers
    from transformers import Qwen2VLImageProcessor

    vocab, tokenizer = word_tokenizer({"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                                       "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>"}, QWEN_TOKENS)
    patch = 8 if version == "3" else 4
    patches = dict(patch_size=patch, temporal_patch_size=2, merge_size=2)
    images_ = Qwen2VLImageProcessor(min_pixels=(4 * patch) ** 2, max_pixels=(8 * patch) ** 2, **patches)
    video_cls = getattr(transformers, "Qwen3VLVideoProcessor" if version == "3" else "Qwen2VLVideoProcessor")
    videos_ = video_cls(min_pixels=(4 * patch) ** 2, max_pixels=(8 * patch) ** 2, **patches)
    name = {"2": "Qwen2VL", "2_5": "Qwen2_5_VL", "3": "Qwen3VL"}[version]
    processor = getattr(transformers, f"{name}Processor")(
        image_processor=images_, video_processor=videos_, tokenizer=tokenizer,
        chat_template=chat_template("<|vision_start|> <|image_pad|> <|vision_end|>", "<|vision_start|> <|video_pad|> <|vision_end|>"))
    torch.manual_seed(seed)
    layers = 1 if small else 2
    if version == "3":
        text_config = text(layers, head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                 "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=patch,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, deepstack_visual_indexes=[0])
    else:
        text_config = text(layers, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=patch, spatial_merge_size=2,
                      temporal_patch_size=2)
        vision.update(dict(out_hidden_size=32, window_size=8, fullatt_block_indexes=[1]) if version == "2_5"
                      else dict(embed_dim=32, mlp_ratio=2))
    config = getattr(transformers, f"{name}Config")(
        text_config=text_config, vision_config=vision, image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"], vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"])
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config)
    return finish(model, processor, seed, std)


def tiny_qwen2(seed: int = 0, std=None, small: bool = False):
    return tiny_qwen(seed, std, small, version="2")


def tiny_qwen3(seed: int = 0, std=None, small: bool = False):
    return tiny_qwen(seed, std, small, version="3")


def idefics3_processor(smolvlm: bool, edge: int, image_seq_len: int) -> tuple[dict, Any]:
    """(vocabulary, processor) of Idefics3, or with `smolvlm` SmolVLM (its video processor too):
    a word-level tokenizer with the family's special tokens, one tile of `edge` pixels (image
    splitting off) read as `image_seq_len` tokens. The PIL image processor: the one a saved
    folder loads as (LANCZOS resizing, which the torchvision one approximates)."""
    import transformers

    special = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>", "global_image_token": "<global-img>",
               "end_of_utterance_token": "<end_of_utterance>"}
    vocab, tokenizer = word_tokenizer(special, ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"])
    name = "SmolVLM" if smolvlm else "Idefics3"
    images_ = getattr(transformers, f"{name}ImageProcessorPil")(do_image_splitting=False, size={"longest_edge": edge},
                                                                max_image_size={"longest_edge": edge})
    videos = {"video_processor": transformers.SmolVLMVideoProcessor()} if smolvlm else {}
    processor = getattr(transformers, f"{name}Processor")(image_processor=images_, tokenizer=tokenizer,
                                                          image_seq_len=image_seq_len, chat_template=chat_template("<image>"),
                                                          **videos)
    return vocab, processor


def tiny_idefics3(seed: int = 0, std=None, small: bool = False, smolvlm: bool = False):
    """Idefics3, or with `smolvlm` SmolVLM (the same layout under its own classes)."""
    import transformers

    vocab, processor = idefics3_processor(smolvlm, edge=32, image_seq_len=4)
    name = "SmolVLM" if smolvlm else "Idefics3"
    torch.manual_seed(seed)
    config = getattr(transformers, f"{name}Config")(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                           patch_size=8),
        text_config=dict(model_type="llama", **text(1 if small else 2)), scale_factor=2, image_token_id=vocab["<image>"])
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config)
    return finish(model, processor, seed, std)


def tiny_smolvlm(seed: int = 0, std=None, small: bool = False):
    return tiny_idefics3(seed, std, small, smolvlm=True)


def tiny_llava_onevision(seed: int = 0, std=None, small: bool = False):
    """LLaVA-OneVision: a SigLIP tower, any-resolution tiles and a Qwen2 language model."""
    from transformers import (LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionImageProcessor,
                              LlavaOnevisionProcessor, LlavaOnevisionVideoProcessor)

    vocab, tokenizer = word_tokenizer({"image_token": "<image>", "video_token": "<video>"}, ["<video>"])
    pinpoints = [[32, 32], [32, 64], [64, 32]]
    processor = LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size={"height": 32, "width": 32}, image_grid_pinpoints=pinpoints),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer,
        num_image_tokens=16, vision_feature_select_strategy="full", chat_template=chat_template("<image>", "<video>"))
    torch.manual_seed(seed)
    config = LlavaOnevisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(model_type="qwen2", **text(1 if small else 2)), image_token_index=vocab["<image>"],
        video_token_index=vocab["<video>"], image_grid_pinpoints=pinpoints, vision_feature_select_strategy="full",
        vision_feature_layer=-1)
    return finish(LlavaOnevisionForConditionalGeneration(config), processor, seed, std)


def tiny_gemma3(seed: int = 0, std=None, small: bool = False):
    """Gemma3: a SigLIP tower pooled to 4 tokens per image, bidirectional attention over each
    image, and a language model of one sliding-window layer (window 8) and one global layer."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessor, Gemma3Processor

    special = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    vocab, tokenizer = word_tokenizer(special, list(special.values()))
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                                image_seq_length=4, chat_template=chat_template("<start_of_image>"))
    torch.manual_seed(seed)
    layers = ["sliding_attention", "full_attention"][: 1 if small else 2]
    config = Gemma3Config(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(model_type="gemma3_text", **text(len(layers), head_dim=16, sliding_window=8, layer_types=layers,
                                                          final_logit_softcapping=3.0)),
        mm_tokens_per_image=4, boi_token_index=vocab["<start_of_image>"], eoi_token_index=vocab["<end_of_image>"],
        image_token_index=vocab["<image_soft_token>"])
    return finish(Gemma3ForConditionalGeneration(config), processor, seed, std)


def tiny_paligemma(seed: int = 0, std=None, small: bool = False, version: int = 1):
    """PaliGemma (a Gemma language model) or with `version=2` PaliGemma 2 (Gemma 2: sliding and
    global layers, soft-capped logits); a SigLIP tower, no chat template (a question is the
    prompt, after its images), its prefix attended bidirectionally."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor, SiglipImageProcessor

    vocab, tokenizer = word_tokenizer({"image_token": "<image>"})
    images_ = SiglipImageProcessor(size={"height": 32, "width": 32})
    images_.image_seq_length = 16
    processor = PaliGemmaProcessor(image_processor=images_, tokenizer=tokenizer)  # adds 1,152 location/segment tokens
    torch.manual_seed(seed)
    size = len(processor.tokenizer)
    if version == 2:
        layers = ["sliding_attention", "full_attention"][: 1 if small else 2]
        language = dict(model_type="gemma2", **text(len(layers), head_dim=16, sliding_window=8, layer_types=layers,
                                                     final_logit_softcapping=3.0))
    else:
        language = dict(model_type="gemma", **text(1 if small else 2, head_dim=16))
    language["vocab_size"] = size
    config = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32),
        text_config=language, image_token_index=vocab["<image>"], projection_dim=32, vocab_size=size)
    return finish(PaliGemmaForConditionalGeneration(config), processor, seed, std)


def tiny_paligemma2(seed: int = 0, std=None, small: bool = False):
    return tiny_paligemma(seed, std, small, version=2)


def tiny_internvl(seed: int = 0, std=None, small: bool = False):
    """InternVL: its own vision tower with pixel shuffle (4 tokens per 32-pixel tile) and a Qwen2
    language model."""
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLForConditionalGeneration, InternVLProcessor
    from transformers import InternVLVideoProcessor

    special = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
               "video_token": "<video>"}
    vocab, tokenizer = word_tokenizer(special, list(special.values()))
    processor = InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": 32, "width": 32}, crop_to_patches=False),
        video_processor=InternVLVideoProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer, image_seq_length=4,
        chat_template=chat_template("<IMG_CONTEXT>"))
    torch.manual_seed(seed)
    config = InternVLConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=[32, 32], patch_size=[8, 8]),
        text_config=dict(model_type="qwen2", **text(1 if small else 2)), image_token_id=vocab["<IMG_CONTEXT>"],
        image_seq_length=4, downsample_ratio=0.5, vision_feature_layer=-1)
    return finish(InternVLForConditionalGeneration(config), processor, seed, std)


def tiny_mistral3(seed: int = 0, std=None, small: bool = False):
    """Mistral3 (Pixtral's tower: 8-pixel patches merged 2 x 2, [IMG_BREAK] per row) and a
    Mistral language model with a sliding window of 8 tokens."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    special = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    vocab, tokenizer = word_tokenizer(special, list(special.values()))
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(size={"longest_edge": 32}, patch_size=8),
                                 tokenizer=tokenizer, patch_size=8, spatial_merge_size=2, chat_template=chat_template("[IMG]"))
    torch.manual_seed(seed)
    config = Mistral3Config(
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8, head_dim=16),
        text_config=dict(model_type="mistral", **text(1 if small else 2, head_dim=16, sliding_window=8)),
        image_token_index=vocab["[IMG]"], spatial_merge_size=2, vision_feature_layer=-1)
    return finish(Mistral3ForConditionalGeneration(config), processor, seed, std)


def tiny_aya_vision(seed: int = 0, std=None, small: bool = False):
    """AyaVision: a SigLIP tower downsampled 2 x 2 and a Cohere2 language model (sliding-window
    and global layers)."""
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration, AyaVisionProcessor, GotOcr2ImageProcessor

    tokens = ["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE_GLOBAL"]
    vocab, tokenizer = word_tokenizer({"image_token": "<image>", **{f"aya_{i}": t for i, t in enumerate(tokens)}}, tokens)
    processor = AyaVisionProcessor(
        image_processor=GotOcr2ImageProcessor(size={"height": 32, "width": 32}, crop_to_patches=False), tokenizer=tokenizer,
        patch_size=8, img_size=32, downsample_factor=2, chat_template=chat_template("<image>"))
    torch.manual_seed(seed)
    layers = ["sliding_attention", "full_attention"][: 1 if small else 2]
    config = AyaVisionConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8),
        text_config=dict(model_type="cohere2", **text(len(layers), sliding_window=8, layer_types=layers)),
        downsample_factor=2, image_token_index=vocab["<|IMG_PATCH|>"], vision_feature_layer=-1)
    return finish(AyaVisionForConditionalGeneration(config), processor, seed, std)


BUILDERS: dict[str, Callable[..., VLMPipeline]] = {
    "llava": tiny_llava, "llava_next": tiny_llava_next, "llava_next_mistral": tiny_llava_next_mistral,
    "qwen2_vl": tiny_qwen2, "qwen2_5_vl": tiny_qwen, "qwen3_vl": tiny_qwen3, "idefics3": tiny_idefics3,
    "smolvlm": tiny_smolvlm, "llava_onevision": tiny_llava_onevision, "gemma3": tiny_gemma3, "paligemma": tiny_paligemma,
    "paligemma2": tiny_paligemma2, "internvl": tiny_internvl, "mistral3": tiny_mistral3, "aya_vision": tiny_aya_vision,
}


def drafter_for(target: VLMPipeline, build: Callable[..., VLMPipeline]) -> VLMPipeline:
    """The family's smaller model (`small`: its language model one layer shorter) holding the
    target's weights where they exist (vision tower, projector, embeddings, the first layer,
    head): a drafter whose drafts the target accepts often but not always."""
    drafter = build(0, small=True)
    mine = drafter.model.state_dict()
    drafter.model.load_state_dict({k: v for k, v in target.model.state_dict().items() if k in mine and v.shape == mine[k].shape},
                                  strict=False)
    return drafter


def images(n: int, sizes=None):
    """`n` random RGB images (seeded by n), 36-44 x 40 pixels, or of the given (w, h) `sizes`."""
    g = torch.Generator().manual_seed(n)
    sizes = sizes or [(40, 36 + 4 * i) for i in range(n)]
    return [Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy()) for w, h in sizes]


def qwen_visionzip_reference(pipe, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """VisionZip's scores of a Qwen vision tower's merged tokens, recomputed outside mmgen: the
    attention each token receives in the tower's last block (eager attention, heads and queries
    averaged, one image / frame group or window at a time), summed per merged token and put in
    the pooled output's row order. Checks that the tower ran once and that the pooled order is
    not the block order (a test of the reordering needs both)."""
    visual, store = pipe.model.model.visual, {}
    hook = visual.blocks[-1].attn.register_forward_pre_hook(lambda m, a, k: store.update(a=a, k=k), with_kwargs=True)
    with torch.no_grad():
        tower = visual(pixel_values, grid_thw=grid_thw)
        hook.remove()
        attn, h = visual.blocks[-1].attn, (store["a"] or (store["k"]["hidden_states"],))[0]
        cu, (cos, sin) = store["k"]["cu_seqlens"], store["k"]["position_embeddings"]
        q, k, _ = attn.qkv(h).reshape(h.shape[0], 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = __import__(type(attn).__module__, fromlist=["x"]).apply_rotary_pos_emb_vision(q, k, cos, sin)
        received = torch.zeros(h.shape[0])
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            logits = torch.einsum("qhd,khd->hqk", q[start:end].float(), k[start:end].float()) * attn.scaling
            received[start:end] = logits.softmax(-1).mean(0).mean(0)
        block_order = received.view(-1, visual.spatial_merge_unit).sum(1)
        merged = visual.merger(tower.last_hidden_state)  # block order
        order = torch.cdist(tower.pooler_output.float(), merged.float()).argmin(1)  # pooled row -> block row
    assert sorted(order.tolist()) == list(range(len(order))) and not torch.equal(order, torch.arange(len(order)))
    return block_order[order]
