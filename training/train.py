"""Train the bundled models on the emoji set: VQ tokenizer, two LlamaGen GPTs, a classifier.

CPU-sized, deterministic for a given seed and thread count, resumable: every `--save-every`
steps the run writes `<out>/checkpoint.pt` (weights, optimizer, step) atomically, and the same
command resumes from it. Data order and augmentation noise derive from (seed, step), so a run
killed and resumed ends with the same weights as one that never stopped.

    python -m training.data.emoji --out data/emoji64.npz
    python -m training.train vq --data data/emoji64.npz --out runs/vq --steps 3000
    python -m training.train tokenize --data data/emoji64.npz --vq runs/vq --out runs/codes.npz
    python -m training.train gpt --preset target --codes runs/codes.npz --out runs/gpt-target --steps 4000
    python -m training.train gpt --preset draft --codes runs/codes.npz --out runs/gpt-draft --steps 3000
    python -m training.train classifier --data data/emoji64.npz --out runs/classifier --steps 2000
    python -m training.train export --data data/emoji64.npz --vq runs/vq --gpt runs/gpt-target \
        --draft runs/gpt-draft --classifier runs/classifier --out image_ar/assets
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from mmgen.files import write_atomic
from mmgen.image_ar.llamagen import LlamaGenConfig, LlamaGenTransformer, VQConfig, VQModel

#: The bundled configurations (small enough to train on 2 CPU cores in about an hour each).
VQ_EMOJI = VQConfig(
    codebook_size=512, codebook_embed_dim=8, encoder_ch_mult=(1, 2, 2, 4), decoder_ch_mult=(1, 2, 2, 4),
    z_channels=64, base_channels=32, num_res_blocks=1,
)
GPT_EMOJI = {
    # Same LlamaGen code and config fields as the official presets, at emoji scale.
    "target": dict(dim=192, n_layer=6, n_head=6, multiple_of=64),
    "draft": dict(dim=96, n_layer=2, n_head=3, multiple_of=32),
}
GPT_COMMON = dict(vocab_size=VQ_EMOJI.codebook_size, block_size=64, cls_token_num=1, class_dropout_prob=0.1,
                  token_dropout_p=0.1, resid_dropout_p=0.1, ffn_dropout_p=0.1)


# ---------------------------------------------------------------------------- data


def load_images(path: str, split: str = "train") -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Images as float [N, 3, 64, 64] in [-1, 1], labels [N], class names."""
    data = np.load(path)
    keep = ~data["is_eval"] if split == "train" else data["is_eval"]
    images = torch.from_numpy(data["images"][keep]).permute(0, 3, 1, 2).float() / 127.5 - 1
    return images, torch.from_numpy(data["labels"][keep]), [str(c) for c in data["class_names"]]


def batches(n: int, batch_size: int, seed: int, start_step: int) -> Iterator[torch.Tensor]:
    """Index batches of a fixed shuffled epoch order; resuming at `start_step` replays it."""
    per_epoch = n // batch_size
    step = start_step
    while True:
        epoch, offset = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        yield order[offset * batch_size : (offset + 1) * batch_size]
        step += 1


