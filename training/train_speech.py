"""Train the speech side of the bundled text-to-speech pair on espeak-ng speech: a neural audio
codec (transformers' own `DacModel`) and a CTC phoneme recogniser (the quality proxy; the model
is `mmgen.audio.recogniser.PhonemeRecogniser`, and `export` writes the folder bundled as
`audio/assets/phoneme-recogniser`).

Data comes from `training/data/speech.py` (16 kHz, phonemes per utterance, a fixed 5%
held-out split that is never trained on). The loop, checkpointing and data order are
`training/train.py`'s (`train_loop`: resumable, randomness from (seed, step)), so a killed and
resumed run ends with the weights of one that never stopped.

    python -m training.data.speech --out data/speech16k.npz
    python -m training.train_speech codec --data data/speech16k.npz --out runs/speech-codec --threads 1
    python -m training.train_speech phonemes --data data/speech16k.npz --out runs/speech-phonemes --threads 1
    python -m training.train_speech tokenize --data data/speech16k.npz --codec runs/speech-codec --out runs/speech-codes.npz
    python -m training.train_speech calibrate --data data/speech16k.npz --codec runs/speech-codec \
        --recogniser runs/speech-phonemes --out runs/speech-calibration.json
    python -m training.train_speech export --codec runs/speech-codec --recogniser runs/speech-phonemes \
        --out runs/speech-export
    python -m training.train_speech bundle-recogniser --recogniser runs/speech-phonemes --data data/speech16k.npz \
        --out audio/assets/phoneme-recogniser

`calibrate` takes exported folders too: `--codec audio/assets/speech-tts/codec --half --recogniser
audio/assets/phoneme-recogniser` measures the bundled (float16) recogniser on the held-out audio.
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

from training.data.speech import SAMPLE_RATE, load_corpus, utterance
from training.train import add_training_arguments, last_log, load_trained, round_to_half, train_loop, wall_clock
from mmgen.audio.phonemes import PHONEMES, reduce_phonemes
from mmgen.audio.recogniser import PhonemeRecogniser, phoneme_error_rate

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
             **{k: data[k] for k in ("text", "kind", "phonemes", "voice", "speed", "pitch", "is_eval", "inventory") if k in data},
             frame_rate=np.array(codec.config.frame_rate), codebook_size=np.array(codec.config.codebook_size))
    print(f"wrote {args.out}: {len(codes)} utterances, {int(frames.sum())} frames x {codes[0].shape[1]} codebooks")


# ---------------------------------------------------------------------------- phoneme recogniser


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
                      blank=model.blank, zero_infinity=True)


def train_phonemes(args) -> None:
    data = load_corpus(args.data)
    train, held_out = Speech(data, "train"), Speech(data, "eval")
    torch.manual_seed(args.seed)
    model = PhonemeRecogniser(**RECOGNISER, sample_rate=SAMPLE_RATE)
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
    per = phoneme_error_rate(held_out.phonemes, model.transcribe(held_out.waves, SAMPLE_RATE))
    print(json.dumps({"held_out_per": round(per, 4), "held_out": len(held_out)}))


def load_recogniser(run: str | Path | None = None) -> PhonemeRecogniser:
    """A run of `phonemes` (checkpoint.pt + config.json), or a recogniser folder (`export`'s
    `<out>/phoneme-recogniser`; None: the bundled one)."""
    if run is None or not (Path(run) / "checkpoint.pt").exists():
        return PhonemeRecogniser.from_pretrained(run)
    config = json.loads((Path(run) / "config.json").read_text())
    model = PhonemeRecogniser(**config["recogniser"], sample_rate=SAMPLE_RATE, inventory=config.get("inventory", PHONEMES))
    return load_trained(model, run)


def trained_step(run: str | Path) -> int | None:
    """The step of a training run's checkpoint; None for an exported folder."""
    return last_log(str(run))["final"]["step"] if (Path(run) / "checkpoint.pt").exists() else None


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
def calibration(held_out: Speech, recogniser: PhonemeRecogniser, codec: Any) -> dict[str, Any]:
    """PER of the recogniser on held-out audio as it is, after the codec, and on two controls (the
    audio scored against another utterance's phonemes; its 50 ms chunks shuffled), plus the
    codec's held-out reconstruction error (mel L1 as in training, SI-SNR) and codes used per book."""
    mel_loss = MelLoss()
    recon, codes = roundtrip(codec, held_out.waves)
    codes = torch.cat(codes)
    mel = [float(mel_loss(audio[None, None], wave[None, None])) for audio, wave in zip(recon, held_out.waves)]
    snr = [float(si_snr(audio, wave)) for audio, wave in zip(recon, held_out.waves)]
    generator = torch.Generator().manual_seed(0)
    refs = held_out.phonemes
    real = recogniser.transcribe(held_out.waves, SAMPLE_RATE)
    result = {
        "held_out": len(refs), "per_real": phoneme_error_rate(refs, real),
        "per_codec": phoneme_error_rate(refs, recogniser.transcribe(recon, SAMPLE_RATE)),
        "per_mismatched": phoneme_error_rate(refs[1:] + refs[:1], real),
        "per_time_shuffled": phoneme_error_rate(
            refs, recogniser.transcribe([time_shuffled(w, generator) for w in held_out.waves], SAMPLE_RATE)),
        "codec_mel_l1": float(np.mean(mel)), "codec_si_snr_db": float(np.mean(snr)),
        "codec_codes_used": [len(torch.unique(book)) for book in codes.T],
    }
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def calibrate(args) -> None:
    """`calibration` of a recogniser (run or folder) and a codec (run or folder, `--half`: rounded
    to float16 first), printed and written to `--out`."""
    codec = load_codec(args.codec)
    if args.half:
        round_to_half(codec)
    figures = calibration(Speech(load_corpus(args.data), "eval"), load_recogniser(args.recogniser), codec)
    result = {"held_out": figures.pop("held_out"), "codec_run": str(args.codec), "codec_half": bool(args.half),
              "codec_step": trained_step(args.codec), "recogniser": str(args.recogniser),
              "recogniser_step": trained_step(args.recogniser), **figures}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


