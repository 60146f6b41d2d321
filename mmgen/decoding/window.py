"""How many drafts each forward verifies, chosen from the tokens each forward has finalised.

A speculative forward over d drafts costs more than an autoregressive step and pays back only
in accepted drafts. Where drafts are rarely accepted (an untrained or mismatched model, a
hard prompt) a fixed window is slower than plain decoding; where acceptance is middling, a
window narrower than the decoder's may pay best. `AdaptiveWindow` picks each forward's draft
count from a ladder (0, 1, 3, 7, 15, ...: windows of 1, 2, 4, 8, 16) by the tokens per unit of
cost it has measured there, falls back to autoregressive steps (0 drafts) when drafting pays
less than they do, and probes a neighbouring width now and then so a decode can move back.
It widens as fast as the evidence allows: a forward that accepts its whole window shows the
window, not the model, held it back, and the window jumps to the widest at once. Acceptance
comes in phases within one decode (a barren stretch, then a run the model repeats, where
every draft passes), so from autoregressive steps it probes one draft often, at a bounded
share of their cost, and follows a phase change within a few forwards.
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

A linear cost misses what models show on a CPU: a forward of two tokens per row can cost
10-60% more than one (the BLAS leaves its matrix-vector kernels), and a few tokens can cost less
than one (LlamaGen emoji64 on another box: 0.96x at 2 and 4 tokens). A model can carry its
measured curve, a `window_cost` (window width -> forward time relative to width 1, per device
type and CPU thread count, measured at batch 1 by `mmgen calibrate`); batch-1 decodes
there use it instead. A curve is its machine's: CPUs differ several-fold in what a few more
tokens per forward cost. A batch-1 decode on a CPU whose model carries no CPU curve uses
`DEFAULT_WINDOW_COST` (GPT-B's, measured): a dear default costs a good case a few probes, a
cheap one costs a barren decode every forward.

What a model usually accepts is a fact of the model, not of the machine: a model can carry its
`window_tokens` (window width -> tokens a forward finalises, measured in fixed-window decodes at
batch 1 with its own sampling, by `mmgen calibrate`). A decode then starts at the
width those figures and the cost say pays best, and each width's running figure starts from
them, worth `prior_forwards` forwards (an empirical-Bayes prior that the decode's own forwards
overrule as they come): a short decode (an image of 64 tokens, an answer of 10) has too few
forwards to find its width from scratch, and a handful of barren forwards is no reason to leave
the width that pays on average.

A row of a continuous batch chooses its own width (each request must decode what it decodes
alone), but a padded forward is as wide as its widest row: a row that widens alone widens every
row's forward. So such a row (`batch_rows` = B > 1) is charged what its width costs the batch,
counted in its own share of an AR step (1 / B of the batch's): 1 + B * beta_B * d, beta_B for the
B rows' feed. Where that exceeds the tokens a width could finalise even if every draft passed
(1 + d > cost for no width: B * beta_B >= 1, a compute-bound CPU at batch 8 with guidance), no
draft can pay and the row runs autoregressive steps without probing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch

#: Default `token_cost` by device type, for the linear cost (batches, and devices without a
#: default curve). CPU: measured on this project's 2-core box (docs/history.md, "Decoding"),
#: 1 thread, CFG: 0.02 for the bundled emoji64 (a 16-token verify at 1.6x an AR step), 0.03-0.05
#: for GPT-B (1.9-2.4x). CUDA: a 16-token verify within a few percent of an AR step at batch 1
#: (memory-bound). Pass a measured figure for your model and machine (`adapt=0.05` in a spec, or
#: `AdaptiveWindow(token_cost=...)`).
TOKEN_COST = {"cpu": 0.02, "cuda": 0.002}

#: A model's measured tokens per forward by window width (tokens per row per forward -> mean
#: tokens a forward finalises per row, at batch 1 with the model's own sampling): what its
#: drafts usually earn, whatever the machine.
WindowTokens = Mapping[int, float]

#: A model's measured forward costs by device type ("cuda", "cpu", or "cpu:N" for N torch threads,
#: which the CPU's curve depends on): window width (tokens per row per forward) -> forward time
#: relative to width 1, at batch 1 with the model's own guidance.
WindowCost = Mapping[str, Mapping[int, float]]

#: The curve a batch-1 decode uses on a device type its model carries none for: LlamaGen GPT-B
#: (random weights, CFG 4: two rows fed), measured on this project's 2-core box in whole decodes
#: of 128 tokens where nothing is accepted, at 1 and 2 threads (2026-11-28). On a CPU a second
#: token per row costs far more than any per-token figure says (1.5-1.6 AR steps here: the BLAS leaves its matrix-vector kernels), and
#: a linear default that misses it drafts where nothing is accepted (GPT-B: 1.31x AR's time).
#: Other thread counts take the two-thread curve. Models measure their own (`mmgen calibrate`).
_GPT_B_TWO_THREADS = {1: 1.0, 2: 1.48, 4: 1.90, 8: 1.92, 16: 2.38}
DEFAULT_WINDOW_COST: WindowCost = {
    "cpu:1": {1: 1.0, 2: 1.61, 4: 2.12, 8: 2.07, 16: 2.51},
    "cpu:2": _GPT_B_TWO_THREADS,
    "cpu": _GPT_B_TWO_THREADS,
}


@dataclass(frozen=True)
class AdaptiveWindow:
    """Per-forward draft count for a speculative decoder (see the module docstring).

    `token_cost`: rho above, None for the device's default (`TOKEN_COST`). `widths`: the draft
    counts it may choose (None: 0, 1, 3, 7, ... up to the decoder's own, so a compiled step
    meets few shapes). `start_cost`: it starts at the widest width whose forward costs at most
    this many AR steps with nothing accepted (the first forwards are all a short decode has: a
    4-token answer never amortises a 16-token window; where even one draft costs more, it
    starts with autoregressive steps).

    Widening follows the evidence: while it grows, a forward that finalises at least half of
    its drafts widens the window one width, and one that accepts all of them (the window, not
    the model, limited it) widens it `jump` widths at once; if the first two judged forwards
    after a jump are barren, it was luck, and the window goes back, still growing but one width
    at a time for the rest of the decode (the lucky forward says nothing against the next width;
    a second jump would likely be as lucky). The first forward after a widening holds fresh
    drafts in its new slots and is not judged (`warmup`). After `dwell` judged
    forwards a width that pays less than autoregressive steps gives way to the next narrower
    one, or straight to autoregressive steps when it finalised fewer than 1 + `barren` tokens
    per forward (a barren first width of one draft first gets one try of the next width: a
    Jacobi window of two holds one stale draft, where wider ones converge over iterations; and
    once drafts have paid in the decode, a barren width above one draft only steps one width
    down, still growing: such a stretch often passes, and one-draft probes are slow to notice); it
    also gives way to the next narrower one when that one, cut to its own width
    in the same forwards, would have paid more than 1 + `margin` times as much (the estimate
    flatters narrow Jacobi windows, whose deeper drafts the wide one refined: hence the margin).
    A width that pays is probed against its neighbours every `probe_every`
    forwards (`dwell` forwards each; the wait doubles after each probe that did not pay); a
    probe that pays moves there, and one upwards resumes growing.

    Acceptance comes in phases (a decode's barren stretch, then a run the model repeats), so
    autoregressive steps probe one draft often: `probe_len` forwards each time `probe_len`
    forwards' worth of one draft's extra cost adds up to `probe_cost` of the AR steps between
    (with nothing accepted, the probes cost about that fraction; every 8 steps at one draft =
    1.074 AR steps). The probe's first forward verifies a fresh draft and is not judged; an
    accepted draft after it that beats AR steps starts the growth. A decode
    that starts with AR steps probes first once the probe's extra cost is at most
    `first_probe_cost` of the steps before it, and after `dwell` steps at the latest: soon where
    a draft is cheap (a batch of rows, where one draft already costs more than `start_cost`), late
    enough where it is dear that a short answer ends first; at once where nothing can end the
    decode early (no stop tokens: an image) and the probe's extra cost is at most
    `first_probe_cost` of its length. Where the model's `window_tokens`
    chose AR steps, the first probe keeps the `probe_cost` pace too (emoji-vlm's answers of about
    20 tokens: two probes each became one).
    `decay`: weight of older forwards in a width's running figure.

    With the model's `window_tokens` (see the module docstring) it starts at the width whose
    measured tokens per unit of cost are highest (autoregressive steps where none beats 1), not
    growing: its probes look both ways from there. Every width's running figure starts as
    `prior_forwards` forwards at the measured figure, which then decays like any forward's (0
    turns it off). 24: on emoji64 and speech-tts (lab notes in the git history of docs/benchmarks.md) 12 left 1.02-1.05x the
    best fixed window's cost, 24 1.01-1.02x, 48 1.01x; a stronger prior leaves a barren decode
    later (24 forwards at emoji64's 4-token figure take about ten barren ones to overrule, by the
    arithmetic of the decayed sums).

    `batch_rows`: the rows of the continuous batch this decode is one row of (see the module
    docstring); None for a decode of its own, or the batch size where `continuous_decode` runs it.
    A request decodes the same tokens as a batch-1 decode with the same `batch_rows` (under
    greedy decoding, the same as any window). Where no width can pay such a row, it decodes
    autoregressively (`never_drafts`). A static batch shares one width and refuses it.
    """

    token_cost: Optional[float] = None
    widths: Optional[tuple[int, ...]] = None
    start_cost: float = 1.1
    dwell: int = 6
    probe_every: int = 32
    decay: float = 0.95
    barren: float = 0.1
    jump: int = 3
    warmup: int = 1
    probe_len: int = 2
    probe_cost: float = 0.02
    first_probe_cost: float = 0.1
    margin: float = 0.15
    prior_forwards: float = 24.0
    batch_rows: Optional[int] = None

    def __post_init__(self):
        if self.token_cost is not None and not (math.isfinite(self.token_cost) and self.token_cost >= 0):
            raise ValueError(f"token_cost must be a finite number >= 0, got {self.token_cost!r}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")
        if not (math.isfinite(self.barren) and self.barren >= 0):
            raise ValueError(f"barren must be a finite number >= 0, got {self.barren!r}")
        if not (math.isfinite(self.start_cost) and self.start_cost >= 1):
            raise ValueError(f"start_cost must be a number >= 1 (AR steps), got {self.start_cost!r}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"margin must be a finite number >= 0, got {self.margin!r}")
        if not (math.isfinite(self.prior_forwards) and self.prior_forwards >= 0):
            raise ValueError(f"prior_forwards must be a finite number >= 0, got {self.prior_forwards!r}")
        for name in ("probe_cost", "first_probe_cost"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a fraction > 0 of the AR steps, got {value!r}")
        for name, least in (("dwell", 1), ("probe_every", 1), ("jump", 1), ("warmup", 0), ("probe_len", 1), ("batch_rows", 1)):
            value = getattr(self, name)
            if name == "batch_rows" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.widths is not None and (not self.widths or any(int(w) != w or w < 0 for w in self.widths)):
            raise ValueError(f"widths must be draft counts >= 0, got {self.widths!r}")

    def start(self, max_draft: int, rows_fed: int, device, window_cost: Optional[WindowCost] = None,
              window_tokens: Optional[WindowTokens] = None, length: Optional[int] = None) -> "WindowChooser":
        """The chooser of one decode: at most `max_draft` drafts, `rows_fed` rows per forward
        (2 x batch with guidance; for a row of a continuous batch, that row's: 2 or 1).
        `window_cost`: the model's measured curves, for a batch-1 decode (None otherwise; the
        loop adds `DEFAULT_WINDOW_COST`'s, `with_default_curves`); a curve applies on its device
        type unless `token_cost` is set, and not to a row of a batch.
        `window_tokens`: the model's measured tokens per forward (any batch: a row accepts what
        it accepts alone). `length`: the tokens the decode will finalise when nothing can end it
        sooner (no stop tokens), else None."""
        widths = self.widths if self.widths is not None else _powers(max_draft)
        widths = sorted({min(int(w), max_draft) for w in widths} | {0})
        prior = None
        if window_tokens and self.prior_forwards:
            # Width 1 finalises one token. Beyond the widest measured width, the widest's figure:
            # Jacobi's tokens per forward flatten as the window grows (emoji64: 1.69 at 8, 1.81
            # at 16), and a wider window a decode was never measured at must not look better.
            points, widest = {1: 1.0, **window_tokens}, max(window_tokens)
            prior = [min(1.0 + d, max(1.0, interpolate_width(points, min(d + 1, widest)))) for d in widths]
        kind = torch.device(device).type
        rows = self.batch_rows or 1
        curve = measured_curve(window_cost, kind) if self.token_cost is None and rows == 1 else None
        if curve is not None:
            return WindowChooser(self, widths, [interpolate_cost(curve, d + 1) for d in widths], prior, length)
        rho = self.token_cost if self.token_cost is not None else TOKEN_COST.get(kind, TOKEN_COST["cuda"])
        beta = rows * draft_cost(rho, rows_fed * rows)  # in this row's share of the batch's AR step
        return WindowChooser(self, widths, [1 + beta * d for d in widths], prior, length)

    def never_drafts(self, max_draft: int, device) -> bool:
        """Whether a row of a batch (`batch_rows` set) would never draft: it starts with AR steps
        and no width pays even with every draft accepted, at its cheapest (one row fed, without
        guidance; the linear cost only grows with the rows fed). The loop then runs plain AR
        steps. False without `batch_rows`: a decode of its own keeps its probes."""
        if self.batch_rows is None:
            return False
        chooser = self.start(max_draft, 1, device)  # a subclass's chooser may not say: then it may draft
        return getattr(chooser, "home", None) == 0 and not getattr(chooser, "can_pay", True)


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


def with_default_curves(window_cost: Optional[WindowCost]) -> WindowCost:
    """A model's measured curves, and `DEFAULT_WINDOW_COST`'s for each device type it carries none
    for (a model measured at one CPU thread count keeps the linear cost at another, as before)."""
    own = dict(window_cost or {})
    kinds = {kind.split(":")[0] for kind in own}
    return {**{kind: curve for kind, curve in DEFAULT_WINDOW_COST.items() if kind.split(":")[0] not in kinds}, **own}


def interpolate_width(figures: Mapping[int, float], width: int) -> float:
    """A figure measured at some window widths, at `width`: linear between them, along the last
    segment beyond them; a single width's figure everywhere."""
    points = sorted(figures.items())
    if len(points) == 1:
        return points[0][1]
    for (w0, f0), (w1, f1) in zip(points, points[1:]):
        if width <= w1:
            break  # else it ends on the last segment, which extends past the last width
    return f0 + (f1 - f0) * (width - w0) / (w1 - w0)


