"""One command that checks a GPU and measures the decoding core on it, within a fixed time.

    python -m benchmarks.gpu_check --out gpu-report          # CUDA, real sizes, at most 8 minutes on an H100
    python -m benchmarks.gpu_check --small --out /tmp/check  # tiny configs on the CPU, under a minute

It writes DIR/report.json and DIR/report.md (rewritten after every section, so a run cut off
still leaves what it measured), section by section:

- environment: GPU, driver, CUDA, torch, triton, transformers and diffusers versions;
- device tests: `pytest -m device tests/device` with MMGEN_TEST_DEVICE set to the device, in a
  subprocess (`--tests EXPR` narrows it as `pytest -k`);
- step latency (`benchmarks.step_latency`): an AR step and a 16-token verify step with random
  weights at real sizes, in bfloat16, against the weights / bandwidth floor: LlamaGen GPT-XL
  (eager, and compiled with CUDA graphs as its own, last, section), VAR-d30, Janus-Pro-1B's
  trunk, Qwen2.5-VL-3B's language model, Dia-1.6B, and one denoising forward of a
  Wan-2.1-1.3B block;
- rule cost (`benchmarks.rule_cost`): each acceptance rule beside a GPT-B verify forward;
- decoders: SJD, GSD and LANTERN against AR, whole decodes of random LlamaGen GPT-XL at batch 1
  and 8 (wall clock, forwards, step compression);
- continuous batching: images per second against static batches at batch 8 and 32;
- proposers: a round of drafting by draft heads (a chain, and a token tree of 3 branches) and by
  layer skipping beside the verify forward it feeds and an AR step (random GPT-XL and heads:
  costs, not acceptance).

Goals (docs/benchmarks.md, "GPU check"): AR step <= 1.3x the floor, 16-token verify <= 1.2x an
AR step, every rule <= 10% of a verify forward, SJD wall-clock speedup >= 0.85x its step
compression; the report marks each figure against its goal.

Every section has a time box, and all of them share `--budget` seconds: a section that fails
is written down with its traceback, one that runs out of time with what it had measured, and
the next one starts. On a GPU each section runs in its own process (`--no-isolate` keeps them
in this one), so a hung kernel or a poisoned CUDA context costs one section. `--small` runs
every section on tiny models, on the CPU.

On a bare GPU machine (no network, no `*/assets/`) install the wheels of
`benchmarks.gpu_wheels` first (docs/benchmarks.md, "GPU check").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 16
GOALS = {"ar_over_floor": 1.3, "verify_over_ar": 1.2, "rule_over_verify": 0.10, "sjd_speedup_over_compression": 0.85}
BUDGET = {"full": 450.0, "small": 55.0}  # seconds for all sections; a GPU run must end within 8 minutes (480 s)


class SectionTimeout(Exception):
    """A section ran past its time box."""


@dataclass
class Context:
    """What every section reads: the device, the dtype of real-size runs, tiny or real sizes."""

    device: Any
    dtype: Any
    small: bool
    tests: Optional[str]
    out: Path


@dataclass
class Section:
    """One part of the report: `run(ctx, result)` fills the dict `result` as it goes (what it
    holds when the time box ends is kept). `seconds` is its box on a GPU, `small` with --small."""

    name: str
    title: str
    run: Callable[[Context, dict], None]
    seconds: float
    small: float


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(ctx: Context, result: dict) -> None:
    import torch

    from mmgen.benchmarking import environment as machine
    from mmgen.kernels import backend_for

    result.update(machine(ctx.device, "python -m benchmarks.gpu_check " + " ".join(sys.argv[1:])))
    result.update({name: _version(name) for name in ("triton", "transformers", "diffusers", "accelerate", "numpy")})
    result["kernels"] = backend_for(torch.zeros(1, device=ctx.device))
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        result.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), capability=f"{props.major}.{props.minor}",
                      memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20)
            result["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            result["driver"] = None


def device_test_files() -> list[str]:
    """tests/device's modules, CUDA-only checks (kernel compilation, CUDA-graph capture: the
    slow ones) last, so that a time box cut there still leaves every family's parity."""
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "device").glob("test_*.py"))
    return sorted(files, key=lambda f: f.endswith("test_cuda.py"))