#: Everyday sentences outside the corpus (its texts are emoji names, numbers and template
#: sentences over a small vocabulary): how the recogniser does on words it never heard.
UNSEEN_TEXTS = (
    "Hello there, how are you today?", "The weather was much warmer than we expected.",
    "Please bring three thick jackets for the journey north.", "She measured the treasure with a golden ruler.",
    "My brother enjoys fishing at the quiet village pond.", "We should finish the chapter before midnight.",
    "Can you imagine a garage full of purple bicycles?", "The teacher asked the children to sing louder.",
    "Strong coffee helps me think during early meetings.", "Nobody knew why the old bridge had been closed.",
    "Jump over the fence and follow the narrow path.", "His voice sounded calm, although the news was bad.",
    "The library opens at nine on weekday mornings.", "Fresh bread smells wonderful in the kitchen.",
    "They played chess by the window until it got dark.", "Our neighbour's dog barks whenever the postman arrives.",
    "I usually walk to work when it isn't raining.", "The museum shows paintings from several centuries.",
    "Thank you for the lovely birthday present.", "Sugar and salt look alike but taste very different.",
)


@torch.no_grad()
def unseen_per(recogniser: PhonemeRecogniser, texts: tuple[str, ...] = UNSEEN_TEXTS) -> float:
    """PER on `texts` spoken as the corpus speaks a text (voice, speed and pitch from its hash;
    16 kHz; trimmed), against the phonemes espeak-ng spoke."""
    from training.data.speech import speak, to_16k, voice_for

    waves, refs = [], []
    for text in texts:
        audio, rate, ipa = speak(text, *voice_for(text))
        waves.append(torch.from_numpy(to_16k(audio, rate).astype(np.float32) / 32768))
        refs.append(" ".join(reduce_phonemes(ipa)))
    return phoneme_error_rate(refs, recogniser.transcribe(waves, SAMPLE_RATE))


