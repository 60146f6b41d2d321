"""Decoders: swappable strategy objects that drive any `TokenModel`.

A decoder is a proposer (where drafts come from) combined with an acceptance rule (which
drafts survive). Shortcuts name the usual combinations; `make_decoder(name, **options)` sets
any field of the decoder or of its acceptance rule by name.
"""

from __future__ import annotations

import json
from dataclasses import fields, is_dataclass, replace
from typing import Any, Callable

from mmgen.decoding.acceptance import (
    AcceptanceRule,
    ExactAcceptance,
    GroupedAcceptance,
    NeighbourhoodAcceptance,
    RelaxedAcceptance,
    residual_distribution,
)
from mmgen.decoding.autoregressive import Autoregressive
from mmgen.decoding.batching import Finished, Request, continuous_decode, row_decoder
from mmgen.decoding.base import BaseDecoder, DecodeOutput, Decoder
from mmgen.decoding.block_diffusion import BlockDecodeOutput, BlockDenoising, BlockStats, CollaborativeDenoising, FlowSchedule
from mmgen.decoding.continuous_tokens import (
    ContinuousAcceptance,
    ContinuousDecoder,
    ContinuousOutput,
    ContinuousSpeculative,
    GaussianTokens,
    MaskedContinuous,
)
from mmgen.decoding.causal_continuous import CausalContinuousSpeculative
from mmgen.decoding.coupled import CoupledJacobi, CounterNoise
from mmgen.decoding.draft import DraftModelProposer, DraftSpeculative
from mmgen.decoding.entropy_switch import EntropySwitch
from mmgen.decoding.heads import DraftHeads, DraftHeadsConfig, HeadsProposer, HeadsSpeculative
from mmgen.decoding.jacobi_init import AboveNeighbourInit, DraftContext, DraftInit, LeftNeighbourInit, RandomDraftInit
from mmgen.decoding.jacobi import JacobiProposer, SpeculativeJacobi
from mmgen.decoding.layer_skip import LayerSkipProposer, LayerSkipSpeculative
from mmgen.decoding.ngram import NGramProposer, PromptLookup
from mmgen.decoding.next_scale import Collaborative, MapSmoothing, NextScale, ScaleDecodeOutput, ScaleDecoder
from mmgen.decoding.pruning import CachedTokenPruning
from mmgen.decoding.proposer import DecodeRun, Proposer
from mmgen.decoding.speculative import speculative_decode
from mmgen.decoding.stats import DecodeStats, DraftCounters, StageCounters
from mmgen.decoding.stopping import Stopping, Streamer, TokenQueueStreamer
from mmgen.decoding.window import AdaptiveWindow, resolve_adaptive
from mmgen.deprecation import rename_options, warn_deprecated

#: String shortcuts accepted wherever a decoder is (`decoding="lantern"`).
DECODERS: dict[str, Callable[[], Decoder]] = {
    "ar": Autoregressive,
    "sjd": SpeculativeJacobi,
    "sjd-coupled": CoupledJacobi,
    "gsd": lambda: SpeculativeJacobi(acceptance=GroupedAcceptance()),
    "lantern": lambda: SpeculativeJacobi(acceptance=RelaxedAcceptance(delta=0.1)),
    "lantern++": lambda: SpeculativeJacobi(acceptance=RelaxedAcceptance(lam=2.0)),
    "draft": DraftSpeculative,
    "heads": HeadsSpeculative,
    "lookup": PromptLookup,
    "skip": LayerSkipSpeculative,
    "entropy-switch": EntropySwitch,
}

#: The shortcuts of continuous-token models (MAR): `decoding="cspd"` needs `drafter=`.
CONTINUOUS_DECODERS: dict[str, Callable[[], ContinuousDecoder]] = {
    "ar": MaskedContinuous,
    "cspd": ContinuousSpeculative,
}

