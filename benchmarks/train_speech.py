"""Train the speech side of the bundled text-to-speech pair on espeak-ng speech: a neural audio
codec (transformers' own `DacModel`) and a CTC phoneme recogniser (the quality proxy).

Data comes from `benchmarks/data/speech.py` (16 kHz, phonemes per utterance, a fixed 5%
held-out split that is never trained on). The loop, checkpointing and data order are
`benchmarks/train.py`'s (`train_loop`: resumable, randomness from (seed, step)), so a killed and
resumed run ends with the weights of one that never stopped.

    python -m benchmarks.data.speech --out data/speech16k.npz
    python -m benchmarks.train_speech codec --data data/speech16k.npz --out runs/speech-codec --threads 1
    python -m benchmarks.train_speech phonemes --data data/speech16k.npz --out runs/speech-phonemes --threads 1
    python -m benchmarks.train_speech tokenize --data data/speech16k.npz --codec runs/speech-codec --out runs/speech-codes.npz
    python -m benchmarks.train_speech calibrate --data data/speech16k.npz --codec runs/speech-codec \
        --recogniser runs/speech-phonemes --out runs/speech-calibration.json
    python -m benchmarks.train_speech export --codec runs/speech-codec --recogniser runs/speech-phonemes \
        --out runs/speech-export
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
import torchaudio

from benchmarks.data.speech import PHONEMES, SAMPLE_RATE, load_corpus, utterance
from benchmarks.train import add_training_arguments, last_log, load_trained, round_to_half, train_loop

#: The codec: DAC's architecture at toy scale, 50 frames/s (hop 320) of 8 codes from 256 each.
CODEC = dict(encoder_hidden_size=8, decoder_hidden_size=96, downsampling_ratios=[2, 4, 5, 8], n_codebooks=8,
             codebook_size=256, codebook_dim=8, quantizer_dropout=0.0, sampling_rate=SAMPLE_RATE)
#: Codec loss: multi-resolution log-mel L1 (n_fft, hop, mels), weighted as DAC weights its mel loss.
MEL_SCALES = ((256, 64, 40), (512, 128, 80), (1024, 256, 80))
MEL_WEIGHT, WAVE_WEIGHT = 15.0, 1.0
CROP_SECONDS = (0.5, 1.0)
#: Dead-code restarts: on this share of steps (drawn per step), codes that none of `RESTART_CROPS`
#: one-second crops use are set to latents of those crops. DAC has none (it relies on long training
#: to spread its codes); a short CPU run needs them to keep each book's codes where the latents are.
RESTART_PROBABILITY, RESTART_CROPS = 0.1, 32
#: The recogniser: log-mel frames every 10 ms -> two convolutions (the first halves the rate) -> a
#: two-layer BiGRU -> the phoneme inventory plus the CTC blank (last class).
RECOGNISER = dict(n_mels=80, n_fft=400, hop=160, channels=192, hidden=192, layers=2, classes=len(PHONEMES) + 1)


# ---------------------------------------------------------------------------- data


class Speech:
    """One split of the corpus: float waveforms in [-1, 1] and phoneme ids."""

    def __init__(self, data: dict[str, np.ndarray], split: str):
        keep = np.flatnonzero(data["is_eval"] if split == "eval" else ~data["is_eval"])
        ids = {p: i for i, p in enumerate(str(s) for s in data["inventory"])}
        self.waves = [torch.from_numpy(utterance(data, i).astype(np.float32) / 32768) for i in keep]
        self.phonemes = [str(data["phonemes"][i]) for i in keep]
        self.labels = [torch.tensor([ids[p] for p in s.split()]) for s in self.phonemes]
        self.texts = [str(data["text"][i]) for i in keep]

    def __len__(self) -> int:
        return len(self.waves)


def pad_batch(waves: list[torch.Tensor], multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] zero-padded to a multiple of `multiple`, and the lengths."""
    lengths = torch.tensor([len(w) for w in waves])
    width = -(-int(lengths.max()) // multiple) * multiple
    return torch.stack([F.pad(w, (0, width - len(w))) for w in waves]), lengths


def crops(waves: list[torch.Tensor], index: torch.Tensor, generator: torch.Generator, hop: int,
          between: tuple[float, float] = CROP_SECONDS) -> torch.Tensor:
    """[B, 1, T]: one random crop per utterance, all of one random length in `between` seconds
    (whole frames), zero padded where an utterance is shorter."""
    seconds = between[0] + (between[1] - between[0]) * float(torch.rand((), generator=generator))
    width = int(seconds * SAMPLE_RATE) // hop * hop
    out = torch.zeros(len(index), 1, width)
    for row, (i, u) in enumerate(zip(index.tolist(), torch.rand(len(index), generator=generator).tolist())):
        wave = waves[i]
        start = int(u * max(0, len(wave) - width + 1))
        piece = wave[start:start + width]
        out[row, 0, :len(piece)] = piece
    return out


def steps_per_second() -> Callable[[], float]:
    """A clock: steps per second over the calls so far in this process."""
    started, calls = time.time(), [0]

    def tick() -> float:
        calls[0] += 1
        return round(calls[0] / max(time.time() - started, 1e-9), 3)

    return tick


# ---------------------------------------------------------------------------- codec


def codec_config(overrides: dict | None = None) -> Any:
    from transformers import DacConfig

    return DacConfig(**{**CODEC, **(overrides or {})})


def new_codec(config: Any, seed: int) -> Any:
    """A DacModel with fan-in scaled convolution weights and zero biases. DAC's own init (normal,
    std 0.02) assumes weight norm, which `DacModel` does not apply: without it the activations
    shrink layer by layer, every latent is nearly the quantizer's bias, and all frames get one code."""
    from transformers import DacModel

    torch.manual_seed(seed)
    model = DacModel(config)
    for module in model.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            module.reset_parameters()
            torch.nn.init.zeros_(module.bias)
    return model


class MelLoss(torch.nn.Module):
    """Mean over resolutions of L1 between log10 mel spectrograms (DAC's mel reconstruction loss)."""

    def __init__(self, scales=MEL_SCALES):
        super().__init__()
        self.mels = torch.nn.ModuleList(
            torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=n_fft, hop_length=hop, n_mels=mels, power=1.0)
            for n_fft, hop, mels in scales)

    def forward(self, recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log = lambda mel, x: torch.log10(mel(x).clamp(min=1e-5))
        return sum(F.l1_loss(log(m, recon), log(m, target)) for m in self.mels) / len(self.mels)


def roundtrip(codec: Any, waves: list[torch.Tensor], batch: int = 16,
              decode: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each waveform's reconstruction (same length; none unless `decode`) and codes [frames,
    n_codebooks], in batches of `batch` padded to whole frames (frames = ceil(samples / hop); the
    decoder gives back 8 samples less than its frames cover, so the last few may be zero filled)."""
    hop = codec.config.hop_length
    audio, codes = [], []
    for start in range(0, len(waves), batch):
        chunk = waves[start:start + batch]
        x, lengths = pad_batch(chunk, hop)
        encoded = codec.encode(x[:, None])
        codes += [encoded.audio_codes[row, :, :-(-n // hop)].T for row, n in enumerate(lengths.tolist())]
        if decode:
            decoded = codec.decode(encoded.quantized_representation).audio_values.reshape(len(chunk), -1)
            decoded = F.pad(decoded, (0, max(0, x.shape[1] - decoded.shape[1])))
            audio += [decoded[row, :n].float() for row, n in enumerate(lengths.tolist())]
    return audio, codes


@torch.no_grad()
def restart_dead_codes(model: Any, waves: list[torch.Tensor], generator: torch.Generator) -> int:
    """Encode random crops; in every codebook, point each code none of them uses at one of their
    (projected) latents. Returns the number of codes restarted."""
    hop, dim = model.config.hop_length, model.config.codebook_dim
    index = torch.randint(0, len(waves), (RESTART_CROPS,), generator=generator)
    x = crops(waves, index, generator, hop, (1.0, 1.0))
    model.eval()
    encoded = model.encode(x)
    model.train()
    restarted = 0
    for q, quantizer in enumerate(model.quantizer.quantizers):
        latents = encoded.projected_latents[:, q * dim:(q + 1) * dim].permute(0, 2, 1).reshape(-1, dim)
        used = torch.zeros(model.config.codebook_size, dtype=torch.bool)
        used[encoded.audio_codes[:, q].reshape(-1)] = True
        dead = (~used).nonzero()[:, 0]
        pick = torch.randint(0, len(latents), (len(dead),), generator=generator)
        quantizer.codebook.weight[dead] = latents[pick]
        restarted += len(dead)
    return restarted


def train_codec(args) -> None:
    train = Speech(load_corpus(args.data), "train")
    config = codec_config(json.loads(args.codec_config) if args.codec_config else None)
    model = new_codec(config, args.seed)
    mel_loss = MelLoss()
    clock = steps_per_second()

    def loss_fn(index, generator):
        x = crops(train.waves, index, generator, config.hop_length)
        restarted = 0
        if float(torch.rand((), generator=generator)) < args.restart_probability:
            restarted = restart_dead_codes(model, train.waves, generator)
        # The quantizer draws its dropout from the global RNG: seed it per step as well.
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        out = model(x)
        recon = out.audio_values[:, None]
        target = x[..., :recon.shape[-1]]
        mel, wave = mel_loss(recon, target), F.l1_loss(recon, target)
        vq = out.loss.mean()
        usage = len(torch.unique(out.audio_codes[:, 0])) / config.codebook_size
        return MEL_WEIGHT * mel + WAVE_WEIGHT * wave + vq, {
            "mel": round(mel.item(), 4), "wave": round(wave.item(), 5), "vq": round(vq.item(), 4),
            "usage0": round(usage, 3), "restarted": restarted, "steps_per_s": clock()}

    params = sum(p.numel() for p in model.parameters())
    print(f"codec: {params / 1e6:.2f}M parameters, hop {config.hop_length}, {config.n_codebooks}x{config.codebook_size} codes")
    train_loop(model, loss_fn, len(train), args, {"dac": config.to_dict(), "params": params, "args": vars(args)})


def load_codec(run: str | Path) -> Any:
    """A codec run of `codec` (checkpoint.pt + config.json) or a transformers DacModel folder
    (`export`'s `<out>/codec`, a bundle's `codec/`)."""
    from transformers import DacConfig, DacModel

    if not (Path(run) / "checkpoint.pt").exists():
        return DacModel.from_pretrained(str(run), dtype=torch.float32).eval()
    config = DacConfig.from_dict(json.loads((Path(run) / "config.json").read_text())["dac"])
    return load_trained(new_codec(config, 0), str(run))


@torch.no_grad()
def tokenize(args) -> None:
    """Codes of every utterance ([frames, n_codebooks] int16, concatenated, with offsets) and the
    corpus's text, phonemes, voice and split: the training data of the text-to-speech model."""
    data = load_corpus(args.data)
    codec = load_codec(args.codec)
    if args.half:
        round_to_half(codec)
    waves = [torch.from_numpy(utterance(data, i).astype(np.float32) / 32768) for i in range(len(data["text"]))]
    codes = [c.numpy().astype(np.int16) for c in roundtrip(codec, waves, decode=False)[1]]
    frames = np.array([len(c) for c in codes])
    np.savez(args.out, codes=np.concatenate(codes), offsets=np.concatenate([[0], np.cumsum(frames)]),
             **{k: data[k] for k in ("text", "phonemes", "voice", "speed", "pitch", "is_eval", "inventory")},
             frame_rate=np.array(codec.config.frame_rate), codebook_size=np.array(codec.config.codebook_size))
    print(f"wrote {args.out}: {len(codes)} utterances, {int(frames.sum())} frames x {codes[0].shape[1]} codebooks")


# ---------------------------------------------------------------------------- phoneme recogniser


class PhonemeRecogniser(torch.nn.Module):
    """Log-mel -> conv (stride 2) -> conv -> BiGRU -> phoneme logits at 50 frames/s (CTC, blank last)."""

    def __init__(self, n_mels: int, n_fft: int, hop: int, channels: int, hidden: int, layers: int, classes: int):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(SAMPLE_RATE, n_fft=n_fft, hop_length=hop, n_mels=n_mels)
        self.hop = hop
        self.conv1 = torch.nn.Conv1d(n_mels, channels, 5, stride=2, padding=2)
        self.conv2 = torch.nn.Conv1d(channels, channels, 5, padding=2)
        self.norm1, self.norm2 = torch.nn.LayerNorm(channels), torch.nn.LayerNorm(channels)
        self.rnn = torch.nn.GRU(channels, hidden, num_layers=layers, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(2 * hidden, classes)

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

    @torch.no_grad()
    def transcribe(self, waves: list[torch.Tensor], batch: int = 32) -> list[str]:
        """Greedy CTC: space-joined phonemes of each waveform."""
        out = []
        for start in range(0, len(waves), batch):
            wave, lengths = pad_batch(waves[start:start + batch])
            logp = self(self.features(wave), lengths)
            for row, n in zip(logp.argmax(-1), self.frames(lengths).clamp(max=logp.shape[1]).tolist()):
                ids = torch.unique_consecutive(row[:n]).tolist()
                out.append(" ".join(PHONEMES[i] for i in ids if i < len(PHONEMES)))
        return out


def augment(wave: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random gain (-6..+2 dB) and white noise (30-50 dB below the speech), per utterance."""
    b = len(wave)
    gain = 10 ** ((torch.rand(b, 1, generator=generator) * 8 - 6) / 20)
    snr = torch.rand(b, 1, generator=generator) * 20 + 30
    mask = torch.arange(wave.shape[1])[None] < lengths[:, None]
    power = (wave ** 2).sum(1, keepdim=True) / lengths[:, None]
    noise = torch.randn(wave.shape, generator=generator) * (power / 10 ** (snr / 10)).sqrt()
    return (wave + noise) * gain * mask


def spec_mask(mel: torch.Tensor, generator: torch.Generator, times: int = 2, width: int = 8, bands: int = 2,
              band: int = 8) -> torch.Tensor:
    """SpecAugment: `times` time masks up to `width` frames and `bands` mel masks up to `band` bins,
    filled with the utterance's mean."""
    mel = mel.clone()
    fill = mel.mean(dim=(1, 2))
    for row in range(len(mel)):
        for axis, count, most in ((2, times, width), (1, bands, band)):
            for _ in range(count):
                size = int(torch.randint(0, most + 1, (), generator=generator))
                start = int(torch.randint(0, max(1, mel.shape[axis] - size), (), generator=generator))
                mel[row].narrow(axis - 1, start, size).fill_(fill[row])
    return mel


def ctc_loss(model: PhonemeRecogniser, mel: torch.Tensor, lengths: torch.Tensor, labels: list[torch.Tensor]) -> torch.Tensor:
    logp = model(mel, lengths)
    frames = model.frames(lengths).clamp(max=logp.shape[1])
    targets = torch.cat(labels)
    return F.ctc_loss(logp.transpose(0, 1), targets, frames, torch.tensor([len(l) for l in labels]),
                      blank=len(PHONEMES), zero_infinity=True)


def phoneme_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """PER: jiwer's word error rate over space-joined phonemes (errors over all reference phonemes)."""
    import jiwer

    return float(jiwer.wer(references, hypotheses))


def train_phonemes(args) -> None:
    data = load_corpus(args.data)
    train, held_out = Speech(data, "train"), Speech(data, "eval")
    torch.manual_seed(args.seed)
    model = PhonemeRecogniser(**RECOGNISER)
    clock = steps_per_second()

    def loss_fn(index, generator):
        wave, lengths = pad_batch([train.waves[i] for i in index.tolist()])
        mel = spec_mask(model.features(augment(wave, lengths, generator)), generator)
        loss = ctc_loss(model, mel, lengths, [train.labels[i] for i in index.tolist()])
        return loss, {"steps_per_s": clock()}

    params = sum(p.numel() for p in model.parameters())
    print(f"recogniser: {params / 1e6:.2f}M parameters, {len(train)} training utterances")
    train_loop(model, loss_fn, len(train), args, {"recogniser": RECOGNISER, "inventory": list(PHONEMES),
                                                  "params": params, "args": vars(args)})
    per = phoneme_error_rate(held_out.phonemes, model.transcribe(held_out.waves))
    print(json.dumps({"held_out_per": round(per, 4), "held_out": len(held_out)}))


def load_recogniser(run: str) -> PhonemeRecogniser:
    config = json.loads((Path(run) / "config.json").read_text())["recogniser"]
    return load_trained(PhonemeRecogniser(**config), run)


# ---------------------------------------------------------------------------- calibration, export


def si_snr(estimate: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Scale-invariant signal-to-noise ratio in dB of 1-D signals."""
    estimate, target = estimate - estimate.mean(), target - target.mean()
    projection = (estimate @ target) / (target @ target).clamp(min=1e-9) * target
    return 10 * torch.log10((projection @ projection).clamp(min=1e-9) / ((estimate - projection) ** 2).sum().clamp(min=1e-9))


def time_shuffled(wave: torch.Tensor, generator: torch.Generator, chunk: int = 800) -> torch.Tensor:
    """The waveform's 50 ms chunks in a random order: the same sounds, no phoneme sequence."""
    pieces = list(wave.split(chunk))
    return torch.cat([pieces[i] for i in torch.randperm(len(pieces), generator=generator).tolist()])


@torch.no_grad()
def calibrate(args) -> None:
    """PER of the recogniser on held-out audio as it is, after the codec, and on two controls (the
    audio scored against another utterance's phonemes; its 50 ms chunks shuffled), plus the
    codec's held-out reconstruction error (mel L1 as in training, SI-SNR) and codes used per book."""
    held_out = Speech(load_corpus(args.data), "eval")
    recogniser = load_recogniser(args.recogniser)
    codec = load_codec(args.codec)
    if args.half:
        round_to_half(codec)
    mel_loss = MelLoss()
    recon, codes = roundtrip(codec, held_out.waves)
    codes = torch.cat(codes)
    mel = [float(mel_loss(audio[None, None], wave[None, None])) for audio, wave in zip(recon, held_out.waves)]
    snr = [float(si_snr(audio, wave)) for audio, wave in zip(recon, held_out.waves)]
    generator = torch.Generator().manual_seed(0)
    refs = held_out.phonemes
    real = recogniser.transcribe(held_out.waves)
    result = {
        "held_out": len(refs), "codec_run": str(args.codec), "codec_half": bool(args.half),
        "codec_step": last_log(args.codec)["final"]["step"], "recogniser_step": last_log(args.recogniser)["final"]["step"],
        "per_real": phoneme_error_rate(refs, real),
        "per_codec": phoneme_error_rate(refs, recogniser.transcribe(recon)),
        "per_mismatched": phoneme_error_rate(refs[1:] + refs[:1], real),
        "per_time_shuffled": phoneme_error_rate(refs, recogniser.transcribe([time_shuffled(w, generator) for w in held_out.waves])),
        "codec_mel_l1": float(np.mean(mel)), "codec_si_snr_db": float(np.mean(snr)),
        "codec_codes_used": [len(torch.unique(book)) for book in codes.T],
    }
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


@torch.no_grad()
def export(args) -> None:
    """The codec as a transformers folder (float16) and the recogniser as safetensors + config.json."""
    from safetensors.torch import save_file

    out = Path(args.out)
    codec = round_to_half(load_codec(args.codec)).half()
    codec.save_pretrained(out / "codec")
    recogniser = load_recogniser(args.recogniser)
    folder = out / "phoneme-recogniser"
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in recogniser.state_dict().items() if not k.startswith("mel.")}
    save_file(state, folder / "model.safetensors")
    config = {"recogniser": RECOGNISER | json.loads((Path(args.recogniser) / "config.json").read_text())["recogniser"],
              "inventory": list(PHONEMES), "blank": len(PHONEMES), "sample_rate": SAMPLE_RATE}
    (folder / "config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out / 'codec'} and {folder}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    codec = jobs.add_parser("codec", help="train the DAC codec")
    codec.add_argument("--data", required=True)
    codec.add_argument("--codec-config", help="JSON of DacConfig fields overriding CODEC (tests use a tiny one)")
    codec.add_argument("--restart-probability", type=float, default=RESTART_PROBABILITY,
                       help="share of steps that restart unused codes")
    add_training_arguments(codec, 3e-4, 8)
    codec.set_defaults(steps=1500, log_every=25, save_every=100)
    rec = jobs.add_parser("phonemes", help="train the CTC phoneme recogniser")
    rec.add_argument("--data", required=True)
    add_training_arguments(rec, 2e-3, 32)
    rec.set_defaults(steps=1500, log_every=25, save_every=100)
    tok = jobs.add_parser("tokenize", help="encode the corpus to codec codes")
    cal = jobs.add_parser("calibrate", help="PER on real / codec / control audio; codec reconstruction error")
    for p in (tok, cal):
        p.add_argument("--data", required=True)
        p.add_argument("--codec", required=True)
        p.add_argument("--half", action="store_true", help="round the codec to float16 first (as exported)")
        p.add_argument("--threads", type=int, default=0)
    tok.add_argument("--out", required=True)
    cal.add_argument("--recogniser", required=True)
    cal.add_argument("--out")
    exp = jobs.add_parser("export")
    for name in ("--codec", "--recogniser", "--out"):
        exp.add_argument(name, required=True)
    args = parser.parse_args(argv)
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    {"codec": train_codec, "phonemes": train_phonemes, "tokenize": tokenize, "calibrate": calibrate,
     "export": export}[args.job](args)


if __name__ == "__main__":
    main()
