"""Train the bundled VLM pair on emoji questions: `emoji-vlm` and its drafter `emoji-vlm-draft`.

Both are transformers' own `LlavaForConditionalGeneration` (a tiny CLIP vision tower, a small
Llama), sharing one byte-level BPE tokenizer and one `LlavaProcessor`; `VLMPipeline` loads
them. Questions and answers come from `training/data/emoji_vlm.py`; the image set's held-out
split is never trained on. The loop, checkpointing and data order are `training/train.py`'s
(`train_loop`: resumable, randomness from (seed, step)), so a killed and resumed run ends with
the weights of one that never stopped.

    python -m training.data.emoji --out data/emoji64.npz
    python -m training.train_vlm data --data data/emoji64.npz --out vlm/assets/emoji-vlm-eval.jsonl
    python -m training.train_vlm tokenizer --data data/emoji64.npz --out runs/vlm-processor
    python -m training.train_vlm target --data data/emoji64.npz --processor runs/vlm-processor --out runs/vlm-target
    python -m training.train_vlm draft --data data/emoji64.npz --processor runs/vlm-processor --out runs/vlm-draft
    python -m training.train_vlm export --processor runs/vlm-processor --target runs/vlm-target \
        --draft runs/vlm-draft --out vlm/assets
    python -m training.train_vlm eval --assets vlm/assets --out runs/vlm-eval.json
    python -m training.train_vlm card --eval runs/vlm-eval.json --target runs/vlm-target --draft runs/vlm-draft \
        --out vlm/assets/emoji-vlm/MODEL_CARD.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from training.data.emoji_vlm import (KINDS, PALETTE, QUESTIONS, SHORT_KINDS, dominant_colours, eval_records, image_answers,
                                       patch_mean_colours, write_jsonl)
from mmgen.vlm.heldout import load_eval, token_f1
from training.train import add_training_arguments, cosine_lr, keep_window_cost, last_log, load_trained, round_to_half, train_loop

IMAGE_SIZE, PATCH = 64, 8
SPECIAL = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "image": "<image>"}
#: One user turn (its images, then its text) and the assistant's cue; answers follow after a space.
CHAT_TEMPLATE = (
    "<s>{% for m in messages %}{{ m['role'].upper() + ':' }}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %} <image>{% else %} {{ c['text'] }}{% endif %}{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
#: Vision tower / language model sizes of the pair (transformers' CLIPVisionConfig / LlamaConfig fields).
PRESETS = {
    "target": dict(vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4),
                   text=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=4)),
    "draft": dict(vision=dict(hidden_size=96, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2),
                  text=dict(hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2)),
}
#: Evaluation: rows per pipeline call, and the subset (the first call) whose figures tests reproduce.
EVAL_BATCH, MAX_NEW_TOKENS = 64, 48


# ---------------------------------------------------------------------------- tokenizer, processor


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE (any string encodes; decoding inverts encoding exactly) as a
    `PreTrainedTokenizerFast` with the pipeline's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [SPECIAL[k] for k in ("pad", "bos", "eos", "image")]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"],
                                   pad_token=SPECIAL["pad"], extra_special_tokens={"image_token": SPECIAL["image"]})


def make_processor(tokenizer: Any) -> Any:
    """CLIP preprocessing at 64x64 and the tokenizer; 64 image tokens (CLS dropped)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    size = {"shortest_edge": IMAGE_SIZE}, {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    return LlavaProcessor(image_processor=CLIPImageProcessor(size=size[0], crop_size=size[1]), tokenizer=tokenizer,
                          patch_size=PATCH, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE)


def load_processor(path: str) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def build_tokenizer(args) -> None:
    data = dict(np.load(args.data))
    train = ~data["is_eval"]
    texts = [q for qs in QUESTIONS.values() for q in qs] + ["USER: ASSISTANT:"]
    texts += [" " + a for row, keep in zip(image_answers(data), train) if keep for a in row.values()]
    processor = make_processor(train_tokenizer(texts, args.vocab_size))
    processor.save_pretrained(args.out)
    print(f"wrote {args.out}: vocab {len(processor.tokenizer)}")


# ---------------------------------------------------------------------------- models


def vlm_config(preset: str, tokenizer: Any, text_layers: Optional[int] = None, vision_hidden: Optional[int] = None,
               text_hidden: Optional[int] = None) -> Any:
    """The preset's LlavaConfig; `text_layers` overrides its language model's depth,
    `text_hidden` its width (the MLP 3x as wide, 64-wide heads), `vision_hidden` its vision
    tower's width (the MLP 4x as wide)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    p = PRESETS[preset]
    text = p["text"] | ({"num_hidden_layers": text_layers} if text_layers else {})
    if text_hidden:
        text |= {"hidden_size": text_hidden, "intermediate_size": 3 * text_hidden,
                 "num_attention_heads": text_hidden // 64, "num_key_value_heads": text_hidden // 64}
    vision = p["vision"] | ({"hidden_size": vision_hidden, "intermediate_size": 4 * vision_hidden} if vision_hidden else {})
    ids = {f"{k}_token_id": tokenizer.convert_tokens_to_ids(SPECIAL[k]) for k in ("pad", "bos", "eos")}
    return LlavaConfig(
        vision_config=CLIPVisionConfig(**vision, image_size=IMAGE_SIZE, patch_size=PATCH),
        text_config=LlamaConfig(**text, vocab_size=len(tokenizer), max_position_embeddings=256,
                                tie_word_embeddings=True, **ids),
        image_token_index=tokenizer.convert_tokens_to_ids(SPECIAL["image"]), vision_feature_layer=-1,
        vision_feature_select_strategy="default", tie_word_embeddings=True,
    )


def new_model(preset: str, tokenizer: Any, seed: int, text_layers: Optional[int] = None,
              vision_hidden: Optional[int] = None, text_hidden: Optional[int] = None) -> Any:
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(vlm_config(preset, tokenizer, text_layers, vision_hidden, text_hidden))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# ---------------------------------------------------------------------------- training data


#: Every look of an image the colour head trains on: channel order x mirrored left-right.
LOOKS = [(order, mirror) for order in itertools.permutations(range(3)) for mirror in (False, True)]


def look(images: np.ndarray, k: int) -> np.ndarray:
    """Images [N, H, W, 3] in look `k` of LOOKS."""
    order, mirror = LOOKS[k]
    out = images[..., list(order)]
    return np.ascontiguousarray(out[:, :, ::-1] if mirror else out)


class QAData:
    """Training examples (image, kind) with pixels, prompts and answers tokenized once.

    An example's paraphrase comes from the step's generator; its sequence is the prompt exactly as
    `VLMPipeline` builds it (chat template, image tokens expanded by the processor), then the
    answer and the end token, the only positions with a loss."""

    def __init__(self, images: np.ndarray, rows: list[dict[str, str]], processor: Any, colour_augment: float = 0.0):
        self.processor, tok = processor, processor.tokenizer
        # Colour questions on recoloured copies (channel permutations, mirror images), answered
        # by the same pixel rule: 12 looks per image, so the answer must be read off the pixels
        # rather than remembered per image (the target answered 99% of its training images' colours
        # and 78% of held-out ones).
        self.colour_augment, self.images = colour_augment, images
        self.pixels = processor.image_processor(images=list(images), return_tensors="pt")["pixel_values"]
        blank = np.full((IMAGE_SIZE, IMAGE_SIZE, 3), 255, np.uint8)
        self.prompts = {
            (kind, i): processor(images=[blank], return_tensors="pt", text=processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}], add_generation_prompt=True,
            ))["input_ids"][0].tolist()
            for kind, qs in QUESTIONS.items() for i, q in enumerate(qs)
        }
        self.answers = [{k: tok.encode(" " + row[k], add_special_tokens=False) + [tok.eos_token_id] for k in KINDS} for row in rows]
        self.pad = tok.pad_token_id
        self.colour_answers: dict[str, list[int]] = {}

    def recoloured(self, image: int, u: list[float]) -> tuple[torch.Tensor, list[int]]:
        """Pixel values and colour answer of image `image` with its channels permuted (one of the
        five non-identity orders, by `u[0]`) and mirrored left-right when `u[1]` < 0.5."""
        pixels = look(self.images[image:image + 1], 2 * (1 + int(u[0] * 5)) + (u[1] < 0.5))[0]
        colour = dominant_colours(pixels[None])[0]
        if colour not in self.colour_answers:
            tok = self.processor.tokenizer
            self.colour_answers[colour] = tok.encode(" " + colour, add_special_tokens=False) + [tok.eos_token_id]
        values = self.processor.image_processor(images=[pixels], return_tensors="pt")["pixel_values"][0]
        return values, self.colour_answers[colour]

    def __len__(self) -> int:
        return len(self.answers) * len(KINDS)

    def batch(self, index: torch.Tensor, generator: Optional[torch.Generator]) -> dict[str, torch.Tensor]:
        """Right-padded `input_ids`, `attention_mask`, `labels` (-100 off the answers) and
        `pixel_values` of examples `index` (image * len(KINDS) + kind); each asks a paraphrase
        drawn from `generator`, or the first (the one evaluation asks) without one."""
        picks = torch.rand(len(index), generator=generator).tolist() if generator is not None else [0.0] * len(index)
        # Drawn only when augmenting, so runs without it keep their data order.
        looks = (torch.rand(len(index), 3, generator=generator).tolist() if generator is not None and self.colour_augment
                 else [[1.0] * 3] * len(index))
        seqs, labels, pixels = [], [], []
        for i, u, look in zip(index.tolist(), picks, looks):
            image, kind = divmod(i, len(KINDS))
            kind = KINDS[kind]
            prompt = self.prompts[(kind, int(u * len(QUESTIONS[kind])))]
            if kind == "colour" and look[0] < self.colour_augment:
                values, answer = self.recoloured(image, look[1:])
            else:
                values, answer = self.pixels[image], self.answers[image][kind]
            seqs.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
            pixels.append(values)
        width = max(map(len, seqs))
        pad = lambda rows, value: torch.tensor([r + [value] * (width - len(r)) for r in rows])
        return {"input_ids": pad(seqs, self.pad), "labels": pad(labels, -100),
                "attention_mask": pad([[1] * len(s) for s in seqs], 0), "pixel_values": torch.stack(pixels)}


class ColourLooks:
    """The colour answer of every training image in every look (computed once), and the
    processor's pixel values of a batch of (image, look) pairs: the images are already the
    processor's size, so its resize and crop are identities and only rescaling and
    normalisation remain (checked against the processor on construction)."""

    def __init__(self, images: np.ndarray, processor: Any):
        self.images = images
        names = list(PALETTE)
        self.labels = torch.tensor([[names.index(c) for c in dominant_colours(look(images, k))] for k in range(len(LOOKS))])
        ip = processor.image_processor
        self.scale = ip.rescale_factor
        self.mean, self.std = (torch.tensor(v).view(1, 3, 1, 1) for v in (ip.image_mean, ip.image_std))
        reference = ip(images=list(images[:4]), return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(self.pixels(images[:4]), reference, atol=1e-5, rtol=0)

    def pixels(self, images: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(images).permute(0, 3, 1, 2).float() * self.scale - self.mean) / self.std

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(self.images), (size,), generator=generator)
        which = torch.randint(len(LOOKS), (size,), generator=generator)
        images = np.stack([look(self.images[i:i + 1], k)[0] for i, k in zip(index.tolist(), which.tolist())])
        return self.pixels(images), self.labels[which, index]


class WithColourHead(torch.nn.Module):
    """A VLM in training with an auxiliary colour classifier on its image features (the
    projector's outputs, averaged over the image tokens): the tower is taught to carry each
    image's colour where the language model reads it, from many recoloured looks per step at
    the tower's cost alone. The head is dropped at export."""

    def __init__(self, vlm: Any):
        super().__init__()
        self.vlm = vlm
        self.colour_head = torch.nn.Linear(vlm.config.text_config.hidden_size, len(PALETTE))

    def colour_logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.vlm.model.get_image_features(pixel_values=pixel_values, vision_feature_layer=-1,
                                                     vision_feature_select_strategy="default").pooler_output
        pooled = torch.stack(list(features)).mean(1).float()
        # Normalised so the fresh head's first losses stay near log(11) rather than pulling hard on the tower.
        return self.colour_head(F.layer_norm(pooled, pooled.shape[-1:]))


def answer_logits(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits predicting each next token, and those tokens (-100 off the answers)."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   pixel_values=batch["pixel_values"]).logits[:, :-1].float()
    return logits, batch["labels"][:, 1:]


def answer_loss(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy on the answer positions, and the answers' token accuracy."""
    logits, target = answer_logits(model, batch)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)
    keep = target != -100
    return loss, (logits.argmax(-1)[keep] == target[keep]).float().mean()


def heldout_figures(model: Any, qa: "QAData", batch: int = 64) -> dict[str, Any]:
    """Teacher-forced figures on held-out questions (each kind's first paraphrase): answer-token
    loss, and exact match per kind. An answer is exact when every one of its tokens and the end
    token is the argmax after the true prefix, which is when greedy decoding gives it (up to
    rounding at a near-tie: these are right-padded batches, a pipeline's left-padded; on the
    shipped weights the two agree to the answer), so this is greedy exact match at a fraction
    of a decode's cost. `score`: exact over the
    short kinds, the figure the bundled model is judged by."""
    hits, counts, loss_sum, tokens = Counter(), Counter(), 0.0, 0
    for start in range(0, len(qa), batch):
        index = torch.arange(start, min(start + batch, len(qa)))
        logits, target = answer_logits(model, qa.batch(index, None))
        keep = target != -100
        loss_sum += F.cross_entropy(logits[keep], target[keep], reduction="sum").item()
        tokens += int(keep.sum())
        right = ((logits.argmax(-1) == target) | ~keep).all(-1).tolist()
        for i, ok in zip(index.tolist(), right):
            kind = KINDS[i % len(KINDS)]
            counts[kind] += 1
            hits[kind] += ok
    exact = {kind: round(hits[kind] / counts[kind], 4) for kind in KINDS}
    short = sum(hits[k] for k in SHORT_KINDS) / sum(counts[k] for k in SHORT_KINDS)
    return {"loss": round(loss_sum / tokens, 4), "exact": exact, "score": round(short, 4)}


def train_model(args) -> None:
    data = dict(np.load(args.data))
    train = ~data["is_eval"]
    processor = load_processor(args.processor)
    rows = image_answers(data)
    qa = QAData(data["images"][train], [row for row, keep in zip(rows, train) if keep], processor,
                colour_augment=args.colour_augment)
    heldout = QAData(data["images"][~train], [row for row, keep in zip(rows, train) if not keep], processor)
    model = new_model(args.job, processor.tokenizer, args.seed, args.text_layers, args.vision_hidden, args.text_hidden)
    if args.init:  # a warm start (a resumed run's checkpoint replaces these weights)
        model = load_pipeline_weights(model, args.init, partial=args.init_partial)

    trainee = WithColourHead(model) if args.colour_aux else model
    looks = ColourLooks(data["images"][train], processor) if args.colour_aux else None

    def loss_fn(index, generator):
        loss, accuracy = answer_loss(model, qa.batch(index, generator))
        metrics = {"token_acc": round(accuracy.item(), 4)}
        if looks is not None:
            pixels, colours = looks.batch(args.colour_aux_batch, generator)
            logits = trainee.colour_logits(pixels.to(loss.device))
            colour_loss = F.cross_entropy(logits, colours.to(loss.device))
            loss = loss + args.colour_aux * colour_loss
            metrics |= {"colour_loss": round(colour_loss.item(), 4),
                        "colour_acc": round((logits.argmax(-1).cpu() == colours).float().mean().item(), 4)}
        return loss, metrics

    config = {"preset": args.job, "llava": model.config.to_dict(), "args": {k: str(v) if isinstance(v, Path) else v
                                                                           for k, v in vars(args).items()}}
    train_loop(trainee, loss_fn, len(qa), args, config, heldout=lambda: heldout_figures(model, heldout),
               param_groups=image_side_groups(trainee, args.tower_lr_scale))


def image_side_groups(trainee: torch.nn.Module, scale: float) -> list[dict] | None:
    """Parameter groups where the image side (vision tower, projector, colour head) learns at
    `scale` times the language model's rate: a tower that must learn to read more of its pixels
    (the colour answers) next to a language model that already answers; None at scale 1."""
    if scale == 1.0:
        return None
    image_side = ("vision_tower.", "multi_modal_projector.", "colour_head.")
    rest, faster = [], []
    for name, parameter in trainee.named_parameters():
        (faster if any(part in name for part in image_side) else rest).append(parameter)
    return [{"params": rest}, {"params": faster, "lr_scale": scale}]


def load_pipeline_weights(model: Any, folder: str, partial: bool = False) -> Any:
    """`model` with the weights of a saved model folder of the same preset (strict), or with
    `partial`, only the tensors whose name and shape match (a resized vision tower over a
    trained language model); the names left as initialised are printed."""
    from transformers import LlavaForConditionalGeneration

    saved = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).state_dict()
    if partial:
        own = model.state_dict()
        fresh = [k for k in own if k not in saved or saved[k].shape != own[k].shape]
        saved = {k: v for k, v in saved.items() if k in own and k not in fresh}
        print(f"warm start from {folder}: {len(saved)} tensors taken, {len(fresh)} initialised "
              f"({sum(own[k].numel() for k in fresh) / 1e6:.2f}M parameters), e.g. {fresh[:3]}", flush=True)
        model.load_state_dict(saved, strict=False)
        return model
    model.load_state_dict(saved, strict=True)
    return model


def trained_vlm(preset: str, tokenizer: Any, run: str) -> Any:
    """The VLM of a training run's last checkpoint (without the colour head a run with
    `--colour-aux` trained alongside it), or of an exported model folder as it is."""
    if is_model_folder(run):
        from transformers import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration.from_pretrained(run, dtype=torch.float32).eval()
    args = json.loads((Path(run) / "config.json").read_text())["args"]
    model = new_model(preset, tokenizer, 0, args.get("text_layers"), args.get("vision_hidden"), args.get("text_hidden"))
    if args.get("colour_aux"):
        return load_trained(WithColourHead(model), run).vlm
    return load_trained(model, run)


# ---------------------------------------------------------------------------- export, evaluation, card

#: What an export keeps of a model's training run beside its weights: the run's arguments, its
#: last logged step, its held-out curve and its architecture, so that a card can be written again
#: once the run folder (runs/, scratch that does not outlive the machine) is gone.
TRAINING_RECORD = "training.json"


def is_model_folder(path: str | Path) -> bool:
    """An exported model folder (weights as safetensors), not a training run (a checkpoint)."""
    return (Path(path) / "model.safetensors").is_file() and not (Path(path) / "checkpoint.pt").is_file()


def training_record(source: str | Path) -> dict:
    """The card's facts about a model's training: from a run folder, or from the
    `TRAINING_RECORD` an export left in a model folder."""
    source = Path(source)
    if is_model_folder(source):
        if not (source / TRAINING_RECORD).is_file():
            raise SystemExit(f"{source} is a model folder without {TRAINING_RECORD}: give its training run instead")
        return json.loads((source / TRAINING_RECORD).read_text())
    return {**last_log(str(source)), "heldout": heldout_curve(str(source)),
            "llava": json.loads((source / "config.json").read_text())["llava"]}


@torch.no_grad()
def export(args) -> None:
    """Safetensors of both models, each folder with the shared processor (and the measured
    window cost a folder already there carried).

    float32 by default: `from_pretrained` computes in the stored dtype, and on CPU float16 is
    slower and rounds a multi-token verification forward differently from a one-token forward,
    so greedy drafting can part from greedy AR at a near-tie (1 of 1,264 held-out answers here)."""
    processor = load_processor(args.processor)
    out = Path(args.out)
    for name, preset, run in (("emoji-vlm", "target", args.target), ("emoji-vlm-draft", "draft", args.draft)):
        model = trained_vlm(preset, processor.tokenizer, run)
        if args.dtype == "float16":
            model = round_to_half(model).half()
        record = training_record(run)  # read before the folder is written: `run` may be that folder
        keep_window_cost(model, out / name)
        model.save_pretrained(out / name)
        processor.save_pretrained(out / name)
        (out / name / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out / name}")


def answer_all(pipe: Any, records: list[dict], images: np.ndarray, decoding: Any = "ar",
               batch: int = EVAL_BATCH) -> tuple[list[str], dict]:
    """Greedy answers to `records` in calls of `batch` rows, and summed decode counters."""
    from PIL import Image

    texts, totals = [], Counter()
    for start in range(0, len(records), batch):
        chunk = records[start:start + batch]
        out = pipe([r["question"] for r in chunk], [Image.fromarray(images[r["index"]]) for r in chunk],
                   max_new_tokens=MAX_NEW_TOKENS, decoding=decoding)
        texts += out.texts
        # (row, forward) pairs and the tokens they finalised: the per-row tokens per target forward.
        histogram = out.stats.accepted_histogram
        totals.update(forwards=out.stats.forwards, draft_forwards=out.stats.draft_forwards, row_forwards=sum(histogram),
                      row_tokens=sum(k * c for k, c in enumerate(histogram)))
    return texts, dict(totals)


def scores(records: list[dict], texts: list[str]) -> dict[str, dict[str, float]]:
    """Exact match and token F1 per question kind, over the short kinds ("short") and over all
    questions; a group none of `records` falls in is left out."""
    groups = {kind: (kind,) for kind in KINDS} | {"short": SHORT_KINDS, "all": KINDS}
    out = {}
    for group, kinds in groups.items():
        pairs = [(t, r["answer"]) for t, r in zip(texts, records) if r["kind"] in kinds]
        if not pairs:
            continue
        out[group] = {"n": len(pairs), "exact": sum(t == a for t, a in pairs) / len(pairs),
                     "f1": sum(token_f1(t, a) for t, a in pairs) / len(pairs)}
    return out


def evaluate(args) -> None:
    from mmgen.decoding import make_decoder
    from mmgen.vlm.pipeline import VLMPipeline

    assets = Path(args.assets)
    records, images = load_eval(assets)
    records = records[:args.limit] if args.limit else records
    target = VLMPipeline.from_pretrained(assets / "emoji-vlm")
    drafter = VLMPipeline.from_pretrained(assets / "emoji-vlm-draft")
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "subset_rows": EVAL_BATCH,
                              "dtype": str(target.model.dtype), "max_new_tokens": MAX_NEW_TOKENS,
                              "vocab": len(target.processor.tokenizer), "questions": len(records),
                              "subset_images": len({r["index"] for r in records[:EVAL_BATCH]})}
    # A floor: always giving the most common held-out answer of the question's kind.
    common = {kind: Counter(r["answer"] for r in records if r["kind"] == kind).most_common(1)[0][0] for kind in KINDS}
    result["majority"] = scores(records, [common[r["kind"]] for r in records])
    for name, pipe in (("target", target), ("draft", drafter)):
        started = time.time()
        texts, stats = answer_all(pipe, records, images)
        result[name] = {"full": scores(records, texts), "subset": scores(records[:EVAL_BATCH], texts[:EVAL_BATCH]),
                        "seconds": round(time.time() - started, 1), "params": sum(p.numel() for p in pipe.model.parameters())}
        if name == "target":
            result["target_texts"], result["target_forwards"] = texts, stats["forwards"]
    sentences = [i for i, r in enumerate(records) if r["kind"] == "sentence"]
    for k in (2, 4):
        started = time.time()
        texts, stats = answer_all(target, records, images, decoding=make_decoder("draft", drafter=drafter, num_draft=k))
        result[f"speculative_k{k}"] = {**stats, "tokens_per_target_forward": stats["row_tokens"] / stats["row_forwards"],
                                       "equals_ar": texts == result["target_texts"], "seconds": round(time.time() - started, 1)}
        if sentences:  # the long answers alone, where drafting has room to pay
            chosen = [records[i] for i in sentences]
            texts, stats = answer_all(target, chosen, images, decoding=make_decoder("draft", drafter=drafter, num_draft=k))
            result[f"speculative_k{k}"]["sentence"] = {
                "tokens_per_target_forward": stats["row_tokens"] / stats["row_forwards"],
                "equals_ar": texts == [result["target_texts"][i] for i in sentences]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "target_texts"}, indent=1))


