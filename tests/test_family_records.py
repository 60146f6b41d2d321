"""A family's options live in its record, and every surface is built from it.

One toy family per modality is defined here alone, each with one option of its own declared in
its `mmgen.registry.register_family` call (`Option`): image `shift` (int: rotates the class
labels), text `suffix` (str: appended to answers), speech `gain` (float: scales the waveform),
video `reverse` (bool: plays the frames backwards). With no other file touched, each option is a
`mmgen generate <modality>` flag, a `mmgen batch` job field (checked with the record's one
wording), a widget of its demo whose value reaches the model, and a field of the server's
`"options"` object (listed per model by `/v1/models`); a model of a family that does not declare
it refuses it in one line, and a bad value is refused before any model runs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import soundfile
import torch

from mmgen import registry
from mmgen.audio.pipeline import TTSPipeline
from mmgen.cli import build_parser, main
from mmgen.registry import Option
from mmgen.video.pipeline import BlockDiffusionVideoPipeline
from mmgen.vlm.pipeline import VLMPipeline

from tests.test_family_registration_modalities import TEXT, ToySpeech, save_toy_dia, save_toy_vlm
from tests.test_family_registry import ToyConfig, ToyLM, ToyPipeline
from tests.video.tiny import tiny_video_pipeline
from tests.vlm.tiny import PROMPTS, images

FRAMES = 24


def last_record(capsys) -> dict:
    return json.loads(capsys.readouterr().err.strip().splitlines()[-1])


def write_jobs(path, *jobs: dict):
    path.write_text("".join(json.dumps(job) + "\n" for job in jobs))
    return path


def widget(demo, name: str):
    """The demo's widget of family option `name` (`gradio_common.family_widgets`)."""
    return next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == f"option-{name}")


def widget_values(modality: str, own=(), **given) -> list:
    """The demo's family option widgets' values, in `family_widgets`' order (the demo's `own`
    controls' options have none): those `given`, and None (an empty field) for the others."""
    return [given.get(name) for name in registry.family_options(modality) if name not in own]


@contextmanager
def served(*folders):
    """`mmgen serve` of the model folders, in process (as tests/apps/test_server.py runs it): an
    httpx client of it."""
    import httpx

    from mmgen.apps.server import ServerSettings, create_app, discover_catalogs
    from tests.apps.test_server import running

    with running(create_app(discover_catalogs([str(f) for f in folders]), ServerSettings())) as url, \
            httpx.Client(base_url=url, timeout=300) as client:
        yield client


def models(client) -> dict:
    return {entry["id"]: entry for entry in client.get("/v1/models").json()["data"]}


def refused(client, path: str, body: dict, message: str) -> None:
    """`body` at `path` is one 400 in OpenAI's shape whose one-line message matches `message`."""
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    assert re.fullmatch(message, error["message"]), error["message"]


def counted(monkeypatch, cls) -> list:
    """Calls of `cls` pipelines from now on (the keywords of each)."""
    calls, call = [], cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *args, **kwargs: calls.append(kwargs) or call(self, *args, **kwargs))
    return calls


# ---------------------------------------------------------------------------------------- image
class ShiftPipeline(ToyPipeline):
    """The toy image family of tests/test_family_registry.py, whose call also takes `shift`."""

    def __call__(self, class_labels, decoding="sjd", guidance_scale=None, temperature=None, generator=None,
                 output_type="pil", shift: int = 0):
        labels = [(label + shift) % self.num_classes for label in self.check_class_labels(class_labels)]
        return super().__call__(labels, decoding, guidance_scale, temperature, generator, output_type)


SHIFT = Option("shift", int, 0, "rotate the class labels by this many", minimum=0)


@pytest.fixture
def image_family(tmp_path):
    registry.register_family("image", pipeline=ShiftPipeline, options=[SHIFT])
    registry.register_pipeline(ToyPipeline)  # a family without the option
    ShiftPipeline(ToyLM(ToyConfig()), class_names=["a", "b", "c"]).save_pretrained(tmp_path / "shift")
    ToyPipeline(ToyLM(ToyConfig()), class_names=["a", "b", "c"]).save_pretrained(tmp_path / "plain")
    yield tmp_path / "shift", tmp_path / "plain"
    registry.unregister_family("image", "ShiftPipeline")
    registry.unregister_pipeline("ToyPipeline")