def interpolate_cost(curve: Mapping[int, float], width: int) -> float:
    """A forward's cost at `width` tokens per row, in AR steps, from a measured curve (relative
    to its width 1)."""
    return interpolate_width(curve, width) / curve[1]


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


def parse_window_tokens(raw: Any, source: str) -> Optional[dict[int, float]]:
    """A `window_tokens` read from a model's config (JSON: string keys), checked; None for None.
    ValueError (one line, naming `source`) for anything but {window width >= 2: tokens per
    forward} with each figure between 1 and the width."""
    if raw is None:
        return None
    problem = ValueError(f"{source}: window tokens must map window widths >= 2 to the tokens a forward finalises "
                         f"(1 to the width), got {raw!r}")
    try:
        parsed = {int(w): float(t) for w, t in raw.items()}
    except (AttributeError, TypeError, ValueError):
        raise problem from None
    if not parsed or any(w < 2 or not (math.isfinite(t) and 1 <= t <= w) for w, t in parsed.items()):
        raise problem
    return parsed


#: The keys of a transformers model's config that carry its `window_cost` and `window_tokens`
#: (transformers keeps unknown keys through `from_pretrained` / `save_pretrained`).
WINDOW_COST_KEY = "mmgen_window_cost"
WINDOW_TOKENS_KEY = "mmgen_window_tokens"


