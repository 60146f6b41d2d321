"""A speech, a vision-language and a video family registered from the tests folder open and
serve like the built-in ones, with nothing in the tree changed (`tests/test_family_registry.py`
does the same for an image family).

Each toy is one `mmgen.registry.register_family` call over what the family brings of its own:

- speech: a transformers model type `toy_dia` (Dia's model under another config class) whose
  adapter is Dia's, except that untagged text is spoken by speaker 2;
- vision-language: a model type `toy_vlm` (LLaVA's model under another config class), served by
  `VLMPipeline` as every registered VLM family is;
- video: a pipeline class `ToyVideoPipeline` (a block-diffusion pipeline under another name).

Each is driven through `mmgen.load_pipeline`, `mmgen generate` (and the speech family through
`mmgen batch`) and the request layer's `discover` / `run_request`; removing its registration makes the same folder a one-line error
at every entry. transformers learns the toy model types as a plugin would teach it
(`AutoConfig.register`); those registrations stay for the session, harmlessly.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile
import torch
from transformers import (
    AutoConfig, AutoModelForImageTextToText, DacModel, DiaConfig, DiaForConditionalGeneration, DiaTokenizer, LlavaConfig,
    LlavaForConditionalGeneration,
)

import mmgen
from mmgen import registry
from mmgen.audio.dia import DiaSpeech
from mmgen.audio.pipeline import TTSPipeline, codec_source
from mmgen.cli import main
from mmgen.hub import CheckpointError
from mmgen.video.pipeline import BlockDiffusionVideoPipeline
from mmgen.vlm.pipeline import VLMPipeline

from tests.audio.tiny import RATE, tiny_dia
from tests.video.tiny import tiny_video_pipeline
from tests.vlm.tiny import PROMPTS, images, tiny_llava

TEXT = "Hello there."
FRAMES = 24


def renamed_config(config_class: type, config) -> object:
    """`config` as an instance of `config_class` (the toy model type), every field kept."""
    return config_class.from_dict({k: v for k, v in config.to_dict().items() if k != "model_type"})


# --------------------------------------------------------------------------------------- speech
class ToyDiaConfig(DiaConfig):
    model_type = "toy_dia"


class ToyDiaModel(DiaForConditionalGeneration):
    config_class = ToyDiaConfig


class ToySpeech(DiaSpeech):
    """Dia's adapter, but untagged text goes to speaker 2."""

    def text_with_speaker(self, text: str) -> str:
        return text if text.lstrip().startswith("[S") else f"[S2] {text.strip()}"

    @classmethod
    def load(cls, source, torch_dtype=None, **kwargs):
        model = ToyDiaModel.from_pretrained(source, dtype=torch_dtype, **kwargs)
        return model, DiaTokenizer(), DacModel.from_pretrained(codec_source(source), dtype=torch_dtype)


@pytest.fixture
def speech_family(tmp_path):
    """The toy speech family registered, a Dia pipeline, and the toy folder of the same weights."""
    registry.register_family("speech", "toy_dia", pipeline="TTSPipeline", adapter=ToySpeech)
    yield save_toy_dia(tmp_path / "toy-tts"), tmp_path / "toy-tts"
    registry.unregister_family("speech", "toy_dia")


def save_toy_dia(folder):
    """A tiny Dia pipeline, and its weights saved in `folder` as the toy model type `toy_dia`."""
    AutoConfig.register("toy_dia", ToyDiaConfig, exist_ok=True)
    dia = tiny_dia(1)
    model = ToyDiaModel(renamed_config(ToyDiaConfig, dia.model.config)).eval()
    model.load_state_dict(dia.model.state_dict())
    TTSPipeline(model, DiaTokenizer(), dia.codec.model).save_pretrained(folder)
    return dia


