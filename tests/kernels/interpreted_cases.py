"""The Triton kernels against their torch twins, case by case.

tests/kernels/test_kernels.py runs this file in a subprocess: under TRITON_INTERPRET=1 on the
CPU (always), and on a CUDA device without the interpreter (when there is one). The variable
must be set before triton is imported, which is why it is never set in the main test process.
By hand: TRITON_INTERPRET=1 python -m pytest --noconftest tests/kernels/interpreted_cases.py

Probabilities must agree to float32 rounding (the kernels sum and exponentiate in their own
order), supports and tokens exactly (the same noise gives the same token), n_acc exactly.
"""

import math
import os

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    raise RuntimeError("these cases need TRITON_INTERPRET=1 (set before triton is imported) or a CUDA device")
DEVICE = "cpu" if INTERPRET else "cuda"

if INTERPRET and np.lib.NumpyVersion(np.__version__) >= "2.4.0":
    # Triton 3.6's interpreter turns scalars (arrays of shape [1]) into ints with int(), which
    # NumPy 2.4 refuses, so `range(0, V, BLOCK)` over a runtime V fails with "only 0-dimensional
    # arrays can be converted to Python scalars" (triton-lang/triton#9171, fixed upstream by #9172).
    import triton.runtime.interpreter as interpreter

    _patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = _patch_lang_tensor