def model_window_cost(model: Any) -> Optional[dict[str, dict[int, float]]]:
    """The `window_cost` a transformers model's config carries under `WINDOW_COST_KEY`, checked
    (None without one)."""
    return parse_window_cost(getattr(model.config, WINDOW_COST_KEY, None), f"{type(model).__name__} config {WINDOW_COST_KEY}")


def model_window_tokens(model: Any) -> Optional[dict[int, float]]:
    """The `window_tokens` a transformers model's config carries under `WINDOW_TOKENS_KEY`,
    checked (None without them)."""
    return parse_window_tokens(getattr(model.config, WINDOW_TOKENS_KEY, None), f"{type(model).__name__} config {WINDOW_TOKENS_KEY}")


def _powers(max_draft: int) -> list[int]:
    widths, w = [0], 1
    while w < max_draft:
        widths.append(w)
        w = 2 * w + 1
    return widths + [max_draft]


class WindowChooser:
    """One decode's figures and choices: `choose()` before a forward, `observe(tokens)` after it
    with the mean tokens each active row finalised (None while not `measuring`), `chosen` the
    draft counts so far (an `AdaptiveWindow` subclass may return any chooser with these four).
    Levels index `widths`; level 0 is autoregressive, worth 1 token per unit of cost by
    definition. A width's figure is a ratio of decayed sums (tokens over cost): Jacobi's gains
    come in bursts (a forward that accepts its whole window, then one whose drafts are all
    fresh), which a ratio over ~20 forwards weighs right. `prior`: the model's measured tokens
    per forward at each level (`AdaptiveWindow.start` from its `window_tokens`), or None."""

    def __init__(self, policy: AdaptiveWindow, widths: list[int], cost: list[float], prior: Optional[list[float]] = None,
                 length: Optional[int] = None):
        self.policy, self.widths, self.cost, self.prior = policy, widths, cost, prior
        self.top = len(widths) - 1
        # Whether any width can pay even if all its drafts pass; if none can, no probe is made.
        self.can_pay = any(1 + w > c for w, c in zip(widths, cost) if w > 0)
        if prior is None:
            self.home = [level for level, c in enumerate(cost) if c <= policy.start_cost][-1]
            # A decode that starts at one draft and finds nothing there gets one try of the next
            # width before AR steps (`observe`); later visits to one draft do not.
            self.tried_wider = self.home != 1
            self.growing = self.home < self.top
        else:  # where the model's measured figures pay best; the probes look both ways from there
            pays = [t / c for t, c in zip(prior, cost)]
            self.home = max(range(len(pays)), key=lambda level: (pays[level], -level))
            self.tried_wider, self.growing = True, False
        self.level = self.home  # this forward's
        self.warm = 0  # forwards left whose new slots still hold fresh drafts (not judged)
        self.jumped_from: Optional[int] = None  # the home before a jump, until two forwards confirm it
        self.may_jump = True  # until a jump turns out to have been luck
        self.paid = False  # whether drafts have paid in this decode (it widened on them, or a probe paid)
        self._reset()
        self.trial: Optional[list] = None  # [level, forwards left, tokens, cost, forwards judged] while probing
        self.interval = policy.probe_every  # between probes of a drafting home; doubles after each that did not pay
        self.upward = False  # the last probe's direction (they alternate)
        # Between probes of one draft from autoregressive steps: they cost `probe_cost` of the steps.
        extra = policy.probe_len * (cost[1] - 1) if len(cost) > 1 else 0.0
        self.ar_interval = max(1, math.ceil(extra / policy.probe_cost))
        # Starting with AR steps, the first probe comes once its extra cost is `first_probe_cost`
        # of the steps before it, after `dwell` of them at the latest (a short answer may end first),
        # or at once where the decode's known length makes it that cheap (an image cannot end
        # first); where the model's measured tokens chose AR steps, an early probe would only ask
        # again what they say, so it waits the `probe_cost` pace like every later one.
        first = min(policy.dwell, math.ceil(extra / policy.first_probe_cost))
        if length is not None and extra <= policy.first_probe_cost * length:
            first = 0
        self.since_probe = max(0, self.ar_interval - first) if self.home == 0 and prior is None else 0
        self.chosen: list[int] = []

    def _reset(self) -> None:
        self.sums, self.forwards, self.measured = [0.0, 0.0], 0.0, 0  # decayed (tokens, cost, forwards) at home
        self.below = [0.0, 0.0]  # decayed (tokens, cost) the next narrower width would have had in home's forwards
        if self.prior is not None and self.home > 0:  # the measured figures, worth `prior_forwards` forwards
            n, narrower = self.policy.prior_forwards, self.home - 1
            self.sums, self.forwards = [n * self.prior[self.home], n * self.cost[self.home]], n
            self.below = [n * self.prior[narrower], n * self.cost[narrower]]

    def value(self) -> float:
        """Tokens per unit of cost at home (1.0 for autoregressive steps)."""
        return 1.0 if self.home == 0 else self.sums[0] / max(self.sums[1], 1e-9)

    def choose(self) -> int:
        if self.trial is None and self.can_pay:
            if self.home == 0 and self.since_probe >= self.ar_interval:
                self.trial = [1, self.policy.probe_len, 0.0, 0.0, 0]
            elif self.home > 0 and self.since_probe >= self.interval:
                down, up = self.home - 1, self.home + 1
                self.upward = up <= self.top and (not self.upward or down < 1)
                level = up if self.upward else down
                self.trial = [level, self.policy.dwell + (self.policy.warmup if self.upward else 0), 0.0, 0.0, 0]
        self.level = self.trial[0] if self.trial is not None else self.home
        self.chosen.append(self.widths[self.level])
        return self.chosen[-1]

    def shortened(self, drafts: int) -> None:
        """The proposer gave only `drafts` of the forward's chosen count (it had no more): the
        forward's record. Where it gave none, the forward is no probe's, and a probe waiting
        for it runs at the next forward that has drafts."""
        self.chosen[-1] = drafts

    @property
    def measuring(self) -> bool:
        """Whether `observe` reads the tokens of this forward: not while it runs autoregressive
        steps between probes, which it only counts (the loop then skips that host read)."""
        return self.trial is not None or self.home != 0

    def observe(self, tokens: Optional[float]) -> None:
        """After a forward: the mean tokens each active row finalised (None where not
        `measuring`)."""
        if self.trial is not None:
            self._probe(tokens)
            return
        self.since_probe += 1
        if self.home == 0:
            return
        drafts = self.widths[self.home]
        if self.growing and tokens >= 1 + drafts / 2:  # half the drafts passed (all: the window limited it): widen
            home, jump = self.home, (self.policy.jump if tokens >= 1 + drafts and self.may_jump else 1)
            self.paid = True
            self._move(min(self.top, home + jump), growing=True)
            self.jumped_from = home if jump > 1 else None
            return
        if self.warm > 0:  # the new slots' fresh drafts: not this width's figure
            self.warm -= 1
            return
        keep = self.policy.decay
        self.sums = [keep * self.sums[0] + tokens, keep * self.sums[1] + self.cost[self.home]]
        self.forwards = keep * self.forwards + 1
        self.measured += 1
        if self.home > 1:
            # What the next narrower window would have finalised in this forward: the same
            # accepted drafts, cut at its width (a row mean, so an estimate; Jacobi's deeper
            # drafts, refined by the wider window, make it an optimistic one).
            narrower = self.widths[self.home - 1]
            self.below = [keep * self.below[0] + min(tokens, 1 + narrower), keep * self.below[1] + self.cost[self.home - 1]]
        if self.jumped_from is not None and self.measured == 2:
            # A jump on one lucky forward: two barren ones after it send the window back at once.
            if self.sums[0] / self.forwards < 1 + self.policy.barren:
                self._move(self.jumped_from, growing=True)
                self.may_jump = False
                return
            self.jumped_from = None
        if self.measured < self.policy.dwell:
            return
        if self.value() < 1.0:
            # Drafting pays less than plain steps here: with next to nothing accepted, fall back
            # to them at once; otherwise try the next narrower window first.
            barren = self.sums[0] / self.forwards < 1 + self.policy.barren
            if barren and self.home == 1 and self.growing and not self.tried_wider and self.top >= 2:
                # A Jacobi window of one draft carries a single stale draft; wider ones converge
                # over iterations. So a barren one-draft window gets one try of the next width
                # before AR steps (emoji64: a third of its decodes accept nothing at one draft
                # and do at three).
                self.tried_wider = True
                self._move(2, growing=True)
                return
            if barren and self.home > 1 and self.paid:
                # A barren stretch after drafts have paid in this decode often passes, and from
                # AR steps only one-draft probes look for its end, which on emoji64 found
                # nothing for 20-30 forwards where a 4-token window accepted: so one width down,
                # still growing. AR steps only from one draft, the cheapest window to keep.
                self._move(self.home - 1, growing=True)
                return
            self._move(0 if barren else self.home - 1, growing=False)
        elif self.home > 1 and self.below[0] / self.below[1] > (1 + self.policy.margin) * self.value():
            # The wider half of the window does not pay for itself, by this forward's own outcome.
            self._move(self.home - 1, growing=False)

    def _probe(self, tokens: float) -> None:
        """A probe, judged once it has run its forwards. Its first forward is not judged where it
        widens a drafting home (the new slots hold fresh drafts) nor where it starts from AR steps
        (every draft is fresh there: where one draft costs 1.5 AR steps, a two-forward probe that
        counted it could not pay even if every later draft passed)."""
        level = self.trial[0]
        self.trial[1] -= 1
        if self.home > 0:
            warm = level > self.home and self.trial[1] >= self.policy.dwell
        else:
            warm = self.policy.probe_len > 1 and self.trial[1] == self.policy.probe_len - 1
        if not warm:
            self.trial[2:] = [self.trial[2] + tokens, self.trial[3] + self.cost[level], self.trial[4] + 1]
        if self.trial[1] > 0:
            return
        tokens_sum, cost_sum, judged = self.trial[2:]
        self.trial, self.since_probe = None, 0
        if tokens_sum / cost_sum <= self.value():
            if self.home > 0:
                self.interval *= 2
            return
        upward = level > self.home
        self.paid = True
        if upward and level < self.top and tokens >= 1 + self.widths[level] and self.may_jump:  # it ended accepting its whole window
            self._move(min(self.top, level + self.policy.jump), growing=True)
            self.jumped_from = level
            return
        self._move(level, growing=upward and level < self.top)
        # The probe's forwards are the new home's figure (on top of the prior, where there is
        # one), judged already (a probe from AR steps is shorter than `dwell`: the next forward
        # may still send it back).
        self.sums = [self.sums[0] + tokens_sum, self.sums[1] + cost_sum]
        self.forwards, self.measured = self.forwards + judged, self.policy.dwell
        self.warm = 0

    def _move(self, level: int, growing: bool) -> None:
        self.warm = self.policy.warmup if level > self.home else 0
        self.tried_wider = self.tried_wider or level > 1
        self.home, self.growing, self.since_probe, self.jumped_from = level, growing, 0, None
        self.interval = self.policy.probe_every
        self._reset()