def test_a_speech_family_registered_here_loads_generates_and_serves(speech_family, tmp_path, capsys):
    from mmgen.apps.requests.speech import SpeechCatalog, SpeechRequest, run_request

    dia, folder = speech_family
    pipe = mmgen.load_pipeline(folder)
    assert type(pipe) is TTSPipeline and type(pipe.adapter) is ToySpeech and pipe.model.config.model_type == "toy_dia"
    audio = pipe(TEXT, max_new_frames=FRAMES, temperature=0).audio[0]
    # the toy's adapter ran: its speaker rule, over Dia's weights, is Dia told "[S2]"
    assert torch.equal(audio, dia(f"[S2] {TEXT}", max_new_frames=FRAMES, temperature=0).audio[0])
    assert not torch.equal(audio, dia(TEXT, max_new_frames=FRAMES, temperature=0).audio[0])

    out = tmp_path / "toy.wav"
    assert main(["generate", "speech", "--model", str(folder), "--text", TEXT, "--out", str(out), "--temperature", "0",
                 "--max-new-frames", str(FRAMES)]) == 0
    written, rate = soundfile.read(out, dtype="float32")
    assert rate == RATE and abs(written - audio.clamp(-1, 1).numpy()).max() <= 1 / 32767 + 1e-6  # 16-bit PCM
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"model": str(folder), "text": TEXT, "output": "toy", "max_new_frames": FRAMES,
                                "temperature": 0}) + "\n")
    assert main(["batch", str(jobs), "--out", str(tmp_path / "batch"), "--no-progress"]) == 0
    assert np.array_equal(soundfile.read(tmp_path / "batch" / "toy.wav", dtype="float32")[0], written)

    catalog = SpeechCatalog.discover([str(folder)])
    assert list(catalog.main) == ["toy-tts"]
    result = run_request(SpeechRequest(model="toy-tts", text=TEXT, max_new_frames=FRAMES, temperature=0.0, method="sjd",
                                       compare=True), catalog)
    assert type(catalog.pipeline("toy-tts").adapter) is ToySpeech
    assert np.array_equal(result.baseline.audio, audio.numpy()) and np.array_equal(result.method.audio, audio.numpy())

    registry.unregister_family("speech", "toy_dia")  # the same folder, unregistered: refused at every entry
    with pytest.raises(ValueError, match=r"is not a text-to-speech model: its config.json's model_type is not one of "
                                         r"\['csm', 'dia', 'vibevoice'\]"):
        SpeechCatalog.discover([str(folder)])
    with pytest.raises(CheckpointError, match="model_type 'toy_dia' \\(its config.json\\) is not one mmgen opens"):
        mmgen.load_pipeline(folder)
    with pytest.raises(ValueError, match="model type 'toy_dia' is not a speech model mmgen serves"):
        TTSPipeline.from_pretrained(folder)


# ------------------------------------------------------------------------------ vision-language
class ToyVLMConfig(LlavaConfig):
    model_type = "toy_vlm"


class ToyVLM(LlavaForConditionalGeneration):
    config_class = ToyVLMConfig


@pytest.fixture
def vlm_family(tmp_path):
    """The toy VLM family registered, a LLaVA pipeline, and the toy folder of the same weights."""
    registry.register_family("text", "toy_vlm", pipeline="VLMPipeline")
    yield save_toy_vlm(tmp_path), tmp_path / "toy-vlm"
    registry.unregister_family("text", "toy_vlm")


def save_toy_vlm(tmp_path):
    """A tiny LLaVA pipeline, its weights saved in `tmp_path/toy-vlm` as the toy model type
    `toy_vlm`, and an image `tmp_path/cat.png`."""
    AutoConfig.register("toy_vlm", ToyVLMConfig, exist_ok=True)
    AutoModelForImageTextToText.register(ToyVLMConfig, ToyVLM, exist_ok=True)
    llava = tiny_llava(0, std=0.1)
    model = ToyVLM(renamed_config(ToyVLMConfig, llava.model.config)).eval()
    model.load_state_dict(llava.model.state_dict())
    model.generation_config = llava.model.generation_config
    VLMPipeline(model, llava.processor).save_pretrained(tmp_path / "toy-vlm")
    images(1)[0].save(tmp_path / "cat.png")
    return llava