def heldout_curve(run: str) -> list[dict]:
    """The held-out records a training run logged (`train_loop`'s `heldout`), in step order."""
    records = [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines() if line]
    return [r for r in records if "heldout" in r]


def augmentation(run_args: dict) -> str:
    """A run's augmentation, for the card (runs from before `--colour-augment` had none)."""
    share = run_args.get("colour_augment") or 0
    text = (f"{share:.0%} of colour questions about a copy with its channels permuted and maybe mirrored"
            if share else "no augmentation")
    if run_args.get("colour_aux"):
        text += (f"; plus {run_args['colour_aux']:g} x an auxiliary colour loss: a training-only linear head on the "
                 f"image features (the projector's outputs averaged over the image tokens), "
                 f"{run_args['colour_aux_batch']} images per step in any of their 12 looks (channel order x mirror)")
    return text


def image_side_rate(run_args: dict) -> str:
    """A run's `--tower-lr-scale`, for the card ("" at the default)."""
    scale = run_args.get("tower_lr_scale") or 1.0
    return "" if scale == 1.0 else f"the vision tower, projector and colour head at {scale:g} x the peak learning rate"


def architecture(record: dict) -> tuple[str, str]:
    """The vision tower and language model of a run (its `training_record`), as the card states them."""
    v, t = record["llava"]["vision_config"], record["llava"]["text_config"]
    tokens = (v["image_size"] // v["patch_size"]) ** 2
    return (f"CLIP {v['num_hidden_layers']} layers, hidden {v['hidden_size']}, patch {v['patch_size']} ({tokens} tokens)",
            f"Llama {t['num_hidden_layers']} layer{'s' * (t['num_hidden_layers'] > 1)}, hidden {t['hidden_size']}")


def card(args) -> None:
    e = json.loads(Path(args.eval).read_text())
    runs = {name: training_record(run) for name, run in (("target", args.target), ("draft", args.draft))}
    groups = (*KINDS, "short", "all")
    rows = lambda part: "\n".join(
        f"| {group} | {e['target'][part][group]['n']} | {e['target'][part][group]['exact']:.1%} | {e['target'][part][group]['f1']:.3f} | "
        f"{e['draft'][part][group]['exact']:.1%} | {e['draft'][part][group]['f1']:.3f} |" for group in groups if group in e["target"][part])
    floor = ", ".join(f"{group} {e['majority'][group]['exact']:.1%}" for group in groups)
    spec = "\n".join(f"| {k} | {e[f'speculative_k{k}']['tokens_per_target_forward']:.2f} | "
                     f"{e[f'speculative_k{k}'].get('sentence', {}).get('tokens_per_target_forward', float('nan')):.2f} | "
                     f"{e[f'speculative_k{k}']['forwards']} (AR: {e['target_forwards']}) | "
                     f"{e[f'speculative_k{k}']['draft_forwards']} | {e[f'speculative_k{k}']['equals_ar']} |" for k in (2, 4))
    curve = lambda name, record: "\n".join(
        f"| {name} | {r['step']} | {r['heldout']['loss']:.3f} | "
        + " | ".join(f"{r['heldout']['exact'].get(kind, float('nan')):.1%}" for kind in KINDS)
        + f" | {r['heldout']['score']:.1%} |" for r in record["heldout"])
    train = lambda name: runs[name]["args"]
    run_of = lambda name, source: train(name).get("out", source)  # the run an exported folder came from
    # A run with the colour head logs the sum; the table gives the answers' part.
    answer_part = lambda name: runs[name]["final"]["loss"] - (train(name).get("colour_aux") or 0) * runs[name]["final"].get("colour_loss", 0)
    augmentations = (f"{augmentation(train('target'))} (both models)" if augmentation(train("target")) == augmentation(train("draft"))
                     else f"{augmentation(train('target'))} (target), {augmentation(train('draft'))} (drafter)")
    rates = [f"{image_side_rate(train(name))} ({label})" for name, label in (("target", "target"), ("draft", "drafter"))
             if image_side_rate(train(name))]
    if rates:
        augmentations += "; " + ", ".join(rates)
    warmups = (f"{train('target')['warmup']}" if train("target")["warmup"] == train("draft")["warmup"]
               else f"{train('target')['warmup']} (target) and {train('draft')['warmup']} (drafter)")
    text = f"""# emoji-vlm and emoji-vlm-draft: bundled LLaVA-style question answering about emoji

Two transformers `LlavaForConditionalGeneration` models (tiny CLIP vision tower, small Llama),
trained from scratch on this project's CPU machine by `training/train_vlm.py`; they share one
byte-level BPE tokenizer ({e['vocab']} tokens) and one `LlavaProcessor`, and `emoji-vlm-draft`
is the drafter for `decoding="draft"`. Load with `mmgen.vlm.VLMPipeline.from_pretrained(folder)`.
Weights ship in {e['dtype'].removeprefix('torch.')} (`from_pretrained` computes in the stored dtype; on CPU float16 is
slower, and it rounds the drafter's multi-token verification forwards differently from one-token
forwards, so greedy drafting parted from greedy AR on 1 of 1,264 held-out answers in a
float16 export of earlier weights). The figures below were measured on the shipped weights.

## Data

The emoji images of `training/data/emoji.py` (Noto Color Emoji 64x64 on white, Debian
`fonts-noto-color-emoji` and `unicode-data`): 3,212 training images, 316 held out (every 10th of
each subgroup; the images of `image_ar/assets/emoji64-eval.npz`, never trained on). Five
questions per image, answers computed by `training/data/emoji_vlm.py`:

| kind | question (evaluation asks the first paraphrase) | answer |
|---|---|---|
| name | "What is this emoji?" (+3 paraphrases) | Unicode name, e.g. "grinning face" |
| subgroup | "Which subgroup is this emoji in?" (+3) | Unicode subgroup, hyphens as spaces, e.g. "face smiling" (74) |
| colour | "What is the main colour?" (+3) | most common palette colour of the non-white pixels (11 colours) |
| face | "Is it a face?" (+2) | "yes" for subgroups `face-*` and `cat-face`, else "no" (yes for 100 of 3,528) |
| sentence | "Describe this emoji." (+2) | the other answers in one sentence, e.g. "This is grinning face, a yellow face from the face smiling subgroup." (16-34 tokens, median 22) |

No held-out name occurs in training, though many are skin-tone or gender variants of trained
ones; token F1 gives partial credit for the words a name shares (skin tones, "man", "woman"),
and a sentence's exact match needs its name right. "short" below is the first four kinds
together (the figure the model is judged by); "all" adds the sentences. The held-out questions
ship as `vlm/assets/emoji-vlm-eval.jsonl`.

## Models and training

| model | vision tower | language model | parameters | steps (this run) | batch | peak lr | last logged answer loss / answer-token accuracy |
|---|---|---|---|---|---|---|---|
| emoji-vlm | {' | '.join(architecture(runs['target']))} | {e['target']['params'] / 1e6:.2f}M | {runs['target']['final']['step']} | {train('target')['batch_size']} | {train('target')['lr']:g} | {answer_part('target'):.3f} / {runs['target']['final']['token_acc']:.3f} |
| emoji-vlm-draft | {' | '.join(architecture(runs['draft']))} | {e['draft']['params'] / 1e6:.2f}M | {runs['draft']['final']['step']} | {train('draft')['batch_size']} | {train('draft')['lr']:g} | {answer_part('draft'):.3f} / {runs['draft']['final']['token_acc']:.3f} |

Cross-entropy on the answer tokens and the end token only (prompts and image tokens carry no
loss), one random (image, question kind) pair per example, a random paraphrase per example;
AdamW (betas 0.9/0.95, weight decay {train('target')['weight_decay']:g}), cosine schedule with {warmups} warm-up steps,
gradient clipping 1.0; {augmentations}. Torch threads: {train('target')['threads']} (target), {train('draft')['threads']} (drafter).
{args.training_note}

Held-out figures logged during the runs (teacher-forced: an answer counts as exact when every
token of it and the end token is the argmax after the true prefix, which is exactly when greedy
decoding gives it; first paraphrase; "score" is exact over the short kinds):

| model | step | answer-token loss | {' | '.join(KINDS)} | score |
|---|---|---|{'---|' * len(KINDS)}---|
{curve('emoji-vlm', runs['target'])}
{curve('emoji-vlm-draft', runs['draft'])}

## Held-out figures (greedy, through `VLMPipeline`)

All {e['target']['full']['all']['n']} held-out questions, asked in calls of {EVAL_BATCH} rows, at most {e['max_new_tokens']} new tokens;
exact match of the whole answer string, token F1 over whitespace words:

| kind | questions | emoji-vlm exact | emoji-vlm F1 | draft exact | draft F1 |
|---|---|---|---|---|---|
{rows('full')}

The floor of always giving the most common held-out answer of each kind: {floor} exact.
Evaluated with {e['threads']} torch thread(s); decoding took {e['target']['seconds']:.0f} s (target) and {e['draft']['seconds']:.0f} s (drafter) for all questions on this shared machine.

The first call alone (the first {EVAL_BATCH} rows of the eval file: {e['subset_images']} images;
`tests/vlm/test_bundled_vlm.py` reproduces these):

| kind | questions | emoji-vlm exact | emoji-vlm F1 | draft exact | draft F1 |
|---|---|---|---|---|---|
{rows('subset')}

## Speculative decoding with the drafter

`decoding=make_decoder("draft", drafter=<emoji-vlm-draft>, num_draft=k)` on the same questions
(greedy; the output equals autoregressive decoding token for token). Tokens per target forward
is per row (finalised tokens over the (row, forward) pairs of rows still decoding), over all
questions and over the sentence questions alone; forwards are batched calls summed over the
{e['questions'] // EVAL_BATCH + bool(e['questions'] % EVAL_BATCH)} evaluation calls, against autoregressive decoding's.

| k | tokens per target forward (all) | (sentences) | target forwards | drafter forwards | equals AR |
|---|---|---|---|---|---|
{spec}

Wall-clock comparisons (batch 1, methods interleaved, against transformers' `generate` and
assisted generation with the same drafter) are in docs/benchmarks.md.

## Limits

A toy for offline tests and demos of image-aware drafting: it knows 64x64 emoji and these five
questions only. A held-out emoji's whole name is rarely right (it answers with a training name
of the same look, or gets a skin-tone variant's base right and the tone wrong), and with it the
sentence, whose other parts it mostly gets right (token F1).

## Reproduce

```
python -m training.data.emoji --out data/emoji64.npz
python -m training.train_vlm data --data data/emoji64.npz --out vlm/assets/emoji-vlm-eval.jsonl
{args.target_command}
{args.draft_command}
python -m training.train_vlm export --processor vlm/assets/emoji-vlm --target {run_of('target', args.target)} --draft {run_of('draft', args.draft)} --out vlm/assets
python -m training.train_vlm eval --assets vlm/assets --out {args.eval} --threads {e['threads']}
python -m training.train_vlm card --eval {args.eval} --target {args.target} --draft {args.draft} --out vlm/assets/emoji-vlm/MODEL_CARD.md \\
    --target-command ... --draft-command ... --training-note ...   # the training lines and notes above
```
"""
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


def write_eval_data(args) -> None:
    from mmgen import image_ar

    data = dict(np.load(args.data))
    eval_images = np.load(Path(image_ar.__file__).parent / "assets" / "emoji64-eval.npz")["images"]
    records = eval_records(data, eval_images)
    write_jsonl(records, args.out)
    print(f"wrote {args.out}: {len(records)} questions about {len(eval_images)} held-out images")


def colour_reading(args) -> None:
    """How much of the colour answer a reader of patch means gets right on the held-out images
    (`patch_mean_colours`), per patch size: the tower's patch (PATCH) and finer ones."""
    data = dict(np.load(args.data))
    held_out = data["images"][data["is_eval"]]
    truth = dominant_colours(held_out)
    figures = {}
    for patch in sorted({2, 4, PATCH, 16}):
        guess = patch_mean_colours(held_out, patch)
        figures[patch] = round(sum(g == t for g, t in zip(guess, truth)) / len(truth), 4)
    print(json.dumps({"held_out_images": len(truth), "exact_by_patch": figures}))


def colour_tower(args) -> None:
    """Which vision tower can read the colour answer: a CLIP tower of the given size, a
    per-token projector and a mean over the image tokens, trained on the colour answer alone
    (every image in its 12 looks, the answer recomputed per look, so it is read off the pixels),
    held-out accuracy on the original images. A quick probe of the tower, not of the pair: the
    language model only has to pass the answer on."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(args.seed)
    data = dict(np.load(args.data))
    held_out = data["images"][data["is_eval"]]
    t0 = time.perf_counter()
    looks = ColourLooks(data["images"][~data["is_eval"]], load_processor(args.processor))
    truth = torch.tensor([list(PALETTE).index(c) for c in dominant_colours(held_out)])
    print(f"labels for {len(LOOKS)} looks in {time.perf_counter() - t0:.0f} s", flush=True)

    tower = CLIPVisionModel(CLIPVisionConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                             image_size=IMAGE_SIZE, patch_size=args.patch))
    head = torch.nn.Sequential(torch.nn.Linear(args.hidden, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    classify = torch.nn.Linear(256, len(PALETTE))
    params = [*tower.parameters(), *head.parameters(), *classify.parameters()]
    optimiser = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.05)

    def logits(pixels: torch.Tensor) -> torch.Tensor:
        tokens = tower(pixel_values=pixels).last_hidden_state[:, 1:]
        return classify(head(tokens).mean(1))

    def accuracy() -> float:
        tower.eval()
        with torch.no_grad():
            guess = torch.cat([logits(looks.pixels(held_out[i:i + 128])).argmax(-1) for i in range(0, len(held_out), 128)])
        tower.train()
        return round((guess == truth).float().mean().item(), 4)

    generator = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        for group in optimiser.param_groups:
            group["lr"] = cosine_lr(step - 1, args.steps, args.lr, 50)
        pixels, colours = looks.batch(args.batch_size, generator)
        loss = F.cross_entropy(logits(pixels), colours)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimiser.step()
        if step % args.eval_every == 0 or step == args.steps:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "held_out_colour": accuracy(),
                              "s": round(time.perf_counter() - t0)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    data = jobs.add_parser("data", help="the held-out questions (JSONL keyed by row of emoji64-eval.npz)")
    data.add_argument("--data", required=True)
    data.add_argument("--out", default="vlm/assets/emoji-vlm-eval.jsonl")
    tok = jobs.add_parser("tokenizer", help="train the BPE tokenizer; save the processor")
    tok.add_argument("--data", required=True)
    tok.add_argument("--out", required=True)
    tok.add_argument("--vocab-size", type=int, default=2048)
    for preset, lr in (("target", 1.5e-3), ("draft", 2e-3)):
        p = jobs.add_parser(preset, help=f"train the {preset}")
        p.add_argument("--data", required=True)
        p.add_argument("--processor", required=True)
        p.add_argument("--init", help="start from the weights of this model folder (e.g. vlm/assets/emoji-vlm)")
        p.add_argument("--init-partial", action="store_true",
                       help="with --init: take only the tensors whose shape matches (e.g. a resized vision tower)")
        p.add_argument("--text-layers", type=int, help="language model layers (default: the preset's)")
        p.add_argument("--text-hidden", type=int, help="language model width, a multiple of 64 (default: the preset's)")
        p.add_argument("--vision-hidden", type=int, help="vision tower width (default: the preset's)")
        p.add_argument("--colour-aux", type=float, default=0.0, metavar="W",
                       help="add W x an auxiliary colour loss on the image features (a training-only head)")
        p.add_argument("--tower-lr-scale", type=float, default=1.0, metavar="S",
                       help="the vision tower, projector and colour head learn at S times the peak lr")
        p.add_argument("--colour-aux-batch", type=int, default=64, help="recoloured images per step for --colour-aux")
        p.add_argument("--eval-every", type=int, default=500, help="held-out figures every N steps (0: never)")
        p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
        p.add_argument("--colour-augment", type=float, default=0.0, metavar="P",
                       help="ask a colour question about a recoloured copy (channels permuted, maybe mirrored; "
                            "the answer recomputed) with probability P")
        add_training_arguments(p, lr, 32)
    exp = jobs.add_parser("export")
    for name in ("--processor", "--target", "--draft", "--out"):
        exp.add_argument(name, required=True)
    exp.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    ev = jobs.add_parser("eval")
    ev.add_argument("--assets", default="vlm/assets")
    ev.add_argument("--out", required=True)
    ev.add_argument("--threads", type=int, default=0)
    ev.add_argument("--limit", type=int, default=0, help="only the first LIMIT questions (a dry run; 0: all)")
    cr = jobs.add_parser("colour-reading", help="held-out colour answers a reader of patch-mean colours gets right")
    cr.add_argument("--data", required=True)
    ct = jobs.add_parser("colour-tower", help="train a vision tower on the colour answer alone (a probe of its size)")
    ct.add_argument("--data", required=True)
    ct.add_argument("--processor", default="vlm/assets/emoji-vlm")
    ct.add_argument("--patch", type=int, default=PATCH)
    ct.add_argument("--hidden", type=int, default=PRESETS["target"]["vision"]["hidden_size"])
    ct.add_argument("--layers", type=int, default=PRESETS["target"]["vision"]["num_hidden_layers"])
    ct.add_argument("--heads", type=int, default=PRESETS["target"]["vision"]["num_attention_heads"])
    ct.add_argument("--steps", type=int, default=3000)
    ct.add_argument("--batch-size", type=int, default=64)
    ct.add_argument("--lr", type=float, default=1e-3)
    ct.add_argument("--eval-every", type=int, default=250)
    ct.add_argument("--seed", type=int, default=0)
    ct.add_argument("--threads", type=int, default=1)
    cd = jobs.add_parser("card")
    for name in ("--eval", "--target", "--draft", "--out"):
        cd.add_argument(name, required=True)
    cd.add_argument("--target-command", default="python -m training.train_vlm target --data data/emoji64.npz "
                    "--processor runs/vlm-processor --out runs/vlm-target")
    cd.add_argument("--training-note", default="", help="how the runs went (stops and resumes), for the card")
    cd.add_argument("--draft-command", default="python -m training.train_vlm draft --data data/emoji64.npz "
                    "--processor runs/vlm-processor --out runs/vlm-draft")
    args = parser.parse_args(argv)
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    {"data": write_eval_data, "tokenizer": build_tokenizer, "target": train_model, "draft": train_model,
     "export": export, "eval": evaluate, "card": card,
     "colour-reading": colour_reading, "colour-tower": colour_tower}[args.job](args)


if __name__ == "__main__":
    main()