def device_tests(ctx: Context, result: dict, timeout: float = 0) -> None:
    """`pytest -m device` over tests/device on the device, in a subprocess; counts, failures and
    skip reasons from its JUnit XML, or, when it runs out of time, from its per-test lines."""
    xml = ctx.out / "device_tests.xml"
    command = [sys.executable, "-m", "pytest", "-m", "device", *device_test_files(), "-v", "-rfE", "-p", "no:cacheprovider",
               f"--junitxml={xml}"] + (["-k", ctx.tests] if ctx.tests else [])
    result["command"] = f"MMGEN_TEST_DEVICE={ctx.device} python " + " ".join(command[1:])
    env = {**os.environ, "MMGEN_TEST_DEVICE": str(ctx.device)}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout or None)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        result["output_tail"] = out[-3000:]
        result["so_far"] = {outcome: out.count(f" {outcome.upper()}") for outcome in ("passed", "failed", "error", "skipped")}
        result["failures"] = [{"test": line.split(" ")[0], "message": ""} for line in out.splitlines() if " FAILED" in line]
        raise SectionTimeout(f"pytest ran past {timeout:.0f} s") from None
    result["exit_code"] = done.returncode
    result["output_tail"] = (done.stdout + done.stderr)[-3000:]
    if xml.is_file():
        result.update(junit_summary(xml))
    if done.returncode not in (0, 5):  # 5: nothing selected
        raise RuntimeError(f"pytest exited {done.returncode}: {result.get('failed', '?')} failed, {result.get('errors', '?')} errors "
                           "(see failures)")


def junit_summary(path: Path) -> dict:
    """Outcome counts, each failure's test and message, and each skip reason (counted)."""
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], {}
    for case in suite.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reason = (outcome.get("message") or "").strip()
            skips[reason] = skips.get(reason, 0) + 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append({"test": name, "message": (outcome.get("message") or "")[:500]})
    return {**counts, "seconds": float(suite.get("time", 0)), "failures": failures, "skip_reasons": skips}


def _janus_case(name: str, device, dtype, window: int, context: int = 128):
    """Janus-Pro-1B's image-generation step (`JanusTokenModel.forward`: the Llama trunk, the
    generation embeddings, aligner and head) after a `context`-token prompt; the vision tower
    and the VQ decoder (prefill and image decoding only) are built small and not counted."""
    import torch
    from transformers import JanusConfig, JanusForConditionalGeneration

    from benchmarks.step_latency import Case, Step, weight_bytes
    from mmgen.image_ar.janus import JanusConditions, JanusTokenModel

    tiny = name == "janus-tiny"
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                vocab_size=256) if tiny else dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                                  num_attention_heads=16, num_key_value_heads=16, vocab_size=102400)
    hidden = text["hidden_size"]
    config = JanusConfig(
        text_config=dict(model_type="llama", max_position_embeddings=16384, **text),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, projection_dim=hidden),
        vq_config=dict(num_embeddings=512 if tiny else 16384, base_channels=32, num_res_blocks=1, projection_dim=hidden,
                       image_token_embed_dim=hidden))
    torch.manual_seed(0)
    with torch.device(device):
        model = JanusForConditionalGeneration._from_config(config, dtype=dtype).eval()
    boi = text["vocab_size"] - 1
    model.generation_config.pad_token_id, model.generation_config.bos_token_id = 0, 1
    model.generation_config.generation_kwargs = {"boi_token_id": boi}
    token_model = JanusTokenModel(model)
    ids = torch.randint(2, boi, (1, context), device=device)
    ids[0, 0], ids[0, -1] = 1, boi
    conditions = JanusConditions(ids, torch.ones_like(ids))

    def step(mode: str, width: int) -> Step:
        held, tokens = {}, torch.randint(0, token_model.vocab_size, (1, width), device=device)

        def prepare():  # a fresh cache each time: a forward appends its slots
            held["state"] = token_model.start(conditions, context + window, True)

        return Step(lambda: token_model.forward(held["state"], tokens), prepare)

    inner = model.model
    skip = (inner.vision_model, inner.aligner, inner.vqmodel, model.lm_head)
    params = sum(p.numel() for p in model.parameters()) - sum(p.numel() for m in skip for p in m.parameters())
    note = (f"{name}: image-token step with CFG (2 rows) after a {context}-token prompt; the text head, vision tower and VQ "
            "are not read by it (built small, not counted)")
    return Case(name, params, weight_bytes(model, skip=skip), ("eager",), step, [note])


