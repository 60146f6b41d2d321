"""How many drafts each forward verifies, chosen from the tokens each forward has finalised.

A speculative forward over d drafts costs more than an autoregressive step and pays back only
in accepted drafts. Where drafts are rarely accepted (an untrained or mismatched model, a
hard prompt) a fixed window is slower than plain decoding; where acceptance is middling, a
window narrower than the decoder's may pay best. `AdaptiveWindow` picks each forward's draft
count from a ladder (0, 1, 3, 7, 15, ...: windows of 1, 2, 4, 8, 16) by the tokens per unit of
cost it has measured there, falls back to autoregressive steps (0 drafts) when drafting pays
less than they do, and probes a neighbouring width now and then so a decode can move back.
The choice depends only on what earlier forwards finalised, never on the current draws, so
every rule stays exactly as lossless as with a fixed window (tested).

Why measured, not modelled: Jacobi decoding's acceptance is not geometric in the window.
After a forward that accepts its whole window, the next has no carried drafts and accepts
little, so tokens per forward grow about linearly with the window where a per-draft rate
model predicts saturation (and would narrow the window step after step). Dynamic draft
lengths in the same spirit: SpecDec++ (Huang et al. 2024, arXiv 2405.19715); the cost
argument is Leviathan et al. 2023 (arXiv 2211.17192), Section 3.3.

Cost of a forward over d drafts, in autoregressive steps: 1 + d * beta, beta = rho R / (1 + rho R)
for R rows fed (both halves of a guided batch), where `token_cost` rho is one fed token's
compute relative to one pass over the weights (a small step is a per-weight part plus a
per-token part). An autoregressive step is worth exactly 1 token per unit, which is what the
fallback compares against.

A linear cost misses what small models show on a CPU: a forward of two tokens per row can cost
20-30% more than one (the BLAS leaves its matrix-vector kernels), and a few tokens can cost less
than one (LlamaGen emoji64: 0.96x at 2 and 4 tokens). A model can carry its measured curve, a
`window_cost` (window width -> forward time relative to width 1, per device type and CPU thread
count, measured at batch 1 by `benchmarks/window_cost.py`); batch-1 decodes there use it instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

#: Default `token_cost` by device type. CPU: measured by `benchmarks/adaptive_window.py` on
#: this project's 2-core box, 1 thread, CFG: 0.02 for the bundled emoji64 (a 16-token verify
#: at 1.6x an AR step), 0.03-0.05 for GPT-B (1.9-2.4x); the smaller figure keeps every good case
#: and still falls back where nothing is accepted. CUDA: a 16-token verify within a few percent
#: of an AR step at batch 1 (memory-bound). Pass a measured figure for your model and machine
#: (`adapt=0.05` in a spec, or `AdaptiveWindow(token_cost=...)`).
TOKEN_COST = {"cpu": 0.02, "cuda": 0.002}

#: A model's measured forward costs by device type ("cuda", "cpu", or "cpu:N" for N torch threads,
#: which the CPU's curve depends on): window width (tokens per row per forward) -> forward time
#: relative to width 1, at batch 1 with the model's own guidance.
WindowCost = Mapping[str, Mapping[int, float]]


@dataclass(frozen=True)
class AdaptiveWindow:
    """Per-forward draft count for a speculative decoder (see the module docstring).

    `token_cost`: rho above, None for the device's default (`TOKEN_COST`). `widths`: the draft
    counts it may choose (None: 0, 1, 3, 7, ... up to the decoder's own, so a compiled step
    meets few shapes). `start_cost`: it starts at the widest width whose forward costs at most
    this many AR steps with nothing accepted (the first forwards are all a short decode has: a
    4-token answer never amortises a 16-token window), and grows one width each time a forward
    finalises at least half of its drafts, until the widest or until a width does not pay (on a
    GPU, where a draft costs next to nothing, it starts at the widest; where one draft costs
    more, it starts with autoregressive steps and probes a 2-token window after `dwell`).
    `dwell`: forwards measured before a width is judged (Jacobi's first forwards have no
    carried drafts, and its gains come in bursts).
    `probe_every`: forwards at the chosen width before a probe of a neighbouring width (the
    wait doubles after each probe that did not pay).
    `decay`: weight of older forwards in a width's running figure. A width that pays less than
    autoregressive steps gives way to the next narrower one, or straight to autoregressive
    steps when it finalised fewer than 1 + `barren` tokens per forward. Worst case (nothing
    accepted): `dwell` forwards at the starting width (at most `start_cost` AR steps each), then
    `dwell`-forward probes of a 2-token window after 32, 64, 128, ... autoregressive steps.
    """

    token_cost: Optional[float] = None
    widths: Optional[tuple[int, ...]] = None
    start_cost: float = 1.1
    dwell: int = 6
    probe_every: int = 32
    decay: float = 0.95
    barren: float = 0.1

    def __post_init__(self):
        if self.token_cost is not None and not (math.isfinite(self.token_cost) and self.token_cost >= 0):
            raise ValueError(f"token_cost must be a finite number >= 0, got {self.token_cost!r}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")
        if not (math.isfinite(self.barren) and self.barren >= 0):
            raise ValueError(f"barren must be a finite number >= 0, got {self.barren!r}")
        if not (math.isfinite(self.start_cost) and self.start_cost >= 1):
            raise ValueError(f"start_cost must be a number >= 1 (AR steps), got {self.start_cost!r}")
        for name in ("dwell", "probe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.widths is not None and (not self.widths or any(int(w) != w or w < 0 for w in self.widths)):
            raise ValueError(f"widths must be draft counts >= 0, got {self.widths!r}")

    def start(self, max_draft: int, rows_fed: int, device, window_cost: Optional[WindowCost] = None) -> "WindowChooser":
        """The chooser of one decode: at most `max_draft` drafts, `rows_fed` rows per forward
        (2 x batch with guidance). `window_cost`: the model's measured curve, for a batch-1
        decode (None otherwise); it applies on its device type unless `token_cost` is set."""
        widths = self.widths if self.widths is not None else _powers(max_draft)
        widths = sorted({min(int(w), max_draft) for w in widths} | {0})
        kind = torch.device(device).type
        curve = measured_curve(window_cost, kind) if self.token_cost is None else None
        if curve is not None:
            return WindowChooser(self, widths, [interpolate_cost(curve, d + 1) for d in widths])
        rho = self.token_cost if self.token_cost is not None else TOKEN_COST.get(kind, TOKEN_COST["cuda"])
        beta = draft_cost(rho, rows_fed)
        return WindowChooser(self, widths, [1 + beta * d for d in widths])


def draft_cost(token_cost: float, rows_fed: int) -> float:
    """beta: what each draft adds to a forward, in AR steps, for `rows_fed` rows per forward."""
    return token_cost * rows_fed / (1 + token_cost * rows_fed)


def window_cost_key(kind: str) -> str:
    """The `window_cost` key of a curve measured now on this device type: a CPU's curve depends
    on torch's thread count ("cpu:2")."""
    return f"cpu:{torch.get_num_threads()}" if kind == "cpu" else kind


