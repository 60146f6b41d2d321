"""mmgen.kernels: the twins are the core's own code path, the dispatch picks the right one, and
the Triton kernels agree with the twins (interpreted_cases.py, in a subprocess: under
TRITON_INTERPRET=1 on the CPU, and on CUDA when a device is present)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmgen.decoding import ExactAcceptance
from mmgen.decoding.finalise import finalise
from mmgen.kernels import backend_for, exponential_noise, sample_logits, verify_exact
from mmgen.sampling import ConstantGuidance, IntervalGuidance, Logits, SamplingConfig, sample

ROOT = Path(__file__).parents[2]


def run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    """A fresh Python process: TRITON_INTERPRET is read when triton is imported, so the
    interpreter is switched on per process, never in this one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", **({"TRITON_INTERPRET": "1"} if interpret else {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.parametrize("mode", ["interpreter", "cuda"])
def test_triton_kernels_match_twins(mode):
    if mode == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the kernels were checked under the interpreter only")
    result = run("-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "tests/kernels/interpreted_cases.py",
                 interpret=mode == "interpreter")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("guidance", [ConstantGuidance(1.0), IntervalGuidance(3.0, 1)])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 20, 0.9), (0.0, 0, 1.0)])
def test_sampling_twin_is_the_core_path(guidance, temperature, top_k, top_p):
    """SamplingConfig.probs + sample with a generator == the twin fed the noise drawn from the
    same generator state, bit for bit."""
    g = torch.Generator().manual_seed(0)
    logits = Logits(torch.randn(2, 4, 100, generator=g), torch.randn(2, 4, 100, generator=g))
    index = torch.arange(4).expand(2, 4)
    config = SamplingConfig(temperature, top_k, top_p, guidance)
    probs = config.probs(logits, index)
    tokens = sample(probs, torch.Generator().manual_seed(7))
    noise = exponential_noise(probs.shape, torch.Generator().manual_seed(7), probs.device)
    twin_probs, twin_tokens = sample_logits(logits, guidance.scales(index), noise, temperature, top_k, top_p)
    assert torch.equal(twin_probs, probs) and torch.equal(twin_tokens, tokens)


def test_verify_twin_is_the_core_path():
    """The loop's verify + finalise (ExactAcceptance with its uniform draws, the bonus sample,
    the residual samples, `finalise`) == the twin fed the same draws, in the loop's order."""
    B, n, V = 5, 4, 50
    g = torch.Generator().manual_seed(1)
    p = (torch.randn(B, n + 1, V, generator=g) * 2).softmax(-1)
    q = (p[:, :-1].log() + torch.randn(B, n, V, generator=g)).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, n)

    core = torch.Generator().manual_seed(3)
    accepted, residual = ExactAcceptance()(p[:, :-1], q, drafts, core)
    fresh = sample(p[:, -1:], core)
    n_acc, token, _ = finalise(accepted, sample(residual, core), fresh, drafts, 1)

    same = torch.Generator().manual_seed(3)
    uniforms = torch.rand((B, n), generator=same)
    bonus = sample(p[:, -1:], same)[:, 0]
    noise = exponential_noise((B, n, V), same, p.device)
    twin = verify_exact(p[:, :-1], q, drafts, uniforms, noise, bonus)
    assert torch.equal(twin[0], n_acc) and torch.equal(twin[1], token)
    assert len(set(n_acc.tolist())) >= 2


