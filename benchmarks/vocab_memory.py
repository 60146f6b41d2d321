"""Decoder-side memory at a text vocabulary: peak resident memory of one decode, per decoder.

A stand-in model returns random logits of the real shape (no weights, no cache), so what is
measured is the decoder's own working set: probabilities, laws, noise, samples. Each decoder
runs in a fresh process; the figure is the growth of peak RSS over the process after warm-up.

    python -m benchmarks.vocab_memory --vocab 151936 --batch 8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from mmgen.modeling import DecodeState
from mmgen.sampling import Logits, SamplingConfig


class RandomLogits:
    """A TokenModel whose logits are random (seeded by the forward count); it keeps no cache."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.calls = 0

    def _logits(self, batch, n):
        self.calls += 1
        g = torch.Generator().manual_seed(self.calls)
        return Logits(torch.randn(batch, n, self.vocab_size, generator=g) * 3)

    def start(self, conditions, capacity, guidance):
        return DecodeState(cache=None, batch_size=len(conditions), guidance=False, first_logits=self._logits(len(conditions), 1))

    def forward(self, state, tokens):
        return self._logits(*tokens.shape)

    def commit(self, state, accepted):
        pass

    def rewind(self, state, n):
        pass


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(decoding: str, vocab: int, batch: int, tokens: int) -> dict:
    from mmgen.decoding import resolve_decoder

    decoder = resolve_decoder(decoding)
    model = RandomLogits(vocab)
    conditions = torch.zeros(batch, dtype=torch.long)
    sampling = SamplingConfig(temperature=1.0)
    # Warm-up: the model's own logits (what any decoder must hold) and the allocator's pools.
    Autoregressive = resolve_decoder("ar")
    Autoregressive.generate(model, conditions, 4, sampling, torch.Generator().manual_seed(0))
    model._logits(batch, decoder.window)
    base = peak_mib()
    out = decoder.generate(model, conditions, tokens, sampling, torch.Generator().manual_seed(0))
    logits_mib = batch * decoder.window * vocab * 4 / 2**20
    return {"decoding": decoding, "vocab": vocab, "batch": batch, "window": decoder.window,
            "decoder_peak_mib": round(peak_mib() - base, 1), "logits_mib": round(logits_mib, 1),
            "forwards": out.stats.forwards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--decoding", nargs="*", default=["ar", "sjd", "sjd-coupled", "lookup"])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        torch.set_num_threads(1)
        print(json.dumps(measure(args.one, args.vocab, args.batch, args.tokens)))
        return
    for decoding in args.decoding:
        cmd = [sys.executable, "-m", "benchmarks.vocab_memory", "--one", decoding, "--vocab", str(args.vocab),
               "--batch", str(args.batch), "--tokens", str(args.tokens)]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