def measured_curve(window_cost: Optional[WindowCost], kind: str) -> Optional[Mapping[int, float]]:
    """The curve of `window_cost` for this device type (on a CPU the one measured at torch's
    thread count, else a "cpu" one); None without one."""
    window_cost = window_cost or {}
    return window_cost.get(window_cost_key(kind), window_cost.get(kind))


def interpolate_cost(curve: Mapping[int, float], width: int) -> float:
    """A forward's cost at `width` tokens per row, in AR steps, from a measured curve: linear
    between its widths, along its last segment beyond them."""
    points = sorted(curve.items())
    if len(points) == 1:  # width 1 alone: every width costs one step
        return 1.0
    for (w0, c0), (w1, c1) in zip(points, points[1:]):
        if width <= w1:
            break  # else it ends on the last segment, which extends past the last width
    return (c0 + (c1 - c0) * (width - w0) / (w1 - w0)) / curve[1]


def parse_window_cost(raw: Any, source: str) -> Optional[dict[str, dict[int, float]]]:
    """A `window_cost` read from a model's config (JSON: string keys), checked; None for None.
    ValueError (one line, naming `source`) for anything but device type -> {width: cost} with
    width 1 among the widths and every cost a positive number."""
    if raw is None:
        return None
    problem = ValueError(f"{source}: window cost must map device types to {{window width: relative cost}} with width 1, got {raw!r}")
    if not isinstance(raw, Mapping) or not raw:
        raise problem
    parsed = {}
    for kind, curve in raw.items():
        try:
            parsed[str(kind)] = {int(w): float(c) for w, c in curve.items()}
        except (AttributeError, TypeError, ValueError):
            raise problem from None
        values = parsed[str(kind)]
        if 1 not in values or any(w < 1 for w in values) or not all(math.isfinite(c) and c > 0 for c in values.values()):
            raise problem
    return parsed


#: The key of a transformers model's config that carries its `window_cost` (transformers keeps
#: unknown keys through `from_pretrained` / `save_pretrained`).
WINDOW_COST_KEY = "mmgen_window_cost"


def model_window_cost(model: Any) -> Optional[dict[str, dict[int, float]]]:
    """The `window_cost` a transformers model's config carries under `WINDOW_COST_KEY`, checked
    (None without one)."""
    return parse_window_cost(getattr(model.config, WINDOW_COST_KEY, None), f"{type(model).__name__} config {WINDOW_COST_KEY}")


def _powers(max_draft: int) -> list[int]:
    widths, w = [0], 1
    while w < max_draft:
        widths.append(w)
        w = 2 * w + 1
    return widths + [max_draft]


