"""`LlamaGenText2ImagePipeline`: prompts -> images with LlamaGen's t2i GPT, on the shared core.

The text path is the official one (`language/t5.py`, `autoregressive/sample/sample_t2i.py`):
flan-t5-xl's encoder through transformers' `T5EncoderModel`, captions tokenized to 120 tokens
(padded, truncated, with the closing `</s>`), then left-padded (valid features moved to the
end, padding zeroed) and masked in attention as the official `generate` does.

One departure: the official sampler cleans prompts with a long rule set built on `ftfy` and
BeautifulSoup (URLs, HTML, CJK ranges, punctuation). mmgen lower-cases, strips and collapses
white space, which is what that cleaning does to ordinary prompts; prompts holding URLs,
markup or unusual punctuation may tokenize differently from the official script.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, T5EncoderModel

from mmgen.decoding import Decoder
from mmgen.hub import CheckpointError, PathLike, loading_folder
from mmgen.inference import inference
from mmgen.registry import register_pipeline
from mmgen.sampling import takes_sampling

from mmgen.image_ar.llamagen.gpt import LlamaGenConfig, LlamaGenTransformer
from mmgen.image_ar.llamagen.pipeline import LlamaGenPipelineBase
from mmgen.image_ar.llamagen.token_model import CaptionConditions
from mmgen.image_ar.llamagen.vq import VQConfig, VQModel
from mmgen.image_ar.outputs import ImageGenerationOutput, check_output_type, check_prompts

#: The official `sample_t2i.py` defaults (512 px with VQ-16 and GPT-XL, 120 caption tokens).
OFFICIAL_T2I_SAMPLING = {"guidance_scale": 7.5, "cfg_interval": -1, "temperature": 1.0, "top_k": 1000, "top_p": 1.0}


def normalize_prompt(text: str) -> str:
    """Lower-case, strip and collapse white space (the official cleaning, for ordinary prompts)."""
    return " ".join(text.lower().split())


@register_pipeline
class LlamaGenText2ImagePipeline(LlamaGenPipelineBase):
    """Text-conditional LlamaGen (arXiv 2406.06525): T5 caption features -> GPT -> VQ decoder.

    Sampling defaults are the official `sample_t2i.py` ones (guidance 7.5, top-k 1000, top-p
    1.0, temperature 1.0) unless the pipeline was saved with its own `sampling_defaults`.
    Decoding defaults to lossless speculative Jacobi decoding.
    """

    conditions = "prompt"
    component_types = {
        "transformer": (LlamaGenTransformer, LlamaGenConfig),
        "vq": (VQModel, VQConfig),
        "text_encoder": (T5EncoderModel, None),  # transformers' own save/load
        "tokenizer": (AutoTokenizer, None),
    }
    official_sampling = OFFICIAL_T2I_SAMPLING

    def __init__(
        self,
        transformer: LlamaGenTransformer,
        vq: VQModel,
        text_encoder: T5EncoderModel,
        tokenizer: PreTrainedTokenizerBase,
        sampling_defaults: Optional[dict] = None,
    ):
        if transformer.config.model_type != "t2i":
            raise ValueError("LlamaGenText2ImagePipeline is text-conditional; this transformer is class-conditional")
        if text_encoder.config.d_model != transformer.config.caption_dim:
            raise ValueError(
                f"text encoder width {text_encoder.config.d_model} != transformer caption_dim {transformer.config.caption_dim}"
            )
        super().__init__(transformer, vq, sampling_defaults, text_encoder=text_encoder, tokenizer=tokenizer)

    @property
    def caption_length(self) -> int:
        """Caption tokens per prompt: the rows of the learned null caption (120, as officially)."""
        return self.transformer.cls_embedding.uncond_embedding.shape[0]

    @classmethod
    def from_official(
        cls,
        gpt_checkpoint: PathLike,
        vq_checkpoint: PathLike,
        text_encoder: Union[PathLike, T5EncoderModel] = "google/flan-t5-xl",
        tokenizer: Union[PathLike, PreTrainedTokenizerBase, None] = None,
        gpt_model: Union[str, LlamaGenConfig] = "GPT-XL",
        vq_model: Union[str, VQConfig] = "VQ-16",
        image_size: int = 512,
        codebook_size: int = 16384,
        codebook_embed_dim: int = 8,
    ) -> "LlamaGenText2ImagePipeline":
        """Load the official files (`t2i_XL_stage2_512.pt`, `vq_ds16_t2i.pt`) strictly, and the
        T5 encoder and its tokenizer from a Hugging Face repo id or folder (the tokenizer from
        `text_encoder`'s location unless given). Everything loads in float32; use `.to()`
        (the official sampler runs GPT and T5 in bfloat16).
        """
        transformer, vq = cls.official_models(
            gpt_checkpoint, vq_checkpoint, gpt_model, vq_model, image_size, codebook_size, codebook_embed_dim,
            model_type="t2i", cls_token_num=120,
        )
        if tokenizer is None:
            if isinstance(text_encoder, T5EncoderModel):
                raise ValueError("pass `tokenizer` when `text_encoder` is a model object")
            tokenizer = text_encoder
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
        if not isinstance(text_encoder, T5EncoderModel):
            text_encoder = load_text_encoder(text_encoder)
        return cls(transformer, vq, text_encoder, tokenizer)

    def check_inputs(self, prompt: Union[str, Sequence[str]], image_size: Optional[int]) -> list[str]:
        prompts = check_prompts(prompt)
        self.check_image_size(image_size)
        return list(prompts)

    @inference
    def encode_prompt(self, prompt: Union[str, Sequence[str]]) -> CaptionConditions:
        """Prompts -> left-padded T5 features and mask on the pipeline's device."""
        prompts = [normalize_prompt(p) for p in self.check_inputs(prompt, None)]
        batch = self.tokenizer(
            prompts, max_length=self.caption_length, padding="max_length", truncation=True,
            add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        device = self.text_encoder.device
        mask = batch["attention_mask"].to(device)
        features = self.text_encoder(input_ids=batch["input_ids"].to(device), attention_mask=mask).last_hidden_state
        captions = CaptionConditions.left_padded(features, mask)
        return CaptionConditions(captions.embeddings.to(self.device), captions.mask.to(self.device))

    @takes_sampling
    @inference
    def __call__(
        self,
        prompt: Union[str, Sequence[str]],
        decoding: Union[str, Decoder] = "sjd",
        guidance_scale: Optional[float] = None,
        cfg_interval: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
        image_size: Optional[int] = None,
        output_type: str = "pil",
        batch_size: Optional[int] = None,
        on_image: Optional[Callable[[int, Any, Any], None]] = None,
    ) -> ImageGenerationOutput:
        """Generate one image per prompt.

        Args:
            prompt: a prompt or a list of prompts (non-empty strings).
            decoding: a shortcut of `mmgen.decoding.DECODERS` ("ar", "sjd", "sjd-coupled",
                "gsd", "lantern", "lantern++") or a `Decoder` object (e.g. `SpeculativeJacobi(window=8)`,
                `DraftSpeculative(drafter=small_pipeline)`).
            guidance_scale ... top_p: None takes the pipeline's `sampling_defaults`.
            guidance_scale: classifier-free guidance scale (the null caption); 1.0 turns it off.
            cfg_interval: guide only tokens t <= cfg_interval + 1 (official semantics); -1 = all.
            temperature, top_k, top_p: applied to the guided logits; temperature 0 is greedy,
                top_k 0 and top_p 1.0 disable those filters.
            generator: the source of every random draw; None seeds one from OS entropy. A list
                (one generator per image) decodes each image as a call with it alone would,
                by continuous batching (`generate_each`; needs a fixed-window decoder such as
                "sjd:adapt=false" or "ar").
            image_size: must equal the model's size if given (LlamaGen has one token grid).
            output_type: "pil", "np" (uint8 HWC) or "pt" (float [0, 1] NCHW).
            batch_size: with a list of generators, the most images decoded at once (default
                all); a finished image's row takes the next waiting one.
            on_image: with a list of generators, called as `on_image(i, image, stats)` as soon
                as image i is decoded, with its own `DecodeStats` (the output then keeps tokens
                and the run's stats, not images).
        """
        self.check_inputs(prompt, image_size)
        # Every argument is checked before the text encoder runs.
        check_output_type(output_type)
        sampling = self.sampling_config(guidance_scale, cfg_interval, temperature, top_k, top_p)
        decoder, generator = self.decoder(decoding), self.generator_for(generator, per_output=True)
        return self.generate(self.encode_prompt(prompt), decoder, sampling, generator, output_type, batch_size=batch_size,
                             on_image=on_image)


def load_text_encoder(path_or_repo: PathLike) -> T5EncoderModel:
    """A `T5EncoderModel` in float32 from a folder or repo id; every encoder weight must be in
    the checkpoint (a full T5's decoder weights are ignored, as transformers does)."""
    with loading_folder(path_or_repo):  # no link out of a local folder, sizes within bounds, one-line errors
        model, info = T5EncoderModel.from_pretrained(str(path_or_repo), dtype=torch.float32, output_loading_info=True,
                                                     trust_remote_code=False)
    problems = [f"missing: {k}" for k in info.get("missing_keys", [])] + [
        f"shape mismatch: {m[0] if isinstance(m, tuple) else m}" for m in info.get("mismatched_keys", [])
    ]
    if problems:
        raise CheckpointError(f"{path_or_repo} does not hold a complete T5 encoder: " + ", ".join(sorted(problems)[:25]))
    return model.eval()
