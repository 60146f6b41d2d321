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

from mmgen.decoding import Autoregressive
from mmgen.metrics import token_nll
from mmgen.sampling import ConstantGuidance, SamplingConfig

from mmgen.image_ar.bench import environment, markdown_table
from mmgen.image_ar.bundled import QUALITY_CLASSIFIER, load_eval_set, resolve_model
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
    rows = []

    def add(name, images, labels, tokens):
        rows.append({"samples": name, **scorer(images, labels), "nll": float(token_nll(model, labels, tokens).mean())})

    real, real_labels = load_eval_set()
    codes = pipe.vq.encode(real * 2 - 1)[2]
    add("real held-out images", real, real_labels, codes)
    add("VQ reconstructions of them", pipe.decode_tokens(codes, "pt"), real_labels, codes)
    generator = torch.Generator().manual_seed(args.seed)
    shuffled = codes.gather(1, torch.stack([torch.randperm(codes.shape[1], generator=generator) for _ in codes]))
    add("their tokens, shuffled", pipe.decode_tokens(shuffled, "pt"), real_labels, shuffled)

    labels = torch.arange(pipe.num_classes).repeat_interleave(args.per_class)
    settings = [(t, pipe.sampling_defaults["guidance_scale"]) for t in args.temperatures]
    settings += [(1.0, g) for g in args.guidance_scales if g != pipe.sampling_defaults["guidance_scale"]]
    for temperature, guidance in settings:
        sampling = SamplingConfig(temperature=temperature, guidance=ConstantGuidance(guidance))
        tokens = torch.cat([
            Autoregressive().generate(model, chunk, 64, sampling, torch.Generator().manual_seed(args.seed + i)).tokens
            for i, chunk in enumerate(labels.split(64))
        ])
        add(f"AR samples, temperature {temperature}, guidance {guidance}", pipe.decode_tokens(tokens, "pt"), labels, tokens)

    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            command = "python -m benchmarks.proxy_calibration " + shlex.join(sys.argv[1:])
            json.dump({"environment": environment(torch.device("cpu"), command), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
