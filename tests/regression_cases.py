"""The decode regression fixture: every bundled model under every decoder that applies to it.

Recorded once before the decoding core was reshaped (issue 13) and kept: the core may change
shape, never what it generates. `python -m tests.regression_cases` rewrites
`tests/fixtures/decode_regression.{safetensors,json}`; `tests/core/test_regression.py` replays
every case and compares tokens (VAR: all token maps; MAR: latents) and the forward counts.
A deliberate change of a decoder's output re-records only that decoder's cases
(`python -m tests.regression_cases DECODING...`) and says why in the commit. A renamed decoder
renames its cases' keys only (CoDe's `code` / `draft_steps` became `collaborative` /
`large_steps`, same tensors).

Jacobi and lookup decoders adapt their window by default since issue 17; their cases here run
with `adapt=False`, the fixed window they pinned before (the adaptive window's own tests show
it lossless for any sequence of widths, tests/core/test_adaptive_window.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

FIXTURE = Path(__file__).parent / "fixtures" / "decode_regression"
ASSETS = Path(__file__).parents[1] / "image_ar" / "assets"


@dataclass(frozen=True)
class Case:
    model: str
    decoding: str  # a CLI spec
    labels: tuple[int, ...]
    guided: bool
    seed: int
    companion: Optional[str] = None  # the second model of two-model decoders
    temperature: Optional[float] = None

    @property
    def name(self) -> str:
        cfg = "cfg" if self.guided else "nocfg"
        temp = "" if self.temperature is None else f"-t{self.temperature:g}"
        return f"{self.model}|{self.decoding}|b{len(self.labels)}|{cfg}{temp}|s{self.seed}"


TOKEN_DECODERS = ["ar", "sjd", "sjd-8", "sjd:draft_init=left", "sjd:draft_init=above", "sjd-coupled", "gsd", "lantern",
                  "lantern++"]
BATCHES = [(7,), (0, 7, 8)]


def cases() -> list[Case]:
    out = []
    for batch in BATCHES:
        for guided in (True, False):
            seed = len(batch) + 10 * guided
            for model in ("emoji64", "emoji64-draft"):
                out += [Case(model, d, batch, guided, seed) for d in TOKEN_DECODERS]
            out += [Case("emoji64", "draft", batch, guided, seed, "emoji64-draft"),
                    Case("emoji64", "entropy-switch", batch, guided, seed, "emoji64-draft"),
                    Case("emoji64", "entropy-switch:threshold=0.5", batch, guided, seed, "emoji64-draft")]
            for model in ("var-emoji64", "var-emoji64-small"):
                out.append(Case(model, "ar", batch, guided, seed))
            out += [Case("var-emoji64", "collaborative", batch, guided, seed, "var-emoji64-small"),
                    Case("var-emoji64", "collaborative:large_steps=3", batch, guided, seed, "var-emoji64-small"),
                    Case("var-emoji64", "ar+prune", batch, guided, seed)]
            for model in ("mar-emoji64", "mar-emoji64-draft"):
                out.append(Case(model, "ar", batch, guided, seed))
            out.append(Case("mar-emoji64", "cspd", batch, guided, seed, "mar-emoji64-draft"))
    # Greedy decoding, where every lossless decoder must equal "ar" token for token.
    for d in ("ar", "sjd", "sjd-coupled", "draft"):
        out.append(Case("emoji64", d, (0, 7, 8), True, 5, "emoji64-draft" if d == "draft" else None, temperature=0.0))
    return out


_PIPES: dict = {}


def pipeline(name: str):
    if name not in _PIPES:
        from mmgen.image_ar.llamagen import LlamaGenPipeline
        from mmgen.image_ar.mar import MARPipeline
        from mmgen.image_ar.var import VARPipeline

        cls = VARPipeline if name.startswith("var") else MARPipeline if name.startswith("mar") else LlamaGenPipeline
        pipe = cls.from_pretrained(ASSETS / name)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[name] = pipe
    return _PIPES[name]


def run(case: Case) -> tuple[torch.Tensor, dict]:
    """(tokens, {forwards, histogram}) of one case."""
    from mmgen.decoding import CONTINUOUS_DECODERS, DECODERS, SCALE_DECODERS, make_decoder, parse_decoding
    from mmgen.decoding.pruning import CachedTokenPruning

    pipe = pipeline(case.model)
    family = "var" if case.model.startswith("var") else "mar" if case.model.startswith("mar") else "llamagen"
    spec, prune = (case.decoding[: -len("+prune")], True) if case.decoding.endswith("+prune") else (case.decoding, False)
    name, options = parse_decoding(spec)
    if case.companion is not None:
        role = {"draft": "drafter", "cspd": "drafter", "entropy-switch": "small", "collaborative": "small"}[name]
        options[role] = pipeline(case.companion)
    registry = {"llamagen": DECODERS, "var": SCALE_DECODERS, "mar": CONTINUOUS_DECODERS}[family]
    decoder = make_decoder(name, registry, **options)
    if hasattr(decoder, "adapt") and "adapt" not in options:
        decoder = replace(decoder, adapt=False)
    kwargs = dict(generator=torch.Generator().manual_seed(case.seed), output_type="pt")
    if family == "llamagen":
        kwargs["guidance_scale"] = None if case.guided else 1.0
        kwargs["temperature"] = case.temperature
    elif family == "var":
        kwargs["guidance_scale"] = None if case.guided else 0.0
        if prune:
            kwargs["pruning"] = CachedTokenPruning(keep={-1: 0.5})
    else:
        kwargs["guidance_scale"] = None if case.guided else 1.0
        kwargs["num_iter"] = pipe.sampling_defaults["num_iter"]
    out = pipe(list(case.labels), decoding=decoder, **kwargs)
    return out.tokens, {"forwards": out.stats.forwards, "histogram": out.stats.accepted_histogram}


def record(only: Optional[list[str]] = None) -> None:
    """Run the cases and (re)write the fixture; `only` re-records the cases of those decodings."""
    old_tokens = load_file(str(FIXTURE.with_suffix(".safetensors"))) if only else {}
    old_meta = json.loads(FIXTURE.with_suffix(".json").read_text()) if only else {}
    tokens, meta = dict(old_tokens), dict(old_meta)
    for case in cases():
        if only and case.decoding not in only:
            continue
        t, m = run(case)
        tokens[case.name] = t.contiguous()
        meta[case.name] = m
        print(case.name, m["forwards"], flush=True)
    save_file(tokens, str(FIXTURE.with_suffix(".safetensors")))
    FIXTURE.with_suffix(".json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    record(sys.argv[1:] or None)
