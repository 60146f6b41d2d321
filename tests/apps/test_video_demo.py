"""The video demo: its request function directly, its command, and the app in a real headless
Chromium (Debian's, driven by playwright) that must never reach the internet.

The models are tiny random Wan pipelines (`tests/video/tiny.py`, 32×32 frames, blocks of 2
latent frames) saved as folders: `tiny-video` and, beside it, its small model
`tiny-video-small` (one layer, other weights), served by path. The browser fixtures are the
image demo's (`tests/apps/test_image_demo.py`): they skip when /usr/bin/chromium or playwright
is missing, unless MMGEN_REQUIRE_BROWSER=1; screenshots go to $MMGEN_TEST_ARTIFACTS/video_demo/.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from types import SimpleNamespace

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import numpy as np
import pytest
import torch

from mmgen.apps.requests.video import (WORKER, VideoCatalog, VideoRequest, default_length, lengths, model_settings,
                                      run_request, stream_request)

from tests.apps import test_image_demo as image_demo_tests
from tests.apps.test_image_demo import pick, served
from tests.streams import drain
from tests.video.tiny import tiny_video_pipeline

#: The image demo's browser fixtures, shared (bound by assignment: function arguments of these
#: names then read as uses, not as redefinitions of unused imports).
artifacts, browser, page = image_demo_tests.artifacts, image_demo_tests.browser, image_demo_tests.page

READY = "#generate"  # the page fixture waits for it
ARTIFACTS = "video_demo"
PROMPT = "cat face moving left"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("video-models")
    tiny_video_pipeline().save_pretrained(root / "tiny-video")
    tiny_video_pipeline(layers=1, seed=1).save_pretrained(root / "tiny-video-small")
    alone = tmp_path_factory.mktemp("video-alone") / "solo-video"
    shutil.copytree(root / "tiny-video", alone)  # no small model beside it
    return root / "tiny-video", alone


@pytest.fixture(scope="module")
def catalog(folders):
    return VideoCatalog.discover([str(folders[0])])  # the small model comes along as a sibling


def video(**changes) -> VideoRequest:
    return VideoRequest(**{"model": "tiny-video", "prompt": PROMPT, "num_frames": 13, **changes})


def direct(catalog, seed: int = 0, **call):
    """The pipeline's own video for the same settings."""
    return catalog.pipeline("tiny-video")(PROMPT, generator=torch.Generator().manual_seed(seed), **call)


def workers() -> list:
    return [t for t in threading.enumerate() if t.name.startswith(WORKER)]


# --- the request function -------------------------------------------------------------------


def test_catalog_pairs_the_sibling_small_model_and_offers_collaborative_only_with_it(catalog, folders):
    assert list(catalog.main) == ["tiny-video"] and list(catalog.companions) == ["tiny-video-small"]
    assert catalog.methods("tiny-video") == ["block", "collaborative"]
    alone = VideoCatalog.discover([str(folders[1])])
    assert list(alone.main) == ["solo-video"] and not alone.companions and alone.methods("solo-video") == ["block"]
    with pytest.raises(ValueError, match="collaborative denoising needs a small model: start with a folder "
                                         "solo-video-small beside the model"):
        run_request(VideoRequest("solo-video", PROMPT, method="collaborative"), alone)
    given = VideoCatalog.discover([str(folders[0]), str(folders[0].parent / "tiny-video-small") + "/"])  # named: once
    assert list(given.main) == ["tiny-video"] and list(given.companions) == ["tiny-video-small"]


def test_the_bundled_model_by_default_and_other_folders_are_one_line_errors(tmp_path):
    catalog = VideoCatalog.discover(None)  # the bundled pair
    assert list(catalog.main) == ["emoji-motion"] and list(catalog.companions) == ["emoji-motion-small"]
    with pytest.raises(ValueError, match="is neither a bundled video model nor a pipeline folder with a model_index.json"):
        VideoCatalog.discover([str(tmp_path / "missing")])
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "model_index.json").write_text('{"_class_name": "LlamaGenPipeline"}')
    with pytest.raises(ValueError, match="is not a block-diffusion video model: its model_index.json names no "
                                         "BlockDiffusionVideoPipeline"):
        VideoCatalog.discover([str(tmp_path / "image")])


