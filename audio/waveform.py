"""Reading voice prompts and writing speech: soundfile for files (torchaudio 2.9+ reads them only
through torchcodec), torchaudio's resampler for rates."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from mmgen.files import write_atomic

#: A voice prompt quieter than this (peak amplitude, full scale 1.0) is taken for silence.
SILENCE_PEAK = 1e-3
#: Longest voice prompt accepted, in seconds (a prompt is a few seconds of the voice to clone).
MAX_VOICE_SECONDS = 60.0


class AudioError(ValueError):
    """An audio input that cannot be used (unreadable, silent, too long); one-line message."""


def read_audio(source: Any, sampling_rate: int, max_seconds: float = MAX_VOICE_SECONDS) -> torch.Tensor:
    """A mono float32 waveform [S] at `sampling_rate` from a file path, raw file bytes, or
    (array, rate); resampled with torchaudio, channels averaged. Silence and over-long audio
    are errors."""
    if isinstance(source, tuple) and len(source) == 2:
        data, rate = np.asarray(source[0], dtype=np.float32), int(source[1])
        name = "the voice prompt"
    else:
        import soundfile

        name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the voice prompt"
        try:
            stream = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else os.fspath(source)
            data, rate = soundfile.read(stream, dtype="float32", always_2d=True)
        except Exception as error:  # soundfile raises LibsndfileError, OSError, TypeError ...
            raise AudioError(f"cannot read audio from {name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    wave = torch.from_numpy(np.ascontiguousarray(data))
    if wave.ndim == 2:
        wave = wave.mean(1 if wave.shape[1] <= 8 else 0)  # (frames, channels) from soundfile
    if wave.numel() == 0 or not torch.isfinite(wave).all():
        raise AudioError(f"{name} holds no usable samples")
    if wave.numel() / rate > max_seconds:
        raise AudioError(f"{name} is {wave.numel() / rate:.1f} s long; at most {max_seconds:.0f} s is accepted")
    if float(wave.abs().max()) < SILENCE_PEAK:
        raise AudioError(f"{name} is silent (peak below {SILENCE_PEAK})")
    if rate != sampling_rate:
        import torchaudio.functional as AF

        wave = AF.resample(wave[None], rate, sampling_rate)[0]
    return wave.contiguous()


def wav_bytes(wave: Union[torch.Tensor, np.ndarray], sampling_rate: int) -> bytes:
    """16-bit PCM WAV bytes of a mono waveform in [-1, 1] (clipped)."""
    import soundfile

    data = np.clip(np.asarray(torch.as_tensor(wave).float().cpu()), -1.0, 1.0)
    buffer = io.BytesIO()
    soundfile.write(buffer, data, sampling_rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def write_wav(path: Union[str, os.PathLike], wave: Union[torch.Tensor, np.ndarray], sampling_rate: int) -> Path:
    """Write a mono waveform as 16-bit WAV, atomically (a reader never sees half a file)."""
    path = Path(path)
    write_atomic(path, wav_bytes(wave, sampling_rate))
    return path
