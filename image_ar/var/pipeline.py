"""`VARPipeline`: class labels -> images by next-scale prediction, with any scale decoder."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence, Union

import torch

from mmgen.decoding import Collaborative, ScaleDecoder
from mmgen.decoding.pruning import CachedTokenPruning
from mmgen.hub import PathLike, load_state_dict, load_strict, resolve_path
from mmgen.inference import inference
from mmgen.pipeline import Companion, Pipeline
from mmgen.registry import register_pipeline
from mmgen.sampling import RampGuidance, SamplingConfig, takes_sampling

from mmgen.image_ar.outputs import (
    ClassLabelled,
    ImageGenerationOutput,
    SamplingDefaults,
    check_image_size,
    check_output_type,
    postprocess,
)
from mmgen.image_ar.var.scale_model import MoreSmooth, VARScaleModel
from mmgen.image_ar.var.transformer import VARConfig, VARTransformer
from mmgen.image_ar.var.vqvae import MultiScaleVQVAE, VQVAEConfig

#: The official sampler settings: `fid` is the README's FID evaluation setting, `demo` the
#: notebook's (`demo_sample.ipynb`). `guidance_scale` is the official `cfg`: the last scale is
#: guided with 1 + cfg (see `RampGuidance`).
VAR_PRESETS: dict[str, dict[str, Any]] = {
    "fid": {"guidance_scale": 1.5, "top_k": 900, "top_p": 0.96, "temperature": 1.0, "more_smooth": False},
    "demo": {"guidance_scale": 4.0, "top_k": 900, "top_p": 0.95, "temperature": 1.0, "more_smooth": False},
}


@register_pipeline
class VARPipeline(ClassLabelled, SamplingDefaults, Pipeline):
    """Class-conditional VAR (Tian et al. 2024, arXiv 2404.02905): a transformer predicts each
    scale's token map from the coarser ones; the multi-scale VQVAE decodes the sum.

    Sampling defaults are the official FID setting (`VAR_PRESETS["fid"]`: cfg 1.5, top-k 900,
    top-p 0.96) unless the pipeline was saved with its own `sampling_defaults`; `preset="demo"`
    picks the notebook's (cfg 4, top-p 0.95).
    """

    component_types = {"transformer": (VARTransformer, VARConfig), "vqvae": (MultiScaleVQVAE, VQVAEConfig)}
    decoder_family = "scale"
    companions = {"collaborative": Companion("small", "-small", "a small model of the same tokenizer")}
    official_sampling = VAR_PRESETS["fid"]

    def __init__(
        self,
        transformer: VARTransformer,
        vqvae: MultiScaleVQVAE,
        class_names: Optional[Sequence[str]] = None,
        sampling_defaults: Optional[dict] = None,
    ):
        self.set_sampling_defaults(sampling_defaults)
        super().__init__(transformer=transformer, vqvae=vqvae)
        VARScaleModel(transformer, vqvae)  # checks that the two match
        self.class_names = self.check_class_names(class_names)

    @property
    def num_classes(self) -> int:
        return self.transformer.config.num_classes

    @property
    def image_size(self) -> int:
        return self.vqvae.config.image_size

    def scale_model(self, pruning: Optional[CachedTokenPruning] = None) -> VARScaleModel:
        """The transformer and VQVAE as the core's `ScaleModel` (what `Collaborative` takes as `small`)."""
        return VARScaleModel(self.transformer, self.vqvae, pruning)

    def sampling_config(self, guidance_scale=None, temperature=None, top_k=None, top_p=None, preset=None) -> SamplingConfig:
        """The `SamplingConfig` for these options; None takes the preset's value, or the
        pipeline's `sampling_defaults` without a preset."""
        base = self.preset(preset)
        given = dict(guidance_scale=guidance_scale, temperature=temperature, top_k=top_k, top_p=top_p)
        o = {k: base[k] if v is None else v for k, v in given.items()}
        steps = len(self.transformer.config.patch_nums)
        return SamplingConfig(o["temperature"], o["top_k"], o["top_p"], RampGuidance(o["guidance_scale"], steps))

    def preset(self, name: Optional[str]) -> dict[str, Any]:
        if name is None:
            return self.sampling_defaults
        if name not in VAR_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(VAR_PRESETS)}")
        return VAR_PRESETS[name]

    @takes_sampling
    @inference
    def __call__(
        self,
        class_labels: Union[int, Sequence[int]],
        decoding: Union[str, ScaleDecoder] = "ar",
        guidance_scale: Optional[float] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        preset: Optional[str] = None,
        more_smooth: Optional[bool] = None,
        pruning: Optional[CachedTokenPruning] = None,
        generator: Optional[torch.Generator] = None,
        image_size: Optional[int] = None,
        output_type: str = "pil",
    ) -> ImageGenerationOutput:
        """Generate one image per class label.

        Args:
            class_labels: class ids in [0, num_classes).
            decoding: "ar" (one forward per scale), "collaborative" / `Collaborative(small=small_pipe,
                large_steps=8)` (CoDe: this model decodes the first scales, a smaller one the rest),
                or any `ScaleDecoder`.
            guidance_scale: the official `cfg`: scale k of n is guided as (1 + t) c - t u with
                t = cfg * k / (n - 1); 0 turns guidance off.
            temperature, top_k, top_p: applied to the guided logits (temperature 0 is greedy; top_k 0
                and top_p 1.0 disable those filters).
            preset: "fid" or "demo" (`VAR_PRESETS`); explicit arguments override it.
            more_smooth: feed Gumbel-softmax soft maps to the next scale (official
                visualisation option; not for FID).
            pruning: FastVAR's cached token pruning, e.g.
                `CachedTokenPruning(keep={-2: 0.6, -1: 0.5})`; None runs every token.
            generator: the source of every random draw; None seeds one from OS entropy.
            image_size: must equal the model's size if given.
            output_type: "pil", "np" (uint8 HWC) or "pt" (float [0, 1] NCHW).
        """
        labels = self.check_class_labels(class_labels)
        check_image_size(image_size, self.image_size)
        check_output_type(output_type)
        sampling = self.sampling_config(guidance_scale, temperature, top_k, top_p, preset)
        smooth = self.preset(preset)["more_smooth"] if more_smooth is None else more_smooth
        decoder = self.decoder(decoding)
        if pruning is not None and isinstance(decoder, Collaborative) and hasattr(decoder.small, "scale_model"):
            # The pruned (largest) scales are the small model's: it prunes them.
            decoder = replace(decoder, small=decoder.small.scale_model(pruning))
        generator = self.generator_for(generator)
        with self.progress_bar(len(self.transformer.config.patch_nums), desc="scales") as bar:
            result = decoder.generate(
                self.scale_model(pruning), torch.tensor(labels, device=self.device), sampling, generator, bar,
                MoreSmooth() if smooth else None,
            )
        images = self.decode_tokens(result.tokens, output_type)
        return ImageGenerationOutput(images, torch.cat(result.tokens, 1), result.stats)

    @inference
    def decode_tokens(self, tokens: Union[torch.Tensor, Sequence[torch.Tensor]], output_type: str = "pil"):
        """Token maps (a list per scale, or all scales concatenated [B, L]) -> images."""
        check_output_type(output_type)
        if isinstance(tokens, torch.Tensor):
            tokens = list(tokens.split(list(self.transformer.config.step_sizes), dim=1))
        return postprocess(self.vqvae.decode(tokens), output_type)

    @classmethod
    def from_official(
        cls,
        var_checkpoint: PathLike,
        vae_checkpoint: PathLike,
        depth: Union[int, VARConfig] = 16,
        image_size: Optional[int] = None,
        vqvae: Optional[VQVAEConfig] = None,
    ) -> "VARPipeline":
        """Load the official `.pth` files (`var_d16.pth`, `vae_ch160v4096z32.pth`) strictly.

        `depth` picks the official preset (16, 20, 24, 30 at 256 px; 36 at 512 px) or is a
        complete config. `vqvae` is the VQVAE's config (default: the official
        `vae_ch160v4096z32`); it takes the transformer's patch_nums. `image_size`, when given,
        must be the size the two generate. Both files load strictly; a transformer and VQVAE
        that do not fit together (vocabulary, channels) are a ValueError.
        """
        if isinstance(depth, VARConfig):
            config = depth
        else:
            if depth not in (16, 20, 24, 30, 36):
                raise ValueError(f"official VAR depths are 16, 20, 24, 30 and 36, got {depth!r}")
            config = VARConfig.from_preset(f"d{depth}")
        if vqvae is not None and not isinstance(vqvae, VQVAEConfig):
            raise ValueError(f"vqvae must be a VQVAEConfig, got {type(vqvae).__name__}")
        vq_config = replace(vqvae or VQVAEConfig(), patch_nums=config.patch_nums)
        if config.num_tokens != sum(p * p for p in config.patch_nums) or (image_size is not None and vq_config.image_size != image_size):
            raise ValueError(f"VAR-d{config.depth} with this VQVAE generates {vq_config.image_size}px images, not {image_size}px")
        transformer = VARTransformer(config)
        vq = MultiScaleVQVAE(vq_config)
        var_path, vae_path = resolve_path(var_checkpoint), resolve_path(vae_checkpoint)
        load_strict(transformer, load_state_dict(var_path), source=str(var_path))
        load_strict(vq, load_state_dict(vae_path), source=str(vae_path))
        return cls(transformer, vq)