def test_lengths_are_whole_blocks_of_latent_frames_up_to_the_bound(catalog):
    assert lengths(catalog.pipeline("tiny-video"), 40) == [5, 13, 21, 29, 37]  # 1 + 4·(2n − 1)
    assert lengths(SimpleNamespace(temporal_ratio=4, block_frames=3), 40) == [9, 21, 33]  # Self-Forcing's blocks of 3
    assert lengths(SimpleNamespace(temporal_ratio=4, block_frames=1), 13) == [1, 5, 9, 13]
    assert lengths(SimpleNamespace(temporal_ratio=4, block_frames=3), 8) == []
    assert lengths(SimpleNamespace(temporal_ratio=4, block_frames=1), 10**6)[-1] == 321  # the hard cap
    pipe = SimpleNamespace(num_frames=81)
    assert default_length(pipe, [9, 21, 81]) == 81 and default_length(pipe, [9, 21, 33]) == 33
    assert default_length(SimpleNamespace(num_frames=5), [9, 21]) == 9 and default_length(pipe, []) is None
    s = model_settings(catalog, "tiny-video", 29)
    assert (s["lengths"], s["length"], s["steps"], s["large_steps"]) == ([5, 13, 21, 29], 13, 4, 2)
    assert s["policies"] == ["global", "window:4", "sink:2,window:4", "none"]


def test_blocks_stream_in_order_and_make_up_the_pipelines_video(catalog):
    seen, result = drain(stream_request(video(num_frames=29, cache_policy="sink:2,window:4", seed=3), catalog))
    assert [p.index for p in seen] == [0, 1, 2, 3] and {p.num_blocks for p in seen} == {4}
    assert [p.start for p in seen] == [0, 5, 13, 21] and [len(p.frames) for p in seen] == [5, 8, 8, 8]
    assert all(a.seconds < b.seconds for a, b in zip(seen, seen[1:]))
    expected = direct(catalog, 3, num_frames=29, cache_policy="sink:2,window:4").frames[0].numpy()
    assert np.array_equal(result.frames, expected)  # the same seed: the pipeline's own video
    assert np.array_equal(np.concatenate([p.frames for p in seen]), expected)
    assert [len(b) for b in result.blocks()] == [5, 8, 8, 8] and result.fps == 8.0
    assert not workers() and not catalog._locks["tiny-video"].locked()


def test_decoding_at_the_end_streams_the_blocks_without_frames(catalog):
    seen, result = drain(stream_request(video(decode_per_block=False, seed=1), catalog))
    assert [(p.index, p.start, p.frames) for p in seen] == [(0, 0, None), (1, 5, None)]
    assert np.array_equal(result.frames, direct(catalog, 1, num_frames=13, decode="end").frames[0].numpy())


def test_collaborative_first_block_cache_and_token_dropping_reach_the_pipeline(catalog):
    result = run_request(video(num_frames=21, method="collaborative", large_steps=1), catalog)
    assert result.label == "collaborative (large 1/4 steps)"
    assert result.stats.denoise_forwards == {"large": 3, "small": 9} and "tiny-video-small" in catalog._pipelines
    assert result.profile_row()["denoise forwards"] == "large 3 · small 9"
    cached = run_request(video(cache_threshold=0.0, drop_threshold=0.0, seed=2), catalog)  # 0: off, the plain video
    assert np.array_equal(cached.frames, direct(catalog, 2, num_frames=13).frames[0].numpy())
    dropped = run_request(video(drop_threshold=0.5, seed=2), catalog)
    assert dropped.profile_row()["tokens computed"].startswith("model ") and cached.profile_row()["tokens computed"] == "all"
    fbc = run_request(video(cache_threshold=0.5, seed=2), catalog)
    assert np.array_equal(fbc.frames, direct(catalog, 2, num_frames=13, cache_threshold=0.5).frames[0].numpy())