from mmgen.kernels import exponential_noise, sample_logits, verify_exact  # noqa: E402
from mmgen.kernels.sampling import sample_logits_triton  # noqa: E402
from mmgen.kernels.verify import verify_exact_triton  # noqa: E402
from mmgen.sampling import Logits, race  # noqa: E402


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def logits_case(rows, V, guided, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cond = torch.randn(rows, V, generator=g) * 3
    uncond = torch.randn(rows, V, generator=g) * 3 if guided else None
    scale = torch.tensor([1.0, 2.5, 4.0, 0.0])[torch.arange(rows) % 4]  # 1.0: cond bit for bit; 0.0: uncond
    to = lambda t: None if t is None else t.to(DEVICE, dtype)
    return Logits(to(cond), to(uncond)), scale.to(DEVICE)


def both(logits, scale, temperature, top_k, top_p, block=None, seed=0):
    """(twin, kernel) (probs, tokens) from the same noise."""
    noise = exponential_noise(logits.cond.shape, torch.Generator(DEVICE).manual_seed(seed), DEVICE)
    twin = sample_logits(logits, scale, noise, temperature, top_k, top_p, backend="twin")
    if block is None:
        kernel = sample_logits(logits, scale, noise, temperature, top_k, top_p, backend="triton")
    else:
        kernel = sample_logits_triton(logits, scale, noise, temperature, top_k, top_p, block=block)
    return twin, kernel, noise


def assert_same(twin, kernel):
    (tp, tt), (kp, kt) = twin, kernel
    assert kp.dtype == torch.float32 and kp.shape == tp.shape and kt.shape == tt.shape
    assert torch.equal(kp > 0, tp > 0), "different supports after top-k / top-p"
    torch.testing.assert_close(kp, tp, rtol=1e-5, atol=1e-8, equal_nan=True)
    assert torch.equal(kt, tt), f"tokens {kt.tolist()} != twin {tt.tolist()}"


SETTINGS = {  # guided, temperature, top_k, top_p
    "plain": (False, 1.0, 0, 1.0),
    "guided": (True, 0.7, 0, 1.0),
    "top-k": (True, 1.0, 50, 1.0),
    "top-p": (False, 1.3, 0, 0.8),
    "top-k+top-p": (True, 0.9, 100, 0.9),
    "greedy": (True, 0.0, 50, 0.9),
    "top-k 1": (False, 1.0, 1, 1.0),
    "top-k >= V": (True, 1.0, 5000, 1.0),
    "top-p 0.01": (True, 1.0, 0, 0.01),
}


# V = 1003 in one block, and in blocks of 256 (a partial last block) for the settings that use
# every pass (each interpreted block step costs milliseconds, so not all of them).
CASES = [(name, None) for name in SETTINGS] + [(name, 256) for name in ("guided", "top-k+top-p", "greedy")]


@pytest.mark.parametrize("name,block", CASES, ids=[f"{n}-{'one-block' if b is None else 'blocks-of-256'}" for n, b in CASES])
def test_sampling_matches_twin(name, block):
    guided, temperature, top_k, top_p = SETTINGS[name]
    logits, scale = logits_case(3 if block is None else 1, 1003, guided, seed=len(name))
    twin, kernel, _ = both(logits, scale, temperature, top_k, top_p, block)
    assert_same(twin, kernel)
    if temperature == 0:
        assert torch.equal(kernel[0].argmax(-1), kernel[1]) and bool((kernel[0].sum(-1) == 1).all())


def test_sampling_small_vocabulary_and_leading_axes():
    """[B, n, V] logits with a [B, n] scale (the decoding loop's layout), V = 64."""
    logits, _ = logits_case(4, 64, True, seed=3)
    logits = Logits(logits.cond.view(2, 2, 64), logits.uncond.view(2, 2, 64))
    scale = torch.tensor([[1.0, 2.0], [0.5, 7.5]], device=DEVICE)
    twin, kernel, _ = both(logits, scale, 0.8, 10, 1.0)
    assert kernel[0].shape == (2, 2, 64) and kernel[1].shape == (2, 2)
    assert_same(twin, kernel)


def test_top_k_keeps_every_tie_of_the_kth_logit():
    """Integer logits tie everywhere; the k-th value's ties all stay, -0.0 and 0.0 included."""
    g = torch.Generator().manual_seed(5)
    cond = torch.randint(-4, 5, (3, 1003), generator=g).float()
    cond[2] = -1.0
    cond[2, :5] = 1.0
    cond[2, 10:14] = 0.0
    cond[2, 20:24] = -0.0  # the 7th largest is a zero: all eight zeros stay
    twin, kernel, _ = both(Logits(cond.to(DEVICE)), None, 1.0, 7, 1.0)
    assert_same(twin, kernel)
    assert int((kernel[0][2] > 0).sum()) == 13
    # Greedy over maxima tied across blocks: the first one, as torch.argmax.
    assert_same(*both(Logits(cond.to(DEVICE)), None, 0.0, 0, 1.0, block=256)[:2])


def test_unit_scale_is_the_cond_logits_bit_for_bit():
    """Where the scale is 1 the core returns cond itself (u + 1 (c - u) would cancel: with
    |u| ~ 1e8 nothing of c survives); where it is 0, uncond."""
    g = torch.Generator().manual_seed(6)
    cond, uncond = torch.randn(2, 1003, generator=g) * 3, torch.randn(2, 1003, generator=g) * 1e8
    uncond[1] = torch.randn(1003, generator=g) * 3
    logits, scale = Logits(cond.to(DEVICE), uncond.to(DEVICE)), torch.tensor([1.0, 0.0], device=DEVICE)
    assert_same(*both(logits, scale, 1.0, 20, 1.0)[:2])


def test_top_p_boundary_inside_a_tie():
    """3 tokens at logit 2, 10 tied at 1, the rest at -5; top_p = 0.55 falls inside the tie:
    the core keeps 4 of the 10 (which 4 follows its sort, not stable on the CPU); the kernel
    keeps the first 4 in vocabulary order, with the same probabilities."""
    cond = torch.full((1, 1003), -5.0)
    cond[0, [7, 500, 900]] = 2.0
    tied = torch.tensor([3, 50, 51, 200, 333, 600, 601, 777, 901, 1002])
    cond[0, tied] = 1.0
    (tp, _), (kp, kt), noise = both(Logits(cond.to(DEVICE)), None, 1.0, 0, 0.55, block=256)
    assert int((tp > 0).sum()) == int((kp > 0).sum()) == 7
    torch.testing.assert_close(kp.sort(-1).values, tp.sort(-1).values, rtol=1e-5, atol=1e-8)
    assert (kp[0, tied] > 0).tolist() == [True] * 4 + [False] * 6
    assert torch.equal(kt, race(kp, noise))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's NumPy on -inf - -inf
def test_bfloat16_masked_and_all_masked_rows():
    """bf16 logits (ties galore), tokens masked to -inf, and a row with nothing left: the twin's
    probabilities are NaN there (the core flags it, `invalid_rows`); the kernel's too."""
    logits, _ = logits_case(3, 1003, False, seed=9, dtype=torch.bfloat16)
    cond = logits.cond.clone()
    cond[0, ::7] = -math.inf
    cond[2] = -math.inf
    for top_k, top_p, block in [(40, 0.9, None), (0, 1.0, 256)]:
        twin, kernel, _ = both(Logits(cond), None, 1.0, top_k, top_p, block)
        assert_same(twin, kernel)
        assert bool(kernel[0][2].isnan().all()) and bool((kernel[0][0, ::7] == 0).all())


def test_sampling_150k_vocabulary():
    """A text-model vocabulary: bf16 CFG logits, top-k 2000 then top-p 0.95, and no filters."""
    logits, _ = logits_case(1, 150_000, True, seed=11, dtype=torch.bfloat16)
    block = 65536 if INTERPRET else None  # the interpreter pays per block step, not per element
    for top_k, top_p in [(2000, 0.95), (0, 1.0)]:
        twin, kernel, _ = both(logits, torch.tensor([3.0], device=DEVICE), 1.0, top_k, top_p, block)
        assert_same(twin, kernel)


# --------------------------------------------------------------------------------------------
# Verify (exact rule)
# --------------------------------------------------------------------------------------------


def verify_case(B, n, V, seed=0, onehot_q=False):
    """Target laws with top-k style zeros and drafts drawn from draft laws q near them, or (one-hot
    q, as Jacobi's carried-over samples) from a sharper p itself, so that some pass. Row 0
    accepts everything (bonus), row 1 rejects at once, row 2 rejects with p == q (an empty
    residual: the core falls back to p)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, n, V, generator=g) * (5 if onehot_q else 2)
    logits[..., ::5] = -math.inf
    p = logits.softmax(-1)
    q = (0.6 * logits + 0.8 * torch.randn(B, n, V, generator=g)).softmax(-1)
    drafts = torch.multinomial((p if onehot_q else q).view(-1, V), 1, generator=g).view(B, n)
    if onehot_q:
        q = torch.nn.functional.one_hot(drafts, V).float()
    uniforms = torch.rand(B, n, generator=g)
    uniforms[0] = 0.0
    uniforms[1, 0] = 1.0
    q[2, 0] = p[2, 0]
    uniforms[2, 0] = 1.0
    bonus = torch.randint(0, V, (B,), generator=g)
    noise = exponential_noise((B, n, V), g, "cpu")
    return [t.to(DEVICE) for t in (p, q, drafts, uniforms, noise, bonus)]


def assert_same_verify(case, block=None, slice_p=None):
    p, q, drafts, uniforms, noise, bonus = case
    n_acc, token = verify_exact(p, q, drafts, uniforms, noise, bonus, backend="twin")
    if slice_p is not None:
        p = slice_p
    if block is None:
        k_acc, k_token = verify_exact(p, q, drafts, uniforms, noise, bonus, backend="triton")
    else:
        k_acc, k_token = verify_exact_triton(p, q, drafts, uniforms, noise, bonus, block=block)
    assert torch.equal(k_acc, n_acc), f"n_acc {k_acc.tolist()} != twin {n_acc.tolist()}"
    assert torch.equal(k_token, token), f"tokens {k_token.tolist()} != twin {token.tolist()}"
    return n_acc, token


@pytest.mark.parametrize("block", [None, 256], ids=["one-block", "blocks-of-256"])
@pytest.mark.parametrize("onehot_q", [False, True], ids=["q-spread", "q-one-hot"])
def test_verify_matches_twin(block, onehot_q):
    B, n, V = 8, 5, 1003
    case = verify_case(B, n, V, seed=1 + onehot_q, onehot_q=onehot_q)
    n_acc, token = assert_same_verify(case, block)
    assert n_acc[0] == n and token[0] == case[5][0]  # every draft passed: the bonus token
    assert n_acc[1] == 0 and n_acc[2] == 0
    p, noise = case[0], case[4]
    assert token[2] == race(p[2, 0], noise[2, 0])  # empty residual: drawn from p
    assert len(set(n_acc.tolist())) >= 3, "the case should exercise several prefix lengths"


@pytest.mark.parametrize("n", [1, 16])
def test_verify_window_sizes_and_strided_p(n):
    """p as the loop passes it: p[:, :-1] of the target's [B, n + 1, V] laws (not contiguous)."""
    p, q, drafts, uniforms, noise, bonus = verify_case(4, n, 300, seed=n)
    full = torch.cat([p, p[:, :1]], 1)
    assert_same_verify((p, q, drafts, uniforms, noise, bonus), slice_p=full[:, :-1])


def test_verify_150k_vocabulary():
    case = verify_case(3, 4, 150_000, seed=4)
    assert_same_verify(case, block=65536 if INTERPRET else None)


# --------------------------------------------------------------------------------------------
# The decoding loop: its kernel step (mmgen.kernels.step) decodes what its torch path decodes
# --------------------------------------------------------------------------------------------

from mmgen.decoding import DraftSpeculative, make_decoder  # noqa: E402
from mmgen.decoding.batching import Request, continuous_decode  # noqa: E402
from mmgen.image_ar.llamagen import LlamaGenTokenModel  # noqa: E402
from mmgen.kernels import grouped as grouped_kernels, relaxed as relaxed_kernels, sampling as sampling_kernels, verify as verify_kernels  # noqa: E402,E501
from mmgen.sampling import SamplingConfig, make_generator  # noqa: E402

from tests.conftest import tiny_transformer  # noqa: E402

MODEL = LlamaGenTokenModel(tiny_transformer(output_std=1.5).to(DEVICE))
# Flatter laws, where the lossy rules move mass; a random codebook gives LANTERN its neighbours
# (GSD groups by the token embeddings).
FLAT = LlamaGenTokenModel(tiny_transformer(output_std=0.5).to(DEVICE), codebook=torch.randn(32, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE))
DRAFTER = LlamaGenTokenModel(tiny_transformer(output_std=0.3).to(DEVICE))  # a flatter head: some drafts pass
# No top-k in the loop cases: its 32 counting passes per row are slow under the interpreter, and
# the sampling cases above check it.
LOOP_SAMPLING = {"sampled": SamplingConfig(temperature=0.9, guidance=3.0), "greedy": SamplingConfig(temperature=0.0, guidance=4.0)}
LOOP_DECODERS = {
    "ar": lambda: make_decoder("ar"),
    "sjd": lambda: make_decoder("sjd", window=6, adapt=False),
    "sjd-adaptive": lambda: make_decoder("sjd", window=6),
    "draft-model": lambda: DraftSpeculative(DRAFTER, num_draft=3),  # samples only the bonus slot
}
LOSSY_DECODERS = {  # on FLAT; thresholds at which groups and neighbourhoods form
    "gsd": lambda: make_decoder("gsd", window=6, adapt=False, prob_threshold=0.3, distance_threshold=60.0),
    "lantern": lambda: make_decoder("lantern", window=6, adapt=False, k=8, delta=0.3),
    "lantern++": lambda: make_decoder("lantern++", window=6, adapt=False, k=8, lam=4.0),
}


def decode_both(monkeypatch, run):
    """(torch path's output, kernel step's output, kernel launches) of `run()`, from the same seeds."""
    monkeypatch.setenv("MMGEN_KERNELS", "twin")
    twin = run()
    launches = []
    for module, name in [(sampling_kernels, "_sample_kernel"), (verify_kernels, "_verify_kernel"), (grouped_kernels, "_grouped_kernel"),
                         (relaxed_kernels, "_prefix_kernel"), (relaxed_kernels, "_target_kernel")]:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, _Counted(kernel, name, launches))
    monkeypatch.setenv("MMGEN_KERNELS", "triton")
    return twin, run(), launches


