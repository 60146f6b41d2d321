"""Train the bundled MAR models on the emoji set: a KL VAE and two MARs of different sizes on its
latents (a target and a drafter, for continuous speculative decoding).

Same harness as `training/train.py` (deterministic for a seed and thread count, resumable,
atomic checkpoints):

    python -m training.train_mar vae --data data/emoji64.npz --out runs/mar-vae --steps 200 --batch-size 16 \
        --lr 5e-4 --warmup 20 --threads 2
    python -m training.train_mar latents --data data/emoji64.npz --vae runs/mar-vae --out runs/mar-latents.npz
    python -m training.train_mar mar --preset target --latents runs/mar-latents.npz --out runs/mar-target \
        --steps 5000 --threads 1
    python -m training.train_mar mar --preset draft --latents runs/mar-latents.npz --out runs/mar-draft \
        --steps 5000 --threads 1
    python -m training.train_mar export --data data/emoji64.npz --vae runs/mar-vae --latents runs/mar-latents.npz \
        --target runs/mar-target --draft runs/mar-draft --out image_ar/assets
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.train import add_training_arguments, component_row, last_log, load_images, load_trained, random_flip, round_to_half, train_loop
from mmgen.image_ar.mar.mar import MAR, MARConfig
from mmgen.image_ar.mar.vae import DiagonalGaussian, KLVAE, KLVAEConfig

#: 64x64 images, 8x downsampling, 4-channel latents: 64 tokens of 4 dims (patch size 1). The
#: encoder/decoder trunk is the bundled VAR VQVAE's (same LDM skeleton, attention at 8x8), so
#: the VAE starts from its weights (`warm_start`) and only the 16 -> 4 channel bottleneck is new.
KL_EMOJI = KLVAEConfig(embed_dim=4, z_channels=16, ch=32, ch_mult=(1, 2, 2, 4), num_res_blocks=1,
                       encoder_attn_resolutions=(8,), decoder_attn_resolutions=(8,), resolution=64)
VAR_VQVAE = Path(__file__).resolve().parents[1] / "image_ar" / "assets" / "var-emoji64" / "vqvae" / "model.safetensors"
#: KL weight on the per-image KL (summed over the 256 latent dims), against mean L1 + L2 pixel
#: losses: small enough to keep reconstructions sharp, large enough to keep latents near N(0, s²).
KL_WEIGHT = 1e-5
#: A target and a drafter on one VAE (the official presets tie the head's size to the model's).
MAR_EMOJI = {
    "target": dict(encoder_embed_dim=128, encoder_depth=2, encoder_num_heads=4, decoder_embed_dim=128, decoder_depth=2,
                   decoder_num_heads=4, diffloss_d=3, diffloss_w=128),
    "draft": dict(encoder_embed_dim=64, encoder_depth=1, encoder_num_heads=2, decoder_embed_dim=64, decoder_depth=1,
                  decoder_num_heads=2, diffloss_d=2, diffloss_w=64),
}
#: What both sizes share: the emoji latent grid, a 4-token class buffer (officially 64 for 256
#: tokens), 50 respaced head steps (officially 100) and 2 diffusion draws per token in training
#: (officially 4), to keep CPU training and sampling affordable. The heads sample with the
#: predicted x0 clipped to +-5 (5 standard deviations of the tokens; see
#: `MARConfig.clip_denoised`): unclipped, their eps error at t = 999 (about 0.04) blows tokens up
#: to the hundreds.
MAR_COMMON = dict(img_size=64, vae_stride=8, patch_size=1, vae_embed_dim=KL_EMOJI.embed_dim, buffer_size=4,
                  num_sampling_steps="50", diffusion_batch_mul=2, clip_denoised=5.0)


def warm_start(model: KLVAE, vqvae_file: Path) -> KLVAE:
    """Copy the VAR VQVAE's encoder and decoder into the KL VAE (training a 64x64 VAE from scratch
    costs about 2 s a step on 2 CPU cores). The fused `qkv` convs split into `q`, `k`, `v`; the
    encoder's output conv gives the posterior means' trunk (its extra log-variance channels start
    at zero); the 1x1 quant convs (the new bottleneck) keep their random init."""
    from safetensors.torch import load_file

    source, target = load_file(str(vqvae_file)), model.state_dict()
    for key, value in source.items():
        value = value.float()
        if ".qkv." in key:
            for name, part in zip("qkv", value.chunk(3)):
                target[key.replace(".qkv.", f".{name}.")].copy_(part)
        elif key.startswith("encoder.conv_out."):
            target[key].zero_()[: value.shape[0]].copy_(value)
        elif key.startswith(("encoder.", "decoder.")):
            target[key].copy_(value)
    model.load_state_dict(target)
    return model


def train_vae(args) -> None:
    images, _, _ = load_images(args.data)
    torch.manual_seed(args.seed)
    model = warm_start(KLVAE(KL_EMOJI), VAR_VQVAE)

    def loss_fn(index, generator):
        x = random_flip(images[index], generator)
        posterior = model.encode(x)
        recon = model.decode(posterior.sample(generator))
        rec = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        kl = posterior.kl().mean()
        return rec + KL_WEIGHT * kl, {"recon": rec.item(), "kl": kl.item()}

    train_loop(model, loss_fn, len(images), args, {"vae": KL_EMOJI.to_dict(), "kl_weight": KL_WEIGHT, "args": vars(args)})


@torch.no_grad()
def latents(args) -> None:
    """Posterior moments of every training image and of its mirror image (MAR's cached-latent
    training samples the posterior at every step), and the scaling factor that gives the
    sampled latents unit standard deviation."""
    images, labels, names = load_images(args.data)
    vae = load_trained(KLVAE(KL_EMOJI), args.vae)
    moments = torch.cat([vae.encode(chunk).moments for flip in (False, True)
                         for chunk in (images.flip(-1) if flip else images).split(256)])
    sample = DiagonalGaussian(moments).sample(torch.Generator().manual_seed(0))
    scale = float(1.0 / sample.std())
    np.savez_compressed(args.out, moments=moments.numpy(), labels=torch.cat([labels, labels]).numpy(),
                        class_names=np.array(names), scaling_factor=scale)
    print(f"wrote {args.out}: {tuple(moments.shape)}, latent std {sample.std():.4f}, scaling factor {scale:.4f}")


def mar_config(preset: str, num_classes: int) -> MARConfig:
    return MARConfig(**MAR_EMOJI[preset], **MAR_COMMON, class_num=num_classes)


def train_mar(args) -> None:
    """The official objective (`MAR.forward`): diffusion loss on the masked tokens of a random
    order with a truncated-normal mask ratio, 10% of labels dropped for CFG; latents sampled
    from the cached posterior at every step, times the scaling factor."""
    data = np.load(args.latents)
    moments, labels = torch.from_numpy(data["moments"]), torch.from_numpy(data["labels"]).long()
    scale = float(data["scaling_factor"])
    config = mar_config(args.preset, len(data["class_names"]))
    torch.manual_seed(args.seed)
    model = MAR(config)

    def loss_fn(index, generator):
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))  # the blocks' dropout
        x = DiagonalGaussian(moments[index]).sample(generator) * scale
        return model(x, labels[index], generator), {}

    train_loop(model, loss_fn, len(moments), args, {"mar": config.to_dict(), "scaling_factor": scale, "args": vars(args)})


#: Sampling defaults saved with the bundled MAR pipelines (see the model card).
MAR_EMOJI_SAMPLING = {"num_iter": 16, "guidance_scale": 2.0, "cfg_schedule": "linear", "temperature": 1.0}


@torch.no_grad()
def export(args) -> None:
    """Write `mar-emoji64` (target MAR + VAE) and `mar-emoji64-draft` (drafter, VAE shared with
    the target) and the model card."""
    from mmgen.image_ar.bench.mar import mar_diffusion_loss
    from mmgen.image_ar.mar import MARPipeline

    data = np.load(args.data)
    names = [str(c) for c in data["class_names"]]
    scale = float(np.load(args.latents)["scaling_factor"])
    out = Path(args.out)
    vae = KLVAE(replace(KL_EMOJI, scaling_factor=scale))
    vae.load_state_dict(load_trained(KLVAE(KL_EMOJI), args.vae).state_dict())
    vae = round_to_half(vae.eval())
    target = load_trained(MAR(mar_config("target", len(names))), args.target)
    draft = load_trained(MAR(mar_config("draft", len(names))), args.draft)
    MARPipeline(target, vae, names, MAR_EMOJI_SAMPLING).save_pretrained(out / "mar-emoji64", dtypes={"vae": torch.float16})
    MARPipeline(draft, vae, names, MAR_EMOJI_SAMPLING).save_pretrained(out / "mar-emoji64-draft", shared={"vae": "../mar-emoji64/vae"})

    held_out = data["is_eval"]
    images = torch.from_numpy(data["images"][held_out]).permute(0, 3, 1, 2).float() / 127.5 - 1
    labels = torch.from_numpy(data["labels"][held_out]).long()
    posterior = vae.encode(images)
    latent = posterior.mode() * scale
    facts = {
        "eval_loss": {name: mar_diffusion_loss(m, latent, labels) for name, m in (("target", target), ("draft", draft))},
        "vae_eval_mse": float(F.mse_loss(vae.decode(posterior.mode()), images)),
        "scaling_factor": scale,
        "params": {name: sum(p.numel() for p in m.parameters()) for name, m in (("vae", vae), ("target", target), ("draft", draft))},
        "runs": {name: last_log(run) for name, run in (("vae", args.vae), ("target", args.target), ("draft", args.draft))},
    }
    (out / "mar-emoji64" / "MODEL_CARD.md").write_text(model_card(facts))
    print(json.dumps(facts, indent=1))


def model_card(f: dict) -> str:
    row = lambda name, what: component_row(f, name, what)
    T, D = MAR_EMOJI["target"], MAR_EMOJI["draft"]
    size = lambda c: (f"MAR, encoder/decoder {c['encoder_depth']}+{c['decoder_depth']} blocks of width {c['encoder_embed_dim']}, "
                      f"diffusion head {c['diffloss_d']} blocks of width {c['diffloss_w']}")
    s = MAR_EMOJI_SAMPLING
    return f"""# mar-emoji64: bundled MAR models (a target and a drafter)

