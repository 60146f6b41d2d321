"""What only CUDA runs: compiled steps (inductor with CUDA graphs, `reduce-overhead`) equal to
eager ones, and the Triton kernels against their torch twins, case by case and in whole
decodes. On the CPU each skips, naming the test that covers it there.
"""

from __future__ import annotations

import pytest
import torch

from mmgen.decoding import Autoregressive, SpeculativeJacobi, make_decoder
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import make_generator

from tests.conftest import tiny_transformer
from tests.device.parity import needs_cuda
from tests.device.test_core import GREEDY, SAMPLED, model_on

pytestmark = pytest.mark.device


@pytest.fixture(scope="module")
def compiled_pair(device):
    """(eager, compiled) token models of one tiny transformer: both tests reuse its graphs (an
    AR step and a 4-token window; each width compiles once)."""
    needs_cuda(device, "tests/core/test_compiled_steps.py checks inductor (CUDA graphs need a GPU)")
    transformer = tiny_transformer(block_size=16).to(device)
    return LlamaGenTokenModel(transformer), LlamaGenTokenModel(transformer, compile=True)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_compiled_steps_equal_eager_ones(device, compiled_pair, sampling):
    from mmgen.compile import CompiledStep

    eager, compiled = compiled_pair
    labels = torch.tensor([1, 5], device=device)
    for decoder in (Autoregressive(), SpeculativeJacobi(window=4, adapt=False)):
        run = lambda model: decoder.generate(model, labels, 16, sampling, make_generator(3, device))
        expected, out = run(eager), run(compiled)
        assert torch.equal(out.tokens, expected.tokens) and out.stats.forwards == expected.stats.forwards
    assert isinstance(compiled.forward, CompiledStep) and compiled.forward.mode == "reduce-overhead"
    with torch.no_grad():
        states = [m.start(labels, 24, True) for m in (eager, compiled)]
        tokens = torch.randint(0, 32, (2, 4), generator=make_generator(0), dtype=torch.long).to(device)
        a, b = (m.forward(s, tokens) for m, s in zip((eager, compiled), states))
    torch.testing.assert_close(b.cond, a.cond, rtol=1e-5, atol=1e-5)


def test_triton_kernels_match_their_twins_case_by_case(device):
    needs_cuda(device, "tests/kernels/test_kernels.py runs these cases under Triton's interpreter")
    from tests.kernels.test_kernels import run

    result = run("-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider", "tests/kernels/interpreted_cases.py")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("name", ["ar", "sjd", "lantern", "gsd"])
def test_decodes_through_the_kernels_equal_the_torch_path(device, name, monkeypatch):
    """The same seed through the Triton kernels (CUDA's default) and through their twins
    (MMGEN_KERNELS=twin): the same tokens, greedy and sampled (tiny vocabulary: no float32
    near-ties to split them)."""
    needs_cuda(device, "the decoders run the kernels' twins, which are their torch path")
    from mmgen.kernels import backend_for

    assert backend_for(torch.zeros(1, device=device)) == "triton"
    model, labels = model_on(device, output_std=1.5), torch.tensor([1, 2, 3], device=device)
    decoder = make_decoder(name) if name == "ar" else make_decoder(name, adapt=False, window=8)
    for sampling in (GREEDY, SAMPLED):
        kernels = decoder.generate(model, labels, 64, sampling, make_generator(5, device))
        monkeypatch.setenv("MMGEN_KERNELS", "twin")
        twins = decoder.generate(model, labels, 64, sampling, make_generator(5, device))
        monkeypatch.delenv("MMGEN_KERNELS")
        assert torch.equal(kernels.tokens, twins.tokens)
