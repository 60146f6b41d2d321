"""The image demo: its request function directly, its command, and the app in a real headless
Chromium (Debian's, driven by playwright) that must never reach the internet.

Browser tests skip when /usr/bin/chromium or playwright is missing, unless MMGEN_REQUIRE_BROWSER=1
(CI), where that is a failure. Screenshots go to $MMGEN_TEST_ARTIFACTS/image_demo/ (default: a
pytest temporary folder), one per scenario.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest

from mmgen.apps.requests.image import ImageRequest, ImageCatalog, model_info, run_request
from mmgen.decoding import DECODERS, SCALE_DECODERS, Autoregressive
from mmgen.image_ar import bundled

from tests.conftest import tiny_pipeline, tiny_transformer, tiny_vq

CHROMIUM = Path("/usr/bin/chromium")
#: Keep the browser off the network: no background services, and every host name but
#: 127.0.0.1 resolves to nothing.
CHROMIUM_ARGS = [
    "--no-sandbox",  # tests may run as root (CI containers)
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--disable-extensions", "--disable-domain-reliability", "--disable-breakpad", "--no-first-run",
    "--no-default-browser-check", "--metrics-recording-only", "--disable-gpu",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]
TIMEOUT_MS = 60_000  # generous: the test machine's cores are shared


@pytest.fixture(scope="module")
def catalog():
    return ImageCatalog.discover()


def request(**changes) -> ImageRequest:
    return ImageRequest(**{"model": "emoji64", "class_name": "cat-face", "method": "sjd", **changes})


# --- the request function -------------------------------------------------------------------


def test_catalog_offers_bundled_models_with_companions_apart(catalog, monkeypatch, tmp_path):
    assert {"emoji64", "var-emoji64", "mar-emoji64"} <= set(catalog.main)
    assert {"emoji64-draft", "var-emoji64-small", "mar-emoji64-draft"} <= set(catalog.companions)
    assert not any(name.endswith(("-draft", "-small")) for name in catalog.main)
    monkeypatch.setitem(bundled.BUNDLED_MODELS, "ghost64", tmp_path / "not-installed")
    assert "ghost64" not in ImageCatalog.discover().names
    given = ImageCatalog.discover(["emoji64"])
    assert list(given.main) == ["emoji64"] and list(given.companions) == ["emoji64-draft"]


def test_catalog_takes_pipeline_folders_and_rejects_others(tmp_path):
    tiny_pipeline().save_pretrained(tmp_path / "tiny")
    tiny_pipeline(seed=1).save_pretrained(tmp_path / "tiny-draft")
    catalog = ImageCatalog.discover([str(tmp_path / "tiny"), str(tmp_path / "tiny-draft")])
    assert list(catalog.main) == ["tiny"] and list(catalog.companions) == ["tiny-draft"]
    out = run_request(ImageRequest("tiny", "3", "draft", options="num_draft=2", seed=1), catalog)
    assert out.method.stats.draft_forwards > 0 and out.method.images[0].size == (8, 8)
    alone = ImageCatalog.discover([str(tmp_path / "tiny")])
    with pytest.raises(ValueError, match="needs a draft model"):
        run_request(ImageRequest("tiny", "3", "draft"), alone)
    with pytest.raises(ValueError, match="nor a pipeline folder with a model_index.json"):
        ImageCatalog.discover([str(tmp_path / "missing")])
    (tmp_path / "t2i").mkdir()
    (tmp_path / "t2i" / "model_index.json").write_text('{"_class_name": "LlamaGenText2ImagePipeline"}')
    with pytest.raises(ValueError, match="serves class-conditional"):
        ImageCatalog.discover([str(tmp_path / "t2i")])


def test_methods_come_from_the_core_registries(catalog, monkeypatch):
    token, scale = model_info(catalog.pipeline("emoji64")), model_info(catalog.pipeline("var-emoji64"))
    assert token.methods == list(DECODERS) and token.default_method == "sjd" and token.vocab_size == 512
    assert scale.methods == list(SCALE_DECODERS) and scale.decoder_family == "scale"
    assert len(token.class_names) == 74 and "cat-face" in token.class_names
    monkeypatch.setitem(DECODERS, "brand-new", Autoregressive)
    assert "brand-new" in model_info(catalog.pipeline("emoji64")).methods
    assert run_request(request(method="brand-new"), catalog).method.stats.forwards == 64


def test_one_request_gives_images_and_stats(catalog):
    out = run_request(request(num_images=2, seed=3), catalog)
    assert [image.size for image in out.method.images] == [(64, 64), (64, 64)] and out.baseline is None
    (row,) = out.stats_rows()
    assert row["run"] == "sjd" and row["tokens"] == 64 and 1 <= row["forwards"] <= 64
    assert row["step compression"] >= 1 and row["mean accepted length"] >= 1 and row["time (s)"] > 0
    assert len(out.trace_rows()) == row["forwards"] and out.trace_rows()[0]["forward"] == 1


def test_overlapping_requests_share_one_continuous_batch_and_keep_their_seeds_images():
    """--continuous-batch: fixed-window requests from two threads decode in the shared batch,
    image i from seed + i (the image a call with that seed alone makes); adaptive and compare
    requests decode alone, as without it."""
    import threading

    from mmgen.sampling import make_generator

    shared = ImageCatalog.discover(["emoji64"])
    shared.continuous_batch = 4
    results = {}
    asks = {"a": request(method="sjd", options="adapt=false", num_images=2, seed=5),
            "b": request(method="sjd", options="adapt=false", num_images=3, seed=9, class_name="face-smiling")}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, run_request(asks[k], shared, max_images=4)))
               for k in asks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    pipe = shared.pipeline("emoji64")
    for key, ask in asks.items():
        run = results[key].method
        assert run.label == "sjd:adapt=false (continuous batch)" and run.stats.rows == ask.num_images
        for i, image in enumerate(run.images):
            alone = pipe([pipe.class_index(ask.class_name)], decoding="sjd:adapt=false", generator=make_generator(ask.seed + i))
            assert image.tobytes() == alone.images[0].tobytes()
    assert len(shared._servers) == 1
    # The adaptive window batches continuously too (each row its own widths); lookup cannot.
    assert run_request(request(num_images=1), shared).method.label == "sjd (continuous batch)"
    assert run_request(request(method="lookup", num_images=1), shared).method.label == "lookup"
    assert run_request(request(options="adapt=false", compare=True), shared).method.label == "sjd:adapt=false"


def test_compare_runs_autoregressive_on_the_same_seed(catalog):
    # A fixed window: on this random model the adaptive default falls back to AR steps.
    out = run_request(request(options="window=8,adapt=false", compare=True, seed=5), catalog)
    alone = run_request(request(method="ar", seed=5), catalog)
    assert [run.label for run in out.runs] == ["ar (baseline)", "sjd:window=8,adapt=false"]
    assert out.baseline.images[0].tobytes() == alone.method.images[0].tobytes()
    rows = out.stats_rows()
    assert rows[0]["forwards"] == 64 and rows[0]["speedup (per token)"] == 1.0 and rows[1]["forwards"] < 64
    per_token = lambda run: run.stats.wall_time_s / (run.stats.tokens * len(run.images))  # noqa: E731
    assert rows[1]["speedup (per token)"] == round(per_token(out.baseline) / per_token(out.method), 2)
    assert {r["accepted"] for r in out.trace_rows(out.baseline)} == {1.0}


def test_two_model_methods_pair_with_the_cached_companion(catalog):
    out = run_request(ImageRequest("var-emoji64", "heart", "collaborative", options="large_steps=3", compare=True), catalog)
    assert out.method.stats.stage_forwards and out.baseline.stats.forwards == 6
    assert "var-emoji64-small" in catalog._pipelines  # loaded once, through the catalog


def test_old_collaborative_names_still_run_the_same_decode_and_warn(catalog):
    """The demo and the server read CoDe's old names (`code`, `draft_steps=`) until 0.3: the same
    images as `collaborative` / `large_steps=`, one DeprecationWarning a name, labelled as given."""
    new = run_request(ImageRequest("var-emoji64", "heart", "collaborative", options="large_steps=3"), catalog)
    with pytest.warns(DeprecationWarning) as caught:
        old = run_request(ImageRequest("var-emoji64", "heart", "code", options="draft_steps=3"), catalog)
    assert sorted(str(w.message).split(": use ")[1] for w in caught) == ["'collaborative'", "large_steps="]
    assert [i.tobytes() for i in old.method.images] == [i.tobytes() for i in new.method.images]
    assert old.method.label == "code:draft_steps=3" and old.method.stats.stage_forwards == [3, 3]


def test_next_scale_runs_report_tokens_per_step_and_the_model_of_each_step(catalog):
    out = run_request(ImageRequest("var-emoji64", "heart", "collaborative", options="large_steps=3", compare=True), catalog)
    sizes = [1, 4, 9, 16, 36, 64]  # var-emoji64's scales 1, 2, 3, 4, 6, 8
    assert out.step_rows() == [{"step": k + 1, "tokens": n, "model": "var-emoji64" if k < 3 else "var-emoji64-small"}
                               for k, n in enumerate(sizes)]
    assert [r["model"] for r in out.step_rows(out.baseline)] == ["var-emoji64"] * 6
    assert {r["accepted"] for r in out.trace_rows()} == {1.0}  # what the chart showed before: a flat line
    assert run_request(request(), catalog).step_rows() == []  # token-by-token runs keep the accepted-length trace


def test_continuous_models_take_bounded_steps(tmp_path):
    from tests.image_ar.test_mar_pipeline import tiny_vae
    from tests.image_ar.test_mar_model import tiny_model

    from mmgen.image_ar.mar.pipeline import MARPipeline

    pipe = MARPipeline(tiny_model(), tiny_vae(), class_names=[f"c{i}" for i in range(10)])
    pipe.save_pretrained(tmp_path / "mar")
    catalog = ImageCatalog.discover([str(tmp_path / "mar")])
    info = model_info(catalog.pipeline("mar"))
    assert info.decoder_family == "continuous" and info.vocab_size is None and info.default_method == "ar"
    out = run_request(ImageRequest("mar", "c2", "ar", num_steps=3, top_k=99999), catalog)  # top-k: not a MAR option
    assert out.method.stats.forwards == 3
    with pytest.raises(ValueError, match=r"MAR steps must be an integer in \[1, 256\]"):
        run_request(ImageRequest("mar", "c2", "ar", num_steps=257), catalog)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(method="lantern", options="delta=abc"), "delta='abc': expected a number"),
        (dict(method="lantern", options="delta=0.5,delta=0.2"), "given twice"),
        (dict(method="lantern", options="delta=2"), r"total-variation budget in \[0, 1\]"),
        (dict(method="lantern", options="dleta=0.2"), r"unknown option\(s\) \['dleta'\]"),
        (dict(options="window"), "expected key=value"),
        (dict(options="window=65"), "above this demo's limit of 64"),
        (dict(options="window=1e9"), "out of range"),
        (dict(options="draft_init=1"), "takes an object"),
        (dict(options="lantern:delta=0.2"), "key=value pairs"),
        (dict(options="x" * 201), "at most 200 characters"),
        (dict(method="draft", options="drafter=/etc"), "name one of the demo's other models"),
        (dict(method="code"), "unknown decoding method 'code'"),  # CoDe's old name is VAR's only
        (dict(method="collaborative"), "unknown decoding method 'collaborative'"),
        (dict(model="../emoji64"), "unknown model"),
        (dict(class_name="<b>dog</b>"), "unknown class '<b>dog</b>'"),  # plain text, not HTML-escaped
        (dict(class_name="x" * 10_000), r"unknown class 'x{58}…; choose"),  # any size through the API: cut
        (dict(top_p=0), r"top-p must be a number in \(0, 1\]"),
        (dict(top_p=float("nan")), "top-p"),
        (dict(top_k=513), r"top-k must be an integer in \[0, 512\]"),
        (dict(guidance_scale=21), r"guidance must be a number in \[0, 20\]"),
        (dict(temperature=-1), "temperature"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(num_images=5), r"number of images must be an integer in \[1, 4\]"),
        (dict(num_images=0), "number of images"),
        (dict(model="mar-emoji64", class_name="heart", method="cspd", options="num_steps=4"), "with the steps control"),
    ],
)
def test_bad_input_is_a_value_error_with_a_message(catalog, changes, message):
    with pytest.raises(ValueError, match=message):
        run_request(request(**changes), catalog)


UI_VALUES = dict(model="emoji64", class_name="cat-face", method="sjd", options="", compare=False, num_images=1, seed=0,
                 guidance=2.0, temperature=1.0, top_k=0, top_p=1.0, steps=64)


def family_defaults() -> list:
    """The family option widgets' values left as built (`gradio_common.family_widgets`: the options
    the image families' records declare, after the demo's own controls): an API call sends them too."""
    from mmgen import registry
    from mmgen.apps.image_demo import OWN_OPTIONS

    return [o.default for name, o in registry.family_options("image").items() if name not in OWN_OPTIONS]


def test_ui_handler_turns_errors_into_plain_text_gradio_errors(catalog, monkeypatch):
    import gradio as gr

    from mmgen.apps import image_demo

    values = {**UI_VALUES, "class_name": "<b>cat</b> & 'dog'"}
    with pytest.raises(gr.Error) as error:
        image_demo.handle_generate(catalog, 4, *values.values())
    # Plain text: no &lt; / &#x27; (HTML escaping made API messages unreadable); a "<" that could
    # open a tag is the Python escape \x3c, so that the page's toast shows it instead of rendering it.
    assert error.value.message.startswith("unknown class \"\\x3cb>cat\\x3c/b> & 'dog'\"; choose one of this model's classes (")
    values.update(model="var-emoji64", class_name="heart", method="collaborative", options="handoffs=3")  # fails inside the decoder
    with pytest.raises(gr.Error, match="generation failed"):
        image_demo.handle_generate(catalog, 4, *values.values())

    def fail(*args, **kwargs):
        raise RuntimeError("kernel said 'no'\n  at <step 3>, |x| <= 2")

    monkeypatch.setattr(image_demo, "run_request", fail)
    with pytest.raises(gr.Error) as error:
        image_demo.handle_generate(catalog, 4, *UI_VALUES.values())
    assert error.value.message == "generation failed (RuntimeError): kernel said 'no' at \\x3cstep 3>, |x| <= 2"  # one line


def test_var_chart_shows_tokens_per_step_by_model_not_a_flat_accepted_line(catalog):
    from mmgen.apps.image_demo import STEPS_TITLE, handle_generate

    values = {**UI_VALUES, "model": "var-emoji64", "class_name": "heart", "method": "collaborative", "options": "large_steps=3"}
    *_, trace, steps = handle_generate(catalog, 4, *values.values())
    assert trace["visible"] is False and steps["visible"] is True
    assert steps["label"] == STEPS_TITLE.format(label="collaborative:large_steps=3") and "per-step time is not recorded" in steps["label"]
    frame = steps["value"]
    assert list(frame["step"]) == [f"{k} · var-emoji64" for k in (1, 2, 3)] + [f"{k} · var-emoji64-small" for k in (4, 5, 6)]
    assert list(frame["tokens"]) == [1, 4, 9, 16, 36, 64] and frame["tokens"].nunique() > 1
    *_, trace, steps = handle_generate(catalog, 4, *UI_VALUES.values())  # LlamaGen: the accepted-length trace
    assert trace["visible"] is True and steps["visible"] is False and len(trace["value"]) >= 1


def test_step_labels_sort_in_step_order_from_ten_steps():
    from mmgen.apps.image_demo import _steps_frame

    frame = _steps_frame([{"step": k, "tokens": k * k, "model": "var-d30" if k < 9 else "var-d16"} for k in range(1, 11)])
    assert list(frame["step"]) == sorted(frame["step"]) and frame["step"].iloc[0] == "01 · var-d30"


def test_switching_model_updates_classes_methods_and_bounds(catalog):
    from mmgen.apps.image_demo import handle_model

    classes, methods, guidance, _, top_k, top_p, steps, *_ = handle_model(catalog, "var-emoji64")  # then its options
    assert methods["choices"] == list(SCALE_DECODERS) and methods["value"] == "ar"
    assert len(classes["choices"]) == 74 and top_k["maximum"] == 512 and guidance["value"] == 2.0
    assert top_p["visible"] and not steps["visible"]


# --- the command -----------------------------------------------------------------------------


def test_demo_command_parses_bounds_and_launches_locally(monkeypatch):
    from mmgen import cli
    from mmgen.apps import image_demo

    args = cli.build_parser().parse_args(["demo", "image"])
    assert (args.model, args.host, args.port, args.share, args.max_images, args.concurrency) == (None, "127.0.0.1", None, False, 4, 1)
    args = cli.build_parser().parse_args(["demo", "image", "--model", "emoji64", "--model", "/x/y", "--port", "8000"])
    assert args.model == ["emoji64", "/x/y"] and args.port == 8000
    for bad in (["--max-images", "0"], ["--max-images", "17"], ["--port", "70000"], ["--concurrency", "x"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["demo", "image", *bad])
    launched = {}
    monkeypatch.setattr(image_demo, "launch_demo", lambda demo, **kw: launched.update(kw, demo=demo))
    assert cli.main(["demo", "image", "--model", "emoji64", "--max-images", "2", "--concurrency", "2"]) == 0
    assert launched["host"] == "127.0.0.1" and launched["share"] is False
    assert launched["demo"]._queue.default_concurrency_limit == 2 and launched["demo"]._queue.max_size == image_demo.QUEUE_SIZE
    assert cli.main(["demo", "image", "--model", "nowhere/at-all"]) == 2


# --- the app over its API (gradio_client, no page, no UI events) ------------------------------


@contextmanager
def served(demo, launch_demo) -> Iterator[str]:
    """`demo` served by `launch_demo` on a free local port, closed afterwards; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launch_demo(demo, host="127.0.0.1", port=port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def server_url(catalog):
    """The demo served on a free local port (the API tests and the browser tests share it)."""
    from mmgen.apps.image_demo import build_demo, launch_demo

    with served(build_demo(catalog, max_images=2), launch_demo) as url:
        yield url


def api_call(url: str, **changes):
    from gradio_client import Client

    values = {**UI_VALUES, **changes}
    return Client(url, verbose=False).predict(*values.values(), *family_defaults(), api_name="/generate")


def test_api_takes_any_method_and_class_of_the_chosen_model_without_a_ui_event(server_url):
    # The page was built with emoji64's methods; an API caller never sends the model-change
    # event that would list VAR's, and Gradio used to refuse "collaborative" as "not in the list of choices".
    picture, baseline, stats, trace, steps = api_call(server_url, model="var-emoji64", class_name="heart",
                                                      method="collaborative", options="large_steps=3")
    assert stats["data"][0][:3] == ["collaborative:large_steps=3", 6, 130] and Path(picture["value"]).is_file()
    assert steps["visible"] and [row[1] for row in steps["value"]["data"]] == [1, 4, 9, 16, 36, 64]
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="unknown decoding method 'sjd'"):  # still checked, against the model's family
        api_call(server_url, model="var-emoji64", class_name="heart", method="sjd")


