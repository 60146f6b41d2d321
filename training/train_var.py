"""Train the bundled VAR models on the emoji set: a multi-scale VQVAE and two VAR transformers
of different depths on its tokens (a large one and a small one, for collaborative decoding).

Same harness as `training/train.py` (deterministic for a seed and thread count, resumable,
atomic checkpoints):

    python -m training.train_var vqvae --data data/emoji64.npz --out runs/var-vqvae --steps 900 --threads 2
    python -m training.train_var tokenize --data data/emoji64.npz --vqvae runs/var-vqvae --out runs/var-codes.npz
    python -m training.train_var var --preset large --codes runs/var-codes.npz --vqvae runs/var-vqvae --out runs/var-large \
        --steps 1500 --threads 1
    python -m training.train_var var --preset small --codes runs/var-codes.npz --vqvae runs/var-vqvae --out runs/var-small \
        --steps 1500 --threads 1
    python -m training.train_var export --data data/emoji64.npz --vqvae runs/var-vqvae --large runs/var-large \
        --small runs/var-small --out image_ar/assets
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.train import add_training_arguments, component_row, last_log, load_images, load_trained, random_flip, round_to_half, train_loop
from mmgen.image_ar.var.transformer import VARConfig, VARTransformer
from mmgen.image_ar.var.vqvae import MultiScaleVQVAE, VQVAEConfig

#: 64x64 images, 8x downsampling, six scales (130 tokens), 512 codes of 16 dims.
VQVAE_EMOJI = VQVAEConfig(vocab_size=512, z_channels=16, ch=32, ch_mult=(1, 2, 2, 4), num_res_blocks=1,
                          patch_nums=(1, 2, 3, 4, 6, 8))
#: Two depths on one tokenizer (the official presets tie width to depth; these are CPU-sized).
VAR_EMOJI = {"large": dict(depth=4, embed_dim=128, num_heads=4), "small": dict(depth=2, embed_dim=64, num_heads=2)}


def train_vqvae(args) -> None:
    images, _, _ = load_images(args.data)
    torch.manual_seed(args.seed)
    model = MultiScaleVQVAE(VQVAE_EMOJI)
    codebook = model.quantize.embedding.weight

    def loss_fn(index, generator):
        x = random_flip(images[index], generator)
        out = model(x)
        rec = F.l1_loss(out.reconstruction, x) + F.mse_loss(out.reconstruction, x)
        hits = torch.cat([t.flatten() for t in out.tokens]).bincount(minlength=codebook.shape[0])
        # Every 50 steps (for the first 80% of the run), codes this batch did not use restart at
        # random encoder vectors of the batch: a training-side fix for codebook collapse (the
        # official VAR VQVAE trainer is unreleased). The step comes from the per-step seed, so a
        # resumed run restarts the same codes.
        step = generator.initial_seed() - args.seed * 1_000_003
        if step % 50 == 0 and step < 0.8 * args.steps:
            with torch.no_grad():
                f = model.quant_conv(model.encoder(x)).permute(0, 2, 3, 1).reshape(-1, codebook.shape[1])
                dead = (hits == 0).nonzero().flatten()
                codebook[dead] = f[torch.randint(0, f.shape[0], (dead.numel(),), generator=generator)]
        return rec + out.vq_loss, {"recon": rec.item(), "vq": out.vq_loss.item(), "used": int((hits > 0).sum())}

    train_loop(model, loss_fn, len(images), args, {"vqvae": VQVAE_EMOJI.to_dict(), "args": vars(args)})


@torch.no_grad()
def tokenize(args) -> None:
    """Token maps of every training image and of its mirror image, concatenated over scales."""
    images, labels, names = load_images(args.data)
    vqvae = load_trained(MultiScaleVQVAE(VQVAE_EMOJI), args.vqvae)
    codes = []
    for flip in (False, True):
        for chunk in (images.flip(-1) if flip else images).split(256):
            codes.append(torch.cat(vqvae.encode(chunk), 1))
    codes = torch.cat(codes)
    np.savez_compressed(args.out, codes=codes.numpy().astype(np.int16), labels=torch.cat([labels, labels]).numpy(),
                        class_names=np.array(names))
    print(f"wrote {args.out}: {tuple(codes.shape)}, {len(torch.unique(codes))} distinct codes")


def var_config(preset: str, num_classes: int) -> VARConfig:
    return VARConfig(**VAR_EMOJI[preset], num_classes=num_classes, vocab_size=VQVAE_EMOJI.vocab_size,
                     cvae=VQVAE_EMOJI.z_channels, patch_nums=VQVAE_EMOJI.patch_nums)


def train_var(args) -> None:
    """The official objective: cross-entropy over every token of every scale, teacher-forced
    with the VQVAE's next-scale inputs, 10% of labels dropped to the null class for CFG."""
    data = np.load(args.codes)
    codes, labels = torch.from_numpy(data["codes"].astype(np.int64)), torch.from_numpy(data["labels"]).long()
    vqvae = load_trained(MultiScaleVQVAE(VQVAE_EMOJI), args.vqvae)
    config = var_config(args.preset, len(data["class_names"]))
    torch.manual_seed(args.seed)
    model = VARTransformer(config)
    model.init_weights(init_adaln=0.5, init_adaln_gamma=1e-3, init_head=0.02, init_std=-1)
    sizes = list(config.step_sizes)

    def loss_fn(index, generator):
        target = codes[index]
        with torch.no_grad():
            inputs = vqvae.quantize.next_scale_inputs(list(target.split(sizes, dim=1)))
        drop = torch.rand(len(index), generator=generator) < config.cond_drop_rate
        logits = model(torch.where(drop, config.num_classes, labels[index]), inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        last = logits[:, -sizes[-1]:].argmax(-1) == target[:, -sizes[-1]:]
        return loss, {"last_scale_acc": last.float().mean().item()}

    train_loop(model, loss_fn, len(codes), args, {"var": config.to_dict(), "args": vars(args)})


#: Sampling defaults saved with the bundled VAR pipelines (see the model card).
VAR_EMOJI_SAMPLING = {"guidance_scale": 2.0, "top_k": 0, "top_p": 1.0}


@torch.no_grad()
def export(args) -> None:
    """Write `var-emoji64` (large transformer + VQVAE) and `var-emoji64-small` (small
    transformer, VQVAE shared with the large one) and the model card."""
    from mmgen.image_ar.bench.var import var_token_nll
    from mmgen.image_ar.var import VARPipeline

    data = np.load(args.data)
    names = [str(c) for c in data["class_names"]]
    out = Path(args.out)
    vqvae = round_to_half(load_trained(MultiScaleVQVAE(VQVAE_EMOJI), args.vqvae))
    large = load_trained(VARTransformer(var_config("large", len(names))), args.large)
    small = load_trained(VARTransformer(var_config("small", len(names))), args.small)
    big_pipe = VARPipeline(large, vqvae, names, VAR_EMOJI_SAMPLING)
    big_pipe.save_pretrained(out / "var-emoji64", dtypes={"vqvae": torch.float16})
    VARPipeline(small, vqvae, names, VAR_EMOJI_SAMPLING).save_pretrained(out / "var-emoji64-small", shared={"vqvae": "../var-emoji64/vqvae"})

    held_out = data["is_eval"]
    images = torch.from_numpy(data["images"][held_out]).permute(0, 3, 1, 2).float() / 127.5 - 1
    labels = torch.from_numpy(data["labels"][held_out]).long()
    tokens = torch.cat(vqvae.encode(images), 1)
    facts = {
        "eval_nll": {name: float(var_token_nll(VARPipeline(m, vqvae), labels, tokens).mean()) for name, m in (("large", large), ("small", small))},
        "vqvae_eval_mse": float(F.mse_loss(vqvae(images).reconstruction, images)),
        "codes_used": int(torch.unique(tokens).numel()),
        "params": {name: sum(p.numel() for p in m.parameters()) for name, m in (("vqvae", vqvae), ("large", large), ("small", small))},
        "runs": {name: last_log(run) for name, run in (("vqvae", args.vqvae), ("large", args.large), ("small", args.small))},
    }
    (out / "var-emoji64" / "MODEL_CARD.md").write_text(model_card(facts))
    print(json.dumps(facts, indent=1))


def model_card(f: dict) -> str:
    row = lambda name, what: component_row(f, name, what)
    L, S = VAR_EMOJI["large"], VAR_EMOJI["small"]
    return f"""# var-emoji64: bundled VAR models (a large and a small model for collaborative decoding)

Trained on this project's CPU machine by `training/train_var.py` (its docstring has the exact
commands; deterministic for a seed and thread count) on the same emoji set as `emoji64`
(see `../emoji64/MODEL_CARD.md` for the data): 64x64 images, 74 classes, horizontal flips.

## Models

| component | what | parameters | steps | batch | peak lr | last logged training loss |
|---|---|---|---|---|---|---|
{row("vqvae", "VAR multi-scale VQVAE, 8x downsampling, scales 1,2,3,4,6,8 (130 tokens), 512 codes of dim 16")}
{row("large", f"VAR transformer, depth {L['depth']}, width {L['embed_dim']}, {L['num_heads']} heads (`var-emoji64`)")}
{row("small", f"VAR transformer, depth {S['depth']}, width {S['embed_dim']}, {S['num_heads']} heads (`var-emoji64-small`)")}

Same code and state-dict layout as the official VAR and VQVAE, at emoji scale. The VQVAE loss is
L1 + L2 reconstruction plus the official multi-scale VQ/commitment loss (no perceptual or GAN
loss); every 50 steps (in the first 80% of the run) codes a batch did not use restart at random
encoder vectors. Held-out
reconstruction MSE {f['vqvae_eval_mse']:.4f} on images in [-1, 1]; {f['codes_used']} codes used by the
held-out images. The transformers use the official objective (cross-entropy over all 130 tokens,
teacher-forced with the VQVAE's next-scale inputs, 10% of labels dropped to the null class), the
official initialisation (AdaLN gamma 1e-3), AdamW (betas 0.9/0.95, weight decay 0.05), cosine schedule,
100 warm-up steps, gradient clipping 1.0. NLL of the held-out images' tokens: large
{f['eval_nll']['large']:.3f}, small {f['eval_nll']['small']:.3f} nats/token (uniform: 6.238).

The VQVAE ships in float16 (rounded before every figure here was computed); the transformers in float32.

## Sampling defaults

Saved with the pipelines: guidance scale {VAR_EMOJI_SAMPLING['guidance_scale']} (the official ramp: the last
scale is guided with 1 + 2.0), no top-k, no top-p, temperature 1.0; chosen to match `emoji64`'s
guidance, not tuned on the proxies.

## Reproduce

The commands in the docstring of `training/train_var.py` (the two VAR runs ran side by side,
one thread each; the VQVAE with two threads).

## Limits

A toy for offline tests and benchmarks of next-scale decoding, collaborative decoding and token
pruning, not for pictures: blurry, and most classes beyond faces and simple symbols come out as
coloured blobs.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    vq = jobs.add_parser("vqvae")
    vq.add_argument("--data", required=True)
    tok = jobs.add_parser("tokenize")
    for name in ("--data", "--vqvae", "--out"):
        tok.add_argument(name, required=True)
    exp = jobs.add_parser("export")
    for name in ("--data", "--vqvae", "--large", "--small", "--out"):
        exp.add_argument(name, required=True)
    var = jobs.add_parser("var")
    var.add_argument("--preset", choices=sorted(VAR_EMOJI), required=True)
    var.add_argument("--codes", required=True)
    var.add_argument("--vqvae", required=True)
    for p, lr, batch in ((vq, 1e-3, 32), (var, 1e-3, 32)):
        add_training_arguments(p, lr, batch)
    args = parser.parse_args()
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    {"vqvae": train_vqvae, "tokenize": tokenize, "var": train_var, "export": export}[args.job](args)


if __name__ == "__main__":
    main()
