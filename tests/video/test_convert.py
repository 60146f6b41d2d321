"""Self-Forcing / CausVid causal Wan checkpoints → diffusers WanTransformer3DModel (tiny random models)."""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file

from mmgen.hub import CheckpointError
from mmgen.video.convert import convert_causal_wan, convert_to_pipeline_transformer, load_causal_wan_state_dict

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=8, ffn_dim=32, num_layers=2, cross_attn_norm=True)

#: (official Wan name, diffusers name), written from Wan's `WanModel` / Self-Forcing's
#: `CausalWanModel` module names. In blocks: `norm1`/`norm2` carry no weights in Wan, `norm3` is
#: the affine cross-attention norm (diffusers' `norm2`).
TOP_NAMES = [
    ("patch_embedding", "patch_embedding"),
    ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
    ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
    ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
    ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
    ("time_projection.1", "condition_embedder.time_proj"),
    ("head.head", "proj_out"),
    ("head.modulation", "scale_shift_table"),
]
BLOCK_NAMES = [
    ("self_attn.q", "attn1.to_q"), ("self_attn.k", "attn1.to_k"), ("self_attn.v", "attn1.to_v"),
    ("self_attn.o", "attn1.to_out.0"), ("self_attn.norm_q", "attn1.norm_q"), ("self_attn.norm_k", "attn1.norm_k"),
    ("cross_attn.q", "attn2.to_q"), ("cross_attn.k", "attn2.to_k"), ("cross_attn.v", "attn2.to_v"),
    ("cross_attn.o", "attn2.to_out.0"), ("cross_attn.norm_q", "attn2.norm_q"), ("cross_attn.norm_k", "attn2.norm_k"),
    ("norm3", "norm2"), ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"), ("modulation", "scale_shift_table"),
]
#: The head count is not in the shapes (the converter defaults to 128-wide heads, as in Wan-2.1).
HEADS = {"num_attention_heads": 2}


def official_name(diffusers_key: str) -> str:
    stem, _, suffix = diffusers_key.rpartition(".")
    if suffix not in ("weight", "bias"):  # the scale_shift_table parameters have no suffix
        stem, suffix = diffusers_key, ""
    prefix, table = "", TOP_NAMES
    block = re.fullmatch(r"(blocks\.\d+\.)(.+)", stem)
    if block:
        prefix, stem, table = block.group(1), block.group(2), BLOCK_NAMES
    for official, ours in table:
        if stem == ours:
            return prefix + official + ("." + suffix if suffix else "")
    raise AssertionError(f"test map has no official name for {diffusers_key}")


def tiny_model(seed: int, **overrides) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**TINY, **overrides}).double().eval()
    with torch.no_grad():
        for param in model.parameters():  # norms and tables too: a swapped norm2/norm3 must show
            param.normal_(0, 0.3)
    return model


