"""`JanusPipeline`: text -> image with Janus-Pro (arXiv 2501.17811) through transformers.

The model and processor are transformers' own (`JanusForConditionalGeneration`,
`JanusProcessor`); mmgen adds the decoding core, so the same checkpoint samples with any
decoder, e.g. lossless speculative Jacobi decoding.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence, Union

import torch

from mmgen.decoding import Decoder
from mmgen.hub import loading_folder
from mmgen.inference import inference
from mmgen.pipeline import Pipeline
from mmgen.registry import register_pipeline
from mmgen.sampling import ConstantGuidance, SamplingConfig, make_generator, takes_sampling

from mmgen.image_ar.janus.token_model import JanusConditions, JanusTokenModel, config_boi_token_id
from mmgen.image_ar.outputs import ImageGenerationOutput, check_output_type, check_prompts, postprocess

#: The transformers port of Janus-Pro 1B (the id its docs and docstrings use).
DEFAULT_REPO = "deepseek-community/Janus-Pro-1B"

#: The official Janus-Pro sampler (`generation_inference.py`): CFG 5, temperature 1, no top-k
#: or top-p; 576 tokens (24 x 24) decoded to 384 px come from the checkpoint's config.
OFFICIAL_SAMPLING = {"guidance_scale": 5.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


@register_pipeline(model_types=("janus",))
class JanusPipeline(Pipeline):
    """Janus-Pro text-to-image: LM over VQ tokens with classifier-free guidance, then the VQ decoder.

    Prompts are formatted as transformers' Janus example does: a one-turn user chat through
    the processor's chat template with the generation prompt (`<|User|>: ...\\n\\n<|Assistant|>:`),
    then `processor(text=..., generation_mode="image")`, which appends the image-start token
    and pads on the left. Decoding defaults to lossless speculative Jacobi decoding, which
    samples the same distribution as `decoding="ar"` in fewer forwards.
    """

    # Components come from transformers, not from mmgen's folder format.
    component_types = {}
    conditions = "prompt"
    default_decoding = "sjd"

    def __init__(self, model, processor):
        super().__init__(model=model)
        self.processor = processor
        vq = model.model.vqmodel.quantize
        grid = vq.quant_state_dims[0] * vq.quant_state_dims[1]
        if self.num_image_tokens != grid:
            raise ValueError(f"config says {self.num_image_tokens} image tokens but the VQ decodes a {vq.quant_state_dims} grid")

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        repo_or_path: Union[str, os.PathLike] = DEFAULT_REPO,
        torch_dtype: Optional[torch.dtype] = None,
        device: Union[str, torch.device, None] = None,
        **kwargs,
    ) -> "JanusPipeline":
        """Load a transformers Janus checkpoint (a Hub id or a local folder) and its processor.

        Extra keyword arguments go to `JanusForConditionalGeneration.from_pretrained`.
        """
        from transformers import JanusForConditionalGeneration, JanusProcessor

        source = os.fspath(repo_or_path)
        kwargs.setdefault("trust_remote_code", False)  # never the folder's own code (`auto_map`)
        try:
            with loading_folder(source):  # no link out of a local folder, sizes within bounds, one-line errors
                processor = JanusProcessor.from_pretrained(source, trust_remote_code=False)
                model = JanusForConditionalGeneration.from_pretrained(source, dtype=torch_dtype, **kwargs)
        except OSError as error:
            offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
            hint = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached or the repo does not exist"
            raise OSError(
                f"could not load Janus from {source!r} ({hint}): {error}. Download it while online, or pass a local folder."
            ) from error
        pipe = cls(model.eval(), processor)
        return pipe.to(device) if device is not None else pipe

    def save_pretrained(self, path: Union[str, os.PathLike]) -> None:
        """Write model and processor in transformers' layout (loadable by `from_pretrained`)."""
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    # ---------------------------------------------------------------- properties
    @property
    def num_image_tokens(self) -> int:
        return self.model.config.vision_config.num_image_tokens

    @property
    def image_size(self) -> int:
        """Pixels per side: the token grid times the VQ decoder's upsampling."""
        vq = self.model.config.vq_config
        return self.model.model.vqmodel.quantize.quant_state_dims[0] * 2 ** (len(vq.channel_multiplier) - 1)

    def token_model(self) -> JanusTokenModel:
        """The LM as the core's `TokenModel`; special ids from the generation config, else the tokenizer."""
        tok, gen = self.processor.tokenizer, self.model.generation_config
        boi = getattr(tok, "boi_token", None)
        return JanusTokenModel(
            self.model,
            pad_token_id=None if gen.pad_token_id is not None else tok.pad_token_id,
            bos_token_id=None if gen.bos_token_id is not None else tok.bos_token_id,
            boi_token_id=None if config_boi_token_id(gen) is not None or boi is None else tok.convert_tokens_to_ids(boi),
        )

    # ---------------------------------------------------------------- generation
    def check_inputs(self, prompt) -> list[str]:
        return check_prompts(prompt)

    def encode_prompt(self, prompts: Sequence[str]) -> JanusConditions:
        """Chat-format and tokenize prompts as transformers' Janus text-to-image example does."""
        if getattr(self.processor, "chat_template", None) is None:
            raise ValueError("the processor has no chat template; Janus prompts are formatted with it")
        texts = [
            self.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}], add_generation_prompt=True)
            for p in prompts
        ]
        inputs = self.processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
        return JanusConditions(inputs["input_ids"].to(self.device), inputs["attention_mask"].to(self.device))

    @takes_sampling
    @inference
    def __call__(
        self,
        prompt: Union[str, Sequence[str]],
        decoding: Union[str, Decoder] = "sjd",
        guidance_scale: float = OFFICIAL_SAMPLING["guidance_scale"],
        temperature: float = OFFICIAL_SAMPLING["temperature"],
        top_k: Optional[int] = None,
        top_p: float = OFFICIAL_SAMPLING["top_p"],
        generator: Optional[torch.Generator] = None,
        output_type: str = "pil",
    ) -> ImageGenerationOutput:
        """Generate one image per prompt.

        Args:
            prompt: a text prompt or a list of them.
            decoding: a shortcut of `mmgen.decoding.DECODERS` ("ar", "sjd", "sjd-coupled",
                "gsd", "lantern", "lantern++") or a `Decoder` object (e.g. `SpeculativeJacobi(window=8)`,
                `DraftSpeculative(drafter=small_pipeline)`).
            guidance_scale: classifier-free guidance u + s (c - u); 1.0 turns it off. Official: 5.
            temperature: applied to the guided logits; 0 is greedy. Official: 1.
            top_k: None or 0 disables it (the official sampler has none).
            top_p: 1.0 disables it.
            generator: the source of every random draw, on the pipeline's device; None seeds
                one from OS entropy.
            output_type: "pil", "np" (uint8 HWC) or "pt" (float [0, 1] NCHW).
        """
        prompts = self.check_inputs(prompt)
        check_output_type(output_type)
        sampling = SamplingConfig(temperature, 0 if top_k is None else top_k, top_p, ConstantGuidance(guidance_scale))
        decoder = self.decoder(decoding)
        device = self.device
        if generator is None:
            generator = make_generator(None, device)
        elif generator.device.type != device.type:
            raise ValueError(f"generator is on {generator.device} but the pipeline runs on {device}: create it there")
        conditions = self.encode_prompt(prompts)
        with self.progress_bar(self.num_image_tokens) as bar:
            result = decoder.generate(self.token_model(), conditions, self.num_image_tokens, sampling, generator, bar)
        return ImageGenerationOutput(self.decode_tokens(result.tokens, output_type), result.tokens, result.stats)

    @inference
    def decode_tokens(self, tokens: torch.Tensor, output_type: str = "pil"):
        """Image tokens [B, num_image_tokens] -> images through the model's VQ decoder."""
        check_output_type(output_type)
        pixels = self.model.decode_image_tokens(tokens).permute(0, 3, 1, 2)  # transformers returns NHWC
        return postprocess(pixels, output_type)