def _wan_case(name: str, device, dtype, window: int):
    """One denoising forward of a block (3 latent frames of a 64x64 video, 48 tokens) on a
    cache holding the block before it, Wan-2.1-T2V-1.3B's transformer; no verify window
    exists (block diffusion denoises a whole block per forward)."""
    import torch
    from diffusers import WanTransformer3DModel

    from benchmarks.step_latency import Case, Step, weight_bytes
    from mmgen.video.model import PromptEmbeddings, WanBlockModel

    tiny = name == "wan-tiny"
    dims = dict(num_attention_heads=2, attention_head_dim=12, ffn_dim=32, num_layers=2, text_dim=16, freq_dim=16) if tiny else \
        dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30, text_dim=4096)
    torch.manual_seed(0)
    with torch.device(device):
        transformer = WanTransformer3DModel(in_channels=16, out_channels=16, **dims).eval().to(dtype)
        text = PromptEmbeddings(torch.randn(1, 512, dims["text_dim"], dtype=dtype))
    frames, latent = 3, (8, 8)
    model = WanBlockModel(transformer, frames, latent)
    noise = torch.randn(1, 16, frames, *latent, device=device, dtype=dtype)

    def step(mode: str, width: int):
        if width != 1:
            return None
        with torch.no_grad():
            state = model.start(text, 2, False)
            model.velocity(state, noise, 500.0)
            model.commit(state, noise)
        return Step(lambda: model.velocity(state, noise, 500.0))

    params = sum(p.numel() for p in transformer.parameters())
    note = (f"{name}: 'AR step' = one denoising forward of a 48-token block (3 latent frames at 64x64) after one cached "
            "block; no verify window")
    return Case(name, params, weight_bytes(transformer), ("eager",), step, [note])


#: Real sizes and their tiny stand-ins (`--small`): the step-latency builders by name.
STEP_MODELS = {"GPT-XL": "llamagen-tiny", "var-d30": "var-tiny", "janus-pro-1b": "janus-tiny", "qwen2.5-vl-3b": "vlm-tiny",
               "dia": "dia-tiny", "wan-1.3b": "wan-tiny"}


def step_case(name: str, device, dtype):
    from benchmarks import step_latency

    builders = {**step_latency.BUILDERS, "janus-pro-1b": _janus_case, "janus-tiny": _janus_case, "wan-1.3b": _wan_case,
                "wan-tiny": _wan_case}
    return builders[name](name, device, dtype, WINDOW)


def step_section(model: str, mode: str) -> Callable[[Context, dict], None]:
    def run(ctx: Context, result: dict) -> None:
        import torch

        from benchmarks.step_latency import bandwidth, measure

        name = STEP_MODELS[model] if ctx.small else model
        per_second, source = bandwidth(ctx.device, None)
        result.update(model=name, dtype=str(ctx.dtype).removeprefix("torch."), bandwidth_gbps=per_second / 1e9,
                      bandwidth_source=source, window=WINDOW)
        case = step_case(name, ctx.device, ctx.dtype)
        repeats, warmup = (2, 1) if ctx.small else (20, 3)
        result["rows"] = measure(case, [mode], WINDOW, ctx.device, repeats, warmup, case.step_bytes / per_second)
        result["notes"] = case.notes + ([f"{name}: {mode} is not run for this model"] if mode not in case.modes else [])
        if ctx.device.type == "cuda":
            result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 2)

    return run


def rule_cost(ctx: Context, result: dict) -> None:
    import torch

    from benchmarks import rule_cost as benchmark

    argv = ["--device", str(ctx.device), "--window", str(WINDOW)]
    argv += ["--vocab", "512", "--top-k", "64", "--repeats", "1"] if ctx.small else ["--top-k", "2000", "0", "--repeats", "20"]
    threads = torch.get_num_threads()
    try:
        result.update(benchmark.main(argv))
    finally:
        torch.set_num_threads(threads)  # rule_cost times one thread on a CPU


def _random_llamagen(ctx: Context):
    """(token model, sampling, tokens per image, class count): GPT-XL at 256 px with random
    weights and a random VQ codebook for LANTERN's neighbours, in `ctx.dtype` (a 2-layer
    16-token model with --small), under LlamaGen's official sampling (CFG 4, top-k 2000)."""
    import torch

    from mmgen.image_ar.llamagen import LlamaGenConfig, LlamaGenTokenModel, LlamaGenTransformer
    from mmgen.sampling import IntervalGuidance, SamplingConfig

    if ctx.small:
        config = LlamaGenConfig(dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=512, block_size=16, num_classes=10)
    else:
        config = LlamaGenConfig.from_preset("GPT-XL")
    torch.manual_seed(0)
    with torch.device(ctx.device):
        transformer = LlamaGenTransformer(config).eval().to(ctx.dtype)
        codebook = torch.randn(config.vocab_size, 8)
    sampling = SamplingConfig(1.0, min(2000, config.vocab_size), 1.0, IntervalGuidance(4.0, -1))
    return LlamaGenTokenModel(transformer, codebook=codebook), sampling, config.block_size, config.num_classes


