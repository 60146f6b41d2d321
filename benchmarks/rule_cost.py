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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import torch

from mmgen.decoding import ExactAcceptance, GroupedAcceptance, RelaxedAcceptance

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


def verify_forward(window: int):
    """A closure running one GPT-B forward of `window` tokens with CFG (batch 1, cache half full)."""
    from mmgen.image_ar.llamagen.gpt import LlamaGenConfig, LlamaGenTransformer
    from mmgen.image_ar.llamagen.token_model import LlamaGenTokenModel

    torch.manual_seed(0)
    model = LlamaGenTransformer(LlamaGenConfig.from_preset("GPT-B")).eval()
    token_model = LlamaGenTokenModel(model)
    state = token_model.start(torch.tensor([0]), model.config.block_size + 2 * window, guidance=True)
    state.cache.advance(model.config.block_size // 2)
    tokens = torch.randint(0, model.config.vocab_size, (1, window))
    return lambda: token_model.forward(state, tokens)


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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    tables = _Tables(args.vocab, g)
    rules = {name: RULES[name]().bind(tables) for name in args.rules}
    forward = verify_forward(args.window)
    n = args.window - 1
    cases = {}
    for top_k in args.top_k:
        p, q = (law.view(args.batch_size, n, args.vocab) for law in laws(args.batch_size * n, args.vocab, top_k, g))
        drafts = torch.multinomial(q.view(-1, args.vocab), 1, generator=g).view(args.batch_size, n)
        cases[top_k] = (p, q, drafts)
    seconds: dict = {"verify forward": []}
    runs = [("verify forward", forward)]
    for name, rule in rules.items():
        for top_k, c in cases.items():
            runs.append(((name, top_k, "call"), lambda rule=rule, c=c: rule(*c, torch.Generator().manual_seed(1))))
            if hasattr(rule, "_decide"):  # every draft scored as if accepted: the worst case on the CPU
                runs.append(((name, top_k, "all scored"), lambda rule=rule, c=c: score_all(rule, *c)))
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for key, run in runs:
            start = time.perf_counter()
            run()
            seconds.setdefault(key, []).append(time.perf_counter() - start)
    verify = statistics.median(seconds.pop("verify forward")[1:])
    rows = [{"rule": name, "top_k": top_k, "case": case, "ms": 1e3 * statistics.median(t[1:]), "ms_min": 1e3 * min(t[1:]),
             "ms_max": 1e3 * max(t[1:]), "vs_verify_forward": statistics.median(t[1:]) / verify}
            for (name, top_k, case), t in seconds.items()]
    result = {"window": args.window, "batch_size": args.batch_size, "vocab": args.vocab, "threads": args.threads,
              "verify_forward_ms": 1e3 * verify, "rules": rows}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
