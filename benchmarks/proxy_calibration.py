"""How the quality proxies move under known degradations, so their numbers can be trusted.

Rows: the held-out real images, their VQ reconstructions, the same tokens shuffled, and AR
samples of the bundled model at several temperatures and guidance scales (same labels and
seed everywhere; two samples per class). Each row: classifier accuracy, FID-proxy, and the
GPT's NLL of the tokens.

    python -m benchmarks.proxy_calibration --json docs/results/proxy_calibration.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from mmgen.benchmarking import environment, markdown_table
from mmgen.image_ar.bench.llamagen import sample_and_score, score_samples
from mmgen.decoding import Autoregressive

from mmgen.image_ar.bundled import QUALITY_CLASSIFIER, load_eval_set
from mmgen.loading import resolve_model
from mmgen.image_ar.llamagen import LlamaGenPipeline, LlamaGenTokenModel
from mmgen.image_ar.quality import ImageQualityProxies


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-class", type=int, default=2)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0, 1.3, 1.6])
    parser.add_argument("--guidance-scales", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()

    pipe = LlamaGenPipeline.from_pretrained(resolve_model("emoji64"))
    model = LlamaGenTokenModel(pipe.transformer)
    scorer = ImageQualityProxies.from_pretrained(QUALITY_CLASSIFIER)

    real, real_labels = load_eval_set()
    codes = pipe.vq.encode(real * 2 - 1)[2]
    generator = torch.Generator().manual_seed(args.seed)
    shuffled = codes.gather(1, torch.stack([torch.randperm(codes.shape[1], generator=generator) for _ in codes]))
    rows = [
        {"samples": "real held-out images", **score_samples(scorer, model, real, real_labels, codes)},
        {"samples": "VQ reconstructions of them", **score_samples(scorer, model, pipe.decode_tokens(codes, "pt"), real_labels, codes)},
        {"samples": "their tokens, shuffled", **score_samples(scorer, model, pipe.decode_tokens(shuffled, "pt"), real_labels, shuffled)},
    ]

    labels = torch.arange(pipe.num_classes).repeat_interleave(args.per_class)
    default_guidance = pipe.sampling_defaults["guidance_scale"]
    settings = [(t, default_guidance) for t in args.temperatures]
    settings += [(1.0, g) for g in args.guidance_scales if g != default_guidance]
    for temperature, guidance in settings:
        sampling = pipe.sampling_config(guidance_scale=guidance, temperature=temperature)
        scores = sample_and_score(pipe, Autoregressive(), sampling, labels, 64, args.seed, scorer)
        rows.append({"samples": f"AR samples, temperature {temperature}, guidance {guidance}", **scores})

    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            command = "python -m benchmarks.proxy_calibration " + shlex.join(sys.argv[1:])
            json.dump({"environment": environment(torch.device("cpu"), command), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
