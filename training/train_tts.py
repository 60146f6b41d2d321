"""Train the bundled text-to-speech pair on espeak-ng speech: `speech-tts` and its drafter
`speech-tts-draft`.

Both are transformers' own `DiaForConditionalGeneration` in small configurations: Dia's byte-level
text encoder (`DiaTokenizer`, text read as "[S1] <text>" as `DiaSpeech.text_with_speaker` does)
and its multi-channel audio decoder over the codes of the project's 16 kHz DAC codec
(`training/train_speech.py`), in Dia's delayed layout (`DELAY`). The decoder vocabulary is the
codebook, then EOS, PAD and BOS. They load through `TTSPipeline.from_pretrained(folder)` exactly
as official Dia checkpoints do (the codec is the folder's `codec/`).

Training inputs are those `DiaProcessor(..., generation=False, output_labels=True)` builds from
the same codes (BOS, the codes, EOS, each codebook delayed; labels the inputs shifted by one with
PAD and BOS set to -100), built here from the codes `train_speech.py tokenize` precomputed, with
one difference: rows are right padded (the processor left pads). Dia's decoder knows positions
only through RoPE in self-attention, so a row's computation does not depend on where its padding
is, and right padding leaves no query position with every key masked. The loss is the model's
own (cross-entropy over every channel's labelled positions). `TEXT_DROPOUT` of the training rows
read all-zero text ids (same mask): the unconditional branch of Dia's classifier-free guidance.

The loop, checkpointing and data order are `training/train.py`'s (`train_loop`: resumable,
randomness from (seed, step)), so a killed and resumed run ends with the weights of one that
never stopped. Held-out utterances (the corpus' `is_eval`) are never trained on.

    python -m training.train_speech tokenize --data data/speech16k.npz --codec runs/speech-codec \
        --out runs/speech-codes.npz
    python -m training.train_tts target --codes runs/speech-codes.npz --out runs/tts-target --threads 1
    python -m training.train_tts draft --codes runs/speech-codes.npz --out runs/tts-draft --threads 1
    python -m training.train_tts export --codec runs/speech-export/codec --target runs/tts-target \
        --draft runs/tts-draft --out audio/assets
    python -m training.train_tts card --codes runs/speech-codes.npz --target runs/tts-target \
        --draft runs/tts-draft --assets audio/assets --out audio/assets/speech-tts/MODEL_CARD.md

The card also hears the exported folders (`--assets`) speak the held-out texts as written, one
call per text (PER under the bundled recogniser, texts that end, durations; `--speak N` for the
first N only), beside the codec's round-trip floor. Its "Decoding" section is the frame decoders
on the exported pair, from the benchmarks' results: `--decoding` takes `benchmarks.tts_bundled
--out` files (batch 1, one per thread count), `--batch-decoding` a `benchmarks.tts_continuous_batching
--json` file. The `decoding` job writes that section alone into an existing card:

    python -m training.train_tts decoding --card audio/assets/speech-tts/MODEL_CARD.md \
        --results runs/speech-bundled-t1.json runs/speech-bundled-t2.json --batch-results runs/speech-batch8-t1.json

`--codec` is either a codec run of `train_speech.py codec` (checkpoint.pt + config.json) or a
transformers `DacModel` folder (`train_speech.py export` writes one in `<out>/codec`).

What a run measures as it goes (`--eval-every N`): the held-out teacher-forced loss with and
without the text, and with `--eval-speak K --codec FOLDER` the model speaking K held-out texts,
scored by the phoneme recogniser (PER, texts that end, durations; best.pt keeps the lowest PER).
`--text-input phonemes` has the encoder read each utterance's espeak phonemes, one letter each
(`mmgen.audio.phonemes.spell_phonemes`), instead of the text's bytes:

    python -m training.train_tts target --codes runs/speech-codes.npz --out runs/tts-phon --threads 1 \
        --text-input phonemes --guided-attention 1.0 --eval-every 250 --eval-speak 48 --codec audio/assets/speech-tts/codec

One voice first (issue 30): codes of the one-voice corpus (`training/data/speech.py
--one-voice`), then a second stage from that run's weights (`--init`) with a sharper guide
(`--guide-width`) and noisier past codes, so the decoder reads each word where it is:

    python -m training.data.speech --out data/speech16k-en-us.npz --one-voice
    python -m training.train_speech tokenize --data data/speech16k-en-us.npz --codec audio/assets/speech-tts/codec \
        --out runs/speech-codes-en-us.npz --threads 1
    python -m training.train_tts target --codes runs/speech-codes-en-us.npz --out runs/tts-en-us --threads 1 \
        --text-input phonemes --guided-attention 1.0 --code-noise 0.3 --steps 6000 --eval-every 250 --eval-speak 48 \
        --codec audio/assets/speech-tts/codec
    python -m training.train_tts target --codes runs/speech-codes-en-us.npz --out runs/tts-en-us-2 --threads 1 \
        --init runs/tts-en-us --text-input phonemes --guided-attention 1.0 --guide-width 0.1 --code-noise 0.5 \
        --steps 6000 --eval-every 250 --eval-speak 48 --codec audio/assets/speech-tts/codec

The shipped pair is these stages (the first stopped at step 1,900) and a drafter trained the same
way in three stages; its card lists every command.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from training.train import add_training_arguments, keep_window_cost, last_log, load_trained, round_to_half, train_loop, trained_weights
from mmgen.audio.dia import TEXT_FRONTEND_KEY
from mmgen.audio.phonemes import spell_phonemes
from mmgen.files import write_atomic

#: Encoder / decoder sizes of the pair (transformers' DiaEncoderConfig / DiaDecoderConfig fields).
PRESETS = {
    "target": dict(
        encoder=dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=64),
        decoder=dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, cross_num_attention_heads=4, cross_num_key_value_heads=2,
                     cross_head_dim=64),
    ),
    "draft": dict(
        encoder=dict(num_hidden_layers=2, hidden_size=128, intermediate_size=384, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=64),
        decoder=dict(num_hidden_layers=2, hidden_size=192, intermediate_size=512, num_attention_heads=3,
                     num_key_value_heads=1, head_dim=64, cross_num_attention_heads=3, cross_num_key_value_heads=1,
                     cross_head_dim=64),
    ),
}
#: Longest text (tokens: bytes, "[S1]" one token) and frame sequence (BOS + frames + delay + EOS) the
#: models read; the corpus' longest are 48 tokens and 150 frames (3 s at 50 frames/s).
TEXT_CONTEXT, FRAME_CONTEXT = 128, 256
#: The espeak-ng voice a phoneme-reading export spells its users' text with (the corpus spoke
#: eight voice variants; its phonemes follow each utterance's accent).
PHONEME_VOICE = "en-us"
#: Share of training rows whose text is zeroed (the unconditional branch of guidance).
TEXT_DROPOUT = 0.1
#: Generation defaults saved with the bundle (`generation_config.json`): sampled at temperature 1
#: (the distribution trained on; codec LMs decoded greedily tend to repeat frames), top-k 32 of the
#: 256 codes (Dia also takes it as its guidance filter: candidates are the top 32 of the guided
#: logits, drawn from the conditional ones), guidance scale 3 (Dia's published default).
SAMPLING = dict(do_sample=True, temperature=1.0, top_k=32, top_p=1.0, guidance_scale=3.0)


#: Guided attention (Tachibana et al. 2018, "Efficiently Trainable Text-to-Speech System Based on
#: Deep Convolutional Networks with Guided Attention"): the penalty on attending text position
#: s/S at frame t/T is 1 - exp(-(s/S - t/T)^2 / (2 g^2)); g is its width.
GUIDE_WIDTH = 0.2


def delay_pattern(num_codebooks: int) -> list[int]:
    """Codebook c delayed by c frames: each residual codebook sees the coarser ones of its frame."""
    return list(range(num_codebooks))


# ---------------------------------------------------------------------------- data


def text_with_speaker(text: str) -> str:
    """What `DiaSpeech.text_with_speaker` reads (untagged text is speaker 1)."""
    return text if text.lstrip().startswith("[S") else f"[S1] {text.strip()}"


def delayed_row(codes: torch.Tensor, delay: list[int], eos: int, pad: int, bos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One utterance's training row as `DiaProcessor` builds it: codes [T, C] -> decoder inputs
    [T + 1 + D, C] and labels [T + 1 + D, C] (D = max delay). Undelayed, codebook c is BOS, its T
    codes, EOS; delayed by d it is d more BOS before and PAD after; labels are the next position's
    token, -100 where that is PAD or BOS."""
    T, C = codes.shape
    u = torch.cat([torch.full((1, C), bos), codes.long(), torch.full((1, C), eos)])
    out = torch.full((T + 2 + max(delay), C), pad, dtype=torch.long)
    for c, d in enumerate(delay):
        out[:d, c] = bos
        out[d:d + T + 2, c] = u[:, c]
    labels = out[1:].clone()
    labels[(labels == pad) | (labels == bos)] = -100
    return out[:-1], labels