def test_an_image_family_option_is_a_flag_a_job_field_and_a_widget(image_family, tmp_path, capsys):
    folder, plain = image_family
    assert registry.family_options("image")["shift"] == SHIFT  # beside the built-in families' options
    generate = ["generate", "image", "--model", str(folder), "--no-progress"]
    assert main([*generate, "--class-labels", "a", "--shift", "1", "--out", str(tmp_path / "shifted")]) == 0
    assert main([*generate, "--class-labels", "b", "--out", str(tmp_path / "b")]) == 0
    shifted = (tmp_path / "shifted" / "000_class0_shift_seed0_sjd_shift=1.png").read_bytes()
    assert shifted == (tmp_path / "b" / "000_class1_shift_seed0_sjd.png").read_bytes()  # class a shifted by 1 is b

    jobs = write_jobs(tmp_path / "jobs.jsonl", {"model": str(folder), "class_label": "a", "seed": 0, "decoding": "sjd",
                                                "count": 1, "output": "s", "shift": 1})
    assert main(["batch", str(jobs), "--out", str(tmp_path / "batch"), "--batch-size", "1", "--no-progress"]) == 0
    assert (tmp_path / "batch" / "s_000.png").read_bytes() == shifted
    record = json.loads((tmp_path / "batch" / "manifest.jsonl").read_text())
    assert "--shift=1" in record["group"]["command"]

    # One wording for a bad value on every surface, before any work; refused by a family without it.
    capsys.readouterr()
    with pytest.raises(SystemExit, match="2"):
        main([*generate, "--class-labels", "a", "--shift", "-1", "--out", str(tmp_path / "x")])
    assert "argument --shift: must be an integer >= 0, got -1 (see" in capsys.readouterr().err
    write_jobs(jobs, {"model": str(folder), "class_label": "a", "seed": 0, "decoding": "sjd", "count": 1, "output": "s",
                      "shift": -1})
    assert main(["batch", str(jobs), "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "line 1: shift must be an integer >= 0, got -1" in capsys.readouterr().err
    assert main(["generate", "image", "--model", str(plain), "--class-labels", "a", "--shift", "1", "--no-progress",
                 "--out", str(tmp_path / "x")]) == 2
    assert "shift is for ShiftPipeline models; this model's family takes no such option" in capsys.readouterr().err

    import gradio as gr

    from mmgen.apps.image_demo import ImageCatalog, build_demo, handle_model

    catalog = ImageCatalog.discover([str(folder), str(plain)])
    shift = widget(build_demo(catalog), "shift")
    assert isinstance(shift, gr.Number) and shift.value == 0 and shift.precision == 0 and shift.minimum == 0
    assert shift.visible is True and handle_model(catalog, "plain")[-1] == gr.update(visible=False)  # plain: no shift
    assert shift.label == "shift (ShiftPipeline models)" and shift.info == SHIFT.help


def test_an_image_family_option_reaches_the_model_from_the_demo_and_over_http(image_family, monkeypatch):
    from mmgen.apps.image_demo import OWN_OPTIONS, ImageCatalog, handle_generate

    folder, plain = image_family
    catalog = ImageCatalog.discover([str(folder), str(plain)])

    def picture(model: str, class_name: str, **family) -> bytes:
        shown = handle_generate(catalog, 1, model, class_name, "sjd", "", False, 1, 0, None, None, None, None, None,
                                *widget_values("image", OWN_OPTIONS, **family))
        return shown[0]["value"].tobytes()

    assert picture("shift", "a", shift=1) == picture("shift", "b") != picture("shift", "a")  # a shifted by 1 is b
    assert picture("shift", "a", shift=0) == picture("shift", "a")
    assert picture("plain", "a", shift=1) == picture("plain", "a")  # a value left in the hidden widget is not plain's

    with served(folder, plain) as client:
        def image(**body) -> str:
            response = client.post("/v1/images/generations", json={"model": "shift", "seed": 0, "decoding": "sjd", **body})
            assert response.status_code == 200, response.text
            return response.json()["data"][0]["b64_json"]

        assert image(prompt="a", options={"shift": 1}) == image(prompt="b") != image(prompt="a")
        listed = models(client)
        assert listed["shift"]["options"] == [{"name": "shift", "type": "integer", "default": 0, "help": SHIFT.help,
                                               "choices": [], "minimum": 0, "maximum": None}]
        assert listed["plain"]["options"] == []
        calls = counted(monkeypatch, ToyPipeline)  # ShiftPipeline's call is ToyPipeline's too
        path = "/v1/images/generations"
        refused(client, path, {"model": "shift", "prompt": "a", "options": {"shift": -1}}, "shift must be an integer >= 0, got -1")
        refused(client, path, {"model": "shift", "prompt": "a", "options": {"shift": "1"}}, "shift must be an integer >= 0, got '1'")
        refused(client, path, {"model": "shift", "prompt": "a", "options": {"nope": 1}},
                "unknown option 'nope'; the image families' options are .*shift.*")
        refused(client, path, {"model": "plain", "prompt": "a", "options": {"shift": 1}},
                "shift is for ShiftPipeline models; this model's family takes no such option")
        refused(client, path, {"model": "shift", "prompt": "a", "options": [1]}, "options.*")
        assert calls == []


# ----------------------------------------------------------------------------------------- text
class SuffixVLMPipeline(VLMPipeline):
    """A vision-language pipeline whose answers end with `suffix`."""

    def __call__(self, *args, suffix: str = "", **kwargs):
        out = super().__call__(*args, **kwargs)
        return replace(out, texts=[text + suffix for text in out.texts])


SUFFIX = Option("suffix", str, "", "appended to every answer")


@pytest.fixture
def text_family(tmp_path):
    registry.register_family("text", "toy_vlm", pipeline=SuffixVLMPipeline, options=[SUFFIX])
    yield save_toy_vlm(tmp_path), tmp_path / "toy-vlm"
    registry.unregister_family("text", "toy_vlm")
    registry.unregister_pipeline("SuffixVLMPipeline")


def test_a_text_family_option_is_a_flag_a_job_field_and_a_widget(text_family, tmp_path, capsys):
    llava, folder = text_family
    answer = llava(PROMPTS[0], images(1)[0], max_new_tokens=8).texts[0]
    capsys.readouterr()
    assert main(["generate", "text", "--model", str(folder), "--image", str(tmp_path / "cat.png"), "--prompt", PROMPTS[0],
                 "--max-new-tokens", "8", "--suffix", " (toy)"]) == 0
    assert capsys.readouterr().out.strip() == answer + " (toy)"

    jobs = write_jobs(tmp_path / "jobs.jsonl",
                      {"model": str(folder), "prompt": PROMPTS[0], "images": [str(tmp_path / "cat.png")],
                       "max_new_tokens": 8, "output": "a", "suffix": "!"},
                      {"model": str(folder), "prompt": PROMPTS[0], "images": [str(tmp_path / "cat.png")],
                       "max_new_tokens": 8, "output": "b"})
    assert main(["batch", str(jobs), "--out", str(tmp_path / "batch"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "batch" / "a.json").read_text())["text"] == answer + "!"
    assert json.loads((tmp_path / "batch" / "b.json").read_text())["text"] == answer  # not one call with "a"
    write_jobs(jobs, {"prompt": PROMPTS[0], "output": "c", "suffix": 3})
    assert main(["batch", str(jobs), "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "line 1: suffix must be a string, got 3" in capsys.readouterr().err

    import gradio as gr

    from mmgen.apps.requests.text import VLMCatalog
    from mmgen.apps.text_demo import build_demo

    suffix = widget(build_demo(VLMCatalog.discover([str(folder)])), "suffix")
    assert isinstance(suffix, gr.Textbox) and suffix.value == "" and suffix.label == "suffix (toy_vlm models)"
    assert suffix.visible is True


def test_a_text_family_option_reaches_the_model_from_the_demo_and_over_http(text_family, tmp_path, monkeypatch):
    from mmgen.apps.requests.text import VLMCatalog
    from mmgen.apps.text_demo import handle_send

    llava, folder = text_family
    catalog = VLMCatalog.discover([str(folder)])

    def answer(**family) -> str:
        updates = list(handle_send(catalog, 4, 8, {"text": PROMPTS[0], "files": [str(tmp_path / "cat.png")]}, None,
                                   "toy-vlm", "ar", "none", 0.25, 0.0, 0, 8, False, *widget_values("text", **family)))
        return updates[-1][0]["value"][-1]["content"]

    assert answer(suffix=" (toy)") == answer() + " (toy)"

    url = "data:image/png;base64," + base64.b64encode((tmp_path / "cat.png").read_bytes()).decode()
    turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPTS[0]}]}]
    with served(folder) as client:
        def chat(**body) -> str:
            response = client.post("/v1/chat/completions", json={"model": "toy-vlm", "messages": turn, "max_tokens": 8,
                                                                  "seed": 0, "decoding": "ar", **body})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]

        assert chat(options={"suffix": "!"}) == chat() + "!"
        assert models(client)["toy-vlm"]["options"] == [{"name": "suffix", "type": "string", "default": "", "help": SUFFIX.help,
                                                         "choices": [], "minimum": None, "maximum": None}]
        calls = counted(monkeypatch, SuffixVLMPipeline)
        refused(client, "/v1/chat/completions", {"model": "toy-vlm", "messages": turn, "options": {"suffix": 3}},
                "suffix must be a string, got 3")
        refused(client, "/v1/chat/completions", {"model": "toy-vlm", "messages": turn, "options": {"suffix": "a\x00"}},
                "suffix holds a control character .*")
        assert calls == []


