"""mmgen's scale decoders against the official VAR code on the same weights (a class-conditional
VAR folder such as the bundled `var-emoji64`), on this machine.

    python -m benchmarks.official_var --official PATH --json docs/results/official_var_emoji64_cpu.json

`--official` is a checkout of https://github.com/FoundationVision/VAR (its `models` folder and
`dist.py` are all that is read). Its `VAR` and `VQVAE` are built from the folder's configs (the
VQVAE's encoder and decoder with the folder's `ch_mult`/`num_res_blocks`, which the official
constructor fixes to the released ones) and load the folder's weights strictly (mmgen keeps the
official layout); then its own `autoregressive_infer_cfg` (KV-cached, eager, image decode
included) samples at the model's defaults. First, a check that the two run the same model:
official greedy tokens (top-k 1) must equal mmgen `ar`'s (temperature 0), and its images must
match. Then, per round, every method generates images of the same classes in turn (official
first; mmgen's time includes `decode_tokens`), and each method's time is reported against the
official sampler and against mmgen `ar` as medians of the per-round (paired) ratios.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.official_peer import command, commit_of, finish, parse, ratio_rows, timed_rounds
from mmgen.benchmarking import environment


def official_models(official: Path, pipe) -> torch.nn.Module:
    """The official `VAR` (on its `VQVAE`) with `pipe`'s configs and weights (loaded strictly)."""
    sys.path.insert(0, str(official))
    from models.basic_vae import Decoder, Encoder
    from models.var import VAR
    from models.vqvae import VQVAE

    c, v = pipe.transformer.config, pipe.vqvae.config
    vae = VQVAE(vocab_size=v.vocab_size, z_channels=v.z_channels, ch=v.ch, dropout=v.dropout, beta=v.beta,
                using_znorm=v.using_znorm, quant_conv_ks=v.quant_conv_ks, quant_resi=v.quant_resi,
                share_quant_resi=v.share_quant_resi, default_qresi_counts=v.default_qresi_counts,
                v_patch_nums=tuple(v.patch_nums), test_mode=True)
    dd = {"dropout": v.dropout, "ch": v.ch, "z_channels": v.z_channels, "in_channels": 3, "ch_mult": tuple(v.ch_mult),
          "num_res_blocks": v.num_res_blocks, "using_sa": v.using_sa, "using_mid_sa": v.using_mid_sa}
    vae.encoder, vae.decoder = Encoder(double_z=False, **dd), Decoder(**dd)
    vae.downsample = 2 ** (len(v.ch_mult) - 1)
    vae.load_state_dict(pipe.vqvae.state_dict(), strict=True)
    model = VAR(vae, num_classes=c.num_classes, depth=c.depth, embed_dim=c.embed_dim, num_heads=c.num_heads,
                mlp_ratio=c.mlp_ratio, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, norm_eps=c.norm_eps,
                shared_aln=c.shared_aln, cond_drop_rate=c.cond_drop_rate, attn_l2_norm=c.attn_l2_norm,
                patch_nums=tuple(c.patch_nums))
    model.load_state_dict(pipe.transformer.state_dict(), strict=True)
    return model.eval()


def official_greedy(model, run) -> tuple[torch.Tensor, torch.Tensor]:
    """The official sampler's token maps (all scales, [B, L]) and images from `run()`: its
    sampling helper is wrapped for the call to record what it draws."""
    import models.var as official_var

    sample, drawn = official_var.sample_with_top_k_top_p_, []

    def recording(*args, **kwargs):
        drawn.append(sample(*args, **kwargs)[:, :, 0])
        return drawn[-1].unsqueeze(-1)

    official_var.sample_with_top_k_top_p_ = recording
    try:
        images = run()
    finally:
        official_var.sample_with_top_k_top_p_ = sample
    return torch.cat(drawn, 1), images


def main(argv=None) -> int:
    args = parse(__doc__, "FoundationVision/VAR", "var-emoji64", ["ar", "collaborative"], ["models/var.py", "dist.py"], argv)
    official = args.official

    from mmgen import load_pipeline

    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    defaults = pipe.sampling_config()
    if defaults.temperature != 1.0:
        print(f"official_var: the official sampler has no temperature; the defaults' is {defaults.temperature}",
              file=sys.stderr)
        return 1
    model = official_models(official, pipe)
    classes = pipe.num_classes
    scale = float(defaults.guidance.scale)
    scale_model = pipe.scale_model()

    def run_official(labels, seed, top_k=defaults.top_k):
        # official "off" is top_p 0; mmgen's is 1.0
        return model.autoregressive_infer_cfg(len(labels), torch.tensor(labels), g_seed=seed, cfg=scale, top_k=top_k,
                                              top_p=0.0 if defaults.top_p >= 1.0 else defaults.top_p)

    decoders = {m: pipe.decoder(m) for m in args.methods}

    def run_mmgen(method, labels, seed, sampling=defaults):
        out = decoders[method].generate(scale_model, torch.tensor(labels), sampling, torch.Generator().manual_seed(seed))
        return out.tokens, pipe.decode_tokens(out.tokens, "pt")

    with torch.inference_mode():
        # The same model: greedy tokens equal (official top-k 1 is its greedy; mmgen temperature 0),
        # and so the images.
        labels = list(range(min(4, classes)))
        official_tokens, official_images = official_greedy(model, lambda: run_official(labels, 0, top_k=1))
        tokens, images = run_mmgen("ar", labels, 0, replace(defaults, temperature=0.0))
        image_diff = (images - official_images).abs().max().item()
        same = torch.equal(torch.cat(tokens, 1), official_tokens) and image_diff <= 1e-4
        if not same:
            print(f"official_var: official greedy tokens or images (max diff {image_diff:.2e}) differ from mmgen ar's: "
                  "not the same model", file=sys.stderr)
            return 1
        times = timed_rounds("official autoregressive_infer_cfg", run_official, args.methods, run_mmgen, args.repeats, args.batch,
                             classes)
    rows = ratio_rows(times, "official autoregressive_infer_cfg", args.batch)
    env = environment(torch.device("cpu"), command("official_var", argv))
    report = {"environment": env, "model": args.model, "batch": args.batch, "repeats": args.repeats,
              "sampling": {"guidance_scale": scale, "temperature": defaults.temperature, "top_k": defaults.top_k,
                           "top_p": defaults.top_p},
              "greedy_equal": same, "greedy_image_max_diff": image_diff, "official_commit": commit_of(official),
              "rows": rows}
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
