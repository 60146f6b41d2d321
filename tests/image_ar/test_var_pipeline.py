"""VARPipeline on a tiny random VAR: the scale-model adapter, collaborative decoding (CoDe),
token pruning, sampling options and input checks."""

import pytest
import torch

from mmgen.decoding import CachedTokenPruning, Collaborative, NextScale
from mmgen.image_ar.var import MultiScaleVQVAE, VARConfig, VARPipeline, VARTransformer, VQVAEConfig
from mmgen.sampling import RampGuidance, SamplingConfig

PATCH_NUMS = (1, 2, 3, 4)


def tiny_transformer(depth=2, width=64, seed=0) -> VARTransformer:
    torch.manual_seed(seed)
    model = VARTransformer(VARConfig(depth=depth, embed_dim=width, num_heads=2, vocab_size=32, cvae=8,
                                     patch_nums=PATCH_NUMS, num_classes=10)).eval()
    with torch.no_grad():  # the official init makes the blocks near-identities and the head near zero
        for name, p in model.named_parameters():
            if "ada_lin" in name or name.startswith("head"):
                p.normal_(std=0.3)
    return model


def tiny_vqvae(seed=0) -> MultiScaleVQVAE:
    torch.manual_seed(seed)
    return MultiScaleVQVAE(VQVAEConfig(vocab_size=32, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                                       patch_nums=PATCH_NUMS)).eval()


@pytest.fixture(scope="module")
def pipe():
    p = VARPipeline(tiny_transformer(), tiny_vqvae(), class_names=[f"c{i}" for i in range(10)])
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def small(pipe):
    p = VARPipeline(tiny_transformer(depth=1, width=32, seed=1), pipe.vqvae)
    p.set_progress_bar_config(disable=True)
    return p


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_generates_images_and_every_scale(pipe):
    out = pipe([1, 2, 3], generator=gen(), output_type="pt")
    assert out.images.shape == (3, 3, 8, 8) and 0 <= out.images.min() and out.images.max() <= 1
    assert out.tokens.shape == (3, 30) and out.stats.forwards == 4 and out.stats.stage_forwards == [4]
    again = pipe([1, 2, 3], generator=gen(), output_type="pt")
    assert torch.equal(out.tokens, again.tokens) and torch.equal(out.images, again.images)
    assert not torch.equal(out.tokens, pipe([1, 2, 3], generator=gen(1), output_type="pt").tokens)
    assert len(pipe(1, generator=gen()).images) == 1