# --------------------------------------------------------------------------------------- speech
class GainTTSPipeline(TTSPipeline):
    """A text-to-speech pipeline whose waveform is scaled by `gain`."""

    def __call__(self, *args, gain: float = 1.0, **kwargs):
        out = super().__call__(*args, **kwargs)
        return replace(out, audio=[audio * gain for audio in out.audio])

    def stream(self, *args, gain: float = 1.0, **kwargs):
        """`TTSPipeline.stream`, its waveform chunks scaled as the call's audio is."""
        with contextlib.closing(super().stream(*args, gain=gain, **kwargs)) as chunks:
            while True:
                try:
                    row, chunk = next(chunks)
                except StopIteration as end:
                    return end.value
                yield row, chunk * gain


GAIN = Option("gain", float, 1.0, "scale the waveform by this", minimum=0, maximum=4)


@pytest.fixture
def speech_family(tmp_path):
    registry.register_family("speech", "toy_dia", pipeline=GainTTSPipeline, adapter=ToySpeech, options=[GAIN])
    dia = save_toy_dia(tmp_path / "toy-tts")
    dia.save_pretrained(tmp_path / "dia")
    yield dia, tmp_path / "toy-tts", tmp_path / "dia"
    registry.unregister_family("speech", "toy_dia")
    registry.unregister_pipeline("GainTTSPipeline")