def wan_layout(model: WanTransformer3DModel, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """What Self-Forcing / CausVid save for this model: `WanDiffusionWrapper.model` + Wan names."""
    return {prefix + official_name(k): v.clone() for k, v in model.state_dict().items()}


def forward(model: WanTransformer3DModel, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    video = torch.randn(1, 4, 3, 4, 6, generator=generator, dtype=torch.float64)
    text = torch.randn(1, 5, 16, generator=generator, dtype=torch.float64)
    with torch.no_grad():
        return model(hidden_states=video, timestep=torch.tensor([700.0]), encoder_hidden_states=text,
                     return_dict=False)[0]


def load_folder(folder) -> WanTransformer3DModel:
    model = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(folder)).double().eval()
    model.load_state_dict(load_file(str(folder / "diffusion_pytorch_model.safetensors")), strict=True)
    return model


class NotATensor:
    """Pickled beside the weights: weights_only=True must refuse to rebuild it."""

    def __init__(self):
        self.value = 1


@pytest.fixture(scope="module")
def models():
    return tiny_model(1), tiny_model(2), tiny_model(3)  # generator, generator_ema, critic


@pytest.fixture
def self_forcing_file(tmp_path, models):
    generator, ema, critic = models
    path = tmp_path / "self_forcing_dmd.pt"
    checkpoint = {"generator": wan_layout(generator), "critic": wan_layout(critic), "generator_ema": wan_layout(ema)}
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def causvid_file(tmp_path, models):
    generator, _, critic = models
    path = tmp_path / "autoregressive_checkpoint" / "model.pt"
    path.parent.mkdir()
    torch.save({"generator": wan_layout(generator), "critic": wan_layout(critic)}, path)
    return path


def test_test_map_covers_the_model(models):
    keys = models[0].state_dict().keys()
    official = {official_name(k) for k in keys}
    assert len(official) == len(keys)
    assert {"blocks.0.self_attn.q.weight", "blocks.1.cross_attn.norm_k.weight", "blocks.0.norm3.bias",
            "blocks.0.ffn.0.weight", "blocks.1.modulation", "head.modulation", "head.head.bias",
            "time_projection.1.weight", "text_embedding.2.weight"} <= official


def test_self_forcing_ema_and_generator_convert_exactly(self_forcing_file, tmp_path, models):
    generator, ema, _ = models
    ema_folder = convert_to_pipeline_transformer(self_forcing_file, tmp_path / "ema", which="ema", config=HEADS)
    gen_folder = convert_to_pipeline_transformer(self_forcing_file, tmp_path / "gen", which="generator", config=HEADS)
    converted_ema, converted_gen = load_folder(ema_folder), load_folder(gen_folder)
    assert torch.allclose(forward(converted_ema), forward(ema), rtol=0, atol=1e-10)
    assert torch.allclose(forward(converted_gen), forward(generator), rtol=0, atol=1e-10)
    assert not torch.allclose(forward(converted_ema), forward(generator), atol=1e-3)
    config = WanTransformer3DModel.load_config(ema_folder)
    names = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim")
    assert tuple(config[k] for k in names) == (2, 2, 12, 32)
    assert load_file(str(ema_folder / "diffusion_pytorch_model.safetensors"))["proj_out.weight"].dtype == torch.float64


def test_which_defaults(self_forcing_file, causvid_file, models):
    generator, ema, _ = models
    default = load_causal_wan_state_dict(self_forcing_file)
    assert torch.equal(default["blocks.0.self_attn.q.weight"], wan_layout(ema, "")["blocks.0.self_attn.q.weight"])
    causvid = load_causal_wan_state_dict(causvid_file)  # no EMA: the generator, never the critic
    assert torch.equal(causvid["head.head.weight"], wan_layout(generator, "")["head.head.weight"])
    assert set(causvid) == set(wan_layout(generator, ""))
    with pytest.raises(CheckpointError, match=r"no 'generator_ema'.*which='generator'.*\['critic', 'generator'\]"):
        load_causal_wan_state_dict(causvid_file, which="ema")
    with pytest.raises(ValueError, match="which must be one of"):
        load_causal_wan_state_dict(causvid_file, which="critic")


def test_causvid_converts_exactly(causvid_file, tmp_path, models):
    folder = convert_to_pipeline_transformer(causvid_file, tmp_path / "causvid", config=HEADS)
    assert torch.allclose(forward(load_folder(folder)), forward(models[0]), rtol=0, atol=1e-10)


def test_wrapper_prefixes_are_stripped(tmp_path, models):
    generator = models[0]
    wrapped = {}
    for key, value in wan_layout(generator, "").items():
        key = re.sub(r"^blocks\.(\d+)\.", r"blocks.\1._fsdp_wrapped_module._checkpoint_wrapped_module.", key)
        wrapped["module._orig_mod.model._fsdp_wrapped_module." + key] = value
    path = tmp_path / "fsdp.pt"
    torch.save({"generator": wrapped}, path)
    folder = convert_to_pipeline_transformer(path, tmp_path / "out", config=HEADS)
    assert torch.allclose(forward(load_folder(folder)), forward(generator), rtol=0, atol=1e-10)


def test_flat_safetensors_and_already_converted(tmp_path, models):
    from safetensors.torch import save_file

    generator = models[0]
    path = tmp_path / "flat.safetensors"
    save_file(wan_layout(generator), str(path))
    converted, config = convert_causal_wan(load_causal_wan_state_dict(path), HEADS)
    again, _ = convert_causal_wan(converted, HEADS)  # diffusers layout passes through unchanged
    assert set(again) == set(generator.state_dict()) and config["num_layers"] == 2
    nested = tmp_path / "nested.safetensors"
    save_file({"generator_ema." + k: v for k, v in wan_layout(models[1]).items()}
              | {"generator." + k: v for k, v in wan_layout(generator).items()}, str(nested))
    ema = load_causal_wan_state_dict(nested, which="ema")
    assert torch.equal(ema["head.modulation"], models[1].scale_shift_table)


def test_missing_and_unknown_keys_are_named_in_one_line(tmp_path, models):
    weights = wan_layout(models[0])
    del weights["model.blocks.1.cross_attn.k.weight"]
    weights["model.blocks.0.self_attn.extra.weight"] = torch.zeros(3)
    path = tmp_path / "broken.pt"
    torch.save({"generator": weights}, path)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as caught:
        convert_to_pipeline_transformer(path, out, config=HEADS)
    message = str(caught.value)
    assert "\n" not in message
    assert "1 missing: blocks.1.attn2.to_k.weight" in message
    assert "blocks.0.self_attn.extra.weight" in message
    assert not out.exists()  # refused before anything was written


def test_shape_mismatch_and_wrong_heads(models):
    weights = wan_layout(models[0], "")
    with pytest.raises(ValueError, match="num_attention_heads=5 x attention_head_dim=12 != width 24"):
        convert_causal_wan(weights, {"num_heads": 5, "attention_head_dim": 12})
    mis_shaped = r"6 mis-shaped: .*blocks\.0\.ffn\.net\.0\.proj\.weight \(32, 24\) vs \(64, 24\)"
    with pytest.raises(CheckpointError, match=mis_shaped):
        convert_causal_wan(weights, {**HEADS, "ffn_dim": 64})
    with pytest.raises(CheckpointError, match="cannot infer the Wan config, 'patch_embedding.weight' is missing"):
        convert_causal_wan({"foo.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="unknown config key 'heads'"):
        convert_causal_wan(weights, {"heads": 2})
    # default heads are 128 wide: width 24 needs the head count spelled out
    with pytest.raises(ValueError, match="not a multiple of attention_head_dim 128"):
        convert_causal_wan(weights)


def test_official_1_3b_config_is_inferred():
    """The released generators are Wan2.1-T2V-1.3B: the shapes alone give its config (meta tensors)."""
    with torch.device("meta"):
        model = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30)
    weights = {"model." + official_name(k): v for k, v in model.state_dict().items()}
    converted, config = convert_causal_wan(weights)
    assert len(converted) == len(weights) == 825
    expected = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                    out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                    rope_max_seq_len=1024, pos_embed_seq_len=None)
    assert config == expected
    # the original Wan config.json names are accepted
    _, from_wan = convert_causal_wan(weights, {"_class_name": "WanModel", "dim": 1536, "num_heads": 12, "in_dim": 16,
                                               "out_dim": 16, "model_type": "t2v", "text_len": 512, "qk_norm": True})
    assert from_wan == expected


def test_pickled_objects_are_refused(tmp_path, models):
    path = tmp_path / "unsafe.pt"
    torch.save({"generator": wan_layout(models[0]), "extra": NotATensor()}, path)
    with pytest.raises(CheckpointError, match=r"NotATensor.*weights_only=True"):
        load_causal_wan_state_dict(path)


def test_legacy_torch_save_format_loads(tmp_path, models):
    path = tmp_path / "legacy.pt"
    torch.save({"generator": wan_layout(models[0])}, path, _use_new_zipfile_serialization=False)
    weights = load_causal_wan_state_dict(path)
    assert torch.equal(weights["patch_embedding.weight"], models[0].patch_embedding.weight)


def test_out_folder_is_never_overwritten_silently(self_forcing_file, tmp_path, models):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user file")
    with pytest.raises(ValueError, match="not empty; pass overwrite=True"):
        convert_to_pipeline_transformer(self_forcing_file, out, config=HEADS)
    convert_to_pipeline_transformer(self_forcing_file, out, overwrite=True, config=HEADS)
    assert (out / "keep.txt").read_text() == "user file"
    assert torch.allclose(forward(load_folder(out)), forward(models[1]), rtol=0, atol=1e-10)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        convert_to_pipeline_transformer(self_forcing_file, tmp_path / "file", config=HEADS)


def test_a_self_forcing_checkpoint_and_a_diffusers_wan_folder_make_a_video_pipeline(self_forcing_file, tmp_path, models):
    """`convert_to_pipeline`: the converted transformer beside the Wan folder's VAE, UMT5 and
    tokenizer (a tiny diffusers WanPipeline saved as diffusers saves it), under the preset's
    settings; the folder loads as a BlockDiffusionVideoPipeline and makes a video."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from mmgen.video.convert import PRESETS, convert_to_pipeline
    from mmgen.video.pipeline import BlockDiffusionVideoPipeline
    from tests.video.tiny import tiny_text_encoder, tiny_tokenizer, tiny_vae

    text_encoder = tiny_text_encoder()
    wan = WanPipeline(tokenizer=tiny_tokenizer(), text_encoder=text_encoder, transformer=tiny_model(9, text_dim=16),
                      vae=tiny_vae(), scheduler=FlowMatchEulerDiscreteScheduler())
    wan.save_pretrained(tmp_path / "wan")
    out = convert_to_pipeline(self_forcing_file, tmp_path / "wan", tmp_path / "sf", preset="self-forcing")
    pipe = BlockDiffusionVideoPipeline.from_pretrained(out)
    assert pipe.pipeline_config()["timesteps"] == list(PRESETS["self-forcing"]["timesteps"]) and pipe.block_frames == 3
    _, ema, _ = models
    mine = pipe.transformer.state_dict()
    assert all(torch.equal(mine[k], v.to(mine[k].dtype)) for k, v in ema.state_dict().items())
    pipe.set_progress_bar_config(disable=True)
    pipe.max_sequence_length = 8
    video = pipe("cat face", num_frames=9, height=32, width=32, generator=torch.Generator().manual_seed(0))
    assert video.frames.shape == (1, 9, 32, 32, 3)
    with pytest.raises(ValueError, match="not an empty folder"):
        convert_to_pipeline(self_forcing_file, tmp_path / "wan", out)
    with pytest.raises(ValueError, match="not a diffusers Wan folder"):
        convert_to_pipeline(self_forcing_file, (tmp_path / "bare").mkdir() or tmp_path / "bare", tmp_path / "other")