class _Counted:
    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("sampling", list(LOOP_SAMPLING))
@pytest.mark.parametrize("name", list(LOOP_DECODERS))
def test_the_loop_decodes_the_same_tokens_with_its_kernel_step(monkeypatch, name, sampling):
    decoder, config = LOOP_DECODERS[name](), LOOP_SAMPLING[sampling]
    labels = torch.tensor([1, 5], device=DEVICE)
    run = lambda: decoder.generate(MODEL, labels, 16, config, make_generator(3, DEVICE))
    twin, kernel, launches = decode_both(monkeypatch, run)
    assert torch.equal(kernel.tokens, twin.tokens)
    assert kernel.stats.accepted_histogram == twin.stats.accepted_histogram and kernel.stats.forwards == twin.stats.forwards
    # Every decode forward ran the sampling kernel (the prefill's token 0 is the torch path's),
    # and every forward with drafts the verify kernel, but greedy ones: a one-hot law accepts a
    # draft exactly when it is the argmax, compared without a kernel or a draw.
    assert launches.count("_sample_kernel") == twin.stats.forwards - 1
    assert ("_verify_kernel" in launches) == (name != "ar" and sampling != "greedy")
    histogram = twin.stats.accepted_histogram
    assert name == "ar" or (histogram[1] > 0 and sum(histogram[2:]) > 0), "the case should reject and accept drafts"