def test_a_speech_family_option_is_a_flag_a_job_field_and_a_widget(speech_family, tmp_path, capsys):
    dia, folder, plain = speech_family
    half = (dia(f"[S2] {TEXT}", max_new_frames=FRAMES, temperature=0).audio[0] * 0.5).clamp(-1, 1).numpy()  # ToySpeech's rule
    speak = ["generate", "speech", "--text", TEXT, "--temperature", "0", "--max-new-frames", str(FRAMES)]
    assert main([*speak, "--model", str(folder), "--out", str(tmp_path / "half.wav"), "--gain", "0.5"]) == 0
    written = soundfile.read(tmp_path / "half.wav", dtype="float32")[0]
    assert abs(written - half).max() <= 1 / 32767 + 1e-6

    jobs = write_jobs(tmp_path / "jobs.jsonl", {"model": str(folder), "text": TEXT, "output": "half",
                                                "max_new_frames": FRAMES, "temperature": 0, "gain": 0.5})
    assert main(["batch", str(jobs), "--out", str(tmp_path / "batch"), "--no-progress"]) == 0
    assert np.array_equal(soundfile.read(tmp_path / "batch" / "half.wav", dtype="float32")[0], written)

    capsys.readouterr()
    with pytest.raises(SystemExit, match="2"):
        main([*speak, "--model", str(folder), "--out", str(tmp_path / "x.wav"), "--gain", "5"])
    assert "argument --gain: must be a number >= 0 and <= 4, got 5.0" in capsys.readouterr().err
    assert main([*speak, "--model", str(plain), "--out", str(tmp_path / "x.wav"), "--gain", "0.5"]) == 2
    assert "--gain is for toy_dia models; this model is a dia" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()

    import gradio as gr

    from mmgen.apps.requests.speech import SpeechCatalog
    from mmgen.apps.speech_demo import build_demo

    demo = build_demo(SpeechCatalog.discover([str(folder)]))
    gain = widget(demo, "gain")
    assert isinstance(gain, gr.Number) and gain.value == 1.0 and (gain.minimum, gain.maximum) == (0, 4) and gain.visible
    final_std = widget(demo, "final_std")  # a built-in family's, from its record: shown for VibeVoice models only
    assert final_std.label == "final_std (vibevoice models)" and final_std.visible is False


