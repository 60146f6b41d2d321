"""`MARPipeline`: class labels -> images by masked generation of continuous tokens."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Union

import torch

from mmgen.decoding import ContinuousDecoder, ContinuousSpeculative
from mmgen.hub import CheckpointError, PathLike, load_state_dict, load_strict, resolve_path
from mmgen.inference import inference
from mmgen.pipeline import Companion, Pipeline
from mmgen.registry import register_pipeline
from mmgen.sampling import ConstantGuidance, LinearProgressGuidance, SamplingConfig, takes_sampling

from mmgen.image_ar.mar.continuous_model import MARContinuousModel
from mmgen.image_ar.mar.mar import MAR, MARConfig
from mmgen.image_ar.mar.vae import OFFICIAL_IGNORED_KEYS, KLVAE, KLVAEConfig
from mmgen.image_ar.outputs import ClassLabelled, ImageGenerationOutput, SamplingDefaults, check_output_type, postprocess

#: The official sampler's defaults (`main_mar.py`; the README evaluates with 256 iterations,
#: 64 is its faster setting); `from_official` sets each size's evaluation guidance.
OFFICIAL_SAMPLING = {"num_iter": 64, "guidance_scale": 3.0, "cfg_schedule": "linear", "temperature": 1.0}
#: The README's evaluation guidance per model size.
OFFICIAL_GUIDANCE = {"mar_base": 2.9, "mar_large": 3.0, "mar_huge": 3.2}


@register_pipeline
class MARPipeline(ClassLabelled, SamplingDefaults, Pipeline):
    """Class-conditional MAR (Li et al. 2024, arXiv 2406.11838): continuous tokens revealed in a
    random order over `num_iter` masked steps, each sampled by the diffusion head, then the KL-16
    VAE decoder.

    `decoding="ar"` is the official sampler. `decoding=ContinuousSpeculative(drafter=small_pipe)`
    (or "cspd:drafter=...") is continuous speculative decoding; both models then sample the head's
    last step with its own variance, which the density ratio needs (see `MARContinuousModel`).
    """

    component_types = {"transformer": (MAR, MARConfig), "vae": (KLVAE, KLVAEConfig)}
    decoder_family = "continuous"
    companions = {"cspd": Companion("drafter", "-draft", "a draft model of the same tokenizer")}
    decoder_settings = {"num_iter": "num_steps"}  # masked steps
    official_sampling = OFFICIAL_SAMPLING

    def __init__(self, transformer: MAR, vae: KLVAE, class_names: Optional[Sequence[str]] = None,
                 sampling_defaults: Optional[dict] = None):
        self.set_sampling_defaults(sampling_defaults)
        if vae.config.embed_dim != transformer.config.vae_embed_dim or transformer.config.vae_stride != vae.config.downsample:
            raise ValueError(
                f"MAR expects {transformer.config.vae_embed_dim}-channel latents at stride {transformer.config.vae_stride}; "
                f"the VAE gives {vae.config.embed_dim} channels at stride {vae.config.downsample}"
            )
        super().__init__(transformer=transformer, vae=vae)
        self.class_names = self.check_class_names(class_names)

    @property
    def num_classes(self) -> int:
        return self.transformer.config.class_num

    @property
    def image_size(self) -> int:
        return self.transformer.config.img_size

    def continuous_model(self, stochastic_last_step: bool = True) -> MARContinuousModel:
        """The transformer as the core's `ContinuousModel` (what `ContinuousSpeculative` takes
        as a drafter); by default with the stochastic last head step that CSpD needs. Decoders
        that set no `num_steps` run the pipeline's `num_iter`."""
        return MARContinuousModel(self.transformer, stochastic_last_step, self.sampling_defaults["num_iter"])

    def sampling_config(self, guidance_scale=None, cfg_schedule=None, temperature=None) -> SamplingConfig:
        o = {k: self.sampling_defaults[k] if v is None else v
             for k, v in dict(guidance_scale=guidance_scale, cfg_schedule=cfg_schedule, temperature=temperature).items()}
        if o["cfg_schedule"] not in ("linear", "constant"):
            raise ValueError(f"cfg_schedule must be 'linear' or 'constant', got {o['cfg_schedule']!r}")
        if o["guidance_scale"] < 1.0:
            raise ValueError(f"guidance_scale must be >= 1 (1 turns guidance off), got {o['guidance_scale']}")
        guidance = (LinearProgressGuidance(o["guidance_scale"], self.transformer.seq_len) if o["cfg_schedule"] == "linear"
                    else ConstantGuidance(o["guidance_scale"]))
        return SamplingConfig(temperature=o["temperature"], guidance=guidance)

    @takes_sampling
    @inference
    def __call__(
        self,
        class_labels: Union[int, Sequence[int]],
        decoding: Union[str, ContinuousDecoder] = "ar",
        num_iter: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        cfg_schedule: Optional[str] = None,
        temperature: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
        output_type: str = "pil",
    ) -> ImageGenerationOutput:
        """Generate one image per class label.

        Args:
            class_labels: class ids in [0, num_classes).
            decoding: "ar" (the official sampler), "cspd" / `ContinuousSpeculative(drafter=...)`,
                or any `ContinuousDecoder`.
            num_iter: masked steps; overrides the decoder's `num_steps`. Default: the decoder's
                `num_steps` when it sets one ("ar:num_steps=8", `MaskedContinuous(num_steps=8)`),
                else the pipeline's (officially 64; the README evaluates with 256), for shortcuts
                and decoder objects alike.
            guidance_scale: CFG scale (>= 1), schedule "linear" (grows with the known tokens) or "constant".
            temperature: scales the head's noise.
            generator: the source of every random draw; None seeds one from OS entropy.
            output_type: "pil", "np" (uint8 HWC) or "pt" (float [0, 1] NCHW).
        """
        labels = self.check_class_labels(class_labels)
        check_output_type(output_type)
        sampling = self.sampling_config(guidance_scale, cfg_schedule, temperature)
        decoder = self.decoder(decoding)
        if num_iter is not None:
            decoder = replace(decoder, num_steps=num_iter)
        model = self.continuous_model(stochastic_last_step=isinstance(decoder, ContinuousSpeculative))
        with self.progress_bar(model.num_tokens, desc="tokens") as bar:
            result = decoder.generate(_CanvasProgress(model, bar), torch.tensor(labels, device=self.device), sampling,
                                      self.generator_for(generator))
            bar.update(bar.total - bar.n)
        return ImageGenerationOutput(self.decode_tokens(result.tokens, output_type), result.tokens, result.stats)

    @inference
    def decode_tokens(self, tokens: torch.Tensor, output_type: str = "pil"):
        """Token latents [B, seq_len, D] -> images through the VAE decoder (latents / its
        scaling factor, officially 0.2325)."""
        check_output_type(output_type)
        latents = self.transformer.unpatchify(tokens) / self.vae.config.scaling_factor
        return postprocess(self.vae.decode(latents.to(self.vae.post_quant_conv.weight.dtype)), output_type)

    @classmethod
    def from_official(cls, mar_checkpoint: PathLike, vae_checkpoint: PathLike,
                      model: Union[str, MARConfig] = "mar_base", vae: Optional[KLVAEConfig] = None) -> "MARPipeline":
        """Load the official `checkpoint-last.pth` (its `model_ema` weights, as the official
        evaluation uses) and `kl16.ckpt` strictly. `model` is an official preset name
        ("mar_base", "mar_large", "mar_huge", with the README's DiffLoss sizes and guidance)
        or a complete config."""
        config = MARConfig.from_preset(model) if isinstance(model, str) else model
        transformer, autoencoder = MAR(config), KLVAE(vae)
        mar_path, vae_path = resolve_path(mar_checkpoint), resolve_path(vae_checkpoint)
        load_strict(transformer, ema_weights(mar_path), source=str(mar_path))
        load_strict(autoencoder, load_state_dict(vae_path), ignore=OFFICIAL_IGNORED_KEYS, source=str(vae_path))
        defaults = {"guidance_scale": OFFICIAL_GUIDANCE[model]} if isinstance(model, str) else None
        return cls(transformer.eval(), autoencoder.eval(), sampling_defaults=defaults)


class _CanvasProgress:
    """The target `ContinuousModel` as the decoder sees it, advancing a progress bar by the tokens
    every row knows whenever the decoder runs the backbone (continuous decoders take no
    progress object; the first B rows of a state are the committed canvas, also when the
    target verifies several drafted canvases at once)."""

    def __init__(self, model: MARContinuousModel, bar):
        self.model, self.bar, self.rows = model, bar, 0

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def start(self, conditions: torch.Tensor, guidance: bool):
        state = self.model.start(conditions, guidance)
        self.rows = state.tokens.shape[0]
        return state

    def head_inputs(self, state, positions: torch.Tensor):
        if not self.bar.disable:
            known = int(state.known[: self.rows].sum(1).min())  # one host sync per backbone forward
            if known > self.bar.n:
                self.bar.update(known - self.bar.n)
        return self.model.head_inputs(state, positions)


def ema_weights(path) -> dict:
    """The `model_ema` weights of an official training checkpoint (what the official evaluation
    samples with); a flat state dict (a safetensors export) as it is."""
    try:
        return load_state_dict(path, key="model_ema")
    except CheckpointError as error:
        if "has no key" not in str(error) and "not a state dict" not in str(error):
            raise
        return load_state_dict(path)