def test_api_errors_are_plain_text(server_url):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError) as error:
        api_call(server_url, class_name="<b>cat</b> 'x'")
    message = str(error.value)
    assert "unknown class \"\\x3cb>cat\\x3c/b> 'x'\"; choose one" in message and "&" not in message
    with pytest.raises(AppError, match=r"decoding option delta='abc': expected a number"):
        api_call(server_url, method="lantern", options="delta=abc")


def test_top_k_bound_spans_every_models_vocabulary(tmp_path):
    from mmgen.apps.image_demo import build_demo

    from mmgen.image_ar.llamagen import LlamaGenPipeline

    tiny_pipeline().save_pretrained(tmp_path / "small-vocab")
    big = LlamaGenPipeline(tiny_transformer(vocab_size=64, block_size=16), tiny_vq(codebook_size=64))
    big.save_pretrained(tmp_path / "big-vocab")
    catalog = ImageCatalog.discover([str(tmp_path / "small-vocab"), str(tmp_path / "big-vocab")])
    demo = build_demo(catalog)
    (top_k,) = [block for block in demo.blocks.values() if getattr(block, "label", None) == "Top-k (0 = off)"]
    assert top_k.maximum == 64  # so that an API call may ask big-vocab for top-k 50; run_request bounds it per model
    # the page still gets the first model's own bound, from a load event
    assert any(target[1] == "load" for fn in demo.fns.values() for target in fn.targets)
    with pytest.raises(ValueError, match=r"top-k must be an integer in \[0, 32\]"):
        run_request(ImageRequest("small-vocab", "3", "ar", top_k=50), catalog)
    assert run_request(ImageRequest("big-vocab", "3", "ar", top_k=50), catalog).method.stats.forwards == 16


