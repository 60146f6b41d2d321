"""The bundled video pair (package data; see video/assets/emoji-motion/MODEL_CARD.md): it loads
strictly, shares its VAE, text encoder and tokenizer with the small model, and makes videos
offline from the CLI default."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from mmgen.cli import main
from mmgen.loading import load_pipeline
from mmgen.registry import bundled_models
from mmgen.video.export import read_mp4


def test_the_pair_is_stored_in_float16_loads_in_float32_and_shares_its_components():
    folders = bundled_models()
    big, small = load_pipeline("emoji-motion"), load_pipeline("emoji-motion-small")
    for name in ("transformer", "vae", "text_encoder"):
        stored = load_file(next((folders["emoji-motion"] / name).glob("*.safetensors")))
        assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float16}
    big.set_progress_bar_config(disable=True)
    out = big("red heart moving down", num_frames=9, generator=torch.Generator().manual_seed(0))
    assert {p.dtype for m in (big.transformer, big.vae, big.text_encoder) for p in m.parameters()} == {torch.float32}
    assert out.frames.shape == (1, 9, 64, 64, 3)
    index = json.loads((folders["emoji-motion-small"] / "model_index.json").read_text())
    assert set(index["shared"]) == {"vae", "text_encoder", "tokenizer"}
    assert small.transformer.config.num_layers < big.transformer.config.num_layers
    card = (folders["emoji-motion"] / "MODEL_CARD.md").read_text()
    assert "emoji-motion-small" in card and "direction acc." in card
    # The card's table is quality.json (measured by `training/train_video.py quality`), and the
    # proxies are calibrated: real clips score far above shuffled frames' chance and the models.
    from training.train_video import quality_table

    quality = json.loads((folders["emoji-motion"] / "quality.json").read_text())
    assert quality_table(quality) in card
    real = quality["real clips"]
    for name in ("emoji-motion", "emoji-motion-small"):
        r = quality[name]
        assert 0 <= r["class_accuracy"] <= r["class_accuracy_among_sprites"] <= 1 and 0 <= r["direction_accuracy"] <= 1
        assert r["num_clips"] == 64 and len(r["class_accuracy_among_sprites_by_frame"]) == 17
        assert r["class_accuracy"] < real["class_accuracy"] and r["fid_proxy"] > real["fid_proxy"]
    assert real["class_accuracy"] > 0.9 and real["direction_accuracy"] > 0.9


def test_the_cli_default_makes_the_documented_example_offline(tmp_path, capsys):
    out = tmp_path / "cat.mp4"
    assert main(["generate", "video", "--prompt", "cat face moving left", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert report["frames"] == 17 and report["stats"]["blocks"] == 5
    assert read_mp4(out).shape == (17, 64, 64, 3)
    out2 = tmp_path / "collab.mp4"
    assert main(["generate", "video", "--prompt", "sun moving up", "--out", str(out2), "--decoding", "collaborative",
                 "--large-steps", "2"]) == 0  # the bundled small model comes along
    steps = len(json.loads((bundled_models()["emoji-motion"] / "model_index.json").read_text())["config"]["timesteps"])
    forwards = json.loads(capsys.readouterr().err.strip().splitlines()[-1])["stats"]["denoise_forwards"]
    assert forwards == {"large": 2 * 5, "small": (steps - 2) * 5}  # per block: the large model's 2 steps, the rest small
