"""Compiled decode steps (`mmgen.compile`, `LlamaGenTokenModel(compile=True)`, `--compile`).

Inductor on the CPU takes seconds per graph, so every test here decodes the same tiny model at
the same shapes (batch 2 with guidance: 4 rows; an AR step and a 4-token verify window) and
the whole file compiles two graphs; the later tests hit torch's compile cache.
"""

import pytest
import torch

from mmgen.cache import StaticKVCache
from mmgen.cli import main
from mmgen.compile import CachePool, CompiledStep, compile_mode
from mmgen.decoding import Autoregressive, SpeculativeJacobi
from mmgen.image_ar.llamagen import LlamaGenTokenModel
from mmgen.sampling import SamplingConfig

from tests.conftest import tiny_pipeline, tiny_transformer

LABELS = torch.tensor([1, 5])
NUM_TOKENS = 16  # tiny_pipeline's 4x4 grid
SAMPLINGS = {"greedy": SamplingConfig(top_k=1, guidance=4.0), "sampled": SamplingConfig(temperature=1.0, guidance=4.0)}
DECODERS = {"ar": Autoregressive(), "sjd": SpeculativeJacobi(window=4)}


@pytest.fixture(scope="module")
def models():
    """(eager, compiled) token models of one tiny transformer."""
    transformer = tiny_transformer(block_size=NUM_TOKENS)
    return LlamaGenTokenModel(transformer), LlamaGenTokenModel(transformer, compile=True)


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("guidance", [True, False])
def test_a_decode_step_is_one_graph_without_breaks(models, width, guidance):
    eager, _ = models
    with torch.no_grad():
        state = eager.start(LABELS, NUM_TOKENS + 8, guidance)
        tokens = torch.randint(0, eager.vocab_size, (2, width))
        explained = torch._dynamo.explain(eager.forward)(state, tokens)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("decoder", list(DECODERS))
def test_compiled_decodes_equal_eager_ones(models, decoder, sampling):
    eager, compiled = models
    assert isinstance(compiled.forward, CompiledStep) and compiled.forward.mode is None  # the CPU: inductor's default
    run = lambda model: DECODERS[decoder].generate(model, LABELS, NUM_TOKENS, SAMPLINGS[sampling],
                                                   torch.Generator().manual_seed(3))
    expected, out = run(eager), run(compiled)
    assert torch.equal(out.tokens, expected.tokens)
    assert out.stats.forwards == expected.stats.forwards
    with torch.no_grad():  # the logits themselves agree to rounding
        states = [m.start(LABELS, NUM_TOKENS + 8, True) for m in models]
        tokens = torch.randint(0, eager.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
        a, b = (m.forward(s, tokens) for m, s in zip(models, states))
    torch.testing.assert_close(b.cond, a.cond, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.uncond, a.uncond, rtol=1e-5, atol=1e-5)


def test_the_cache_writes_the_same_under_compile(monkeypatch):
    """Traced, `StaticKVCache.update` writes with one index_put_ (in place under inductor); run
    eagerly here, it writes what the scatter_ path does, bit for bit."""
    positions = torch.tensor([[3, 4, 5], [0, 1, 2]])
    k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    caches = [StaticKVCache(2, 2, 2, 8, 4) for _ in range(2)]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = caches[0].update(1, positions, k, v)
    monkeypatch.undo()
    eager = caches[1].update(1, positions, k, v)
    assert all(torch.equal(a, b) for a, b in zip(traced, eager))
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    assert caches[1].k[1, 0, :, 3:6].eq(k[0]).all() and caches[1].k[0].eq(0).all()


def test_compiled_models_pool_their_caches_between_decodes(models):
    _, compiled = models
    first = compiled.start(LABELS, NUM_TOKENS, True)
    held = compiled.start(LABELS, NUM_TOKENS, True)  # `first` is alive: a fresh cache
    assert held.cache is not first.cache
    pooled, first = held.cache, None
    del held
    again = compiled.start(LABELS, NUM_TOKENS, True)
    assert again.cache is pooled
    fresh = LlamaGenTokenModel(compiled.transformer).start(LABELS, NUM_TOKENS, True)
    for name in ("k", "v", "lengths", "key_padding"):  # cleared: as a freshly allocated cache
        assert torch.equal(getattr(again.cache, name), getattr(fresh.cache, name)), name
    assert compiled.start(LABELS, NUM_TOKENS + 1, True).cache is not pooled  # another size, another cache


def test_cache_pool_lends_one_cache_per_live_state():
    class Cache:
        cleared = 0

        def clear(self):
            self.cleared += 1

    class State:
        pass

    pool, made = CachePool(), []
    make = lambda: made.append(Cache()) or made[-1]
    cache = pool.take("k", make)
    state = State()
    pool.lend("k", cache, state)
    assert pool.take("k", make) is not cache
    del state
    assert pool.take("k", make) is cache and cache.cleared == 1


def test_compile_mode_by_device():
    assert compile_mode("cuda:0") == "reduce-overhead"
    assert compile_mode("cpu") is None


def test_pipeline_compile_keeps_one_compiled_token_model():
    pipe = tiny_pipeline()
    assert not pipe.token_model().compiled
    assert pipe.compile() is pipe
    model = pipe.token_model()
    assert model.compiled and pipe.token_model() is model
    assert not pipe.compile(False).token_model().compiled
    with pytest.raises(ValueError, match="True or False"):
        pipe.compile("yes")


def test_generate_image_compile_flag_writes_the_eager_images(tmp_path, capsys):
    tiny_pipeline().save_pretrained(tmp_path / "model")
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        args = ["generate", "image", "--model", str(tmp_path / "model"), "--class-labels", "1", "5", "--decoding", "sjd:window=4",
                "--out", str(tmp_path / name), "--no-progress", *extra]
        assert main(args) == 0, capsys.readouterr().err
    eager, compiled = (sorted((tmp_path / name).iterdir()) for name in ("eager", "compiled"))
    assert [p.name for p in eager] == [p.name for p in compiled]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(eager, compiled))


def test_compile_flag_on_a_model_without_compiled_steps_is_a_clear_error(tmp_path, capsys):
    from mmgen.image_ar.var import VARPipeline
    from tests.image_ar.test_var_pipeline import tiny_transformer as tiny_var, tiny_vqvae

    VARPipeline(tiny_var(), tiny_vqvae()).save_pretrained(tmp_path / "var")
    args = ["generate", "image", "--model", str(tmp_path / "var"), "--class-labels", "1", "--out", str(tmp_path / "out"),
            "--no-progress", "--compile"]
    assert main(args) == 2
    assert "VARPipeline has no compiled decode steps" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