class FixedWindow:
    """The speculative loop's window without an `AdaptiveWindow` (or without drafts): every
    forward asks for all `num_draft` drafts, and nothing is measured. Where the proposer gave
    fewer in some forward (a drafter unsure, no n-gram match), the stats carry each forward's
    draft count (`drafts_per_forward`)."""

    def __init__(self, num_draft: int):
        self.num_draft, self.forwards = num_draft, 0
        self.counts: Optional[list[int]] = None  # each forward's draft count, once one fell short

    def choose(self) -> int:
        return self.num_draft

    def after(self, step: torch.Tensor, active: torch.Tensor, drafts: int) -> None:
        """`drafts`: the draft count the forward verified."""
        if drafts != self.num_draft and self.counts is None:
            self.counts = [self.num_draft] * self.forwards
        if self.counts is not None:
            self.counts.append(drafts)
        self.forwards += 1

    def finish(self, stats: Any) -> None:
        if self.counts is not None:
            stats.drafts_per_forward = self.counts


class AdaptingWindow:
    """The speculative loop's window under an `AdaptiveWindow`: its chooser's `choose()` before
    each forward; after it, the mean tokens each row still decoding finalised (one host read,
    only while the chooser is `measuring`); at the end each forward's draft count in the stats
    (`drafts_per_forward`)."""

    def __init__(self, chooser: WindowChooser):
        self.chooser, self.choose = chooser, chooser.choose

    def after(self, step: torch.Tensor, active: torch.Tensor, drafts: int) -> None:
        """`step` [B] tokens finalised per row, counted over the rows `active` [B] in that forward,
        which verified `drafts` drafts per row (fewer than chosen where the proposer gave fewer)."""
        chooser = self.chooser
        if drafts < chooser.chosen[-1]:
            chooser.shortened(drafts)
            if drafts == 0:  # nothing was proposed: an autoregressive step, no figure of the width chosen
                return
        chooser.observe(float((step * active).sum() / active.sum().clamp_min(1)) if chooser.measuring else None)

    def finish(self, stats: Any) -> None:
        stats.drafts_per_forward = self.chooser.chosen