def random_flip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flip = torch.rand(images.shape[0], generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


# ---------------------------------------------------------------------------- training loop


def cosine_lr(step: int, steps: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


class WeightAverage:
    """An exponential moving average of a model's trained weights (Polyak averaging; diffusion
    models are evaluated on it: DDPM, Ho et al. 2020; DiT, Peebles and Xie 2023). The decay warms
    up as min(decay, (1 + k) / (10 + k)) over its first k updates. Frozen parameters and buffers
    are copied, not averaged, so a part frozen mid-run (the video target's text encoder) stays
    exactly the weights the rest trained against."""

    def __init__(self, model: torch.nn.Module, decay: float, state: Optional[dict] = None):
        self.model, self.decay = model, decay
        live = model.state_dict()
        kept = state["weights"] if state else live
        self.weights = {k: kept[k].detach().clone().to(v.device) for k, v in live.items()}
        self.updates = int(state["updates"]) if state else 0

    def update(self) -> None:
        live = self.model.state_dict()
        trained = {name for name, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad}
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        with torch.no_grad():
            for name, weight in self.weights.items():
                if name in trained and weight.is_floating_point():
                    weight.lerp_(live[name].detach().to(weight.dtype), 1 - decay)
                else:
                    weight.copy_(live[name])
        self.updates += 1

    def state_dict(self) -> dict:
        return {"weights": self.weights, "updates": self.updates}

    @contextmanager
    def swapped_in(self):
        """The model holds the averaged weights inside the block, its own again after."""
        own = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self.weights)
        try:
            yield
        finally:
            self.model.load_state_dict(own)


def trained_weights(state: dict) -> dict:
    """The weights a run's checkpoint stands for: its average (`--ema`) where it kept one."""
    return state["ema"]["weights"] if "ema" in state else state["model"]


def train_loop(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, dict]],
    n: int,
    args: argparse.Namespace,
    config: dict,
    heldout: Optional[Callable[[], dict]] = None,
    param_groups: Optional[list[dict]] = None,
) -> None:
    """AdamW + cosine schedule with warm-up; checkpoint/resume; a JSONL log of losses.

    `param_groups`: AdamW's parameter groups, where a group's `lr_scale` multiplies the schedule's
    learning rate for its parameters (default: every parameter of `model` at the schedule's rate)
    and a group marked `clip_apart` has its gradient norm clipped on its own (a GAN's critic, whose
    gradients should not shrink the generator's); the rest are clipped together.

    `heldout`: figures on held-out data, logged every `args.eval_every` steps (and at the end) as
    `{"step", "heldout": {...}}`; where they carry a `score` (higher is better), the best step's
    weights are kept in `<out>/best.pt`, so a run stopped for time leaves its best checkpoint and
    its curve. It runs under `no_grad` with its own randomness, so it changes nothing a resumed
    run replays. The forward runs under bf16 autocast on `args.device` "cuda", and on the CPU where
    `args.autocast` is "bf16" (oneDNN's bf16 convolutions: 1.46x a float32 step of the base-32 video
    VAE on AVX512-BF16 cores; docs/benchmarks.md has the command).

    `args.ema` > 0 keeps a `WeightAverage` of that decay in the checkpoint (from the first step, or
    from the step a run without one is resumed with it); held-out figures, `best.pt` and
    `load_trained` then use the averaged weights."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(getattr(args, "device", "cpu"))
    model.to(device)
    optimizer = torch.optim.AdamW(param_groups or model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    start, state = 0, {}
    checkpoint = out / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
        print(f"resumed {checkpoint} at step {start}")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    log = open(out / "log.jsonl", "a")
    decay = getattr(args, "ema", 0.0) or 0.0
    average = WeightAverage(model, decay, state.get("ema")) if decay else None
    if average is not None and "ema" not in state:  # the average starts here: the log says where
        log.write(json.dumps({"step": start, "weight_average": {"decay": decay}}) + "\n")
        log.flush()
    model.train()
    started = time.time()
    stop = args.steps if args.run_steps is None else min(args.steps, start + args.run_steps)
    minutes = getattr(args, "minutes", None)
    deadline = None if minutes is None else started + 60 * minutes
    eval_every = getattr(args, "eval_every", 0) or 0
    mode = getattr(args, "autocast", "auto")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" if mode == "auto" else mode == "bf16")
    # Gradient clipping: the groups marked `clip_apart` each on their own, every other parameter together.
    apart = [group["params"] for group in optimizer.param_groups if group.get("clip_apart")]
    kept_apart = {id(p) for params in apart for p in params}
    together = [p for p in model.parameters() if id(p) not in kept_apart]
    for step, index in zip(range(start, stop), batches(n, args.batch_size, args.seed, start)):
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, args.steps, args.lr, args.warmup) * group.get("lr_scale", 1.0)
        # Randomness derives from (seed, step) alone, so a resumed run equals an uninterrupted one.
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        with autocast:
            loss, metrics = loss_fn(index, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(together, 1.0)
        for params in apart:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if average is not None:
            average.update()
        done = step + 1
        out_of_time = deadline is not None and time.time() >= deadline
        if done % args.log_every == 0 or done == args.steps or out_of_time:
            record = {"step": done, "loss": loss.item(), **metrics, "seconds": round(time.time() - started, 1)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
        if heldout is not None and eval_every and (done % eval_every == 0 or done == args.steps):
            record = log_heldout(model, heldout, done, out, autocast, average)
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
        if done % args.save_every == 0 or done == stop or out_of_time:
            save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                         **({"ema": average.state_dict()} if average is not None else {})}, checkpoint)
        if out_of_time:
            print(f"stopped after {minutes} minutes at step {done} of {args.steps}; the same command resumes", flush=True)
            break
    model.eval()


def save_atomic(state: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def log_heldout(model: torch.nn.Module, heldout: Callable[[], dict], step: int, out: Path, autocast,
                average: Optional[WeightAverage] = None) -> dict:
    """One held-out measurement (of the weight average, where the run keeps one); `best.pt` keeps
    the weights of the best `score` so far."""
    model.eval()
    best = out / "best.json"
    with torch.no_grad(), autocast, (average.swapped_in() if average is not None else nullcontext()):
        figures = heldout()
        if "score" in figures:
            # A score of another metric (a run resumed with other held-out figures) does not compare.
            kept = json.loads(best.read_text()) if best.exists() else {}
            previous = kept.get("score", -math.inf) if kept.get("metric") == figures.get("metric") else -math.inf
            if figures["score"] > previous:
                save_atomic({"model": model.state_dict(), "step": step}, out / "best.pt")
                write_atomic(best, (json.dumps({"step": step, "score": figures["score"], "metric": figures.get("metric")}) + "\n").encode())
    model.train()
    record = {"step": step, "heldout": figures}
    return record


def train_vq(args) -> None:
    images, _, _ = load_images(args.data)
    model = VQModel(VQ_EMOJI)

    def loss_fn(index, generator):
        x = random_flip(images[index], generator)
        recon, losses = model(x)
        rec = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        total = rec + losses.vq_loss + losses.commit_loss
        return total, {"recon": rec.item(), "vq": losses.vq_loss.item(), "usage": losses.codebook_usage}

    train_loop(model, loss_fn, len(images), args, {"vq": VQ_EMOJI.to_dict(), "args": vars(args)})


@torch.no_grad()
def tokenize(args) -> None:
    """Codes of every training image and of its mirror image (LlamaGen's flip augmentation)."""
    images, labels, names = load_images(args.data)
    vq = load_trained(VQModel(VQ_EMOJI), args.vq)
    codes = []
    for flip in (False, True):
        for chunk in (images.flip(-1) if flip else images).split(256):
            codes.append(vq.encode(chunk)[2])
    codes = torch.cat(codes)
    np.savez_compressed(args.out, codes=codes.numpy().astype(np.int16), labels=torch.cat([labels, labels]).numpy(),
                        class_names=np.array(names))
    print(f"wrote {args.out}: {tuple(codes.shape)}, {len(torch.unique(codes))} distinct codes")


def gpt_config(preset: str, num_classes: int) -> LlamaGenConfig:
    return LlamaGenConfig(**GPT_EMOJI[preset], **GPT_COMMON, num_classes=num_classes)


def train_gpt(args) -> None:
    data = np.load(args.codes)
    codes, labels = torch.from_numpy(data["codes"].astype(np.int64)), torch.from_numpy(data["labels"])
    config = gpt_config(args.preset, len(data["class_names"]))
    torch.manual_seed(args.seed)
    model = LlamaGenTransformer(config)

    def loss_fn(index, generator):
        # Label dropout for CFG uses the global RNG inside the embedder; seed it per step.
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
        logits, loss = model(codes[index, :-1], labels[index], targets=codes[index])
        return loss, {}

    train_loop(model, loss_fn, len(codes), args, {"gpt": config.to_dict(), "args": vars(args)})


def classifier_model(num_classes: int):
    import timm

    return timm.create_model("resnet10t", pretrained=False, num_classes=num_classes)


def train_classifier(args) -> None:
    images, labels, names = load_images(args.data)
    torch.manual_seed(args.seed)
    model = classifier_model(len(names))

    def loss_fn(index, generator):
        x = random_flip(images[index], generator)
        logits = model(x)
        loss = F.cross_entropy(logits, labels[index], label_smoothing=0.1)
        return loss, {"acc": (logits.argmax(-1) == labels[index]).float().mean().item()}

    train_loop(model, loss_fn, len(images), args, {"classifier": "timm resnet10t", "num_classes": len(names), "args": vars(args)})


#: Sampling defaults saved with the bundled pipelines (chosen on the eval proxies; see MODEL_CARD.md).
EMOJI_SAMPLING = {"guidance_scale": 2.0, "top_k": 0}


@torch.no_grad()
def export(args) -> None:
    """Write the bundled assets: two pipelines sharing one VQ, the classifier with the real
    data's feature statistics, the held-out real images, and a model card."""
    from mmgen.image_ar.llamagen import LlamaGenPipeline, LlamaGenTokenModel
    from mmgen.image_ar.quality import ClassifierConfig, ImageQualityProxies
    from mmgen.quality import token_nll

    data = np.load(args.data)
    names = [str(c) for c in data["class_names"]]
    out = Path(args.out)
    vq = load_trained(VQModel(VQ_EMOJI), args.vq)
    # The VQ and the classifier ship in float16; round them first so that what is measured
    # here (reference statistics, reconstructions) is what users load.
    round_to_half(vq)
    target = load_trained(LlamaGenTransformer(gpt_config("target", len(names))), args.gpt)
    draft = load_trained(LlamaGenTransformer(gpt_config("draft", len(names))), args.draft)
    LlamaGenPipeline(target, vq, names, EMOJI_SAMPLING).save_pretrained(out / "emoji64", dtypes={"vq": torch.float16})
    LlamaGenPipeline(draft, vq, names, EMOJI_SAMPLING).save_pretrained(out / "emoji64-draft", shared={"vq": "../emoji64/vq"})

    classifier = round_to_half(load_trained(classifier_model(len(names)), args.classifier))
    config = ClassifierConfig("resnet10t", len(names), int(data["images"].shape[1]))
    all_images = torch.from_numpy(data["images"]).permute(0, 3, 1, 2).float() / 255
    ImageQualityProxies.fit(classifier, config, all_images).save_pretrained(out / "emoji64-classifier", dtype=torch.float16)
    held_out = data["is_eval"]
    tmp = out / "emoji64-eval.tmp.npz"
    np.savez_compressed(tmp, images=data["images"][held_out], labels=data["labels"][held_out])
    os.replace(tmp, out / "emoji64-eval.npz")

    eval_images = all_images[torch.from_numpy(held_out)] * 2 - 1
    eval_labels = torch.from_numpy(data["labels"][held_out])
    eval_codes = vq.encode(eval_images)[2]
    facts = {
        "eval_nll": {name: float(token_nll(LlamaGenTokenModel(m), eval_labels, eval_codes).mean())
                     for name, m in (("target", target), ("draft", draft))},
        "images": len(data["labels"]), "held_out": int(held_out.sum()), "classes": len(names),
        "vq_eval_mse": float(F.mse_loss(vq(eval_images)[0], eval_images)),
        "classifier_eval_accuracy": float((classifier(eval_images).argmax(-1) == torch.from_numpy(data["labels"][held_out])).float().mean()),
        "params": {name: sum(p.numel() for p in m.parameters()) for name, m in
                   (("vq", vq), ("target", target), ("draft", draft), ("classifier", classifier))},
        "runs": {name: last_log(run) for name, run in
                 (("vq", args.vq), ("target", args.gpt), ("draft", args.draft), ("classifier", args.classifier))},
    }
    (out / "emoji64" / "MODEL_CARD.md").write_text(model_card(facts))
    print(f"wrote {out}")


def last_log(run: str) -> dict:
    """The log record of the step the checkpoint holds, and the run's arguments (batch, lr)."""
    step = int(torch.load(Path(run) / "checkpoint.pt", map_location="cpu", weights_only=True)["step"])
    records = [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines()]
    final = next(r for r in reversed(records) if r["step"] <= step and "loss" in r)  # not a held-out record
    return {"final": {**final, "step": step}, "args": json.loads((Path(run) / "config.json").read_text())["args"]}


def wall_clock(run: str | Path) -> tuple[float, int]:
    """Training seconds of a run summed over its invocations (each restarts the log's clock, so a
    drop in `seconds` starts a new one; time after an invocation's last record is not counted),
    and the number of invocations."""
    records = [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines()]
    total, last, invocations = 0.0, 0.0, 1
    for seconds in (r["seconds"] for r in records if "seconds" in r):
        if seconds < last:
            total, invocations = total + last, invocations + 1
        last = seconds
    return total + last, invocations


def model_card(f: dict) -> str:
    row = lambda name, what: component_row(f, name, what)
    return f"""# emoji64: bundled class-conditional LlamaGen models

Trained on this project's CPU machine by `training/train.py` (see its docstring for the exact
commands; training is deterministic for a given seed and thread count). These weights came from
the trainer at commit edcc830, which reseeded its augmentation noise at each resume; the VQ
and classifier runs were resumed once (below), so the current trainer, which derives noise
per step, reproduces them only approximately.

## Data

Noto Color Emoji (Debian `fonts-noto-color-emoji` 2.042) rendered at 64x64 on white, labelled by
Unicode emoji subgroup from `emoji-test.txt` (Debian `unicode-data` 15.0), built by
`python -m training.data.emoji`: {f['images']} images in {f['classes']} classes (subgroups with at
least 8 emoji); every 10th image of each class is held out ({f['held_out']} images, shipped as
`emoji64-eval.npz`). Horizontal flips augment training.

## Models

| component | what | parameters | steps | batch | peak lr | last logged training loss |
|---|---|---|---|---|---|---|
{row("vq", "LlamaGen VQ, 8x downsampling (8x8 tokens), 512 codes of dim 8, l2-normalised")}
{row("target", "LlamaGen GPT, dim 192, 6 layers, 6 heads, class-conditional (74 + null class)")}
{row("draft", "LlamaGen GPT, dim 96, 2 layers, 3 heads, same tokenizer (a drafter for speculation)")}
{row("classifier", "timm resnet10t, random init (quality proxies)")}

The VQ loss is L1 + L2 reconstruction plus the VQ and commitment terms (no perceptual or GAN
loss): held-out reconstruction MSE {f['vq_eval_mse']:.4f} on images in [-1, 1]. The GPTs use the
official LlamaGen training objective (next-token cross-entropy, 10% class dropout for CFG) with
AdamW (betas 0.9/0.95, weight decay 0.05), cosine schedule, 100 warm-up steps, gradient clipping 1.0.
NLL of the held-out images' tokens: target {f['eval_nll']['target']:.3f}, draft
{f['eval_nll']['draft']:.3f} nats/token (uniform: 6.238). The target's training loss is well below its
held-out NLL: with 3,212 training images it partly memorises them.
The classifier reaches {f['classifier_eval_accuracy']:.1%} accuracy on the held-out images.

The VQ and the classifier ship in float16 (rounded before every figure here was computed);
the GPTs ship in float32.

## Sampling defaults

Saved with the pipelines: guidance scale {EMOJI_SAMPLING['guidance_scale']}, no top-k, temperature 1.0.
`docs/benchmarks.md` has the quality proxies at other settings.

## Limits

A 64x64, 74-class toy: it exists to make acceptance rates and speedups meaningful offline,
not to make good pictures. Samples are blurry (8x8 tokens, 512 codes). Faces, cat faces,
people, hearts and keycaps come out recognisable; most object, animal, food and vehicle classes
(varied shapes, few examples each) come out as coloured blobs.

## Reproduce

```
python -m training.data.emoji --out data/emoji64.npz
python -m training.train vq --data data/emoji64.npz --out runs/vq --steps 1500 --lr 5e-4   # stopped at 750, resumed with --steps 1000
python -m training.train tokenize --data data/emoji64.npz --vq runs/vq --out runs/codes.npz
python -m training.train gpt --preset draft --codes runs/codes.npz --out runs/gpt-draft --steps 2000
python -m training.train gpt --preset target --codes runs/codes.npz --out runs/gpt-target --steps 3000
python -m training.train classifier --data data/emoji64.npz --out runs/classifier --steps 2000 --threads 1  # stopped at 1000, resumed with --steps 1200
python -m training.train export --data data/emoji64.npz --vq runs/vq --gpt runs/gpt-target \
    --draft runs/gpt-draft --classifier runs/classifier --out image_ar/assets
```
"""


def component_row(facts: dict, name: str, what: str) -> str:
    """A model card's table row for one trained component: parameters and its run's last log
    (`facts` holds "params" and "runs" by component name)."""
    run = facts["runs"][name]
    return (f"| {name} | {what} | {facts['params'][name] / 1e6:.2f}M | {run['final']['step']} | "
            f"{run['args']['batch_size']} | {run['args']['lr']:g} | {run['final']['loss']:.3f} |")


def keep_window_cost(model: torch.nn.Module, folder: Path) -> None:
    """Give a transformers model the measured window cost (`mmgen calibrate`)
    that the export `folder` it replaces already carried: the curve describes the architecture on
    this machine, not the weights, so a re-export keeps it. Its measured `window_tokens` describe
    the weights (what their drafts are accepted at), so a re-export drops them: measure again."""
    from mmgen.decoding.window import WINDOW_COST_KEY

    previous = Path(folder) / "config.json"
    if previous.is_file() and WINDOW_COST_KEY in (config := json.loads(previous.read_text())):
        setattr(model.config, WINDOW_COST_KEY, config[WINDOW_COST_KEY])


def round_to_half(model: torch.nn.Module) -> torch.nn.Module:
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            tensor.copy_(tensor.half().float())
    return model


def load_trained(model: torch.nn.Module, run: str) -> torch.nn.Module:
    """`model` with a run's trained weights (`trained_weights`: the average where it kept one)."""
    state = torch.load(Path(run) / "checkpoint.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(trained_weights(state))
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    vq = jobs.add_parser("vq")
    vq.add_argument("--data", required=True)
    tok = jobs.add_parser("tokenize")
    tok.add_argument("--data", required=True)
    tok.add_argument("--vq", required=True)
    tok.add_argument("--out", required=True)
    gpt = jobs.add_parser("gpt")
    gpt.add_argument("--preset", choices=sorted(GPT_EMOJI), required=True)
    gpt.add_argument("--codes", required=True)
    clf = jobs.add_parser("classifier")
    clf.add_argument("--data", required=True)
    exp = jobs.add_parser("export")
    for name in ("--data", "--vq", "--gpt", "--draft", "--classifier", "--out"):
        exp.add_argument(name, required=True)
    for p, lr, batch in ((vq, 1e-3, 32), (gpt, 1e-3, 64), (clf, 2e-3, 64)):
        add_training_arguments(p, lr, batch)
    args = parser.parse_args()
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    jobs = {"vq": train_vq, "tokenize": tokenize, "gpt": train_gpt, "classifier": train_classifier, "export": export}
    jobs[args.job](args)


def add_training_arguments(p: argparse.ArgumentParser, lr: float, batch: int) -> None:
    """The options every training job takes (`train_loop` reads them)."""
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=batch)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=250)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto",
                   help="bf16 autocast of the forward (auto: on CUDA only)")
    p.add_argument("--ema", type=float, default=0.0, help="keep an exponential moving average of the weights with this "
                   "decay (e.g. 0.999); held-out figures, best.pt and the exported weights are the average's")
    p.add_argument("--run-steps", type=int, help="train at most this many steps in this invocation, then "
                   "checkpoint and exit; the same command resumes (bounded CPU sessions)")
    p.add_argument("--minutes", type=float, help="train at most this many minutes of wall clock in this invocation, "
                   "then checkpoint and exit; the same command resumes (borrowed GPU windows)")


if __name__ == "__main__":
    main()