def test_continuous_batching_with_the_kernel_step(monkeypatch):
    decoder = make_decoder("sjd", window=6, adapt=False)
    config = LOOP_SAMPLING["sampled"]
    requests = lambda: [Request(torch.tensor([label], device=DEVICE), make_generator(10 + i, DEVICE)) for i, label in enumerate([1, 5, 7])]
    run = lambda: continuous_decode(decoder, MODEL, requests(), 16, config, batch_size=2)[0]
    twin, kernel, launches = decode_both(monkeypatch, run)
    assert [f.index for f in kernel] == [f.index for f in twin]
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(kernel, twin)) and "_verify_kernel" in launches


# --------------------------------------------------------------------------------------------
# GSD's relaxed target
# --------------------------------------------------------------------------------------------

from mmgen.decoding import GroupedAcceptance  # noqa: E402
from mmgen.decoding.acceptance import close_pairs  # noqa: E402
from mmgen.kernels import relaxed_target  # noqa: E402
from mmgen.kernels.grouped import grouped_target_triton  # noqa: E402


def grouped_case(rows, V, seed, top_k=0):
    """A bound GSD rule whose groups are plentiful (2-d embeddings: many close pairs) and laws
    p, q [rows, V] with near-equal probabilities (flat logits), top-k zeros in both."""
    g = torch.Generator().manual_seed(seed)
    rule = GroupedAcceptance(prob_threshold=0.002 if V > 100 else 0.5, close=close_pairs(torch.randn(V, 2, generator=g), 0.5 if V > 100 else 4.0))
    logits = torch.randn(2, rows, V, generator=g) * 0.5
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[..., -1:], float("-inf"))
    p, q = logits.softmax(-1).to(DEVICE)
    return rule, p, q