Trained on this project's CPU machine by `training/train_mar.py` (its docstring has the exact
commands; deterministic for a seed and thread count) on the same emoji set as `emoji64`
(see `../emoji64/MODEL_CARD.md` for the data): 64x64 images, 74 classes, horizontal flips.

## Models

| component | what | parameters | steps | batch | peak lr | last logged training loss |
|---|---|---|---|---|---|---|
{row("vae", "KL VAE (the official AutoencoderKL layout), 8x downsampling, 4-channel latents, warm-started from `var-emoji64`'s VQVAE trunk")}
{row("target", size(T) + " (`mar-emoji64`)")}
{row("draft", size(D) + " (`mar-emoji64-draft`)")}

Same code and state-dict layout as the official MAR, DiffLoss and KL VAE, at emoji scale: the
8x8x4 latent is a sequence of 64 tokens of 4 dims (patch size 1), the class buffer is 4 tokens
(officially 64), and the head samples on 50 respaced steps of the 1000-step cosine schedule
(officially 100) with its predicted x0 clipped to +-5 (`clip_denoised`; officially unclipped: these
small heads predict eps at t = 999 to about 0.04, which the unclipped cosine sampler multiplies
into tokens in the hundreds). The VAE loss is L1 + L2 reconstruction plus {KL_WEIGHT:g} x the posterior's KL
(no perceptual or GAN loss); held-out reconstruction MSE {f['vae_eval_mse']:.4f} from the posterior
mean, on images in [-1, 1]. Tokens are latents x {f['scaling_factor']:.4f} (the VAE's
`scaling_factor`: unit standard deviation on the training set; MAR's official KL-16 uses 0.2325).
The MARs use the official objective (diffusion loss on the masked tokens, mask ratio from a
truncated normal with minimum 0.7, 2 diffusion draws per token (officially 4), 10% of labels dropped to the
null class), AdamW (betas 0.9/0.95, weight decay 0.05), cosine schedule, 100 warm-up steps,
gradient clipping 1.0, no EMA. Held-out diffusion loss (the training loss on the held-out
images' latents, four fixed draws): target {f['eval_loss']['target']:.4f}, drafter {f['eval_loss']['draft']:.4f}.

The VAE ships in float16 (rounded before every figure here was computed); the MARs in float32.

## Sampling defaults

Saved with the pipelines: {s['num_iter']} masked steps (4 tokens per step on average; officially 64 for 256
tokens), guidance {s['guidance_scale']} with the official linear schedule, temperature {s['temperature']}; not tuned on
the proxies.

## Reproduce

The commands in the docstring of `training/train_mar.py` (the two MAR runs ran side by side,
one thread each).

## Limits

A toy for offline tests and benchmarks of masked continuous-token generation and continuous
speculative decoding, not for pictures.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    vae = jobs.add_parser("vae")
    vae.add_argument("--data", required=True)
    lat = jobs.add_parser("latents")
    for name in ("--data", "--vae", "--out"):
        lat.add_argument(name, required=True)
    exp = jobs.add_parser("export")
    for name in ("--data", "--vae", "--latents", "--target", "--draft", "--out"):
        exp.add_argument(name, required=True)
    mar = jobs.add_parser("mar")
    mar.add_argument("--preset", choices=sorted(MAR_EMOJI), required=True)
    mar.add_argument("--latents", required=True)
    for p, lr, batch in ((vae, 1e-3, 32), (mar, 1e-3, 32)):
        add_training_arguments(p, lr, batch)
    args = parser.parse_args()
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    {"vae": train_vae, "latents": latents, "mar": train_mar, "export": export}[args.job](args)


if __name__ == "__main__":
    main()
