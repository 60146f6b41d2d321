"""`LlamaGenPipeline`: class labels -> images, with any decoder of the core.

`LlamaGenPipelineBase` holds what the class- and text-conditional pipelines share (sampling
defaults, official checkpoint loading, the decode loop, VQ decoding).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import numpy as np
import torch

from mmgen.decoding import Decoder
from mmgen.decoding.base import check_int
from mmgen.decoding.batching import ContinuousServer, Finished, Request, check_continuous, continuous_decode, split_rows
from mmgen.hub import PathLike, load_state_dict, load_strict, resolve_path
from mmgen.inference import inference
from mmgen.pipeline import Companion, Pipeline
from mmgen.registry import register_pipeline
from mmgen.sampling import IntervalGuidance, SamplingConfig, takes_sampling

from mmgen.image_ar.llamagen.gpt import LlamaGenConfig, LlamaGenTransformer
from mmgen.image_ar.llamagen.token_model import LlamaGenTokenModel
from mmgen.image_ar.llamagen.vq import VQ_CONFIGS, VQConfig, VQModel
from mmgen.image_ar.outputs import (
    ClassLabelled,
    ImageGenerationOutput,
    SamplingDefaults,
    check_image_size,
    check_output_type,
    postprocess,
)

#: The official `sample_c2i.py` defaults, used where a pipeline saved none of its own.
OFFICIAL_SAMPLING = {"guidance_scale": 4.0, "cfg_interval": -1, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}

#: Run-time state some official training scripts saved with the weights; never parameters.
OFFICIAL_IGNORED_KEYS = (r"freqs_cis", r"causal_mask", r"layers\.\d+\.attention\.kv_cache\.[kv]_cache")


class LlamaGenPipelineBase(SamplingDefaults, Pipeline):
    """What every LlamaGen pipeline shares: a GPT over VQ tokens, then the VQ decoder.

    A subclass sets `official_sampling` (its official sampler's defaults) and turns its inputs
    into the conditions of `LlamaGenTokenModel`; `generate` does the rest.
    """

    #: The official sampler's defaults, used where a pipeline saved none of its own.
    official_sampling: ClassVar[dict] = OFFICIAL_SAMPLING
    default_decoding = "sjd"  # lossless speculative Jacobi decoding
    compilable = True
    companions = {
        "draft": Companion("drafter", "-draft", "a draft model of the same tokenizer"),
        "entropy-switch": Companion("small", "-draft", "a small model of the same tokenizer"),
    }

    def __init__(self, transformer: LlamaGenTransformer, vq: VQModel, sampling_defaults: Optional[dict] = None, **others: Any):
        if transformer.config.vocab_size != vq.config.codebook_size:
            raise ValueError(
                f"transformer vocabulary {transformer.config.vocab_size} != VQ codebook {vq.config.codebook_size}"
            )
        self.set_sampling_defaults(sampling_defaults)
        super().__init__(transformer=transformer, vq=vq, **others)
        self._compiled_token_models: dict[tuple, LlamaGenTokenModel] = {}

    @property
    def image_size(self) -> int:
        """The size the transformer was trained for: token grid x VQ downsampling."""
        return self.transformer.config.grid_size * self.vq.config.downsample_factor

    def check_image_size(self, image_size: Optional[int]) -> None:
        """None or the model's own size (LlamaGen has one token grid); ValueError otherwise."""
        grid = self.transformer.config.grid_size
        check_image_size(image_size, self.image_size, f" ({grid}x{grid} tokens)")

    def token_model(self, official_attention: Optional[bool] = None) -> LlamaGenTokenModel:
        """The GPT as the core's `TokenModel`, with the VQ codebook for relaxed acceptance.
        `official_attention`: see `LlamaGenTokenModel` (None: on for bfloat16/float16 weights).

        After `compile()` the token model is compiled and kept for later calls (one per
        attention setting, device and dtype), so its graphs and pooled caches are reused."""
        codebook = self.vq.quantize.codebook()
        if not self.compile_steps:
            model = LlamaGenTokenModel(self.transformer, codebook=codebook, official_attention=official_attention)
        else:
            weight = self.transformer.tok_embeddings.weight
            key = (official_attention, weight.device, weight.dtype)
            if key not in self._compiled_token_models:
                # Models of another device or dtype hold pooled caches nothing will read again.
                self._compiled_token_models = {k: m for k, m in self._compiled_token_models.items() if k[1:] == key[1:]}
                self._compiled_token_models[key] = LlamaGenTokenModel(
                    self.transformer, codebook=codebook, official_attention=official_attention, compile=True)
            model = self._compiled_token_models[key]
        # The adaptive window's measured costs and tokens per forward (`Pipeline.window_cost`, `.window_tokens`).
        model.window_cost, model.window_tokens = self.window_cost, self.window_tokens
        return model

    def sampling_config(
        self,
        guidance_scale: Optional[float] = None,
        cfg_interval: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
    ) -> SamplingConfig:
        """The `SamplingConfig` for these options; None takes the pipeline's `sampling_defaults`."""
        given = dict(guidance_scale=guidance_scale, cfg_interval=cfg_interval, temperature=temperature, top_k=top_k, top_p=top_p)
        o = {k: self.sampling_defaults[k] if v is None else v for k, v in given.items()}
        if isinstance(o["cfg_interval"], bool) or not isinstance(o["cfg_interval"], int):
            raise ValueError(f"cfg_interval must be an integer (-1 disables it), got {o['cfg_interval']!r}")
        return SamplingConfig(o["temperature"], o["top_k"], o["top_p"], IntervalGuidance(o["guidance_scale"], o["cfg_interval"]))

    def generate(
        self,
        conditions: Any,
        decoding: Union[str, Decoder],
        sampling: SamplingConfig,
        generator: Union[torch.Generator, Sequence[torch.Generator], None],
        output_type: str,
        official_attention: Optional[bool] = None,
        batch_size: Optional[int] = None,
        on_image: Optional[Callable[[int, Any, Any], None]] = None,
    ) -> ImageGenerationOutput:
        """Decode one image per condition row with `decoding`, then run the VQ decoder. With a
        list of generators (one per row), continuous batching: see `generate_each`."""
        check_output_type(output_type)
        decoder = self.decoder(decoding)
        generator = self.generator_for(generator, per_output=True)
        if isinstance(generator, list):
            return self.generate_each(conditions, decoder, sampling, generator, output_type, official_attention, batch_size, on_image)
        if batch_size is not None or on_image is not None:
            raise ValueError("batch_size and on_image come with a list of generators, one per image (continuous batching)")
        model = self.token_model(official_attention)
        num_tokens = self.transformer.config.block_size
        with self.progress_bar(num_tokens) as bar:
            result = decoder.generate(model, conditions, num_tokens, sampling, generator, bar)
        return ImageGenerationOutput(self.decode_tokens(result.tokens, output_type), result.tokens, result.stats)

    def generate_each(
        self,
        conditions: Any,
        decoding: Union[str, Decoder],
        sampling: SamplingConfig,
        generators: Sequence[torch.Generator],
        output_type: str = "pil",
        official_attention: Optional[bool] = None,
        batch_size: Optional[int] = None,
        on_image: Optional[Callable[[int, Any, Any], None]] = None,
    ) -> ImageGenerationOutput:
        """One image per condition row, each from its own generator, by continuous batching
        (`mmgen.decoding.batching`): at most `batch_size` rows decode at once (default: all)
        and a finished row takes the next waiting one. Image i is the image a call with
        condition row i alone and `generators[i]` makes (under the adaptive window, a call with
        `row_decoder(decoding, batch_size)`: rows judge widths at what they cost the batch). `on_image(i, image, stats)` receives each image as soon as it is decoded,
        with its own stats (those of a batch-1 decode); the output then holds no images (a long
        run keeps none in memory), only tokens and the run's stats."""
        decoder = self.decoder(decoding)
        rows = split_rows(conditions)
        if len(generators) != len(rows):
            raise ValueError(f"{len(generators)} generators for {len(rows)} images: give one generator per image")
        check_continuous(decoder)
        model = self.token_model(official_attention)
        requests = [Request(row, g) for row, g in zip(rows, self.generator_for(list(generators), per_output=True))]
        tokens: list = [None] * len(requests)
        images: list = [None] * len(requests)
        with self.progress_bar(len(requests), desc="images") as bar:

            def finished(result: Finished) -> None:
                tokens[result.index] = result.checked().tokens
                image = self.decode_tokens(result.tokens[None], output_type)[0]
                if on_image is not None:
                    on_image(result.index, image, result.stats)
                else:
                    images[result.index] = image
                bar.update(1)

            _, stats = continuous_decode(decoder, model, requests, self.transformer.config.block_size, sampling,
                                         len(requests) if batch_size is None else batch_size, on_finish=finished)
        tokens = torch.stack(tokens)
        if on_image is not None:
            return ImageGenerationOutput([], tokens, stats)
        if output_type == "pil":
            return ImageGenerationOutput(images, tokens, stats)
        return ImageGenerationOutput(torch.stack(images) if output_type == "pt" else np.stack(images), tokens, stats)

    def serve(self, decoding: Union[str, Decoder], sampling: SamplingConfig, batch_size: int, output_type: str = "pil",
              lock: Any = None, official_attention: Optional[bool] = None) -> ContinuousServer:
        """A `ContinuousServer` for requests from many threads (a demo's queue): `submit(Request(
        conditions_row, generator))` returns a future of `(image, stats)`, the image being the
        one a call with that row alone and that generator makes (under the adaptive window, with
        `row_decoder(decoding, batch_size)`); requests that overlap in time share one
        continuous batch of up to `batch_size` rows. `lock` (a context manager) is
        held while the batch decodes, to keep other users of this pipeline off it."""
        decoder = self.decoder(decoding)
        check_continuous(decoder)
        check_output_type(output_type)
        check_int("batch_size", batch_size, 1)
        num_tokens = self.transformer.config.block_size

        def decode(queue) -> None:
            continuous_decode(decoder, self.token_model(official_attention), queue, num_tokens, sampling, batch_size)

        def result(done: Finished) -> tuple[Any, Any]:  # a masked request's error goes to its caller alone
            return self.decode_tokens(done.checked().tokens[None], output_type)[0], done.stats

        return ContinuousServer(decode, result, lock)

    @inference
    def decode_tokens(self, tokens: torch.Tensor, output_type: str = "pil"):
        """Image tokens [B, grid * grid] -> images through the VQ decoder."""
        check_output_type(output_type)
        grid = self.transformer.config.grid_size
        pixels = self.vq.decode_code(tokens, (tokens.shape[0], self.vq.config.codebook_embed_dim, grid, grid))
        return postprocess(pixels, output_type)

    @staticmethod
    def official_models(
        gpt_checkpoint: PathLike,
        vq_checkpoint: PathLike,
        gpt_model: Union[str, LlamaGenConfig],
        vq_model: Union[str, VQConfig],
        image_size: int,
        codebook_size: int,
        codebook_embed_dim: int,
        **gpt_options: Any,
    ) -> tuple[LlamaGenTransformer, VQModel]:
        """Build the GPT and the VQ from official preset names (the other arguments fill in the
        official command-line flags; `gpt_options` e.g. num_classes, cls_token_num, model_type)
        or complete configs, and load the official `.pt` files into them strictly."""
        if isinstance(vq_model, str):
            if vq_model not in VQ_CONFIGS:
                raise ValueError(f"unknown VQ model {vq_model!r}; choose from {sorted(VQ_CONFIGS)}")
            vq_model = VQConfig.from_dict(
                {**VQ_CONFIGS[vq_model].to_dict(), "codebook_size": codebook_size, "codebook_embed_dim": codebook_embed_dim}
            )
        if isinstance(gpt_model, str):
            factor = vq_model.downsample_factor
            if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size <= 0 or image_size % factor:
                raise ValueError(f"image_size {image_size!r} must be a positive multiple of {factor}")
            grid = image_size // factor
            gpt_model = LlamaGenConfig.from_preset(gpt_model, vocab_size=vq_model.codebook_size, block_size=grid * grid, **gpt_options)
        transformer, vq = LlamaGenTransformer(gpt_model), VQModel(vq_model)
        gpt_path, vq_path = resolve_path(gpt_checkpoint), resolve_path(vq_checkpoint)
        load_strict(transformer, load_state_dict(gpt_path), ignore=OFFICIAL_IGNORED_KEYS, source=str(gpt_path))
        load_strict(vq, load_state_dict(vq_path), source=str(vq_path))
        return transformer, vq


@register_pipeline
class LlamaGenPipeline(ClassLabelled, LlamaGenPipelineBase):
    """Class-conditional LlamaGen (arXiv 2406.06525): GPT over VQ tokens, then the VQ decoder.

    Sampling defaults are the official `sample_c2i.py` ones (guidance 4.0, top-k 2000, top-p
    1.0, temperature 1.0) unless the pipeline was saved with its own `sampling_defaults`.
    Decoding defaults to lossless speculative Jacobi decoding, which samples the same
    distribution as `decoding="ar"` in fewer forwards.
    """

    component_types = {"transformer": (LlamaGenTransformer, LlamaGenConfig), "vq": (VQModel, VQConfig)}
    official_sampling = OFFICIAL_SAMPLING

    def calibration_calls(self, count: int) -> list[Callable[[str], Any]]:
        """Class ids spread over the classes, one seed each (see `Pipeline.calibration_calls`)."""
        return [lambda spec, i=i: self([i * self.num_classes // count], decoding=spec,
                                       generator=torch.Generator().manual_seed(i))
                for i in range(count)]

    def __init__(
        self,
        transformer: LlamaGenTransformer,
        vq: VQModel,
        class_names: Optional[Sequence[str]] = None,
        sampling_defaults: Optional[dict] = None,
    ):
        if transformer.config.model_type != "c2i":
            raise ValueError("LlamaGenPipeline is class-conditional; this transformer is text-conditional")
        super().__init__(transformer, vq, sampling_defaults)
        self.class_names = self.check_class_names(class_names)

    @property
    def num_classes(self) -> int:
        return self.transformer.config.num_classes

    @classmethod
    def from_official(
        cls,
        gpt_checkpoint: PathLike,
        vq_checkpoint: PathLike,
        gpt_model: Union[str, LlamaGenConfig] = "GPT-B",
        vq_model: Union[str, VQConfig] = "VQ-16",
        image_size: int = 256,
        codebook_size: int = 16384,
        codebook_embed_dim: int = 8,
        num_classes: int = 1000,
    ) -> "LlamaGenPipeline":
        """Load the official `.pt` files (`c2i_B_256.pt`, `vq_ds16_c2i.pt`, ...) strictly.

        `gpt_model` / `vq_model` are official preset names (then the other arguments fill in
        the official command-line flags) or complete config objects.
        """
        transformer, vq = cls.official_models(
            gpt_checkpoint, vq_checkpoint, gpt_model, vq_model, image_size, codebook_size, codebook_embed_dim,
            num_classes=num_classes, cls_token_num=1,
        )
        return cls(transformer, vq)

    def check_inputs(self, class_labels, image_size: Optional[int]) -> list[int]:
        labels = self.check_class_labels(class_labels)
        self.check_image_size(image_size)
        return labels

    @takes_sampling
    @inference
    def __call__(
        self,
        class_labels: Union[int, Sequence[int]],
        decoding: Union[str, Decoder] = "sjd",
        guidance_scale: Optional[float] = None,
        cfg_interval: Optional[int] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        generator: Union[torch.Generator, Sequence[torch.Generator], None] = None,
        image_size: Optional[int] = None,
        output_type: str = "pil",
        official_attention: Optional[bool] = None,
        batch_size: Optional[int] = None,
        on_image: Optional[Callable[[int, Any, Any], None]] = None,
    ) -> ImageGenerationOutput:
        """Generate one image per class label.

        Args:
            class_labels: class ids in [0, num_classes).
            decoding: a shortcut of `mmgen.decoding.DECODERS` ("ar", "sjd", "sjd-coupled",
                "gsd", "lantern", "lantern++", "draft", "lookup", "entropy-switch"), a spec with
                options ("sjd:window=8") or a `Decoder` object (e.g. `SpeculativeJacobi(window=8)`);
                "draft" and "entropy-switch" need their second model as an object
                (`DraftSpeculative(drafter=small_pipeline)`, `EntropySwitch(small=small_pipeline)`).
            guidance_scale ... top_p: None takes the pipeline's `sampling_defaults`.
            guidance_scale: classifier-free guidance scale; 1.0 turns guidance off.
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
            official_attention: run the decoding forwards' attention on SDPA's math backend,
                as the official sampler does; None (default) does so for bfloat16/float16
                weights only, where it makes greedy outputs match the official ones (float32
                keeps the default backend). See `LlamaGenTokenModel`.
        """
        labels = self.check_inputs(class_labels, image_size)
        check_output_type(output_type)
        sampling = self.sampling_config(guidance_scale, cfg_interval, temperature, top_k, top_p)
        conditions = torch.tensor(labels, device=self.device)
        return self.generate(conditions, decoding, sampling, generator, output_type, official_attention, batch_size, on_image)