@pytest.mark.parametrize("V,top_k,block", [(300, 0, None), (300, 40, 128), (1000, 100, None), (5, 0, None)],
                         ids=["V300", "V300-top-k-blocks-of-128", "V1000-top-k", "V5-window-past-the-vocabulary"])
def test_grouped_target_matches_twin_bit_for_bit(V, top_k, block):
    rule, p, q = grouped_case(6, V, seed=V + top_k, top_k=top_k)
    twin = relaxed_target(rule, p, q, backend="twin")
    kernel = grouped_target_triton(rule, p, q, block=block)
    assert torch.equal(kernel, twin)
    assert not torch.equal(twin, p), "the case should move mass"


def test_grouped_target_keeps_leading_axes():
    rule, p, q = grouped_case(6, 300, seed=1)
    p, q = p.view(2, 3, 300), q.view(2, 3, 300)
    assert torch.equal(relaxed_target(rule, p, q, backend="triton"), relaxed_target(rule, p, q, backend="twin"))


@pytest.mark.parametrize("name", list(LOSSY_DECODERS))
def test_lossy_rules_decode_the_same_tokens_with_the_kernel_step(monkeypatch, name):
    """GSD, LANTERN and LANTERN++ (bounded) through the kernel step: the exact verify against
    the relaxed target from its kernels (GSD's bit for bit, LANTERN's to float32 rounding).
    Sampled only: greedy laws are one-hot, and a one-hot law moves no mass."""
    decoder, config = LOSSY_DECODERS[name](), LOOP_SAMPLING["sampled"]
    labels = torch.tensor([1], device=DEVICE)  # one row: the interpreter runs a program per row and block
    # A seed whose decode the rule changes (not SJD's tokens), so the comparison has teeth; which
    # seeds do depends on the device's random stream (seed 3 does on the CPU, not on an H200).
    sjd = make_decoder("sjd", window=6, adapt=False)
    monkeypatch.setenv("MMGEN_KERNELS", "twin")
    seed = next((s for s in range(3, 13) if not torch.equal(
        decoder.generate(FLAT, labels, 16, config, make_generator(s, DEVICE)).tokens,
        sjd.generate(FLAT, labels, 16, config, make_generator(s, DEVICE)).tokens)), None)
    assert seed is not None, "the rule should move mass: on seeds 3..12 it decodes SJD's tokens"
    run = lambda: decoder.generate(FLAT, labels, 16, config, make_generator(seed, DEVICE))
    twin, kernel, launches = decode_both(monkeypatch, run)
    assert torch.equal(kernel.tokens, twin.tokens) and kernel.stats.accepted_histogram == twin.stats.accepted_histogram
    assert "_verify_kernel" in launches and ("_grouped_kernel" in launches) == (name == "gsd")
    assert ("_target_kernel" in launches) == name.startswith("lantern")


