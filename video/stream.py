"""`VideoStream`: a block-diffusion video that runs for as long as it is read, and can be steered.

`BlockDiffusionVideoPipeline.stream` opens one. Each `next()` makes one block (the core's
`BlockRollout` step, the loop `__call__` runs), decodes it through the VAE's streaming cache and
returns it as a `StreamBlock`; nothing runs between reads. The KV cache is a rolling
`sink,window` one, allocated once, so memory stays flat however long the stream runs, and the
rotary positions stay below sink + window + block. `set_prompt` (from any thread) conditions
the next block not yet started, as `prompt_switches` does; `close()` (or leaving a `with`
block) frees the caches and gives the transformer its own attention processors back.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from mmgen.decoding.block_diffusion import BlockRollout
from mmgen.inference import inference
from mmgen.video.export import to_uint8
from mmgen.video.vae import StreamingDecoder

if TYPE_CHECKING:
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline


@dataclass
class StreamBlock:
    """One committed block: `frames` [B, T, H, W, 3] uint8 starting at video frame
    `first_frame` (T = 4·block_frames with Wan's VAE, less 3 in the first block: the first
    latent frame decodes to one frame); `latents` [B, C, block_frames, h, w]; `prompts` the
    block followed."""

    index: int
    first_frame: int
    frames: torch.Tensor
    latents: torch.Tensor
    prompts: list[str]


class VideoStream:
    """Blocks of one video, made as they are read (see the module docstring). Iterate it, or
    call `next()`; after `close()` iteration stops. Made by `BlockDiffusionVideoPipeline.stream`."""

    def __init__(self, pipe: "BlockDiffusionVideoPipeline", prompts: list[str], rollout: BlockRollout,
                 block_frames: int, guided: bool, negative_prompt: str):
        self.pipe, self.prompts, self.block_frames = pipe, prompts, block_frames
        self.guided, self.negative_prompt = guided, negative_prompt
        self.blocks = 0  # blocks made so far
        self.stats = rollout.stats  # the decode's `BlockStats` (forwards per role, blocks, cache bytes at the start)
        self._rollout: Optional[BlockRollout] = rollout
        self._vae: Optional[StreamingDecoder] = StreamingDecoder(pipe.vae)
        self._pending: Optional[tuple[list[str], Any]] = None  # a prompt set for the next block
        self._running = threading.Lock()  # held while a block is made; `close` waits for it
        self._prompt_lock = threading.Lock()
        # Dropped without `close`: the models still give back what they installed.
        self._finalizer = weakref.finalize(self, rollout.close)

    @property
    def closed(self) -> bool:
        return self._rollout is None

    @property
    def cache_bytes(self) -> int:
        """Bytes the stream's caches hold now: the models' KV caches and the VAE's feature cache."""
        rollout, vae = self._rollout, self._vae
        return 0 if rollout is None or vae is None else rollout.cache_bytes + vae.nbytes

    def set_prompt(self, prompt: Union[str, Sequence[str]]) -> None:
        """From the next block not yet started on, follow `prompt` (one, or one per video of the
        batch); its cross-attention keys are recomputed and the cached frames stay, as with
        `prompt_switches`. Checked and encoded here, in the caller's thread (ValueError)."""
        if self.closed:
            raise ValueError("the stream is closed: open a new one with pipe.stream(...)")
        prompts = self.pipe.batch_prompts(prompt, len(self.prompts), "set_prompt")
        with self._prompt_lock, torch.inference_mode():  # one at a time: the tokenizer is not thread-safe
            self.pipe.check_prompts(prompts)
            self._pending = (prompts, self.pipe.embeddings(prompts, self.guided, self.negative_prompt))  # the last one wins

    def __iter__(self) -> "VideoStream":
        return self

    @inference
    def __next__(self) -> StreamBlock:
        with self._running:
            rollout, vae = self._rollout, self._vae
            if rollout is None or vae is None:
                raise StopIteration
            with self._prompt_lock:
                pending, self._pending = self._pending, None
            try:
                if pending is not None:
                    self.prompts = pending[0]
                latents = rollout.step(None if pending is None else pending[1])
                frames = to_uint8(vae.decode(latents))
            except BaseException:  # a block cut short leaves the cache half-written: the stream ends
                self._release()
                raise
            index, self.blocks = self.blocks, self.blocks + 1
            return StreamBlock(index, self.pipe.first_frame(index * self.block_frames), frames, latents, list(self.prompts))

    def close(self) -> None:
        """Free the caches and restore the transformer's processors (waits for a running block)."""
        with self._running:
            self._release()

    def _release(self) -> None:
        self._rollout, self._vae, self._pending = None, None, None
        self._finalizer()  # the rollout's close, once

    def __enter__(self) -> "VideoStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