def test_a_vlm_family_registered_here_loads_generates_and_serves(vlm_family, tmp_path, capsys):
    from mmgen.apps.requests.text import ChatRequest, VLMCatalog, run_request

    llava, folder = vlm_family
    image = images(1)[0]
    pipe = mmgen.load_pipeline(folder)
    assert type(pipe) is VLMPipeline and type(pipe.model) is ToyVLM and "toy_vlm" in mmgen.vlm.MODEL_TYPES
    answer = pipe(PROMPTS[0], image, max_new_tokens=8)
    assert answer.texts == llava(PROMPTS[0], image, max_new_tokens=8).texts and answer.lengths.tolist() == [8]

    capsys.readouterr()
    assert main(["generate", "text", "--model", str(folder), "--image", str(tmp_path / "cat.png"), "--prompt", PROMPTS[0],
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() == answer.texts[0]

    catalog = VLMCatalog.discover([str(folder)])
    assert list(catalog.main) == ["toy-vlm"]
    result = run_request(ChatRequest(model="toy-vlm", message=PROMPTS[0], images=[image], max_new_tokens=8, method="sjd",
                                     compare=True), catalog)
    assert type(catalog.pipeline("toy-vlm").model) is ToyVLM
    assert result.baseline.text == result.method.text == answer.texts[0]

    registry.unregister_family("text", "toy_vlm")
    with pytest.raises(ValueError, match=r"is not a vision-language model: its config.json's model_type is not one of \["):
        VLMCatalog.discover([str(folder)])
    with pytest.raises(CheckpointError, match="model_type 'toy_vlm' \\(its config.json\\) is not one mmgen opens"):
        mmgen.load_pipeline(folder)
    with pytest.raises(ValueError, match="model_type 'toy_vlm' is not a vision-language family mmgen serves"):
        VLMPipeline.from_pretrained(folder)


# ---------------------------------------------------------------------------------------- video
class ToyVideoPipeline(BlockDiffusionVideoPipeline):
    """A block-diffusion video pipeline under its own class name (what its folders store)."""


@pytest.fixture
def video_family(tmp_path):
    """The toy video family registered, and folders of the same weights saved as the built-in
    block-diffusion pipeline and as the toy."""
    registry.register_family("video", pipeline=ToyVideoPipeline)
    base = tiny_video_pipeline()
    base.save_pretrained(tmp_path / "base-video")
    toy = ToyVideoPipeline(base.transformer, base.vae, base.text_encoder, base.tokenizer, **base.pipeline_config())
    toy.save_pretrained(tmp_path / "toy-video")
    yield tmp_path / "base-video", tmp_path / "toy-video"
    registry.unregister_family("video", "ToyVideoPipeline")


def test_a_video_family_registered_here_loads_generates_and_serves(video_family, tmp_path, capsys):
    from mmgen.apps.requests.video import VideoCatalog, VideoRequest, run_request

    base, folder = video_family
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "ToyVideoPipeline"
    pipe = mmgen.load_pipeline(folder)
    assert type(pipe) is ToyVideoPipeline and mmgen.ToyVideoPipeline is ToyVideoPipeline
    make = lambda p: p("cat face moving left", generator=torch.Generator().manual_seed(2)).frames[0]  # noqa: E731
    frames = make(pipe)
    assert torch.equal(frames, make(mmgen.load_pipeline(base)))  # the built-in class on the same weights

    assert main(["generate", "video", "--model", str(folder), "--prompt", "cat face moving left", "--seed", "2",
                 "--out", str(tmp_path / "toy.mp4")]) == 0
    report = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert report["frames"] == frames.shape[0] and report["stats"]["blocks"] == 2

    catalog = VideoCatalog.discover([str(folder)])
    assert list(catalog.main) == ["toy-video"]
    result = run_request(VideoRequest(model="toy-video", prompt="cat face moving left", num_frames=13, seed=2), catalog)
    assert type(catalog.pipeline("toy-video")) is ToyVideoPipeline and np.array_equal(result.frames, frames.numpy())

    registry.unregister_family("video", "ToyVideoPipeline")
    with pytest.raises(ValueError, match="is not a block-diffusion video model: its model_index.json names no "
                                         "BlockDiffusionVideoPipeline$"):
        VideoCatalog.discover([str(folder)])
    with pytest.raises(CheckpointError, match="unknown pipeline class 'ToyVideoPipeline'"):
        mmgen.load_pipeline(folder)


def test_family_registrations_are_checked():
    assert registry.family("speech", "dia").adapter_class() is DiaSpeech
    assert registry.family("video", "BlockDiffusionVideoPipeline").pipeline_class() is BlockDiffusionVideoPipeline
    assert registry.family("text", "dia") is None and registry.family("speech", None) is None
    with pytest.raises(ValueError, match="unknown modality 'audio'"):
        registry.register_family("audio", "x", pipeline="TTSPipeline")
    with pytest.raises(ValueError, match="a speech family named 'dia' is already registered"):
        registry.register_family("speech", "dia", pipeline="TTSPipeline", adapter=ToySpeech)
    with pytest.raises(ValueError, match="model_type 'llava' is already registered \\(text\\)"):
        registry.register_family("speech", "llava", pipeline="TTSPipeline", adapter=ToySpeech)
    with pytest.raises(ValueError, match="a text family is named by its transformers model_type"):
        registry.register_family("text", pipeline="VLMPipeline")
    impostor = type("BlockDiffusionVideoPipeline", (ToyVideoPipeline,), {})  # another class under a taken name
    with pytest.raises(ValueError, match="a pipeline class named 'BlockDiffusionVideoPipeline' is already registered"):
        registry.register_family("video", pipeline=impostor)
    assert registry.pipeline_class("BlockDiffusionVideoPipeline") is BlockDiffusionVideoPipeline
    assert "toy_dia" not in registry.families("speech")  # nothing was registered by the refused calls


def test_the_old_modality_name_vlm_still_registers_text_families_with_a_warning():
    """`register_family("vlm", ...)` (the text modality's name until issue 37, in third-party
    registrations) registers a text family; `family`, `families` and `unregister_family` read
    "vlm" as "text" too, each with a DeprecationWarning that points at the caller's line."""
    with pytest.warns(DeprecationWarning, match="modality 'vlm' is now called 'text'") as caught:
        entry = registry.register_family("vlm", "old_toy_vlm", pipeline="VLMPipeline")
    assert [w.filename for w in caught] == [__file__]
    try:
        assert entry.modality == "text" and registry.family("text", "old_toy_vlm") is entry
        assert mmgen.vlm.MODEL_TYPES["old_toy_vlm"] == "VLMPipeline"
        with pytest.warns(DeprecationWarning) as caught:
            assert registry.family("vlm", "old_toy_vlm") is entry
        assert [w.filename for w in caught] == [__file__]  # one warning, at this line, not inside the registry
        with pytest.warns(DeprecationWarning):
            assert registry.families("vlm") == registry.families("text")
    finally:
        with pytest.warns(DeprecationWarning):
            registry.unregister_family("vlm", "old_toy_vlm")
    assert registry.family("text", "old_toy_vlm") is None and "vlm" not in registry.FAMILY_KEYS