def test_the_profile_and_the_mp4(catalog, tmp_path):
    from mmgen.apps.requests.video import size_text
    from mmgen.video.export import read_mp4

    result = run_request(video(), catalog)
    row = result.profile_row()
    assert (row["method"], row["frames"], row["blocks"], row["denoise forwards"]) == ("block", 13, 2, "model 8")
    assert 0 < row["first block (s)"] <= row["total (s)"] and row["frames/s"] > 0 and row["cache"] == "9.0 KiB"
    blocks = result.block_rows()
    assert [(b["block"], b["frames"]) for b in blocks] == [(1, "0–4"), (2, "5–12")]
    assert all(b["latency (s)"] > 0 for b in blocks)
    assert (size_text(0), size_text(1023), size_text(9216), size_text(5 * 2**30)) == ("0 B", "1023 B", "9.0 KiB", "5.0 GiB")
    data = result.mp4()
    assert data[4:8] == b"ftyp"
    (tmp_path / "clip.mp4").write_bytes(data)
    clip = read_mp4(tmp_path / "clip.mp4")
    assert clip.shape == (13, 32, 32, 3) and np.abs(clip.astype(float) - result.frames).mean() < 12  # H.264 at crf 18


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(model="../tiny-video"), r"unknown model '../tiny-video'; choose one of \['tiny-video'\]"),
        (dict(model="tiny-video-small"), "unknown model 'tiny-video-small'"),  # a small model is not a choice
        (dict(prompt="  "), r"type a prompt \(the prompt is empty\)"),
        (dict(prompt=None), "type a prompt"),
        (dict(prompt="x" * 501), "at most 500 characters, got 501"),
        (dict(num_frames=9), "num_frames=9 is 3 latent frames, not a multiple of block_frames=2: use num_frames 5 or 13"),
        (dict(num_frames=12), r"num_frames must be 1 \+ 4·k"),
        (dict(num_frames=37), r"length \(frames\) must be an integer in \[1, 29\], got 37"),
        (dict(num_frames=0), r"length \(frames\) must be an integer"),
        (dict(num_frames="13"), r"length \(frames\) must be an integer"),
        (dict(num_frames=True), r"length \(frames\) must be an integer"),
        (dict(cache_policy="window:0"), "cache policy 'window:0': cache window must be an integer >= 1"),
        (dict(cache_policy="window:129"), r"cache policy 'window:129': cache window must be an integer in \[1, 128\], got 129"),
        (dict(cache_policy="sink:200,window:4"), r"cache sink must be an integer in \[0, 128\], got 200"),
        (dict(cache_policy="sink:1"), "expected 'global', 'window:N' or 'sink:S,window:N'"),
        (dict(cache_policy="window:4,size:2"), r"unknown field\(s\) \['size'\]"),
        (dict(cache_policy="<b>x</b>"), "cache policy '<b>x</b>'"),  # plain text, not HTML-escaped
        (dict(cache_policy="w" * 41), "the cache policy must be global, window:N, sink:S,window:N or none"),
        (dict(cache_policy=4), "the cache policy must be"),
        (dict(cache_policy="none", cache_threshold=0.1), "First Block Cache and token dropping need the K/V cache"),
        (dict(cache_policy="none", drop_threshold=0.1), "need the K/V cache"),
        (dict(decode_per_block="yes"), "decode per block must be true or false, got 'yes'"),
        (dict(method="lantern"), r"unknown method 'lantern' for this model; choose one of \['block', 'collaborative'\]"),
        (dict(method=["block"]), r"unknown method \['block'\]"),
        (dict(method="collaborative", large_steps=0), r"large-model steps must be an integer in \[1, 4\], got 0"),
        (dict(method="collaborative", large_steps=5), r"large-model steps must be an integer in \[1, 4\]"),
        (dict(cache_threshold=-0.1), r"First Block Cache threshold must be a number in \[0, 1\]"),
        (dict(cache_threshold=float("nan")), "First Block Cache threshold"),
        (dict(drop_threshold=2), r"token dropping threshold must be a number in \[0, 1\]"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=1.5), "seed must be an integer"),
    ],
)
def test_bad_input_is_a_one_line_value_error_before_any_work(catalog, changes, message):
    with pytest.raises(ValueError, match=message) as error:
        next(stream_request(video(**changes), catalog, max_frames=29))
    assert "\n" not in str(error.value) and len(str(error.value)) < 200
    assert not workers() and not catalog._locks["tiny-video"].locked()


