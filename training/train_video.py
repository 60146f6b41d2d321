r"""Train the bundled block-diffusion video pair on moving-emoji clips: `emoji-motion` and its
small companion `emoji-motion-small` (`mmgen.video.pipeline.BlockDiffusionVideoPipeline`).

Every component is diffusers' or transformers' own module in a small configuration: a Wan-layout
`AutoencoderKLWan` (x4 space, x4 time), a word-level tokenizer over the caption vocabulary with a
tiny `UMT5EncoderModel`, and two `WanTransformer3DModel`s of the same latent space. Clips come from
`mmgen.video.data` (pure functions of (seed, index), made on the fly; `TRAIN_SEED` for training,
`HELD_OUT_SEED` for the VAE's held-out figures; the quality proxies' real clips and prompts are
corpus 0 and their reference frames corpus 1, as `mmgen.video.quality.calibrate` uses).

The transformers learn flow matching under teacher forcing (CausVid's): the sequence is the clean
latents of all blocks but the last (timestep 0) followed by a noisy copy of every block (its own
noise level), in one forward with a mask (`teacher_forcing_mask`): a clean block sees the clean
blocks up to itself, a noisy block the clean blocks before it and itself; the noisy copy has its
clean counterpart's rotary frame positions. That is exactly what the cached block decode computes
(`tests/video/test_train_video.py` checks it in float64), so the model is trained on the
computation the pipeline runs. The loss is MSE(v, noise - x0) on the noisy half. `TEXT_DROPOUT`
of the captions are "" (the pipeline's negative prompt) for classifier-free guidance.

The loop, checkpointing and data order are `training/train.py`'s (`train_loop`: resumable,
randomness from (seed, step)), so a killed and resumed run ends with the weights of one that never
stopped.

    # The shipped VAE: a base-16 encoder trained plainly, then with the sprites weighted, then
    # against a critic (each run starting from the last one's checkpoint), and a base-32 decoder
    # trained behind that encoder, frozen (so the denoisers' latents stay valid).
    python -m training.train_video vae --out runs/video-vae2 --z-dim 16 --steps 9000 --frames 9 --eval-every 500 \
        --threads 1  # to 2,800; then without --frames 9 (whole 17-frame clips) to 3,800
    cp -r runs/video-vae2 runs/video-vae2-fg  # at step 3,800
    python -m training.train_video vae --out runs/video-vae2-fg --foreground-weight 4 --z-dim 16 --steps 9000 \
        --eval-every 500 --threads 1  # from 3,800 to 5,600
    python -m training.train_video vae --out runs/video-vae2-gan --branch-from runs/video-vae2-fg --foreground-weight 4 \
        --adversarial-weight 0.5 --z-dim 16 --steps 9000 --eval-every 500 --threads 1  # from 5,600 to 9,000
    python -m training.train_video vae --out runs/video-dec32-gan --encoder-from runs/video-vae2-gan --decoder-base-dim 32 \
        --steps 8000 --autocast bf16 --frames 17 --foreground-weight 4 --adversarial-weight 0.5 --adversarial-from 1500 \
        --eval-every 500 --threads 1
    # or on a borrowed GPU: bf16 autocast, clips drawn ahead in 12 processes, stop after 4 minutes
    # (the denoisers take --device cuda and --minutes too, `latents` --device cuda)
    python -m training.train_video vae --device cuda --workers 12 --batch-size 32 --minutes 4 --out runs/video-vae
    python -m training.train_video vae-quality --vae runs/video-dec32-gan --threads 1   # PSNR, proxies through the VAE
    python -m training.train_video latents --vae runs/video-vae2-gan --out runs/video-latents-gan.npz --clips 8000 --threads 1
    python -m training.train_video target --latents runs/video-latents-gan.npz --out runs/video-target-gan --steps 8000 \
        --ema 0.999 --threads 1 --eval-every 500 --vae runs/video-vae2-gan  # --ema from step 3,200 on
    python -m training.train_video small --latents runs/video-latents-gan.npz --text-encoder runs/video-target-gan/text_encoder \
        --out runs/video-small-gan --steps 8000 --ema 0.999 --threads 1 --eval-every 500 --vae runs/video-vae2-gan
    python -m training.train_video export --vae runs/video-dec32-gan --target runs/video-target-gan \
        --small runs/video-small-gan --out video/assets
    python -m training.train_video card --vae runs/video-dec32-gan --target runs/video-target-gan \
        --small runs/video-small-gan --assets video/assets --out video/assets/emoji-motion/MODEL_CARD.md
    # Then, on a machine without those runs, the target continued from the shipped weights (a new
    # run: fresh optimizer and schedule) and was exported beside the shipped VAE and small model:
    python -m training.train_video latents --vae video/assets/emoji-motion --out runs/video-latents-shipped.npz \
        --clips 8000 --threads 1
    python -m training.train_video target --init-from video/assets/emoji-motion --text-steps 0 \
        --latents runs/video-latents-shipped.npz --out runs/video-target-ft --steps 2400 --lr 5e-4 --warmup 50 \
        --ema 0.999 --threads 1 --eval-every 400 --vae video/assets/emoji-motion
    python -m training.train_video export --vae video/assets/emoji-motion --target runs/video-target-ft \
        --small video/assets/emoji-motion-small --out video/assets
    # Where a denoiser loses the prompt: its rows with a real past, and its first frame alone
    python -m training.train_video diagnose --pipeline video/assets/emoji-motion --out runs/diagnose.json --threads 1

Run folders do not outlive the machine they trained on; the shipped weights do. A denoiser run
can start from them (`target --init-from video/assets/emoji-motion --text-steps 0`, `small
--init-from video/assets/emoji-motion-small --text-encoder video/assets/emoji-motion/text_encoder`):
a new run with a fresh optimizer and its own schedule, its held-out figures logged first at
step 0 for the weights it starts from. `--vae video/assets/emoji-motion` reads the shipped VAE
(for `latents` and the held-out figures), whose encoder made the shipped denoisers' latents.

`self-forcing` trains a shipped transformer on its own rollouts through the cached block decode
(Self-Forcing; the objective is student forcing's flow matching, not the paper's distribution
matching: `self-forcing --help` says why), e.g. at 4 steps per block:

    python -m training.train_video self-forcing --init-from video/assets/emoji-motion \
        --latents runs/video-latents-shipped.npz --out runs/self-forcing --steps 2000 --steps-per-block 4 \
        --ema 0.999 --threads 1 --eval-every 200 --vae video/assets/emoji-motion
    # or distilled to 4 steps on its own rollouts, the starting model at 8 steps as the teacher
    # (how the bundled pair was made from its 8-step weights: the model card has the commands)
    python -m training.train_video self-forcing --objective distill --anchor-blocks 0 \
        --init-from video/assets/emoji-motion --latents runs/video-latents-shipped.npz --out runs/self-forcing-distill \
        --steps 2500 --ema 0.998 --threads 1 --eval-every 250 --eval-clips 32 --vae video/assets/emoji-motion

The exported pair's figures: `quality` (the card's table, quality.json), `techniques` (every
decoding technique, quality beside speed: docs/results/video_emoji-motion_cpu.json) and `compare`
(pipelines side by side, frame by frame, with a PNG sheet):

    python -m training.train_video quality --assets video/assets --out video/assets/emoji-motion/quality.json
    python -m training.train_video techniques --out docs/results/video_emoji-motion_cpu.json --threads 1
    python -m training.train_video compare --pipelines "4 steps=video/assets/emoji-motion" \
        "8 steps=video/assets/emoji-motion@8" --out runs/compare.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from training.train import (add_training_arguments, last_log, load_trained, log_heldout, round_to_half, train_loop,
                              trained_weights, wall_clock)

#: Clips of the training corpus, the VAE's held-out corpus (never trained on) and the proxies' corpora.
TRAIN_SEED, HELD_OUT_SEED, PROMPT_SEED, REFERENCE_SEED = 100, 2, 0, 1
#: Clips the trainers index (each made on the fly from (TRAIN_SEED, index)).
TRAIN_CLIPS = 100_000

#: The VAE: Wan's layout at emoji scale. Three levels (x4 in space, so a 16-24 px sprite is 4-6
#: latent pixels), both downsamplings also in time (x4: 17 frames -> 5 latent frames). `base_dim`
#: and `z_dim` are the `vae` job's `--base-dim` / `--z-dim` (a run's config.json keeps them).
VAE = dict(base_dim=16, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
           scale_factor_spatial=4, scale_factor_temporal=4)
#: Per-element KL weight against the mean L1 + L2 pixel loss: latents stay near N(0, s^2) without
#: blurring the reconstructions (the latents are normalised per channel afterwards anyway). The
#: decoder reads the posterior's mode (a deterministic autoencoder with a KL penalty), as the
#: pipeline's latents are the mode (`encode_video`); the posterior's std, which starts at 1, far
#: above the means' scale, would otherwise drown the latents early in a short run.
KL_WEIGHT = 1e-3


def vae_config(base_dim: int = VAE["base_dim"], z_dim: int = VAE["z_dim"], decoder_base_dim: Optional[int] = None) -> dict:
    config = dict(VAE, base_dim=base_dim, z_dim=z_dim, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    if decoder_base_dim and decoder_base_dim != base_dim:
        config["decoder_base_dim"] = decoder_base_dim
    assert config["scale_factor_spatial"] == 2 ** (len(config["dim_mult"]) - 1)
    assert config["scale_factor_temporal"] == 2 ** sum(config["temperal_downsample"])
    return config


# ---------------------------------------------------------------------------- data


def corpus(seed: int, length: int = TRAIN_CLIPS, num_frames: int = 17):
    from mmgen.video.data import MovingEmoji, MovingEmojiConfig

    return MovingEmoji(MovingEmojiConfig(num_frames=num_frames), seed, length)


def clips(data, index: torch.Tensor) -> torch.Tensor:
    """Clips `index` of `data` as float [B, 3, T, H, W] in [-1, 1]."""
    from mmgen.video.data import frames_to_tensor

    return frames_to_tensor(np.stack([data[int(i)].frames for i in index]))


def clip_frames(data, indices: list[int]) -> np.ndarray:
    return np.stack([data[i].frames for i in indices])


class PrefetchedClips:
    """`clips(data, index)` for the batches `train_loop` will ask for, made ahead by `workers`
    processes: a GPU step of the small VAE takes less time than one thread needs to draw its
    clips. The batch order is `batches`' own, so the clips (and the weights) are the ones the
    loop would have made in this process."""

    def __init__(self, data, args, start: int, workers: int, ahead: int = 32):
        import multiprocessing
        from collections import deque
        from concurrent.futures import ProcessPoolExecutor

        from training.train import batches

        self.data, self.ahead = data, ahead
        self.order = batches(len(data), args.batch_size, args.seed, start)
        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        self.pending = deque()

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        from mmgen.video.data import frames_to_tensor

        while len(self.pending) < self.ahead:
            upcoming = next(self.order)
            self.pending.append((upcoming, self.pool.submit(clip_frames, self.data, upcoming.tolist())))
        upcoming, frames = self.pending.popleft()
        assert torch.equal(upcoming, index), "the prefetched batch order drifted from train_loop's"
        return frames_to_tensor(frames.result())


def foreground_mask(video: torch.Tensor, threshold: float = 0.05) -> torch.Tensor:
    """[B, 1, T, H, W] float: 1 where a clip's pixel (in [-1, 1]) is not its plain background (the
    most common colour of its first frame), widened by a pixel so that sprites' edges count."""
    masks = []
    for clip in video:
        colours, counts = torch.unique(clip[:, 0].flatten(1).T, dim=0, return_counts=True)
        background = colours[counts.argmax()][:, None, None, None]
        masks.append(((clip - background).abs().amax(0, keepdim=True) > threshold).float())
    return F.max_pool3d(torch.stack(masks), (1, 3, 3), stride=1, padding=(0, 1, 1))


def latent_foreground(video: torch.Tensor, spatial: int, temporal: int = 4) -> torch.Tensor:
    """bool [B, F, H / spatial, W / spatial]: the latent positions whose pixels hold a sprite
    (`foreground_mask`) in any frame they encode: frame 0 alone, then each `temporal` frames
    (the causal VAE's chunks), each `spatial` x `spatial` pixels."""
    mask = foreground_mask(video)[:, 0]  # [B, T, H, W]
    chunks = torch.cat([mask[:, :1], F.max_pool3d(mask[:, 1:], (temporal, 1, 1))], 1)
    return F.max_pool3d(chunks, (1, spatial, spatial)) > 0


def gradient_difference(recon: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mean L1 distance between the horizontal and vertical pixel differences of two videos
    [B, C, T, H, W] (Mathieu et al., 2016's gradient difference loss), weighted per pixel by
    `weight` [B, 1, T, H, W] where given: it penalises blur, which L1 + L2 on pixels tolerates."""
    total = 0.0
    for dim in (3, 4):
        error = (recon.diff(dim=dim) - target.diff(dim=dim)).abs()
        if weight is None:
            total = total + error.mean()
        else:
            w = weight.narrow(dim, 1, weight.shape[dim] - 1)
            total = total + (w * error).mean() / w.mean()
    return total


def random_crop(video: torch.Tensor, frames: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """Per clip, `frames` consecutive frames from a random start and a random size x size window."""
    B, _, T, H, W = video.shape
    t0 = torch.randint(0, T - frames + 1, (B,), generator=generator).tolist()
    y0 = torch.randint(0, H - size + 1, (B,), generator=generator).tolist()
    x0 = torch.randint(0, W - size + 1, (B,), generator=generator).tolist()
    return torch.stack([v[:, t:t + frames, y:y + size, x:x + size] for v, t, y, x in zip(video, t0, y0, x0)])


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR (dB) of videos in [-1, 1], over pixels in [0, 1]."""
    mse = F.mse_loss(a.clamp(-1, 1), b.clamp(-1, 1)).item() / 4
    return 10 * math.log10(1 / max(mse, 1e-12))


# ---------------------------------------------------------------------------- VAE


class PatchCritic(torch.nn.Module):
    """A PatchGAN discriminator (Isola et al., 2017) on single frames, as VQGAN's adversarial term
    uses one (Esser et al., 2021): a real-or-reconstructed logit per 26 px patch of each frame.
    Trained from scratch beside the VAE; no pretrained network enters the loss."""

    def __init__(self, channels: int = 32):
        super().__init__()
        c, act = channels, lambda: torch.nn.LeakyReLU(0.2)
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, c, 4, 2, 1), act(),
            torch.nn.Conv2d(c, 2 * c, 4, 2, 1), torch.nn.GroupNorm(8, 2 * c), act(),
            torch.nn.Conv2d(2 * c, 4 * c, 3, 1, 1), torch.nn.GroupNorm(8, 4 * c), act(),
            torch.nn.Conv2d(4 * c, 1, 3, 1, 1))

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        """[B, 3, T, H, W] in [-1, 1] -> logits [B * T, 1, H / 4, W / 4]."""
        return self.net(video.transpose(1, 2).flatten(0, 1))