def test_dispatch_choice(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("MMGEN_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert backend_for(cpu) == "twin"
    monkeypatch.setenv("MMGEN_KERNELS", "twin")
    assert backend_for(cpu) == "twin"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        backend_for(cpu, "triton")  # no GPU and no interpreter: a clear error, not a driver crash
    monkeypatch.setenv("MMGEN_KERNELS", "fast")
    with pytest.raises(ValueError, match="kernel backend"):
        backend_for(cpu)
    if torch.cuda.is_available():
        assert backend_for(torch.zeros(1, device="cuda"), "auto") == "triton"
        assert backend_for(torch.zeros(1, device="cuda"), "twin") == "twin"


def test_kernels_compile_for_a_gpu():
    """The interpreter runs Python, not Triton's compiler: a kernel can pass it and still not
    lower (an int32 literal overflow did). Compile the kernels to an sm_90 cubin with triton's
    own ptxas, which needs no GPU, and check that nothing fused a multiply-add into guidance."""
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mmgen.kernels.sampling import _sample_kernel
from mmgen.kernels.verify import _verify_kernel
from mmgen.kernels.grouped import _grouped_kernel
from mmgen.kernels.relaxed import _prefix_kernel, _target_kernel

def build(kernel, types, constants):
    signature = {**types, **{name: "constexpr" for name in constants}}
    options = {"num_warps": 8, "enable_fp_fusion": False}
    return triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32), options=options)

types = dict(cond="*bf16", uncond="*bf16", scale="*fp32", noise="*fp32", out="*fp32", token="*i64", V="i32", stride_c="i32",
             stride_u="i32", stride_e="i32", temperature="fp32", top_k="i32", top_p="fp32")
for greedy in (False, True):
    compiled = build(_sample_kernel, types, dict(GUIDED=True, GREEDY=greedy, RECIPROCAL=True, TOP_K=True, TOP_P=True, BLOCK=2048))
    assert compiled.asm["cubin"] and "fma.rn.f32" not in compiled.asm["ptx"]
types = dict(p="*fp32", q="*fp32", drafts="*i64", uniforms="*fp32", noise="*fp32", bonus="*i64", n_acc="*i64", token="*i64",
             **{name: "i32" for name in ["n", "V", "sp_b", "sp_n", "sq_b", "sq_n", "se_b", "se_n"]})
assert build(_verify_kernel, types, dict(BLOCK_N=16, BLOCK=2048)).asm["cubin"]
types = dict(sorted_p="*fp32", sorted_idx="*i64", q="*fp32", bits="*u8", out="*fp32", V="i32", threshold="fp32")
compiled = build(_grouped_kernel, types, dict(REACH=7, BLOCK=1024))
assert compiled.asm["cubin"] and "fma.rn.f32" not in compiled.asm["ptx"]  # pi = p (1 - claimed) + q moved_in, unfused
types = dict(p="*fp32", q="*fp32", neighbours="*i32", prefix="*i32", moved_in="*fp32", V="i32", k="i32", budget="fp32")
for lam in (False, True):
    assert build(_prefix_kernel, types, dict(LAM=lam, BLOCK=128, BLOCK_K=64)).asm["cubin"]
types = dict(p="*fp32", q="*fp32", starts="*i64", claimers="*i32", ranks="*i32", prefix="*i32", moved_in="*fp32", out="*fp32", V="i32")
compiled = build(_target_kernel, types, dict(BLOCK=128))
assert compiled.asm["cubin"] and "fma.rn.f32" not in compiled.asm["ptx"]
print("ok")
"""
    result = run("-c", code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_import_never_needs_triton():
    """`import mmgen.kernels` imports no triton, and with triton missing both ops still run (twins)."""
    code = """
import sys
import mmgen.kernels
assert "triton" not in sys.modules, "import mmgen.kernels imported triton"
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
from mmgen.kernels import exponential_noise, sample_logits, verify_exact
from mmgen.sampling import Logits
g = torch.Generator().manual_seed(0)
probs, tokens = sample_logits(Logits(torch.randn(3, 10)), None, exponential_noise((3, 10), g, "cpu"), 0.7, 4, 0.9)
assert tokens.shape == (3,) and torch.allclose(probs.sum(-1), torch.ones(3))
p = torch.rand(2, 3, 10).softmax(-1)
drafts, uniforms, noise = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3, 10)
n_acc, token = verify_exact(p, p, drafts, uniforms, noise, torch.tensor([4, 5]))
assert n_acc.tolist() == [3, 3] and token.tolist() == [4, 5]
print("ok")
"""
    result = run("-c", code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