def test_a_rollout_past_the_rotary_table_is_a_one_line_error_naming_the_window_policies(catalog):
    # 125 frames are 32 latent frames: with a block they overflow the tiny model's 32-frame table
    with pytest.raises(ValueError, match="overflow the model's rotary table .* use a window policy") as error:
        next(stream_request(video(num_frames=125), catalog, max_frames=125))
    assert "\n" not in str(error.value) and not workers() and not catalog._locks["tiny-video"].locked()


def test_a_stream_closed_early_stops_after_its_block_and_frees_the_model(catalog):
    from mmgen.apps.video_demo import handle_generate

    events = stream_request(video(num_frames=117, cache_policy="window:4"), catalog, max_frames=117)
    assert next(events).index == 0 and catalog._locks["tiny-video"].locked() and workers()
    events.close()  # the page went away: the run ends at its next block
    assert not catalog._locks["tiny-video"].locked() and not workers()
    updates = handle_generate(catalog, 117, "", *{**UI_VALUES, "length": 117, "cache_policy": "window:4"}.values())
    next(updates)  # the first block is shown
    assert catalog._locks["tiny-video"].locked()
    updates.close()  # Gradio closes the handler of a page that went away
    assert not catalog._locks["tiny-video"].locked() and not workers()
    assert run_request(video(), catalog).frames.shape[0] == 13  # the model serves the next request


# --- the UI handlers ---------------------------------------------------------------------------


UI_VALUES = dict(prompt=PROMPT, model="tiny-video", length=13, cache_policy="global", per_block=True, method="block",
                 large_steps=2, cache_threshold=0, drop_threshold=0, seed=0)


def generate(catalog, cache_dir, **changes) -> list:
    from mmgen.apps.video_demo import handle_generate

    return list(handle_generate(catalog, 29, str(cache_dir), *{**UI_VALUES, **changes}.values()))


def test_ui_handler_grows_the_sheet_a_row_per_block_then_gives_the_video_and_profile(catalog, tmp_path):
    from mmgen.video.export import read_mp4

    (sheet1, status1, video1, profile1, latency1), (sheet2, status2, *_), _, (sheet, status, path, profile, latency) = \
        generate(catalog, tmp_path, length="21", seed=4)  # a typed length arrives as text
    assert status1.startswith("block 1 of 3: frames 0–4 after ") and status2.startswith("block 2 of 3: frames 5–12")
    assert (video1, profile1, latency1) == (None, None, None)  # the last request's video goes
    assert sheet1.size == (5 * 96 + 4 * 4, 96) and sheet2.size == (8 * 96 + 7 * 4, 2 * 96 + 10)  # ×3, one row per block
    assert sheet.size == (8 * 96 + 7 * 4, 3 * 96 + 10 * 2)
    assert status.startswith("done: 21 frames (2.62 s at 8 fps) in ") and status.endswith("(block)")
    expected = direct(catalog, 4, num_frames=21).frames[0].numpy()
    assert np.asarray(sheet)[:96:3, :96:3].tolist() == expected[0].tolist()  # the first frame, scaled ×3
    assert path.startswith(str(tmp_path)) and path.endswith("mmgen-video.mp4")  # in Gradio's cache
    assert read_mp4(path).shape == (21, 32, 32, 3)
    assert list(profile["method"]) == ["block"] and list(profile["frames"]) == [21] and list(profile["blocks"]) == [3]
    assert list(latency["block"]) == ["1 · frames 0–4", "2 · frames 5–12", "3 · frames 13–20"]
    assert (latency["latency (s)"] > 0).all()


