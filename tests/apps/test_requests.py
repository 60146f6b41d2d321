"""The request layer every surface shares: bounds and their messages, the catalogue's default
method, runs compared per output unit, and the streaming plumbing's rule for a client that
goes away."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from mmgen.apps.requests.bounds import checked_text, integer, number, sampler, shown
from mmgen.apps.requests.catalog import Catalog
from mmgen.apps.requests.runs import PerUnit, Result, finish, relay
from mmgen.streaming import stream_from_thread


def test_shown_quotes_plain_values_and_names_only_the_type_of_objects():
    assert shown("cat") == "'cat'" and shown([1, 2.5, None]) == "[1, 2.5, None]"
    assert len(shown("x" * 500)) == 60
    text = shown(object())
    assert text == "a object" and "0x" not in text
    assert shown({"k": threading.Lock()}) == "a dict"


@pytest.mark.parametrize("value", ["3", None, True, 2.5, 99, float("nan")])
def test_integer_refuses_in_one_line(value):
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, 10\], got ") as caught:
        integer("seed", value, 0, 10)
    assert "\n" not in str(caught.value)
    assert integer("seed", 3.0, 0, 10) == 3


def test_number_text_and_sampler_bounds():
    with pytest.raises(ValueError, match=r"temperature must be a number in \[0, 5\], got 'hot'"):
        number("temperature", "hot", 0.0, 5.0)
    with pytest.raises(ValueError, match=r"top-p must be a number in \(0, 1\]"):
        sampler(top_p=0.0, vocab_size=10)
    with pytest.raises(ValueError, match="top-k must be an integer in \\[0, 10\\]"):
        sampler(top_k=11, vocab_size=10)
    assert sampler(temperature=1, top_k=3, vocab_size=None) == {"temperature": 1.0}  # a model without top-k
    with pytest.raises(ValueError, match="type something"):
        checked_text("the text", "  ", empty="type something")
    with pytest.raises(ValueError, match="at most 4 characters, got 5"):
        checked_text("the text", "hello", 4)


class _Pipe(SimpleNamespace):
    def decoders(self):
        return {"ar": None, "sjd": None, "draft": None}


class _Catalog(Catalog):
    def load(self, source):
        return _Pipe(companions={"draft": SimpleNamespace(suffix="-draft", option="drafter", role="a drafter")},
                     default_decoding="sjd")


def test_default_method_is_the_measured_fastest_lossless_one(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    catalog = _Catalog({"model": str(folder)})
    assert catalog.methods("model") == ["ar", "sjd"]  # draft needs a drafter the catalogue lacks
    assert catalog.default_method("model") == "sjd"  # nothing measured: the pipeline's own default
    (folder / "decoding.json").write_text(json.dumps({"default": "ar", "measured": "a benchmark"}))
    assert catalog.default_method("model") == "ar"
    (folder / "decoding.json").write_text(json.dumps({"default": "draft"}))  # measured, but not offered here
    assert catalog.default_method("model") == "sjd"
    with_drafter = _Catalog({"model": str(folder)}, {"model-draft": str(folder)})
    assert with_drafter.default_method("model") == "draft"
    with pytest.raises(ValueError, match="unknown model 'other'"):
        catalog.main_pipeline("other")


def test_the_measured_default_runs_with_its_measured_settings_where_a_request_sets_none(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    catalog = _Catalog({"model": str(folder)})
    assert catalog.measured_options("model", "sjd") == {}  # no decoding.json
    (folder / "decoding.json").write_text(json.dumps({"default": "sjd", "options": {"adapt": False, "window": 4}}))
    assert catalog.measured_options("model", "sjd") == {"adapt": False, "window": 4}
    assert catalog.measured_options("model", "ar") == {}  # the settings belong to the measured method only
    (folder / "decoding.json").write_text(json.dumps({"default": "sjd", "options": {"window": [4]}}))
    assert catalog.measured_options("model", "sjd") == {}  # not a setting
    (folder / "decoding.json").write_text("[1, 2]")
    assert catalog.measured_options("model", "sjd") == {} and catalog.default_method("model") == "sjd"


def test_the_bundled_vlm_drafts_with_its_own_heads_unless_told_otherwise():
    from mmgen.apps.requests.text import VLMCatalog
    from mmgen.decoding import DraftHeads

    catalog = VLMCatalog.discover()
    measured = json.loads((Path(__file__).parents[2] / "vlm/assets/emoji-vlm/decoding.json").read_text())
    assert catalog.default_method("emoji-vlm") == measured["default"] == "heads"
    decoder = catalog.decoder("heads", "emoji-vlm")
    assert isinstance(decoder.heads, DraftHeads) and decoder.drafts == decoder.heads.config.num_drafts == 5
    assert catalog.decoder("heads", "emoji-vlm", num_draft=2).drafts == 2
    assert catalog.decoder("draft", "emoji-vlm", num_draft=2).num_draft == 2  # the drafter is still offered


@pytest.mark.parametrize("folder, default", [("audio/assets/speech-tts", "ar"), ("vlm/assets/emoji-vlm", "heads")])
def test_bundled_models_name_a_measured_default(folder, default):
    record = json.loads((Path(__file__).parents[2] / folder / "decoding.json").read_text())
    assert record["default"] == default and "mmgen bench " in record["measured"]


@dataclass
class Run(PerUnit):
    label: str
    units: int
    seconds: float


def test_runs_compare_per_output_unit_not_per_call():
    class Speech(Result):
        unit = "frame"

        def __init__(self, runs):
            self.runs = runs

    # The speech demo once showed "speedup 1.14" for a run that made 34 frames in 1.42 s against
    # a baseline's 117 frames in 1.62 s: per frame, it is three times slower.
    result = Speech([Run("ar (baseline)", 117, 1.62), Run("draft", 34, 1.42)])
    columns = result.speed_columns(result.method)
    assert columns == {"ms/frame": 41.76, "speedup (per frame)": 0.33}
    assert result.speed_columns(Run("empty", 0, 0.1)) == {"ms/frame": None, "speedup (per frame)": None}
    assert "speedup (per frame)" not in Speech([Run("sjd", 10, 1.0)]).speed_columns(Run("sjd", 10, 1.0))


def test_relay_returns_the_streams_value_and_a_close_stops_the_run_before_returning():
    steps, released = [], threading.Event()

    def run(emit):
        try:
            for i in range(1000):
                steps.append(i)
                emit(i)
                time.sleep(0.002)  # a model's step
            return "done"
        finally:
            released.set()

    assert finish(relay(stream_from_thread(lambda emit: [emit(i) for i in range(3)] and "all"), str)) == "all"
    events = relay(stream_from_thread(run), lambda i: f"item {i}")
    assert next(events) == "item 0"
    events.close()  # the client went away
    assert released.is_set()  # the run ended before close returned: the model is free
    assert len(steps) < 1000


@pytest.mark.parametrize("modality", ["image", "vlm", "speech", "video"])
def test_check_request_checks_everything_and_runs_nothing(modality, monkeypatch):
    """`check_request` is what the server runs before a request waits for its model: a valid
    request comes back checked without taking a model or a shared batch, and a bad value is
    refused there, in one line."""
    import importlib

    from PIL import Image

    layer = importlib.import_module(f"mmgen.apps.requests.{modality}")
    names = {"image": "Image", "vlm": "VLM", "speech": "Speech", "video": "Video"}
    catalog = getattr(layer, names[modality] + "Catalog").discover()
    model = next(iter(catalog.main))
    good, bad = {
        "image": (dict(class_name="face-smiling", method="ar"), dict(num_images=99)),
        "vlm": (dict(message="What is this?", images=[Image.new("RGB", (64, 64))]), dict(temperature="hot")),
        "speech": (dict(text="Hello there.", max_new_frames=100), dict(max_new_frames=10**9)),
        "video": (dict(prompt="red heart moving left"), dict(cache_policy="sometimes")),
    }[modality]
    request_class = getattr(layer, "ChatRequest" if modality == "vlm" else names[modality] + "Request")
    make = lambda **fields: request_class(model=model, **fields)

    def forbidden(*args, **kwargs):
        raise AssertionError("the check took a model or a shared batch")

    monkeypatch.setattr(catalog, "using", forbidden)
    monkeypatch.setattr(catalog, "server", forbidden)
    checked = layer.check_request(make(**good), catalog)
    assert checked.request == make(**good) and checked.pipe is catalog.main_pipeline(model)
    with pytest.raises(ValueError) as caught:
        layer.check_request(make(**{**good, **bad}), catalog)
    assert "\n" not in str(caught.value)


def test_var_pruning_options_become_the_command_line_s_cached_token_pruning():
    """A request's VAR `pruning` and `pruning_layers` (a demo's widgets, a server body's
    "options") reach the call as the CLI's one `CachedTokenPruning`; a bad one is one line."""
    from mmgen.apps.requests import image
    from mmgen.decoding import CachedTokenPruning

    catalog = image.SERVICE.discover(["var-emoji64"])
    request = lambda **options: image.SERVICE.parse(model="var-emoji64", class_name="cat-face", method="ar",
                                                    family_options=options)
    checked = image.SERVICE.check(request(pruning="5=0.5", pruning_layers=[1, 3]), catalog)
    assert checked.family == {"pruning": CachedTokenPruning(keep={5: 0.5}, layers=(1, 3))}
    for bad, message in (({"pruning_layers": [1, 3]}, "needs --pruning"), ({"pruning_layers": 3}, "two integers"),
                         ({"pruning": "x"}, "bad --pruning item")):
        with pytest.raises(ValueError, match=message) as error:
            image.SERVICE.check(request(**bad), catalog)
        assert "\n" not in str(error.value)