def test_small_model_prefill_equals_its_own_scale_by_scale_logits(pipe, small):
    """CoDe's hand-off: one block-causal prefill over the large model's maps gives the small
    model the logits it would have produced decoding those scales itself."""
    maps = [torch.randint(0, 32, (2, p * p), generator=gen(i)) for i, p in enumerate(PATCH_NUMS)]
    labels = torch.tensor([3, 7])
    for model in (small.scale_model(), pipe.scale_model()):
        for handoff in (1, 2, 3):
            state = model.start(labels, 4, guidance=True)
            step_logits = [model.forward(state, [])] + [model.forward(state, [m]) for m in maps[:handoff]]
            fresh = model.start(labels, 4, guidance=True)
            prefill = model.forward(fresh, maps[:handoff])
            torch.testing.assert_close(prefill.cond, step_logits[-1].cond, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(prefill.uncond, step_logits[-1].uncond, rtol=1e-5, atol=1e-5)
            # and the small model continues from there exactly as the model that decoded every scale
            if handoff < 3:
                torch.testing.assert_close(model.forward(fresh, [maps[handoff]]).cond, model.forward(state, [maps[handoff]]).cond,
                                           rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_collaborative_with_the_same_model_as_small_equals_plain_decoding(pipe, temperature):
    for seed in range(3):
        a = pipe([0, 5], decoding="ar", temperature=temperature, top_k=0, top_p=1.0, generator=gen(seed), output_type="pt")
        for n in (1, 2, 3):
            b = pipe([0, 5], decoding=Collaborative(small=pipe, large_steps=n), temperature=temperature, top_k=0, top_p=1.0,
                     generator=gen(seed), output_type="pt")
            assert torch.equal(a.tokens, b.tokens)
            assert b.stats.stage_forwards == [n, 4 - n]


def test_collaborative_decodes_first_scales_with_the_large_model_and_the_rest_with_the_small_one(pipe, small):
    big = pipe([0, 5], generator=gen(), output_type="pt")
    alone = small([0, 5], generator=gen(), output_type="pt")
    code = pipe([0, 5], decoding=Collaborative(small=small, large_steps=2), generator=gen(), output_type="pt")
    assert torch.equal(code.tokens[:, :5], big.tokens[:, :5])  # scales 0-1: the large model's, same noise
    assert not torch.equal(code.tokens, big.tokens) and not torch.equal(code.tokens, alone.tokens)
    # The large model's cache holds 2 scales (5 tokens); the small one's all 30.
    assert code.stats.cache_bytes == small.transformer.new_cache(4, 30).nbytes
    assert code.stats.cache_bytes < big.stats.cache_bytes


def test_collaborative_from_a_spec_needs_a_small_model(pipe):
    with pytest.raises(ValueError, match="needs a small model"):
        pipe([0], decoding="collaborative", generator=gen())


def test_old_collaborative_names_in_a_spec_load_the_small_model_and_decode_the_same(pipe, small, tmp_path):
    """`code:draft_steps=N,refiner=PATH` (the old names, read until 0.3) still loads the small model from
    PATH and decodes the tokens of `collaborative:large_steps=N,small=PATH`, warning once a name."""
    small.save_pretrained(tmp_path / "small")
    new = pipe([0, 5], decoding=f"collaborative:large_steps=2,small={tmp_path / 'small'}", generator=gen(), output_type="pt")
    with pytest.warns(DeprecationWarning) as caught:
        old = pipe([0, 5], decoding=f"code:draft_steps=2,refiner={tmp_path / 'small'}", generator=gen(), output_type="pt")
    assert sorted(str(w.message).split(": use ")[1] for w in caught) == ["'collaborative'", "large_steps=", "small="]
    assert torch.equal(old.tokens, new.tokens) and old.stats.stage_forwards == [2, 2]


def test_pruning_that_keeps_every_token_is_identical(pipe, small):
    for decoding in ("ar", Collaborative(small=small, large_steps=2)):
        a = pipe([0, 5], decoding=decoding, generator=gen(), output_type="pt")
        b = pipe([0, 5], decoding=decoding, pruning=CachedTokenPruning(keep={-1: 0.99, -2: 0.99}, layers=(0, None)),
                 generator=gen(), output_type="pt")
        assert torch.equal(a.tokens, b.tokens)


def test_pruning_changes_the_pruned_scale_only(pipe):
    policy = CachedTokenPruning(keep={-1: 0.25}, layers=(0, None))
    a = pipe([0, 5], temperature=0.0, generator=gen(), output_type="pt")
    b = pipe([0, 5], temperature=0.0, pruning=policy, generator=gen(), output_type="pt")
    assert torch.equal(a.tokens[:, :14], b.tokens[:, :14])
    assert b.stats.cache_bytes > 0


def test_ramp_guidance_and_presets(pipe):
    config = pipe.sampling_config()
    assert isinstance(config.guidance, RampGuidance) and config.guidance.scale == 1.5 and config.guidance.num_steps == 4
    assert (config.top_k, config.top_p) == (900, 0.96)
    demo = pipe.sampling_config(preset="demo")
    assert (demo.guidance.scale, demo.top_p) == (4.0, 0.95)
    assert pipe.sampling_config(guidance_scale=2.0, preset="demo").guidance.scale == 2.0
    with pytest.raises(ValueError, match="unknown preset"):
        pipe.sampling_config(preset="best")


def test_more_smooth_feeds_soft_maps(pipe):
    a = pipe([0, 5], generator=gen(), output_type="pt")
    b = pipe([0, 5], more_smooth=True, generator=gen(), output_type="pt")
    c = pipe([0, 5], more_smooth=True, generator=gen(), output_type="pt")
    assert torch.equal(b.images, c.images) and not torch.equal(a.images, b.images)
    # a one-hot soft map is the hard map
    vq = pipe.vqvae.quantize
    tokens = torch.randint(0, 32, (2, 4))
    hard = vq.add_scale(None, 1, tokens)
    soft = vq.add_scale(None, 1, torch.nn.functional.one_hot(tokens, 32).float())
    torch.testing.assert_close(hard[0], soft[0])
    torch.testing.assert_close(hard[1], soft[1])


def test_bad_inputs_are_clear_errors(pipe, small):
    with pytest.raises(ValueError, match="invalid class id"):
        pipe([10])
    with pytest.raises(ValueError, match="class_labels is empty"):
        pipe([])
    with pytest.raises(ValueError, match="image_size"):
        pipe([1], image_size=256)
    with pytest.raises(ValueError, match="unknown sampling defaults"):
        VARPipeline(pipe.transformer, pipe.vqvae, sampling_defaults={"cfg": 2})
    with pytest.raises(ValueError, match="does not match"):
        VARPipeline(pipe.transformer, MultiScaleVQVAE(VQVAEConfig(vocab_size=32, z_channels=8, ch=32, ch_mult=(1, 2),
                                                                  num_res_blocks=1, patch_nums=(1, 2, 4))))
    with pytest.raises(ValueError, match="step 0 cannot be pruned"):
        pipe([1], pruning=CachedTokenPruning(keep={0: 0.5}))
    with pytest.raises(ValueError, match="outside"):
        pipe([1], pruning=CachedTokenPruning(keep={7: 0.5}))
    with pytest.raises(ValueError, match="keep ratio"):
        CachedTokenPruning(keep={1: 1.5})
    with pytest.raises(ValueError, match="unknown class name"):
        pipe.class_index("dog")
    assert pipe.class_index("c3") == 3


def test_save_and_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "var", dtypes={"vqvae": torch.float16})
    loaded = VARPipeline.from_pretrained(tmp_path / "var")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.class_names == pipe.class_names
    ref = VARPipeline(pipe.transformer, loaded.vqvae)
    ref.set_progress_bar_config(disable=True)
    assert torch.equal(loaded([1, 2], generator=gen(), output_type="pt").tokens, ref([1, 2], generator=gen(), output_type="pt").tokens)


def test_next_scale_and_collaborative_run_on_the_core_directly(pipe, small):
    sampling = SamplingConfig(guidance=RampGuidance(1.0, 4))
    labels = torch.tensor([1])
    a = NextScale().generate(pipe.scale_model(), labels, sampling, gen())
    b = Collaborative(small=small, large_steps=3).generate(pipe, labels, sampling, gen())
    assert [t.shape[1] for t in a.tokens] == [t.shape[1] for t in b.tokens] == [1, 4, 9, 16]


def test_from_official_takes_a_non_default_vqvae_config(pipe, tmp_path):
    """A checkpoint of another VQVAE layout (here 32 codes, 8 channels, 2 levels) loads when its
    config is given; the default (official) layout names the mismatch."""
    from mmgen.hub import CheckpointError

    torch.save({"model": pipe.transformer.state_dict()}, tmp_path / "var_tiny.pth")
    torch.save(pipe.vqvae.state_dict(), tmp_path / "vae_tiny.pth")
    config, vq_config = pipe.transformer.config, pipe.vqvae.config
    loaded = VARPipeline.from_official(tmp_path / "var_tiny.pth", tmp_path / "vae_tiny.pth", depth=config,
                                       vqvae=VQVAEConfig(**{**vq_config.to_dict(), "patch_nums": (1, 2)}), image_size=8)
    assert loaded.vqvae.config == vq_config  # the transformer's patch_nums
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(loaded([1, 2], generator=gen(), output_type="pt").tokens, pipe([1, 2], generator=gen(), output_type="pt").tokens)
    with pytest.raises(CheckpointError, match="shape mismatches"):
        VARPipeline.from_official(tmp_path / "var_tiny.pth", tmp_path / "vae_tiny.pth", depth=config)
    with pytest.raises(ValueError, match="generates 8px images, not 256px"):
        VARPipeline.from_official(tmp_path / "var_tiny.pth", tmp_path / "vae_tiny.pth", depth=config, vqvae=vq_config, image_size=256)