#: The shortcuts of cached causal continuous models (next-token diffusion: VibeVoice):
#: `decoding="cspd"` needs `drafter=`.
CAUSAL_CONTINUOUS_DECODERS: dict[str, Callable[[], CausalContinuousSpeculative]] = {
    "ar": CausalContinuousSpeculative,
    "cspd": CausalContinuousSpeculative,
}

#: The shortcuts of next-scale models (VAR): `decoding="collaborative"` (CoDe) needs `small=`.
SCALE_DECODERS: dict[str, Callable[[], ScaleDecoder]] = {
    "ar": NextScale,
    "collaborative": Collaborative,
}

#: Old shortcut names by decoder family, old -> new, read (with a DeprecationWarning) until 0.3.
RENAMED_SHORTCUTS: dict[str, dict[str, str]] = {"scale": {"code": "collaborative"}}


def make_decoder(name: str, registry: dict[str, Callable[[], Any]] = DECODERS, **options: Any) -> Any:
    """The decoder a shortcut names, with `options` applied to the decoder's fields or, for
    names the decoder lacks, to its acceptance rule's (`make_decoder("lantern", delta=0.2,
    window=8)`) or its adaptive window's (`make_decoder("sjd", batch_rows=8)`: `AdaptiveWindow`'s
    fields but `widths`); rule options apply to an `acceptance=` given alongside them. Unknown
    options are an error that lists the valid ones; old names are read (`canonical_decoding`)."""
    name, options = canonical_decoding(name, options, registry, stacklevel=3)
    decoder = registry[name]()
    own = {k: v for k, v in options.items() if k in _field_names(decoder)}
    window_fields = _WINDOW_OPTIONS if "adapt" in _field_names(decoder) else set()
    window = {k: v for k, v in options.items() if k in window_fields and k not in own}
    rest = {k: v for k, v in options.items() if k not in own and k not in window}
    rule = own.get("acceptance", getattr(decoder, "acceptance", None))
    if "acceptance" in own and not isinstance(rule, AcceptanceRule):
        raise ValueError(f"acceptance must be an AcceptanceRule object, got {rule!r}; pick a rule by its shortcut instead")
    unknown = sorted(k for k in rest if rule is None or k not in _field_names(rule))
    if unknown:
        valid = sorted(_field_names(decoder) | (_field_names(rule) if rule is not None else set()) | window_fields)
        raise ValueError(f"unknown option(s) {unknown} for decoding {name!r}; valid options: {valid}")
    if rest:
        own["acceptance"] = replace(rule, **rest)
    if window:
        adapt = resolve_adaptive(own.get("adapt", decoder.adapt))
        if adapt is None:
            raise ValueError(f"option(s) {sorted(window)} of decoding {name!r} set the adaptive window, which adapt=false turns off")
        own["adapt"] = replace(adapt, **window)
    return replace(decoder, **own) if own else decoder


def canonical_decoding(name: str, options: dict[str, Any], registry: dict[str, Callable[[], Any]] = DECODERS,
                       stacklevel: int = 2) -> tuple[str, dict[str, Any]]:
    """(shortcut, options) of `registry` under their current names: a renamed shortcut
    (`RENAMED_SHORTCUTS`) or decoder option (the decoder's `renamed_options`) becomes its new
    name with a DeprecationWarning. An unknown shortcut is an error listing the valid ones."""
    if not isinstance(name, str):
        raise ValueError(f"unknown decoding {name!r}: use one of {sorted(registry)} or a decoder object")
    given, name, renamed = name, name.lower(), RENAMED_SHORTCUTS.get(_family_of(registry), {})
    if name in renamed and name not in registry:
        warn_deprecated(f"decoding {name!r}", f"use {renamed[name]!r}", stacklevel + 1)
        name = renamed[name]
    if name not in registry:
        raise ValueError(f"unknown decoding {given!r}: use one of {sorted(registry)} or a decoder object")
    decoder = registry[name]()
    return name, rename_options(type(decoder).__name__, getattr(decoder, "renamed_options", {}), options, stacklevel + 1)


