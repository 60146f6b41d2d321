"""The speech demo: its request function directly, its command, and the app in a real headless
Chromium (Debian's, driven by playwright) that must never reach the internet.

The models are tiny random Dia pipelines (`tests/audio/tiny.py`) saved as folders: `tiny-tts`
and, beside it, `tiny-tts-draft` (the same weights: every draft is accepted), served by path.
The browser fixtures are the image demo's (`tests/apps/test_image_demo.py`): they skip when
/usr/bin/chromium or playwright is missing, unless MMGEN_REQUIRE_BROWSER=1; screenshots go to
$MMGEN_TEST_ARTIFACTS/speech_demo/. The page streams audio where ffmpeg is installed (Gradio
encodes the stream with it) and shows each run's whole waveform otherwise; one browser test
serves the second layout explicitly, so that both are driven where ffmpeg is.
"""

from __future__ import annotations

import io
import os
import shutil
import threading

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import numpy as np
import pytest
import soundfile

from mmgen.apps.requests import speech as speech_request
from mmgen.apps.requests.speech import SpeechCatalog, SpeechRequest, run_request, stream_request
from mmgen.sampling import make_generator

from tests.apps import test_image_demo as image_demo_tests
from tests.apps.test_image_demo import pick, served

#: The image demo's browser fixtures, shared (bound by assignment: function arguments of these
#: names then read as uses, not as redefinitions of unused imports).
artifacts, browser, page = image_demo_tests.artifacts, image_demo_tests.browser, image_demo_tests.page
from tests.audio.tiny import RATE, tiny_dia
from tests.streams import drain, in_threads

READY = "#generate"  # the page fixture waits for it
ARTIFACTS = "speech_demo"
TEXT = "[S1] Hello there."
FRAMES = 40
METHODS = ["ar", "sjd", "sjd-coupled", "gsd", "draft", "heads", "lookup", "skip", "entropy-switch"]  # TTSPipeline.decoders() of a Dia model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tts-models")
    pipe = tiny_dia(1)
    pipe.save_pretrained(root / "tiny-tts")
    pipe.save_pretrained(root / "tiny-tts-draft")  # the target's own weights: every draft is accepted
    # What a benchmark records for a pair whose drafts are always accepted: the demo starts there.
    (root / "tiny-tts" / "decoding.json").write_text('{"default": "draft", "measured": "every draft accepted"}')
    alone = tmp_path_factory.mktemp("tts-alone") / "solo-tts"
    shutil.copytree(root / "tiny-tts", alone)  # no drafter beside it
    return root / "tiny-tts", alone


@pytest.fixture(scope="module")
def catalog(folders):
    return SpeechCatalog.discover([str(folders[0])])  # the drafter comes along as a sibling


def speak(**changes) -> SpeechRequest:
    return SpeechRequest(**{"model": "tiny-tts", "text": TEXT, "max_new_frames": FRAMES, "temperature": 0.0, **changes})


def wav_file(path, wave, rate=RATE):
    soundfile.write(path, np.asarray(wave, dtype=np.float32), rate)
    return path


def voice_file(tmp_path, seconds: float = 0.05, rate: int = RATE):
    return wav_file(tmp_path / f"voice-{seconds:g}s.wav", 0.3 * np.sin(np.arange(int(seconds * rate)) / 3.0), rate)


# --- the request function -------------------------------------------------------------------


def test_catalog_pairs_the_sibling_drafter_and_offers_draft_only_with_it(catalog, folders):
    assert list(catalog.main) == ["tiny-tts"] and list(catalog.companions) == ["tiny-tts-draft"]
    assert catalog.methods("tiny-tts") == METHODS
    alone = SpeechCatalog.discover([str(folders[1])])
    assert list(alone.main) == ["solo-tts"] and not alone.companions
    assert alone.methods("solo-tts") == [m for m in METHODS if m not in ("draft", "entropy-switch")]
    with pytest.raises(ValueError, match=r"decoding 'draft' needs a smaller model of the same codec: start with a folder solo-tts-draft"):
        run_request(speak(model="solo-tts", method="draft"), alone)
    given = SpeechCatalog.discover([str(folders[0]), str(folders[0].parent / "tiny-tts-draft")])  # named: once
    assert list(given.main) == ["tiny-tts"] and list(given.companions) == ["tiny-tts-draft"]


