"""mmgen's decoders against the official LlamaGen code on the same weights (a class-conditional
folder such as the bundled `emoji64`), on this machine.

    python -m benchmarks.official_llamagen --official PATH --json docs/results/official_llamagen_emoji64_cpu.json

`--official` is a checkout of https://github.com/FoundationVision/LlamaGen (its
`autoregressive/models` and `utils` folders are all that is read). Its `Transformer` is built from the
folder's config and loads the folder's weights strictly (mmgen keeps the official layout), then
its own `generate` (gpt-fast's static-cache loop, eager) decodes at the model's sampling
defaults. First, a check that the two run the same model: official greedy tokens (top-k 1) must
equal mmgen `ar`'s. Then, per repeat, every method decodes the same classes in turn (official
first), and each method's time is reported against the official `generate` and against mmgen
`ar` as medians of the per-repeat (paired) ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.official_peer import command, commit_of, finish, parse, ratio_rows, timed_rounds
from mmgen.benchmarking import environment


def official_model(official: Path, transformer) -> torch.nn.Module:
    """The official `Transformer` with `transformer`'s config and weights (loaded strictly)."""
    sys.path.insert(0, str(official))
    from autoregressive.models.gpt import ModelArgs, Transformer

    c = transformer.config
    args = ModelArgs(dim=c.dim, n_layer=c.n_layer, n_head=c.n_head, n_kv_head=c.n_kv_head, multiple_of=c.multiple_of,
                     ffn_dim_multiplier=c.ffn_dim_multiplier, rope_base=c.rope_base, norm_eps=c.norm_eps,
                     token_dropout_p=0.0, attn_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0, drop_path_rate=0.0,
                     num_classes=c.num_classes, caption_dim=c.caption_dim, class_dropout_prob=c.class_dropout_prob,
                     model_type=c.model_type, vocab_size=c.vocab_size, cls_token_num=c.cls_token_num, block_size=c.block_size)
    model = Transformer(args).eval()
    model.load_state_dict(transformer.state_dict(), strict=True)
    return model


def main(argv=None) -> int:
    args = parse(__doc__, "FoundationVision/LlamaGen", "emoji64", ["ar", "sjd", "heads:confidence=0.3"], ["autoregressive/models/generate.py", "utils/drop_path.py"], argv)
    official = args.official

    from mmgen import load_pipeline

    pipe = load_pipeline(args.model)
    pipe.set_progress_bar_config(disable=True)
    model = official_model(official, pipe.transformer)
    from autoregressive.models.generate import generate

    n, classes = pipe.transformer.config.block_size, pipe.num_classes
    defaults = pipe.sampling_config(None, None, None, None, None)
    scale = float(defaults.guidance.max_scale)
    token_model = pipe.token_model()

    def run_official(labels, top_k=defaults.top_k, temperature=defaults.temperature):
        return generate(model, torch.tensor(labels), n, cfg_scale=scale, temperature=max(temperature, 1e-5), top_k=top_k,
                        top_p=defaults.top_p, sample_logits=True)

    decoders = {m: pipe.decoder(m) for m in args.methods}

    def run_mmgen(method, labels, seed, sampling=defaults):
        return decoders[method].generate(token_model, torch.tensor(labels), n, sampling, torch.Generator().manual_seed(seed))

    with torch.no_grad():
        # The same model: greedy tokens equal (official top-k 1 is its greedy; mmgen temperature 0).
        from dataclasses import replace

        labels = list(range(min(4, classes)))
        same = torch.equal(run_official(labels, top_k=1).long(), run_mmgen("ar", labels, 0, replace(defaults, temperature=0.0)).tokens)
        if not same:
            print("official_llamagen: official greedy tokens differ from mmgen ar's: not the same model", file=sys.stderr)
            return 1
        times = timed_rounds("official generate", lambda labels, seed: run_official(labels), args.methods, run_mmgen,
                             args.repeats, args.batch, classes)
    report = {"environment": environment(torch.device("cpu"), command("official_llamagen", argv)), "model": args.model,
              "batch": args.batch, "repeats": args.repeats,
              "sampling": {"guidance_scale": scale, "temperature": defaults.temperature, "top_k": defaults.top_k,
                           "top_p": defaults.top_p},
              "greedy_equal": same, "official_commit": commit_of(official),
              "rows": ratio_rows(times, "official generate", args.batch)}
    return finish(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