#: The `AdaptiveWindow` fields a decoding spec may set ("sjd:batch_rows=8,dwell=10").
_WINDOW_OPTIONS = {f.name for f in fields(AdaptiveWindow)} - {"widths"}


def row_spec(spec: str, batch_size: int) -> str:
    """The decoding spec whose batch-1 decode each request of a `batch_size`-row continuous
    batch decodes (`batching.row_decoder` for a spec, kept a spec for a command line): `spec`
    with `batch_rows` added where its decoder adapts its window and the spec names none."""
    name, options = parse_decoding(spec)
    decoder = make_decoder(name, **options) if name in DECODERS else None
    if decoder is None or resolve_adaptive(getattr(decoder, "adapt", None)) is None or "batch_rows" in options:
        return spec
    return f"{spec}{',' if ':' in spec else ':'}batch_rows={batch_size}"


def parse_decoding(spec: str) -> tuple[str, dict[str, Any]]:
    """A decoding spec -> (shortcut, options).

    "lantern:delta=0.2,window=8" -> ("lantern", {"delta": 0.2, "window": 8}); values are JSON
    literals (numbers, true/false, null), other numbers such as ".2", or else plain strings;
    "sjd-8" is short for "sjd:window=8". Nothing is ever evaluated.
    """
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    options: dict[str, Any] = {}
    head, _, window = name.rpartition("-")
    if head == "sjd" and window.isdigit():
        name, options["window"] = head, int(window)
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        key = key.replace("-", "_")
        if not eq or not key:
            raise ValueError(f"bad decoding option {item!r} in {spec!r}: expected key=value")
        if key in options:
            raise ValueError(f"decoding option {key!r} is given twice in {spec!r}")
        options[key] = _literal(value)
    return name, options


def _literal(text: str) -> Any:
    try:
        return json.loads(text.lower() if text.lower() in ("true", "false", "null") else text)
    except json.JSONDecodeError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _field_names(obj: Any) -> set[str]:
    # Bound tables (neighbours, close) are set by `bind`, never by users.
    return {f.name for f in fields(obj) if f.repr and f.init} if is_dataclass(obj) else set()


#: The shortcuts of block-diffusion models (video): plain, and CoDe's large/small split across
#: denoising steps.
BLOCK_DIFFUSION_DECODERS: dict[str, Callable[[], BlockDenoising]] = {
    "block": BlockDenoising,
    "collaborative": CollaborativeDenoising,
}

#: The shortcuts of each decoder family (`BaseDecoder.family`, `Pipeline.decoder_family`).
FAMILY_DECODERS: dict[str, dict[str, Callable[[], Any]]] = {
    "token": DECODERS, "scale": SCALE_DECODERS, "continuous": CONTINUOUS_DECODERS,
    "causal-continuous": CAUSAL_CONTINUOUS_DECODERS, "block-diffusion": BLOCK_DIFFUSION_DECODERS,
}


def register_decoder(family: str, name: str, factory: Callable[[], Any]) -> None:
    """Add a decoding shortcut `name` to a decoder family ("token", "scale", "continuous",
    "causal-continuous", "block-diffusion"): `factory()` makes the decoder, a dataclass whose
    fields are the spec's options ("NAME:key=value"). Every pipeline of that family then takes it
    wherever a decoding is named (Python, `--decoding`, job files, the demos and the server), as
    the built-in ones. A taken name is an error."""
    if family not in FAMILY_DECODERS:
        raise ValueError(f"unknown decoder family {family!r}: families are {', '.join(FAMILY_DECODERS)}")
    if not isinstance(name, str) or not name or name != name.strip().lower() or ":" in name or "," in name:
        raise ValueError(f"a decoding shortcut is a lowercase name without ':' or ',', got {name!r}")
    if name in FAMILY_DECODERS[family]:
        raise ValueError(f"decoding {name!r} is already registered for {family} models")
    if not callable(factory):
        raise ValueError(f"the factory of decoding {name!r} must be callable, got {factory!r}")
    FAMILY_DECODERS[family][name] = factory