def decoders(ctx: Context, result: dict) -> None:
    """Whole decodes, methods interleaved within each repeat, medians: wall clock, forwards and
    step compression of each decoder against AR at the same batch."""
    import statistics

    import torch

    from benchmarks.step_latency import _sync
    from mmgen.decoding import resolve_decoder
    from mmgen.sampling import make_generator

    model, sampling, tokens, classes = _random_llamagen(ctx)
    methods, batches, repeats = ["ar", "sjd", "gsd", "lantern"], [1, 8], 1 if ctx.small else 2
    result.update(model="random LlamaGen " + ("tiny" if ctx.small else "GPT-XL"), tokens=tokens, repeats=repeats, rows=[])
    for batch in batches:
        labels = torch.arange(batch, device=ctx.device) % classes
        runs: dict = {m: [] for m in methods}
        for repeat in range(repeats + 1):  # the first round warms up
            for method in methods:
                _sync(ctx.device)
                out = resolve_decoder(method).generate(model, labels, tokens, sampling, make_generator(repeat, ctx.device))
                _sync(ctx.device)
                if repeat:
                    runs[method].append(out.stats)
        base = statistics.median(s.wall_time_s for s in runs["ar"])
        for method in methods:
            stats = runs[method]
            seconds = statistics.median(s.wall_time_s for s in stats)
            compression = statistics.median(s.step_compression for s in stats)
            result["rows"].append({"method": method, "batch": batch, "seconds": seconds, "speedup_vs_ar": base / seconds,
                                   "forwards": statistics.median(s.forwards for s in stats), "step_compression": compression,
                                   "speedup_over_compression": base / seconds / compression})


def proposers(ctx: Context, result: dict) -> None:
    """Speculation without a second model at real sizes: one round's drafting (3 drafts) by
    draft heads (a chain, and a token tree of 3 branches) and by layer-skip self-drafting, beside
    the verify forward it feeds (4 tokens; the tree's 10, with tree attention) and
    an AR step, on random LlamaGen GPT-XL with random heads at batch 1 and 8 (medians). Random
    weights accept nothing worth reporting, so only costs are measured: a round pays when
    (1 + accepted drafts) AR steps cost more than drafting plus verifying."""
    import statistics
    import time as clock

    import torch

    from benchmarks.step_latency import _sync
    from mmgen.decoding import DraftHeads, DraftHeadsConfig, HeadsSpeculative, LayerSkipSpeculative
    from mmgen.decoding.proposer import DecodeRun
    from mmgen.decoding.tree import TreeLayout
    from mmgen.sampling import make_generator

    model, sampling, tokens, classes = _random_llamagen(ctx)
    heads = DraftHeads(DraftHeadsConfig(model.hidden_size)).to(ctx.device, ctx.dtype)
    repeats, drafts = 3 if ctx.small else 10, 3
    result.update(model="random LlamaGen " + ("tiny" if ctx.small else "GPT-XL"), drafts=drafts, repeats=repeats, rows=[])

    def median_ms(work) -> float:
        times = []
        for _ in range(repeats + 1):  # the first warms up
            _sync(ctx.device)
            begun = clock.perf_counter()
            work()
            _sync(ctx.device)
            times.append(clock.perf_counter() - begun)
        return 1e3 * statistics.median(times[1:])

    for batch in (1, 8):
        labels = torch.arange(batch, device=ctx.device) % classes
        for name, decoder in (("heads", HeadsSpeculative(heads=heads, num_draft=drafts)), ("skip", LayerSkipSpeculative(num_draft=drafts)),
                              ("heads:tree=3", HeadsSpeculative(heads=heads, num_draft=drafts, tree=3))):
            run = DecodeRun.begin(model, labels, tokens, sampling, make_generator(0, ctx.device), drafts,
                                  capacity=tokens + 2 * (1 + 3 * drafts))
            run.tokens[:, 0] = run.state.first_logits.cond[:, 0].argmax(-1)
            proposer, _ = decoder.roles(model, tokens, run.generator)
            proposer.start(run)
            if getattr(decoder, "tree", 0):  # a token tree: drafted for all branches, verified in one tree forward
                layout = TreeLayout(decoder.tree, drafts, run.device)
                drafted = torch.cat([run.newest(), proposer.propose_tree(run, decoder.tree).tokens.flatten(1)], 1)
                draft = lambda: proposer.propose_tree(run, decoder.tree)
                verify = lambda: model.forward_tree(run.state, drafted, layout.depth, layout.visible)
            else:
                drafted = torch.cat([run.newest(), proposer.propose(run)[0]], 1)
                draft, verify = lambda: proposer.propose(run), lambda: model.forward(run.state, drafted)
            # A forward writes the cache but commits nothing, and a round's drafting leaves the
            # state as it found it, so each is timed again and again from the same state.
            row = {"proposer": name, "batch": batch, "verify_tokens": drafted.shape[1], "draft_ms": median_ms(draft),
                   "verify_ms": median_ms(verify), "ar_ms": median_ms(lambda: model.forward(run.state, run.newest()))}
            row["draft_over_ar"] = row["draft_ms"] / row["ar_ms"]
            # Accepted drafts per round a round needs to beat AR: (1 + a) * ar = draft + verify.
            row["break_even_accepted"] = (row["draft_ms"] + row["verify_ms"]) / row["ar_ms"] - 1
            result["rows"].append(row)


