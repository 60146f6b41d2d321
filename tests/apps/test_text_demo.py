"""The VLM demo: its request function directly, its command, and the app in a real headless
Chromium (Debian's, driven by playwright) that must never reach the internet.

The models are tiny random LLaVA pipelines built here (`tests/vlm`'s builders), a target and a
drafter of the same tokenizer, saved as folders and served by path. The browser fixtures are the
image demo's (`tests/apps/test_image_demo.py`): they skip when /usr/bin/chromium or playwright is
missing, unless MMGEN_REQUIRE_BROWSER=1; screenshots go to $MMGEN_TEST_ARTIFACTS/text_demo/.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
import torch
from PIL import Image

from mmgen.apps.requests import text as text_request
from mmgen.apps.requests.text import ChatRequest, VLMCatalog, run_request, stream_request
from mmgen.decoding import DECODERS
from mmgen.sampling import make_generator
from mmgen.vlm import pipeline as vlm_pipeline

from tests.apps.test_image_demo import artifacts, browser, page, pick, served  # noqa: F401 - shared browser fixtures
from tests.streams import drain, in_threads
from tests.vlm.test_vlm_pipeline import images, tiny_llava

READY = "#message textarea"  # the page fixture waits for it
ARTIFACTS = "text_demo"
QUESTION = "what is this ?"
#: What the tiny random models cannot do: LANTERN needs an image tokenizer's codebook, and
#: entropy switching a small model that VLMPipeline does not pair.
NOT_FOR_TEXT = {"lantern", "lantern++", "entropy-switch"}


def deep_llava(layers: int = 4):
    """`tiny_llava` with a deeper language model: FastV and MustDrop prune after layer 2."""
    from transformers import LlavaForConditionalGeneration

    from mmgen.vlm.pipeline import VLMPipeline

    base = tiny_llava(0)
    config = copy.deepcopy(base.model.config)
    config.text_config.num_hidden_layers = layers
    torch.manual_seed(0)
    return VLMPipeline(LlavaForConditionalGeneration(config).eval(), base.processor)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-models")
    pipe = deep_llava()
    pipe.save_pretrained(root / "tiny-vlm")
    pipe.save_pretrained(root / "tiny-vlm-draft")  # the target's own weights: every draft is accepted
    # What a benchmark records for a pair whose drafts are always accepted: the demo starts there.
    (root / "tiny-vlm" / "decoding.json").write_text('{"default": "draft", "measured": "every draft accepted"}')
    return root / "tiny-vlm", root / "tiny-vlm-draft"


@pytest.fixture(scope="module")
def catalog(folders):
    catalog = VLMCatalog.discover([str(f) for f in folders])
    for name in catalog.names:  # no stop token: answers run to their budget (random models stop anywhere)
        catalog.pipeline(name).eos_token_ids = []
    return catalog


def chat(**changes) -> ChatRequest:
    return ChatRequest(**{"model": "tiny-vlm", "message": QUESTION, "images": images(1), "max_new_tokens": 12, **changes})


# --- the request function -------------------------------------------------------------------


def test_catalog_pairs_the_drafter_and_methods_come_from_the_pipeline(catalog, folders):
    assert list(catalog.main) == ["tiny-vlm"] and list(catalog.companions) == ["tiny-vlm-draft"]
    assert catalog.methods("tiny-vlm") == [m for m in DECODERS if m not in NOT_FOR_TEXT]
    alone = VLMCatalog.discover([str(folders[0])])
    assert "draft" not in alone.methods("tiny-vlm") and "sjd" in alone.methods("tiny-vlm")
    with pytest.raises(ValueError, match="neither a bundled model nor a folder"):
        VLMCatalog.discover([str(folders[0].parent / "missing")])


def test_default_model_is_the_bundled_pair_or_a_one_line_error():
    from mmgen import registry

    if text_request.DEFAULT_MODEL in registry.bundled_models():
        try:
            catalog = VLMCatalog.discover()
        except ValueError as error:  # listed but not shipped in this installation
            assert "missing from this installation" in str(error)
        else:
            assert list(catalog.main) == ["emoji-vlm"] and list(catalog.companions) == ["emoji-vlm-draft"]
    else:
        with pytest.raises(ValueError, match="'emoji-vlm' is missing from this installation; pass --model FOLDER"):
            VLMCatalog.discover()


def test_one_turn_gives_the_answer_stats_and_the_conversation(catalog):
    out = run_request(chat(method="sjd"), catalog)
    direct = catalog.pipeline("tiny-vlm")(QUESTION, images(1), max_new_tokens=12)
    assert out.baseline is None and out.method.text == direct.texts[0] and out.method.tokens == 12
    (row,) = out.stats_rows()
    assert row["run"] == "sjd" and row["tokens"] == 12 and 1 <= row["forwards"] <= 12
    assert row["tokens/forward"] == round(12 / row["forwards"], 2) and row["time (s)"] > 0 and row["tokens kept"] == "all"
    assert out.history == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                           {"role": "assistant", "content": [{"type": "text", "text": out.method.text}]}]
    assert len(out.history_images) == 1


@pytest.mark.parametrize("method", ["sjd", "sjd-coupled", "lookup", "draft"])
def test_compare_mode_returns_both_and_lossless_methods_answer_as_ar(catalog, method):
    out = run_request(chat(method=method, compare=True, images=images(2)), catalog)
    assert [run.label for run in out.runs] == ["ar (baseline)", method]
    assert out.method.text == out.baseline.text and out.method.tokens == out.baseline.tokens == 12
    assert out.baseline.stats.forwards == 12  # plain AR: one forward per token, the prefill included
    if method == "draft":
        assert out.method.stats.draft_forwards > 0 and out.method.stats.forwards < 12
    assert [row["run"] for row in out.stats_rows()] == ["ar (baseline)", method]


def test_sampling_is_reproducible_from_the_seed(catalog):
    run = lambda seed: run_request(chat(method="ar", temperature=1.0, seed=seed, max_new_tokens=16), catalog).method.text
    assert run(3) == run(3) and len({run(s) for s in range(4)}) > 1


def test_the_answer_streams_as_tokens_commit(catalog):
    seen, result = drain(stream_request(chat(method="draft", compare=True), catalog))
    for index, run in enumerate(result.runs):
        texts = [p.text for p in seen if p.index == index]
        assert len(texts) > 1 and texts[-1] == run.text  # several updates, ending at the answer
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each one extends the last
    assert [p.index for p in seen] == sorted(p.index for p in seen)  # the baseline first, then the method


def test_overlapping_chats_share_one_continuous_batch_and_answer_as_alone(folders):
    """--continuous-batch: fixed-window requests from threads decode in the shared batch, each
    answer streamed and equal to the request alone (sampled, from its seed); adaptive, compare
    and dropping requests answer alone, as without it."""
    shared = VLMCatalog.discover([str(f) for f in folders])
    shared.continuous_batch = 2
    for name in shared.names:
        shared.pipeline(name).eos_token_ids = []
    asks = {k: chat(method="ar", temperature=1.0, seed=k, max_new_tokens=6 + 2 * k, images=images(1 + k % 2)) for k in range(3)}
    seen, results = {}, {}

    def ask(k):
        events, results[k] = drain(stream_request(asks[k], shared, max_new_tokens=16))
        seen[k] = [event.text for event in events]

    in_threads(ask, asks)
    pipe = shared.pipeline("tiny-vlm")
    for k, request in asks.items():
        run = results[k].method
        alone = pipe(QUESTION, list(request.images), max_new_tokens=request.max_new_tokens, temperature=1.0,
                     generator=make_generator(request.seed))
        assert run.label == "ar (continuous batch)" and run.text == alone.texts[0] and run.tokens == request.max_new_tokens
        assert run.stats.forwards == alone.stats.forwards and seen[k][-1] == run.text
    assert len(shared._servers) == 1
    alone_label = lambda **c: run_request(chat(**c), shared, max_new_tokens=16).method.label
    assert alone_label(method="sjd") == "sjd (continuous batch)"  # the adaptive window: each row its own widths
    assert alone_label(method="lookup") == "lookup"  # no per-row restart: alone
    assert alone_label(method="ar", compare=True) == "ar" and alone_label(method="ar", dropping="fastv", keep_ratio=1.0) == "ar · fastv:keep_ratio=1"


def test_multi_turn_sends_the_conversation_so_far(catalog):
    first = run_request(chat(), catalog)
    follow = chat(message="what colour is the cat ?", images=(), history=first.history, history_images=first.history_images)
    out = run_request(follow, catalog)
    direct = catalog.pipeline("tiny-vlm")([first.history + [out.history[2]]], first.history_images, max_new_tokens=12)
    assert out.method.text == direct.texts[0] and len(out.history) == 4 and len(out.history_images) == 1


def test_dropping_with_everything_kept_answers_as_no_dropping(catalog):
    policies = text_request.dropping_policies()
    assert policies == ["fastv", "visionzip", "mustdrop"]
    plain = run_request(chat(method="sjd"), catalog)
    for policy in policies:
        out = run_request(chat(method="sjd", dropping=policy, keep_ratio=1.0, compare=True), catalog)
        assert out.method.label == f"sjd · {policy}:keep_ratio=1" and out.baseline.label == "ar (baseline)"
        assert out.method.text == out.baseline.text == plain.method.text
    pruned = run_request(chat(dropping="visionzip", keep_ratio=0.25), catalog)
    kept, total = map(int, pruned.method.tokens_kept.split("/"))
    assert 0 < kept < total == 16 and pruned.stats_rows()[0]["tokens kept"] == f"{kept}/16"  # 16 patches of 32x32 / 8x8


def big_image(tmp_path) -> Path:
    path = tmp_path / "big.png"
    Image.new("1", (4100, 4100)).save(path)  # a small file of too many pixels
    return path


def not_an_image(tmp_path) -> Path:
    path = tmp_path / "notes.png"
    path.write_text("not a picture")
    return path


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(model="../tiny-vlm"), r"unknown model '../tiny-vlm'; choose one of \['tiny-vlm'\]"),
        (dict(message="   "), "type a question"),
        (dict(message="x" * 2001), "at most 2000 characters, got 2001"),
        (dict(method="lantern"), r"unknown decoding method 'lantern' for this model; choose one of \['ar', "),
        (dict(method="<b>x</b>"), "unknown decoding method '<b>x</b>'"),  # plain text, not HTML-escaped
        (dict(temperature=-1), r"temperature must be a number in \[0, 5\]"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(max_new_tokens=0), r"max new tokens must be an integer in \[1, 64\]"),
        (dict(max_new_tokens=65), r"max new tokens must be an integer in \[1, 64\]"),
        (dict(images=images(5)), "at most 4 images per conversation, got 5"),
        (dict(images="cat.png"), "images must be a list"),
        (dict(images=[b"\x89PNG"]), "an image must be an image file or a PIL image"),
        (dict(dropping="prune-all"), r"unknown token dropping 'prune-all'; choose one of \['none'"),
        (dict(history=[{"role": "assistant", "content": []}]), "history message 0 must be a user message"),
        (dict(history=[{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": []}]),
         "1 image placeholders but 0 images"),
        (dict(history=[{"role": "user", "content": [{"type": "video", "path": "/etc/passwd"}]},
                       {"role": "assistant", "content": []}]), "unexpected part"),
    ],
)
def test_bad_input_is_a_one_line_value_error(catalog, changes, message):
    with pytest.raises(ValueError, match=message) as error:
        run_request(chat(**changes), catalog, max_images=4, max_new_tokens=64)
    assert "\n" not in str(error.value) and len(str(error.value)) < 200


def test_unreadable_and_oversized_uploads_are_refused_before_decoding(catalog, tmp_path):
    with pytest.raises(ValueError, match="notes.png: not a readable image"):
        run_request(chat(images=[str(not_an_image(tmp_path))]), catalog)
    with pytest.raises(ValueError, match=r"at most 16777216 pixels, got 4100x4100"):
        run_request(chat(images=[str(big_image(tmp_path))]), catalog)


def test_keep_ratio_is_bounded_where_dropping_exists(catalog):
    policies = text_request.dropping_policies()
    assert policies == ["fastv", "visionzip", "mustdrop"]
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"keep ratio must be a number in \(0, 1\]"):
            run_request(chat(dropping=policies[0], keep_ratio=bad), catalog)


# --- the UI handlers ---------------------------------------------------------------------------


UI_VALUES = dict(model="tiny-vlm", method="draft", dropping="none", keep_ratio=0.25, temperature=0.0, seed=0, budget=12,
                 compare=False)


def send(catalog, text, files=(), state=None, **changes):
    from mmgen.apps.text_demo import handle_send

    values = {**UI_VALUES, **changes}
    return list(handle_send(catalog, 4, 64, {"text": text, "files": list(files)}, state, *values.values()))


def test_ui_handler_streams_into_the_chat_and_keeps_the_conversation(catalog, tmp_path):
    path = tmp_path / "cat.png"
    images(1)[0].save(path)
    updates = send(catalog, QUESTION, [str(path)], compare=True)
    *streamed, (method_chat, baseline_chat, stats, state, box) = updates
    assert len(streamed) >= 2 and box["value"] is None  # several updates; the message box is emptied at the end
    answer = run_request(chat(method="draft"), catalog).method.text
    assert method_chat["value"][-1] == {"role": "assistant", "content": answer} and baseline_chat["visible"]
    assert method_chat["value"][0] == {"role": "user", "content": [{"path": str(path)}, QUESTION]}
    assert list(stats["run"]) == ["ar (baseline)", "draft"] and state["history"][1]["content"][0]["text"] == answer


def test_ui_handler_errors_are_plain_one_line_gradio_errors(catalog, monkeypatch):
    import gradio as gr

    from mmgen.apps import text_demo

    with pytest.raises(gr.Error) as error:
        send(catalog, QUESTION, method="<b>x</b> & 'y'")
    assert error.value.message.startswith("unknown decoding method \"\\x3cb>x\\x3c/b> & 'y'\" for this model")

    def fail(*args, **kwargs):
        raise RuntimeError("kernel said 'no'\n  at <step 3>")
        yield

    monkeypatch.setattr(text_demo, "stream_request", fail)
    with pytest.raises(gr.Error) as error:
        send(catalog, QUESTION)
    assert error.value.message == "generation failed (RuntimeError): kernel said 'no' at \\x3cstep 3>"


def test_switching_model_lists_its_methods_and_clears_the_chat(catalog):
    from mmgen.apps.text_demo import empty_state, handle_model

    method, chat_, baseline, stats, state = handle_model(catalog, "tiny-vlm")
    assert method["choices"] == catalog.methods("tiny-vlm") and method["value"] == "draft"  # decoding.json
    assert chat_["value"] == [] and stats is None and state == empty_state()


# --- the command -----------------------------------------------------------------------------


def test_demo_command_parses_bounds_and_launches_locally(monkeypatch, folders):
    from mmgen import cli
    from mmgen.apps import text_demo

    args = cli.build_parser().parse_args(["demo", "text"])
    assert (args.model, args.host, args.port, args.share, args.max_images, args.max_new_tokens, args.concurrency) == (
        None, "127.0.0.1", None, False, 4, 128, 1)
    for bad in (["--max-images", "0"], ["--max-images", "9"], ["--max-new-tokens", "513"], ["--port", "70000"],
                ["--concurrency", "x"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["demo", "text", *bad])
    launched = {}
    monkeypatch.setattr(text_demo, "launch_demo", lambda demo, **kw: launched.update(kw, demo=demo))
    argv = ["demo", "text", "--model", str(folders[0]), "--model", str(folders[1]), "--concurrency", "2"]
    assert cli.main(argv) == 0
    assert launched["host"] == "127.0.0.1" and launched["share"] is False and launched["port"] is None
    assert launched["demo"]._queue.default_concurrency_limit == 2
    assert cli.main(["demo", "text", "--model", str(folders[0].parent / "nowhere")]) == 2


def test_demo_vlm_the_old_name_still_launches_the_text_demo_with_a_note(monkeypatch, folders, capsys):
    """`mmgen demo vlm` (the text demo's name until issue 37) runs the same demo, says so in one
    stderr line, and `mmgen demo --help` lists it as the old name."""
    from mmgen import cli
    from mmgen.apps import text_demo

    old, new = (cli.build_parser().parse_args(["demo", name, "--max-new-tokens", "64"]) for name in ("vlm", "text"))
    assert old.run is new.run and vars(old) == {**vars(new), "target": "vlm"}
    launched = {}
    monkeypatch.setattr(text_demo, "launch_demo", lambda demo, **kw: launched.update(kw, demo=demo))
    capsys.readouterr()
    assert cli.main(["demo", "vlm", "--model", str(folders[0])]) == 0 and "demo" in launched
    notes = [line for line in capsys.readouterr().err.splitlines() if "mmgen demo:" in line]  # not the loading bars
    assert len(notes) == 1 and "note: `mmgen demo vlm` is now `mmgen demo text`" in notes[0]
    assert cli.main(["demo", "text", "--model", str(folders[0])]) == 0
    assert "mmgen demo:" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["demo", "--help"])
    listing = " ".join(capsys.readouterr().out.split())  # whatever the help's line breaks
    assert "text (vlm)" in listing and "vlm: the old name" in listing


# --- the app in a headless browser -----------------------------------------------------------

#: Seconds each committed token waits in the browser tests' server, so that the page has time to
#: show an answer growing (the tiny models answer in milliseconds).
STREAM_DELAY_S = 0.08


@pytest.fixture(scope="module")
def app_url(browser, catalog):  # noqa: F811 - `browser` is the image demo's fixture
    """The demo on a free local port, its token streamer slowed down (see STREAM_DELAY_S)."""
    from mmgen.apps.text_demo import build_demo, launch_demo
    from mmgen.decoding import TokenQueueStreamer

    class SlowStreamer(TokenQueueStreamer):
        def put(self, rows):
            time.sleep(STREAM_DELAY_S)
            super().put(rows)

    patch = pytest.MonkeyPatch()
    patch.setattr(vlm_pipeline, "TokenQueueStreamer", SlowStreamer)
    with served(build_demo(catalog, max_images=2, max_new_tokens=16), launch_demo) as url:
        yield url
    patch.undo()


#: Every text the last answer of a chat showed, recorded by a MutationObserver (so that updates
#: between two polls of the test are seen too).
WATCH_JS = """(chat) => {
    window.__answers = window.__answers || {};
    const seen = window.__answers[chat] = [];
    const root = document.querySelector('#' + chat);
    new MutationObserver(() => {
        const bots = root.querySelectorAll('[data-testid=bot]');
        const text = bots.length ? bots[bots.length - 1].innerText.trim() : '';
        if (text && seen[seen.length - 1] !== text) seen.push(text);
    }).observe(root, {subtree: true, childList: true, characterData: true});
}"""


def ask(page, text: str, files=(), method: str = "draft", chat: str = "chat") -> str:
    """Upload `files`, send `text`, wait for the answer to finish (the stats table shows the
    method's row) and return the answer's text."""
    from playwright.sync_api import expect

    if files:
        page.locator("#message input[type=file]").set_input_files([str(f) for f in files])
        page.locator("#message img").first.wait_for()  # the upload's preview
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    expect(page.locator("#stats")).to_contain_text(method, timeout=60_000)  # a loaded CI box is slow
    return page.locator(f"#{chat} [data-testid=bot]").last.inner_text().strip()


@pytest.fixture
def picture(tmp_path) -> Path:
    path = tmp_path / "emoji.png"
    images(1)[0].save(path)
    return path


def test_page_loads_without_the_internet(page, artifacts):  # noqa: F811
    assert page.title() == "mmgen VLM demo"
    assert page.locator("#model input").input_value() == "tiny-vlm"
    assert page.locator("#method input").input_value() == "draft"
    assert not page.locator("#baseline-chat").is_visible()
    page.screenshot(path=artifacts / "01-load.png", full_page=True)


def test_upload_ask_and_see_the_answer_stream(page, artifacts, catalog, picture):  # noqa: F811
    page.evaluate(WATCH_JS, "chat")
    answer = ask(page, QUESTION, [picture])
    expected = run_request(chat(method="draft", images=[str(picture)], max_new_tokens=16), catalog).method.text
    assert answer == expected
    seen = page.evaluate("window.__answers.chat")
    assert len(seen) >= 3 and seen[-1] == expected  # the answer grew on the page before it was whole
    assert all(expected.startswith(text) for text in seen)
    assert page.locator("#chat [data-testid=user] img").count() == 1  # the uploaded image is in the user's turn
    stats = page.locator("#stats").inner_text()
    assert "draft" in stats and "tokens/forward" in stats and "tokens kept" in stats
    page.screenshot(path=artifacts / "02-ask.png", full_page=True)


def test_switch_method_and_compare_shows_two_answers(page, artifacts, picture):  # noqa: F811
    from playwright.sync_api import expect

    pick(page, "method", "lookup")
    page.locator("#compare input[type=checkbox]").check()
    answer = ask(page, "what colour is the cat ?", [picture], method="lookup")
    expect(page.locator("#baseline-chat")).to_be_visible()
    baseline = page.locator("#baseline-chat [data-testid=bot]").last.inner_text().strip()
    assert answer == baseline and answer  # greedy prompt lookup answers as plain AR
    stats = page.locator("#stats").inner_text()
    assert "ar (baseline)" in stats and "lookup" in stats
    page.screenshot(path=artifacts / "03-compare.png", full_page=True)


def test_a_bad_request_shows_a_one_line_error_and_the_app_keeps_working(page, artifacts, picture):  # noqa: F811
    from playwright.sync_api import expect

    box = page.locator("#method input")  # takes any value: the server checks it against the model
    box.click()
    box.fill("lantern")
    box.press("Enter")
    page.locator("#message textarea").fill(QUESTION)
    page.locator("#message textarea").press("Enter")
    toast = page.locator("[data-testid=toast-text]").first
    expect(toast).to_contain_text("unknown decoding method 'lantern' for this model; choose one of ['ar', ")
    assert "\n" not in toast.inner_text().strip()
    page.wait_for_timeout(500)  # let the toast finish fading in
    page.screenshot(path=artifacts / "04-error.png")
    page.locator("[data-testid=toast-close]").first.click()
    pick(page, "method", "sjd")
    assert ask(page, QUESTION, [picture], method="sjd")
    assert "sjd" in page.locator("#stats").inner_text()
    page.screenshot(path=artifacts / "05-after-error.png", full_page=True)