class VAEWithCritic(torch.nn.Module):
    """What an adversarial `vae` run checkpoints: the VAE (keys `vae.*`) and its critic (`critic.*`)."""

    def __init__(self, vae, critic: PatchCritic):
        super().__init__()
        self.vae, self.critic = vae, critic


def vae_weights(state: dict) -> dict:
    """The VAE's weights from a `vae` run's checkpoint: the whole state of a plain run, the `vae.*`
    keys (unprefixed) of an adversarial one."""
    if not any(key.startswith("critic.") for key in state):
        return state
    return {key[len("vae."):]: value for key, value in state.items() if key.startswith("vae.")}


def adaptive_weight(reconstruction: torch.Tensor, adversarial: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """VQGAN's balance of the adversarial term: the ratio of the two losses' gradient norms at the
    decoder's last layer, so the critic's push is as large as the reconstruction's whatever the scale."""
    g_rec = torch.autograd.grad(reconstruction, last, retain_graph=True)[0]
    g_adv = torch.autograd.grad(adversarial, last, retain_graph=True)[0]
    return (g_rec.norm() / (g_adv.norm() + 1e-4)).clamp(0, 1e4).detach()


def branch_checkpoint(parent: Path, out: Path, critic: Optional[PatchCritic], critic_lr_scale: float) -> None:
    """Start run `out` at `parent`'s checkpoint (weights, optimizer, step) and log. With `critic`,
    a plain parent's state is lifted into `VAEWithCritic`'s: its VAE under `vae.*`, the fresh critic
    beside it, and an optimizer group for the critic without moments yet."""
    from training.train import save_atomic

    state = torch.load(parent / "checkpoint.pt", map_location="cpu", weights_only=True)
    if critic is not None and not any(key.startswith("critic.") for key in state["model"]):
        state.pop("ema", None)  # a weight average restarts beside the new critic
        state["model"] = {**{f"vae.{k}": v for k, v in state["model"].items()},
                          **{f"critic.{k}": v for k, v in critic.state_dict().items()}}
        groups = state["optimizer"]["param_groups"]
        first = len(groups[0]["params"])
        groups.append({**groups[0], "params": list(range(first, first + len(list(critic.parameters())))),
                       "lr_scale": critic_lr_scale, "clip_apart": True})
    out.mkdir(parents=True, exist_ok=True)
    if (parent / "log.jsonl").exists():
        (out / "log.jsonl").write_bytes((parent / "log.jsonl").read_bytes())
    save_atomic(state, out / "checkpoint.pt")


def new_vae(seed: int = 0, config: Optional[dict] = None):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**(config or vae_config()))


@torch.no_grad()
def held_out_psnr(vae, count: int, device: str = "cpu") -> float:
    """Reconstruction PSNR (dB) of the first `count` held-out clips (corpus `HELD_OUT_SEED`, whole
    17-frame clips), a mean over clips in batches of 16."""
    data, total = corpus(HELD_OUT_SEED, count), 0.0
    for start in range(0, count, 16):
        x = clips(data, torch.arange(start, min(start + 16, count)))
        total += psnr(vae(x.to(device)).sample.float().cpu(), x) * len(x)
    return total / count


def run_vae_config(run: str | Path) -> dict:
    """The VAE configuration a `vae` run trains (its config.json), the default for runs without one."""
    saved = Path(run) / "config.json"
    return json.loads(saved.read_text())["vae"] if saved.exists() else vae_config()


def train_vae(args) -> None:
    """Reconstruction (L1 + L2; `--foreground-weight` weighs the sprites' pixels up, as they are
    what the class proxy reads and a small share of each frame) plus a small KL on random crops
    (`--frames` frames, `--crop` px) of training clips; the last `--full-steps` steps see whole
    64x64 frames (the mid-block's attention then works at the size it will be used at).
    `--adversarial-weight` adds VQGAN's hinge GAN term from `--adversarial-from` on: a
    `PatchCritic` judges reconstructed frames against real ones, against the blur that pixel
    losses settle for. `--branch-from RUN` starts at another run's checkpoint.
    `--encoder-from RUN` trains a decoder alone (`--decoder-base-dim` channels wide) behind RUN's
    finished, frozen encoder, so RUN's latents, and denoisers trained on them, stay valid.
    Finished, `finish_vae` writes `<out>/vae`."""
    data = corpus(TRAIN_SEED, num_frames=17)
    if args.encoder_from:
        if not (Path(args.encoder_from) / "vae" / "config.json").exists():
            raise SystemExit(f"--encoder-from {args.encoder_from}: not a finished vae run (no vae/ folder)")
        encoder_vae = load_vae_run(args.encoder_from)
        config = dict(vae_config(encoder_vae.config.base_dim, encoder_vae.config.z_dim, args.decoder_base_dim),
                      latents_mean=list(encoder_vae.config.latents_mean), latents_std=list(encoder_vae.config.latents_std))
    else:
        config = vae_config(args.base_dim, args.z_dim, args.decoder_base_dim)
    vae = new_vae(args.seed, config)
    if args.encoder_from:
        freeze_encoder(vae, encoder_vae)
    trained = [p for p in vae.parameters() if p.requires_grad]
    params = sum(p.numel() for p in trained)
    critic = None
    if args.adversarial_weight:
        torch.manual_seed(args.seed + 1)
        critic = PatchCritic()
    if args.branch_from and not (Path(args.out) / "checkpoint.pt").exists():
        branch_checkpoint(Path(args.branch_from), Path(args.out), critic, args.critic_lr_scale)
    checkpoint = Path(args.out) / "checkpoint.pt"
    if checkpoint.exists():
        adversarial = any(k.startswith("critic.") for k in torch.load(checkpoint, map_location="cpu", weights_only=True)["model"])
        if adversarial != (critic is not None):
            raise SystemExit(f"{checkpoint} is {'an adversarial' if adversarial else 'a plain'} run's: "
                             f"{'add' if adversarial else 'drop'} --adversarial-weight, or --branch-from it into a new --out")
    model = vae if critic is None else VAEWithCritic(vae, critic)
    groups = [{"params": trained}] + ([] if critic is None else [{
        "params": list(critic.parameters()), "lr_scale": args.critic_lr_scale, "clip_apart": True}])
    print(f"vae: {params / 1e6:.2f}M parameters trained{' (the decoder; the encoder frozen)' if args.encoder_from else ''}, "
          f"{config['z_dim']} latent channels, x{VAE['scale_factor_spatial']} space x{VAE['scale_factor_temporal']} time")
    full_from = args.steps - args.full_steps
    calls = {"step": None}
    draw = (lambda index: clips(data, index)) if not args.workers else \
        PrefetchedClips(data, args, step_of(args, None), args.workers)

    def loss_fn(index, generator):
        step = calls["step"] = step_of(args, calls["step"])
        size = 64 if step >= full_from else args.crop
        video = draw(index)
        if args.foreground_weight:  # the sprites' mask rides along as a fourth channel through the crop
            video = torch.cat([video, foreground_mask(video)], 1)
        x = random_crop(video, args.frames, size, generator).to(args.device)
        x, weight = (x[:, :3], 1 + args.foreground_weight * x[:, 3:]) if args.foreground_weight else (x, None)
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.mode(), return_dict=False)[0]
        if weight is None:
            rec = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        else:
            error = (recon - x).abs() + (recon - x).pow(2)
            rec = (weight * error).mean() / weight.mean()
        metrics, loss = {"recon": round(rec.item(), 5), "size": size}, rec
        if not args.encoder_from:
            kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1 - posterior.logvar).mean()
            metrics["kl"] = round(kl.item(), 4)
            loss = loss + KL_WEIGHT * kl
        if args.gradient_weight:
            edges = gradient_difference(recon, x, weight)
            loss = loss + args.gradient_weight * edges
            metrics["edges"] = round(edges.item(), 5)
        if critic is not None and step >= args.adversarial_from:
            # The generator's term sees the critic's weights as constants and the critic's term the
            # reconstruction as one, so one backward trains each against the other.
            frozen = {name: w.detach() for name, w in critic.named_parameters()}
            fooled = -torch.func.functional_call(critic, frozen, (recon,)).mean()
            balance = adaptive_weight(loss, fooled, vae.decoder.conv_out.weight)
            judged = F.relu(1 - critic(x)).mean() + F.relu(1 + critic(recon.detach())).mean()
            loss = loss + args.adversarial_weight * balance * fooled + judged
            metrics.update(fooled=round(fooled.item(), 4), balance=round(balance.item(), 4), critic=round(judged.item(), 4))
        return loss, metrics

    def heldout() -> dict:  # train_loop calls it in eval mode, without gradients
        score = held_out_psnr(vae, args.heldout_clips, args.device)
        return {"psnr_db": round(score, 3), "score": score, "metric": "psnr_db"}

    train_loop(model, loss_fn, len(data), args, {"vae": config, "params": params, "args": vars(args)},
               heldout=heldout if args.eval_every else None, param_groups=groups)
    if int(torch.load(Path(args.out) / "checkpoint.pt", map_location="cpu", weights_only=True)["step"]) == args.steps:
        finish_vae(args.out, args.stats_clips, args.eval_clips)


def freeze_encoder(vae, source) -> None:
    """Give `vae` the encoder side (`encoder.*`, `quant_conv.*`) of `source` and freeze it: its
    posterior, hence every latent it encodes, is `source`'s."""
    encoder_side = {k: v for k, v in source.state_dict().items() if k.startswith(("encoder.", "quant_conv."))}
    unexpected = vae.load_state_dict(encoder_side, strict=False).unexpected_keys
    if unexpected:
        raise SystemExit(f"the encoder does not fit this VAE: {unexpected[:3]}")
    for module in (vae.encoder, vae.quant_conv):
        module.requires_grad_(False)


def step_of(args, previous: Optional[int]) -> int:
    """The step `train_loop` is at, inside its loss function: the checkpoint's step on the first
    call of this invocation, then one more per call (the loop calls the loss once per step)."""
    if previous is not None:
        return previous + 1
    checkpoint = Path(args.out) / "checkpoint.pt"
    if not checkpoint.exists():
        return 0
    return int(torch.load(checkpoint, map_location="cpu", weights_only=True)["step"])


def load_vae_run(run: str | Path):
    """The trained VAE of a run, rounded to float16 (as it ships), with the run's latent
    statistics (`<run>/vae`, written by `finish_vae`) when present."""
    from diffusers import AutoencoderKLWan

    folder = Path(run) / "vae"
    if (folder / "config.json").exists():
        return AutoencoderKLWan.from_pretrained(str(folder)).eval()
    return load_vae_checkpoint(run)


def load_vae_checkpoint(run: str | Path, name: str = "checkpoint.pt"):
    """The VAE of a run's `checkpoint.pt` (or `best.pt`), rounded to float16 (as it ships)."""
    vae = new_vae(config=run_vae_config(run))
    vae.load_state_dict(vae_weights(trained_weights(torch.load(Path(run) / name, map_location="cpu", weights_only=True))))
    return round_to_half(vae.eval())


@torch.no_grad()
def finish_vae(run: str | Path, stats_clips: int, eval_clips: int) -> dict:
    """Round the trained VAE to float16 (as it ships), set its config's per-channel
    `latents_mean` / `latents_std` from the posterior means of `stats_clips` training clips, save
    it as `<run>/vae` (diffusers folder) and its held-out reconstruction PSNR in `<run>/eval.json`.
    A decoder-only run (`--encoder-from`) keeps its frozen encoder's statistics, which the latents
    it decodes were normalised with."""
    vae = load_vae_checkpoint(run)
    if vae.config.latents_std == [1.0] * vae.config.z_dim:
        data = corpus(TRAIN_SEED)
        total, total_sq, count = 0.0, 0.0, 0
        for start in range(0, stats_clips, 16):
            z = vae.encode(clips(data, torch.arange(start, min(start + 16, stats_clips)))).latent_dist.mode().double()
            total = total + z.sum((0, 2, 3, 4))
            total_sq = total_sq + z.pow(2).sum((0, 2, 3, 4))
            count += z[:, 0].numel()
        mean = total / count
        std = (total_sq / count - mean.pow(2)).clamp_min(1e-12).sqrt()
        vae.register_to_config(latents_mean=[round(float(m), 5) for m in mean],
                               latents_std=[round(float(s), 5) for s in std])
    result = {"psnr_db": held_out_psnr(vae, eval_clips), "eval_clips": eval_clips, "stats_clips": stats_clips,
              "latents_mean": vae.config.latents_mean, "latents_std": vae.config.latents_std}
    vae.save_pretrained(str(Path(run) / "vae"))
    (Path(run) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


@torch.no_grad()
def encode_latents(args) -> None:
    """Normalised latents (`mmgen.video.vae.encode_video`: posterior mode, the config's
    statistics) of training clips `--first` ... `--first + --clips - 1`, with their captions,
    encoded on `--device` (drawing a clip costs a few milliseconds of one CPU thread, encoding
    it on the CPU some 30 times more: the encoder is what a GPU speeds up)."""
    from mmgen.video.data import frames_to_tensor
    from mmgen.video.vae import encode_video

    device = torch.device(args.device)
    vae = load_vae_run(args.vae).to(device)
    if not any(vae.config.latents_std) or vae.config.latents_std == [1.0] * vae.config.z_dim:
        raise ValueError(f"{args.vae}: run `finish_vae` first (the VAE has no latent statistics)")
    data = corpus(TRAIN_SEED)
    end = args.first + args.clips
    latents, foreground, captions = [], [], []
    started = time.time()
    for start in range(args.first, end, 16):
        chunk = [data[i] for i in range(start, min(start + 16, end))]  # each clip drawn once
        frames = frames_to_tensor(np.stack([clip.frames for clip in chunk])).to(device)
        latents.append(encode_video(vae, frames).half().cpu())
        foreground.append(latent_foreground(frames.cpu(), vae.config.scale_factor_spatial, vae.config.scale_factor_temporal))
        captions += [clip.caption for clip in chunk]
        if len(captions) % 256 == 0:
            print(f"{len(captions)} clips, {time.time() - started:.0f} s", flush=True)
    latents = torch.cat(latents)
    np.savez(args.out, latents=latents.numpy(), captions=np.array(captions), indices=np.arange(args.first, end),
             foreground=torch.cat(foreground).numpy())
    print(f"wrote {args.out}: {tuple(latents.shape)}, mean {latents.float().mean():.3f}, std {latents.float().std():.3f}")


# ---------------------------------------------------------------------------- text


#: Special tokens of the word-level tokenizer (T5's ids: pad 0, end of text 1, unknown 2).
SPECIAL = ("<pad>", "</s>", "<unk>")
#: Tokens the pipeline reads per prompt (the longest caption is 9 words and </s>).
MAX_TEXT = 12
#: The text encoder: a tiny UMT5 (dropout off: training randomness comes only from (seed, step)).
TEXT_ENCODER = dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, relative_attention_num_buckets=8,
                    relative_attention_max_distance=16, dropout_rate=0.0)