def continuous_batching(ctx: Context, result: dict) -> None:
    """Images per second, static batches against continuous batching (`benchmarks.continuous_batching`'s
    two modes), 2x the batch in requests; the first two requests checked against their decode alone."""
    import time as clock

    import torch

    from benchmarks.continuous_batching import continuous, static, utilisation
    from benchmarks.step_latency import _sync
    from mmgen.decoding import resolve_decoder
    from mmgen.sampling import make_generator

    model, sampling, tokens, classes = _random_llamagen(ctx)
    result.update(model="random LlamaGen " + ("tiny" if ctx.small else "GPT-XL"), tokens=tokens, rows=[])
    for batch in (8, 32):
        labels = torch.arange(2 * batch, device=ctx.device) % classes
        for spec in ("ar", "sjd:adapt=false"):
            decoder, row = resolve_decoder(spec), {"method": spec, "batch": batch, "requests": len(labels)}
            for mode in ("static", "continuous"):
                _sync(ctx.device)
                begun = clock.perf_counter()
                if mode == "static":
                    forwards, busy = static(decoder, model, labels, tokens, sampling, batch, 0)
                else:
                    done, stats = continuous(decoder, model, labels, tokens, sampling, batch, 0)
                    forwards, busy = stats.forwards, utilisation(stats, batch)
                _sync(ctx.device)
                row.update({f"{mode}_images_per_s": len(labels) / (clock.perf_counter() - begun), f"{mode}_forwards": forwards,
                            f"{mode}_row_utilisation": busy})
            alone = [decoder.generate(model, labels[i:i + 1], tokens, sampling, make_generator(i, ctx.device)).tokens[0]
                     for i in range(2)]
            row["identical_to_alone"] = f"{sum(bool(torch.equal(a, done[i].tokens)) for i, a in enumerate(alone))}/2"
            row["speedup"] = row["continuous_images_per_s"] / row["static_images_per_s"]
            result["rows"].append(row)


SECTIONS = [
    Section("environment", "Environment", environment, 15, 10),
    Section("device_tests", "Device tests", device_tests, 140, 25),
    Section("step:GPT-XL", "Step latency: LlamaGen GPT-XL, eager", step_section("GPT-XL", "eager"), 25, 8),
    Section("step:janus-pro-1b", "Step latency: Janus-Pro-1B trunk", step_section("janus-pro-1b", "eager"), 20, 8),
    Section("step:qwen2.5-vl-3b", "Step latency: Qwen2.5-VL-3B language model", step_section("qwen2.5-vl-3b", "eager"), 25, 8),
    Section("step:dia", "Step latency: Dia-1.6B", step_section("dia", "eager"), 35, 8),
    Section("step:var-d30", "Step latency: VAR-d30", step_section("var-d30", "eager"), 20, 8),
    Section("step:wan-1.3b", "Step latency: Wan-2.1-1.3B block", step_section("wan-1.3b", "eager"), 20, 8),
    Section("rule_cost", "Acceptance rules beside a verify forward", rule_cost, 30, 10),
    Section("decoders", "SJD, GSD and LANTERN against AR", decoders, 40, 8),
    Section("continuous_batching", "Continuous batching", continuous_batching, 35, 8),
    Section("proposers", "Draft heads and layer skipping: drafting beside verifying", proposers, 25, 6),
    Section("step:GPT-XL:compiled", "Step latency: LlamaGen GPT-XL, compiled (CUDA graphs)", step_section("GPT-XL", "compiled"),
            85, 0),
]
MIN_SECONDS = 3.0  # a section given less than this is skipped


# --------------------------------------------------------------------------------------------
# Running sections in time boxes
# --------------------------------------------------------------------------------------------


@contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in this (main) thread once `seconds` pass."""

    def expire(signum, frame):
        raise SectionTimeout(f"ran past its {seconds:.0f} s box")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_here(section: Section, ctx: Context, seconds: float) -> dict:
    """Run `section` in this process within `seconds`: its record (status, seconds, result,
    error with traceback)."""
    result: dict = {}
    begun = time.perf_counter()
    try:
        with time_box(seconds):
            if section.run is device_tests:
                device_tests(ctx, result, timeout=max(seconds - 2, 1))
            else:
                section.run(ctx, result)
        status, error = "ok", None
    except SectionTimeout as timeout:
        status, error = "timed out", f"{timeout}\n{traceback.format_exc(limit=-3)}"
    except (Exception, SystemExit):  # noqa: BLE001 - written down (a benchmark's exit too), and the next section starts
        status, error = "failed", traceback.format_exc()
    # The section's own time: the release below collects the whole process's garbage, which in a
    # long-lived process (a test session) takes seconds that are not the section's.
    took = round(time.perf_counter() - begun, 2)
    _release(ctx)
    return {"name": section.name, "title": section.title, "status": status, "seconds": took,
            "box_seconds": round(seconds, 1), "result": result, "error": error}


def _release(ctx: Context) -> None:
    import gc

    gc.collect()
    if ctx.device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)


#: Seconds an isolated section's process gets past its box to write its record before it is killed.
GRACE = 10.0


def run_isolated(section: Section, ctx: Context, seconds: float, argv: list[str]) -> dict:
    """Run `section` in a child process of this command (`--only NAME`) whose box counts from
    its launch (imports included), killed GRACE seconds after; its record, or one saying how
    it ended."""
    with tempfile.TemporaryDirectory() as scratch:
        record_path = Path(scratch) / "record.json"
        command = [sys.executable, "-m", "benchmarks.gpu_check", *argv, "--only", section.name, "--record", str(record_path),
                   "--box", str(seconds), "--launched", repr(time.time())]
        begun = time.perf_counter()
        try:
            child = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds + GRACE)
            output = (child.stdout + child.stderr)[-4000:]
            code: Optional[int] = child.returncode
        except subprocess.TimeoutExpired as expired:
            output = (expired.stderr or b"")[-4000:].decode(errors="replace") if isinstance(expired.stderr, bytes) else ""
            code = None
        took = round(time.perf_counter() - begun, 2)
        if record_path.is_file():
            return {**json.loads(record_path.read_text()), "seconds": took, "box_seconds": round(seconds, 1)}
    status = "timed out" if code is None else "failed"
    how = f"killed after {seconds + GRACE:.0f} s" if code is None else f"its process exited {code} without a record"
    return {"name": section.name, "title": section.title, "status": status, "seconds": took, "box_seconds": round(seconds, 1),
            "result": {}, "error": f"{how}\n{output}"}


def run_all(sections: list[Section], ctx: Context, budget: float, isolate: bool, argv: list[str],
            on_record: Callable[[list[dict]], None] = lambda records: None) -> list[dict]:
    """Every section in turn within its box, cut at the run's deadline; the last one gets all
    the others left (the compiled steps: compilation takes what it takes). A GPU run's boxes
    add up to more than the budget, so the last gets what sections that ended early left
    (`--sections step:GPT-XL:compiled` gives it the whole budget); --small's are generous caps on
    sections that take seconds."""
    deadline = time.perf_counter() + budget
    boxes = [s.small if ctx.small else s.seconds for s in sections]
    records: list[dict] = []
    for i, section in enumerate(sections):
        left = deadline - time.perf_counter()
        seconds = 0.0 if not boxes[i] else left if i == len(sections) - 1 else min(boxes[i], left)
        if seconds < MIN_SECONDS:
            records.append({"name": section.name, "title": section.title, "status": "skipped", "seconds": 0.0,
                            "box_seconds": round(max(seconds, 0), 1), "result": {},
                            "error": "not run with --small" if not boxes[i] else "no time left in the budget"})
        elif isolate:
            records.append(run_isolated(section, ctx, seconds, argv))
        else:
            records.append(run_here(section, ctx, seconds))
        print(f"gpu_check: {section.name}: {records[-1]['status']} ({records[-1]['seconds']:.1f} s)", file=sys.stderr, flush=True)
        on_record(records)
    return records


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def goals(records: list[dict]) -> list[dict]:
    """Every measured figure that has a goal, with whether it meets it."""
    out = []
    for record in records:
        result = record["result"]
        for row in result.get("rows", []) if record["name"].startswith("step:") else []:
            for key in ("ar_over_floor", "verify_over_ar"):
                if row.get(key) is not None:
                    out.append({"what": f"{row['model']} {row['mode']} {key}", "value": row[key], "goal": f"<= {GOALS[key]}",
                                "meets": row[key] <= GOALS[key]})
        if record["name"] == "rule_cost":
            for row in result.get("rules", []):
                key = "rule_over_verify"
                out.append({"what": f"{row['rule']} top-k {row['top_k']} {row['case']}", "value": row["vs_verify_forward"],
                            "goal": f"<= {GOALS[key]}", "meets": row["vs_verify_forward"] <= GOALS[key]})
        if record["name"] == "decoders":
            for row in result.get("rows", []):
                if row["method"] == "sjd":
                    key = "sjd_speedup_over_compression"
                    out.append({"what": f"sjd batch {row['batch']} speedup / step compression",
                                "value": row["speedup_over_compression"], "goal": f">= {GOALS[key]}",
                                "meets": row["speedup_over_compression"] >= GOALS[key]})
    return out


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Markdown rows of `rows`: columns are (header, key, format spec)."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for _, key, spec in columns:
            value = row.get(key)
            cells.append(_fmt(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) and spec else
                         "n/a" if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def section_markdown(record: dict) -> list[str]:
    name, result = record["name"], record["result"]
    lines = [f"## {record['title']}", "", f"Status: **{record['status']}** in {record['seconds']:.1f} s "
             f"(box {record['box_seconds']:.0f} s).", ""]
    if name == "environment" and result:
        lines += [f"- {key}: {value}" for key, value in result.items()] + [""]
    elif name == "device_tests" and result:
        if "passed" in result:
            lines += [f"`{result['command']}`: {result['passed']} passed, {result['failed']} failed, {result['errors']} errors, "
                      f"{result['skipped']} skipped in {result['seconds']:.1f} s.", ""]
            lines += [f"- FAILED {f['test']}: {f['message'].splitlines()[0] if f['message'] else ''}" for f in result["failures"]]
            lines += [f"- skipped ({n}): {reason}" for reason, n in result["skip_reasons"].items()] + [""]
        else:
            if result.get("so_far"):
                lines += ["Before the box ended: " + ", ".join(f"{n} {k}" for k, n in result["so_far"].items()) + ".", ""]
                lines += [f"- FAILED {f['test']}" for f in result.get("failures", [])] + [""]
            if result.get("output_tail"):
                lines += ["```", result["output_tail"][-1500:], "```", ""]
    elif name.startswith("step:") and result.get("rows"):
        lines += [f"{result['dtype']}, bandwidth {result['bandwidth_gbps']:.0f} GB/s ({result['bandwidth_source']}); goals: AR "
                  f"step <= {GOALS['ar_over_floor']}x the floor, {WINDOW}-token verify <= {GOALS['verify_over_ar']}x an AR step.", ""]
        lines += _table(result["rows"], [("model", "model", ""), ("mode", "mode", ""), ("params", "parameters", ",d"),
                                         ("floor ms", "floor_ms", ".3g"), ("AR ms", "ar_ms", ".3f"), ("AR / floor", "ar_over_floor", ".2f"),
                                         (f"{WINDOW}-token verify ms", "verify_ms", ".3f"), ("verify / AR", "verify_over_ar", ".2f")])
        lines += [""] + [f"- {note}" for note in result.get("notes", [])] + [""]
    elif name == "rule_cost" and result.get("rules"):
        lines += [f"Verify forward (GPT-B, {WINDOW} tokens, CFG): {result['verify_forward_ms']:.3f} ms; goal: every rule <= "
                  f"{GOALS['rule_over_verify']:.0%} of it.", ""]
        lines += _table(result["rules"], [("rule", "rule", ""), ("top-k", "top_k", ""), ("case", "case", ""), ("ms", "ms", ".3f"),
                                          ("/ verify forward", "vs_verify_forward", ".3f")]) + [""]
    elif name == "decoders" and result.get("rows"):
        lines += [f"{result['model']}, {result['tokens']} tokens per image, medians of {result['repeats']} decode(s) after a "
                  f"warm-up; goal: SJD speedup >= {GOALS['sjd_speedup_over_compression']}x its step compression.", ""]
        lines += _table(result["rows"], [("method", "method", ""), ("batch", "batch", ""), ("s", "seconds", ".3f"),
                                         ("speedup vs AR", "speedup_vs_ar", ".2f"), ("forwards", "forwards", ".0f"),
                                         ("step compression", "step_compression", ".2f"),
                                         ("speedup / compression", "speedup_over_compression", ".2f")]) + [""]
    elif name == "proposers" and result.get("rows"):
        lines += [f"{result['model']}, {result['drafts']} drafts a round, medians of {result['repeats']}; random weights: "
                  "costs only (break-even: the accepted drafts per round at which a round costs what its tokens cost by AR).", ""]
        lines += _table(result["rows"], [("proposer", "proposer", ""), ("batch", "batch", ""), ("drafting ms", "draft_ms", ".3f"),
                                         ("verify tokens", "verify_tokens", ""), ("verify ms", "verify_ms", ".3f"), ("AR ms", "ar_ms", ".3f"),
                                         ("drafting / AR", "draft_over_ar", ".2f"),
                                         ("break-even accepted", "break_even_accepted", ".2f")]) + [""]
    elif name == "continuous_batching" and result.get("rows"):
        lines += [f"{result['model']}, {result['tokens']} tokens per image.", ""]
        lines += _table(result["rows"], [("method", "method", ""), ("batch", "batch", ""), ("requests", "requests", ""),
                                         ("static img/s", "static_images_per_s", ".2f"),
                                         ("continuous img/s", "continuous_images_per_s", ".2f"), ("speedup", "speedup", ".2f"),
                                         ("identical to alone", "identical_to_alone", "")]) + [""]
    if record.get("error"):
        lines += ["```", record["error"].strip()[-3000:], "```", ""]
    return lines


def markdown(report: dict) -> str:
    env = next((r["result"] for r in report["sections"] if r["name"] == "environment"), {})
    lines = ["# GPU check", "", f"`{report['command']}` on {report['device']} ({env.get('device_name', '?')}), "
             f"{'small (tiny models)' if report['small'] else 'real sizes'}, {report['seconds']:.0f} s of a "
             f"{report['budget_seconds']:.0f} s budget.", "", "| section | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']:.1f} |" for r in report["sections"]] + [""]
    if report["goals"]:
        lines += ["## Goals", ""] + _table(
            [{**g, "meets": "yes" if g["meets"] else "**no**"} for g in report["goals"]],
            [("figure", "what", ""), ("value", "value", ".3f"), ("goal", "goal", ""), ("meets", "meets", "")]) + [""]
    for record in report["sections"]:
        lines += section_markdown(record)
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict) -> None:
    from mmgen.files import write_atomic

    report = {**report, "goals": goals(report["sections"])}
    write_atomic(out / "report.json", (json.dumps(report, indent=1, default=str) + "\n").encode())
    write_atomic(out / "report.md", markdown(report).encode())


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for report.md and report.json")
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU, under a minute")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --small)")
    parser.add_argument("--sections", nargs="+", default=None, metavar="NAME",
                        help="run only these, in the table's order: " + " ".join(s.name for s in SECTIONS))
    parser.add_argument("--tests", default=None, metavar="EXPR",
                        help="pytest -k expression for the device tests (default: all; with --small: the official references)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all sections (default 450; 55 with --small)")
    parser.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    isolate = parser.add_mutually_exclusive_group()
    isolate.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                         help="each section in its own process (the default on a GPU)")
    isolate.add_argument("--no-isolate", dest="isolate", action="store_false", help="every section in this process")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # a child of an isolated run: this section
    parser.add_argument("--record", type=Path, default=None, help=argparse.SUPPRESS)  # ... its record goes here
    parser.add_argument("--box", type=float, default=None, help=argparse.SUPPRESS)  # ... within this many seconds
    parser.add_argument("--launched", type=float, default=None, help=argparse.SUPPRESS)  # ... from this time.time()
    args = parser.parse_args(argv)
    names = {s.name for s in SECTIONS}
    unknown = sorted(set(args.sections or []) - names)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(s.name for s in SECTIONS)}")
    if args.budget is not None and args.budget <= 0:
        parser.error("--budget must be > 0 seconds")
    return args


def context(args: argparse.Namespace) -> Context:
    import torch

    name = args.device or ("cpu" if args.small else "cuda")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device here: run the check on the GPU machine, or --small for the CPU")
    if device.type == "cpu" and not args.small:
        raise ValueError("real sizes on the CPU would take hours: add --small (tiny models), or run on a GPU")
    tests = args.tests if args.tests is not None else ("official" if args.small else None)
    return Context(device, torch.float32 if args.small else torch.bfloat16, args.small, tests, args.out)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    sections = [s for s in SECTIONS if args.sections is None or s.name in args.sections]
    if args.only is not None:  # a child of an isolated run
        ctx = context(args)
        section = next(s for s in SECTIONS if s.name == args.only)
        record = run_here(section, ctx, max(args.box - (time.time() - args.launched), MIN_SECONDS))
        args.record.write_text(json.dumps(record, default=str))
        return 0
    if (args.out / "report.json").exists() and not args.overwrite:
        print(f"gpu_check: {args.out}/report.json exists: choose another --out or add --overwrite", file=sys.stderr)
        return 2
    try:
        ctx = context(args)
    except ValueError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget or BUDGET["small" if args.small else "full"]
    isolate = args.isolate if args.isolate is not None else ctx.device.type == "cuda"
    begun = time.perf_counter()
    report = {"command": "python -m benchmarks.gpu_check " + " ".join(argv), "device": str(ctx.device), "small": ctx.small,
              "dtype": str(ctx.dtype).removeprefix("torch."), "budget_seconds": budget, "goals_stated": GOALS}

    def save(records: list[dict]) -> None:
        write_report(args.out, {**report, "seconds": time.perf_counter() - begun, "sections": records})

    child_argv = [a for a in argv if a not in ("--isolate", "--overwrite")]
    records = run_all(sections, ctx, budget, isolate, child_argv, save)
    save(records)
    print(f"gpu_check: wrote {args.out / 'report.md'} and report.json in {time.perf_counter() - begun:.0f} s", file=sys.stderr)
    return 0 if all(r["status"] in ("ok", "skipped") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
