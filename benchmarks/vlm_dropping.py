"""Visual token dropping side by side, in one process: keep ratio against the language model's
prefill FLOPs (analytic), time to first token, decode tokens/s, answer agreement with the
unpruned model (greedy) and, on the bundled pair, exact match with the held-out answers;
medians over repeats.

    python -m benchmarks.vlm_dropping --model emoji-vlm --rows 64   # held-out questions, scored
    python -m benchmarks.vlm_dropping --model PATH                   # any VLM folder (random images)
    python -m benchmarks.vlm_dropping --random medium                # random-weights LLaVA, no download

Random weights give timings and FLOPs, not quality: agreement there only shows how far
dropping moves an untrained model's greedy path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from PIL import Image

SIZES = {  # hidden, layers, heads, intermediate; vision tower image / patch size
    "tiny": dict(hidden=64, layers=4, heads=4, inter=128, image=64, patch=8),
    "medium": dict(hidden=256, layers=8, heads=8, inter=688, image=224, patch=14),
}


def random_llava(size: str):
    """A random-weights LLaVA (CLIP tower + Llama) with a word-level tokenizer built here."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, PreTrainedTokenizerFast)

    from mmgen.vlm.pipeline import VLMPipeline

    s = SIZES[size]
    words = ["<pad>", "<s>", "</s>", "<unk>", "<image>", "USER:", "ASSISTANT:"] + [f"w{i}" for i in range(505)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", extra_special_tokens={"image_token": "<image>"})
    template = ("{% for m in messages %}{{ m['role'].upper() + ': ' }}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                "<image> {% else %}{{ c['text'] + ' ' }}{% endif %}{% endfor %}{% endfor %}"
                "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": s["image"]},
                                                                  crop_size={"height": s["image"], "width": s["image"]}),
                               tokenizer=tokenizer, patch_size=s["patch"], vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=template)
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=2,
                                       num_attention_heads=s["heads"], image_size=s["image"], patch_size=s["patch"]),
        text_config=LlamaConfig(vocab_size=len(words), hidden_size=s["hidden"], intermediate_size=s["inter"],
                                num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                                pad_token_id=0, bos_token_id=1, eos_token_id=2),
        image_token_index=4, vision_feature_layer=-2, vision_feature_select_strategy="default")
    return VLMPipeline(LlavaForConditionalGeneration(config).eval(), processor)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a VLM folder or bundled name (default: --random)")
    parser.add_argument("--random", choices=sorted(SIZES), default="tiny", help="random-weights LLaVA size without --model")
    parser.add_argument("--policies", default="fastv:layer=2,keep_ratio={r};visionzip:keep_ratio={r};mustdrop:layer=2,keep_ratio={r}")
    parser.add_argument("--ratios", default="1.0,0.5,0.25,0.1")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", default="what is this ?")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    answers = None
    if args.model:
        import mmgen
        from mmgen.loading import resolve_model

        pipe = mmgen.load_pipeline(args.model, dtype=torch.float32)
        held_out = Path(resolve_model(args.model)).parent / "emoji-vlm-eval.jsonl"
    else:
        pipe, held_out = random_llava(args.random), None
    if held_out is not None and held_out.is_file():  # the bundled pair: held-out questions, answers scored
        from benchmarks.train_vlm import load_eval

        records, pictures = load_eval(held_out.parent)
        records = records[: args.rows]
        prompts, imgs = [r["question"] for r in records], [Image.fromarray(pictures[r["index"]]) for r in records]
        answers, stops = [r["answer"] for r in records], None
    else:
        g = torch.Generator().manual_seed(0)
        side = pipe.processor.image_processor.crop_size["height"] if hasattr(pipe.processor.image_processor, "crop_size") else 64
        imgs = [Image.fromarray((torch.rand(side, side, 3, generator=g) * 255).byte().numpy()) for _ in range(args.rows)]
        prompts, stops = [args.prompt] * args.rows, []

    def run(spec):
        outs = [pipe(prompts, imgs, max_new_tokens=args.max_new_tokens, stop_token_ids=stops, dropping=spec)
                for _ in range(args.repeats + 1)][1:]  # first run warms up
        return outs[-1], statistics.median(o.ttft_s for o in outs), statistics.median(o.decode_tokens_per_s for o in outs)

    base, base_ttft, base_rate = run(None)
    exact = lambda out: None if answers is None else sum(t == a for t, a in zip(out.texts, answers)) / len(answers)
    rows = [dict(policy="none", keep_ratio=1.0, image_tokens=None, kept_tokens=None, prefill_flops=None, flops_saved=0.0,
                 ttft_s=base_ttft, decode_tokens_per_s=base_rate, agreement=1.0, exact_match=exact(base))]
    for template in args.policies.split(";"):
        for ratio in args.ratios.split(","):
            spec = template.format(r=float(ratio))
            try:
                out, ttft, rate = run(spec)
            except ValueError as error:  # a policy the model's family cannot run
                print(f"{spec}: {error}", file=sys.stderr)
                break
            r = out.dropping
            same = [torch.equal(a[:n], b[:n]) for a, b, n in zip(out.token_ids, base.token_ids, base.lengths.tolist())]
            rows.append(dict(policy=spec, keep_ratio=float(ratio),
                             image_tokens=statistics.mean(r.image_tokens) if r else None,
                             kept_tokens=statistics.mean(r.kept_tokens) if r else None,
                             prefill_flops=r.prefill_flops_pruned if r else None, flops_saved=r.flops_saved if r else 0.0,
                             ttft_s=ttft, decode_tokens_per_s=rate, agreement=sum(same) / len(same), exact_match=exact(out)))
    print(f"{'policy':44s} {'img':>5s} {'kept':>5s} {'FLOPs saved':>11s} {'TTFT ms':>8s} {'decode tok/s':>12s} {'agree':>6s} "
          f"{'exact':>6s}")
    for row in rows:
        img = "" if row["image_tokens"] is None else f"{row['image_tokens']:.0f}"
        kept = "" if row["kept_tokens"] is None else f"{row['kept_tokens']:.0f}"
        print(f"{row['policy']:44s} {img:>5s} {kept:>5s} {row['flops_saved']:>10.1%} {row['ttft_s'] * 1e3:>8.1f} "
              f"{row['decode_tokens_per_s']:>12.1f} {row['agreement']:>6.2f} "
              f"{'' if row['exact_match'] is None else format(row['exact_match'], '.1%'):>6s}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return {"rows": rows}


if __name__ == "__main__":
    main()
