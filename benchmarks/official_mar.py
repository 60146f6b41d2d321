"""mmgen's MAR decoders against the official MAR code on the same weights (the bundled
`mar-emoji64`), on this machine.

    python -m benchmarks.official_mar --official PATH --json docs/results/official_mar_emoji64_cpu.json

`--official` is a checkout of https://github.com/LTH14/mar (its `models`, `diffusion` and `util`
folders are all that is read; timm and scipy come from the environment). Its `MAR` is built from
the folder's config and loads the folder's weights strictly (mmgen keeps the official layout). It
is CUDA-only as written (`.cuda()` on fresh tensors), so `Tensor.cuda` is the identity while it
runs: everything stays on the CPU. Both sides sample tokens only (the official `sample_tokens`
returns latents; the VAE decoder, shared and identical, is not timed).

First, checks that the two run the same model: the diffusion conditioning z on one masked canvas
(class and null-class rows), then a whole official `sample_tokens` replayed by mmgen's
`sample_tokens` with the official draws (its orders, its head noise) at the sampling defaults.
The replay runs mmgen's model without `clip_denoised` (the bundle's non-official x0 clip; the
official sampler never clips); the error with the bundle's clip is reported beside it. Then, per
round, the official `sample_tokens` at the pipeline's sampling defaults (num_iter, guidance,
schedule, temperature) and every mmgen method decode the same classes in turn (official first),
and each method's time is reported against the official one and against mmgen `ar` as medians of
the per-round (paired) ratios.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.official_peer import command, commit_of, finish, parse, ratio_rows, timed_rounds
from mmgen.benchmarking import environment

#: Largest z error (relative to max(1, max |z|)) that still counts as the same transformer:
#: float32 kernels in a different op order agree to ~1e-6 of the scale (tests/image_ar/test_mar_model.py).
Z_TOLERANCE = 1e-4
#: Largest replayed-sample error (same scale): each token's 50-step head chain multiplies the
#: first step's last-bit eps error by ~1/sqrt(abar) (tests/image_ar/test_mar_model.py's replays
#: stay within 1e-3 on 10 steps); plumbing bugs (orders, masks, guidance) move tokens by O(1).
SAMPLE_TOLERANCE = 1e-3


@contextlib.contextmanager
def on_cpu():
    """The official code's `.cuda()` calls as the identity (it runs on the CPU here)."""
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


def official_model(official: Path, transformer) -> torch.nn.Module:
    """The official `MAR` with `transformer`'s config and weights (loaded strictly)."""
    sys.path.insert(0, str(official))
    from models.mar import MAR

    c = transformer.config
    with on_cpu():
        model = MAR(img_size=c.img_size, vae_stride=c.vae_stride, patch_size=c.patch_size,
                    encoder_embed_dim=c.encoder_embed_dim, encoder_depth=c.encoder_depth, encoder_num_heads=c.encoder_num_heads,
                    decoder_embed_dim=c.decoder_embed_dim, decoder_depth=c.decoder_depth, decoder_num_heads=c.decoder_num_heads,
                    mlp_ratio=c.mlp_ratio, norm_layer=partial(torch.nn.LayerNorm, eps=c.norm_eps), vae_embed_dim=c.vae_embed_dim,
                    mask_ratio_min=c.mask_ratio_min, label_drop_prob=c.label_drop_prob, class_num=c.class_num,
                    attn_dropout=c.attn_dropout, proj_dropout=c.proj_dropout, buffer_size=c.buffer_size,
                    diffloss_d=c.diffloss_d, diffloss_w=c.diffloss_w, num_sampling_steps=c.num_sampling_steps,
                    diffusion_batch_mul=c.diffusion_batch_mul, grad_checkpointing=False).eval()
    model.load_state_dict(transformer.state_dict(), strict=True)
    return model


def scaled_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| relative to max(1, max |ref|) (float32 rounding is relative to the scale)."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)).item()