class RowWindows:
    """The speculative loop's window under an `AdaptiveWindow` in continuous batching: one
    chooser per row, started with the row's request as a batch-1 decode with the same policy
    would start (`batch_rows`: `continuous_decode` sets its batch size) and fed that row's own
    tokens, so each request verifies the draft counts, and makes the draws, of its decode
    alone. A forward holds the largest count of its rows; each row verifies its own
    (`DecodeRun.row_drafts`, `RowGenerators.narrowed`, `finalise`'s `limit`), and its stats carry
    its own `drafts_per_forward` (`chosen`)."""

    def __init__(self, policy: AdaptiveWindow, max_draft: int, guided: bool, device, window_cost: Optional[WindowCost], run: Any,
                 window_tokens: Optional[WindowTokens] = None, ends: Any = None):
        self.policy, self.max_draft, self.device, self.window_cost, self.run = policy, max_draft, device, window_cost, run
        self.window_tokens, self.ends = window_tokens, ends
        self.rows_fed = 2 if guided else 1
        self.choosers: list[Optional[WindowChooser]] = [None] * run.batch_size

    def restart(self, rows: list[int]) -> None:
        """`rows` start new requests: each a fresh chooser."""
        for row in rows:
            length = self.ends.known_length(row) if self.ends is not None else None
            self.choosers[row] = self.policy.start(self.max_draft, self.rows_fed, self.device, self.window_cost, self.window_tokens,
                                                   length)

    def select_rows(self, index: list[int]) -> None:
        """The batch keeps rows `index` (a repeated one restarts before it decodes)."""
        self.choosers = [self.choosers[i] for i in index]

    def chosen(self, row: int) -> list[int]:
        return self.choosers[row].chosen

    def choose(self) -> int:
        active = self.run.active.tolist()
        drafts = [c.choose() if on else 0 for c, on in zip(self.choosers, active)]
        self.run.row_drafts = drafts
        return max(drafts)

    def after(self, step: torch.Tensor, active: torch.Tensor, drafts: int) -> None:
        """Each row that decoded in this forward observes its own finalised tokens (a proposer
        that adapts per row gives every row the drafts it chose: `drafts` is their most)."""
        rows = [(b, c) for b, (c, on) in enumerate(zip(self.choosers, active.tolist())) if on]
        steps = step.tolist() if any(c.measuring for _, c in rows) else None
        for b, chooser in rows:
            chooser.observe(float(steps[b]) if chooser.measuring else None)

    def finish(self, stats: Any) -> None:
        self.run.row_drafts = None


def window_chooser(adapt: Optional[AdaptiveWindow], max_draft: int, batch: int, guided: bool, device,
                   window_cost: Optional[WindowCost] = None, window_tokens: Optional[WindowTokens] = None,
                   length: Optional[int] = None) -> Union[AdaptingWindow, FixedWindow]:
    """The draft counts of one decode of `batch` rows (`guided`: both halves of a guided batch
    are fed): `adapt`'s, or a fixed window without one or without drafts. A model's measured
    `window_cost` is for batch 1, so only a batch-1 decode uses it (its `window_tokens` hold at
    any batch); a static batch's rows share one width, so `batch_rows` is for batch-1 decodes
    only (the loop refuses it in a batch)."""
    if adapt is None or max_draft == 0:
        return FixedWindow(max_draft)
    return AdaptingWindow(adapt.start(max_draft, batch * (2 if guided else 1), device, window_cost if batch == 1 else None,
                                      window_tokens, length))


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