def test_the_bundled_pair_by_default_and_a_folder_of_another_kind_is_a_one_line_error(tmp_path):
    for none in (None, [], ["speech-tts"]):
        catalog = SpeechCatalog.discover(none)
        assert list(catalog.main) == ["speech-tts"] and list(catalog.companions) == ["speech-tts-draft"]
    with pytest.raises(ValueError, match="is neither a bundled speech model present in this installation nor a model folder"):
        SpeechCatalog.discover([str(tmp_path / "missing")])
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"is not a text-to-speech model: its config.json's model_type is not one of"):
        SpeechCatalog.discover([str(tmp_path / "llama")])


def test_one_request_gives_the_pipelines_audio_and_stats(catalog):
    out = run_request(speak(method="sjd"), catalog)
    direct = catalog.pipeline("tiny-tts")(TEXT, max_new_frames=FRAMES, temperature=0)
    assert out.baseline is None and np.array_equal(out.method.audio, direct.audio[0].numpy())
    (row,) = out.stats_rows()
    assert row["run"] == "sjd" and row["frames"] == int(direct.lengths[0]) and 1 <= row["forwards"] <= row["frames"]
    assert row["audio (s)"] == round(direct.audio[0].numel() / RATE, 3) and row["decode (s)"] > 0
    assert row["frames/forward"] == round(row["frames"] / row["forwards"], 2) and row["real-time factor"] > 0
    assert row["ms/frame"] == round(1000 * out.method.decode_s / row["frames"], 2) and "speedup (per frame)" not in row


@pytest.mark.parametrize("method", ["sjd", "draft"])
def test_compare_mode_gives_identical_audio_for_a_lossless_method_at_temperature_0(catalog, method):
    out = run_request(speak(method=method, compare=True), catalog)
    assert [run.label for run in out.runs] == ["ar (baseline)", method]
    assert out.baseline.audio.size > 0 and np.array_equal(out.method.audio, out.baseline.audio)
    assert out.method.frames == out.baseline.frames and out.baseline.stats.forwards == out.baseline.frames
    if method == "draft":
        assert out.method.stats.draft_forwards > 0 and out.method.stats.forwards < out.baseline.frames
    rows = out.stats_rows()
    assert [r["run"] for r in rows] == ["ar (baseline)", method] and rows[0]["frames/forward"] == 1.0
    assert rows[0]["speedup (per frame)"] == 1.0
    per_frame = lambda run: run.decode_s / run.frames  # noqa: E731
    assert rows[1]["speedup (per frame)"] == round(per_frame(out.baseline) / per_frame(out.method), 2)
    assert rows[0]["audio (s)"] == rows[1]["audio (s)"] and rows[1]["frames/forward"] >= 1.0


def test_sampling_is_reproducible_from_the_seed(catalog):
    run = lambda seed: run_request(speak(method="ar", temperature=1.0, top_k=0, top_p=1.0, seed=seed), catalog).method.audio
    assert np.array_equal(run(3), run(3)) and not np.array_equal(run(3), run(4))


def test_audio_streams_in_chunks_that_make_up_each_run(catalog):
    seen, result = drain(stream_request(speak(method="draft", compare=True, max_new_frames=60), catalog))
    for index, run in enumerate(result.runs):
        chunks = [p.chunk for p in seen if p.index == index]
        assert len(chunks) > 1 and {p.label for p in seen if p.index == index} == {run.label}
        np.testing.assert_allclose(np.concatenate(chunks), run.audio, atol=1e-6, rtol=0)  # float rounding only
        assert [p for p in seen if p.index == index][-1].seconds == pytest.approx(run.audio_seconds)
    assert [p.index for p in seen] == sorted(p.index for p in seen)  # the baseline first, then the method