class CodesData:
    """One split of `train_speech.py tokenize`'s codes file: per utterance its codes [frames, C]
    and its text's ids ("[S1] <text>", Dia's byte-level tokenizer)."""

    def __init__(self, path: str | Path, split: str = "train", text_input: str = "text"):
        from transformers import DiaTokenizer

        data = np.load(path)
        is_eval = data["is_eval"].astype(bool)
        keep = np.flatnonzero(is_eval if split == "eval" else ~is_eval)
        codes, offsets = data["codes"], data["offsets"]
        self.codes = [torch.from_numpy(codes[offsets[i]:offsets[i + 1]].astype(np.int64)) for i in keep]
        self.texts = [str(data["text"][i]) for i in keep]
        # What each utterance's espeak voice said (`training/data/speech.py`), where the file has it.
        self.phonemes = [str(data["phonemes"][i]) for i in keep] if "phonemes" in data else None
        self.written = list(self.texts)  # the texts as written, before any phoneme spelling
        self.voices = sorted({str(v) for v in data["voice"][keep]}) if "voice" in data else None
        self.kinds = [str(data["kind"][i]) for i in keep] if "kind" in data else None  # the corpus' text kinds
        self.codebook_size = int(data["codebook_size"])
        self.num_codebooks = int(codes.shape[1])
        self.frame_rate = float(data["frame_rate"]) if "frame_rate" in data else None
        if text_input == "phonemes":
            if self.phonemes is None:
                raise ValueError(f"{path} holds no phonemes to read instead of the text")
            # What the utterance's espeak voice said, one letter per phoneme: the encoder reads
            # sounds, not English spelling (the pipeline's espeak front end writes the same).
            self.texts = [spell_phonemes(p) for p in self.phonemes]
        tokenizer = DiaTokenizer()
        self.text_ids = [torch.tensor(tokenizer(text_with_speaker(t))["input_ids"]) for t in self.texts]
        longest = max(map(len, self.text_ids), default=0)
        if longest > TEXT_CONTEXT:
            raise ValueError(f"{path}: a text of {longest} bytes exceeds the models' {TEXT_CONTEXT}")
        frames = max((len(c) for c in self.codes), default=0)
        if frames + 2 + max(delay_pattern(self.num_codebooks)) > FRAME_CONTEXT:
            raise ValueError(f"{path}: an utterance of {frames} frames exceeds the models' {FRAME_CONTEXT} positions")

    def __len__(self) -> int:
        return len(self.codes)

    @property
    def tokens(self) -> dict[str, int]:
        v = self.codebook_size
        return {"eos": v, "pad": v + 1, "bos": v + 2}

    def batch(self, index: torch.Tensor, generator: torch.Generator | None = None,
              text_dropout: float = 0.0, code_noise: float = 0.0) -> dict[str, torch.Tensor]:
        """Model inputs with `labels` [B * C, L] (the processor's layout): text ids right padded
        with 0 and its mask; decoder rows right padded with PAD (mask 0, labels -100); rows drawn
        under `text_dropout` read all-zero text; with `code_noise`, that share of the decoder's
        input codes (never BOS, EOS or PAD; labels untouched) is replaced by random codes."""
        t = self.tokens
        delay = delay_pattern(self.num_codebooks)
        rows = [delayed_row(self.codes[i], delay, t["eos"], t["pad"], t["bos"]) for i in index.tolist()]
        texts = [self.text_ids[i] for i in index.tolist()]
        B, C, L, S = len(rows), self.num_codebooks, max(len(r[0]) for r in rows), max(map(len, texts))
        decoder = torch.full((B, L, C), t["pad"], dtype=torch.long)
        labels = torch.full((B, L, C), -100, dtype=torch.long)
        decoder_mask = torch.zeros(B, L, dtype=torch.long)
        ids, mask = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
        for b, ((inputs, target), text) in enumerate(zip(rows, texts)):
            decoder[b, :len(inputs)], labels[b, :len(inputs)], decoder_mask[b, :len(inputs)] = inputs, target, 1
            ids[b, :len(text)], mask[b, :len(text)] = text, 1
        if text_dropout:
            drop = torch.rand(B, generator=generator) < text_dropout
            ids[drop] = 0
        if code_noise:
            # Tacotron's always-on prenet dropout, for a token decoder: the past frames cannot
            # be trusted alone, so the model has to read where the text says it is.
            noisy = (torch.rand(decoder.shape, generator=generator) < code_noise) & (decoder < self.codebook_size)
            decoder = torch.where(noisy, torch.randint(0, self.codebook_size, decoder.shape, generator=generator), decoder)
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder,
                "decoder_attention_mask": decoder_mask, "labels": labels.transpose(1, 2).reshape(B * C, L)}