def unregister_decoder(family: str, name: str) -> None:
    """Remove a shortcut `register_decoder` added (tests clean up with this)."""
    FAMILY_DECODERS.get(family, {}).pop(name, None)


def _family_of(registry: dict[str, Callable[[], Any]]) -> str:
    """The decoder family whose shortcut table `registry` is ("token" for one of none)."""
    return next((name for name, table in FAMILY_DECODERS.items() if table is registry), "token")


def resolve_decoder(decoding: Any, registry: dict[str, Callable[[], Any]] = DECODERS) -> Any:
    """A decoder object from itself, a shortcut name or a spec ("lantern:delta=0.2"); pass
    `registry=SCALE_DECODERS` for next-scale models, `CONTINUOUS_DECODERS` for continuous ones
    (or `FAMILY_DECODERS[family]`). A decoder object must be of that registry's family."""
    family = _family_of(registry)
    kind = {"token": Decoder, "scale": ScaleDecoder, "continuous": ContinuousDecoder,
            "causal-continuous": CausalContinuousSpeculative, "block-diffusion": BlockDenoising}[family]
    if isinstance(decoding, BaseDecoder) and decoding.family == family:
        return decoding
    if isinstance(decoding, str):
        name, options = parse_decoding(decoding)
        return make_decoder(name, registry, **options)
    raise ValueError(
        f"decoding must be a shortcut name {sorted(registry)}, a spec or a {kind.__name__} object, got {decoding!r}"
    )


__all__ = [
    "Finished",
    "Request",
    "continuous_decode",
    "row_decoder",
    "row_spec",
    "AdaptiveWindow",
    "DraftCounters",
    "StageCounters",
    "BaseDecoder",
    "FAMILY_DECODERS",
    "BLOCK_DIFFUSION_DECODERS",
    "BlockDenoising",
    "CollaborativeDenoising",
    "FlowSchedule",
    "BlockDecodeOutput",
    "BlockStats",
    "CausalContinuousSpeculative",
    "CAUSAL_CONTINUOUS_DECODERS",
    "speculative_decode",
    "TokenQueueStreamer",
    "Streamer",
    "Stopping",
    "DecodeRun",
    "Proposer",
    "PromptLookup",
    "NGramProposer",
    "JacobiProposer",
    "DraftModelProposer",
    "CounterNoise",
    "AboveNeighbourInit",
    "AcceptanceRule",
    "CONTINUOUS_DECODERS",
    "Autoregressive",
    "CachedTokenPruning",
    "Collaborative",
    "ContinuousAcceptance",
    "ContinuousDecoder",
    "ContinuousOutput",
    "ContinuousSpeculative",
    "CoupledJacobi",
    "DECODERS",
    "DecodeOutput",
    "DecodeStats",
    "Decoder",
    "DraftContext",
    "DraftInit",
    "DraftSpeculative",
    "LayerSkipProposer",
    "LayerSkipSpeculative",
    "DraftHeads",
    "DraftHeadsConfig",
    "HeadsProposer",
    "HeadsSpeculative",
    "EntropySwitch",
    "ExactAcceptance",
    "GaussianTokens",
    "GroupedAcceptance",
    "LeftNeighbourInit",
    "MapSmoothing",
    "MaskedContinuous",
    "NextScale",
    "NeighbourhoodAcceptance",
    "RandomDraftInit",
    "RelaxedAcceptance",
    "SCALE_DECODERS",
    "ScaleDecodeOutput",
    "ScaleDecoder",
    "SpeculativeJacobi",
    "make_decoder",
    "canonical_decoding",
    "RENAMED_SHORTCUTS",
    "parse_decoding",
    "register_decoder",
    "unregister_decoder",
    "resolve_decoder",
    "residual_distribution",
]
