"""What the device tests assert with: greedy identity (with bfloat16's rounding stated), the
chi-square of a sampled law, and skips that say where the CPU covers a CUDA-only check.

No scipy here: the GPU machine's environment does not have it (benchmarks/gpu_wheels.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from mmgen.sampling import Logits, SamplingConfig, apply_guidance

DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]
ALPHA = 1e-3  # false-alarm rate of each chi-square test (seeds are fixed, so the outcome is too)
#: bfloat16 keeps 8 significant bits (2^-8 relative). A W-token verify forward and W one-token
#: steps round differently in every layer: their logits differ by about 1% of the logits' scale
#: (docs/architecture.md, LlamaGen at GPT-B size), so two decoders may part where the best two
#: tokens are that close; 2^-5 (3%) leaves room for deeper models and other kernels.
BF16_TIE = 2.0**-5


def needs_cuda(device: torch.device, covered: str) -> None:
    """Skip unless `device` is CUDA; `covered` says what checks it on the CPU."""
    if device.type != "cuda":
        pytest.skip(f"needs CUDA (MMGEN_TEST_DEVICE=cuda runs it); on the CPU {covered}")


@torch.no_grad()
def teacher_forced_guided(model, conditions, tokens: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Guided float32 logits [B, n, V] of every position of `tokens` [B, n], from one forward of
    the whole sequence after the prefill (the width a verify window has)."""
    n = tokens.shape[1]
    state = model.start(conditions, n + 8, sampling.uses_guidance)
    rest = model.forward(state, tokens[:, :-1])
    first = state.first_logits
    logits = Logits(torch.cat([first.cond, rest.cond], 1),
                    None if first.uncond is None else torch.cat([first.uncond, rest.uncond], 1))
    index = torch.arange(n, device=tokens.device).expand(tokens.shape[0], n)
    return apply_guidance(logits, sampling.guidance.scales(index))


def assert_greedy_identical(model, conditions, sampling: SamplingConfig, expected: torch.Tensor, got: torch.Tensor,
                            dtype: torch.dtype, what: str) -> None:
    """`got` equals `expected` (greedy AR) token for token. In bfloat16 a row may instead part
    from it where AR's two best tokens were within BF16_TIE of the largest logit (rounding can
    swap them); everywhere else, and in float32 always, the tokens must be equal."""
    if torch.equal(got, expected):
        return
    assert dtype == torch.bfloat16, f"{what}: tokens differ from AR's\n{expected.tolist()}\n{got.tolist()}"
    guided = teacher_forced_guided(model, conditions, expected, sampling)
    for row in range(expected.shape[0]):
        differ = (got[row] != expected[row]).nonzero()
        if len(differ) == 0:
            continue
        t = int(differ[0])
        best = guided[row, t].topk(2).values
        gap, scale = float(best[0] - best[1]), float(guided[row].abs().max())
        assert gap <= BF16_TIE * scale, (f"{what}: row {row} parts from AR at token {t}, where AR's best two logits are "
                                         f"{gap:.4g} apart (more than bfloat16 rounding, {BF16_TIE} x {scale:.3g})")


def chi_square_pvalue(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square p-value of counts against expected counts, cells expected below 5
    pooled into one (the test's usual validity condition); 0 when a cell of probability zero
    was observed. The chi-square survival function is the regularised upper gamma."""
    observed, expected = observed.double().cpu(), expected.double().cpu()
    if observed[expected == 0].sum() > 0:
        return 0.0
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    statistic = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), statistic / 2))


@torch.no_grad()
def exact_law(model, label: int, sampling: SamplingConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence of `length` tokens over a LlamaGen token model's vocabulary [N, length]
    and its probability under `sampling` (teacher-forced full forwards, on the model's device)."""
    transformer = model.transformer
    device = next(transformer.parameters()).device
    vocab = transformer.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)), device=device)
    cond = torch.full((len(seqs),), label, device=device)
    logits_c, _ = transformer(seqs[:, :-1], cond)
    logits_u, _ = transformer(seqs[:, :-1], torch.full_like(cond, transformer.config.num_classes))
    index = torch.arange(length, device=device).expand(len(seqs), -1)
    probs = sampling.probs(Logits(logits_c, logits_u if sampling.uses_guidance else None), index)
    joint = probs.gather(-1, seqs[..., None]).squeeze(-1).double().prod(-1)
    return seqs, joint / joint.sum()
