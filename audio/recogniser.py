"""The project's phoneme recogniser: how intelligible a speech model's output is, as a phoneme
error rate (PER) against the phonemes its text should sound like (`mmgen.audio.phonemes`).

A small CTC model (log-mel -> two convolutions -> BiGRU -> phoneme logits at 50 frames/s),
trained on espeak-ng speech by `training/train_speech.py phonemes` and bundled in float16
(`assets/phoneme-recogniser/`, see its MODEL_CARD.md). A folder holds `model.safetensors` (the
weights, without the mel filterbank, which is computed) and `config.json` (the architecture, the
phoneme inventory, the CTC blank and the sample rate); weights load into float32, the dtype it
computes in.

    from mmgen.audio.recogniser import PhonemeRecogniser, phoneme_error_rate
    from mmgen.audio.phonemes import text_phonemes

    recogniser = PhonemeRecogniser.from_pretrained()          # the bundled one
    heard = recogniser.transcribe([wave], sampling_rate=24000)
    per = phoneme_error_rate([text_phonemes("Hello there.")], heard)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from mmgen.audio.phonemes import PHONEMES
from mmgen.hub import folder_file
from mmgen.inference import inference

#: The bundled recogniser's folder (package data).
BUNDLED = Path(__file__).parent / "assets" / "phoneme-recogniser"
WEIGHTS, CONFIG = "model.safetensors", "config.json"
#: The mel filterbank and window are recomputed from the config, never stored.
COMPUTED = "mel."


class PhonemeRecogniser(torch.nn.Module):
    """Log-mel -> conv (stride 2) -> conv -> BiGRU -> phoneme logits at 50 frames/s (CTC, blank last)."""

    def __init__(self, n_mels: int, n_fft: int, hop: int, channels: int, hidden: int, layers: int, classes: int,
                 sample_rate: int = 16000, inventory: Sequence[str] = PHONEMES):
        super().__init__()
        import torchaudio

        if classes != len(inventory) + 1:
            raise ValueError(f"a recogniser of {classes} classes needs an inventory of {classes - 1} phonemes "
                             f"(and the blank), got {len(inventory)}")
        self.config = dict(n_mels=n_mels, n_fft=n_fft, hop=hop, channels=channels, hidden=hidden, layers=layers,
                           classes=classes)
        self.sample_rate, self.inventory, self.hop, self.n_fft = sample_rate, tuple(inventory), hop, n_fft
        self.mel = torchaudio.transforms.MelSpectrogram(sample_rate, n_fft=n_fft, hop_length=hop, n_mels=n_mels)
        self.conv1 = torch.nn.Conv1d(n_mels, channels, 5, stride=2, padding=2)
        self.conv2 = torch.nn.Conv1d(channels, channels, 5, padding=2)
        self.norm1, self.norm2 = torch.nn.LayerNorm(channels), torch.nn.LayerNorm(channels)
        self.rnn = torch.nn.GRU(channels, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(2 * hidden, classes)

    @property
    def blank(self) -> int:
        return len(self.inventory)

    def features(self, wave: torch.Tensor) -> torch.Tensor:
        """[B, T] -> log-mel [B, n_mels, frames]."""
        return torch.log(self.mel(wave) + 1e-6)

    def frames(self, lengths: torch.Tensor) -> torch.Tensor:
        """Output frames for waveforms of `lengths` samples."""
        return (lengths // self.hop + 1 + 1) // 2

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Log-mel [B, n_mels, frames] of waveforms of `lengths` samples -> log-probs [B, frames', classes]."""
        x = F.gelu(self.norm1(self.conv1(mel).transpose(1, 2))).transpose(1, 2)
        x = F.gelu(self.norm2(self.conv2(x).transpose(1, 2)))
        frames = self.frames(lengths).clamp(max=x.shape[1])
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, frames, batch_first=True, enforce_sorted=False)
        x = torch.nn.utils.rnn.pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]
        return self.head(x).log_softmax(-1)

    @inference
    def transcribe(self, waves: Sequence[Union[torch.Tensor, np.ndarray]], sampling_rate: int) -> list[str]:
        """Greedy CTC: the space-joined phonemes heard in each mono waveform (floats in [-1, 1] at
        `sampling_rate`, resampled to the recogniser's with torchaudio). Each waveform is heard
        alone, one forward each, so what it hears never depends on the others in the call (in a
        zero-padded batch the mel's last windows and the convolutions would read the padding:
        the codec floor measured 8.2% PER in batches of 32 and 8.5% alone). One shorter than
        half an analysis window reads as nothing."""
        import torchaudio

        waves = [torch.as_tensor(w, dtype=torch.float32) for w in waves]
        if any(w.ndim != 1 for w in waves):
            raise ValueError(f"transcribe takes mono waveforms (1-D), got shapes {[tuple(w.shape) for w in waves if w.ndim != 1]}")
        if sampling_rate != self.sample_rate:
            waves = [torchaudio.functional.resample(w, sampling_rate, self.sample_rate) for w in waves]
        heard = []
        for wave in waves:
            if len(wave) <= self.n_fft // 2:  # the mel's reflect padding needs more
                heard.append("")
                continue
            logp = self(self.features(wave[None]), torch.tensor([len(wave)]))[0]
            heard.append(" ".join(self.inventory[j] for j in collapse(logp.argmax(-1).tolist(), self.blank)))
        return heard

    @classmethod
    def from_pretrained(cls, folder: Union[str, Path, None] = None) -> "PhonemeRecogniser":
        """The recogniser saved in `folder` (default: the bundled one), in float32, for inference.
        ValueError (one line) for a folder that does not hold one."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = BUNDLED if folder is None else Path(folder)
        for name in (CONFIG, WEIGHTS):
            if not folder_file(folder, name).is_file():  # never through a link out of the folder
                raise ValueError(f"{folder} is not a phoneme recogniser folder: no {name}")
        try:
            config = json.loads((folder / CONFIG).read_text())
            model = cls(**config["recogniser"], sample_rate=int(config["sample_rate"]), inventory=config["inventory"])
            if config.get("blank", model.blank) != model.blank:
                raise ValueError(f"blank {config['blank']}: this recogniser's blank is the class after the inventory, {model.blank}")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{folder / CONFIG}: not a phoneme recogniser config ({type(error).__name__}: {error})") from None
        try:
            state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(folder / WEIGHTS).items()}
        except (SafetensorError, OSError) as error:
            raise ValueError(f"{folder / WEIGHTS}: cannot read ({error})") from None
        expected = {k: v.shape for k, v in model.state_dict().items() if not k.startswith(COMPUTED)}
        given = {k: v.shape for k, v in state.items()}
        if given != expected:
            differ = sorted(k for k in expected.keys() | given.keys() if expected.get(k) != given.get(k))
            raise ValueError(f"{folder / WEIGHTS} does not fit its config: {len(differ)} tensor(s) missing, extra or "
                             f"of another shape ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})")
        model.load_state_dict(state, strict=False)  # the mel buffers, not stored, keep their computed values
        return model.eval()

    def save_pretrained(self, folder: Union[str, Path], dtype: torch.dtype = torch.float16) -> Path:
        """Write `folder`/model.safetensors (floating weights in `dtype`, the computed mel buffers
        left out) and config.json; returns the folder."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
                 for k, v in self.state_dict().items() if not k.startswith(COMPUTED)}
        save_file(state, folder / WEIGHTS)
        config = {"recogniser": self.config, "inventory": list(self.inventory), "blank": self.blank,
                  "sample_rate": self.sample_rate}
        (folder / CONFIG).write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
        return folder