class WindowChooser:
    """One decode's figures and choices: `choose()` before a forward, `observe(tokens)` after it
    with the mean tokens each active row finalised. Levels index `widths`; level 0 is
    autoregressive, worth 1 token per unit of cost by definition. A width's figure is a ratio
    of decayed sums (tokens over cost): Jacobi's gains come in bursts (a run of 1-token
    forwards, then 13 tokens at once), which a ratio over ~20 forwards weighs right."""

    def __init__(self, policy: AdaptiveWindow, widths: list[int], cost: list[float]):
        self.policy, self.widths, self.cost = policy, widths, cost
        # The width decoding runs at: it starts at the widest one within `start_cost` and grows
        # while forwards accept half their drafts (`growing`). Where even one draft costs more,
        # it starts with autoregressive steps and probes one draft after `dwell` of them.
        self.home = [level for level, c in enumerate(cost) if c <= policy.start_cost][-1]
        self.growing = self.home < len(widths) - 1
        self.level = self.home  # this forward's
        self.sums, self.forwards, self.measured = [0.0, 0.0], 0.0, 0  # decayed (tokens, cost, forwards) at home
        self.trial: Optional[list] = None  # [level, forwards left, tokens, cost] while probing
        self.interval = policy.probe_every  # doubles after each probe that did not pay
        self.since_probe, self.upward = (self.interval - policy.dwell if self.home == 0 else 0), False
        self.chosen: list[int] = []

    def value(self) -> float:
        """Tokens per unit of cost at home (1.0 for autoregressive steps)."""
        return 1.0 if self.home == 0 else self.sums[0] / max(self.sums[1], 1e-9)

    def choose(self) -> int:
        if self.trial is None and self.since_probe >= self.interval and len(self.widths) > 1:
            down, up = self.home - 1, self.home + 1
            self.upward = (not self.upward or down < 0) and up < len(self.widths)
            self.trial = [up if self.upward else down, self.policy.dwell, 0.0, 0.0]
        self.level = self.trial[0] if self.trial is not None else self.home
        self.chosen.append(self.widths[self.level])
        return self.chosen[-1]

    @property
    def measuring(self) -> bool:
        """Whether `observe` reads the tokens of this forward: not while it runs autoregressive
        steps between probes, which it only counts (the loop then skips that host read)."""
        return self.trial is not None or self.home != 0

    def observe(self, tokens: Optional[float]) -> None:
        """After a forward: the mean tokens each active row finalised (None where not
        `measuring`)."""
        cost = self.cost[self.level]
        if self.trial is not None:  # a probe, judged once it has run `dwell` forwards
            self.trial[1:] = [self.trial[1] - 1, self.trial[2] + tokens, self.trial[3] + cost]
            if self.trial[1] == 0:
                level, tokens_sum, cost_sum = self.trial[0], self.trial[2], self.trial[3]
                self.trial, self.since_probe = None, 0
                if tokens_sum / cost_sum > self.value():
                    self.home, self.sums, self.forwards, self.measured = level, [tokens_sum, cost_sum], float(self.policy.dwell), self.policy.dwell
                    self.interval = self.policy.probe_every
                else:
                    self.interval *= 2
            return
        self.since_probe += 1
        if self.home == 0:
            return
        if self.growing and tokens >= 1 + self.widths[self.home] / 2:  # half the drafts passed: widen
            self.home += 1
            self.growing = self.home < len(self.widths) - 1
            self.sums, self.forwards, self.measured, self.since_probe = [0.0, 0.0], 0.0, 0, 0
            return
        keep = self.policy.decay
        self.sums = [keep * self.sums[0] + tokens, keep * self.sums[1] + cost]
        self.forwards = keep * self.forwards + 1
        self.measured += 1
        if self.measured >= self.policy.dwell and self.value() < 1.0:
            # Drafting pays less than plain steps here: with next to nothing accepted, fall back
            # to them at once; otherwise try the next narrower window first.
            barren = self.sums[0] / self.forwards < 1 + self.policy.barren
            self.home = 0 if barren else self.home - 1
            self.growing = False
            self.sums, self.forwards, self.measured, self.since_probe = [0.0, 0.0], 0.0, 0, 0


def resolve_adaptive(adapt) -> Optional[AdaptiveWindow]:
    """A decoder's `adapt` option: False / None (fixed window), True (the defaults), a number
    (the `token_cost`) or an `AdaptiveWindow`."""
    if adapt is None or adapt is False:
        return None
    if adapt is True:
        return AdaptiveWindow()
    if isinstance(adapt, AdaptiveWindow):
        return adapt
    if isinstance(adapt, float):  # an int (adapt=0, adapt=1) would read as off / on: refused below
        return AdaptiveWindow(token_cost=adapt)
    raise ValueError(f"adapt must be true, false, a token cost (a decimal number such as 0.05) or an AdaptiveWindow, got {adapt!r}")
