"""Decoders: swappable strategy objects that drive any `TokenModel`."""

from __future__ import annotations

from typing import Union

from mmgen.decoding.acceptance import ExactAcceptance, residual_distribution
from mmgen.decoding.autoregressive import Autoregressive
from mmgen.decoding.base import DecodeOutput, Decoder
from mmgen.decoding.jacobi import RandomDraftInit, SpeculativeJacobi
from mmgen.decoding.stats import DecodeStats

#: String shortcuts accepted wherever a decoder is (`decoding="sjd"`).
DECODERS = {"ar": Autoregressive, "sjd": SpeculativeJacobi}


def resolve_decoder(decoding: Union[str, Decoder]) -> Decoder:
    """A decoder object from a shortcut name or the object itself."""
    if isinstance(decoding, Decoder):
        return decoding
    if isinstance(decoding, str) and decoding.lower() in DECODERS:
        return DECODERS[decoding.lower()]()
    raise ValueError(f"unknown decoding {decoding!r}: use one of {sorted(DECODERS)} or a Decoder object")


__all__ = [
    "Autoregressive",
    "DECODERS",
    "DecodeOutput",
    "DecodeStats",
    "Decoder",
    "ExactAcceptance",
    "RandomDraftInit",
    "SpeculativeJacobi",
    "resolve_decoder",
    "residual_distribution",
]