def test_a_speech_family_option_reaches_the_model_from_the_demo_and_over_http(speech_family, monkeypatch):
    from mmgen.apps.requests.speech import SpeechCatalog
    from mmgen.apps.speech_demo import handle_generate

    dia, folder, plain = speech_family
    catalog = SpeechCatalog.discover([str(folder), str(plain)])

    def spoken(model: str = "toy-tts", **family) -> np.ndarray:
        updates = list(handle_generate(catalog, 1024, False, TEXT, None, "", model, "ar", False, 0.0, 0, 1.0, 0, FRAMES,
                                       *widget_values("speech", **family)))
        return updates[-1][1]["value"][1].astype(int)  # the method's player: (rate, int16 samples)

    full, half = spoken(), spoken(gain=0.5)
    assert abs(full).max() > 100 and abs(half - full / 2).max() <= 1  # 16-bit samples of half the waveform
    assert np.array_equal(spoken("dia", gain=0.5), spoken("dia"))  # a value left in the hidden widget is not dia's

    with served(folder, plain) as client:
        def speech(**body) -> np.ndarray:
            response = client.post("/v1/audio/speech", json={"model": "toy-tts", "input": TEXT, "temperature": 0, "seed": 0,
                                                              "max_new_frames": FRAMES, "decoding": "ar",
                                                              "response_format": "pcm", **body})
            assert response.status_code == 200, response.text
            return np.frombuffer(response.content, "<i2").astype(int)

        full, half = speech(), speech(options={"gain": 0.5})
        assert abs(full).max() > 100 and abs(half - full / 2).max() <= 1
        listed = models(client)
        assert listed["toy-tts"]["options"] == [{"name": "gain", "type": "number", "default": 1.0, "help": GAIN.help,
                                                 "choices": [], "minimum": 0, "maximum": 4}]
        assert listed["dia"]["options"] == []
        calls = counted(monkeypatch, TTSPipeline)  # GainTTSPipeline's call is TTSPipeline's too
        refused(client, "/v1/audio/speech", {"model": "toy-tts", "input": TEXT, "options": {"gain": 5}},
                "gain must be a number >= 0 and <= 4, got 5")
        refused(client, "/v1/audio/speech", {"model": "dia", "input": TEXT, "options": {"gain": 0.5}},
                "gain is for toy_dia models; this model is a dia")
        assert calls == []


# ---------------------------------------------------------------------------------------- video
class ReversiblePipeline(BlockDiffusionVideoPipeline):
    """A block-diffusion video pipeline that can play its frames backwards."""

    def __call__(self, *args, reverse: bool = False, **kwargs):
        out = super().__call__(*args, **kwargs)
        return replace(out, frames=out.frames.flip(1)) if reverse else out


REVERSE = Option("reverse", bool, False, "play the frames backwards")


@pytest.fixture
def video_family(tmp_path):
    registry.register_family("video", pipeline=ReversiblePipeline, options=[REVERSE])
    base = tiny_video_pipeline()
    ReversiblePipeline(base.transformer, base.vae, base.text_encoder, base.tokenizer,
                       **base.pipeline_config()).save_pretrained(tmp_path / "toy-video")
    yield base, tmp_path / "toy-video"
    registry.unregister_family("video", "ReversiblePipeline")


def test_a_video_family_option_is_a_flag_a_job_field_and_a_widget(video_family, tmp_path, capsys, monkeypatch):
    base, folder = video_family
    calls = []
    monkeypatch.setattr(ReversiblePipeline, "__call__", lambda self, *a, reverse=False, **k: calls.append(reverse) or
                        BlockDiffusionVideoPipeline.__call__(self, *a, **k))
    prompt = "cat face moving left"
    assert main(["generate", "video", "--model", str(folder), "--prompt", prompt, "--out", str(tmp_path / "r.mp4"),
                 "--reverse"]) == 0
    assert main(["generate", "video", "--model", str(folder), "--prompt", prompt, "--out", str(tmp_path / "f.mp4")]) == 0
    jobs = write_jobs(tmp_path / "jobs.jsonl", {"modality": "video", "model": str(folder), "prompt": prompt, "output": "r",
                                                "reverse": True})
    assert main(["batch", str(jobs), "--out", str(tmp_path / "batch"), "--no-progress"]) == 0
    assert calls == [True, False, True] and (tmp_path / "batch" / "r.mp4").is_file()

    capsys.readouterr()
    write_jobs(jobs, {"modality": "video", "model": str(folder), "prompt": prompt, "output": "r", "reverse": "yes"})
    assert main(["batch", str(jobs), "--out", str(tmp_path / "bad"), "--no-progress"]) == 2
    assert "line 1: reverse must be true or false, got 'yes'" in capsys.readouterr().err

    import gradio as gr

    from mmgen.apps.requests.video import VideoCatalog
    from mmgen.apps.video_demo import build_demo

    reverse = widget(build_demo(VideoCatalog.discover([str(folder)])), "reverse")
    assert isinstance(reverse, gr.Checkbox) and reverse.value is False and reverse.visible is True