def z_error(official, mar, classes: int) -> float:
    """z of both models on one random half-known canvas, class rows and a null-class row."""
    g = torch.Generator().manual_seed(0)
    b, length = 3, mar.seq_len
    tokens = torch.randn(b, length, mar.config.token_embed_dim, generator=g)
    mask = torch.zeros(b, length).scatter(1, torch.rand(b, length, generator=g).argsort(1)[:, : length // 2], 1.0)
    labels = torch.tensor([0, classes - 1, mar.config.class_num])
    emb = torch.cat([official.class_emb(labels[:2]), official.fake_latent])
    with on_cpu():
        ref = official.forward_mae_decoder(official.forward_mae_encoder(tokens, mask, emb), mask)
    return scaled_error(mar.compute_z(tokens, mask, labels), ref)


def replay_errors(official, mar, labels: list[int], defaults: dict, seed: int) -> tuple[float, float]:
    """An official `sample_tokens` with its draws recorded (orders; per step the head's initial
    noise and its per-timestep noise), replayed by mmgen's `sample_tokens`: the error without
    mmgen's x0 clip (the official numerics) and with the bundle's."""
    from mmgen.image_ar.mar import sample_tokens

    draws, orders = [], []
    randn, randn_like, sample_orders = torch.randn, torch.randn_like, official.sample_orders

    def recorded(draw):
        def wrapper(*args, **kwargs):
            out = draw(*args, **kwargs)
            draws.append(out)
            return out
        return wrapper

    def recorded_orders(bsz):
        orders.append(sample_orders(bsz))
        return orders[-1]

    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.randn, torch.randn_like, official.sample_orders = recorded(randn), recorded(randn_like), recorded_orders
    try:
        with on_cpu():
            ref = official.sample_tokens(len(labels), num_iter=defaults["num_iter"], cfg=defaults["guidance_scale"],
                                         cfg_schedule=defaults["cfg_schedule"], labels=torch.tensor(labels),
                                         temperature=defaults["temperature"])
    finally:
        torch.randn, torch.randn_like = randn, randn_like
        del official.sample_orders  # back to the class's method
    per_step = official.diffloss.gen_diffusion.num_timesteps + 1  # the initial noise, then one per timestep
    tables = []
    for step in range(defaults["num_iter"]):
        chunk = draws[step * per_step:(step + 1) * per_step]
        rows = chunk[0].shape[0]  # the initial noise: one row per token (duplicated for guidance)
        tables.append(torch.stack([chunk[0]] + [d[:rows] for d in chunk[1:]]))  # the conditional half's trajectory
    if len(draws) != per_step * defaults["num_iter"]:
        raise RuntimeError(f"recorded {len(draws)} draws, expected {per_step * defaults['num_iter']}")

    def replay(model):
        return sample_tokens(model, torch.tensor(labels), defaults["num_iter"], defaults["guidance_scale"],
                             defaults["cfg_schedule"], defaults["temperature"], orders=orders[0],
                             head_noise=lambda step, rows: tables[step])

    unclipped = copy.deepcopy(mar)
    unclipped.diffloss.clip_denoised = None
    return scaled_error(replay(unclipped), ref), scaled_error(replay(mar), ref)


def main(argv=None) -> int:
    args = parse(__doc__, "LTH14/mar", "mar-emoji64", ["ar", "cspd"], ["models/mar.py", "diffusion/__init__.py"], argv)
    official = args.official

    from mmgen import load_pipeline
    from mmgen.decoding import ContinuousSpeculative

    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    mar = pipe.transformer
    model = official_model(official, mar)
    defaults, classes = dict(pipe.sampling_defaults), pipe.num_classes
    sampling = pipe.sampling_config()
    decoders = {m: pipe.decoder(m) for m in args.methods}
    targets = {m: pipe.continuous_model(stochastic_last_step=isinstance(d, ContinuousSpeculative)) for m, d in decoders.items()}

    def run_official(labels, seed):
        np.random.seed(seed)  # the official orders (np.random.shuffle)
        torch.manual_seed(seed)  # and head noise (the global torch RNG)
        with on_cpu():
            return model.sample_tokens(len(labels), num_iter=defaults["num_iter"], cfg=defaults["guidance_scale"],
                                       cfg_schedule=defaults["cfg_schedule"], labels=torch.tensor(labels),
                                       temperature=defaults["temperature"])

    def run_mmgen(method, labels, seed):
        return decoders[method].generate(targets[method], torch.tensor(labels), sampling, torch.Generator().manual_seed(seed))

    with torch.no_grad():
        labels = list(range(min(4, classes)))
        z = z_error(model, mar, classes)
        sample, sample_clipped = replay_errors(model, mar, labels, defaults, seed=0)
        same = z < Z_TOLERANCE and sample < SAMPLE_TOLERANCE
        print(f"official_mar: z error {z:.2e} (tolerance {Z_TOLERANCE:g}), replayed sample error {sample:.2e} "
              f"(tolerance {SAMPLE_TOLERANCE:g}; {sample_clipped:.2e} with the bundle's x0 clip)", file=sys.stderr)
        if not same:
            print("official_mar: the official and mmgen outputs differ beyond the tolerance: not the same model", file=sys.stderr)
            return 1
        times = timed_rounds("official sample_tokens", run_official, args.methods, run_mmgen, args.repeats, args.batch,
                             classes)
    rows = ratio_rows(times, "official sample_tokens", args.batch)
    env = environment(torch.device("cpu"), command("official_mar", argv))
    report = {"environment": env, "model": args.model, "batch": args.batch, "repeats": args.repeats,
              "sampling": {k: defaults[k] for k in ("num_iter", "guidance_scale", "cfg_schedule", "temperature")},
              "timed": "token sampling only (no VAE decode) on both sides",
              "same_model": {"z_error": z, "z_tolerance": Z_TOLERANCE, "replayed_sample_error": sample,
                             "replayed_sample_error_with_bundle_clip": sample_clipped, "sample_tolerance": SAMPLE_TOLERANCE},
              "official_commit": commit_of(official), "rows": rows}
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