def test_ui_handler_decoding_at_the_end_shows_the_sheet_at_the_end(catalog, tmp_path):
    first, second, _, last = generate(catalog, tmp_path, length=21, per_block=False, method="collaborative", large_steps=3)
    assert first[0] is None and "made after" in first[1] and "decoded at the end" in first[1]
    assert isinstance(second[0], dict) and last[0].size == (8 * 96 + 7 * 4, 3 * 96 + 10 * 2)
    assert list(last[3]["denoise forwards"]) == ["large 9 · small 3"]


def test_ui_handler_errors_are_plain_one_line_gradio_errors(catalog, tmp_path, monkeypatch):
    import gradio as gr

    from mmgen.apps import video_demo

    with pytest.raises(gr.Error) as error:
        generate(catalog, tmp_path, cache_policy="<b>x</b> & 'y'")
    assert error.value.message.startswith("cache policy \"\\x3cb>x\\x3c/b> & 'y'\": expected 'global'")
    assert error.value.title == "Invalid input"

    def fail(*args, **kwargs):
        raise RuntimeError("VAE said 'no'\n  at <frame 3>")
        yield

    monkeypatch.setattr(video_demo, "stream_request", fail)
    with pytest.raises(gr.Error) as error:
        generate(catalog, tmp_path)
    assert error.value.message == "generation failed (RuntimeError): VAE said 'no' at \\x3cframe 3>"
    assert error.value.title == "Generation failed"


def test_switching_model_lists_its_lengths_policies_and_methods(catalog):
    from mmgen.apps.video_demo import handle_model

    length, policy, method, large_steps = handle_model(catalog, 29, "tiny-video")
    assert length["choices"] == [5, 13, 21, 29] and length["value"] == 13
    assert policy["value"] == "global" and "sink:2,window:4" in policy["choices"]
    assert method["choices"] == ["block", "collaborative"] and (large_steps["maximum"], large_steps["value"]) == (4, 2)


def test_the_live_player_plays_a_stream_steers_its_next_block_and_stops_freeing_the_model(catalog):
    from mmgen.apps.video_demo import LivePlayers, handle_live, handle_steer, handle_stop

    players = LivePlayers()
    shown = handle_live(players, catalog, "page", PROMPT, "tiny-video", "block", 2, 0, paced=False)
    played = [next(shown) for _ in range(6)]  # block 1's 5 frames, block 2's first
    assert catalog._locks["tiny-video"].locked()
    assert handle_steer(players, "page", "dog face moving up") == "the next block follows “dog face moving up”"
    with pytest.raises(gr_error()) as error:
        handle_steer(players, "page", "  ")  # refused: the stream runs on with its prompt
    assert error.value.message == "type a prompt (the prompt is empty)"
    played += [next(shown) for _ in range(7 + 8)]  # the rest of block 2, block 3
    assert handle_stop(players, "page") == "" and not catalog._locks["tiny-video"].locked()
    (_, end), = list(shown)
    assert end == "stopped: 3 blocks, 21 frames" and players.get("page") is None
    assert [status for _, status in played[4:6]] == ["block 1 · frame 4 · “cat face moving left”",
                                                     "block 2 · frame 5 · “cat face moving left”"]
    assert played[-1][1] == "block 3 · frame 20 · “dog face moving up”"  # block 2 was made: block 3 followed
    pipe = catalog.pipeline("tiny-video")
    with pipe.stream(PROMPT, generator=torch.Generator().manual_seed(0)) as stream:
        blocks = [next(stream) for _ in range(2)]
        stream.set_prompt("dog face moving up")
        blocks.append(next(stream))
    frames = np.concatenate([b.frames[0].numpy() for b in blocks])
    assert played[0][0].size == (256, 256)  # 32×32 frames scaled ×8, nearest neighbour
    assert all(np.array_equal(np.asarray(image)[::8, ::8], frame) for (image, _), frame in zip(played, frames))
    with pytest.raises(gr_error(), match="no stream is running"):
        handle_steer(players, "page", "dog face")
    with pytest.raises(gr_error()) as error:
        next(handle_live(players, catalog, "page", PROMPT, "tiny-video", "block", 2, -1))
    assert error.value.message.startswith("seed must be an integer") and not catalog._locks["tiny-video"].locked()


