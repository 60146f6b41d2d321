"""Per-step latency of decoding at real model sizes (random weights), eager and compiled,
against the memory-bandwidth floor.

At batch 1 a decode step reads every weight once and computes little, so its floor is the
bytes of the weights it reads divided by the memory bandwidth. The goals (docs/benchmarks.md):
an AR step (1 token per row) within 1.3x that floor, and a 16-token verify step (one
speculative window) within 1.2x an AR step, so that every accepted draft is almost free.

    python -m benchmarks.step_latency                                      # GPT-B, GPT-L, GPT-XL
    python -m benchmarks.step_latency --models GPT-XL var-d30 dia --repeats 50 --json step.json
    python -m benchmarks.step_latency --models GPT-B --threads 1 --repeats 5   # a CPU
    python -m benchmarks.step_latency --preset tiny                         # tiny models, seconds on a CPU

Each model is built with random weights (speed does not depend on them), batch 1, with
classifier-free guidance where the model uses it (2 rows), the cache half full:

- LlamaGen GPT-B / GPT-L / GPT-XL (c2i, 256 px: 256 tokens): `LlamaGenTokenModel.forward` of
  1 and 16 tokens after 128 committed ones; eager, and compiled (`mmgen.compile`: inductor,
  CUDA graphs on CUDA).
- VAR-d30 (next-scale): no one-token step and no verify window exist; its rows time the scale
  step of 1 query token (step 0, the class token) and the one of 16 (step 3, the 4x4 map, after
  14 cached tokens), eager only.
- Dia-1.6B (text-to-speech, its own CFG: 2 rows): `DiaTokenModel.forward` of 1 and 16 frames
  after 128 committed frames; eager only (its cache is transformers' growing `DynamicCache`,
  which does not compile to static shapes).

- Qwen2.5-VL-3B (`qwen2.5-vl-3b`, the VLM adapter `VLMTokenModel`): 1 and 16 tokens after a
  128-token text prompt; eager only (transformers' `DynamicCache`). Its floor leaves out the
  vision tower (run at the prefill). 3.75B parameters: a GPU's size (7.5 GB in bfloat16).

Not timed here: CSM (its forward scores codebook 0 only: the depth decoder's 31 sequential steps per
frame run outside it, so one forward is not one frame's cost) and block-diffusion video (no
token step: `benchmarks/video_decoding.py --wan-size` times its blocks).

The floor counts the weights a step reads: every parameter but embedding tables (a step
gathers a few rows of those) and, for Dia, its encoder (run once, at the prefill). The
bandwidth is `--bandwidth` (GB/s), else the data sheet's for a known GPU (H100 SXM 3.35 TB/s,
H200 4.8 TB/s), else a measured copy of a large tensor on the device (read + write bytes over
time), which is what the CPU gets. Figures are medians over interleaved repeats (every
configuration once per repeat) after warm-up (which includes compilation), each step timed
alone between device synchronisations.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

#: Data-sheet memory bandwidth (bytes/s) by a substring of `torch.cuda.get_device_name`, most
#: specific first.
GPU_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12))
#: The goals this benchmark checks.
AR_OVER_FLOOR_GOAL, VERIFY_OVER_AR_GOAL = 1.3, 1.2
MODES = ("eager", "compiled")
TINY = ("llamagen-tiny", "var-tiny", "dia-tiny", "vlm-tiny")


@dataclass
class Step:
    """One step, ready to time: `prepare()` (untimed) puts the model where the step starts, `run()` is the step."""

    run: Callable[[], Any]
    prepare: Callable[[], Any] = lambda: None


@dataclass
class Case:
    """One model: what a step reads, and `step(mode, width)` -> Step (None where that width has
    no step, e.g. VAR's scales)."""

    model: str
    parameters: int
    step_bytes: int
    modes: tuple[str, ...]
    step: Callable[[str, int], Optional[Step]]
    notes: list[str] = field(default_factory=list)


def weight_bytes(module: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Bytes of the parameters a step reads: all but those only embedding tables and `skip`
    hold (a table tied to an output head is read whole by the head, so it counts)."""
    skipped = {id(m) for s in skip for m in s.modules()}
    read = {id(p) for m in module.modules() if not isinstance(m, nn.Embedding) and id(m) not in skipped
            for p in m.parameters(recurse=False)}
    return sum(p.nbytes for p in module.parameters() if id(p) in read)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def llamagen(name: str, device: torch.device, dtype: torch.dtype, window: int) -> Case:
    from mmgen.image_ar.llamagen import LlamaGenConfig, LlamaGenTokenModel, LlamaGenTransformer

    if name == "llamagen-tiny":
        config = LlamaGenConfig(dim=64, n_layer=1, n_head=4, multiple_of=32, vocab_size=512, block_size=64, num_classes=10)
    else:
        config = LlamaGenConfig.from_preset(name)
    torch.manual_seed(0)
    with torch.device(device):
        transformer = LlamaGenTransformer(config).eval().to(dtype)
    models = {"eager": LlamaGenTokenModel(transformer), "compiled": LlamaGenTokenModel(transformer, compile=True)}
    labels = torch.zeros(1, dtype=torch.long, device=device)

    def step(mode: str, width: int) -> Step:
        model = models[mode]
        state = model.start(labels, config.block_size + 2 * window, guidance=True)
        state.cache.advance(config.block_size // 2)
        tokens = torch.randint(0, config.vocab_size, (1, width), device=device)
        return Step(lambda: model.forward(state, tokens))

    params = sum(p.numel() for p in transformer.parameters())
    return Case(name, params, weight_bytes(transformer), MODES, step)


def var(name: str, device: torch.device, dtype: torch.dtype, window: int) -> Case:
    if name == "var-tiny":
        from mmgen.image_ar.var import VARPipeline
        from tests.image_ar.test_var_pipeline import tiny_transformer, tiny_vqvae

        pipe = VARPipeline(tiny_transformer(), tiny_vqvae()).to(device, dtype)
    else:
        from mmgen.image_ar.bench.var import random_var_pipeline

        pipe = random_var_pipeline(int(name.removeprefix("var-d")), device, dtype)
    model = pipe.scale_model()
    sizes, vocab = model.step_sizes, model.vocab_size
    labels = torch.zeros(1, dtype=torch.long, device=device)

    def step(mode: str, width: int) -> Optional[Step]:
        if width not in sizes:
            return None
        k = sizes.index(width)  # the step whose map has `width` tokens
        maps = [torch.randint(0, vocab, (1, sizes[i]), device=device) for i in range(k)]
        held = {}

        def prepare():
            held["state"] = state = model.start(labels, k + 1, guidance=True)
            for i in range(k):
                model.forward(state, maps[i - 1:i] if i else [])

        return Step(lambda: model.forward(held["state"], maps[k - 1:k] if k else []), prepare)

    params = sum(p.numel() for p in pipe.transformer.parameters())
    notes = [f"{name}: next-scale; 'AR step' = scale step 0 (1 query token, empty cache), 'verify' = the scale step "
             f"of {window} tokens (step {sizes.index(window)}, after {sum(sizes[:sizes.index(window)])} cached)"
             if window in sizes else f"{name}: no scale step has {window} tokens"]
    return Case(name, params, weight_bytes(pipe.transformer), ("eager",), step, notes)


def dia(name: str, device: torch.device, dtype: torch.dtype, window: int, context: int = 128) -> Case:
    from benchmarks.tts_decoding import build

    pipe, text = build("dia", "tiny" if name == "dia-tiny" else "official")
    pipe.to(device, dtype)
    conditions, _ = pipe.prepare(text, max_new_frames=context + 2 * window + 64)
    model = pipe.token_model()

    def step(mode: str, width: int) -> Step:
        with torch.no_grad():
            state = model.start(conditions, context + 2 * window + 64, False)
            frames = state.first_logits.cond.argmax(-1)
            for _ in range(context):
                frames = model.forward(state, frames[:, -1:]).cond.argmax(-1)
                model.commit(state, torch.ones(state.batch_size, dtype=torch.long, device=device))
        tokens = frames[:, -1:].expand(-1, width, -1).contiguous()
        return Step(lambda: model.forward(state, tokens))

    params = sum(p.numel() for p in pipe.model.parameters())
    step_bytes = weight_bytes(pipe.model, skip=(pipe.model.model.encoder,))
    return Case(name, params, step_bytes, ("eager",), step, [f"{name}: {context} frames committed before the timed step"])


#: Qwen2.5-VL-3B-Instruct's dimensions (its config.json): the language model a step runs, and
#: the vision tower that runs only at the prefill.
QWEN2_5_VL_3B = dict(
    text_config=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, max_position_embeddings=128000,
                     tie_word_embeddings=True, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31]),
    tie_word_embeddings=True,
)


def vlm(name: str, device: torch.device, dtype: torch.dtype, window: int, context: int = 128) -> Case:
    """A Qwen2.5-VL through `VLMTokenModel` (the transformers adapter every VLM decodes through):
    1 and 16 tokens after a `context`-token text prompt (the image's tokens cost the prefill,
    not a step)."""
    from mmgen.vlm.token_model import VLMTokenModel

    torch.manual_seed(0)
    if name == "vlm-tiny":
        from tests.vlm.test_vlm_pipeline import tiny_qwen

        model = tiny_qwen(0).model.to(device, dtype)
    else:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration._from_config(Qwen2_5_VLConfig(**QWEN2_5_VL_3B), dtype=dtype).eval()
    token_model = VLMTokenModel(model)
    vocab = token_model.vocab_size
    ids = torch.randint(0, vocab, (1, context), device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def step(mode: str, width: int) -> Step:
        with torch.no_grad():
            state = token_model.start(inputs, context + 2 * window + 64, False)
        tokens = torch.randint(0, vocab, (1, width), device=device)
        return Step(lambda: token_model.forward(state, tokens))

    params = sum(p.numel() for p in model.parameters())
    step_bytes = weight_bytes(model, skip=(model.model.visual,))
    return Case(name, params, step_bytes, ("eager",), step, [f"{name}: a {context}-token text prompt before the timed step"])


BUILDERS = {"GPT-B": llamagen, "GPT-L": llamagen, "GPT-XL": llamagen, "llamagen-tiny": llamagen,
            "var-d16": var, "var-d30": var, "var-tiny": var, "dia": dia, "dia-tiny": dia,
            "qwen2.5-vl-3b": vlm, "vlm-tiny": vlm}


# --------------------------------------------------------------------------------------------
# Bandwidth and timing
# --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of copying a `megabytes` float32 tensor on `device` (read + write), median."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times)


def bandwidth(device: torch.device, given_gbps: Optional[float]) -> tuple[float, str]:
    """(bytes/s, where it comes from): the argument, a known GPU's data sheet, or measured."""
    if given_gbps is not None:
        return given_gbps * 1e9, "--bandwidth"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_BANDWIDTH:
            if key in name:
                return value, f"{key} data sheet"
    return copy_bandwidth(device), "measured copy"


@torch.no_grad()
def time_steps(steps: dict, device: torch.device, repeats: int, warmup: int) -> dict:
    """Seconds of each step (key -> Step), one per repeat: `warmup` untimed rounds, then
    `repeats` rounds, each running every step once, each timed alone."""
    for _ in range(warmup):
        for s in steps.values():
            s.prepare()
            s.run()
    times: dict = {key: [] for key in steps}
    for _ in range(repeats):
        for key, s in steps.items():
            s.prepare()
            _sync(device)
            start = time.perf_counter()
            s.run()
            _sync(device)
            times[key].append(time.perf_counter() - start)
    return times


def measure(case: Case, modes: list[str], window: int, device: torch.device, repeats: int, warmup: int,
            floor: float) -> list[dict]:
    """One row per mode of `case`: AR step, verify step, their ratios to the floor and each other."""
    modes = [m for m in modes if m in case.modes]
    with torch.no_grad():
        steps = {(m, w): case.step(m, w) for m in modes for w in (1, window)}
    times = time_steps({k: s for k, s in steps.items() if s is not None}, device, repeats, warmup)
    ms = lambda key, f: 1e3 * f(times[key]) if key in times else None
    rows = []
    for mode in modes:
        ar, verify = ms((mode, 1), statistics.median), ms((mode, window), statistics.median)
        rows.append({
            "model": case.model, "parameters": case.parameters, "step_weight_bytes": case.step_bytes, "mode": mode,
            "floor_ms": 1e3 * floor, "ar_ms": ar, "verify_ms": verify,
            "ar_ms_range": [ms((mode, 1), min), ms((mode, 1), max)], "verify_ms_range": [ms((mode, window), min), ms((mode, window), max)],
            "ar_over_floor": None if ar is None else ar / (1e3 * floor),
            "verify_over_ar": None if ar is None or verify is None else verify / ar,
        })
    return rows


def token_work(vocab: int, window: int, device: torch.device, repeats: int, warmup: int) -> list[dict]:
    """Milliseconds of a step's token work after the forward, at LlamaGen's sampling (CFG 4,
    top-k 2000, or V if smaller) over `vocab` tokens, batch 1: guidance, filters, softmax and the draws of an AR
    step (width 1), plus the exact verify of a `window`-token step. "torch" is the loop's torch
    path (the kernels' twins are its code); "kernels" the Triton kernel step, where the dispatch
    picks it (CUDA)."""
    from mmgen.kernels import backend_for
    from mmgen.kernels.step import ExactStep
    from mmgen.sampling import Logits, SamplingConfig, make_generator

    sampling = SamplingConfig(temperature=1.0, top_k=min(2000, vocab), guidance=4.0)
    backends = ["twin"] + (["triton"] if backend_for(device) == "triton" else [])
    steps = {}
    for width in (1, window):
        logits = Logits(*(torch.randn(1, width, vocab, device=device) * 3 for _ in range(2)))
        index = torch.arange(width, device=device)[None] + 100
        drafts = torch.randint(0, vocab, (1, width - 1), device=device)
        q = torch.randn(1, width - 1, vocab, device=device).softmax(-1)
        for backend in backends:
            step = ExactStep(sampling, backend=backend)
            generator = make_generator(0, device)
            steps[(backend, width)] = Step(lambda step=step, logits=logits, index=index, drafts=drafts, q=q, generator=generator:
                                           step(logits, index, drafts if width > 1 else None, q, generator, True))
    times = time_steps(steps, device, repeats, warmup)
    return [{"backend": "torch" if backend == "twin" else "kernels", "width": width, "vocab": vocab,
             "ms": 1e3 * statistics.median(t), "ms_range": [1e3 * min(t), 1e3 * max(t)]} for (backend, width), t in times.items()]


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    w = report["window"]
    head = (f"{report['device_name']} ({report['device']}), {report['dtype']}, {report['threads']} thread(s); bandwidth "
            f"{report['bandwidth_gbps']:.1f} GB/s ({report['bandwidth_source']}). Goals: AR step <= {AR_OVER_FLOOR_GOAL}x "
            f"the floor, {w}-token verify <= {VERIFY_OVER_AR_GOAL}x an AR step.\n\n")
    lines = [f"| model | params | weights read per step | floor | mode | AR step | AR / floor | {w}-token verify | verify / AR |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, spec, suffix="": "n/a" if v is None else f"{v:{spec}}{suffix}"
    for r in report["rows"]:
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['step_weight_bytes'] / 2**20:.1f} MiB | "
                     f"{r['floor_ms']:.3g} ms | {r['mode']} | {fmt(r['ar_ms'], '.2f', ' ms')} | {fmt(r['ar_over_floor'], '.2f', 'x')} | "
                     f"{fmt(r['verify_ms'], '.2f', ' ms')} | {fmt(r['verify_over_ar'], '.2f', 'x')} |")
    if report.get("token_work"):
        V = report["token_work"][0]["vocab"]
        lines += ["", f"Token work after each forward (LlamaGen's sampling: CFG 4, top-k {min(2000, V)}; exact verify), "
                  f"V = {V}:", "", f"| path | AR step | {w}-token verify step |", "|---|---|---|"]
        by = {(r["backend"], r["width"]): r["ms"] for r in report["token_work"]}
        for backend in dict.fromkeys(r["backend"] for r in report["token_work"]):
            lines.append(f"| {backend} | {by[(backend, 1)]:.3f} ms | {by[(backend, w)]:.3f} ms |")
    notes = "".join(f"\n- {n}" for n in report["notes"])
    return head + "\n".join(lines) + ("\n" + notes if notes else "") + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, choices=list(BUILDERS),
                        help="default: GPT-B GPT-L GPT-XL (with --preset tiny: " + " ".join(TINY) + ")")
    parser.add_argument("--preset", choices=("official", "tiny"), default="official",
                        help="tiny: the tiny test models of each family (seconds on a CPU)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--window", type=int, default=16, help="tokens of the verify step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="default: bfloat16 on CUDA, float32 elsewhere")
    parser.add_argument("--bandwidth", type=float, default=None, metavar="GB/s",
                        help="memory bandwidth for the floor (default: a known GPU's data sheet, else measured)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (compilation, CUDA graph capture)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--no-token-work", dest="token_work", action="store_false",
                        help="skip the token work rows (sampling and verify after the forward, torch and kernels)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    names = args.models or (list(TINY) if args.preset == "tiny" else ["GPT-B", "GPT-L", "GPT-XL"])
    per_second, source = bandwidth(device, args.bandwidth)

    from mmgen.benchmarking import environment

    env = environment(device, "python -m benchmarks.step_latency " + shlex.join(argv if argv is not None else sys.argv[1:]))
    report = {**env, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
              "window": args.window, "bandwidth_gbps": per_second / 1e9, "bandwidth_source": source,
              "repeats": args.repeats, "warmup": args.warmup, "rows": [], "notes": []}
    for name in names:
        try:  # one model failing (out of memory, say) must not lose the others' figures
            case = BUILDERS[name](name, device, dtype, args.window)
            report["rows"] += measure(case, args.modes, args.window, device, args.repeats, args.warmup, case.step_bytes / per_second)
            report["notes"] += case.notes
        except Exception as error:  # noqa: BLE001 - reported, and the exit status says so
            report["notes"].append(f"{name}: failed: {type(error).__name__}: {error}")
            report["failed"] = report.get("failed", []) + [name]
        case = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.token_work:
        vocab = 512 if args.preset == "tiny" and args.models is None else 16384
        report["token_work"] = token_work(vocab, args.window, device, args.repeats, args.warmup)
    report["markdown"] = markdown(report)
    print(report["markdown"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if report.get("failed"):
        sys.exit(f"step_latency: {', '.join(report['failed'])} failed (see the notes)")
    return report


if __name__ == "__main__":
    main()