def test_overlapping_requests_share_one_continuous_batch_and_speak_as_alone(folders):
    """--continuous-batch: requests from threads decode in the shared batch, each streamed and
    equal to the request alone (sampled, from its seed, its own frame budget), the adaptive
    window too (each row its own widths); lookup and compare requests speak alone."""
    shared = SpeechCatalog.discover([str(folders[0])])
    shared.continuous_batch = 2
    asks = {k: speak(method="ar", temperature=1.0, top_k=8, seed=k, max_new_frames=20 + 5 * k) for k in range(3)}
    seen, results = {}, {}

    def ask(k):
        events, results[k] = drain(stream_request(asks[k], shared))
        seen[k] = [event.chunk for event in events]

    in_threads(ask, asks)
    pipe = shared.pipeline("tiny-tts")
    for k, request in asks.items():
        run = results[k].method
        alone = pipe(TEXT, max_new_frames=request.max_new_frames, temperature=1.0, top_k=8, generator=make_generator(k))
        assert run.label == "ar (continuous batch)" and np.array_equal(run.audio, alone.audio[0].numpy())
        assert run.frames == int(alone.lengths[0]) and run.stats.forwards == alone.stats.forwards
        np.testing.assert_allclose(np.concatenate(seen[k]), run.audio, atol=1e-6, rtol=0)  # streamed, float rounding only
    assert len(shared._servers) == 1
    assert run_request(speak(method="sjd"), shared).method.label == "sjd (continuous batch)"
    assert run_request(speak(method="lookup"), shared).method.label == "lookup"
    assert run_request(speak(method="ar", compare=True), shared).method.label == "ar"


def test_a_stream_closed_early_frees_the_model_after_its_decoder_ends(catalog):
    events = stream_request(speak(method="ar", max_new_frames=120), catalog)
    next(events)
    decoding = lambda: [t for t in threading.enumerate() if t.name.endswith("(run)")]  # TTSPipeline.stream's thread
    assert catalog._locks["tiny-tts"].locked() and decoding()
    events.close()  # the page went away
    assert not catalog._locks["tiny-tts"].locked() and not decoding()
    assert run_request(speak(method="sjd"), catalog).method.frames == FRAMES  # the model serves the next request
    from mmgen.apps.speech_demo import handle_generate

    updates = handle_generate(catalog, 1024, True, *{**UI_VALUES, "budget": 120}.values())
    next(updates)  # the players are shown: the baseline is decoding
    assert catalog._locks["tiny-tts"].locked()
    updates.close()  # Gradio closes the handler of a page that went away
    assert not catalog._locks["tiny-tts"].locked() and not decoding()


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(model="../tiny-tts"), r"unknown model '../tiny-tts'; choose one of \['tiny-tts'\]"),
        (dict(model="tiny-tts-draft"), "unknown model 'tiny-tts-draft'"),  # a drafter is not a choice
        (dict(text="   "), "type a text to speak"),
        (dict(text=None), "type a text to speak"),
        (dict(text="x" * 1001), "at most 1000 characters, got 1001"),
        (dict(method="lantern"), r"unknown decoding method 'lantern' for this model; choose one of \['ar', 'sjd', "),
        (dict(method="<b>x</b>"), "unknown decoding method '<b>x</b>'"),  # plain text, not HTML-escaped
        (dict(method=["ar"]), r"unknown decoding method \['ar'\]"),
        (dict(temperature=-1), r"temperature must be a number in \[0, 5\]"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), r"top-k must be an integer in \[0, 68\]"),  # the tiny Dia's 64 codes and 4 specials
        (dict(top_k=69), r"top-k must be an integer in \[0, 68\]"),
        (dict(top_p=0), r"top-p must be a number in \(0, 1\]"),
        (dict(top_p=1.5), "top-p"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(max_new_frames=0), r"max new frames must be an integer in \[1, 255\]"),  # the model's context: 256
        (dict(max_new_frames=256), r"max new frames must be an integer in \[1, 255\]"),
        (dict(max_new_frames=True), "max new frames"),
        (dict(voice_text="[S1] Hi."), "the voice transcript is the transcript of a voice prompt: upload the voice too"),
        (dict(voice_text=3), "the voice transcript must be text"),
        (dict(voice="/etc"), "the voice prompt is not an audio file"),
        (dict(voice="/dev/zero"), "the voice prompt is not an audio file"),  # not a regular file: never read
        (dict(voice=12), "the voice prompt must be an audio file, got 12"),
    ],
)
def test_bad_input_is_a_one_line_value_error(catalog, changes, message):
    with pytest.raises(ValueError, match=message) as error:
        run_request(speak(**changes), catalog, max_new_frames=1024)
    assert "\n" not in str(error.value) and len(str(error.value)) < 200