def gr_error() -> type:
    import gradio as gr

    return gr.Error


# --- the command -----------------------------------------------------------------------------


def test_demo_command_parses_bounds_and_launches_locally(monkeypatch, folders, capsys):
    from mmgen import cli
    from mmgen.apps import video_demo

    args = cli.build_parser().parse_args(["demo", "video"])
    assert (args.model, args.host, args.port, args.share, args.max_frames, args.concurrency, args.device) == (
        None, "127.0.0.1", None, False, 81, 1, "cpu")
    for bad in (["--max-frames", "0"], ["--max-frames", "322"], ["--port", "70000"], ["--concurrency", "9"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["demo", "video", *bad])
    capsys.readouterr()
    assert cli.main(["demo", "video", "--model", str(folders[0].parent / "missing")]) == 2
    assert capsys.readouterr().err.strip().startswith("mmgen: error: --model ")
    launched = {}
    monkeypatch.setattr(video_demo, "launch_demo", lambda demo, **kw: launched.update(kw, demo=demo))
    assert cli.main(["demo", "video", "--model", str(folders[0]), "--concurrency", "2", "--max-frames", "21"]) == 0
    assert launched["host"] == "127.0.0.1" and launched["share"] is False and launched["port"] is None
    assert launched["demo"]._queue.default_concurrency_limit == 2
    (length,) = [b for b in launched["demo"].blocks.values() if getattr(b, "elem_id", None) == "length"]
    assert [value for _, value in length.choices] == [5, 13, 21]


# --- the app in a headless browser -----------------------------------------------------------


@pytest.fixture(scope="module")
def app_url(browser, catalog):  # `browser`: the image demo's fixture
    from mmgen.apps.video_demo import build_demo, launch_demo

    with served(build_demo(catalog, max_frames=29), launch_demo) as url:
        yield url


def natural_size(page, selector: str) -> list:
    """The picture's size once the browser has decoded it (it may still be loading when the
    status line already says done)."""
    page.wait_for_function("(s) => { const i = document.querySelector(s); return i && i.complete && i.naturalWidth > 0; }",
                           arg=selector)
    return page.evaluate("(s) => { const i = document.querySelector(s); return [i.naturalWidth, i.naturalHeight]; }", selector)


def test_blocks_show_as_they_are_made_then_the_player_gets_the_video(page, app_url, artifacts, catalog, monkeypatch):
    from playwright.sync_api import expect

    from mmgen.video.export import read_mp4

    # Hold the run after its first block, so that the page is seen with one block and no video yet.
    held, release = threading.Event(), threading.Event()
    cls = type(catalog.pipeline("tiny-video"))
    call = cls.__call__

    def paused(self, *args, callback=None, **kwargs):
        def hold(index, latents, frames):
            callback(index, latents, frames)
            if index == 0:
                held.set()
                release.wait(60)

        return call(self, *args, callback=hold, **kwargs)

    monkeypatch.setattr(cls, "__call__", paused)
    try:
        assert page.title() == "mmgen video demo"
        assert page.locator("#length input").input_value() == "13" and page.locator("#method input").input_value() == "block"
        page.locator("#prompt textarea").fill("dog face moving up")
        page.locator("#generate").click()
        expect(page.locator("#status")).to_contain_text("block 1 of 2: frames 0–4")
        page.locator("#blocks img").wait_for()
        assert held.is_set() and natural_size(page, "#blocks img") == [5 * 96 + 4 * 4, 96]  # one row: block 1
        assert page.locator("#video video").count() == 0
        page.screenshot(path=artifacts / "01-first-block.png", full_page=True)
    finally:
        release.set()
    expect(page.locator("#status")).to_contain_text("done: 13 frames")
    page.wait_for_function("() => { const v = document.querySelector('#video video'); return v && v.readyState >= 1; }")
    assert natural_size(page, "#blocks img") == [8 * 96 + 7 * 4, 2 * 96 + 10]  # two rows
    source = page.evaluate("document.querySelector('#video video').src")
    assert source.startswith(app_url) and source.endswith(".mp4")
    assert page.evaluate("document.querySelector('#video video').videoWidth") == 32  # Chromium decodes the H.264
    path = artifacts / "01-video.mp4"
    path.write_bytes(page.request.get(source).body())  # what the player plays: the request's video
    assert read_mp4(path).shape == (13, 32, 32, 3)
    stats = page.locator("#stats").inner_text()
    assert "first block (s)" in stats and "frames/s" in stats and "cache" in stats and "model 8" in stats
    page.locator("#latency svg").first.wait_for()
    page.screenshot(path=artifacts / "02-done.png", full_page=True)


def test_collaborative_decoded_at_the_end(page, artifacts):
    from playwright.sync_api import expect

    pick(page, "method", "collaborative")
    expect(page.locator("#large-steps")).to_be_visible()
    pick(page, "length", "21")
    page.locator("#per-block input[type=checkbox]").uncheck()
    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text("done: 21 frames")
    expect(page.locator("#stats")).to_contain_text("large 6 · small 6")
    assert natural_size(page, "#blocks img") == [8 * 96 + 7 * 4, 3 * 96 + 10 * 2]
    page.screenshot(path=artifacts / "03-collaborative.png", full_page=True)


def test_a_bad_cache_policy_shows_a_one_line_error(page, artifacts):
    from playwright.sync_api import expect

    box = page.locator("#cache-policy input")  # takes any value: the server checks it
    box.click()
    box.fill("window:0")
    box.press("Enter")
    page.locator("#generate").click()
    toast = page.locator("[data-testid=toast-text]").first
    expect(toast).to_contain_text("cache policy 'window:0': cache window must be an integer >= 1 or None (global), got 0")
    assert "\n" not in toast.inner_text().strip()
    page.wait_for_timeout(500)  # let the toast finish fading in
    page.screenshot(path=artifacts / "04-error.png")


def test_the_live_player_plays_steers_and_stops_in_the_page(page, artifacts, catalog):
    from playwright.sync_api import expect

    page.locator("#live-start").click()
    status, frame = page.locator("#live-status"), "document.querySelector('#live-frame img')"
    expect(status).to_contain_text(re.compile(r"block \d+ · frame \d+ · “cat face moving left”"))
    page.wait_for_function(f"() => {frame} && {frame}.naturalWidth === 256")
    first = page.evaluate(f"{frame}.src")
    page.wait_for_function(f"(s) => {frame}.src !== s", arg=first)  # the frames change as the stream plays
    page.screenshot(path=artifacts / "05-live.png", full_page=True)
    page.locator("#steer-prompt textarea").fill("dog face moving up")
    page.locator("#steer").click()
    expect(page.locator("#steer-status")).to_contain_text("the next block follows “dog face moving up”")
    expect(status).to_contain_text("“dog face moving up”", timeout=30_000)  # a later block followed it, the stream ran on
    page.screenshot(path=artifacts / "06-steered.png", full_page=True)
    page.locator("#live-stop").click()
    expect(status).to_contain_text("stopped: ")
    assert not catalog._locks["tiny-video"].locked()
    page.locator("#live-start").click()  # again, and the page goes away while it plays
    expect(status).to_contain_text(re.compile(r"block \d+ · frame"))
    assert catalog._locks["tiny-video"].locked()
    page.close()
    deadline = time.monotonic() + 20
    while catalog._locks["tiny-video"].locked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not catalog._locks["tiny-video"].locked()  # the stream was closed with the page