def recogniser_card(f: dict[str, Any]) -> str:
    """The bundled recogniser's MODEL_CARD.md from the figures `bundle_recogniser` measured."""
    a, c = f["args"], f["calibration"]
    stopped = "" if f["step"] >= a["steps"] else (
        f"\n\n**These weights are the run's step-{f['step']} checkpoint, exported while it was still training\n"
        f"towards {a['steps']} steps** (re-run the last command below when it ends).")
    return f"""# phoneme-recogniser: the project's speech intelligibility meter

A CTC phoneme recogniser (`mmgen.audio.recogniser.PhonemeRecogniser`): log-mel (80 bins, 25 ms
window, 10 ms hop, 16 kHz) -> two convolutions (the first halves the rate) with LayerNorm and
GELU -> a {f['recogniser']['layers']}-layer bidirectional GRU ({f['recogniser']['hidden']} per direction) -> {len(f['inventory'])} phonemes plus the CTC blank at 50 frames/s,
greedy decoding. {f['params'] / 1e6:.2f}M parameters, stored in float16 ({f['bytes'] / 1e6:.1f} MB), computed in float32.
`mmgen eval per AUDIO --text TEXT` scores any audio against the phonemes espeak-ng gives for its
text (`mmgen.audio.phonemes.text_phonemes`, the reduction the training data used).

## Data

`training/data/speech.py` (`data/speech16k.npz`): English texts the project makes itself (emoji
names, spelled-out numbers, short template sentences) spoken by Debian's espeak-ng 1.51 with
{len(f['voices'])} voices ({', '.join(f['voices'])}), 140-200 words per minute, pitch 35-65, chosen by a hash
of the text; 16 kHz, 0.5-3 s each. Labels are the phonemes espeak-ng spoke (its IPA for the
voice's accent), reduced to the {len(f['inventory'])}-symbol inventory. {f['train']} training utterances ({f['train_hours']:.2f} h),
{c['held_out']} held out (5% by a hash of the text, never trained on).

## Training

`training/train_speech.py phonemes`: CTC loss, AdamW (betas 0.9/0.95, weight decay
{a['weight_decay']}), peak learning rate {a['lr']} with {a['warmup']} warm-up steps and a cosine schedule to step {a['steps']},
batch {a['batch_size']}, gradient clipping 1.0, seed {a['seed']}. Augmentation per utterance: gain -6..+2 dB, white
noise 30-50 dB below the speech, SpecAugment (2 time masks up to 8 frames, 2 mel masks up to 8
bins). {f['step']} steps on {a['threads']} CPU thread(s) of this project's shared 2-core machine, {f['wall_clock'] / 60:.0f} minutes of
wall clock ({f['invocations']} invocation(s); other jobs shared the cores), last logged training loss {f['loss']:.3f}.{stopped}

## Held-out phoneme error rate

PER = (substitutions + deletions + insertions) / reference phonemes, over all {c['held_out']} held-out
utterances together, greedy CTC, batches of 32 (`transcribe`'s default), the float16 weights as
shipped:

| audio | PER |
|---|---|
| real espeak-ng audio | {c['per_real']:.2%} |
| round trip through the bundled speech codec (`{f['codec']}`, float16) | {c['per_codec']:.2%} |
| control: scored against another utterance's phonemes | {c['per_mismatched']:.1%} |
| control: the audio's 50 ms chunks shuffled in time | {c['per_time_shuffled']:.1%} |

The float32 weights score {f['per_float32']:.2%} on the real audio; {f['differ']} of {c['held_out']} transcripts change
when the weights are rounded to float16. The codec's held-out mel L1 is {c['codec_mel_l1']:.3f}, its SI-SNR
{c['codec_si_snr_db']:.1f} dB.

Words it never heard: on {f['unseen_count']} everyday sentences outside the corpus (`UNSEEN_TEXTS` in
`training/train_speech.py`, spoken by espeak-ng as the corpus speaks a text), PER {f['unseen']:.1%}.

## Limits

- English only, and only espeak-ng's voices: it learned espeak's synthetic speech (8 voice
  variants under Data). On human speech or other text-to-speech voices its error rate is
  unmeasured and surely higher; compare models under it, not against human listeners.
- The expected phonemes follow an accent: `--voice` (en-us by default; en-gb, en-gb-x-rp,
  en-gb-scotland) should match the one spoken, or accent differences count as errors.
- Trained on 0.5-3 s utterances over a small vocabulary; new words score worse (the sentences
  above), longer audio is transcribed whole, unmeasured beyond a few seconds.
- It hears phonemes, not prosody, voice quality or naturalness; no language model, so a
  plausible-sounding wrong word scores its phoneme edits only.
- Sounds outside the inventory are mapped to the nearest symbols espeak's reduction gives; a text
  whose espeak phonemes fall outside it is refused in one line.

## Reproduce

```bash
apt-get install espeak-ng unicode-data
python -m training.data.speech --out data/speech16k.npz
python -m training.train_speech phonemes --data data/speech16k.npz --out runs/speech-phonemes --threads 1
python -m training.train_speech bundle-recogniser --recogniser runs/speech-phonemes --data data/speech16k.npz \\
    --codec {f['codec']} --out audio/assets/phoneme-recogniser
```

The last command exports the float16 folder, measures every figure above on it and writes this
card (torch {f['torch']}).
"""