def test_a_video_family_option_reaches_the_model_from_the_demo_and_over_http(video_family, tmp_path, monkeypatch):
    from mmgen.apps.requests.video import VideoCatalog, VideoRequest, run_request
    from mmgen.apps.video_demo import contact_sheet, handle_generate
    from mmgen.video.export import mp4_bytes

    base, folder = video_family
    prompt = "cat face moving left"
    catalog = VideoCatalog.discover([str(folder)])
    forward = run_request(VideoRequest(model="toy-video", prompt=prompt), catalog)
    backward = np.ascontiguousarray(forward.frames[::-1])
    assert not np.array_equal(backward, forward.frames)

    def sheet(**family) -> bytes:
        updates = list(handle_generate(catalog, 81, str(tmp_path), prompt, "toy-video", None, "global", True, "block", 1, 0,
                                       0, 0, *widget_values("video", **family)))
        return updates[-1][0].tobytes()  # the contact sheet of the video's blocks

    assert sheet(reverse=True) == contact_sheet([backward[start:end] for start, end in forward.spans]).tobytes()
    assert sheet() == contact_sheet(forward.blocks()).tobytes()

    with served(folder) as client:
        def video(**body) -> bytes:
            response = client.post("/v1/videos", json={"model": "toy-video", "prompt": prompt, "seed": 0, **body})
            assert response.status_code == 200, response.text
            job = response.json()["id"]
            while client.get(f"/v1/videos/{job}").json()["status"] in ("queued", "in_progress"):
                time.sleep(0.05)
            return client.get(f"/v1/videos/{job}/content").content

        assert video(options={"reverse": True}) == mp4_bytes(backward, forward.fps)
        assert video(options={"reverse": False}) == forward.mp4()
        assert models(client)["toy-video"]["options"] == [{"name": "reverse", "type": "boolean", "default": False,
                                                           "help": REVERSE.help, "choices": [], "minimum": None,
                                                           "maximum": None}]
        calls = counted(monkeypatch, BlockDiffusionVideoPipeline)  # ReversiblePipeline's call is its base's too
        refused(client, "/v1/videos", {"model": "toy-video", "prompt": prompt, "options": {"reverse": "yes"}},
                "reverse must be true or false, got 'yes'")
        refused(client, "/v1/videos", {"model": "toy-video", "prompt": prompt, "options": {"reverse": 1}},
                "reverse must be true or false, got 1")
        assert calls == []


def test_a_reversed_call_plays_the_frames_backwards(video_family):
    base, folder = video_family
    import mmgen

    pipe = mmgen.load_pipeline(folder)
    make = lambda **k: pipe("cat face", generator=torch.Generator().manual_seed(1), **k).frames  # noqa: E731
    assert torch.equal(make(reverse=True), make().flip(1))


# ------------------------------------------------------------------------------------- records
def test_options_are_checked_when_registered_and_the_cli_offers_only_registered_ones():
    with pytest.raises(ValueError, match="option name 'a-b' is not a Python identifier"):
        Option("a-b", int)
    with pytest.raises(ValueError, match="type must be one of bool, int, float, str"):
        Option("x", list)
    with pytest.raises(ValueError, match="x must be one of 'a', 'b', got 'c'"):
        Option("x", str, "c", choices=("a", "b"))
    with pytest.raises(ValueError, match="option 'final_std' is declared otherwise by another speech family"):
        registry.register_family("speech", "toy_dia", pipeline="TTSPipeline", adapter=ToySpeech,
                                 options=[Option("final_std", int)])
    assert registry.family("speech", "toy_dia") is None  # nothing was registered
    assert registry.family("speech", "vibevoice").options[0].flag == "--final-std"
    flags = build_parser()._subparsers._group_actions[0].choices["generate"]._subparsers._group_actions[0].choices
    assert "--final-std" in flags["speech"]._option_string_actions
    assert not {"--shift", "--suffix", "--gain", "--reverse"} & {f for p in flags.values() for f in p._option_string_actions}
