"""Neural audio codecs (transformers' `DacModel`, `MimiModel`): codes in, waveform out, one-shot
or streamed as frames arrive.

Streaming decodes each new chunk of codes with context frames on both sides and keeps the
chunk's samples (`StreamChunking`). DAC's decoder is non-causal (centred convolutions both
sides), Mimi's is causal. Left and right context that cover the decoder's reach give the
one-shot samples; the reach
is measured once per codec (`decoder_reach`: how many frames a change to one code moves the
output on each side), so the default stream is exact up to float rounding and the right
context is the latency it costs. Smaller contexts trade exactness for speed (tests bound it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


class Codec:
    """A codec model with `decode(audio_codes=[B, C, T])` (and `encode(input_values=[B, 1, S])`)."""

    def __init__(self, model: Any):
        self.model = model.eval()
        config = model.config
        self.sampling_rate = int(config.sampling_rate)
        self.num_codebooks = int(getattr(config, "n_codebooks", None) or getattr(config, "num_quantizers"))
        self.hop_length = int(getattr(config, "hop_length", 0) or getattr(config, "frame_size"))
        self.causal = bool(getattr(config, "use_causal_conv", False))
        self._reach: Optional[tuple[int, int]] = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Waveform [S] (float32) of codes [C, T]."""
        out = self.model.decode(audio_codes=codes[None].to(self.device)).audio_values
        return out.reshape(-1).float().cpu()

    @torch.no_grad()
    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """Codes [C, T] of a mono waveform [S] at `sampling_rate` (padded to whole frames)."""
        pad = (-wave.shape[-1]) % self.hop_length
        x = torch.nn.functional.pad(wave.float(), (0, pad))[None, None].to(self.device, self.dtype)
        return self.model.encode(x).audio_codes[0, : self.num_codebooks].cpu()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def decoder_reach(self, probe_frames: int = 48) -> tuple[int, int]:
        """(before, after): how many frames before and after a code have samples that depend on
        it, measured by changing one code in the middle of a random probe (memoised). A causal
        decoder has before = 0."""
        if self._reach is None:
            g = torch.Generator().manual_seed(0)
            size = int(getattr(self.model.config, "codebook_size", 2))
            codes = torch.randint(0, size, (self.num_codebooks, probe_frames), generator=g)
            changed = codes.clone()
            mid = probe_frames // 2
            changed[:, mid] = (changed[:, mid] + 1) % size
            diff = (self.decode(codes) - self.decode(changed)).abs()
            # Some decoders return a few samples fewer than frames x hop (odd strides): pad to frames.
            diff = torch.nn.functional.pad(diff, (0, probe_frames * self.hop_length - diff.numel()))
            diff = diff.view(probe_frames, self.hop_length).amax(1)
            moved = (diff > 0).nonzero().flatten()  # outside the reach both decodes are bitwise equal
            before = mid - int(moved.min()) if moved.numel() else 0
            after = int(moved.max()) - mid if moved.numel() else 0
            if before >= mid or after >= probe_frames - mid - 1:
                if probe_frames >= 1024:
                    raise ValueError("the codec decoder's reach exceeds 1024 frames: stream with an explicit StreamChunking")
                return self.decoder_reach(probe_frames * 2)
            self._reach = (before, after)
        return self._reach


@dataclass
class StreamChunking:
    """How codes stream to audio: the context, in frames, decoded around each chunk (`left`,
    `right`; None measures the decoder's reach: exact; smaller values are faster and
    approximate), and chunks that double from one frame up to `max_chunk` frames: the first
    audio goes out as soon as its first frame is final, and the codec decodes a frame's context
    about log2(max_chunk) + n / max_chunk times over n frames, not once per frame (a chunk per
    frame made streaming 4x slower than one call)."""

    left: Optional[int] = None
    right: Optional[int] = None
    max_chunk: int = 32


class CodecStream:
    """Incremental decoding of one row: `push(codes [C, n])` returns the samples that are final
    so far, `flush()` the rest. Concatenated, they equal `Codec.decode` of all codes when the
    context covers the decoder's reach. Decoders are shift-equivariant away from their edges, so
    sample j of a decoded span is one-shot sample j + (span start) x hop; a decoder that returns
    a few samples short (odd strides) is short at its end only, in a span as in one shot."""

    def __init__(self, codec: Codec, chunking: StreamChunking = StreamChunking()):
        before, after = codec.decoder_reach() if chunking.left is None or chunking.right is None else (0, 0)
        self.codec = codec
        # Frame t's samples depend on codes t - after .. t + before.
        self.left = after if chunking.left is None else chunking.left
        self.right = before if chunking.right is None else chunking.right
        self.codes = torch.zeros(codec.num_codebooks, 0, dtype=torch.long)
        self.emitted = 0  # frames whose samples are out
        self.chunk, self.max_chunk = 1, max(1, int(chunking.max_chunk))  # final frames the next chunk waits for

    def push(self, codes: torch.Tensor) -> torch.Tensor:
        self.codes = torch.cat([self.codes, codes.cpu().long()], 1)
        # Chunk boundaries follow the frame count alone, never how the frames arrived (one per
        # push or a batch's worth): one span's decode rounds differently from another's, so
        # the same frames give the same bytes however a decode's timing grouped them.
        final, chunks = self.codes.shape[1] - self.right, []
        while final - self.emitted >= self.chunk:
            chunks.append(self._emit(self.emitted + self.chunk))
            self.chunk = min(2 * self.chunk, self.max_chunk)
        return torch.cat(chunks) if chunks else torch.zeros(0)

    def flush(self) -> torch.Tensor:
        return self._emit(self.codes.shape[1])

    def _emit(self, upto: int) -> torch.Tensor:
        if upto <= self.emitted:
            return torch.zeros(0)
        start = max(0, self.emitted - self.left)
        end = min(self.codes.shape[1], upto + self.right)
        wave = self.codec.decode(self.codes[:, start:end])
        hop = self.codec.hop_length
        chunk = wave[(self.emitted - start) * hop: (upto - start) * hop]
        self.emitted = upto
        return chunk


def __getattr__(name: str):
    if name == "StreamWindow":  # the name until this release: "window" is the Jacobi width elsewhere
        import warnings

        warnings.warn("mmgen.audio.codec.StreamWindow is now StreamChunking", DeprecationWarning, stacklevel=2)
        return StreamChunking
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
