"""The bundled emoji models: offline loading, generation, and quality proxies that can fail."""

import json

import pytest
import torch

from mmgen.decoding import SpeculativeJacobi
from mmgen.image_ar.bundled import BUNDLED_MODELS, QUALITY_CLASSIFIER, load_eval_set
from mmgen.loading import resolve_model
from mmgen.image_ar.llamagen import LlamaGenPipeline, LlamaGenTokenModel
from mmgen.image_ar.quality import ImageQualityProxies
from mmgen.quality import token_nll


@pytest.fixture(scope="module")
def pipe():
    p = LlamaGenPipeline.from_pretrained(resolve_model("emoji64"))
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture(scope="module")
def scorer():
    return ImageQualityProxies.from_pretrained(QUALITY_CLASSIFIER)


def test_bundled_models_load_offline_and_generate(pipe):
    assert pipe.image_size == 64 and pipe.num_classes == len(pipe.class_names) == 74
    out = pipe([pipe.class_index("cat-face"), 0], decoding=SpeculativeJacobi(window=8), generator=torch.Generator().manual_seed(0))
    assert [im.size for im in out.images] == [(64, 64), (64, 64)]
    assert out.tokens.shape == (2, 64) and out.stats.forwards < 64
    draft = LlamaGenPipeline.from_pretrained(resolve_model("emoji64-draft"))
    assert torch.equal(draft.vq.quantize.embedding.weight, pipe.vq.quantize.embedding.weight)  # one shared VQ
    assert sum(p.numel() for p in draft.transformer.parameters()) < sum(p.numel() for p in pipe.transformer.parameters()) / 4


def test_unknown_bundled_name_is_passed_through_as_a_path():
    assert resolve_model("not-a-bundled-model") == "not-a-bundled-model"
    assert set(BUNDLED_MODELS) == {"emoji64", "emoji64-draft", "var-emoji64", "var-emoji64-small", "mar-emoji64", "mar-emoji64-draft"}


@torch.no_grad()
def shuffled_token_images(pipe, images, seed=0):
    """Real images re-encoded by the VQ with their token positions shuffled."""
    codes = pipe.vq.encode(images * 2 - 1)[2]
    generator = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(codes.shape[1], generator=generator) for _ in range(len(codes))])
    shuffled = codes.gather(1, order)
    return codes, shuffled, pipe.decode_tokens(shuffled, output_type="pt")


def test_quality_proxies_separate_real_from_shuffled(pipe, scorer):
    images, labels = load_eval_set()
    real = scorer(images, labels)
    codes, shuffled_codes, shuffled = shuffled_token_images(pipe, images)
    broken = scorer(shuffled, labels)
    model = LlamaGenTokenModel(pipe.transformer)
    nll_real = token_nll(model, labels, codes).mean().item()
    nll_shuffled = token_nll(model, labels, shuffled_codes).mean().item()
    # Held-out real images are classified well and sit close to the data's feature statistics;
    # the same tokens in shuffled order are neither, and the GPT finds them far less likely.
    assert real["accuracy"] > 0.6 and broken["accuracy"] < real["accuracy"] - 0.4
    assert broken["fid_proxy"] > 3 * real["fid_proxy"]
    assert nll_shuffled > nll_real + 1.0


def test_bench_harness_reports_speed_and_quality(tmp_path):
    from mmgen.cli import main

    path = tmp_path / "bench.json"
    argv = ["bench", "image", "--methods", "ar", "sjd-8", "--batch-sizes", "2", "--repeats", "1", "--warmup", "0",
            "--quality-per-class", "1", "--json", str(path), "--markdown", str(tmp_path / "bench.md")]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert report["environment"]["command"] == "mmgen " + " ".join(argv)
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["device"] == "cpu"
    ar, sjd = report["speed"]
    assert (ar["method"], ar["forwards"], ar["step_compression"], ar["speedup_vs_ar"]) == ("ar", 64, 1.0, 1.0)
    assert sjd["forwards"] < 64 and sjd["step_compression"] == pytest.approx(64 / sjd["forwards"])
    assert "| model | method | batch |" in (tmp_path / "bench.md").read_text()
    quality = {row["method"]: row for row in report["quality"]}
    assert set(quality) == {"ar", "sjd-8"} and quality["ar"]["num_images"] == 74
    for row in quality.values():  # samples of a trained model are classified far above chance (1/74)
        assert row["accuracy"] > 0.1 and 0 < row["nll"] < 6.2 and row["fid_proxy"] > 0
    assert abs(quality["ar"]["nll"] - quality["sjd-8"]["nll"]) < 0.25  # same distribution, 74 samples


def test_random_weight_timing_mode(tmp_path):
    from mmgen.cli import main

    path = tmp_path / "cost.json"
    assert main(["bench", "image", "--random-weights", "GPT-B", "--windows", "1", "4", "--batch-sizes", "1", "--repeats", "1",
                 "--warmup", "0", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["forward_cost"]
    assert [r["window"] for r in rows] == [1, 4] and rows[0]["cost_vs_ar_step"] == 1.0
