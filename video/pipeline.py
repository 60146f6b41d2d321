"""`BlockDiffusionVideoPipeline`: text-to-video block by block on diffusers' Wan components.

A video of F latent frames is made in blocks of `block_frames` latent frames (CausVid,
Self-Forcing): each block is denoised in a few flow-matching steps by diffusers'
`WanTransformer3DModel` attending to the cached K/V of earlier blocks (`video.model`), then
committed by one clean pass; the VAE (`AutoencoderKLWan`) decodes each block as it is committed
through its causal feature cache (`video.vae`), so frames stream. The prompt is encoded by
transformers' `UMT5EncoderModel` as diffusers' WanPipeline does (states past each prompt's
length zeroed).

    pipe = BlockDiffusionVideoPipeline.from_pretrained(folder)
    out = pipe("cat face moving left", num_frames=17, cache_policy="window:4",
               callback=lambda i, latents, frames: ..., generator=torch.Generator().manual_seed(0))
    write_mp4("cat.mp4", out.frames[0], fps=pipe.fps)

`stream` runs a video for as long as it is read, under a rolling `sink,window` cache (memory
fixed), and takes a new prompt at any time (`video.stream`):

    with pipe.stream("cat face moving left", generator=torch.Generator().manual_seed(0)) as stream:
        for block in stream:              # block.index, block.frames [B, T, H, W, 3] uint8, block.latents
            show(block.frames[0])
            if block.index == 10:
                stream.set_prompt("cat face moving right")  # the next block follows it
            if block.index == 40:
                break
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from transformers import AutoTokenizer, UMT5EncoderModel

from mmgen.cache import CachePolicy
from mmgen.decoding import BlockStats, FlowSchedule
from mmgen.decoding.block_diffusion import BlockRollout
from mmgen.hub import loading_folder
from mmgen.inference import inference, ordinary
from mmgen.pipeline import Companion, Pipeline
from mmgen.registry import register_pipeline
from mmgen.sampling import takes_sampling
from mmgen.video.export import to_uint8
from mmgen.video.model import PromptEmbeddings, RecomputingWanModel, WanBlockModel, check_rotary_table
from mmgen.video.profiler import BlockProfiler, VideoProfile
from mmgen.video.stream import VideoStream
from mmgen.video.vae import (StreamingDecoder, decode_latents, use_onednn_convolutions, use_sum_of_squares_rms_norm,
                             video_frames)

DECODE_MODES = ("block", "end", "none")
#: callback(block index, the block's latents [B, C, f, h, w], its frames [B, T, H, W, 3] uint8 or None)
VideoCallback = Callable[[int, torch.Tensor, Optional[torch.Tensor]], None]


@dataclass
class VideoOutput:
    """`frames` [B, T, H, W, 3] uint8 (None with decode="none"); `latents` [B, C, F, h, w]."""

    frames: Optional[torch.Tensor]
    latents: torch.Tensor
    profile: VideoProfile
    stats: BlockStats
    fps: float


def check_thresholds(cache_threshold: Optional[float], drop_threshold: Optional[float]) -> None:
    for name, value in (("cache_threshold", cache_threshold), ("drop_threshold", drop_threshold)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")


def wan_folder(wan: Union[str, os.PathLike], with_transformer: bool = True) -> Path:
    """The local folder of a diffusers Wan folder or Hub repo; ValueError if a component is missing."""
    from mmgen.hub import resolve_path

    root = resolve_path(wan)
    for name in ("vae", "text_encoder", "tokenizer") + (("transformer",) if with_transformer else ()):
        if not (root / name).is_dir():
            raise ValueError(f"{wan} is not a diffusers Wan folder: {name}/ is missing")
    return root


@register_pipeline
class BlockDiffusionVideoPipeline(Pipeline):
    component_types = {
        "transformer": (WanTransformer3DModel, None),
        "vae": (AutoencoderKLWan, None),
        "text_encoder": (UMT5EncoderModel, None),
        "tokenizer": (AutoTokenizer, None),
    }
    decoder_family = "block-diffusion"
    conditions = "prompt"
    default_decoding = "block"
    companions = {"collaborative": Companion("small", "-small", "a smaller denoiser of the same VAE")}

    def __init__(self, transformer, vae, text_encoder, tokenizer, block_frames: int = 3, num_frames: int = 81,
                 height: int = 480, width: int = 832, fps: float = 16.0, max_sequence_length: int = 512,
                 timesteps: Sequence[float] = (1000.0, 750.0, 500.0, 250.0), shift: float = 5.0,
                 stochastic: bool = True, negative_prompt: str = "", guidance_scale: float = 1.0):
        super().__init__(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)
        # The VAE's CPU fast paths: PyTorch's batch-of-one convolution is several times slower than
        # oneDNN's, and F.normalize's strided vector norm is slow (the same numbers either way).
        use_sum_of_squares_rms_norm(use_onednn_convolutions(vae))
        self.block_frames, self.num_frames, self.height, self.width, self.fps = block_frames, num_frames, height, width, fps
        self.max_sequence_length, self.negative_prompt, self.guidance_scale = max_sequence_length, negative_prompt, guidance_scale
        self.schedule = FlowSchedule(tuple(timesteps), shift, stochastic)

    def pipeline_config(self) -> dict:
        return {"block_frames": self.block_frames, "num_frames": self.num_frames, "height": self.height,
                "width": self.width, "fps": self.fps, "max_sequence_length": self.max_sequence_length,
                "timesteps": list(self.schedule.timesteps), "shift": self.schedule.shift,
                "stochastic": self.schedule.stochastic, "negative_prompt": self.negative_prompt,
                "guidance_scale": self.guidance_scale}

    @classmethod
    def from_wan(cls, wan: Union[str, os.PathLike], transformer: Any = None, **config: Any) -> "BlockDiffusionVideoPipeline":
        """Components from a diffusers Wan folder or Hub repo (`vae/`, `text_encoder/`,
        `tokenizer/`, and `transformer/` unless `transformer` — a module or a folder — is
        given): a causal Wan generator (a converted Self-Forcing / CausVid checkpoint) beside the
        VAE and text encoder it was trained with. `config`: the pipeline settings."""
        root = wan_folder(wan, with_transformer=transformer is None)
        with loading_folder(root):  # no link out of it, sizes within bounds, one-line errors
            if transformer is None:
                transformer = WanTransformer3DModel.from_pretrained(str(root / "transformer"))
            elif isinstance(transformer, (str, os.PathLike)):
                with loading_folder(transformer):
                    transformer = WanTransformer3DModel.from_pretrained(str(transformer))
            return cls(transformer=transformer, vae=AutoencoderKLWan.from_pretrained(str(root / "vae")),
                       text_encoder=UMT5EncoderModel.from_pretrained(str(root / "text_encoder"), trust_remote_code=False),
                       tokenizer=AutoTokenizer.from_pretrained(str(root / "tokenizer"), trust_remote_code=False), **config)

    # ---------------------------------------------------------------- geometry
    @property
    def temporal_ratio(self) -> int:
        return int(self.vae.config.scale_factor_temporal)

    @property
    def spatial_ratio(self) -> int:
        return int(self.vae.config.scale_factor_spatial)

    def latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.temporal_ratio + 1

    def first_frame(self, latent_frame: int) -> int:
        """The first video frame latent frame j decodes to (the first latent is one frame)."""
        return 0 if latent_frame == 0 else self.temporal_ratio * (latent_frame - 1) + 1

    def check_geometry(self, num_frames: int, block_frames: int, height: int, width: int) -> None:
        """ValueError for a video this pipeline cannot make, naming the nearest valid sizes."""
        r, s = self.temporal_ratio, self.spatial_ratio
        if isinstance(block_frames, bool) or not isinstance(block_frames, int) or block_frames < 1:
            raise ValueError(f"block_frames must be an integer >= 1 (latent frames per block), got {block_frames!r}")
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1 or (num_frames - 1) % r:
            raise ValueError(f"num_frames must be 1 + {r}·k (the VAE keeps the first frame and compresses time by {r}), got {num_frames!r}")
        latents = self.latent_frames(num_frames)
        if latents % block_frames:
            lower = (latents // block_frames) * block_frames
            valid = [1 + r * (n - 1) for n in (lower, lower + block_frames) if n > 0]
            raise ValueError(f"num_frames={num_frames} is {latents} latent frames, not a multiple of block_frames={block_frames}: "
                             f"use num_frames {' or '.join(map(str, valid))}")
        p = self.transformer.config.patch_size
        for name, size, patch in (("height", height, p[1]), ("width", width, p[2])):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1 or size % (s * patch):
                raise ValueError(f"{name} must be a positive multiple of {s * patch} (VAE ×{s}, patch {patch}), got {size!r}")

    # ---------------------------------------------------------------- prompts
    def check_prompts(self, prompts: Sequence[str]) -> None:
        """ValueError for a prompt longer than the text encoder reads (`max_sequence_length`
        tokens): it would be cut silently."""
        for prompt in prompts:
            tokens = len(self.tokenizer(prompt, add_special_tokens=True).input_ids)
            if tokens > self.max_sequence_length:
                raise ValueError(f"a prompt of {tokens} tokens ({len(prompt)} characters) is longer than this model reads "
                                 f"(max_sequence_length {self.max_sequence_length} tokens): shorten it")

    @inference
    def encode_prompt(self, prompts: list[str]) -> torch.Tensor:
        """UMT5 states [B, max_sequence_length, D], zero past each prompt's tokens (WanPipeline's)."""
        batch = self.tokenizer(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                               add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        states = self.text_encoder(ids, mask).last_hidden_state
        return states * mask[..., None].to(states.dtype)

    def embeddings(self, prompts: list[str], guided: bool, negative_prompt: str) -> PromptEmbeddings:
        cond = self.encode_prompt(prompts)
        uncond = self.encode_prompt([negative_prompt] * len(prompts)) if guided else None
        return PromptEmbeddings(cond, uncond)

    # ---------------------------------------------------------------- the model
    def block_model(self, like: Any = None, block_frames: Optional[int] = None,
                    latent_size: Optional[tuple[int, int]] = None, cache_policy: Union[str, CachePolicy] = "global",
                    cache_threshold: Optional[float] = None,
                    drop_threshold: Optional[float] = None) -> Union[WanBlockModel, RecomputingWanModel]:
        """The transformer as a `BlockDiffusionModel`; `like` copies another's settings (the
        small model of collaborative denoising follows the large one's). `cache_policy="none"`
        is the no-cache reference (`RecomputingWanModel`: every forward re-feeds the video)."""
        if isinstance(like, RecomputingWanModel):
            return RecomputingWanModel(self.transformer, like.block_frames, like.latent_size)
        if like is not None:  # First Block Cache only where there are later blocks to skip
            threshold = like.cache_threshold if self.transformer.config.num_layers > 1 else None
            return WanBlockModel(self.transformer, like.block_frames, like.latent_size, like.policy, threshold,
                                 like.drop_threshold)
        size = latent_size or (self.height // self.spatial_ratio, self.width // self.spatial_ratio)
        if cache_policy == "none":
            if cache_threshold is not None or drop_threshold is not None:
                raise ValueError("cache_threshold and drop_threshold need the KV cache: not with cache_policy='none'")
            return RecomputingWanModel(self.transformer, block_frames or self.block_frames, size)
        policy = CachePolicy.parse(cache_policy) if isinstance(cache_policy, str) else cache_policy
        return WanBlockModel(self.transformer, block_frames or self.block_frames, size, policy, cache_threshold, drop_threshold)

    def check_companion(self, other: Pipeline, companion: Companion) -> None:
        mine, theirs = self.transformer.config, getattr(other, "transformer", None)
        if theirs is None or (theirs.config.in_channels, theirs.config.patch_size) != (mine.in_channels, mine.patch_size):
            raise ValueError(f"{companion.role}: the small model must denoise the same latents (channels and patches)")
        if other.vae.config.z_dim != self.vae.config.z_dim:
            raise ValueError(f"{companion.role}: the small model's VAE has {other.vae.config.z_dim} latent channels, not {self.vae.config.z_dim}")

    # ---------------------------------------------------------------- call
    @takes_sampling
    @inference
    def __call__(
        self,
        prompt: Union[str, list[str]],
        num_frames: Optional[int] = None,
        block_frames: Optional[int] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        decoding: Any = None,
        cache_policy: Union[str, CachePolicy] = "global",
        guidance_scale: Optional[float] = None,
        negative_prompt: Optional[str] = None,
        prompt_switches: Optional[dict[int, Union[str, list[str]]]] = None,
        decode: str = "block",
        callback: Optional[VideoCallback] = None,
        cache_threshold: Optional[float] = None,
        drop_threshold: Optional[float] = None,
        schedule: Optional[FlowSchedule] = None,
        generator: Optional[torch.Generator] = None,
    ) -> VideoOutput:
        """Make a video of `num_frames` frames for each prompt.

        `cache_policy`: "global", "window:N", "sink:S,window:N" (latent frames), or "none", the
        no-cache reference that recomputes the committed frames at every forward.
        `prompt_switches` {frame: prompt}: from the first block starting at or after that video
        frame, the video follows the new prompt (its cross-attention keys are recomputed; the
        cached frames stay). `decode`: "block" streams each block through the VAE as it is
        committed (and hands its frames to `callback`), "end" decodes once at the end, "none"
        returns latents only. `cache_threshold` turns on First Block Cache for denoising steps
        (0 equals no caching); `drop_threshold` computes, after a block's first step, only the
        tokens whose block input changed by at least it (relative L2; 0 equals no dropping).
        `guidance_scale` defaults to the pipeline's (saved with it), `schedule` (each block's
        noise levels, a `FlowSchedule`) too. `decoding`: "block" (default) or "collaborative"
        with `small=`.
        """
        prompts = self.prompt_list(prompt)
        self.check_no_stream()
        num_frames = self.num_frames if num_frames is None else num_frames
        block_frames = self.block_frames if block_frames is None else block_frames
        height, width = height or self.height, width or self.width
        self.check_geometry(num_frames, block_frames, height, width)
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        check_thresholds(cache_threshold, drop_threshold)
        if cache_policy != "none" and not isinstance(cache_policy, CachePolicy):
            CachePolicy.parse(cache_policy)
        num_blocks = self.latent_frames(num_frames) // block_frames
        switches = self._switch_blocks(prompt_switches or {}, num_frames, num_blocks, block_frames, len(prompts))
        negative = self.negative_prompt if negative_prompt is None else negative_prompt
        self.check_prompts([*prompts, *(p for ps in switches.values() for p in ps), negative])
        decoder = self.decoder(self.default_decoding if decoding is None else decoding)
        model = self.block_model(block_frames=block_frames, latent_size=(height // self.spatial_ratio, width // self.spatial_ratio),
                                 cache_policy=cache_policy, cache_threshold=cache_threshold, drop_threshold=drop_threshold)
        generator = self.generator_for(generator)
        guidance_scale = self.guidance_scale if guidance_scale is None else float(guidance_scale)
        guided = guidance_scale != 1.0
        conditions = self.embeddings(prompts, guided, negative)
        switched = {b: self.embeddings(p, guided, negative) for b, p in switches.items()}

        streaming = StreamingDecoder(self.vae) if decode == "block" else None
        pieces: list[torch.Tensor] = []
        profiler = BlockProfiler(self.device)
        progress = self.progress_bar(num_blocks, desc="blocks")

        def on_block(index: int, latents: torch.Tensor) -> None:
            frames = None
            if streaming is not None:
                frames = to_uint8(streaming.decode(latents))
                pieces.append(frames)
            if callback is not None:
                callback(index, ordinary(latents), ordinary(frames))  # the caller may keep or change them
            profiler.block_done()
            progress.update(1)

        profiler.start()
        try:
            out = decoder.generate(model, conditions, num_blocks, generator, guidance_scale=guidance_scale,
                                   switches=switched, callback=on_block, schedule=self.schedule if schedule is None else schedule)
            latents = torch.cat(out.latents, dim=2)
            frames = torch.cat(pieces, dim=1) if streaming is not None else None
            if decode == "end":
                frames = to_uint8(decode_latents(self.vae, latents))
        except BaseException:
            profiler.close()  # no profile of a failed call; the sampling thread stops
            raise
        finally:
            progress.close()
        profile = profiler.finish(num_frames * len(prompts), cache_bytes=out.stats.cache_bytes)
        return VideoOutput(frames, latents, profile, out.stats, self.fps)

    @inference
    def stream(
        self,
        prompt: Union[str, list[str]],
        block_frames: Optional[int] = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
        decoding: Any = None,
        cache_policy: Union[str, CachePolicy, None] = None,
        guidance_scale: Optional[float] = None,
        negative_prompt: Optional[str] = None,
        cache_threshold: Optional[float] = None,
        drop_threshold: Optional[float] = None,
        generator: Optional[torch.Generator] = None,
    ) -> VideoStream:
        """A video for each prompt that runs block by block for as long as it is read: a
        `VideoStream` of `StreamBlock`s (index, first video frame, frames [B, T, H, W, 3]
        uint8 as `__call__`'s block decode gives them, latents). No frame count: the KV cache
        is a rolling window, `cache_policy` "sink:S,window:N" or "window:N" (latent frames;
        the default `default_stream_policy` keeps the first block as the sink), allocated once,
        so memory stays flat and rotary positions stay below S + N + block.

        `stream.set_prompt(text)` (from any thread) switches the prompt from the next block not
        yet started, as `prompt_switches` does; `close()` (or a `with` block) frees the caches.
        With the same generator, the blocks equal `__call__`'s under the same cache policy
        (prompt switches included). While a stream is open this pipeline makes nothing else.
        The other arguments are `__call__`'s."""
        prompts = self.prompt_list(prompt)
        self.check_no_stream()
        block_frames = self.block_frames if block_frames is None else block_frames
        height, width = height or self.height, width or self.width
        self.check_geometry(video_frames(block_frames, self.temporal_ratio), block_frames, height, width)
        check_thresholds(cache_threshold, drop_threshold)
        policy = self.stream_policy(cache_policy, block_frames)
        held = policy.sink + policy.window
        check_rotary_table(self.transformer.config, held + block_frames, held + block_frames, str(policy), "use a smaller window")
        negative = self.negative_prompt if negative_prompt is None else negative_prompt
        self.check_prompts([*prompts, negative])
        decoder = self.decoder(self.default_decoding if decoding is None else decoding)
        model = self.block_model(block_frames=block_frames, latent_size=(height // self.spatial_ratio, width // self.spatial_ratio),
                                 cache_policy=policy, cache_threshold=cache_threshold, drop_threshold=drop_threshold)
        generator = self.generator_for(generator)
        guidance_scale = self.guidance_scale if guidance_scale is None else float(guidance_scale)
        guided = guidance_scale != 1.0
        conditions = self.embeddings(prompts, guided, negative)
        # Caches for the blocks the window holds: later blocks evict, they never add.
        rollout = BlockRollout(decoder, model, conditions, math.ceil(held / block_frames), generator, guidance_scale,
                               self.schedule)
        stream = VideoStream(self, prompts, rollout, block_frames, guided, negative)
        self._stream = weakref.ref(stream)
        return stream

    def default_stream_policy(self, block_frames: int) -> CachePolicy:
        """A sink of the first block and a window such that the held frames and the new block
        span the pipeline's default video (the context it was made for), at least one block."""
        window = max(block_frames, self.latent_frames(self.num_frames) - 2 * block_frames)
        return CachePolicy(window=window, sink=block_frames)

    def stream_policy(self, cache_policy: Union[str, CachePolicy, None], block_frames: int) -> CachePolicy:
        """The rolling cache of a stream; ValueError for one that would grow with it."""
        if cache_policy is None:
            return self.default_stream_policy(block_frames)
        policy = CachePolicy.parse(cache_policy) if isinstance(cache_policy, str) and cache_policy != "none" else cache_policy
        if not isinstance(policy, CachePolicy) or policy.window is None:
            raise ValueError(f"a stream needs a rolling cache, 'window:N' or 'sink:S,window:N', not {str(cache_policy)!r}: "
                             "it runs unbounded")
        return policy

    def check_no_stream(self) -> None:
        """ValueError while a stream of this pipeline is open: it holds the transformer's
        attention processors (and First Block Cache) between its blocks."""
        stream = getattr(self, "_stream", None)
        stream = stream() if stream is not None else None
        if stream is not None and not stream.closed:
            raise ValueError("a stream of this pipeline is open: close it (stream.close()) before another call")

    def _switch_blocks(self, switches: dict, num_frames: int, num_blocks: int, block_frames: int, batch: int) -> dict[int, list[str]]:
        """{video frame: prompt(s)} -> {block index: prompts}, checked before any work."""
        starts = [self.first_frame(b * block_frames) for b in range(num_blocks)]
        blocks: dict[int, list[str]] = {}
        for frame, prompt in sorted(switches.items()):
            if isinstance(frame, bool) or not isinstance(frame, int) or not 0 <= frame < num_frames:
                raise ValueError(f"prompt switch at frame {frame!r}: the video has frames 0 … {num_frames - 1}")
            block = next((b for b, start in enumerate(starts) if start >= frame), None)
            if block is None:
                raise ValueError(f"prompt switch at frame {frame}: no block starts at or after it (the last block starts at "
                                 f"frame {starts[-1]}; blocks start at frames {starts})")
            blocks[block] = self.batch_prompts(prompt, batch, f"prompt switch at frame {frame}")
        return blocks

    @staticmethod
    def prompt_list(prompt: Union[str, Sequence[str]]) -> list[str]:
        """A call's prompt(s) as a list; ValueError for none or an empty one."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else []
        if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise ValueError("prompt must be a non-empty string or a list of them")
        return prompts

    @staticmethod
    def batch_prompts(prompt: Union[str, Sequence[str]], batch: int, what: str) -> list[str]:
        """A new prompt for a batch of `batch` videos (one for all, or one each); ValueError
        naming `what` (a switch, `set_prompt`) otherwise."""
        prompts = [prompt] * batch if isinstance(prompt, str) else list(prompt) if isinstance(prompt, (list, tuple)) else []
        if len(prompts) != batch or any(not isinstance(p, str) or not p.strip() for p in prompts):
            raise ValueError(f"{what}: give one non-empty prompt, or one per video ({batch})")
        return prompts
