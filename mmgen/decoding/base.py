"""The decoder interface: a small strategy object, swappable like a diffusers scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from mmgen.decoding.stats import DecodeStats
from mmgen.modeling import TokenModel
from mmgen.sampling import AllTokensMaskedError, SamplingConfig


@dataclass
class DecodeOutput:
    """Generated tokens [B, num_tokens] ([B, num_tokens, K] for frames of K codebooks) and the
    decode's statistics. With stopping, `lengths` [B] holds each row's token count (its stop
    token included) and the tokens after it are padding; fixed-length decodes leave it None."""

    tokens: torch.Tensor
    stats: DecodeStats
    lengths: Optional[torch.Tensor] = None


class Progress(Protocol):
    """Anything with tqdm's `update(n)`: called with the tokens the slowest row gained."""

    def update(self, n: int) -> Any: ...


class Decoder:
    """Base class: `generate(model, conditions, num_tokens, sampling, generator)`."""

    #: Tokens fed to the model per forward; the cache needs room for twice this past the end.
    window: int = 1

    def generate(
        self,
        model: TokenModel,
        conditions: Any,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator,
        progress: Optional[Progress] = None,
    ) -> DecodeOutput:
        raise NotImplementedError

    def capacity(self, num_tokens: int) -> int:
        """Cache positions after the conditions that decoding `num_tokens` may touch."""
        return num_tokens + 2 * min(self.window, num_tokens)


def raise_if_masked(bad: torch.Tensor) -> None:
    """Turn the device-side flag of rows that had nothing to sample into an error (one sync)."""
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise AllTokensMaskedError(
            f"every token was masked for batch row(s) {rows[:8]}: the logits were all -inf or NaN "
            "before or after top-k/top-p; check the model output and the sampling filters"
        )


def check_int(name: str, value: Any, minimum: int) -> None:
    """ValueError unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_num_tokens(num_tokens: int) -> None:
    check_int("num_tokens", num_tokens, 1)