# ---------------------------------------------------------------------------- models


def dia_config(preset: str, codebook_size: int, num_codebooks: int) -> Any:
    from transformers import DiaConfig, DiaDecoderConfig, DiaEncoderConfig

    p = PRESETS[preset]
    enc = DiaEncoderConfig(**p["encoder"], vocab_size=256, max_position_embeddings=TEXT_CONTEXT)
    dec = DiaDecoderConfig(**p["decoder"], cross_hidden_size=p["encoder"]["hidden_size"], vocab_size=codebook_size + 4,
                           num_channels=num_codebooks, eos_token_id=codebook_size, pad_token_id=codebook_size + 1,
                           bos_token_id=codebook_size + 2, max_position_embeddings=FRAME_CONTEXT)
    return DiaConfig(encoder_config=enc, decoder_config=dec, delay_pattern=delay_pattern(num_codebooks))


def new_model(config: Any, seed: int) -> Any:
    """A Dia with the bundle's generation defaults (`SAMPLING`)."""
    from transformers import DiaForConditionalGeneration

    torch.manual_seed(seed)
    model = DiaForConditionalGeneration(config)
    for key, value in SAMPLING.items():
        setattr(model.generation_config, key, value)
    model.generation_config.max_length = FRAME_CONTEXT
    model.generation_config._from_model_config = False  # the saved defaults are the bundle's, not derived
    return model


def load_run(run: str | Path) -> Any:
    """A trained run's model (its config from the run's config.json)."""
    from transformers import DiaConfig

    config = DiaConfig.from_dict(json.loads((Path(run) / "config.json").read_text())["dia"])
    return load_trained(new_model(config, 0), str(run))


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def steps_per_second() -> Callable[[], float]:
    """A clock: steps per second over the calls so far in this process."""
    started, calls = time.time(), [0]

    def tick() -> float:
        calls[0] += 1
        return round(calls[0] / max(time.time() - started, 1e-9), 3)

    return tick


def split_by_length(batch: dict[str, torch.Tensor], parts: int) -> list[tuple[dict[str, torch.Tensor], float]]:
    """The rows of `batch` sorted by length into `parts` groups, each cut to its own longest row,
    with each group's share of the labelled tokens: the shares times the groups' mean losses sum
    to the whole batch's mean loss (the same gradient, less padding to compute)."""
    B = batch["decoder_input_ids"].shape[0]
    lengths, text_lengths = batch["decoder_attention_mask"].sum(1), batch["attention_mask"].sum(1)
    labels = batch["labels"].view(B, -1, batch["labels"].shape[-1])
    total = int((labels != -100).sum())
    out = []
    for rows in torch.argsort(lengths, stable=True).tensor_split(min(parts, B)):
        L, S = int(lengths[rows].max()), int(text_lengths[rows].max())
        part = {"input_ids": batch["input_ids"][rows, :S], "attention_mask": batch["attention_mask"][rows, :S],
                "decoder_input_ids": batch["decoder_input_ids"][rows, :L],
                "decoder_attention_mask": batch["decoder_attention_mask"][rows, :L],
                "labels": labels[rows, :, :L].reshape(-1, L)}
        out.append((part, int((part["labels"] != -100).sum()) / total))
    return out


def guided_attention_loss(cross_attentions: tuple, text_mask: torch.Tensor, frame_mask: torch.Tensor,
                          width: float = GUIDE_WIDTH) -> torch.Tensor:
    """The mean over every layer, head and unpadded decoder position of the cross-attention
    mass far from the diagonal (`GUIDE_WIDTH`): 0 for a monotonic alignment that reads the text
    at the speech's pace. Small attention models learn to align slowly (the bundled model never
    did); this prior makes the text matter from the first steps."""
    S, L = text_mask.sum(1, keepdim=True).clamp_min(1), frame_mask.sum(1, keepdim=True).clamp_min(1)
    s = torch.arange(text_mask.shape[1], device=text_mask.device)[None] / S
    t = torch.arange(frame_mask.shape[1], device=frame_mask.device)[None] / L
    penalty = 1 - torch.exp(-(s[:, None, :] - t[:, :, None]).pow(2) / (2 * width ** 2))  # [B, L, S]
    penalty = penalty * text_mask[:, None, :] * frame_mask[:, :, None]
    queries = frame_mask.sum()
    per_layer = [(a.float() * penalty[:, None]).sum() / (a.shape[1] * queries) for a in cross_attentions]
    return torch.stack(per_layer).mean()


