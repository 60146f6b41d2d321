"""The bundled VAR models: offline loading, collaborative decoding with the bundled small model,
pruning, the bench rows, and quality proxies that can fail."""

import json

import pytest
import torch

from mmgen.image_ar.bench.var import var_token_nll
from mmgen.decoding import CachedTokenPruning, Collaborative
from mmgen.image_ar.bundled import load_eval_set
from mmgen.loading import load_pipeline, resolve_model
from mmgen.image_ar.var import VARPipeline


@pytest.fixture(scope="module")
def pipes():
    large = VARPipeline.from_pretrained(resolve_model("var-emoji64"))
    small = VARPipeline.from_pretrained(resolve_model("var-emoji64-small"))
    for p in (large, small):
        p.set_progress_bar_config(disable=True)
    return large, small


def test_bundled_var_models_load_offline_and_generate(pipes):
    large, small = pipes
    assert large.image_size == 64 and large.num_classes == len(large.class_names) == 74
    assert torch.equal(large.vqvae.quantize.embedding.weight, small.vqvae.quantize.embedding.weight)  # one shared VQVAE
    assert sum(p.numel() for p in small.transformer.parameters()) < sum(p.numel() for p in large.transformer.parameters()) / 4
    out = large([large.class_index("cat-face"), 0], decoding=Collaborative(small=small, large_steps=4),
                pruning=CachedTokenPruning(keep={-1: 0.5}, layers=(0, None)), generator=torch.Generator().manual_seed(0))
    assert [im.size for im in out.images] == [(64, 64), (64, 64)] and out.tokens.shape == (2, 130)
    assert out.stats.stage_forwards == [4, 2]


def test_collaborative_by_name_pairs_the_bundled_small_model_also_by_its_old_name():
    """`decoding="collaborative"` on `var-emoji64` takes `var-emoji64-small`; so does "code"
    (the old name, until 0.3), with a DeprecationWarning, to the same tokens."""
    large = load_pipeline("var-emoji64")
    large.set_progress_bar_config(disable=True)
    new = large([3], decoding="collaborative", generator=torch.Generator().manual_seed(0))
    with pytest.warns(DeprecationWarning, match="use 'collaborative'"):
        old = large([3], decoding="code", generator=torch.Generator().manual_seed(0))
    assert torch.equal(old.tokens, new.tokens) and new.stats.stage_forwards == [4, 2]


def test_the_large_model_explains_real_images_better_than_the_small_one(pipes):
    large, small = pipes
    images, labels = load_eval_set()
    tokens = torch.cat(large.vqvae.encode(images * 2 - 1), 1)
    nll_large, nll_small = (var_token_nll(p, labels, tokens).mean().item() for p in (large, small))
    shuffled = tokens[:, torch.randperm(tokens.shape[1], generator=torch.Generator().manual_seed(0))]
    assert nll_large < nll_small < 6.2  # uniform over 512 codes: 6.24
    assert var_token_nll(large, labels, shuffled).mean().item() > nll_large + 1.0


def test_var_bench_reports_speed_memory_and_quality(tmp_path):
    from mmgen.cli import main

    path = tmp_path / "bench.json"
    argv = ["bench", "image", "--models", "var-emoji64", "--methods", "ar", "collaborative:large_steps=4", "--prunings", "none", "5=0.5@0:",
            "--batch-sizes", "2", "--repeats", "1", "--warmup", "0", "--quality-per-class", "1", "--json", str(path)]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    speed = {(r["method"], r["pruning"]): r for r in report["speed"]}
    assert speed[("ar", "none")]["forwards"] == "6" and speed[("ar", "none")]["speedup_vs_ar"] == 1.0
    assert speed[("collaborative:large_steps=4", "none")]["forwards"] == "4+2"
    # CoDe's largest cache alive at once is the small model's; the large one's covers 4 scales only.
    assert speed[("collaborative:large_steps=4", "none")]["kv_cache_mb"] < speed[("ar", "none")]["kv_cache_mb"]
    quality = {(r["method"], r["pruning"]): r for r in report["quality"]}
    assert len(quality) == 4
    for row in quality.values():  # samples of a trained model are classified far above chance (1/74)
        assert row["accuracy"] > 0.05 and 0 < row["nll"] < 6.2 and row["num_images"] == 74