# --- the app in a headless browser -----------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium through playwright; skip (or, with MMGEN_REQUIRE_BROWSER=1, fail)
    when either is missing."""
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the playwright package is not installed (pip install -e '.[dev]')"
    if reason is None and not CHROMIUM.is_file():
        reason = f"{CHROMIUM} is missing (apt-get install chromium)"
    if reason is not None:
        if os.environ.get("MMGEN_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MMGEN_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def app_url(browser, server_url):
    return server_url


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, request) -> Path:
    """The screenshot folder of the test's module: its `ARTIFACTS` name, default image_demo."""
    root = os.environ.get("MMGEN_TEST_ARTIFACTS")
    folder = (Path(root) if root else tmp_path_factory.mktemp("artifacts")) / getattr(request.module, "ARTIFACTS", "image_demo")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def page(browser, app_url, request):
    """A fresh page on the app (ready when the element `READY` of the test's module, default
    #generate, is there); afterwards, every request it made must have stayed on 127.0.0.1.
    The VLM demo's tests use it too."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    requested: list[str] = []
    context.on("request", lambda r: requested.append(r.url))
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(app_url)
    page.locator(getattr(request.module, "READY", "#generate")).wait_for()
    yield page
    context.close()
    remote = sorted({url for url in requested if urlparse(url).scheme not in ("data", "blob")
                     and urlparse(url).hostname != "127.0.0.1"})
    assert not remote, f"the page reached beyond this machine: {remote}"


def pick(page, elem_id: str, choice: str) -> None:
    box = page.locator(f"#{elem_id} input")
    box.click()
    box.fill(choice)
    page.get_by_role("option", name=choice, exact=True).click()


def generate(page, *pictures: str, chart: str = "chart") -> None:
    page.locator("#generate").click()
    for picture in pictures or ("images",):
        page.locator(f"#{picture} img").first.wait_for()
    page.locator(f"#{chart} svg").first.wait_for()


#: Words of the stats table's header cells that the browser laid out over more than one line.
BROKEN_HEADER_WORDS_JS = """() => {
    const broken = [];
    for (const cell of document.querySelectorAll('#stats th')) {
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            for (const word of node.data.matchAll(/\\S+/g)) {
                const range = document.createRange();
                range.setStart(node, word.index);
                range.setEnd(node, word.index + word[0].length);
                const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
                if (lines.size > 1) broken.push(word[0]);
            }
        }
    }
    return broken;
}"""


def test_page_loads_without_the_internet(page, artifacts):
    assert page.title() == "mmgen image demo"
    assert page.locator("#model input").input_value() == "emoji64"
    assert page.locator("#method input").input_value() == "sjd"
    fonts = page.evaluate("getComputedStyle(document.querySelector('.gradio-container')).fontFamily")
    assert "ui-sans-serif" in fonts or "system-ui" in fonts, fonts
    page.screenshot(path=artifacts / "01-load.png", full_page=True)


def test_generate_one_image(page, artifacts):
    generate(page)
    stats = page.locator("#stats").inner_text()
    assert "sjd" in stats and "forwards" in stats and "step compression" in stats
    assert page.locator("#images img").count() >= 1 and not page.locator("#baseline").is_visible()
    page.screenshot(path=artifacts / "02-generate.png", full_page=True)


def test_compare_mode_shows_both_runs_and_the_chart(page, artifacts):
    pick(page, "method", "gsd")
    page.locator("#compare input[type=checkbox]").check()
    generate(page, "baseline", "images")
    stats = page.locator("#stats").inner_text()
    assert "ar (baseline)" in stats and "gsd" in stats and "speedup (per token)" in stats
    assert page.locator("#chart .mark-line path").count() >= 1
    page.screenshot(path=artifacts / "03-compare.png", full_page=True)
    # A narrow window: seven columns no longer fit, and header words used to break mid-word
    # ("for|war|ds", "compr|essio|n"); now lines break between words and the table scrolls.
    page.set_viewport_size({"width": 800, "height": 1000})
    page.wait_for_timeout(500)
    assert page.locator("#stats th").count() >= 7
    assert page.evaluate(BROKEN_HEADER_WORDS_JS) == []
    page.screenshot(path=artifacts / "03b-compare-narrow.png", full_page=True)


def test_switching_to_var_lists_its_methods(page, artifacts):
    from playwright.sync_api import expect

    pick(page, "model", "var-emoji64")
    expect(page.locator("#method input")).to_have_value("ar")
    page.locator("#method input").click()
    assert page.get_by_role("option", name="collaborative", exact=True).is_visible()
    assert page.get_by_role("option", name="sjd", exact=True).count() == 0
    page.get_by_role("option", name="collaborative", exact=True).click()
    page.locator("#options textarea").fill("large_steps=3")
    generate(page, chart="steps-chart")
    assert "collaborative:large_steps=3" in page.locator("#stats").inner_text()
    # Not the flat accepted-length line: one bar per scale, named with the model that ran it.
    expect(page.locator("#chart")).to_be_hidden()
    chart = page.locator("#steps-chart")
    expect(chart).to_contain_text("per-step time is not recorded")
    expect(chart).to_contain_text("6 · var-emoji64-small")
    assert "3 · var-emoji64" in chart.inner_text() and chart.locator(".mark-rect path").count() == 6
    page.screenshot(path=artifacts / "04-var-collaborative.png", full_page=True)


def test_markup_in_an_error_is_shown_as_text_and_fetches_nothing(page, artifacts):
    from playwright.sync_api import expect

    box = page.locator("#class input")  # takes any value: the server checks it against the model
    box.click()
    box.fill('<img src="http://example.com/x.png"><b>dog</b>')
    box.press("Enter")
    page.locator("#generate").click()
    toast = page.locator("[data-testid=toast-text]").first
    expect(toast).to_contain_text("unknown class '\\x3cimg src=\"http://example.com/x.png\">\\x3cb>dog\\x3c/b>'")
    assert toast.locator("img, b").count() == 0  # and the page fixture checks that nothing was fetched
    page.wait_for_timeout(500)  # let the toast finish fading in
    page.screenshot(path=artifacts / "05a-markup-error.png")
    page.locator("[data-testid=toast-close]").first.click()


def test_bad_option_shows_an_error_and_the_app_keeps_working(page, artifacts):
    pick(page, "method", "lantern")
    page.locator("#options textarea").fill("delta=abc")
    page.locator("#generate").click()
    message = page.get_by_text("decoding option delta='abc': expected a number")
    message.wait_for()
    page.wait_for_timeout(500)  # let the toast finish fading in
    page.screenshot(path=artifacts / "05-error.png")
    page.locator("[data-testid=toast-close]").first.click()
    page.locator("#options textarea").fill("delta=0.2")
    generate(page)
    assert "lantern:delta=0.2" in page.locator("#stats").inner_text()
    page.screenshot(path=artifacts / "06-after-error.png", full_page=True)


def test_uploads_are_bounded_by_the_request_layers_limit_even_without_an_upload_widget(server_url):
    """Gradio's upload route takes files for any app: the image demo has no upload widget, yet a
    300 MB upload used to be accepted and left on disk. Larger than the one limit: refused (413)."""
    import httpx

    from mmgen.apps.requests.bounds import LIMITS

    big = httpx.post(f"{server_url}gradio_api/upload", files={"files": ("big.bin", b"\0" * (LIMITS.upload_bytes + 1))},
                     timeout=60)
    assert big.status_code == 413
    small = httpx.post(f"{server_url}gradio_api/upload", files={"files": ("small.bin", b"\0" * 1024)}, timeout=60)
    assert small.status_code == 200


def test_text_where_a_number_is_expected_gets_a_one_line_message_not_a_null_error(server_url):
    import httpx

    values = {**UI_VALUES, "seed": "abc"}
    event = httpx.post(f"{server_url}gradio_api/call/generate", json={"data": [*values.values(), *family_defaults()]},
                       timeout=60).json()
    reply = httpx.get(f"{server_url}gradio_api/call/generate/{event['event_id']}", timeout=120).text
    assert "event: error" in reply and '"error": null' not in reply
    assert "must be a number, got 'abc'" in reply
