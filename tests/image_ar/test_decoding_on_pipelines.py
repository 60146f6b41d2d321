"""Every decoder composes with every discrete image pipeline (c2i and t2i LlamaGen, Janus-Pro):
lossless decoders are token-identical to AR under greedy CFG, and lossy ones run with the
tables each model provides (VQ codebook, token embeddings)."""

import pytest
import torch

from mmgen.decoding import DECODERS, DraftSpeculative, EntropySwitch, make_decoder

from tests.conftest import tiny_pipeline
from tests.image_ar.test_janus import tiny_janus, tiny_processor
from tests.image_ar.test_llamagen_t2i import tiny_t2i_pipeline

LOSSLESS = ["sjd", "sjd-coupled", "draft", "lookup", "skip", "heads", "entropy-switch"]
LOSSY = ["gsd", "lantern", "lantern++"]


@pytest.fixture(scope="module")
def pipelines():
    from mmgen.image_ar.janus import JanusPipeline

    c2i = tiny_pipeline()
    janus = JanusPipeline(tiny_janus(), tiny_processor())
    for pipe in (c2i, janus):
        pipe.set_progress_bar_config(disable=True)
    return {
        "c2i": (c2i, dict(class_labels=[1, 2])),
        "t2i": (tiny_t2i_pipeline(), dict(prompt=["a red cat", "the blue sky"])),
        "janus": (janus, dict(prompt=["a red cat", "the blue sky under a green tree"])),
    }


def decoder(name, pipe):
    # The target drafting for itself is still draft-model speculation (its own cache, rewinds);
    # switching to itself still runs two models with their own caches.
    if name == "draft":
        return DraftSpeculative(drafter=pipe, num_draft=3)
    if name == "entropy-switch":
        return EntropySwitch(small=pipe, threshold=0.0)
    if name == "heads":  # untrained heads (the identity): exact whatever they draft
        from mmgen.decoding import DraftHeads, DraftHeadsConfig

        return make_decoder(name, heads=DraftHeads(DraftHeadsConfig(pipe.token_model().hidden_size)))
    if name in ("lookup", "skip"):  # skip: the tiny models' two blocks, block 0 skipped
        return make_decoder(name, num_draft=3, **({"layers": [0]} if name == "skip" else {}))
    return make_decoder(name, window=4)


def test_every_shortcut_is_covered():
    assert set(LOSSLESS + LOSSY + ["ar"]) == set(DECODERS)


@pytest.mark.parametrize("kind", ["c2i", "t2i", "janus"])
def test_lossless_decoders_equal_ar_under_greedy_cfg(pipelines, kind):
    pipe, inputs = pipelines[kind]
    run = lambda decoding: pipe(**inputs, decoding=decoding, temperature=0.0, guidance_scale=3.0, output_type="pt",
                                generator=torch.Generator().manual_seed(0))
    ar = run("ar")
    for name in LOSSLESS:
        out = run(decoder(name, pipe))
        assert torch.equal(out.tokens, ar.tokens), name
        if name == "entropy-switch":  # greedy: zero entropy, so the "small" model decodes every token
            assert out.stats.stage_forwards == [1, ar.stats.forwards]
        else:
            assert out.stats.forwards <= ar.stats.forwards


@pytest.mark.parametrize("kind", ["c2i", "t2i", "janus"])
def test_lossy_decoders_run_and_are_seeded(pipelines, kind):
    pipe, inputs = pipelines[kind]
    for name in LOSSY:
        run = lambda: pipe(**inputs, decoding=decoder(name, pipe), guidance_scale=3.0, output_type="pt",
                           generator=torch.Generator().manual_seed(1))
        a, b = run(), run()
        assert torch.equal(a.tokens, b.tokens) and a.tokens.shape[0] == 2, name