# --------------------------------------------------------------------------------------------
# LANTERN's relaxed target
# --------------------------------------------------------------------------------------------

from mmgen.decoding import RelaxedAcceptance  # noqa: E402
from mmgen.decoding.acceptance import nearest_neighbours  # noqa: E402
from mmgen.kernels.relaxed import relaxed_target_triton  # noqa: E402


def relaxed_case(rows, V, k, seed, top_k=0, lam=None, delta=0.1):
    g = torch.Generator().manual_seed(seed)
    rule = RelaxedAcceptance(k=k, delta=delta, lam=lam, neighbours=nearest_neighbours(torch.randn(V, 4, generator=g), k))
    logits = torch.randn(2, rows, V, generator=g) * 1.5
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[..., -1:], float("-inf"))
    p, q = logits.softmax(-1).to(DEVICE)
    return rule, p, q


@pytest.mark.parametrize("V,k,top_k,lam,block", [(300, 20, 0, None, None), (300, 70, 40, None, 64), (600, 60, 150, None, None),
                                                 (300, 20, 0, 2.0, None), (7, 6, 0, None, None)],
                         ids=["V300-k20", "V300-k70-top-k-blocks-of-64", "V600-k60-top-k", "lantern++", "k-is-V-1"])
def test_relaxed_target_matches_twin(V, k, top_k, lam, block):
    rule, p, q = relaxed_case(3, V, k, seed=V + k + top_k, top_k=top_k, lam=lam)
    twin = relaxed_target(rule, p, q, backend="twin")
    kernel = relaxed_target_triton(rule, p, q, block=block)
    torch.testing.assert_close(kernel, twin, rtol=1e-5, atol=1e-8)
    assert torch.equal(kernel > 0, twin > 0)
    assert (twin - p).abs().sum() > 0.01, "the case should move mass"
    assert torch.allclose(kernel.sum(-1), torch.ones(3, device=DEVICE), atol=1e-5)  # pi is a law