#: Share of training captions replaced by "" (the pipeline's negative prompt): the unconditional
#: branch of classifier-free guidance.
TEXT_DROPOUT = 0.1


def caption_words() -> list[str]:
    """Every word a caption of the corpus can have (sprite names, motion phrases, "and")."""
    from mmgen.video.data import DEFAULT_SPRITES, PHRASES

    words = {w for name in DEFAULT_SPRITES for w in name.split()} | {w for p in PHRASES.values() for w in p.split()}
    return sorted(words | {"and"})


def new_tokenizer():
    """A word-level tokenizer over `caption_words()` that ends every text with </s> (as T5's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update({w: i + len(SPECIAL) for i, w in enumerate(caption_words())})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=MAX_TEXT)


def new_text_encoder(seed: int = 0):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=len(SPECIAL) + len(caption_words()), **TEXT_ENCODER, pad_token_id=0, eos_token_id=1,
                        decoder_start_token_id=0)
    return UMT5EncoderModel(config)


class PromptEncoder:
    """`BlockDiffusionVideoPipeline.encode_prompt` with gradients: UMT5 states [B, MAX_TEXT, D],
    zero past each prompt's tokens (token ids cached per text)."""

    def __init__(self, tokenizer, text_encoder, max_length: int = MAX_TEXT):
        self.tokenizer, self.text_encoder, self.max_length = tokenizer, text_encoder, max_length
        self.ids: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, texts: list[str]) -> torch.Tensor:
        for text in set(texts) - set(self.ids):
            batch = self.tokenizer([text], padding="max_length", max_length=self.max_length, truncation=True,
                                   add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
            self.ids[text] = (batch.input_ids[0], batch.attention_mask[0])
        device = next(self.text_encoder.parameters()).device
        ids = torch.stack([self.ids[t][0] for t in texts]).to(device)
        mask = torch.stack([self.ids[t][1] for t in texts]).to(device)
        states = self.text_encoder(ids, mask).last_hidden_state
        return states * mask[..., None].to(states.dtype)


# ---------------------------------------------------------------------------- transformers

#: The two denoisers (diffusers' WanTransformer3DModel fields). Latents are the VAE's `z_dim`
#: channels at 16x16 per latent frame; 2x2 patches make 64 tokens a frame.
PRESETS = {
    "target": dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=512, num_layers=4),
    "small": dict(num_attention_heads=2, attention_head_dim=32, ffn_dim=256, num_layers=2),
    # A wider, deeper target (3.9M parameters, about 2.5x the target's step time on the CPU): the
    # target's class accuracy has stayed flat over training, its sprites the right colour and the
    # wrong shape, so the question this shape asks is whether capacity is what limits it.
    "wide": dict(num_attention_heads=6, attention_head_dim=32, ffn_dim=768, num_layers=6),
}
TRANSFORMER_COMMON = dict(patch_size=(1, 2, 2), text_dim=TEXT_ENCODER["d_model"], freq_dim=64, cross_attn_norm=True, rope_max_seq_len=1024)
#: Latent frames per block (the first latent frame is one video frame, each later one four).
BLOCK_FRAMES = 1
#: Training noise levels: u ~ U(0, 1) per block, warped by the flow shift (as `FlowSchedule` warps
#: its timesteps), so training covers the levels the sampler visits.
TRAIN_SHIFT = 3.0


def new_transformer(preset: str, seed: int = 0, channels: int = VAE["z_dim"]):
    """A denoiser of `channels` latent channels (the VAE's `z_dim`)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**PRESETS[preset], **TRANSFORMER_COMMON, in_channels=channels, out_channels=channels)


def shifted(u: torch.Tensor, shift: float) -> torch.Tensor:
    """`FlowSchedule`'s warp of noise levels u in [0, 1]."""
    return shift * u / (1 + (shift - 1) * u)


def teacher_forcing_mask(num_frames: int, block_frames: int, tokens_per_frame: int) -> torch.Tensor:
    """[S, S] bool (True: may attend) over [clean frames 0 ... F - b - 1 ; noisy frames 0 ... F - 1]
    (b = block_frames): a clean block sees the clean blocks up to itself, a noisy block the clean
    blocks before it and itself. (The last block's clean copy would be seen by nobody: left out.)"""
    clean = torch.arange(num_frames - block_frames) // block_frames
    noisy = torch.arange(num_frames) // block_frames
    block = torch.cat([clean, noisy]).repeat_interleave(tokens_per_frame)
    is_noisy = torch.cat([torch.zeros(len(clean), dtype=torch.bool), torch.ones(len(noisy), dtype=torch.bool)])
    is_noisy = is_noisy.repeat_interleave(tokens_per_frame)
    q_block, k_block = block[:, None], block[None, :]
    q_noisy, k_noisy = is_noisy[:, None], is_noisy[None, :]
    clean_query = ~q_noisy & ~k_noisy & (k_block <= q_block)
    noisy_query = q_noisy & ((~k_noisy & (k_block < q_block)) | (k_noisy & (k_block == q_block)))
    return clean_query | noisy_query


def teacher_forcing_velocity(transformer, clean: torch.Tensor, noisy: torch.Tensor, sigmas: torch.Tensor,
                             text: torch.Tensor, block_frames: int = BLOCK_FRAMES) -> torch.Tensor:
    """The velocity of every noisy block [B, C, F, h, w] in one forward, each block seeing the
    clean latents `clean` [B, C, F, h, w] of the blocks before it (what the cached decode computes
    after committing them). `sigmas` [B, F / block_frames]: each noisy block's noise level (its
    timestep is 1000 sigma; clean frames have timestep 0). The noisy copy of a frame has its clean
    counterpart's rotary position."""
    from mmgen.video.attention import MaskedSelfAttention, processors_installed, rotary_tables

    B, _, F_, h, w = noisy.shape
    p = transformer.config.patch_size
    tokens = (h // p[1]) * (w // p[2])
    context = F_ - block_frames
    cos, sin = rotary_tables(transformer, F_, h, w)
    rotary = (torch.cat([cos[:, :context * tokens], cos], 1), torch.cat([sin[:, :context * tokens], sin], 1))
    mask = teacher_forcing_mask(F_, block_frames, tokens).to(noisy.device)
    t_noisy = (1000.0 * sigmas).repeat_interleave(block_frames * tokens, dim=1)
    t = torch.cat([torch.zeros(B, context * tokens, dtype=t_noisy.dtype, device=t_noisy.device), t_noisy], 1)

    class TeacherForcingAttention(MaskedSelfAttention):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary)

    sequence = torch.cat([clean[:, :, :context], noisy], 2)
    with processors_installed(transformer, lambda i: TeacherForcingAttention(mask)):
        out = transformer(sequence, t, encoder_hidden_states=text, return_dict=False)[0]
    return out[:, :, context:]