def part_loss(model: Any, part: dict[str, torch.Tensor], guide: float,
              width: float = GUIDE_WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's loss, the guided attention loss of that `width`) of one group of rows; the
    latter is zero without computing attention weights when `guide` is 0."""
    if not guide:
        return model(**part).loss, torch.zeros(())
    out = model(**part, output_attentions=True)
    return out.loss, guided_attention_loss(out.cross_attentions, part["attention_mask"], part["decoder_attention_mask"], width)


@torch.no_grad()
def held_out_figures(model: Any, data: CodesData, speaker: Optional["HeldOutSpeech"] = None) -> dict[str, Any]:
    """Teacher-forced loss on the held-out split with its text and with the text zeroed (the gap is
    what the model reads from the text), and the cross-attention's distance from the diagonal;
    with a `speaker`, the model also speaks held-out texts and is scored on what it says. The
    score (for `best.pt`) is the gap, or 1 - PER when the model speaks."""
    with_text, no_text = held_out_loss(model, data), held_out_loss(model, data, drop_text=True)
    guide = []
    for start in range(0, len(data), 32):
        inputs = data.batch(torch.arange(start, min(start + 32, len(data))))
        guide.append(part_loss(model, inputs, 1.0)[1].item())
    gap = no_text["loss"] - with_text["loss"]
    figures = {"loss": round(with_text["loss"], 4), "no_text": round(no_text["loss"], 4), "gap": round(gap, 4),
               "guided": round(float(np.mean(guide)), 4), "score": gap, "metric": "gap"}
    if speaker is not None:
        spoken = speaker(model)
        figures.update(spoken, score=1 - spoken["per"], metric="1 - per")
    return figures


class HeldOutSpeech:
    """The model speaks the first `count` held-out texts through `TTSPipeline` at the bundle's
    sampling defaults (utterance k from seed k, so every evaluation hears the same draws), and
    the project's phoneme recogniser scores it: PER against the phonemes the utterance's espeak
    voice said, the share of texts that end before the budget, and the median ratio of the
    spoken duration to the reference's (issue 30's figures, on a sample)."""

    def __init__(self, data: CodesData, codec: str | Path, count: int, recogniser: str | Path | None = None):
        from transformers import DacModel

        from mmgen.audio.recogniser import PhonemeRecogniser

        self.data, self.count = data, min(count, len(data))
        self.codec = DacModel.from_pretrained(codec).float().eval()
        self.recogniser = PhonemeRecogniser.from_pretrained(recogniser)

    def __call__(self, model: Any) -> dict[str, Any]:
        """A model being trained, reading what it trains on (`data.texts`: spelled phonemes for a
        phoneme run)."""
        from transformers import DiaTokenizer

        from mmgen.audio import TTSPipeline

        return self.score(TTSPipeline(model, DiaTokenizer(), self.codec), self.data.texts)

    def score(self, pipe: Any, texts: list[str]) -> dict[str, Any]:
        """`pipe` speaking `texts` (the held-out utterances' texts, in order): PER, the share that
        ended, the median ratio of spoken to reference duration and the share within 25% of it."""
        from mmgen.audio.recogniser import phoneme_error_rate

        heard, ended, ratios = [], 0, []
        for k in range(self.count):
            out = pipe(texts[k], generator=torch.Generator().manual_seed(k))
            heard.append(self.recogniser.transcribe(out.audio, out.sampling_rate)[0])
            ended += int(out.lengths[0]) < FRAME_CONTEXT - 1
            ratios.append(out.codes[0].shape[1] / len(self.data.codes[k]))
        ratios = np.array(ratios)
        figures = {"per": round(phoneme_error_rate(self.data.phonemes[:self.count], heard), 4),
                   "ended": round(ended / self.count, 3), "duration_ratio": round(float(np.median(ratios)), 3),
                   "duration_within_25": round(float(np.mean(np.abs(ratios - 1) <= 0.25)), 3)}
        if self.data.kinds is not None:  # PER per kind of text (the codes file says each utterance's)
            kinds = self.data.kinds[:self.count]
            figures["per_by_kind"] = {kind: {
                "texts": kinds.count(kind),
                "phonemes": sum(len(p.split()) for p, k in zip(self.data.phonemes, kinds) if k == kind),
                "per": round(phoneme_error_rate([p for p, k in zip(self.data.phonemes, kinds) if k == kind],
                                                [h for h, k in zip(heard, kinds) if k == kind]), 4)}
                for kind in sorted(set(kinds))}
        return figures

    def codec_floor(self, kind: Optional[str] = None) -> float:
        """PER of the reference codes decoded by the codec: what a perfect code model would score
        (on the texts of one `kind`, where the codes file says each text's)."""
        from mmgen.audio.codec import Codec

        keep = [i for i in range(self.count) if kind is None or self.data.kinds[i] == kind]
        return round(codec_round_trip_per(Codec(self.codec), [self.data.codes[i] for i in keep],
                                          [self.data.phonemes[i] for i in keep], self.recogniser), 4)


def codec_round_trip_per(codec: Any, codes: list[torch.Tensor], phonemes: list[str], recogniser: Any) -> float:
    """PER of utterances' reference codes ([T, C] each) decoded by `codec` (`mmgen.audio.codec.Codec`)
    and heard by `recogniser`, against their `phonemes`, each decoded alone as
    `HeldOutSpeech.score` decodes generated speech."""
    from mmgen.audio.recogniser import phoneme_error_rate

    heard = [recogniser.transcribe([codec.decode(c.T)], codec.sampling_rate)[0] for c in codes]
    return phoneme_error_rate(phonemes, heard)


def train_model(args) -> None:
    train = CodesData(args.codes, "train", args.text_input)
    config = dia_config(args.job, train.codebook_size, train.num_codebooks)
    model = new_model(config, args.seed)
    if args.init is not None and not (Path(args.out) / "checkpoint.pt").exists():
        # A second stage: another run's weights (same preset and codes layout), a fresh optimizer
        # and schedule; a resumed run reads its own checkpoint instead.
        model.load_state_dict(trained_weights(torch.load(Path(args.init) / "checkpoint.pt", map_location="cpu", weights_only=True)))
    if args.guided_attention or args.eval_every:
        model.set_attn_implementation("eager")  # attention weights to guide and to measure; the same function
    clock = steps_per_second()

    def loss_fn(index, generator):
        batch = train.batch(index, generator, args.text_dropout, args.code_noise)
        parts = [(part_loss(model, part, args.guided_attention, args.guide_width), share)
                 for part, share in split_by_length(batch, args.micro_batches)]
        lm = sum(loss * share for (loss, _), share in parts)
        guided = sum(g * share for (_, g), share in parts)
        metrics = {"steps_per_s": clock()}
        if args.guided_attention:
            metrics.update(lm=round(lm.item(), 4), guided=round(guided.item(), 4))
        return lm + args.guided_attention * guided, metrics

    params = parameters(model)
    print(f"{args.job}: {params / 1e6:.2f}M parameters, {len(train)} training utterances, "
          f"{train.num_codebooks} codebooks x {train.codebook_size}, delay {config.delay_pattern}")
    held_out = CodesData(args.codes, "eval", args.text_input) if args.eval_every else None
    speaker = None
    if args.eval_speak:
        if held_out is None or args.codec is None:
            raise ValueError("--eval-speak needs --eval-every and --codec (the DAC folder the codes came from)")
        speaker = HeldOutSpeech(held_out, args.codec, args.eval_speak)
    train_loop(model, loss_fn, len(train), args, {"preset": args.job, "dia": config.to_dict(), "params": params,
                                                  "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}},
               heldout=(lambda: held_out_figures(model, held_out, speaker)) if held_out is not None else None)


@torch.no_grad()
def held_out_loss(model: Any, data: CodesData, batch: int = 32, drop_text: bool = False) -> dict[str, Any]:
    """Teacher-forced cross-entropy (nats per labelled token) on `data`: overall and per codebook,
    reading the text or (`drop_text`) the zeroed text of the unconditional branch."""
    total = torch.zeros(data.num_codebooks, dtype=torch.float64)
    count = torch.zeros(data.num_codebooks, dtype=torch.float64)
    for start in range(0, len(data), batch):
        inputs = data.batch(torch.arange(start, min(start + batch, len(data))))
        labels = inputs.pop("labels")
        if drop_text:
            inputs["input_ids"].zero_()
        logits = model(**inputs).logits
        V = logits.shape[-1]
        losses = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="none")
        losses = losses.view(-1, data.num_codebooks, labels.shape[-1])
        counted = (labels != -100).view(-1, data.num_codebooks, labels.shape[-1])
        total += losses.sum((0, 2)).double()
        count += counted.sum((0, 2)).double()
    per = (total / count).tolist()
    return {"loss": float(total.sum() / count.sum()), "per_codebook": [round(x, 4) for x in per]}


# ---------------------------------------------------------------------------- export, card


@torch.no_grad()
def export(args) -> None:
    """`<out>/speech-tts` and `<out>/speech-tts-draft`: each the model (`save_pretrained`) and the
    codec in `codec/`, in `--dtype` (float16 by default; weights rounded first)."""
    from training.train_speech import load_codec

    codec = load_codec(args.codec)
    half = args.dtype == "float16"
    if half:
        codec = round_to_half(codec).half()
    out = Path(args.out)
    for name, run in (("speech-tts", args.target), ("speech-tts-draft", args.draft)):
        model = load_run(run)
        dec = model.config.decoder_config
        if (dec.vocab_size - 4, dec.num_channels) != (codec.config.codebook_size, codec.config.n_codebooks):
            raise ValueError(f"{run}: {dec.num_channels} codebooks of {dec.vocab_size - 4} codes, but the codec has "
                             f"{codec.config.n_codebooks} of {codec.config.codebook_size}")
        if half:
            model = round_to_half(model).half()
        if json.loads((Path(run) / "config.json").read_text())["args"].get("text_input") == "phonemes":
            # The pipeline spells the text in phonemes as this run's data was (`DiaSpeech.text_with_speaker`).
            setattr(model.config, TEXT_FRONTEND_KEY, {"kind": "phonemes", "voice": PHONEME_VOICE})
        keep_window_cost(model, out / name)
        model.save_pretrained(out / name)
        codec.save_pretrained(out / name / "codec")
        print(f"wrote {out / name}: {parameters(model) / 1e6:.2f}M parameters ({args.dtype}), codec {parameters(codec) / 1e6:.2f}M")


#: How the card says what the encoder reads, by `--text-input`.
TEXT_INPUTS = {
    "text": 'Text reaches the model as "[S1] <text>" in bytes.',
    "phonemes": ('The encoder reads phonemes, not spelling: each utterance\'s espeak-ng phonemes, one letter '
                 'per phoneme (`mmgen.audio.phonemes.spell_phonemes`), as "[S1] <letters>"; the exported config '
                 f'(`{TEXT_FRONTEND_KEY}`) has the pipeline spell a user\'s text the same way with espeak-ng\'s '
                 f'{PHONEME_VOICE} voice.'),
}
TOKEN_UNITS = {"text": "bytes", "phonemes": "phoneme letters"}


def voices(data: CodesData) -> str:
    if data.voices is None or len(data.voices) > 1:
        return f"{len(data.voices) if data.voices else 'several'} accent / voice variants"
    return f"one voice ({data.voices[0]})"


def text_gap_bound(codes: str, held_out: CodesData) -> str:
    """The card's sentence on how large the text gap can be: the text tells the model at most what
    it holds, its phonemes (each one of the inventory), spread over every labelled token."""
    if held_out.phonemes is None:
        return ""
    raw = np.load(codes)
    inventory = len(raw["inventory"]) if "inventory" in raw else len({p for u in held_out.phonemes for p in u.split()})
    phonemes = sum(len(u.split()) for u in held_out.phonemes)
    labelled = sum(held_out.num_codebooks * (len(c) + 1) for c in held_out.codes)  # codes and EOS per codebook
    return (f"For a model that had learned both laws exactly, the gap would be what the text tells about the codes, which is at most what the text holds: {phonemes:,} phonemes of an inventory of {inventory} over "
            f"{labelled:,} labelled tokens are at most {phonemes * math.log(inventory) / labelled:.3f} nats per token "
            "(less: phonemes are not uniform, and the past frames already tell the phonemes spoken so far). A weaker unconditional branch widens the measured gap beyond it.")


#: Everyday sentences of none of the corpus' kinds (no emoji name, number or template of
#: `training/data/speech.py`): how far a model's reading carries past what it trained on.
EVERYDAY_TEXTS = (
    "Hello there, how are you today?", "Please close the door.", "It is raining again.", "Where is the station?",
    "I like green tea.", "The meeting starts at nine.", "Thank you very much.", "Open the window, please.",
    "My phone is on the table.", "We will see you tomorrow.",
)


def everyday_per(pipe: Any, recogniser: Any) -> float:
    """PER of `pipe` speaking `EVERYDAY_TEXTS` (text k from seed k) against espeak-ng's en-us
    phonemes for them."""
    from mmgen.audio.phonemes import text_phonemes
    from mmgen.audio.recogniser import phoneme_error_rate

    heard = []
    for k, text in enumerate(EVERYDAY_TEXTS):
        out = pipe(text, generator=torch.Generator().manual_seed(k))
        heard.append(recogniser.transcribe(out.audio, out.sampling_rate)[0])
    return round(phoneme_error_rate([text_phonemes(t, "en-us") for t in EVERYDAY_TEXTS], heard), 4)


def speaking_figures(held_out: CodesData, assets: Path, count: Optional[int]) -> dict[str, Any]:
    """The exported pair speaking the first `count` held-out texts (all by default) and the
    everyday sentences, and the codec's round-trip floor on the held-out utterances (`HeldOutSpeech`)."""
    from mmgen.audio import TTSPipeline

    speaker = HeldOutSpeech(held_out, assets / "speech-tts" / "codec", count or len(held_out))
    figures: dict[str, Any] = {"count": speaker.count, "codec_floor": speaker.codec_floor()}
    if held_out.kinds is not None:
        figures["codec_floor_by_kind"] = {kind: speaker.codec_floor(kind) for kind in sorted(set(held_out.kinds[:speaker.count]))}
    for folder in ("speech-tts", "speech-tts-draft"):
        pipe = TTSPipeline.from_pretrained(assets / folder)
        figures[folder] = {**speaker.score(pipe, held_out.written), "everyday_per": everyday_per(pipe, speaker.recogniser)}
        print(folder, figures[folder], flush=True)
    return figures


#: What each kind of the corpus' texts is (`training/data/speech.py`), for the card.
KIND_NAMES = {"emoji": "emoji names", "number": "spelled-out numbers", "sentence": "short template sentences",
              "words": "strings of 2-7 words from emoji and Unicode character names with function words between"}


def corpus_kinds(*splits: CodesData) -> str:
    """The kinds of text the codes file holds, in words (the first three where it does not say)."""
    kinds = {k for data in splits for k in (data.kinds or ("emoji", "number", "sentence"))}
    return ", ".join(KIND_NAMES.get(k, k) for k in KIND_NAMES if k in kinds)


def kind_table(speaking: dict[str, Any]) -> str:
    """PER per kind of held-out text for both models (empty where the codes file has no kinds)."""
    target, draft = speaking["speech-tts"].get("per_by_kind"), speaking["speech-tts-draft"].get("per_by_kind")
    if not target:
        return ""
    floor = speaking["codec_floor_by_kind"]
    rows = "\n".join(f"| {kind} | {f['texts']} | {f['per']:.1%} | {draft[kind]['per']:.1%} | {floor[kind]:.1%} |"
                      for kind, f in target.items())
    return f"""
By kind of held-out text (the codec's floor too: the recogniser hears some kinds worse than others):

| kind | texts | speech-tts PER | speech-tts-draft PER | codec round trip (floor) |
|---|---|---|---|---|
{rows}
"""


#: Frame decoders whose frames do not follow the target's law (`tts_bundled` method names).
LOSSY_METHODS = ("mmgen entropy-switch",)


def decoding_section(bundled: list[dict[str, Any]], batched: Optional[dict[str, Any]], note: str = "") -> str:
    """The card's "## Decoding" section from `benchmarks.tts_bundled` results (batch 1, one per
    thread count) and a `benchmarks.tts_continuous_batching --json` result (batches): per method,
    frames per target forward, ms per frame, real-time factor and PER, against `mmgen ar` and
    transformers' `generate` on the same weights."""
    lines = ["## Decoding", "",
             "Batch 1: the shipped pair loaded in float32 on this project's CPU machine, each held-out utterance "
             "from its own seed, shared by every method; methods interleaved, medians over utterances (PER over "
             "all of them). \"= generate\": utterances whose frames equal transformers' `generate`'s with the same seed.",
             "", "| threads | method | frames per target forward | ms/frame (IQR) | vs mmgen ar | real-time factor | PER | = generate |",
             "|---|---|---|---|---|---|---|---|"]
    best = []
    for result in sorted(bundled, key=lambda r: r["threads"]):
        rows = {r["method"]: r for r in result["rows"]}
        ar = rows["mmgen ar"]["ms_per_frame"]["median"]
        for name, r in rows.items():
            t = r["ms_per_frame"]
            label = f"{name} (lossy; the target sampled {r['target_frame_share']:.0%} of the frames)" if name in LOSSY_METHODS else name
            lines.append(f"| {result['threads']} | {label} | {r['frames_per_forward']:.2f} | {t['median']:.2f} "
                         f"({t['q1']:.2f}-{t['q3']:.2f}) | {ar / t['median']:.2f}x | {r['rtf']:.3f} | {r['per']:.1%} | "
                         f"{r['identical_to_generate']:.0%} |")
        for name, error in result["failures"].items():
            lines.append(f"| {result['threads']} | {name} | | | | | | {error} |")
        lossless = [(ar / r["ms_per_frame"]["median"], name) for name, r in rows.items()
                    if name.startswith("mmgen") and name != "mmgen ar" and name not in LOSSY_METHODS]
        if lossless:
            best.append(f"{max(lossless)[1]} at {max(lossless)[0]:.2f}x `mmgen ar` ({threads(result['threads'])})")
    first = bundled[0]
    s = first["sampling"]
    lines += ["", f"{first['utterances']} held-out utterances, {'greedy' if first['greedy'] else 'sampled'} at the "
              f"defaults (temperature {s['temperature']}, top-k {s['top_k']}, guidance {s['guidance_scale']}); the "
              f"codec's own round trip scores {first['reference_per']['codec round trip']:.1%} PER on them. Fastest "
              f"lossless frame speculation: {'; '.join(best)}."]
    if batched is not None:
        lines += ["", f"Batches of {batched['rows'][0]['batch_size']} ({batched['rows'][0]['utterances']} held-out texts, "
                  f"{'sampled' if batched['sampled'] else 'greedy'}, {threads(batched['threads'])}, codec decoding "
                  "included): static calls of that many texts against continuous batching (a row takes the next text "
                  "when its speech ends), utterances per second, medians.", "",
                  "| method | static | continuous | forwards static / continuous |", "|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['static_utterances_per_s']:.2f} | {r['continuous_utterances_per_s']:.2f} | "
                  f"{r['static_forwards']} / {r['continuous_forwards']} |" for r in batched["rows"]]
    if note:
        lines += ["", note]
    lines += ["", "```", *[r["command"] for r in sorted(bundled, key=lambda r: r["threads"])],
              *([batched["command"]] if batched is not None else []), "```", ""]
    return "\n".join(lines)


def threads(n: int) -> str:
    return f"{n} thread{'s' if n > 1 else ''}"


def replace_section(card_text: str, section: str, before: str = "## Sampling defaults") -> str:
    """`card_text` with its section of `section`'s heading replaced by `section` (or put before
    the `before` heading where it has none)."""
    heading = section.split("\n", 1)[0] + "\n"
    if heading in card_text:
        start = card_text.index(heading)
        end = card_text.find("\n## ", start + len(heading))
        return card_text[:start] + section + ("\n" + card_text[end + 1:] if end >= 0 else "")
    at = card_text.index(before)
    return card_text[:at] + section + "\n" + card_text[at:]


def decoding(args) -> None:
    """Write the decoding figures into an existing card (its other sections stay as they are)."""
    bundled = [json.loads(Path(path).read_text()) for path in args.results]
    batched = json.loads(Path(args.batch_results).read_text()) if args.batch_results else None
    card_path = Path(args.card)
    write_atomic(card_path, replace_section(card_path.read_text(), decoding_section(bundled, batched, args.decoding_note)).encode())
    print(f"wrote {card_path}")


def card(args) -> None:
    """MODEL_CARD.md from the runs' logs, the held-out teacher-forced losses of the trained
    weights (rounded to float16 as exported) and the exported pipelines (`--assets`) speaking the
    held-out texts as a user would: the text as written, scored by the phoneme recogniser."""
    runs = {name: last_log(run) for name, run in (("target", args.target), ("draft", args.draft))}
    text_input = runs["target"]["args"].get("text_input", "text")
    if runs["draft"]["args"].get("text_input", "text") != text_input:
        raise ValueError("the target and the drafter read different text inputs")
    held_out, train = CodesData(args.codes, "eval", text_input), CodesData(args.codes, "train", text_input)
    facts: dict[str, dict] = {}
    for name, run in (("target", args.target), ("draft", args.draft)):
        model = round_to_half(load_run(run))
        facts[name] = {"params": parameters(model), "config": model.config,
                       "text": held_out_loss(model, held_out), "no_text": held_out_loss(model, held_out, drop_text=True)}
    speaking = speaking_figures(held_out, Path(args.assets), args.speak)
    bundled = [json.loads(Path(path).read_text()) for path in args.decoding]
    batched = json.loads(Path(args.batch_decoding).read_text()) if args.batch_decoding else None
    decoding_text = decoding_section(bundled, batched, args.decoding_note) + "\n" if bundled else ""
    uniform = math.log(held_out.codebook_size)
    C, V = held_out.num_codebooks, held_out.codebook_size
    seconds = lambda data: sum(len(c) for c in data.codes) / (data.frame_rate or 50)

    def model_row(name: str, folder: str) -> str:
        c, run = facts[name]["config"], runs[name]
        e, d = c.encoder_config, c.decoder_config
        return (f"| {folder} | {e.num_hidden_layers} x {e.hidden_size} | {d.num_hidden_layers} x {d.hidden_size} "
                f"({d.num_attention_heads} heads, {d.num_key_value_heads} KV) | {facts[name]['params'] / 1e6:.2f}M | "
                f"{run['final']['step']} | {run['args']['batch_size']} | {run['args']['lr']:g} | {run['final']['loss']:.3f} |")

    def loss_row(name: str, folder: str) -> str:
        f = facts[name]
        return (f"| {folder} | {f['text']['loss']:.3f} | {f['no_text']['loss']:.3f} | "
                f"{' / '.join(f'{x:.2f}' for x in f['text']['per_codebook'])} |")

    target_args = runs["target"]["args"]

    def speak_row(folder: str) -> str:
        f = speaking[folder]
        return (f"| {folder} | {f['per']:.1%} | {f['ended']:.1%} | {f['duration_ratio']:.2f} | "
                f"{f['duration_within_25']:.1%} |")
    text = f"""# speech-tts and speech-tts-draft: bundled Dia text-to-speech on espeak-ng speech

Two transformers `DiaForConditionalGeneration` models (Dia's byte-level text encoder and
multi-codebook audio decoder, small configurations) trained from scratch on this project's CPU
machine by `training/train_tts.py`, over the codes of the project's 16 kHz DAC codec
(`training/train_speech.py`, {C} codebooks of {V} codes, 50 frames/s), which ships in each
folder's `codec/`. `speech-tts-draft` is the drafter for `decoding="draft"` (same codec, codebooks,
delay pattern and vocabulary). Load with `mmgen.audio.TTSPipeline.from_pretrained(folder)`.
Weights ship in float16 (rounded before the figures below were computed).

## Data

`training/data/speech.py`: English texts the project makes itself ({corpus_kinds(held_out, train)}) spoken by espeak-ng (Debian `espeak-ng`) with {voices(train)},
speeds and pitches chosen by a hash of the text; 16 kHz, 0.5-3 s each.
{len(train)} training utterances ({seconds(train) / 3600:.2f} h), {len(held_out)} held out (5% by a hash of the
text, never trained on). {TEXT_INPUTS[text_input]}

## Models and training

| model | encoder (layers x hidden) | decoder | parameters | steps (last stage) | batch | peak lr | last logged training loss |
|---|---|---|---|---|---|---|---|
{model_row("target", "speech-tts")}
{model_row("draft", "speech-tts-draft")}

Delay pattern {list(facts['target']['config'].delay_pattern)} (codebook c lags c frames); decoder vocabulary {V} codes,
then EOS ({V}), PAD ({V + 1}), BOS ({V + 2}). The objective is Dia's: the inputs and labels
`DiaProcessor(generation=False, output_labels=True)` builds (BOS, codes, EOS per codebook,
delayed; PAD and BOS unlabelled), cross-entropy averaged over every codebook's labelled tokens.
{TEXT_DROPOUT:.0%} of the training rows read all-zero text (the unconditional branch of Dia's
classifier-free guidance). AdamW (betas 0.9/0.95, weight decay {target_args['weight_decay']:g}), cosine
schedule with {target_args['warmup']} warm-up steps, gradient clipping 1.0; no augmentation. Each batch is
computed in {target_args.get('micro_batches', 1)} groups of similar length (less padding, the same loss).
{args.training_note}

## Held-out teacher-forced loss

Nats per labelled token on the {len(held_out)} held-out utterances (uniform over the codes: {uniform:.3f});
"no text" reads the zeroed text of the unconditional branch, so the gap is what the text tells the model.
{text_gap_bound(args.codes, held_out)}

| model | with text | no text | per codebook (with text) |
|---|---|---|---|
{loss_row("target", "speech-tts")}
{loss_row("draft", "speech-tts-draft")}

## Speaking the held-out texts

Each exported pipeline (`TTSPipeline.from_pretrained`, float16 weights, its sampling defaults)
speaks the first {speaking['count']} held-out texts as written, utterance k from seed k, one call each; the
project's phoneme recogniser (`audio/assets/phoneme-recogniser`, `mmgen eval per`) hears the audio,
scored against the phonemes espeak-ng said for the reference. "Ended": the share that stopped
before the frame budget; durations are spoken frames over the reference's. The codec's floor is
the reference codes decoded by the shipped codec and heard the same way.

| model | PER | ended | median duration ratio | within 25% of the reference duration |
|---|---|---|---|---|
{speak_row("speech-tts")}
{speak_row("speech-tts-draft")}
| codec round trip (floor) | {speaking['codec_floor']:.1%} | | | |
{kind_table(speaking)}
Sentences of none of the corpus' kinds: {len(EVERYDAY_TEXTS)} everyday ones ("{EVERYDAY_TEXTS[0]}",
"{EVERYDAY_TEXTS[1]}", ...: `EVERYDAY_TEXTS` in `training/train_tts.py`), text k from seed k, score
PER {speaking['speech-tts']['everyday_per']:.1%} (speech-tts) and {speaking['speech-tts-draft']['everyday_per']:.1%} (speech-tts-draft). {args.speaking_note}

{decoding_text}## Sampling defaults

Saved in `generation_config.json`: sampled (`do_sample`), temperature {SAMPLING['temperature']}, top-k
{SAMPLING['top_k']} (Dia also filters its guided candidates with this k), guidance scale {SAMPLING['guidance_scale']},
at most {FRAME_CONTEXT - 1} frames ({(FRAME_CONTEXT - 1) / 50:.1f} s).

## Limits

A toy for offline tests and demos of frame drafting: {"one robotic espeak voice" if held_out.voices and len(held_out.voices) == 1 else "robotic espeak voices"}, English only, short
texts of the corpus' kinds (trained on at most {max(map(len, held_out.text_ids + train.text_ids))} text tokens, {TOKEN_UNITS[text_input]} with "[S1]" one, and 3 s of
speech; the models read at most {TEXT_CONTEXT} tokens and {FRAME_CONTEXT} frames); small and trained on one CPU thread.

## Reproduce

```
{args.data_command}
{args.codes_command}
{args.target_command}
{args.draft_command}
python -m training.train_tts export --codec {args.codec_name} --target {args.target} --draft {args.draft} --out {args.assets}
python -m training.train_tts card --codes {args.codes} --target {args.target} --draft {args.draft} --assets {args.assets} \\
    --out {args.out} ...   # the commands and notes above
```
"""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    print(json.dumps({name: {k: v for k, v in f.items() if k != "config"} for name, f in facts.items()}, indent=1))
    print(json.dumps({"speaking": speaking}))


def decoding_arguments(p: argparse.ArgumentParser, results: str, batch_results: str, required: bool) -> None:
    """The options naming the decoding benchmarks' results (the `card` job's are optional)."""
    p.add_argument(results, nargs="+" if required else "*", required=required, default=[], metavar="JSON",
                   help="`benchmarks.tts_bundled --out` results of the shipped pair (one per thread count)")
    p.add_argument(batch_results, default=None, metavar="JSON",
                   help="a `benchmarks.tts_continuous_batching --json` result of the shipped pair")
    p.add_argument("--decoding-note", default="", help="what the decoding figures show, for the card")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    # Default steps: about 60-90 minutes each on one thread of this (shared) machine.
    for preset, lr, steps in (("target", 1e-3, 4000), ("draft", 2e-3, 10000)):
        p = jobs.add_parser(preset, help=f"train the {preset}")
        p.add_argument("--codes", required=True, help="codes file of `train_speech.py tokenize`")
        p.add_argument("--text-dropout", type=float, default=TEXT_DROPOUT)
        p.add_argument("--text-input", choices=("text", "phonemes"), default="text", help="what the encoder reads: the "
                       "text's bytes, or the utterance's phonemes one letter each (`mmgen.audio.phonemes.spell_phonemes`)")
        p.add_argument("--micro-batches", type=int, default=4, help="forward each batch in this many groups of "
                       "similar length (less padding; the same loss)")
        p.add_argument("--code-noise", type=float, default=0.0, help="share of the decoder's input codes replaced by random "
                       "codes while training (labels kept): the past alone cannot predict the next frame, the text must")
        p.add_argument("--guided-attention", type=float, default=0.0, help="weight of the guided attention loss on the "
                       "decoder's cross-attention (0: off)")
        p.add_argument("--guide-width", type=float, default=GUIDE_WIDTH, help="the guided attention's width g (share "
                       "of the text either side of the diagonal; smaller asks for a sharper alignment)")
        p.add_argument("--init", default=None, metavar="RUN", help="start from this run's weights (its checkpoint.pt): a "
                       "second stage with its own optimizer, schedule and settings")
        p.add_argument("--eval-every", type=int, default=0, help="held-out figures every N steps (0: never): loss with "
                       "and without the text, distance from the diagonal; best.pt keeps the best gap")
        p.add_argument("--eval-speak", type=int, default=0, metavar="N", help="with --eval-every: also speak the first N "
                       "held-out texts and score them with the phoneme recogniser (PER, ends, durations); best.pt keeps "
                       "the lowest PER")
        p.add_argument("--codec", default=None, help="the DAC folder of the codes (for --eval-speak), e.g. "
                       "audio/assets/speech-tts/codec")
        add_training_arguments(p, lr, 16)
        p.set_defaults(steps=steps, log_every=25, save_every=200)
    exp = jobs.add_parser("export", help="write the two pipeline folders")
    for name in ("--codec", "--target", "--draft", "--out"):
        exp.add_argument(name, required=True)
    exp.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    cd = jobs.add_parser("card", help="write MODEL_CARD.md")
    for name in ("--codes", "--target", "--draft", "--out"):
        cd.add_argument(name, required=True)
    cd.add_argument("--threads", type=int, default=0)
    cd.add_argument("--assets", default="audio/assets", help="the exported folders (speech-tts, speech-tts-draft) to hear")
    cd.add_argument("--speak", type=int, default=0, metavar="N", help="speak the first N held-out texts (0: all)")
    cd.add_argument("--codec-name", default="audio/assets/speech-tts/codec", help="the --codec the export was given (for "
                    "the card's reproduce lines)")
    cd.add_argument("--data-command", default="python -m training.data.speech --out data/speech16k.npz\n"
                    "python -m training.train_speech codec --data data/speech16k.npz --out runs/speech-codec --threads 1")
    cd.add_argument("--training-note", default="", help="how the runs went (stops and resumes), for the card")
    cd.add_argument("--speaking-note", default="", help="what the speaking figures show, for the card")
    decoding_arguments(cd, "--decoding", "--batch-decoding", required=False)
    cd.add_argument("--codes-command", default="python -m training.train_speech tokenize --data data/speech16k.npz "
                    "--codec runs/speech-codec --out runs/speech-codes.npz")
    cd.add_argument("--target-command", default="python -m training.train_tts target --codes runs/speech-codes.npz "
                    "--out runs/tts-target --threads 1")
    cd.add_argument("--draft-command", default="python -m training.train_tts draft --codes runs/speech-codes.npz "
                    "--out runs/tts-draft --threads 1")
    dec = jobs.add_parser("decoding", help="write the decoding figures into an existing MODEL_CARD.md")
    dec.add_argument("--card", required=True)
    decoding_arguments(dec, "--results", "--batch-results", required=True)
    args = parser.parse_args(argv)
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    {"target": train_model, "draft": train_model, "export": export, "card": card, "decoding": decoding}[args.job](args)


if __name__ == "__main__":
    main()