def collapse(frames: Sequence[int], blank: int) -> list[int]:
    """Greedy CTC decoding of per-frame best classes: repeats merged, then blanks dropped (so a
    blank between two equal classes keeps both)."""
    return [c for i, c in enumerate(frames) if c != blank and (i == 0 or frames[i - 1] != c)]


def edit_distance(reference: Sequence[Any], hypothesis: Sequence[Any]) -> int:
    """Levenshtein distance: the fewest substitutions, deletions and insertions that turn
    `reference` into `hypothesis`."""
    row = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        diagonal, row[0] = row[0], i
        for j, hyp in enumerate(hypothesis, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ref != hyp))
    return row[-1]


def phoneme_error_rate(references: Union[str, Sequence[str]], hypotheses: Union[str, Sequence[str]]) -> float:
    """PER: edit operations over all pairs of space-joined phoneme strings, divided by the
    reference phonemes in all of them (so long utterances weigh more; a single pair may be given
    as two strings). ValueError when the references hold no phonemes."""
    if isinstance(references, str) != isinstance(hypotheses, str):
        raise ValueError("give references and hypotheses both as strings or both as lists")
    if isinstance(references, str):
        references, hypotheses = [references], [hypotheses]
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    total = sum(len(r.split()) for r in references)
    if total == 0:
        raise ValueError("the references hold no phonemes")
    return sum(edit_distance(r.split(), h.split()) for r, h in zip(references, hypotheses)) / total