@torch.no_grad()
def teacher_forced_sample(transformer, clean: torch.Tensor, noise: torch.Tensor, sigmas: Sequence[float], text: torch.Tensor,
                          empty: Optional[torch.Tensor] = None, guidance_scale: float = 1.0,
                          block_frames: int = BLOCK_FRAMES) -> torch.Tensor:
    """Every block [B, C, F, h, w] sampled from `noise` along `sigmas` as the pipeline's Euler
    sampler does (guided by the `empty` prompt's velocity where `guidance_scale` is not 1; the
    last step's x0 prediction is the block), each block seeing the given clean latents `clean`
    of the blocks before it instead of its own earlier blocks. With the pipeline's own blocks as
    `clean` and its draws as `noise` this is the pipeline's decode (test); with real latents it
    shows what each block makes given a perfect past."""
    B, _, F_, _, _ = noise.shape
    x, x0 = noise, noise
    for i, sigma in enumerate(sigmas):
        level = torch.full((B, F_ // block_frames), float(sigma), dtype=noise.dtype, device=noise.device)
        v = teacher_forcing_velocity(transformer, clean, x, level, text, block_frames)
        if guidance_scale != 1.0:
            unguided = teacher_forcing_velocity(transformer, clean, x, level, empty, block_frames)
            v = unguided + guidance_scale * (v - unguided)
        x0 = x - sigma * v
        if i + 1 < len(sigmas):
            x = x + (sigmas[i + 1] - sigma) * v
    return x0


class Latents:
    """Training latents (normalised, [N, C, F, h, w]) and captions from `latents` files, and
    where every file has it, the sprites' latent positions (`foreground`, bool [N, F, h, w])."""

    def __init__(self, paths: list[str]):
        parts = [np.load(path) for path in paths]
        self.latents = torch.from_numpy(np.concatenate([p["latents"] for p in parts]))
        self.captions = [str(c) for p in parts for c in p["captions"]]
        self.foreground = (torch.from_numpy(np.concatenate([p["foreground"] for p in parts]))
                           if all("foreground" in p for p in parts) else None)

    def __len__(self) -> int:
        return len(self.captions)


def flow_loss(transformer, prompts: PromptEncoder, data: Latents, index: torch.Tensor, generator: torch.Generator,
              text_dropout: float, shift: float, block_frames: int = BLOCK_FRAMES, train_text: bool = True,
              foreground_weight: float = 0.0, first_frames: int = 0, first_blocks_only: bool = False) -> torch.Tensor:
    """Teacher-forced flow matching on latents `index`: x_sigma = (1 - sigma) x0 + sigma noise per
    block, MSE of the predicted velocity against noise - x0 over the noisy blocks. With
    `foreground_weight` w, a latent position under a sprite weighs 1 + w (a weighted mean): the
    background, most of every frame, otherwise outweighs the sprites' detail, as in the VAE's
    reconstruction loss. `first_frames` N > 0 adds the first blocks of N more clips (drawn from
    `generator`), each denoised alone as a free rollout's first block is (from the prompt, with
    no past), to the same mean: the first block is the one a rollout cannot copy from its past,
    and a whole clip spends only 1/F of its loss on it (while costing F times its tokens).
    Randomness is drawn on the CPU (the same on every device), then moved to the transformer's
    device."""
    if first_frames:
        extra = torch.randint(0, len(data), (first_frames,), generator=generator)
        whole = flow_loss(transformer, prompts, data, index, generator, text_dropout, shift, block_frames, train_text,
                          foreground_weight)
        first = flow_loss(transformer, prompts, data, extra, generator, text_dropout, shift, block_frames, train_text,
                          foreground_weight, first_blocks_only=True)
        frames = data.latents.shape[2]
        return (len(index) * frames * whole + first_frames * block_frames * first) / (len(index) * frames + first_frames * block_frames)
    device = transformer.patch_embedding.weight.device
    x0 = data.latents[index].float()
    if first_blocks_only:
        x0 = x0[:, :, :block_frames]
    B, _, F_, _, _ = x0.shape
    drop = (torch.rand(B, generator=generator) < text_dropout).tolist()
    texts = ["" if d else data.captions[int(i)] for i, d in zip(index, drop)]
    noise = torch.randn(x0.shape, generator=generator).to(device)
    sigmas = shifted(torch.rand(B, F_ // block_frames, generator=generator), shift).to(device)
    x0 = x0.to(device)
    s = sigmas.repeat_interleave(block_frames, dim=1)[:, None, :, None, None]
    noisy = (1 - s) * x0 + s * noise
    with torch.set_grad_enabled(train_text and torch.is_grad_enabled()):
        text = prompts(texts)
    v = teacher_forcing_velocity(transformer, x0, noisy, sigmas, text, block_frames)
    if not foreground_weight:
        return F.mse_loss(v.float(), noise - x0)
    if data.foreground is None:
        raise ValueError("--foreground-weight needs latents files with the sprites' positions (`latents` writes them)")
    weight = 1 + foreground_weight * data.foreground[index][:, None, :x0.shape[2]].float().to(device)
    return (weight * (v.float() - (noise - x0)) ** 2).mean() / weight.mean()


def load_text_encoder(folder: str | Path):
    """A saved text encoder in float32 (a shipped one is stored in float16)."""
    from transformers import UMT5EncoderModel

    return UMT5EncoderModel.from_pretrained(str(folder)).float().eval()


def train_transformer(args) -> None:
    """`target`: the transformer and the text encoder together; the text encoder is rounded to
    float16 (as it ships) and frozen after `--text-steps` steps and saved to `<out>/text_encoder`
    (what `small` reads). `small`: the transformer alone on that frozen text encoder."""
    data = Latents(args.latents)
    if args.foreground_weight and data.foreground is None:  # refused before any work, as `flow_loss` would at its first step
        raise ValueError(f"{' '.join(args.latents)}: --foreground-weight needs latents files with the sprites' positions "
                         "(`latents` writes them)")
    started_from = init_from(args)
    if started_from is not None:
        transformer = started_from["transformer"]
    else:
        transformer = new_transformer(args.shape or args.job, args.seed, channels=data.latents.shape[1])
    tokenizer = new_tokenizer()
    if args.job == "target":
        if started_from is not None:
            text_encoder = started_from["text_encoder"]
        elif args.text_encoder:  # a frozen one (the small model shipped beside it reads it)
            if args.text_steps != 0:
                raise ValueError("--text-encoder is kept frozen: give --text-steps 0")
            text_encoder = load_text_encoder(args.text_encoder).to(args.device)
        else:
            text_encoder = new_text_encoder(args.seed + 1)
        model = torch.nn.ModuleDict({"transformer": transformer, "text_encoder": text_encoder})
    else:
        text_encoder = load_text_encoder(args.text_encoder).to(args.device)
        text_encoder.requires_grad_(False)
        model = torch.nn.ModuleDict({"transformer": transformer})
    prompts = PromptEncoder(tokenizer, text_encoder)
    snapshot = Path(args.out) / "text_encoder"
    if args.job == "target" and args.text_steps < step_of(args, None):  # resumed past the freeze
        assert snapshot.exists(), f"{snapshot} is missing"
        text_encoder.requires_grad_(False)
    calls: dict[str, Any] = {"step": None}

    def loss_fn(index, generator):
        step = calls["step"] = step_of(args, calls["step"])
        if args.job == "target" and step == args.text_steps:
            freeze_text_encoder(text_encoder, snapshot)  # the same weights however often it runs (resumes)
            text_encoder.requires_grad_(False)  # a weight average copies it from here on
        trained = args.job == "target" and step < args.text_steps
        loss = flow_loss(transformer, prompts, data, index, generator, args.text_dropout, args.shift, train_text=trained,
                         foreground_weight=args.foreground_weight, first_frames=args.first_frames)
        return loss, {"text": "trained" if trained else "frozen"}

    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("transformer", transformer), ("text_encoder", text_encoder))}
    print(f"{args.job}: transformer {params['transformer'] / 1e6:.2f}M, text encoder {params['text_encoder'] / 1e6:.2f}M "
          f"({'trained' if args.job == 'target' and args.text_steps > 0 else 'frozen'}), {len(data)} clips, latents {tuple(data.latents.shape[1:])}")
    config = {"preset": args.job, "shape": args.shape or args.job, "transformer": dict(transformer.config), "text_encoder": text_encoder.config.to_dict(),
              "block_frames": BLOCK_FRAMES, "params": params,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    heldout = None
    if args.eval_every:
        if not args.vae:
            raise ValueError("--eval-every needs --vae (the VAE run the latents came from)")
        heldout = GeneratedQuality(load_vae_run(args.vae), transformer, text_encoder, args.eval_clips, args.reference_clips)
    if started_from is not None and heldout is not None:  # the curve starts at the weights it continues
        log_start(model, heldout, args)
    train_loop(model, loss_fn, len(data), args, config, heldout=heldout)
    if args.job == "target" and args.text_steps >= args.steps and step_of(args, None) == args.steps:
        freeze_text_encoder(text_encoder, snapshot)


def init_from(args) -> Optional[dict]:
    """The modules a new run starts from with `--init-from` (a pipeline folder as it ships, e.g.
    video/assets/emoji-motion): its transformer, and for the target its text encoder, in float32.
    None without the option or where `--out` already holds a checkpoint (a resume goes on from
    that). Shipped weights are what survives a machine that lost its run folders; a run from them
    is a new run (fresh optimizer, its own schedule), not a resume of the one that made them."""
    if not args.init_from or (Path(args.out) / "checkpoint.pt").exists():
        return None
    if args.shape:
        raise ValueError("--init-from takes the shipped transformer's shape: drop --shape")
    if args.job == "target" and args.text_steps != 0:
        raise ValueError("--init-from keeps the shipped text encoder frozen (the small model reads it): give --text-steps 0")
    if args.job == "target":
        transformer, text_encoder = load_transformer_run(args.init_from, with_text_encoder=True)
        return {"transformer": transformer, "text_encoder": text_encoder}
    return {"transformer": load_transformer_run(args.init_from)}


# ---------------------------------------------------------------------------- Self-Forcing


#: What the `self-forcing` job does and why (its --help; the module docstring says it shorter).
SELF_FORCING = """Self-Forcing (Huang et al., 2025): the denoiser trains on its own rollouts through the cached block
decode it runs at inference (`BlockRollout` over `WanBlockModel`: the same KV cache, processors and
clean commit pass), against teacher forcing's exposure bias (trained on clean real pasts, a model
decodes from its own imperfect ones, and its subject melts as the clip goes on).

Each step draws a block b; the past blocks 0 .. b-1 are committed into the model's cache by a
rollout of the model itself (no gradients; --steps-per-block Euler steps per block, guidance 3 as
the pipeline samples), except the first --anchor-blocks, which are the clip's own latents committed
by the same clean pass; one forward with gradients then predicts block b's velocity at one of the
schedule's noise levels (those the few-step sampler visits; --levels continuous: any level, as the
teacher-forcing jobs train) from the real block noised there.

Objectives (--objective), neither the paper's distribution matching: DMD needs a teacher's score and
a second, "fake" score network trained beside the student (three models, two optimizers), too heavy
for this CPU, and it matches the teacher's distribution, which a regression onto the teacher's own
samples also reaches when the teacher is deterministic (an Euler ODE sampler is):
- student-forcing (default): flow matching against noise - x0 on the real block given the model's
  own past.
- distill: few-step distillation on the student's own rollouts (CausVid's ODE regression, run on
  Self-Forcing's self-generated past): the frozen starting model (the teacher) and the student see
  the same past, the student's rollout committed into both caches; from one noise the teacher
  samples block b in --teacher-steps steps, the student runs its --steps-per-block schedule to an
  exit step drawn uniformly (the paper's random exit step), and its x0 prediction there is
  regressed onto the teacher's sample, so every step of the few-step schedule lands where the
  many-step teacher does, from the past the student will really see. Use --anchor-blocks 0: the
  teacher follows whatever past the student made. --teacher puts another model of the same
  latents and text encoder in the teacher's place; a student far smaller than its teacher
  regresses onto the teacher's mean (the bundled small model taught by the target drew blank
  frames within 500 steps), so the bundled small model distils from itself.
Why the anchor (student forcing): a free rollout's first frame puts the
sprite where the real clip's next block does not, and a target that contradicts its past teaches
the model to ignore the past; with the clip's first block committed the sprite's place is the
clip's, the model's later blocks carry its own errors (shape drift, wrong motion), and the real
block is the way back from them. Gradients flow through block b's one forward only (the paper
keeps them to each block's last denoising step); the past's keys and values are the rollout's,
without gradients. In student forcing, the guided batch's unconditional half (the "" prompt on the
same past) weighs --text-dropout; distillation regresses the guided x0, both halves in it. A run starts from --init-from's
weights with a fresh optimizer; it resumes from <out>/checkpoint.pt (weights, optimizer, step; every
draw derives from (seed, step), so a resumed run ends with an uninterrupted one's weights)."""


class GradientCache:
    """A decode's `FrameKVCache` as the one forward with gradients sees it: the held frames' keys
    and values (written without gradients by the rollout) with the block's own after them, joined
    out of place. `FrameKVCache.update` writes every layer's block into one shared buffer, and
    each write would invalidate what autograd saved from the layers before; the keys and values
    attended to are the same."""

    def __init__(self, cache):
        self.cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, index: Optional[torch.Tensor] = None):
        if index is not None:
            raise ValueError("static-token dropping is an inference option: not in training")
        held, cache = self.cache.frames * self.cache.tokens_per_frame, self.cache
        return (torch.cat([cache.k[layer, :, :held], k.to(cache.k.dtype)], 1),
                torch.cat([cache.v[layer, :, :held], v.to(cache.v.dtype)], 1))


def self_forcing_loss(model, prompts: PromptEncoder, data: Latents, index: torch.Tensor, generator: torch.Generator,
                      schedule, guidance_scale: float, anchor_blocks: int, text_dropout: float,
                      continuous: bool = False) -> tuple[torch.Tensor, dict]:
    """Student forcing through the cached block decode (`self-forcing`'s objective, see its help):
    for a block b drawn uniformly, the blocks before it are committed into `model`'s (a
    `WanBlockModel`) cache by a `BlockRollout` of the model itself (no gradients; `schedule`'s
    steps, guidance `guidance_scale`), the first `anchor_blocks` of them the clip's own latents
    committed by the same clean pass; then one forward with gradients predicts block b's velocity
    at one of the schedule's noise levels (`continuous`: u ~ U(0, 1) warped by the schedule's
    shift, as teacher forcing draws them) from the real block noised there, against noise - x0.
    The guided batch's unconditional half (the "" prompt, on the same past) weighs `text_dropout`.
    Draws come from `generator` (CPU), the rollout's from a generator seeded by it on the model's
    device."""
    from mmgen.decoding import BlockDenoising
    from mmgen.decoding.block_diffusion import BlockRollout
    from mmgen.video.model import PromptEmbeddings

    device = model.transformer.patch_embedding.weight.device
    x0 = data.latents[index].float()
    B, _, frames, _, _ = x0.shape
    f = model.block_frames
    block = int(torch.randint(0, frames // f, (1,), generator=generator))
    if continuous:
        sigma = float(shifted(torch.rand(1, generator=generator), schedule.shift))
    else:
        sigmas = schedule.sigmas()
        sigma = sigmas[int(torch.randint(0, len(sigmas), (1,), generator=generator))]
    noise = torch.randn(x0[:, :, :f].shape, generator=generator).to(device)
    rollout_generator = torch.Generator(device).manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=generator)))
    x0 = x0.to(device)
    guided = guidance_scale != 1.0
    with torch.no_grad():
        conditions = PromptEmbeddings(prompts([data.captions[int(i)] for i in index]), prompts([""] * B) if guided else None)
    with BlockRollout(BlockDenoising(schedule=schedule), model, conditions, block + 1, rollout_generator, guidance_scale) as rollout:
        state = rollout.states[id(model)]
        with torch.no_grad():
            for b in range(block):
                if b < anchor_blocks:
                    model.commit(state, x0[:, :, b * f:(b + 1) * f])  # the clip's own block, as a committed one
                else:
                    rollout.step()
        model.condition(state, conditions)  # the prompt's keys and values computed again, with gradients
        target = x0[:, :, block * f:(block + 1) * f]
        cache, state.context.cache = state.context.cache, GradientCache(state.context.cache)
        try:
            cond, uncond = model.velocity(state, (1 - sigma) * target + sigma * noise, 1000.0 * sigma)
        finally:
            state.context.cache = cache
    loss = F.mse_loss(cond.float(), noise - target)
    if uncond is not None:
        loss = (1 - text_dropout) * loss + text_dropout * F.mse_loss(uncond.float(), noise - target)
    return loss, {"block": block, "sigma": round(sigma, 4), "own_blocks": max(0, block - anchor_blocks)}


def self_forcing_distill_loss(model, teacher, prompts: PromptEncoder, data: Latents, index: torch.Tensor,
                              generator: torch.Generator, schedule, teacher_schedule, guidance_scale: float,
                              anchor_blocks: int) -> tuple[torch.Tensor, dict]:
    """Few-step distillation on the student's own rollouts (`self-forcing --objective distill`, see
    its help): for a block b drawn uniformly, the blocks before it are the student's (`model`, a
    `WanBlockModel`) own rollout at `schedule` (no gradients; the first `anchor_blocks` the clip's
    own latents), committed into the student's cache and the frozen teacher's (`teacher`, a
    `WanBlockModel` of the starting weights); from one noise the teacher samples block b along
    `teacher_schedule` (no gradients), the student runs its schedule to an exit step s drawn
    uniformly, and its x0 prediction there (the one forward with gradients) is regressed onto the
    teacher's sample. Both sample guided at `guidance_scale`, as the pipeline does."""
    from mmgen.decoding import BlockDenoising
    from mmgen.decoding.block_diffusion import BlockRollout
    from mmgen.video.model import PromptEmbeddings

    device = model.transformer.patch_embedding.weight.device
    x0 = data.latents[index].float().to(device)
    B, _, frames, _, _ = x0.shape
    f = model.block_frames
    block = int(torch.randint(0, frames // f, (1,), generator=generator))
    sigmas, teacher_sigmas = schedule.sigmas(), teacher_schedule.sigmas()
    exit_step = int(torch.randint(0, len(sigmas), (1,), generator=generator))
    noise = torch.randn(x0[:, :, :f].shape, generator=generator).to(device)
    rollout_generator = torch.Generator(device).manual_seed(int(torch.randint(0, 2 ** 62, (1,), generator=generator)))
    guided = guidance_scale != 1.0
    guide = lambda cond, uncond: cond if uncond is None else uncond + guidance_scale * (cond - uncond)
    with torch.no_grad():
        conditions = PromptEmbeddings(prompts([data.captions[int(i)] for i in index]), prompts([""] * B) if guided else None)
    taught = teacher.start(conditions, block + 1, guided)
    try:
        with BlockRollout(BlockDenoising(schedule=schedule), model, conditions, block + 1, rollout_generator, guidance_scale) as rollout:
            state = rollout.states[id(model)]
            with torch.no_grad():
                for b in range(block):
                    if b < anchor_blocks:
                        past = x0[:, :, b * f:(b + 1) * f]
                        model.commit(state, past)  # the clip's own block, as a committed one
                    else:
                        past = rollout.step()
                    teacher.commit(taught, past)
                x = noise  # the teacher's block: its whole schedule from the noise
                for i, sigma in enumerate(teacher_sigmas):
                    v = guide(*teacher.velocity(taught, x, 1000.0 * sigma))
                    target = x - sigma * v
                    if i + 1 < len(teacher_sigmas):
                        x = x + (teacher_sigmas[i + 1] - sigma) * v
                x = noise  # the student's: its schedule up to the exit step
                for i in range(exit_step):
                    v = guide(*model.velocity(state, x, 1000.0 * sigmas[i]))
                    x = x + (sigmas[i + 1] - sigmas[i]) * v
            model.condition(state, conditions)  # the prompt's keys and values computed again, with gradients
            cache, state.context.cache = state.context.cache, GradientCache(state.context.cache)
            try:
                predicted = x - sigmas[exit_step] * guide(*model.velocity(state, x, 1000.0 * sigmas[exit_step]))
            finally:
                state.context.cache = cache
    finally:
        teacher.finish(taught)
    loss = F.mse_loss(predicted.float(), target.float())
    return loss, {"block": block, "exit_step": exit_step, "own_blocks": max(0, block - anchor_blocks)}


def self_forcing_error(args) -> Optional[str]:
    """What is wrong with a `self-forcing` command (one line), checked before any work; None if nothing."""
    init = Path(args.init_from)
    if not ((init / "transformer" / "config.json").exists() and (init / "text_encoder" / "config.json").exists()):
        return f"--init-from {args.init_from}: not a pipeline folder with transformer/ and text_encoder/ (e.g. video/assets/emoji-motion)"
    missing = [path for path in args.latents if not Path(path).is_file()]
    if missing:
        return f"--latents {missing[0]}: no such file (make one with `latents`)"
    for name, value, low in (("--steps-per-block", args.steps_per_block, 1), ("--anchor-blocks", args.anchor_blocks, 0),
                             ("--teacher-steps", args.teacher_steps, 1)):
        if value < low:
            return f"{name} must be >= {low}, got {value}"
    if not args.shift > 0:
        return f"--shift must be > 0, got {args.shift}"
    if not 0 <= args.text_dropout <= 1:
        return f"--text-dropout must be in [0, 1], got {args.text_dropout}"
    if args.teacher is not None:
        if args.objective != "distill":
            return "--teacher is for --objective distill"
        teacher = Path(args.teacher)
        if not ((teacher / "transformer" / "config.json").exists() or (teacher / "config.json").exists()):
            return f"--teacher {args.teacher}: neither a pipeline folder with transformer/ nor a target run"
    if args.eval_every and not args.vae:
        return "--eval-every needs --vae (e.g. video/assets/emoji-motion, whose VAE made the latents)"
    if args.vae and not ((Path(args.vae) / "vae" / "config.json").exists() or (Path(args.vae) / "checkpoint.pt").exists()):
        return f"--vae {args.vae}: neither a pipeline folder with vae/ nor a vae run"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {args.device}: CUDA is not available here"
    return None


def train_self_forcing(args) -> None:
    """The `self-forcing` job (its help says what and why): the `--init-from` pipeline folder's
    transformer trains on `self_forcing_loss` beside its frozen text encoder (saved to
    `<out>/text_encoder`, so `export --target <out>` takes the run as it takes a target run)."""
    from mmgen.decoding import FlowSchedule
    from mmgen.video.model import WanBlockModel

    data = Latents(args.latents)
    blocks = data.latents.shape[2] // BLOCK_FRAMES
    if args.anchor_blocks >= blocks:
        raise SystemExit(f"train_video self-forcing: --anchor-blocks {args.anchor_blocks} leaves none of the clips' "
                         f"{blocks} blocks to the model's own rollout: give at most {blocks - 1}")
    transformer, text_encoder = load_transformer_run(args.init_from, with_text_encoder=True)
    text_encoder.requires_grad_(False)
    model = torch.nn.ModuleDict({"transformer": transformer, "text_encoder": text_encoder})
    out = Path(args.out)
    fresh = not (out / "checkpoint.pt").exists()
    freeze_text_encoder(text_encoder, out / "text_encoder")  # the shipped weights (already float16): unchanged
    prompts = PromptEncoder(new_tokenizer(), text_encoder)
    block_model = WanBlockModel(transformer, BLOCK_FRAMES, tuple(data.latents.shape[3:]))
    schedule = FlowSchedule.uniform(args.steps_per_block, args.shift)
    guidance = PIPELINE["guidance_scale"]
    if args.objective == "distill":  # the starting weights (or --teacher's), frozen, sample the targets
        frozen = load_transformer_run(args.teacher or args.init_from).to(args.device).requires_grad_(False)
        teacher = WanBlockModel(frozen, BLOCK_FRAMES, tuple(data.latents.shape[3:]))
        teacher_schedule = FlowSchedule.uniform(args.teacher_steps, args.shift)

    def loss_fn(index, generator):
        if args.objective == "distill":
            return self_forcing_distill_loss(block_model, teacher, prompts, data, index, generator, schedule,
                                             teacher_schedule, guidance, args.anchor_blocks)
        return self_forcing_loss(block_model, prompts, data, index, generator, schedule, guidance, args.anchor_blocks,
                                 args.text_dropout, continuous=args.levels == "continuous")

    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("transformer", transformer), ("text_encoder", text_encoder))}
    print(f"self-forcing: transformer {params['transformer'] / 1e6:.2f}M from {args.init_from} (text encoder frozen), "
          f"{len(data)} clips, latents {tuple(data.latents.shape[1:])}, {args.steps_per_block} steps per block, "
          f"guidance {guidance:g}, first {args.anchor_blocks} block(s) of each past the clip's own")
    config = {"preset": "target", "job": "self-forcing", "transformer": dict(transformer.config),
              "text_encoder": text_encoder.config.to_dict(), "block_frames": BLOCK_FRAMES, "params": params,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    heldout = None
    if args.eval_every:
        heldout = GeneratedQuality(load_vae_run(args.vae), transformer, text_encoder, args.eval_clips, args.reference_clips,
                                   steps=args.steps_per_block, shift=args.shift)
    if fresh and heldout is not None:
        log_start(model, heldout, args)
    train_loop(model, loss_fn, len(data), args, config, heldout=heldout)


def log_start(model: torch.nn.Module, heldout, args) -> None:
    """The held-out figures of the weights a new `--init-from` run starts at, logged as step 0."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = {**log_heldout(model, heldout, 0, Path(args.out), nullcontext()), "init_from": str(args.init_from)}
    with open(Path(args.out) / "log.jsonl", "a") as log:
        log.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


class GeneratedQuality:
    """Held-out figures of a denoiser in training: the quality proxies of clips it makes (copies of
    the modules, rounded to float16 as they ship; `steps` Euler steps per block, shift `shift`,
    seeded) for the first `clips` evaluation prompts, and the class accuracy read among the data's
    eight sprites (the 74-way reading spends errors on classes the clips never hold), over all
    frames and over the first and last quarter of them (whether a subject holds as the clip goes
    on). Score: the mean of class and direction accuracy."""

    def __init__(self, vae, transformer, text_encoder, clips: int, reference_clips: int, steps: int = 8, shift: float = 3.0):
        self.vae, self.transformer, self.text_encoder = vae, transformer, text_encoder  # the VAE as it ships
        self.prompts, self.reference_clips, self.score = eval_prompts(clips), reference_clips, None
        self.steps, self.shift = steps, shift

    def __call__(self) -> dict:
        import copy

        from mmgen.decoding import FlowSchedule
        from mmgen.video.pipeline import BlockDiffusionVideoPipeline

        if self.score is None:
            self.score = scorer(self.reference_clips)
        schedule = FlowSchedule.uniform(self.steps, self.shift)
        # Copies: the pipeline may wrap the transformer's blocks, which training must not see.
        copied = lambda module: round_to_half(copy.deepcopy(module).cpu().float())  # made on the CPU, whatever trains
        pipe = BlockDiffusionVideoPipeline(transformer=copied(self.transformer), vae=self.vae,
                                           text_encoder=copied(self.text_encoder), tokenizer=new_tokenizer(),
                                           **dict(PIPELINE, timesteps=schedule.timesteps, shift=self.shift))
        pipe.set_progress_bar_config(disable=True)
        clips_, seconds = generate(pipe, self.prompts)
        figures = self.score(clips_, self.prompts)
        keep = ("class_accuracy", "direction_accuracy", "temporal_l1", "fid_proxy")
        return {**{k: round(figures[k], 4) for k in keep}, **{k: round(v, 4) for k, v in among_sprites(figures).items()},
                "seconds_per_clip_batched": round(seconds, 3), "metric": "class+direction",
                "score": (figures["class_accuracy"] + figures["direction_accuracy"]) / 2}


def among_sprites(figures: dict) -> dict:
    """The class accuracy among the data's eight sprites (`VideoQualityProxies`' reading) over all
    frames and over the first and last quarter of them (whether a subject holds as the clip goes
    on; each frame holds the same objects, so a quarter's accuracy is its frames' mean)."""
    by_frame = figures["class_accuracy_among_sprites_by_frame"]
    quarter = max(1, len(by_frame) // 4)
    return {"class_accuracy_8": figures["class_accuracy_among_sprites"],
            "class_8_first_quarter": float(np.mean(by_frame[:quarter])),
            "class_8_last_quarter": float(np.mean(by_frame[-quarter:]))}


def freeze_text_encoder(text_encoder, folder: Path) -> None:
    """Round the text encoder to float16 in place (as it ships) and save it to `folder`."""
    round_to_half(text_encoder)
    text_encoder.save_pretrained(str(folder))
    new_tokenizer().save_pretrained(str(folder.with_name("tokenizer")))


# ---------------------------------------------------------------------------- export


#: The bundle's pipeline settings: 17 frames (5 latent frames) of 64x64 at 8 fps, one latent frame
#: per block. The sampler (Euler on the flow, `--sampling-steps` uniform steps warped by
#: `--sampling-shift`) and guidance 3 were chosen by `sweep` of the 8,000-step target (docs/benchmarks.md).
PIPELINE = dict(block_frames=BLOCK_FRAMES, num_frames=17, height=64, width=64, fps=8.0, max_sequence_length=MAX_TEXT,
                stochastic=False, negative_prompt="", guidance_scale=3.0)
SHARED = {"vae": "../emoji-motion/vae", "text_encoder": "../emoji-motion/text_encoder", "tokenizer": "../emoji-motion/tokenizer"}


def load_transformer_run(run: str | Path, with_text_encoder: bool = False):
    """A run's trained transformer (and text encoder, for the target), configs from its config.json;
    or a shipped pipeline folder's (in float32), e.g. video/assets/emoji-motion-small where a
    continued target is exported beside the small model as it shipped."""
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    if (Path(run) / "transformer" / "config.json").exists():
        transformer = WanTransformer3DModel.from_pretrained(str(Path(run) / "transformer"), torch_dtype=torch.float32).eval()
        return (transformer, load_text_encoder(Path(run) / "text_encoder")) if with_text_encoder else transformer
    config = json.loads((Path(run) / "config.json").read_text())
    modules = {"transformer": WanTransformer3DModel.from_config(config["transformer"])}
    if config["preset"] == "target":
        modules["text_encoder"] = UMT5EncoderModel(UMT5Config.from_dict(config["text_encoder"]))
    model = load_trained(torch.nn.ModuleDict(modules), str(run))
    return (model["transformer"], model["text_encoder"]) if with_text_encoder else model["transformer"]


def pipelines(vae_run, target_run, small_run, steps: int, shift: float):
    """The pair as they ship: every module rounded to float16 (computing in float32)."""
    from mmgen.decoding import FlowSchedule
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline

    vae = load_vae_run(vae_run)
    target, text_encoder = load_transformer_run(target_run, with_text_encoder=True)
    small = load_transformer_run(small_run)
    frozen = load_text_encoder(Path(target_run) / "text_encoder").state_dict()
    if any(not torch.equal(frozen[k], v) for k, v in text_encoder.state_dict().items()):
        raise ValueError(f"{target_run}: the checkpoint's text encoder is not the frozen one the small model was trained on")
    schedule = FlowSchedule.uniform(steps, shift)
    settings = dict(PIPELINE, timesteps=schedule.timesteps, shift=shift)
    tokenizer = new_tokenizer()
    pipes = [BlockDiffusionVideoPipeline(transformer=round_to_half(t), vae=round_to_half(vae), text_encoder=round_to_half(text_encoder),
                                         tokenizer=tokenizer, **settings) for t in (target, small)]
    for pipe in pipes:
        pipe.set_progress_bar_config(disable=True)
    return pipes


@torch.no_grad()
def export(args) -> None:
    """`<out>/emoji-motion` (every component, float16) and `<out>/emoji-motion-small` (its
    transformer; the VAE, text encoder and tokenizer shared with emoji-motion); both loaded back
    and run once."""
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline

    out = Path(args.out)
    target, small = pipelines(args.vae, args.target, args.small, args.sampling_steps, args.sampling_shift)
    for pipe in (target, small):
        pipe.to(dtype=torch.float16)
    target.save_pretrained(out / "emoji-motion")
    small.save_pretrained(out / "emoji-motion-small", shared=SHARED)
    for config in [*(out / "emoji-motion").rglob("config.json"), *(out / "emoji-motion-small").rglob("config.json")]:
        data = json.loads(config.read_text())  # a module loaded from a folder records its path: no local paths ship
        if data.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    for name in ("emoji-motion", "emoji-motion-small"):
        pipe = BlockDiffusionVideoPipeline.from_pretrained(out / name).to(dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        video = pipe("red heart moving right", generator=torch.Generator().manual_seed(0))
        size = sum(f.stat().st_size for f in (out / name).rglob("*") if f.is_file())
        print(f"wrote {out / name}: {size / 1e6:.2f} MB; loaded, made a video {tuple(video.frames.shape)} in {video.profile.total_s:.2f} s")


# ---------------------------------------------------------------------------- evaluation


def eval_prompts(n: int) -> list[str]:
    """The captions of the proxies' real clips (corpus `PROMPT_SEED`), so that generated and real
    clips are scored on the same prompts."""
    data = corpus(PROMPT_SEED, n)
    return [data[i].caption for i in range(n)]


@torch.no_grad()
def generate(pipe, prompts: list[str], seed: int = 0, batch: int = 16, **call) -> tuple[np.ndarray, float]:
    """uint8 clips [N, T, H, W, 3] for `prompts` (batches of `batch`, clip i seeded by (seed, batch)),
    and the seconds per clip of the batched calls."""
    frames, started = [], time.time()
    for start in range(0, len(prompts), batch):
        out = pipe(prompts[start:start + batch], generator=torch.Generator().manual_seed(seed * 1000 + start), **call)
        frames.append(out.frames.numpy())
    return np.concatenate(frames), (time.time() - started) / len(prompts)


@torch.no_grad()
def clip_seconds(pipe, prompts: list[str], repeats: int = 3, **call) -> float:
    """Median seconds of one single-prompt call (a whole 17-frame clip, decoded)."""
    times = []
    for i in range(repeats):
        started = time.time()
        pipe(prompts[i % len(prompts)], generator=torch.Generator().manual_seed(i), **call)
        times.append(time.time() - started)
    return float(np.median(times))


def scorer(reference_clips: int = 256):
    from mmgen.video.quality import VideoQualityProxies

    return VideoQualityProxies.from_dataset(reference_clips, REFERENCE_SEED)


@torch.no_grad()
def through_vae(vae, clips_: int) -> np.ndarray:
    """The proxies' real clips (the first `clips_` of corpus `PROMPT_SEED`) encoded to the
    pipeline's latents and decoded: uint8 [N, T, H, W, 3]."""
    from mmgen.video.data import frames_to_tensor, tensor_to_frames
    from mmgen.video.vae import decode_latents, encode_video

    real = np.stack([c.frames for c in corpus(PROMPT_SEED, clips_)])
    return np.concatenate([tensor_to_frames(decode_latents(vae, encode_video(vae, frames_to_tensor(real[i:i + 16]))))
                           for i in range(0, len(real), 16)])


def vae_quality(args) -> None:
    """A VAE run's round trip as the card will state it: the proxies (class and direction accuracy,
    FID-proxy) of the real clips through it, and its held-out PSNR; `--checkpoint` picks the
    last step or the best held-out one. Writes `<run>/quality-<checkpoint>.json`. Before
    `finish_vae` the latent statistics are the identity, which changes no round trip."""
    run = Path(args.vae)
    if args.checkpoint == "last":
        vae = load_vae_run(run)
        step = int(torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)["step"])
    else:
        vae = load_vae_checkpoint(run, "best.pt")
        step = int(torch.load(run / "best.pt", map_location="cpu", weights_only=True)["step"])
    result = {"step": step, "psnr_db": held_out_psnr(vae, args.eval_clips), "eval_clips": args.eval_clips,
              "through_vae": scorer(args.reference_clips)(through_vae(vae, args.clips), eval_prompts(args.clips)), "clips": args.clips}
    (run / f"quality-{args.checkpoint}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


@torch.no_grad()
def diagnose(args) -> None:
    """Where a denoiser loses the prompt, on the first `--clips` evaluation clips: the proxies of
    (1) the real clips through the pipeline's VAE; (2) x0 predicted in one step from their
    latents noised to each of `--sigmas`, every block seeing the real blocks before it; (3) every
    block sampled at the pipeline's sampler (schedule, guidance) from noise, seeing the real
    blocks before it; (4) the first block alone, from the prompt (what a free rollout starts
    from: the first frame where a block is one latent frame; class accuracy only, its frames
    scored twice over as a clip). Each row gives the class accuracy over all 74 classes and
    among the data's eight sprites, also per frame position. `--transformer` (a run or a
    pipeline folder) replaces the pipeline's, rounded to float16 as it would ship. Writes `--out` (JSON)."""
    from mmgen.video.data import frames_to_tensor, tensor_to_frames
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline
    from mmgen.video.vae import decode_latents, encode_video

    pipe = BlockDiffusionVideoPipeline.from_pretrained(args.pipeline).to(dtype=torch.float32)
    if pipe.schedule.stochastic:
        raise SystemExit(f"{args.pipeline}: diagnose follows the Euler sampler; this pipeline's schedule is stochastic")
    transformer = round_to_half(load_transformer_run(args.transformer)) if args.transformer else pipe.transformer
    transformer.eval()
    vae, prompts, score = pipe.vae, eval_prompts(args.clips), scorer(args.reference_clips)
    real = np.stack([c.frames for c in corpus(PROMPT_SEED, args.clips)])
    batches = range(0, args.clips, 16)
    clean = torch.cat([encode_video(vae, frames_to_tensor(real[i:i + 16])) for i in batches])
    noise = torch.randn(clean.shape, generator=torch.Generator().manual_seed(args.seed))
    text, empty = pipe.encode_prompt(prompts), pipe.encode_prompt([pipe.negative_prompt] * len(prompts))
    sigmas, guidance = pipe.schedule.sigmas(), pipe.guidance_scale
    block = pipe.block_frames

    def row(name: str, latents: torch.Tensor, class_only: bool = False) -> dict:
        frames = np.concatenate([tensor_to_frames(decode_latents(vae, latents[i:i + 16])) for i in batches])
        if class_only:
            frames = np.repeat(frames, 2, axis=1)
        r = score(frames, prompts)
        out = {"row": name, "class_accuracy": round(r["class_accuracy"], 4),
               "class_accuracy_8": round(r["class_accuracy_among_sprites"], 4),
               "class_accuracy_by_frame": [round(a, 3) for a in r["class_accuracy_by_frame"]],
               "class_accuracy_8_by_frame": [round(a, 3) for a in r["class_accuracy_among_sprites_by_frame"]]}
        if not class_only:
            out.update({k: round(r[k], 4) for k in ("direction_accuracy", "fid_proxy")})
        print(json.dumps(out), flush=True)
        return out

    rows = [row("real clips through the VAE", clean)]
    for sigma in args.sigmas:
        levels = torch.full((args.clips, clean.shape[2] // block), sigma)
        noisy = (1 - sigma) * clean + sigma * noise
        velocity = torch.cat([teacher_forcing_velocity(transformer, clean[i:i + 16], noisy[i:i + 16], levels[i:i + 16], text[i:i + 16], block)
                              for i in batches])
        rows.append(row(f"one step from sigma {sigma:g}, real past", noisy - sigma * velocity))
    sample = lambda c, n: torch.cat([teacher_forced_sample(transformer, c[i:i + 16], n[i:i + 16], sigmas, text[i:i + 16],
                                                           empty[i:i + 16], guidance, block) for i in batches])
    rows.append(row(f"sampled ({len(sigmas)} steps, guidance {guidance:g}), real past", sample(clean, noise)))
    rows.append(row("first frame from the prompt", sample(clean[:, :, :block], noise[:, :, :block]), class_only=True))
    write_json(args.out, {"pipeline": str(args.pipeline), "transformer": args.transformer, "clips": args.clips,
                          "seed": args.seed, "rows": rows})


def sweep(args) -> None:
    """The proxies of the target and/or the small model over sampler settings on `--clips` prompts:
    each `--configs` entry is STEPS:SHIFT:GUIDANCE (Euler steps, flow shift, guidance scale).
    Writes `--out` (JSON)."""
    from mmgen.decoding import BlockDenoising, FlowSchedule

    score = scorer(args.reference_clips)
    prompts = eval_prompts(args.clips)
    target, small = pipelines(args.vae, args.target, args.small, 8, 3.0)
    results = []
    for name, pipe in (("target", target), ("small", small)):
        if name not in args.models:
            continue
        for config in args.configs:
            steps, shift, guidance = config.split(":")
            steps, shift, guidance = int(steps), float(shift), float(guidance)
            decoding = BlockDenoising(schedule=FlowSchedule.uniform(steps, shift))
            clips_, seconds = generate(pipe, prompts, decoding=decoding, guidance_scale=guidance)
            row = {"model": name, "steps": steps, "shift": shift, "guidance": guidance, **score(clips_, prompts),
                   "seconds_per_clip_batched": round(seconds, 3)}
            print(json.dumps(row), flush=True)
            results.append(row)
    write_json(args.out, results)


@torch.no_grad()
def compare(args) -> None:
    """Pipelines side by side, frame by frame (the model card's before and after): per pipeline the
    proxies on the first `--clips` evaluation prompts (the same seeds for all), with the eight-way
    class accuracy of every frame position; and a PNG sheet, one row per prompt and pipeline (the
    first `--sheet-prompts`), its frames left to right. `--pipelines` entries are NAME=FOLDER or
    NAME=FOLDER@STEPS (Euler steps per block instead of the folder's, at its shift). Writes `--out`
    (JSON) and the sheet beside it (.png)."""
    from PIL import Image

    from mmgen.decoding import BlockDenoising, FlowSchedule
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline

    score, prompts = scorer(args.reference_clips), eval_prompts(args.clips)
    rows, sheets = [], []
    for entry in args.pipelines:
        name, _, spec = entry.partition("=")
        folder, _, steps = spec.partition("@")
        pipe = BlockDiffusionVideoPipeline.from_pretrained(folder).to(dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        call = {"decoding": BlockDenoising(schedule=FlowSchedule.uniform(int(steps), pipe.schedule.shift))} if steps else {}
        clips_, _ = generate(pipe, prompts, **call)
        figures = score(clips_, prompts)
        row = {"pipeline": name, "folder": folder, "steps_per_block": int(steps) if steps else len(pipe.schedule.timesteps),
               **{k: round(v, 4) for k, v in among_sprites(figures).items()},
               **{k: round(figures[k], 4) for k in ("class_accuracy", "direction_accuracy", "temporal_l1", "fid_proxy")},
               "class_8_by_frame": [round(a, 3) for a in figures["class_accuracy_among_sprites_by_frame"]],
               "seconds_per_clip": round(clip_seconds(pipe, prompts[:8], **call), 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        sheets.append(clips_[:args.sheet_prompts])
    # One row per (prompt, pipeline): each prompt's pipelines one under another.
    sheet = np.concatenate([np.concatenate(list(clips_[i]), 1) for i in range(args.sheet_prompts) for clips_ in sheets], 0)
    Image.fromarray(sheet).save(Path(args.out).with_suffix(".png"))
    write_json(args.out, {"clips": args.clips, "prompts": prompts[:args.sheet_prompts], "rows": rows})


def compare_error(args) -> Optional[str]:
    """What is wrong with a `compare` command (one line), checked before any work; None if nothing."""
    for entry in args.pipelines:
        name, _, spec = entry.partition("=")
        folder, _, steps = spec.partition("@")
        if not name or not folder:
            return f"--pipelines {entry}: give NAME=FOLDER or NAME=FOLDER@STEPS"
        if not (Path(folder) / "model_index.json").is_file():
            return f"--pipelines {entry}: {folder} is not a pipeline folder (no model_index.json)"
        if steps and not (steps.isdigit() and int(steps) > 0):
            return f"--pipelines {entry}: STEPS must be a positive integer, got {steps!r}"
    if not 1 <= args.sheet_prompts <= args.clips:
        return f"--sheet-prompts must be in [1, --clips], got {args.sheet_prompts}"
    sheet = Path(args.out).with_suffix(".png")
    if sheet.exists() and not args.overwrite:
        return f"{sheet} exists: choose another --out or add --overwrite"
    return None


def write_json(path: str, data: Any) -> None:
    """A job's report, written atomically (never seen half-written)."""
    from mmgen.files import write_atomic

    write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())


@torch.no_grad()
def card(args) -> None:
    """MODEL_CARD.md: configurations, training runs, the VAE's held-out PSNR and the quality proxies
    of the exported pair (alone and collaborating) next to real clips of the same prompts."""
    assets = Path(args.assets)
    pipes = bundled_pair(assets)
    target, small = pipes["emoji-motion"], pipes["emoji-motion-small"]
    quality = Path(args.out).with_name("quality.json")
    if args.reuse_quality:  # the figures of an earlier `card` run (rewording the card only)
        rows = json.loads(quality.read_text())
    else:
        rows = quality_rows(pipes, args.clips, args.reference_clips, args.large_steps, args.guidance)
    steps = len(target.schedule.timesteps)
    trained_runs = [("vae", args.vae), ("target", args.target), ("small", args.small)]
    encoder_from = last_log(args.vae)["args"].get("encoder_from")
    if encoder_from:  # the decoder trained alone behind this run's frozen encoder
        trained_runs.append(("vae encoder", encoder_from))
    facts = {
        "rows": rows, "clips": args.clips, "reference_clips": args.reference_clips, "steps": steps, "schedule": target.pipeline_config(),
        "vae_eval": json.loads((Path(args.vae) / "eval.json").read_text()),
        "vae_config": dict(target.vae.config),
        "latent_shape": f"{target.vae.config.z_dim} x {target.latent_frames(17)} x {64 // target.spatial_ratio} x {64 // target.spatial_ratio}",
        "runs": {name: last_log(run) for name, run in trained_runs},
        "minutes": {name: wall_clock(run)[0] / 60 for name, run in trained_runs},
        "branched_at": {name: branch_step(run) for name, run in trained_runs},
        "averaged": {name: weight_average(run) for name, run in trained_runs},
        "params": {name: sum(p.numel() for p in (m if isinstance(m, list) else m.parameters())) for name, m in
                   (("vae", target.vae), ("text_encoder", target.text_encoder), ("target", target.transformer), ("small", small.transformer),
                    ("vae encoder", [*target.vae.encoder.parameters(), *target.vae.quant_conv.parameters()]))},
        "sizes": {name: sum(f.stat().st_size for f in (assets / name).rglob("*") if f.is_file()) for name in pipes},
        "sweep": [row for path in args.sweep for row in json.loads(Path(path).read_text())],
    }
    Path(args.out).write_text(model_card(facts, args))
    quality.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")


def bundled_pair(assets: str | Path) -> dict:
    """{"emoji-motion", "emoji-motion-small"}: the exported pair's pipelines in float32."""
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline

    pipes = {}
    for name in ("emoji-motion", "emoji-motion-small"):
        pipes[name] = BlockDiffusionVideoPipeline.from_pretrained(Path(assets) / name).to(dtype=torch.float32)
        pipes[name].set_progress_bar_config(disable=True)
    return pipes


def quality_rows(pipes: dict, clips: int, reference_clips: int, large_steps: Sequence[int], guidance: Sequence[float]) -> dict:
    """The model card's quality table: the proxies of real clips, of real clips through the VAE,
    of the pair alone, collaborating (the large model's first `large_steps` steps) and at other
    `guidance` scales, each with its seconds per clip, and the calibration rows."""
    from mmgen.decoding import CollaborativeDenoising
    from mmgen.video.quality import calibrate

    target, small = pipes["emoji-motion"], pipes["emoji-motion-small"]
    score, prompts = scorer(reference_clips), eval_prompts(clips)
    calibration = calibrate(num_clips=clips, seed=PROMPT_SEED, scorer=score)
    rows = {"real clips": calibration["real"], "real clips through the VAE": score(through_vae(target.vae, clips), prompts)}
    steps = len(target.schedule.timesteps)
    runs = [("emoji-motion", target, {}), ("emoji-motion-small", small, {})]
    runs += [(f"collaborative, large first {k} of {steps}", target, {"decoding": CollaborativeDenoising(small=small, large_steps=k)})
             for k in large_steps if k < steps]
    runs += [(f"emoji-motion, guidance {g:g}", target, {"guidance_scale": g}) for g in guidance]
    for name, pipe, call in runs:
        clips_, _ = generate(pipe, prompts, **call)
        rows[name] = {**score(clips_, prompts), "seconds_per_clip": clip_seconds(pipe, prompts, **call)}
        print(name, json.dumps({k: v for k, v in rows[name].items() if not isinstance(v, (list, dict))}), flush=True)
    for kind in calibration.keys() - {"real"}:
        rows[f"real clips, {kind} (calibration)"] = calibration[kind]
    return rows


def quality_table(rows: dict) -> str:
    """The model card's quality table (Markdown) of `quality_rows`."""
    def row(name: str, r: dict) -> str:
        seconds = f"{r['seconds_per_clip']:.2f}" if "seconds_per_clip" in r else ""
        eight = among_sprites(r)
        return (f"| {name} | {eight['class_accuracy_8']:.1%} | {eight['class_8_first_quarter']:.1%} → "
                f"{eight['class_8_last_quarter']:.1%} | {r['class_accuracy']:.1%} | {r['direction_accuracy']:.1%} | "
                f"{r['temporal_l1']:.4f} | {r['fid_proxy']:.1f} | {seconds} |")

    return ("| clips | class acc. (8) | first → last quarter (8) | class acc. (74) | direction acc. | temporal L1 | FID-proxy | s/clip |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(row(name, r) for name, r in rows.items()))


@torch.no_grad()
def quality(args) -> None:
    """The model card's quality table alone, measured on the exported pair in `--assets`: writes
    `--out` (quality.json, the figures `card` reads with --reuse-quality) and prints the table."""
    rows = quality_rows(bundled_pair(args.assets), args.clips, args.reference_clips, args.large_steps, args.guidance)
    write_json(args.out, rows)
    print(quality_table(rows))


@torch.no_grad()
def techniques(args) -> None:
    """The decoding techniques on the exported pair, quality beside speed (docs/benchmarks.md's
    video table): block decoding at the pipeline's steps (the baseline) and at `--other-steps`;
    collaborative decoding along its curve (the large model's first k of the steps); each
    `--cache-policies`; First Block Cache at each `--cache-thresholds`, static-token dropping at
    each `--drop-thresholds`; guidance 1; the small model alone. Proxies on the first `--clips`
    evaluation prompts, one prompt per call (the same seeds for every row); seconds per clip of the same single-prompt calls, rows interleaved within each of
    `--repeats` rounds (one prompt per round), the ratio to the baseline the median of the rounds'
    paired ratios. Writes `--out` (JSON, for docs/make_tables.py)."""
    import sys

    from mmgen.benchmarking import environment
    from mmgen.decoding import BlockDenoising, CollaborativeDenoising, FlowSchedule
    from mmgen.video.quality import calibrate

    pipes = bundled_pair(args.assets)
    target, small = pipes["emoji-motion"], pipes["emoji-motion-small"]
    steps, shift, guidance = len(target.schedule.timesteps), target.schedule.shift, target.guidance_scale
    base = f"block ({steps} steps, guidance {guidance:g})"
    runs = [("emoji-motion", base, target, {})]
    runs += [("emoji-motion", f"block ({n} steps)", target, {"decoding": BlockDenoising(schedule=FlowSchedule.uniform(n, shift))})
             for n in args.other_steps if n != steps]
    runs += [("emoji-motion", f"collaborative, large first {k} of {steps} steps", target,
              {"decoding": CollaborativeDenoising(small=small, large_steps=k)}) for k in args.large_steps if k < steps]
    runs += [("emoji-motion", f"block, cache {policy}", target, {"cache_policy": policy}) for policy in args.cache_policies]
    runs += [("emoji-motion", f"block, First Block Cache {t:g}", target, {"cache_threshold": t}) for t in args.cache_thresholds]
    runs += [("emoji-motion", f"block, static-token dropping {t:g}", target, {"drop_threshold": t}) for t in args.drop_thresholds]
    runs += [("emoji-motion", "block, guidance 1", target, {"guidance_scale": 1.0}),
             ("emoji-motion-small", base, small, {})]
    score, prompts = scorer(args.reference_clips), eval_prompts(args.clips)
    rows = []
    for model, method, pipe, call in runs:
        # One prompt per call, as timed below: First Block Cache and static-token dropping decide
        # for a whole batch (a token is dropped only where every row's is static).
        clips_, _ = generate(pipe, prompts, batch=1, **call)
        figures = score(clips_, prompts)
        rows.append({"model": model, "method": method, **{k: round(v, 4) for k, v in among_sprites(figures).items()},
                     **{k: round(figures[k], 4) for k in ("class_accuracy", "direction_accuracy", "temporal_l1", "fid_proxy")}})
        print(json.dumps(rows[-1]), flush=True)
    seconds = [[] for _ in runs]
    for i in range(args.repeats):
        for j, (_, _, pipe, call) in enumerate(runs):
            started = time.perf_counter()
            pipe(prompts[i % len(prompts)], generator=torch.Generator().manual_seed(i), **call)
            seconds[j].append(time.perf_counter() - started)
    for row, times in zip(rows, seconds):
        row["seconds_per_clip"] = round(float(np.median(times)), 4)
        row["vs_baseline"] = round(float(np.median(np.array(seconds[0]) / np.array(times))), 3)
    real = calibrate(num_clips=args.clips, seed=PROMPT_SEED, scorer=score)["real"]
    vae = score(through_vae(target.vae, args.clips), prompts)
    threads = torch.get_num_threads()
    what = (f"One prompt per call, 17 frames ({target.latent_frames(17)} latent frames, one per block), decoded, "
            f"{threads} thread{'s' if threads > 1 else ''}; seconds per clip are medians of {args.repeats} rounds with the "
            f"rows interleaved, speed-ups the median of the rounds' paired ratios; quality proxies over the first "
            f"{args.clips} held-out captions, class accuracy read among the data's eight sprites and over all 74 classes "
            f"(real clips: 8-way {real['class_accuracy_among_sprites']:.1%}, 74-way {real['class_accuracy']:.1%}, direction "
            f"{real['direction_accuracy']:.0%}, FID-proxy {real['fid_proxy']:.1f}; through the VAE, what any model here can "
            f"reach: 8-way {vae['class_accuracy_among_sprites']:.1%}, 74-way {vae['class_accuracy']:.1%}, direction "
            f"{vae['direction_accuracy']:.0%}, FID-proxy {vae['fid_proxy']:.1f})")
    command = "python -m training.train_video " + " ".join(sys.argv[1:])
    write_json(args.out, {"environment": environment(torch.device("cpu"), command), "what": what, "baseline": base,
                          "rows": rows})


def branch_step(run: str | Path) -> Optional[int]:
    """The step a `--branch-from` run left its parent at (the last step of the log they share),
    None for a run that started from scratch."""
    parent = json.loads((Path(run) / "config.json").read_text())["args"].get("branch_from")
    if not parent or not (Path(parent) / "log.jsonl").exists():
        return None
    shared = None
    for ours, theirs in zip((Path(run) / "log.jsonl").read_text().splitlines(), (Path(parent) / "log.jsonl").read_text().splitlines()):
        if ours != theirs:
            break
        shared = json.loads(ours)["step"]
    return shared


def by_sprite(row: dict) -> str:
    """"; by sprite: red heart 71%, ..." (best first), or "" for figures without the breakdown."""
    shares = sorted(row.get("class_accuracy_by_sprite", {}).items(), key=lambda kv: -kv[1])
    return "; by sprite: " + ", ".join(f"{name} {share:.0%}" for name, share in shares) if shares else ""


def vae_recipe(f: dict) -> str:
    """The VAE bullet of the card, from the runs' arguments."""
    a, steps = f["runs"]["vae"]["args"], f["runs"]["vae"]["final"]["step"]
    loss = "L1 + L2 reconstruction" + (f" with the sprites' pixels weighted {1 + a['foreground_weight']:g}x"
                                       if a.get("foreground_weight") else "")
    if a.get("gradient_weight"):
        loss += f", plus {a['gradient_weight']:g} x the gradient difference loss"
    if a.get("encoder_from"):
        e = f["runs"]["vae encoder"]["args"]
        text = (f"the encoder (base {e['base_dim']}) is run `{a['encoder_from']}`'s, trained "
                f"{f['runs']['vae encoder']['final']['step']} steps with its own decoder and frozen since; the decoder here "
                f"(base {f['vae_config'].get('decoder_base_dim') or f['vae_config']['base_dim']}) trained alone behind it for "
                f"{steps} steps on {loss}")
    else:
        text = f"{loss} plus {KL_WEIGHT:g} x the per-element KL, {steps} steps"
    if a.get("adversarial_weight"):
        branched = f["branched_at"].get("vae")
        start = max(a.get("adversarial_from") or 0, branched or 0)
        text += (f"; from step {start} on, VQGAN's hinge GAN term (weight {a['adversarial_weight']:g} x the adaptive balance) "
                 f"against a PatchGAN critic on single frames, trained from scratch beside it")
    elif f["branched_at"].get("vae") is not None:
        text += f" (branched at step {f['branched_at']['vae']} from `{a['branch_from']}`)"
    return (f"{text}. The decoder reads the posterior's mode (what the pipeline's latents are); random "
            f"{a['frames']}-frame {a['crop']}x{a['crop']} crops of training clips, the last {a['full_steps']} steps on whole "
            f"64x64 frames.")


def weight_average(run: str | Path) -> Optional[dict]:
    """{"decay", "from_step"} of the weight average a run keeps (`--ema`; the log marks where it
    started), None for a run without one."""
    for record in map(json.loads, (Path(run) / "log.jsonl").read_text().splitlines()):
        if "weight_average" in record:
            return {**record["weight_average"], "from_step": record["step"]}
    return None


def averaged_note(f: dict) -> str:
    """The card's sentence on which shipped weights are weight averages."""
    parts = [f"{name}'s from step {a['from_step']} (decay {a['decay']:g})"
             for name, a in f.get("averaged", {}).items() if a is not None]
    return ("The shipped weights are exponential moving averages of the trained ones (`--ema`): "
            + "; ".join(parts) + ".") if parts else ""


def model_card(f: dict, args) -> str:
    sweep_note = (f"Chosen from the sweep below ({f['sweep'][0]['num_clips']} prompts: differences of a few points there "
                  "are within their noise)." if f["sweep"] else
                  "No sampler sweep was run on these weights; the table's guidance rows measure the alternatives.")
    scale = f["schedule"].get("guidance_scale", 1.0)
    guidance = "no guidance (scale 1)" if scale == 1 else f"classifier-free guidance at scale {scale:g}"

    def run_row(name: str, what: str, params: int) -> str:
        run = f["runs"][name]
        return (f"| {name} | {what} | {params / 1e6:.2f}M | {run['final']['step']} | {run['args']['batch_size']} | "
                f"{run['args']['lr']:g} | {run['final']['loss']:.4f} | {f['minutes'][name]:.0f} min |")

    target_args = f["runs"]["target"]["args"]
    t, s, v = PRESETS[target_args.get("shape") or "target"], PRESETS["small"], f["vae_config"]
    vae_row = f["rows"]["real clips through the VAE"]
    sc = f["schedule"]
    shape = (f"dim_mult {v['dim_mult']}, z {v['z_dim']}; x{v['scale_factor_spatial']} space, x{v['scale_factor_temporal']} time")
    if "vae encoder" in f["runs"]:
        vae_rows = "\n".join([
            run_row("vae encoder", f"AutoencoderKLWan's encoder, base {v['base_dim']}, {shape}", f["params"]["vae encoder"]),
            run_row("vae", f"its decoder, base {v.get('decoder_base_dim') or v['base_dim']} (trained alone)",
                    f["params"]["vae"] - f["params"]["vae encoder"])])
    else:
        vae_rows = run_row("vae", f"AutoencoderKLWan, base {v['base_dim']}, {shape}", f["params"]["vae"])
    sweep = ""
    if f["sweep"]:
        lines = [f"| {r['model']} | {r['steps']} | {r['shift']:g} | {r['guidance']:g} | {r['class_accuracy']:.1%} | "
                 f"{r['direction_accuracy']:.1%} | {r['temporal_l1']:.4f} | {r['fid_proxy']:.1f} |" for r in f["sweep"]]
        sweep = ("\n### Sampler sweep\n\n`python -m training.train_video sweep` on the first "
                 f"{f['sweep'][0]['num_clips']} prompts (Euler steps, flow shift, guidance scale):\n\n"
                 "| model | steps | shift | guidance | class acc. | direction acc. | temporal L1 | FID-proxy |\n"
                 "|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")
    return f"""# emoji-motion and emoji-motion-small: bundled block-diffusion text-to-video on moving emoji

A text-to-video pair for `mmgen.video.BlockDiffusionVideoPipeline`, trained from scratch on this
project's CPU machine by `training/train_video.py`: diffusers' `AutoencoderKLWan` and
`WanTransformer3DModel` and transformers' `UMT5EncoderModel` in small configurations. A video is
made block by block (one latent frame per block) with a cached block-causal attention.
`emoji-motion-small` is the small denoiser of the same latent space for collaborative decoding
(`decoding="collaborative"`); it ships only its transformer and reads the VAE, text encoder and
tokenizer of `emoji-motion`. Every module ships in float16 (rounded before any figure here was
computed); the pipelines compute in float32 (`load_pipeline(..., dtype=torch.float32)`).
Sizes: emoji-motion {f['sizes']['emoji-motion'] / 1e6:.1f} MB, emoji-motion-small {f['sizes']['emoji-motion-small'] / 1e6:.1f} MB.

## Data

Moving-emoji clips (`mmgen.video.data`, default `MovingEmojiConfig`): 17 frames of 64x64 at 8 fps,
one or two of eight emoji sprites (16-24 px) moving left/right/up/down or bouncing on a plain
background, captioned "<name> <motion>[ and <name> <motion>]". Clips are made on the fly from
(seed, index): training clips are corpus {TRAIN_SEED}; the VAE's held-out clips corpus {HELD_OUT_SEED}; the
evaluation prompts and real clips below are corpus {PROMPT_SEED} and the FID-proxy's reference frames
corpus {REFERENCE_SEED} (`mmgen.video.quality.calibrate`'s). Captions repeat across corpora (about a
thousand distinct ones); the clips do not.

## Models and training

| component | what | parameters | steps | batch | peak lr | last logged loss | wall clock |
|---|---|---|---|---|---|---|---|
{vae_rows}
{run_row("target", f"WanTransformer3DModel {t['num_attention_heads']}x{t['attention_head_dim']} wide, {t['num_layers']} layers, ffn {t['ffn_dim']}, patch 1x2x2 (+ text encoder)", f['params']['target'] + f['params']['text_encoder'])}
{run_row("small", f"WanTransformer3DModel {s['num_attention_heads']}x{s['attention_head_dim']} wide, {s['num_layers']} layers, ffn {s['ffn_dim']}", f['params']['small'])}

- **VAE**: {vae_recipe(f)} Held-out reconstruction PSNR:
  **{f['vae_eval']['psnr_db']:.2f} dB** on {f['vae_eval']['eval_clips']} clips. The config's `latents_mean` / `latents_std`
  are the per-channel statistics of the posterior means of {f['vae_eval']['stats_clips']} training clips: the
  transformers denoise normalised latents ({f['latent_shape']} per clip).
- **Text**: a word-level tokenizer over the captions' {len(caption_words())} words (T5's `<pad>`, `</s>`, `<unk>`;
  every text ends with `</s>`), {MAX_TEXT} tokens per prompt; a UMT5 encoder ({TEXT_ENCODER['num_layers']} layers,
  d_model {TEXT_ENCODER['d_model']}, {f['params']['text_encoder'] / 1e6:.2f}M parameters) trained with the target for its first
  {target_args['text_steps']} steps, then rounded to float16 and frozen; the small model trained on the frozen one.
- **Transformers**: flow matching under teacher forcing, in one forward per batch: the clean latents
  of blocks 0-3 (timestep 0) and a noisy copy of every block at its own noise level (u ~ U(0, 1)
  warped by shift {target_args['shift']:g}); a clean block attends to the clean blocks up to itself, a noisy
  block to the clean blocks before it and to itself, at its clean counterpart's rotary positions;
  this is exactly the cached decode's computation (tested in float64). Loss: MSE of the predicted
  velocity against noise - x0 on the noisy half. {TEXT_DROPOUT:.0%} of the captions are "" (the
  negative prompt) for classifier-free guidance. AdamW (betas 0.9/0.95, weight decay
  {target_args['weight_decay']:g}), cosine schedule, {target_args['warmup']} warm-up steps, gradient clipping 1.0; one CPU thread each.
  {averaged_note(f)}
{args.training_note}

## Sampling defaults

Saved with the pipelines: one latent frame per block, {f['steps']} Euler steps per block on the flow
(`FlowSchedule.uniform({f['steps']}, shift={sc['shift']:g})`, stochastic False), {guidance};
the negative prompt for guidance is "". {sweep_note}

## Quality

`mmgen.video.quality` proxies on the first {f['clips']} captions of corpus {PROMPT_SEED}, one clip each (seeded),
17 frames: per-object per-frame class accuracy of the bundled emoji classifier on cut-outs, read
among the data's eight sprites (the class the eye would name among what the clips can hold) and
over all 74 classes (errors spent on face subgroups no clip contains count against it), the
eight-way figure also over the first and last quarter of the frames (whether a subject holds as the
clip goes on), motion-direction accuracy of a colour tracker, temporal L1 (mean absolute difference
of consecutive frames, pixels in [0, 1]), and the Fréchet distance of classifier features to the
frames of {f['reference_clips']} real clips of corpus {REFERENCE_SEED}. Real clips of the same captions and their
known-broken versions calibrate them. Seconds per clip: one prompt per call (17 frames, decoded),
median of 3, on this machine's CPU (2 cores, shared).

{quality_table(f['rows'])}
{sweep}
## Limits

A CPU-trained toy, for offline tests and for benchmarks of block-diffusion decoding with honest
quality figures; not a good video model. The VAE caps what any model here can show: real clips
through it keep {vae_row['direction_accuracy']:.0%} of their motions readable and {vae_row['class_accuracy']:.1%} of their objects
classifiable ({f['vae_eval']['psnr_db']:.1f} dB held out){by_sprite(vae_row)}. emoji-motion follows the prompted motion for
{f['rows']['emoji-motion']['direction_accuracy']:.0%} of objects and emoji-motion-small for {f['rows']['emoji-motion-small']['direction_accuracy']:.0%} (shuffled real frames:
{f['rows'].get('real clips, shuffled (calibration)', {}).get('direction_accuracy', float('nan')):.0%}); their class accuracy is {f['rows']['emoji-motion']['class_accuracy']:.1%} and {f['rows']['emoji-motion-small']['class_accuracy']:.1%}. Teacher forcing
trains on clean context only, so an early block's error is not corrected by later blocks. It
knows only the corpus' eight sprites, six motions and caption grammar, 64x64 frames and 17-frame clips (5 latent frames: longer rollouts put frames at rotary positions it
never trained on).

## Reproduce

```
{args.commands}
```
"""


def reproduce_block() -> str:
    """The commands that made the bundle: this module docstring's first indented block."""
    lines = __doc__.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    return "\n".join(block).strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    vae = jobs.add_parser("vae", help="train the VAE, then set its latent statistics")
    vae.add_argument("--frames", type=int, default=17, help="frames per training crop (1 + 4k); fewer than the clips' 17 "
                     "leave the causal VAE's later chunks untrained (measured after 2,800 steps on 9-frame crops: "
                     "frames 0-8 of a held-out clip at 23.3 dB, frames 9-16 falling from 22.3 to 16.8 dB)")
    vae.add_argument("--crop", type=int, default=32, help="crop size before the last --full-steps steps")
    vae.add_argument("--full-steps", type=int, default=100, help="last steps on whole 64x64 frames")
    vae.add_argument("--stats-clips", type=int, default=256)
    vae.add_argument("--eval-clips", type=int, default=64)
    vae.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
    vae.add_argument("--workers", type=int, default=0, help="processes drawing clips ahead of the loop (0: none)")
    vae.add_argument("--foreground-weight", type=float, default=0.0, help="extra reconstruction weight on the sprites' "
                     "pixels (1 + W there, 1 on the background; the loss is normalised by the mean weight)")
    vae.add_argument("--gradient-weight", type=float, default=0.0, help="weight of the gradient difference loss "
                     "(L1 between the reconstruction's and the clip's pixel differences: against blur)")
    vae.add_argument("--adversarial-weight", type=float, default=0.0, help="weight of the hinge GAN term against a "
                     "PatchCritic (times VQGAN's adaptive balance at the decoder's last layer); 0: none")
    vae.add_argument("--adversarial-from", type=int, default=0, help="the step the critic and its term start at")
    vae.add_argument("--critic-lr-scale", type=float, default=1.0, help="the critic's learning rate over the VAE's "
                     "(kept in the checkpoint from the run's first adversarial step)")
    vae.add_argument("--branch-from", help="a vae run whose checkpoint (weights, optimizer, step, log) this run starts "
                     "at, when --out has none; a plain run's is lifted beside a fresh critic")
    vae.add_argument("--base-dim", type=int, default=VAE["base_dim"], help="channels of the first level")
    vae.add_argument("--decoder-base-dim", type=int, help="channels of the decoder's last level (default: --base-dim)")
    vae.add_argument("--encoder-from", help="a finished vae run whose encoder is taken and frozen: only the decoder "
                     "trains, so that run's latents stay valid (its --base-dim and --z-dim apply)")
    vae.add_argument("--z-dim", type=int, default=VAE["z_dim"], help="latent channels")
    vae.add_argument("--eval-every", type=int, default=0, help="log the held-out PSNR every N steps (best.pt keeps the best)")
    vae.add_argument("--heldout-clips", type=int, default=16, help="held-out clips of that PSNR (whole 17-frame 64x64 clips)")
    add_training_arguments(vae, 1e-3, 8)
    vae.set_defaults(steps=700, log_every=10, save_every=50, warmup=50)
    lat = jobs.add_parser("latents", help="encode training clips")
    lat.add_argument("--vae", required=True)
    lat.add_argument("--out", required=True)
    lat.add_argument("--first", type=int, default=0)
    lat.add_argument("--clips", type=int, default=3000)
    lat.add_argument("--threads", type=int, default=0)
    lat.add_argument("--device", default="cpu", help="cpu or cuda: where the VAE encodes")
    for preset, lr in (("target", 1e-3), ("small", 2e-3)):
        p = jobs.add_parser(preset, help=f"train the {preset} transformer")
        p.add_argument("--latents", nargs="+", required=True, help="files of `latents`")
        if preset == "target":
            p.add_argument("--text-steps", type=int, default=150, help="train the text encoder this many steps, then "
                           "freeze it (rounded to float16) and save it to <out>/text_encoder")
            p.add_argument("--text-encoder", help="start from this frozen text encoder instead (with --text-steps 0), "
                           "e.g. video/assets/emoji-motion/text_encoder, which the shipped small model reads")
        else:
            p.add_argument("--text-encoder", required=True, help="the target's frozen text encoder (<target>/text_encoder)")
        p.add_argument("--shape", choices=sorted(PRESETS), help=f"the transformer's shape (default: {preset}'s)")
        p.add_argument("--text-dropout", type=float, default=TEXT_DROPOUT)
        p.add_argument("--foreground-weight", type=float, default=0.0, help="extra loss weight on the latent positions "
                       "under a sprite (latents files from `latents` carry them)")
        p.add_argument("--first-frames", type=int, default=0, help="first blocks of this many more clips per step, "
                       "each denoised alone (from the prompt, no past: what a rollout's first block is); a whole clip "
                       "gives its first block 1/5 of its loss")
        p.add_argument("--shift", type=float, default=TRAIN_SHIFT)
        p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
        p.add_argument("--eval-every", type=int, default=0, help="log the proxies of generated clips every N steps "
                       "(best.pt keeps the best mean of class and direction accuracy)")
        p.add_argument("--vae", help="the VAE run the latents came from (for --eval-every; a pipeline folder "
                       "such as video/assets/emoji-motion reads its vae/)")
        p.add_argument("--init-from", help="start a new run from a shipped pipeline folder's weights (e.g. "
                       "video/assets/emoji-motion): its transformer, and for the target its text encoder, frozen")
        p.add_argument("--eval-clips", type=int, default=16)
        p.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
        add_training_arguments(p, lr, 16)
        p.set_defaults(log_every=10, save_every=50, warmup=50)
    sf = jobs.add_parser("self-forcing", help="train a shipped transformer on its own rollouts (Self-Forcing)",
                         description=SELF_FORCING, formatter_class=argparse.RawDescriptionHelpFormatter)
    sf.add_argument("--init-from", required=True, help="the pipeline folder whose transformer trains (its text encoder "
                    "frozen), e.g. video/assets/emoji-motion")
    sf.add_argument("--latents", nargs="+", required=True, help="files of `latents` (encoded by that pipeline's VAE)")
    sf.add_argument("--steps-per-block", type=int, default=4, help="Euler steps of each block, in the rollouts and in "
                    "the held-out clips (Self-Forcing's 4, what the bundled pipeline samples)")
    sf.add_argument("--shift", type=float, default=3.0, help="flow shift of that schedule (the shipped pipeline's)")
    sf.add_argument("--levels", choices=("schedule", "continuous"), default="schedule", help="noise levels of the "
                    "trained forward: the schedule's own (those the few-step sampler visits) or u ~ U(0, 1) warped by "
                    "--shift, as the teacher-forcing jobs draw them (every level stays trained, for other step counts)")
    sf.add_argument("--anchor-blocks", type=int, default=1, help="blocks at the start of each past that are the clip's "
                    "own latents (committed by the model's clean pass); the rest of the past is the model's rollout. "
                    "0: the whole past is the model's, so the real target may contradict it (where its first frame "
                    "put the sprite)")
    sf.add_argument("--objective", choices=("student-forcing", "distill"), default="student-forcing", help="student "
                    "forcing (flow matching on the real block given the model's own past) or distill (the student's "
                    "x0 at a random exit step of its schedule regressed onto the frozen starting model's "
                    "--teacher-steps sample of the block from the same noise and the same past)")
    sf.add_argument("--teacher-steps", type=int, default=8, help="distill: the teacher's Euler steps per block (the "
                    "8 the bundled target sampled before it was distilled to 4)")
    sf.add_argument("--teacher", help="distill: the pipeline folder or target run whose transformer teaches (default: "
                    "the --init-from weights); it must read the same latents and text encoder")
    sf.add_argument("--text-dropout", type=float, default=TEXT_DROPOUT, help="weight of the unconditional (\"\" prompt) "
                    "half of the guided batch in the loss (the other jobs drop this share of captions)")
    sf.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast)")
    sf.add_argument("--eval-every", type=int, default=0, help="log the proxies of clips the model makes every N steps "
                    "(at --steps-per-block; class accuracy also among the data's eight sprites, and over the first and "
                    "last quarter of the frames); best.pt keeps the best mean of class and direction accuracy")
    sf.add_argument("--vae", help="the VAE for --eval-every: a pipeline folder such as video/assets/emoji-motion, or a vae run")
    sf.add_argument("--eval-clips", type=int, default=16)
    sf.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
    add_training_arguments(sf, 2e-4, 16)
    sf.set_defaults(log_every=10, save_every=50, warmup=20)
    runs = ("--vae", "--target", "--small")
    vq = jobs.add_parser("vae-quality", help="a VAE run's held-out PSNR and the proxies of real clips through it")
    vq.add_argument("--vae", required=True)
    vq.add_argument("--checkpoint", choices=("last", "best"), default="last")
    vq.add_argument("--clips", type=int, default=64)
    vq.add_argument("--eval-clips", type=int, default=64)
    vq.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
    vq.add_argument("--threads", type=int, default=0)
    dg = jobs.add_parser("diagnose", help="where a denoiser loses the prompt: teacher-forced rows and the first frame alone")
    dg.add_argument("--pipeline", default="video/assets/emoji-motion", help="a pipeline folder (its VAE, text encoder, sampler)")
    dg.add_argument("--transformer", help="a run or pipeline folder whose transformer replaces the pipeline's")
    dg.add_argument("--clips", type=int, default=32)
    dg.add_argument("--sigmas", type=float, nargs="+", default=[0.3, 0.6, 0.9], help="noise levels of the one-step rows")
    dg.add_argument("--seed", type=int, default=0)
    dg.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
    dg.add_argument("--out", required=True)
    dg.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    dg.add_argument("--threads", type=int, default=0)
    exp = jobs.add_parser("export", help="write video/assets/emoji-motion and emoji-motion-small")
    tech = jobs.add_parser("techniques", help="the decoding techniques on the exported pair, quality beside speed")
    tech.add_argument("--assets", default="video/assets", help="the folder holding emoji-motion and emoji-motion-small")
    tech.add_argument("--out", required=True, help="the JSON report (docs/results/video_emoji-motion_cpu.json)")
    tech.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    tech.add_argument("--clips", type=int, default=64)
    tech.add_argument("--other-steps", type=int, nargs="*", default=[8, 2], help="Euler steps per block measured beside the pipeline's")
    tech.add_argument("--large-steps", type=int, nargs="*", default=[1, 2, 3, 4, 6], help="collaborative: the large model's steps")
    tech.add_argument("--cache-policies", nargs="*", default=["window:2", "sink:1,window:1"])
    tech.add_argument("--cache-thresholds", type=float, nargs="*", default=[0.3, 0.5], help="First Block Cache thresholds")
    tech.add_argument("--drop-thresholds", type=float, nargs="*", default=[0.1, 0.2], help="static-token dropping thresholds")
    tech.add_argument("--repeats", type=int, default=5, help="timing rounds (one prompt each, every row in turn)")
    tech.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
    tech.add_argument("--threads", type=int, default=0)
    cmp_ = jobs.add_parser("compare", help="pipelines side by side, frame by frame (the card's before and after)")
    cmp_.add_argument("--pipelines", nargs="+", required=True, help="NAME=FOLDER or NAME=FOLDER@STEPS (Euler steps per block)")
    cmp_.add_argument("--clips", type=int, default=64)
    cmp_.add_argument("--sheet-prompts", type=int, default=4, help="prompts shown in the PNG sheet")
    cmp_.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
    cmp_.add_argument("--out", required=True, help="the JSON report; the sheet is written beside it as .png")
    cmp_.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    cmp_.add_argument("--threads", type=int, default=0)
    swp = jobs.add_parser("sweep", help="quality proxies over sampler settings")
    crd = jobs.add_parser("card", help="write MODEL_CARD.md")
    for p in (exp, swp, crd):
        for name in runs:
            p.add_argument(name, required=True)
        p.add_argument("--threads", type=int, default=0)
    for p in (swp, crd):
        p.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
    exp.add_argument("--out", required=True)
    exp.add_argument("--sampling-steps", type=int, default=8)
    exp.add_argument("--sampling-shift", type=float, default=3.0)
    swp.add_argument("--out", required=True)
    swp.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    swp.add_argument("--clips", type=int, default=32)
    swp.add_argument("--configs", nargs="+", default=["4:3:1", "8:3:1", "16:3:1", "8:1:1", "8:5:1", "8:3:3"],
                     help="STEPS:SHIFT:GUIDANCE settings")
    swp.add_argument("--models", nargs="+", choices=("target", "small"), default=["target", "small"])
    crd.add_argument("--assets", required=True)
    crd.add_argument("--out", required=True)
    qual = jobs.add_parser("quality", help="the card's quality table alone, on an exported pair (writes quality.json)")
    qual.add_argument("--assets", required=True, help="the folder holding emoji-motion and emoji-motion-small")
    qual.add_argument("--out", required=True, help="the figures (e.g. video/assets/emoji-motion/quality.json)")
    qual.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    qual.add_argument("--threads", type=int, default=0)
    qual.add_argument("--reference-clips", type=int, default=256, help="real clips whose frames are the FID reference")
    for p in (crd, qual):
        p.add_argument("--clips", type=int, default=64)
        p.add_argument("--large-steps", type=int, nargs="+", default=[1, 2])
        p.add_argument("--guidance", type=float, nargs="+", default=[1.0], help="guidance scales measured beside the default")
    crd.add_argument("--sweep", nargs="*", default=[], help="the JSON files `sweep` wrote, for the card")
    crd.add_argument("--reuse-quality", action="store_true", help="take the figures from the quality.json beside --out "
                     "(an earlier card run) instead of measuring them again")
    crd.add_argument("--training-note", default="", help="how the runs went (stops and resumes), for the card")
    crd.add_argument("--commands", default=reproduce_block(),
                     help="the commands that made the bundle")
    args = parser.parse_args(argv)
    if args.job in ("diagnose", "sweep", "compare", "quality", "techniques") and Path(args.out).exists() and not args.overwrite:
        parser.exit(2, f"train_video {args.job}: {args.out} exists: choose another --out or add --overwrite\n")
    if args.job == "compare" and (error := compare_error(args)):
        parser.exit(2, f"train_video compare: {error}\n")
    if args.job == "self-forcing" and (error := self_forcing_error(args)):
        parser.exit(2, f"train_video self-forcing: {error}\n")
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    jobs_ = {"vae": train_vae, "vae-quality": vae_quality, "latents": encode_latents, "target": train_transformer, "small": train_transformer,
             "self-forcing": train_self_forcing, "diagnose": diagnose, "compare": compare, "quality": quality, "techniques": techniques, "export": export, "sweep": sweep, "card": card}
    jobs_[args.job](args)


if __name__ == "__main__":
    main()
