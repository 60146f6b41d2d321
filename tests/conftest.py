"""Tiny random models shared by the tests (no weights are ever downloaded)."""

from __future__ import annotations

import os

# Tests never download: any Hub access must fail fast with mmgen's offline error.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from mmgen.image_ar.llamagen import LlamaGenConfig, LlamaGenTokenModel, LlamaGenTransformer, VQConfig, VQModel


def tiny_transformer(vocab_size=32, block_size=64, num_classes=10, output_std=0.5, seed=0, **overrides) -> LlamaGenTransformer:
    """A 2-layer LlamaGen with a non-zero head (the official init zeros it: uniform outputs)."""
    torch.manual_seed(seed)
    config = LlamaGenConfig(
        dim=64, n_layer=2, n_head=4, multiple_of=32, vocab_size=vocab_size, block_size=block_size,
        num_classes=num_classes, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0, **overrides,
    )
    model = LlamaGenTransformer(config).eval()
    torch.nn.init.normal_(model.output.weight, std=output_std)
    return model


def tiny_vq(codebook_size=32, seed=0) -> VQModel:
    torch.manual_seed(seed)
    config = VQConfig(codebook_size=codebook_size, codebook_embed_dim=8, encoder_ch_mult=(1, 2), decoder_ch_mult=(1, 2),
                      z_channels=32, base_channels=32, num_res_blocks=1)
    return VQModel(config).eval()


@pytest.fixture
def token_model() -> LlamaGenTokenModel:
    return LlamaGenTokenModel(tiny_transformer())


def tiny_pipeline(seed=0):
    """A 4x4-token, 8-pixel class-conditional pipeline with random weights."""
    from mmgen.image_ar.llamagen import LlamaGenPipeline

    return LlamaGenPipeline(tiny_transformer(block_size=16, seed=seed), tiny_vq(seed=seed))