@torch.no_grad()
def bundle_recogniser(args) -> None:
    """Export a recogniser run as a float16 folder, measure it (`calibration` with the codec rounded
    to float16, and the float32 run on the same audio) and write the folder's MODEL_CARD.md."""
    from training.data.speech import VOICES

    data = load_corpus(args.data)
    held_out = Speech(data, "eval")
    trained = load_recogniser(args.recogniser)
    folder = trained.save_pretrained(args.out, torch.float16)
    shipped = PhonemeRecogniser.from_pretrained(folder)
    figures = calibration(held_out, shipped, round_to_half(load_codec(args.codec)))
    full, half = (model.transcribe(held_out.waves, SAMPLE_RATE) for model in (trained, shipped))
    run = last_log(args.recogniser)
    config = json.loads((Path(args.recogniser) / "config.json").read_text())
    seconds, invocations = wall_clock(args.recogniser)
    train = ~data["is_eval"].astype(bool)
    lengths = np.diff(data["offsets"])
    card = recogniser_card({
        "args": run["args"], "step": run["final"]["step"], "loss": run["final"]["loss"], "params": config["params"],
        "recogniser": shipped.config, "inventory": shipped.inventory, "bytes": (folder / "model.safetensors").stat().st_size,
        "voices": VOICES, "train": int(train.sum()), "train_hours": float(lengths[train].sum()) / SAMPLE_RATE / 3600,
        "wall_clock": seconds, "invocations": invocations, "calibration": figures, "codec": str(args.codec),
        "per_float32": phoneme_error_rate(held_out.phonemes, full), "differ": sum(a != b for a, b in zip(full, half)),
        "unseen": unseen_per(shipped), "unseen_count": len(UNSEEN_TEXTS), "torch": torch.__version__})
    (folder / "MODEL_CARD.md").write_text(card)
    print(json.dumps({"folder": str(folder), "step": run["final"]["step"], **figures}))
    print(f"wrote {folder / 'MODEL_CARD.md'}")


@torch.no_grad()
def export(args) -> None:
    """The codec as a transformers folder and the recogniser as safetensors + config.json (the
    format of `audio/assets/phoneme-recogniser`), both float16; `--recogniser-only` skips the codec."""
    out = Path(args.out)
    if not args.recogniser_only:
        codec = round_to_half(load_codec(args.codec)).half()
        codec.save_pretrained(out / "codec")
        print(f"wrote {out / 'codec'}")
    folder = load_recogniser(args.recogniser).save_pretrained(out / "phoneme-recogniser", torch.float16)
    print(f"wrote {folder}")


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
    exp.add_argument("--codec")
    for name in ("--recogniser", "--out"):
        exp.add_argument(name, required=True)
    exp.add_argument("--recogniser-only", action="store_true", help="export the recogniser alone (no --codec)")
    bundle = jobs.add_parser("bundle-recogniser", help="export a recogniser run as the bundled float16 folder, "
                             "measured, with its model card")
    for name in ("--recogniser", "--data", "--out"):
        bundle.add_argument(name, required=True)
    bundle.add_argument("--codec", default="audio/assets/speech-tts/codec",
                        help="the codec whose round trip the card reports (rounded to float16)")
    bundle.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.job == "export" and not (args.codec or args.recogniser_only):
        parser.error("export needs --codec (or --recogniser-only)")
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    {"codec": train_codec, "phonemes": train_phonemes, "tokenize": tokenize, "calibrate": calibrate,
     "export": export, "bundle-recogniser": bundle_recogniser}[args.job](args)


if __name__ == "__main__":
    main()
