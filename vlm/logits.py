"""A model's own logits processing from its generation config, applied on every step.

transformers' `generate(do_sample=False)` runs the logits processors the model's generation
config asks for before it picks a token; mmgen's decoders must see the same logits, at the
prefill and at every decode position, speculative ones included (a verify forward of n tokens
gives n positions, each with its own history). Served here: `repetition_penalty` (divides a
positive logit of every token seen in the row so far, prompt included, multiplies a negative
one), `suppress_tokens` (never), `begin_suppress_tokens` (not as the first answer token). Any
other setting that changes the logits is refused in one line rather than silently skipped.
Sampling settings (temperature, top-k, top-p) are the call's, not the config's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

#: Generation-config settings that change logits and are not served here (None or 0 is unset).
UNSERVED = ("no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_length", "min_new_tokens",
            "encoder_repetition_penalty", "encoder_no_repeat_ngram_size", "forced_bos_token_id", "forced_eos_token_id",
            "exponential_decay_length_penalty", "forced_decoder_ids", "guidance_scale", "watermarking_config")


@dataclass(frozen=True)
class GenerationRules:
    """The logits processing of one model's generation config."""

    repetition_penalty: float = 1.0
    suppress: tuple[int, ...] = ()
    begin_suppress: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: Any) -> "GenerationRules":
        """The rules of `model.generation_config` (ValueError naming a setting not served)."""
        config = getattr(model, "generation_config", None)
        if config is None:
            return cls()
        for name in UNSERVED:
            value = getattr(config, name, None)
            neutral = 1.0 if name in ("encoder_repetition_penalty", "guidance_scale") else 0
            if value is not None and value != neutral and value != [] and value != {}:
                raise ValueError(f"the model's generation_config sets {name}={value!r}, which mmgen's decoders do not apply: "
                                 f"unset it (model.generation_config.{name} = None) to decode without it")
        penalty = getattr(config, "repetition_penalty", None)
        return cls(repetition_penalty=1.0 if penalty is None else float(penalty),
                   suppress=tuple(int(t) for t in getattr(config, "suppress_tokens", None) or ()),
                   begin_suppress=tuple(int(t) for t in getattr(config, "begin_suppress_tokens", None) or ()))

    @property
    def identity(self) -> bool:
        return self.repetition_penalty == 1.0 and not self.suppress and not self.begin_suppress

    def start(self, input_ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> "RuleState":
        """The per-row history of a prefill: the tokens of each row's prompt (padding excluded,
        so a row's logits are the ones it gets alone)."""
        seen = torch.zeros(input_ids.shape[0], vocab_size, dtype=torch.bool, device=input_ids.device)
        ids = input_ids.clamp(0, vocab_size - 1)
        seen.scatter_(1, ids, mask.bool() & (input_ids < vocab_size) & (input_ids >= 0))
        return RuleState(seen, [[] for _ in range(input_ids.shape[0])])

    def first(self, logits: torch.Tensor, state: "RuleState") -> torch.Tensor:
        """The prefill's logits [R, 1, V], predicting each row's first answer token."""
        logits = self._penalise(logits, state.history()[:, None])
        return self._suppress(logits, self.suppress + self.begin_suppress)

    def step(self, logits: torch.Tensor, state: "RuleState", tokens: torch.Tensor) -> torch.Tensor:
        """The logits [R, n, V] of the last n positions of a forward of `tokens` [R, m] (m >= n):
        position j's history is the row's committed tokens and tokens[:, :j + 1]."""
        if self.repetition_penalty != 1.0:
            fed = torch.zeros(*tokens.shape, logits.shape[-1], dtype=torch.bool, device=logits.device)
            fed.scatter_(2, tokens[..., None], True)
            seen = state.history()[:, None] | fed.cummax(1).values[:, tokens.shape[1] - logits.shape[1]:]
            logits = self._penalise(logits, seen)
        return self._suppress(logits, self.suppress)

    def _penalise(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        if self.repetition_penalty == 1.0:
            return logits
        p = self.repetition_penalty
        return torch.where(seen, torch.where(logits < 0, logits * p, logits / p), logits)

    @staticmethod
    def _suppress(logits: torch.Tensor, tokens: tuple[int, ...]) -> torch.Tensor:
        if not tokens:
            return logits
        logits = logits.clone()
        logits[..., [t for t in tokens if t < logits.shape[-1]]] = -torch.inf
        return logits


@dataclass
class RuleState:
    """Per-row history for the rules: `prompt` [R, V] (tokens of each prompt) and each row's
    committed answer tokens; `pending` holds the last forward's tokens until they commit."""

    prompt: torch.Tensor
    answers: list[list[int]]
    pending: Optional[torch.Tensor] = None

    def history(self) -> torch.Tensor:
        """[R, V]: the tokens each row has seen (prompt and committed answer)."""
        seen = self.prompt.clone()
        for row, tokens in enumerate(self.answers):
            if tokens:
                seen[row, tokens] = True
        return seen

    def commit(self, accepted: torch.Tensor) -> None:
        if self.pending is not None:
            for row, (n, tokens) in enumerate(zip(accepted.tolist(), self.pending.tolist())):
                self.answers[row] += tokens[:n]
        self.pending = None

    def rewind(self, num_generated: torch.Tensor) -> None:
        self.pending = None
        for row, n in enumerate(num_generated.tolist()):
            del self.answers[row][n:]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (into the current rows, in that order; between forwards)."""
        self.prompt, self.answers = self.prompt[index], [list(self.answers[r]) for r in index.tolist()]

    def restart(self, row: int, fresh: "RuleState") -> None:
        self.prompt[row], self.answers[row] = fresh.prompt[0], list(fresh.answers[0])
