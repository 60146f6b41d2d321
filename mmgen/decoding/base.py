"""The decoder interface: a small strategy object, swappable like a diffusers scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Protocol

import torch

from mmgen.decoding.stats import DecodeStats
from mmgen.modeling import TokenModel
from mmgen.sampling import AllTokensMaskedError, SamplingConfig


@dataclass
class DecodeOutput:
    """What every decoder returns: the generated tokens and the decode's statistics.

    `tokens` is [B, num_tokens] for token models ([B, num_tokens, K] for frames of K
    codebooks), the list of token maps [B, step_sizes[k]] for next-scale models and the canvas
    [B, L, D] for continuous ones. With stopping, `lengths` [B] holds each row's token count
    (its stop token included) and the tokens after it are padding; fixed-length decodes leave
    it None."""

    tokens: Any
    stats: DecodeStats
    lengths: Optional[torch.Tensor] = None


class Progress(Protocol):
    """Anything with tqdm's `update(n)`: called with the tokens the slowest row gained."""

    def update(self, n: int) -> Any: ...


class BaseDecoder:
    """What every decoder of the core is: a small strategy object (swappable like a diffusers
    scheduler) whose `generate` drives one kind of model and returns a `DecodeOutput`. `family`
    names that kind: "token" (`TokenModel`), "scale" (`ScaleModel`), "continuous"
    (`ContinuousModel`) or "causal-continuous" (`CausalContinuousModel`)."""

    family: ClassVar[str] = ""


class Decoder(BaseDecoder):
    """Base class of token decoders: `generate(model, conditions, num_tokens, sampling,
    generator, progress, stopping, streamer)`."""

    family: ClassVar[str] = "token"

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
        stopping: Optional[Any] = None,
        streamer: Optional[Any] = None,
    ) -> DecodeOutput:
        """Decode `num_tokens` tokens per row (at most, with a `speculative.Stopping`), calling
        `streamer.put` with each row's new tokens as they are committed."""
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