def test_the_command_line_bound_caps_the_frames(catalog):
    with pytest.raises(ValueError, match=r"max new frames must be an integer in \[1, 16\]"):
        run_request(speak(max_new_frames=17), catalog, max_new_frames=16)


def test_voice_uploads_are_bounded_and_read_cleanly(catalog, tmp_path, monkeypatch):
    good = voice_file(tmp_path)
    out = run_request(speak(voice=str(good), voice_text="[S1] Hi."), catalog)
    direct = catalog.pipeline("tiny-tts")(TEXT, voice=str(good), voice_text="[S1] Hi.", max_new_frames=FRAMES, temperature=0)
    assert np.array_equal(out.method.audio, direct.audio[0].numpy())
    assert np.array_equal(run_request(speak(voice=good.read_bytes(), voice_text="[S1] Hi."), catalog).method.audio,
                          out.method.audio)  # the file's bytes read as the file
    notes = tmp_path / "notes.wav"
    notes.write_text("not a sound")
    cases = [
        (str(notes), "cannot read audio from the voice prompt: Format not recognised"),
        (str(wav_file(tmp_path / "silent.wav", np.zeros(800))), r"the voice prompt is silent \(peak below 0.001\)"),
        (str(voice_file(tmp_path, seconds=31, rate=8000)), "the voice prompt is 31.0 s long; at most 30 s is accepted"),
    ]
    for voice, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            run_request(speak(voice=voice), catalog)
        assert str(tmp_path) not in str(error.value) and "BytesIO" not in str(error.value)  # no server paths
    monkeypatch.setattr(speech_request, "MAX_VOICE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"the voice prompt is 1644 bytes; at most 1000 are accepted"):
        run_request(speak(voice=str(good)), catalog)
    with pytest.raises(ValueError, match=r"the voice prompt is over 1000 bytes"):
        run_request(speak(voice=good.read_bytes()), catalog)


# --- the UI handlers ---------------------------------------------------------------------------


UI_VALUES = dict(text=TEXT, voice=None, voice_text="", model="tiny-tts", method="draft", compare=True, temperature=0.0,
                 top_k=0, top_p=1.0, seed=0, budget=60)


def generate(catalog, streaming: bool, **changes) -> list:
    from mmgen.apps.speech_demo import handle_generate

    return list(handle_generate(catalog, 1024, streaming, *{**UI_VALUES, **changes}.values()))


def test_ui_handler_streams_int16_chunks_to_each_runs_player_then_the_stats(catalog, monkeypatch):
    from mmgen.apps import speech_demo

    monkeypatch.setattr(speech_demo, "MIN_CHUNK_SECONDS", 0.001)  # the tiny model's whole run is 15 ms of audio
    first, *streamed, last = generate(catalog, streaming=True)
    assert first[0]["visible"] is True and first[1]["label"] == "method: draft" and first[2] is None
    result = run_request(speak(method="draft", compare=True, max_new_frames=60), catalog)
    for player, run in ((0, result.baseline), (1, result.method)):
        chunks = [update[player] for update in streamed if isinstance(update[player], tuple)]
        assert len(chunks) > 1 and {rate for rate, _ in chunks} == {RATE}
        assert all(samples.dtype == np.int16 for _, samples in chunks)
        assert np.array_equal(np.concatenate([s for _, s in chunks]), speech_demo.pcm16(run.audio))
    assert list(last[2]["run"]) == ["ar (baseline)", "draft"] and "speedup (per frame)" in last[2].columns
    assert last[3].startswith("done: ar (baseline) ") and isinstance(last[1], dict)  # the stream is not sent again


def test_ui_handler_without_streaming_gives_each_whole_waveform_at_the_end(catalog):
    from mmgen.apps.speech_demo import pcm16

    *_, (baseline, method, stats, status) = generate(catalog, streaming=False, compare=False, method="sjd")
    result = run_request(speak(method="sjd", max_new_frames=60), catalog)
    assert baseline["visible"] is False and baseline["value"] is None
    rate, samples = method["value"]
    assert rate == RATE and np.array_equal(samples, pcm16(result.method.audio))
    assert list(stats["run"]) == ["sjd"] and list(stats.columns)[-2:] == ["real-time factor", "ms/frame"]


def test_ui_handler_errors_are_plain_one_line_gradio_errors(catalog, monkeypatch):
    import gradio as gr

    from mmgen.apps import speech_demo

    with pytest.raises(gr.Error) as error:
        generate(catalog, True, method="<b>x</b> & 'y'")
    assert error.value.message.startswith("unknown decoding method \"\\x3cb>x\\x3c/b> & 'y'\" for this model")

    def fail(*args, **kwargs):
        raise RuntimeError("codec said 'no'\n  at <frame 3>")
        yield

    monkeypatch.setattr(speech_demo, "stream_request", fail)
    with pytest.raises(gr.Error) as error:
        generate(catalog, True)
    assert error.value.message == "generation failed (RuntimeError): codec said 'no' at \\x3cframe 3>"


def test_switching_model_lists_its_methods_and_sampler_defaults(catalog):
    from mmgen.apps.speech_demo import handle_model

    method, temperature, top_k, top_p, final_std = handle_model(catalog, "tiny-tts")
    assert method["choices"] == METHODS and method["value"] == "draft"
    assert (temperature["value"], top_k["value"], top_p["value"]) == (0.0, 0, 1.0)  # greedy: its generation config
    assert final_std["visible"] is False  # VibeVoice's option (its record), not a Dia's


# --- the command -----------------------------------------------------------------------------


def test_demo_command_parses_bounds_defaults_to_the_bundled_pair_and_launches_locally(monkeypatch, folders, capsys):
    from mmgen import cli
    from mmgen.apps import speech_demo

    args = cli.build_parser().parse_args(["demo", "speech"])
    assert (args.model, args.host, args.port, args.share, args.max_new_frames, args.concurrency, args.device) == (
        None, "127.0.0.1", None, False, 1024, 1, "cpu")
    for bad in (["--max-new-frames", "0"], ["--max-new-frames", "4097"], ["--port", "70000"], ["--concurrency", "9"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["demo", "speech", *bad])
    capsys.readouterr()
    assert cli.main(["demo", "speech", "--model", str(folders[0].parent / "missing")]) == 2
    assert capsys.readouterr().err.strip().startswith("mmgen: error: --model ")
    launched = {}
    monkeypatch.setattr(speech_demo, "launch_demo", lambda demo, **kw: launched.update(kw, demo=demo))
    assert cli.main(["demo", "speech", "--model", str(folders[0]), "--concurrency", "2", "--max-new-frames", "64"]) == 0
    assert launched["host"] == "127.0.0.1" and launched["share"] is False and launched["port"] is None
    assert launched["demo"]._queue.default_concurrency_limit == 2
    (budget,) = [b for b in launched["demo"].blocks.values() if getattr(b, "elem_id", None) == "max-new-frames"]
    assert budget.maximum == 64
    players = [b for b in launched["demo"].blocks.values() if getattr(b, "elem_id", None) in ("audio", "baseline-audio")]
    assert len(players) == 2 and {p.streaming for p in players} == {speech_demo.can_stream()}
    assert cli.main(["demo", "speech", "--model", str(folders[0].parent / "nowhere")]) == 2


# --- the app in a headless browser -----------------------------------------------------------


@pytest.fixture(scope="module")
def app_url(browser, catalog):  # `browser`: the image demo's fixture
    from mmgen.apps.speech_demo import build_demo, launch_demo

    with served(build_demo(catalog, max_new_frames=FRAMES), launch_demo) as url:
        yield url


def press_generate(page, method: str) -> str:
    """Press Generate, wait for the run to end (the stats table shows the method's row) and
    return the stats text."""
    from playwright.sync_api import expect

    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text("done:")
    expect(page.locator("#stats")).to_contain_text(method)
    return page.locator("#stats").inner_text()


def audio_source(page, player: str) -> str:
    """What a player plays: its <audio>'s source (streaming: a MediaSource blob), else the file
    its download link serves (the waveform player keeps its <audio> to itself)."""
    page.wait_for_function(
        """(id) => { const root = document.querySelector('#' + id);
                     const audio = root && root.querySelector('audio');
                     const link = root && root.querySelector('[data-testid=download-link]');
                     return (audio && audio.src) || (link && link.href); }""", arg=player)
    return page.evaluate("""(id) => { const root = document.querySelector('#' + id);
                                      const audio = root.querySelector('audio');
                                      const link = root.querySelector('[data-testid=download-link]');
                                      return (audio && audio.src) || link.href; }""", player)


def test_type_a_text_with_a_voice_generate_and_the_player_gets_the_audio(page, artifacts, tmp_path, monkeypatch):
    voices, read = [], speech_request._voice
    monkeypatch.setattr(speech_request, "_voice", lambda voice, rate: voices.append(voice) or read(voice, rate))
    assert page.title() == "mmgen speech demo"
    assert page.locator("#method input").input_value() == "draft"
    page.locator("#text textarea").fill("[S1] Good morning, browser.")
    page.locator("#voice input[type=file]").set_input_files(str(voice_file(tmp_path)))
    page.locator("#voice audio, #voice [data-testid^=waveform]").first.wait_for(state="attached")  # the upload's player
    page.locator("#voice-text textarea").fill("[S1] Hi.")
    stats = press_generate(page, "draft")
    assert "frames/forward" in stats and "real-time factor" in stats and "ar (baseline)" not in stats
    assert len(voices) == 1 and voices[0].endswith(".wav") and voices[0] != str(voice_file(tmp_path))  # Gradio's copy
    assert audio_source(page, "audio").startswith(("blob:http://127.0.0.1:", "http://127.0.0.1:"))
    assert not page.locator("#baseline-audio").is_visible()
    page.screenshot(path=artifacts / "01-generate.png", full_page=True)


def test_compare_mode_shows_two_players(page, artifacts):
    from playwright.sync_api import expect

    pick(page, "method", "sjd")
    page.locator("#compare input[type=checkbox]").check()
    stats = press_generate(page, "sjd")
    assert "ar (baseline)" in stats and "speedup (per frame)" in stats
    expect(page.locator("#baseline-audio")).to_be_visible()
    assert audio_source(page, "baseline-audio") and audio_source(page, "audio")  # (one file where not streamed: the same audio)
    page.screenshot(path=artifacts / "02-compare.png", full_page=True)


def test_without_streaming_the_page_gets_the_whole_wav(browser, catalog, artifacts):
    """The layout for machines without ffmpeg: each player gets its run's WAV at the end."""
    from playwright.sync_api import expect

    from mmgen.apps.speech_demo import build_demo, launch_demo, pcm16

    with served(build_demo(catalog, max_new_frames=FRAMES, streaming=False), launch_demo) as url:
        context = browser.new_context(viewport={"width": 1280, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.locator("#text textarea").fill(TEXT)
        page.locator("#compare input[type=checkbox]").check()
        press_generate(page, "draft")
        expect(page.locator("#baseline-audio")).to_be_visible()
        source = audio_source(page, "audio")
        assert source.startswith(url) and source.endswith(".wav")
        samples, rate = soundfile.read(io.BytesIO(page.request.get(source).body()), dtype="int16")
        expected = run_request(speak(method="draft", max_new_frames=FRAMES), catalog).method.audio
        assert rate == RATE and np.array_equal(samples, pcm16(expected))
        page.screenshot(path=artifacts / "03-whole.png", full_page=True)
        context.close()


def test_a_bad_request_shows_a_one_line_error(page, artifacts):
    from playwright.sync_api import expect

    box = page.locator("#method input")  # takes any value: the server checks it against the model
    box.click()
    box.fill("lantern")
    box.press("Enter")
    page.locator("#generate").click()
    toast = page.locator("[data-testid=toast-text]").first
    expect(toast).to_contain_text("unknown decoding method 'lantern' for this model; choose one of ['ar', ")
    assert "\n" not in toast.inner_text().strip()
    page.wait_for_timeout(500)  # let the toast finish fading in
    page.screenshot(path=artifacts / "04-error.png")
