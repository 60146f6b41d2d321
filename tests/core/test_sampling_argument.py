"""Every pipeline takes one sampling object (`sampling=`: a `SamplingConfig` or a dict), as
transformers' `generate` takes a `GenerationConfig`; its keyword arguments still work and map
onto the same settings, and one check with one wording refuses bad values before any work."""

import inspect
import re

import pytest
import torch

import mmgen
from mmgen import registry
from mmgen.sampling import ConstantGuidance, IntervalGuidance, RampGuidance, SamplingConfig


@pytest.mark.parametrize("name", registry.pipeline_names())
def test_every_pipeline_call_takes_sampling(name):
    parameters = inspect.signature(registry.pipeline_class(name).__call__).parameters
    assert parameters["sampling"].kind is inspect.Parameter.KEYWORD_ONLY and parameters["sampling"].default is None


@pytest.fixture(scope="module")
def emoji64():
    pipe = mmgen.load_pipeline("emoji64")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tokens(pipe, **options):
    return pipe([3, 40], decoding="ar", generator=torch.Generator().manual_seed(0), output_type="pt", **options).tokens


def test_keywords_a_dict_and_a_config_sample_the_same_tokens(emoji64):
    scale, interval = emoji64.sampling_defaults["guidance_scale"], emoji64.sampling_defaults["cfg_interval"]
    by_keywords = tokens(emoji64, temperature=0.8, top_k=50, top_p=0.9)
    assert torch.equal(tokens(emoji64, sampling={"temperature": 0.8, "top_k": 50, "top_p": 0.9}), by_keywords)
    assert torch.equal(tokens(emoji64, sampling=SamplingConfig(0.8, 50, 0.9, IntervalGuidance(scale, interval))), by_keywords)
    # A keyword given both ways must agree; agreeing is fine.
    assert torch.equal(tokens(emoji64, temperature=0.8, sampling={"temperature": 0.8, "top_k": 50, "top_p": 0.9}), by_keywords)
    with pytest.raises(ValueError, match="temperature is given twice with different values: 0.5 and sampling's 0.8"):
        tokens(emoji64, temperature=0.5, sampling={"temperature": 0.8})
    assert not torch.equal(tokens(emoji64, sampling={"temperature": 0.8, "top_k": 5}), by_keywords)


@pytest.mark.parametrize("options, message", [
    (dict(temperature=-1), "temperature must be >= 0 (0 means greedy), got -1"),
    (dict(sampling={"temperature": float("nan")}), "temperature must be >= 0 (0 means greedy), got nan"),
    (dict(top_k=2.5), "top_k must be an integer >= 0 (0 disables it), got 2.5"),
    (dict(sampling={"top_p": 0}), "top_p must be in (0, 1], got 0"),
    (dict(guidance_scale="high"), "guidance scale must be a finite number >= 0, got 'high'"),
    (dict(sampling={"num_beams": 4}), "unknown sampling setting 'num_beams' for this pipeline"),
    (dict(sampling=0.7), "sampling must be a SamplingConfig or a dict of settings, got float"),
    (dict(sampling=SamplingConfig(guidance=RampGuidance(2.0, 10))), "sampling= takes a constant or interval guidance"),
])
def test_bad_sampling_is_one_line_before_any_work(emoji64, options, message, monkeypatch):
    monkeypatch.setattr(type(emoji64), "generate", lambda *a, **k: pytest.fail("decoding started"))
    with pytest.raises(ValueError, match=re.escape(message)):
        emoji64([3], **options)


def test_the_same_words_from_a_sampling_config_itself():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ValueError, match="guidance scale must be a finite number >= 0"):
        ConstantGuidance(float("inf"))


def test_settings_a_pipeline_cannot_take_must_be_neutral():
    vlm = mmgen.load_pipeline("emoji-vlm")  # temperature, top-k and top-p only: no guidance
    image = torch.zeros(64, 64, 3, dtype=torch.uint8).numpy()
    from PIL import Image

    picture = Image.fromarray(image)
    greedy = vlm("What is it?", picture, max_new_tokens=4).token_ids
    assert torch.equal(vlm("What is it?", picture, max_new_tokens=4, sampling=SamplingConfig(temperature=0.0)).token_ids, greedy)
    with pytest.raises(ValueError, match="this pipeline takes no guidance_scale"):
        vlm("What is it?", picture, sampling=SamplingConfig(temperature=0.0, guidance=ConstantGuidance(3.0)))
