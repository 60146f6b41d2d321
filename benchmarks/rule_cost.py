"""Per-forward cost of each acceptance rule at LlamaGen GPT-B size, beside one verify forward.

A verify forward of a W-token window checks W - 1 drafts per row; the rule then scores those
positions (`rule(p, q, drafts, generator)`: acceptance and residual). This times both on the
same box: the rule on [B, W - 1, V] float32 laws (V = 16384, LlamaGen's VQ codebook, random
8-dim codes for the neighbour and group tables), and the GPT-B forward of the window with CFG
(random weights), medians of interleaved repeats.

    python -m benchmarks.rule_cost --top-k 2000 0 --repeats 5

`--top-k 2000` is LlamaGen's official sampling (p and q each filtered to their 2000 likeliest
tokens; q is p's logits plus noise, as Jacobi carry-over gives); `0` is unfiltered.

Bounded lossy rules on the CPU score positions left to right (in chunks of 1, 2, 4, 8) and stop
at each row's first rejection, so their cost depends on the accepted prefix. Each rule is timed
twice: `call` (these laws reject the first draft: one position scored plus the residual there,
the best case) and `all scored` (every position scored, as when all drafts pass, no residual:
the chunks cost about this in all).

Where the kernel dispatch picks Triton (`--device cuda` with triton installed), each rule is
also timed as the decoding loop runs it there: "torch step" (the rule, a sample from every
position's residual and `finalise`, the loop's torch path) against "kernel step" (the rule's
relaxed target and the exact verify as kernels, `mmgen.kernels`), both drawing the same
uniforms and noise. On the CPU those rows are absent (the twin is the torch path).

    python -m benchmarks.rule_cost --device cuda --top-k 2000 0 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import torch

from benchmarks.step_latency import _sync
from mmgen.decoding import ExactAcceptance, GroupedAcceptance, RelaxedAcceptance
from mmgen.decoding.finalise import finalise
from mmgen.kernels import backend_for, relaxed_target, verify_exact
from mmgen.sampling import exponential_noise, make_generator, sample, uniform

RULES = {
    "sjd (exact)": lambda: ExactAcceptance(),
    "lantern": lambda: RelaxedAcceptance(delta=0.1),
    "lantern++": lambda: RelaxedAcceptance(lam=2.0),
    "gsd": lambda: GroupedAcceptance(),
}


class _Tables:
    """What `bind` reads: a codebook and token embeddings of the vocabulary."""

    def __init__(self, vocab_size: int, generator: torch.Generator):
        self.vocab_size = vocab_size
        self._codes = torch.randn(vocab_size, 8, generator=generator)
        self._embeddings = torch.randn(vocab_size, 8, generator=generator)

    def codebook(self) -> torch.Tensor:
        return self._codes

    def token_embeddings(self) -> torch.Tensor:
        return self._embeddings


def laws(rows: int, vocab: int, top_k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) [rows, V]: q from p's logits plus unit noise (the previous Jacobi iteration's law at
    a neighbouring position: mostly the same likely tokens), each filtered to its own top-k."""

    def softmax(logits: torch.Tensor) -> torch.Tensor:
        if top_k:
            kth = logits.topk(top_k, -1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits.softmax(-1)

    logits = torch.randn(rows, vocab, generator=generator) * 3
    return softmax(logits), softmax(logits + torch.randn(rows, vocab, generator=generator))


def verify_forward(window: int, device: torch.device):
    """A closure running one GPT-B forward of `window` tokens with CFG (batch 1, cache half
    full; bfloat16 on a GPU)."""
    from mmgen.image_ar.llamagen.gpt import LlamaGenConfig, LlamaGenTransformer
    from mmgen.image_ar.llamagen.token_model import LlamaGenTokenModel

    torch.manual_seed(0)
    model = LlamaGenTransformer(LlamaGenConfig.from_preset("GPT-B")).eval()
    model.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    token_model = LlamaGenTokenModel(model)
    state = token_model.start(torch.tensor([0], device=device), model.config.block_size + 2 * window, guidance=True)
    state.cache.advance(model.config.block_size // 2)
    tokens = torch.randint(0, model.config.vocab_size, (1, window), device=device)
    return lambda: token_model.forward(state, tokens)


def torch_step(rule, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator):
    """The loop's torch path after a verify forward: the rule, every residual sampled, `finalise`."""
    accepted, residual = rule(p, q, drafts, generator)
    bonus = sample(p[:, -1:], generator)
    return finalise(accepted, sample(residual, generator), torch.cat([drafts, bonus], 1), drafts, 1)[:2]


def kernel_step(rule, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator):
    """The same work as the kernel step runs it: relaxed target (lossy rules), exact verify."""
    B, n, V = p.shape
    uniforms = uniform((B, n), generator, p.device)
    bonus = sample(p[:, -1:], generator)[:, 0]
    noise = exponential_noise((B, n, V), generator, p.device)
    target = relaxed_target(rule, p, q) if rule.lossy else p
    return verify_exact(target, q, drafts, uniforms, noise, bonus)


def score_all(rule, p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> None:
    """The work of a window whose drafts all pass: every position scored, no residual (a
    bounded rule stops at each row's first rejection, so this bounds its per-forward cost)."""
    rule._decide(p, q, drafts, torch.zeros(drafts.shape))


@torch.no_grad()
def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--top-k", type=int, nargs="+", default=[2000, 0])
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    tables = _Tables(args.vocab, g)
    rules = {name: RULES[name]().bind(tables) for name in args.rules}
    forward = verify_forward(args.window, device)
    n = args.window - 1
    cases = {}
    for top_k in args.top_k:
        p, q = (law.view(args.batch_size, n, args.vocab) for law in laws(args.batch_size * n, args.vocab, top_k, g))
        drafts = torch.multinomial(q.view(-1, args.vocab), 1, generator=g).view(args.batch_size, n)
        cases[top_k] = (p.to(device), q.to(device), drafts.to(device))
    kernels = backend_for(device) == "triton"
    seconds: dict = {"verify forward": []}
    runs = [("verify forward", forward)]
    for name, rule in rules.items():
        for top_k, c in cases.items():
            runs.append(((name, top_k, "call"), lambda rule=rule, c=c: rule(*c, make_generator(1, device))))
            if hasattr(rule, "_decide") and device.type == "cpu":  # every draft scored as if accepted: the CPU's worst case
                runs.append(((name, top_k, "all scored"), lambda rule=rule, c=c: score_all(rule, *c)))
            if kernels:
                for case, step in [("torch step", torch_step), ("kernel step", kernel_step)]:
                    runs.append(((name, top_k, case), lambda rule=rule, c=c, step=step: step(rule, *c, make_generator(1, device))))
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for key, run in runs:
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
            seconds.setdefault(key, []).append(time.perf_counter() - start)
    verify = statistics.median(seconds.pop("verify forward")[1:])
    rows = [{"rule": name, "top_k": top_k, "case": case, "ms": 1e3 * statistics.median(t[1:]), "ms_min": 1e3 * min(t[1:]),
             "ms_max": 1e3 * max(t[1:]), "vs_verify_forward": statistics.median(t[1:]) / verify}
            for (name, top_k, case), t in seconds.items()]
    result = {"window": args.window, "batch_size": args.batch_size, "vocab": args.vocab, "threads": args.threads, "device": str(device),
              "verify_forward_ms": 1e3 * verify, "rules": rows}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
