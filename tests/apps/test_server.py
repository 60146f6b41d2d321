"""`mmgen serve` (apps/server.py) over real HTTP: uvicorn on 127.0.0.1 in a thread, the OpenAI
routes driven with the official `openai` client, mmgen's own fields, streaming and errors with
plain httpx. The models are the bundled ones (emoji64, emoji-vlm, speech-tts, emoji-motion, each
with its companion), loaded once for the module; continuous batching is on for the batched
modalities, as `mmgen serve` runs by default.

A request with a seed must give what the offline pipeline (or the request layer's `run_request`)
gives for that seed: each modality has a test that compares them byte for byte.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from PIL import Image

openai = pytest.importorskip("openai")  # a dev dependency (pyproject's [dev])
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from mmgen.apps import serve_cli  # noqa: E402
from mmgen.apps.requests import image, video  # noqa: E402
from mmgen.apps.http.connections import uvicorn_options  # noqa: E402
from mmgen.apps.server import ServerSettings, create_app, discover_catalogs, pcm16, preload  # noqa: E402
from mmgen.sampling import make_generator  # noqa: E402

#: openai's client warns that OpenAI's own video service is to close; the route it drives here is ours.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

KEY = "test-key"
MODELS = ["emoji64", "emoji-vlm", "speech-tts", "emoji-motion"]
TEXT = "[S1] Hello there."
LONG_TEXT = "[S1] Hello there. How are you doing today? I am fine, thank you very much. [S2] Good to hear that."
FRAMES = 48  # of LONG_TEXT's some 95 frames: streamed in many chunks over a second or more
QUESTION = "What is this?"


@pytest.fixture(scope="module")
def catalogs():
    catalogs = discover_catalogs(MODELS, continuous_batch={"image": 4, "text": 4, "speech": 4})
    preload(catalogs)
    return catalogs


@contextmanager
def running(app):
    """Serve `app` with uvicorn on a free port of 127.0.0.1 in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    options = uvicorn_options(app.state.service.settings)  # as `mmgen serve` runs it: connection bounds
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def url(catalogs):
    settings = ServerSettings(api_key=KEY, max_new_tokens=16, max_new_frames=255, max_frames=17)
    with running(create_app(catalogs, settings)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as session:
        yield session


@pytest.fixture(scope="module")
def picture(catalogs):
    """An emoji64 image (what emoji-vlm was trained to describe) and its data: URL."""
    pipe = catalogs["image"].pipeline("emoji64")
    shown = pipe([pipe.class_index("face-smiling")], decoding="ar", generator=make_generator(0)).images[0].convert("RGB")
    buffer = io.BytesIO()
    shown.save(buffer, format="PNG")
    return shown, "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def metric(http, name: str, **labels) -> float:
    """One sample's value from /metrics (0 when the series is absent)."""
    text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def settles(http, value: float, name: str, **labels) -> bool:
    """Whether a metric reaches `value` within a few seconds (a response's last bytes may reach
    the client just before the server's bookkeeping after it)."""
    deadline = time.monotonic() + 30
    while metric(http, name, **labels) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return metric(http, name, **labels) == value


def error_of(response: httpx.Response, status: int) -> dict:
    """The response's one JSON error in OpenAI's shape, after checking its status."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text and "\n" not in body["error"]["message"]
    return body["error"]


def ask(**changes) -> dict:
    return {"model": "emoji-vlm", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, **changes}


# --- models, health, keys ---------------------------------------------------------------------


def test_models_list_every_modality_and_health_needs_no_key(client, url):
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert {name: extra["modality"] for name, extra in models.items()} == {
        "emoji64": "image", "speech-tts": "speech", "emoji-motion": "video", "emoji-vlm": "text"}
    assert models["emoji-vlm"]["companions"] == ["emoji-vlm-draft"] and "ar" in models["emoji-vlm"]["decoding"]
    assert models["speech-tts"]["route"] == "/v1/audio/speech" and models["emoji-vlm"]["route"] == "/v1/chat/completions"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_every_route_but_health_needs_the_key(url, headers):
    for path in ("/v1/models", "/metrics", "/v1/videos/video_x"):
        error = error_of(httpx.get(f"{url}{path}", headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    error_of(httpx.post(f"{url}/v1/chat/completions", headers=headers, json=ask()), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{url}/v1", max_retries=0).models.list()


# --- images -------------------------------------------------------------------------------


def test_image_with_a_seed_is_the_offline_pipelines_image(client, catalogs):
    out = client.images.generate(model="emoji64", prompt="face-smiling", n=1, response_format="b64_json",
                                 extra_body={"seed": 7, "decoding": "ar"})
    got = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
    pipe = catalogs["image"].pipeline("emoji64")
    alone = pipe([pipe.class_index("face-smiling")], decoding="ar", generator=make_generator(7)).images[0]
    assert got.size == (64, 64) and got.convert("RGB").tobytes() == alone.convert("RGB").tobytes()
    assert out.model_extra["seed"] == 7


def test_image_takes_mmgens_fields_as_the_request_layer_does(http, catalogs):
    names = image.model_info(catalogs["image"].pipeline("emoji64")).class_names
    body = {"model": "emoji64", "class_label": 3, "n": 2, "seed": 5, "decoding": "sjd",
            "decoding_options": {"window": 8, "adapt": False}, "temperature": 0.9, "top_k": 100}
    response = http.post("/v1/images/generations", json=body)
    assert response.status_code == 200, response.text
    got = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).convert("RGB") for d in response.json()["data"]]
    layer = image.run_request(image.ImageRequest("emoji64", names[3], "sjd", options="window=8,adapt=false", seed=5,
                                                 num_images=2, temperature=0.9, top_k=100), catalogs["image"])
    assert [g.tobytes() for g in got] == [p.convert("RGB").tobytes() for p in layer.method.images]


@pytest.mark.parametrize("body, status, param, words", [
    ({"prompt": "face-smiling", "response_format": "url"}, 400, "response_format", "hosts no files"),
    ({"prompt": "face-smiling", "n": "2"}, 400, "n", "valid integer"),
    ({"prompt": "face-smiling", "seed": 1.5}, 400, "seed", "valid integer"),
    ({"prompt": "face-smiling", "qualty": "hd"}, 400, "qualty", "unknown field"),
    ({"prompt": "no-such-class"}, 400, None, "unknown class"),
    ({"prompt": "face-smiling", "n": 99}, 400, None, "number of images"),
    ({"prompt": "face-smiling", "decoding": "warp"}, 400, None, "unknown decoding method"),
    ({"prompt": "face-smiling", "size": "1024x1024"}, 400, "size", "64x64"),
    ({"prompt": "face-smiling", "model": "emoji-vlm"}, 404, "model", "vision-language model"),
    ([1, 2], 400, None, "JSON object"),
])
def test_bad_image_requests_get_one_json_error_before_any_work(http, body, status, param, words):
    error = error_of(http.post("/v1/images/generations", json=body), status)
    assert words in error["message"] and error["param"] == param


def test_bad_json_and_unknown_routes_get_one_json_error(http):
    cut_short = http.post("/v1/images/generations", content=b'{"prompt": "face-', headers={"Content-Type": "application/json"})
    error = error_of(cut_short, 400)
    assert "not valid JSON" in error["message"]
    assert "no route" in error_of(http.get("/v1/nothing"), 404)["message"]
    assert "not allowed" in error_of(http.get("/v1/chat/completions"), 405)["message"]


def test_an_unexpected_failure_is_a_generic_500(http, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("internal detail at 0xdeadbeef")

    monkeypatch.setattr(image, "run_checked", broken)
    error = error_of(http.post("/v1/images/generations", json={"prompt": "face-smiling"}), 500)
    assert error["type"] == "server_error" and "0xdeadbeef" not in error["message"]


# --- chat ---------------------------------------------------------------------------------


def test_chat_with_a_seed_is_the_offline_pipelines_answer_with_usage(client, catalogs, picture):
    shown, data_url = picture
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": QUESTION}]}]
    out = client.chat.completions.create(model="emoji-vlm", messages=messages, max_tokens=8, temperature=0.8, seed=3,
                                         extra_body={"decoding": "ar"})
    pipe = catalogs["text"].pipeline("emoji-vlm")
    alone = pipe(QUESTION, [shown], max_new_tokens=8, decoding="ar", temperature=0.8, generator=make_generator(3))
    choice = out.choices[0]
    assert choice.message.content == alone.texts[0] and choice.message.role == "assistant"
    assert out.usage.completion_tokens == int(alone.lengths[0])
    assert out.usage.prompt_tokens == pipe.prepare_inputs(QUESTION, [shown])["input_ids"].shape[-1] > 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.finish_reason == ("length" if int(alone.lengths[0]) == 8 else "stop")


def test_overlapping_chats_share_the_batch_and_each_gives_its_seeds_answer(client, catalogs, picture):
    """Three chats held until all wait, then decoded in one continuous batch (one session of the
    shared server, three rows): each answer is its own seed's answer alone, and the seeds'
    answers differ, so a server that mixed rows up or ignored seeds fails."""
    shown, data_url = picture
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": QUESTION}]}]
    seeds = (11, 12, 13)
    pipe, text = catalogs["text"].pipeline("emoji-vlm"), catalogs["text"]
    alone = {seed: pipe(QUESTION, [shown], max_new_tokens=8, decoding="ar", temperature=1.0,
                        generator=make_generator(seed)).texts[0] for seed in seeds}
    assert len(set(alone.values())) == len(seeds)  # distinct: an answer given to the wrong request shows
    # The server's shared batch for these settings (the same one the requests get: `Catalog.server` caches it).
    shared = text.server("emoji-vlm", "ar", text.decoder("ar", "emoji-vlm"), max_new_tokens=16, temperature=1.0).server
    sessions = shared.sessions
    answers = {}

    def chat(seed: int) -> None:
        out = client.chat.completions.create(model="emoji-vlm", messages=messages, max_tokens=8, temperature=1.0,
                                             seed=seed, extra_body={"decoding": "ar"})
        answers[seed] = out.choices[0].message.content

    threads = [threading.Thread(target=chat, args=(seed,)) for seed in seeds]
    with text.using(["emoji-vlm"]):  # the model is busy: every chat waits for the batch
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while shared.queue.waiting() < len(seeds) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert shared.queue.waiting() == len(seeds)
    for thread in threads:
        thread.join(timeout=120)
    assert shared.sessions == sessions + 1  # one decode served all three: they shared its rows
    assert answers == alone


def test_many_sampling_settings_keep_the_threads_and_servers_bounded(http, catalogs):
    """Each temperature keys its own continuous batch; neither their worker threads nor the
    servers themselves may grow with the settings clients send."""
    from mmgen.apps.requests.catalog import MAX_SERVERS

    def batch_threads() -> int:
        return sum(t.name == "mmgen-continuous-batch" for t in threading.enumerate())

    for k in range(3 * MAX_SERVERS):
        response = http.post("/v1/chat/completions", json=ask(max_tokens=2, temperature=0.5 + 0.001 * k, seed=k,
                                                                 decoding="ar"))
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while batch_threads() and time.monotonic() < deadline:  # an idle server's worker ends once its queue empties
        time.sleep(0.05)
    assert batch_threads() == 0
    assert len(catalogs["text"]._servers) <= MAX_SERVERS


def test_chat_without_max_tokens_fits_the_models_context_on_the_default_server(catalogs, picture):
    """The default budget (256 tokens) is emoji-vlm's whole context: a request that sets none gets
    what the context leaves after its prompt, and its answer, not a 400."""
    _, data_url = picture
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": QUESTION}]}]
    assert catalogs["text"].pipeline("emoji-vlm").context_length <= ServerSettings().max_new_tokens
    with running(create_app(catalogs, ServerSettings())) as base:
        response = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                              json={"model": "emoji-vlm", "messages": messages, "seed": 0, "decoding": "ar"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_chat_streams_server_sent_events_that_add_up_to_the_answer(client, http, picture):
    _, data_url = picture
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": QUESTION}]}]
    whole = client.chat.completions.create(model="emoji-vlm", messages=messages, max_tokens=8, seed=1)
    chunks = list(client.chat.completions.create(model="emoji-vlm", messages=messages, max_tokens=8, seed=1, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len([c for c in chunks if c.choices]) >= 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with http.stream("POST", "/v1/chat/completions", json=ask(messages=messages, stream=True)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"


def test_chat_stops_at_a_stop_string_streamed_or_not(client, picture):
    _, data_url = picture
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": QUESTION}]}]
    full = client.chat.completions.create(model="emoji-vlm", messages=messages, max_tokens=16).choices[0].message.content
    words = full.split()
    assert len(words) >= 2, full
    stop = " " + words[1]
    cut = full[: full.index(stop)]
    stopped = client.chat.completions.create(model="emoji-vlm", messages=messages, max_tokens=16, stop=[stop, "@@"])
    assert stopped.choices[0].message.content == cut and stopped.choices[0].finish_reason == "stop"
    assert 0 < stopped.usage.completion_tokens < 16
    chunks = list(client.chat.completions.create(model="emoji-vlm", messages=messages, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut


def test_chat_takes_earlier_turns(http, picture):
    _, data_url = picture
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": QUESTION}]},
                {"role": "assistant", "content": "an emoji"}, {"role": "user", "content": "Which one?"}]
    response = http.post("/v1/chat/completions", json=ask(messages=messages, seed=2))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 0


def test_chat_never_fetches_an_image_url(http, client):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    target = f"http://127.0.0.1:{listener.getsockname()[1]}/face.png"
    try:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": target}},
                                                 {"type": "text", "text": QUESTION}]}]
        error = error_of(http.post("/v1/chat/completions", json=ask(messages=messages)), 400)
        assert "never fetches" in error["message"] and error["param"] == "messages[0].content[0].image_url.url"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="emoji-vlm", messages=messages)
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody came
    finally:
        listener.close()


@pytest.mark.parametrize("changes, status, words", [
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}, 400, "system message"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}},
                                                 {"type": "text", "text": "hi"}]}]}, 400, "not valid base64"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}, 400, "alternate"),
    ({"messages": [{"role": "user", "content": "   "}]}, 400, "message is empty"),
    ({"max_tokens": 0}, 400, "max new tokens"),
    ({"max_tokens": "8"}, 400, "valid integer"),
    ({"temperature": 9.0}, 400, "temperature"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"n": 2}, 400, "n must be 1"),
    ({"decoding": "warp"}, 400, "unknown decoding method"),
    ({"model": "speech-tts"}, 404, "speech model"),
    ({"messages": []}, 400, "at least one user message"),
])
def test_bad_chat_requests_get_one_json_error(http, changes, status, words):
    error = error_of(http.post("/v1/chat/completions", json=ask(**changes)), status)
    assert words in error["message"]


# --- speech -------------------------------------------------------------------------------


def speak(**changes) -> dict:
    return {"model": "speech-tts", "input": LONG_TEXT, "seed": 5, "decoding": "ar", "max_new_frames": FRAMES, **changes}


def test_speech_streams_wav_while_it_decodes_and_is_the_offline_pipelines(http, client, catalogs):
    with http.stream("POST", "/v1/audio/speech", json=speak(response_format="wav")) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
        pieces = response.iter_raw()
        body = b""
        while len(body) <= 44:
            body += next(pieces)
        # The first audio is out while the utterance is still being decoded: its row still runs.
        assert metric(http, "mmgen_rows_running", modality="speech") == 1
        body += b"".join(pieces)
    assert body[:4] == b"RIFF" and body[8:16] == b"WAVEfmt " and body[36:40] == b"data"
    assert int.from_bytes(body[4:8], "little") == int.from_bytes(body[40:44], "little") == 0xFFFFFFFF  # streamed
    rate = int.from_bytes(body[24:28], "little")
    pipe = catalogs["speech"].pipeline("speech-tts")
    alone = pipe(LONG_TEXT, max_new_frames=FRAMES, decoding="ar", generator=make_generator(5))
    assert rate == pipe.sampling_rate == int(response.headers["x-sample-rate"])
    # The bytes of the offline stream; the one-shot call's audio up to float rounding (the
    # stream decodes its codes in chunks with context, whose convolutions round differently
    # from one over the whole utterance: at most one 16-bit step here).
    streamed = [chunk for _, chunk in pipe.stream(LONG_TEXT, max_new_frames=FRAMES, decoding="ar", generator=make_generator(5))]
    assert body[44:] == pcm16(np.concatenate([c.float().numpy() for c in streamed])) and len(body) > 44 + 2 * 320
    one_shot = np.frombuffer(pcm16(alone.audio[0].float().numpy()), np.int16).astype(int)
    served = np.frombuffer(body[44:], np.int16).astype(int)
    assert len(served) == len(one_shot) and np.abs(served - one_shot).max() <= 1
    with client.audio.speech.with_streaming_response.create(model="speech-tts", voice="default", input=LONG_TEXT,
                                                            response_format="pcm",
                                                            extra_body={"seed": 5, "decoding": "ar",
                                                                        "max_new_frames": FRAMES}) as raw:
        assert raw.read() == body[44:]
    assert settles(http, 0, "mmgen_rows_running", modality="speech")


def test_a_client_that_goes_away_closes_its_stream_and_frees_its_row(http, monkeypatch):
    """The server closes the request's stream when its client leaves (the request layer then
    stops the run at its next output: tests/core/test_cancellation.py), and the slot is free."""
    from mmgen.apps.requests import speech

    ends = []

    def watched(*args, **kwargs):  # the layer's stream, noting how it ended
        try:
            result = yield from speech_stream(*args, **kwargs)
        except GeneratorExit:
            ends.append("closed early")
            raise
        ends.append("finished")
        return result

    speech_stream = speech.SERVICE.stream  # what the route runs a checked request with
    monkeypatch.setattr(speech.SERVICE, "stream", watched)
    with http.stream("POST", "/v1/audio/speech", json=speak(max_new_frames=250, seed=8)) as response:
        assert response.status_code == 200
        next(response.iter_raw())
        assert metric(http, "mmgen_rows_running", modality="speech") == 1
    assert settles(http, 0, "mmgen_rows_running", modality="speech")
    assert ends == ["closed early"]
    again = http.post("/v1/audio/speech", json=speak(input=TEXT, max_new_frames=10, response_format="pcm"))
    assert again.status_code == 200 and len(again.content) > 0 and ends[1:] == ["finished"]


@pytest.mark.parametrize("changes, words", [
    ({"response_format": "mp3"}, "wav or pcm"),
    ({"voice": "alloy"}, "no named voices"),
    ({"speed": 2.0}, "speed must be 1.0"),
    ({"input": ""}, "text is empty"),
    ({"max_new_frames": 100000}, "max new frames"),
    ({"voice_audio": "AAAA", "voice_text": "hi"}, "voice prompt"),
    ({"top_p": "high"}, "valid number"),
])
def test_bad_speech_requests_get_one_json_error(http, changes, words):
    assert words in error_of(http.post("/v1/audio/speech", json=speak(**changes)), 400)["message"]


# --- video --------------------------------------------------------------------------------


def test_video_job_runs_in_the_background_and_is_the_request_layers_video(client, catalogs):
    job = client.videos.create(model="emoji-motion", prompt="a smiling face", extra_body={"num_frames": 5, "seed": 2})
    assert job.status in ("queued", "in_progress", "completed") and job.size == "64x64"
    deadline = time.monotonic() + 60
    while job.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.videos.retrieve(job.id)
    pipe = catalogs["video"].pipeline("emoji-motion")
    blocks = len(range(0, pipe.latent_frames(5), pipe.block_frames))
    assert job.status == "completed" and job.progress == 100
    assert job.model_extra["blocks_done"] == job.model_extra["num_blocks"] == blocks > 1
    content = client.videos.download_content(job.id).read()
    layer = video.run_request(video.VideoRequest("emoji-motion", "a smiling face", num_frames=5, seed=2), catalogs["video"])
    assert content[4:8] == b"ftyp" and content == layer.mp4()


def test_bad_video_requests_and_unknown_jobs(http):
    def refusal(**body) -> str:
        return error_of(http.post("/v1/videos", json={"prompt": "a face", **body}), 400)["message"]

    assert "size must be 64x64" in refusal(size="720x1280")
    assert "num_frames must be 1 + 4" in refusal(num_frames=6)
    assert "unknown method" in refusal(decoding="warp")
    assert "prompt is required" in error_of(http.post("/v1/videos", data={"seed": "1"}), 400)["message"]
    assert "seconds" in error_of(http.post("/v1/videos", data={"prompt": "a face", "seconds": "60"}), 400)["message"]
    assert error_of(http.get("/v1/videos/video_nope"), 404)["code"] == "not_found"
    assert error_of(http.get("/v1/videos/video_nope/content"), 404)["code"] == "not_found"


def test_shutting_down_stops_a_running_job_cleanly(catalogs, caplog):
    app = create_app(catalogs, ServerSettings(max_frames=33))
    with running(app) as base:
        job = httpx.post(f"{base}/v1/videos", json={"prompt": "a face", "num_frames": 33, "seed": 3}).json()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/v1/videos/{job['id']}").json()["blocks_done"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    stopped = app.state.service.jobs[job["id"]]
    assert stopped.status == "failed" and stopped.error["code"] == "cancelled" and stopped.task is None
    assert stopped.blocks_done < stopped.num_blocks  # stopped at its next block, not run to the end
    assert not [r for r in caplog.records if r.name == "mmgen.serve" and r.levelname == "ERROR"]
    assert app.state.service.admission.lanes[("video", "emoji-motion")].admitted == 0


# --- metrics --------------------------------------------------------------------------------


def test_metrics_count_outputs_latency_and_tokens_per_forward(http):
    before = metric(http, "mmgen_output_units_total", modality="image", unit="token")
    assert http.post("/v1/images/generations", json={"prompt": "face-smiling", "seed": 1, "decoding": "ar"}).status_code == 200
    text = http.get("/metrics").text
    assert metric(http, "mmgen_output_units_total", modality="image", unit="token") == before + 64  # 8x8 tokens
    assert metric(http, "mmgen_output_units_per_second", modality="image", unit="token") > 0
    assert metric(http, "mmgen_accepted_tokens_per_forward_count", modality="image", method="ar") >= 1
    assert metric(http, "mmgen_accepted_tokens_per_forward_sum", modality="image", method="ar") \
        == metric(http, "mmgen_accepted_tokens_per_forward_count", modality="image", method="ar")  # ar: one per forward
    for modality in ("image", "text", "speech", "video"):
        assert f'mmgen_queue_depth{{modality="{modality}"}} 0.0' in text
        assert f'mmgen_request_latency_seconds_bucket{{le="+Inf",modality="{modality}"}}' in text
    assert 'modality="vlm"' not in text  # the text modality's old name (issue 37)
    assert metric(http, "mmgen_time_to_first_output_seconds_count", modality="image") >= 1
    assert metric(http, "mmgen_responses_total", route="/v1/images/generations", status="200") >= 1


# --- admission and limits -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight(catalogs):
    """A second server on the same models: no key, one request may wait, bodies of 4 KiB."""
    with running(create_app(catalogs, ServerSettings(max_queue=1, max_body_bytes=4096, max_frames=9))) as base:
        with httpx.Client(base_url=base, timeout=60) as session:
            yield session


def test_a_full_queue_answers_429_with_retry_after_and_health_stays_quick(tight, catalogs):
    job = {"model": "emoji-motion", "prompt": "a face", "num_frames": 5, "seed": 1}
    with catalogs["video"].using(["emoji-motion"]):  # the model is busy: the first job holds its slot, waiting for it
        first = tight.post("/v1/videos", json=job).json()
        deadline = time.monotonic() + 30
        while tight.get(f"/v1/videos/{first['id']}").json()["status"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        second = tight.post("/v1/videos", json=job).json()
        assert tight.get(f"/v1/videos/{second['id']}").json()["status"] == "queued"
        assert metric(tight, "mmgen_queue_depth", modality="video") == 1
        refused = tight.post("/v1/videos", json=job)
        error = error_of(refused, 429)
        assert error["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
        begun = time.perf_counter()
        assert tight.get("/health").status_code == 200 and time.perf_counter() - begun < 2
        image_ok = tight.post("/v1/images/generations", json={"prompt": "face-smiling", "decoding": "ar"})
        assert image_ok.status_code == 200  # another model's slots are free
    for job_id in (first["id"], second["id"]):
        deadline = time.monotonic() + 60
        while tight.get(f"/v1/videos/{job_id}").json()["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tight.get(f"/v1/videos/{job_id}").json()["status"] == "completed"
    assert metric(tight, "mmgen_rejected_requests_total", reason="queue_full") == 1


def test_oversized_bodies_are_refused_before_they_are_read(tight):
    big = {"model": "emoji-vlm", "messages": [{"role": "user", "content": "x" * 8000}]}
    error = error_of(tight.post("/v1/chat/completions", json=big), 413)
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: cut off once it passes the bound
        for _ in range(8):
            yield b" " * 1024

    error_of(tight.post("/v1/chat/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)


# --- abuse: slow, gone and crowding clients ----------------------------------------------------

GUARDED = ServerSettings(max_queue=1, max_body_bytes=4096, max_body_bytes_in_flight=6000, header_timeout_s=1.0,
                         body_timeout_s=2.0, max_connections=8, max_frames=9)


@pytest.fixture(scope="module")
def guarded(catalogs):
    """A server with tight abuse bounds (no key): its base URL and (host, port)."""
    with running(create_app(catalogs, GUARDED)) as base:
        host, port = base.removeprefix("http://").split(":")
        yield base, (host, int(port))


def raw(address, data: bytes = b"", timeout: float = 10.0) -> socket.socket:
    """A raw connection to the server that has sent `data`."""
    sock = socket.create_connection(address, timeout=timeout)
    if data:
        sock.sendall(data)
    return sock


def head(path: str, length: int, kind: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {kind}\r\nContent-Length: {length}\r\n\r\n").encode()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (whatever it answers first)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@contextmanager
def logged(*names: str):
    """The records the named loggers emit meanwhile (uvicorn's do not reach pytest's caplog)."""
    import logging

    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_a_client_gone_mid_body_is_no_500_and_logs_no_traceback(guarded):
    base, address = guarded
    with httpx.Client(base_url=base) as http:
        before = metric(http, "mmgen_responses_total", route="/v1/chat/completions", status="500")
        with logged("uvicorn.error", "mmgen.serve") as records:
            for _ in range(3):
                raw(address, head("/v1/chat/completions", 2000) + b'{"model": "emoji-').close()
            deadline = time.monotonic() + 10
            while metric(http, "mmgen_rejected_requests_total", reason="client_gone") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert metric(http, "mmgen_rejected_requests_total", reason="client_gone") >= 3
        assert metric(http, "mmgen_responses_total", route="/v1/chat/completions", status="500") == before
    assert not [r for r in records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]


def test_trickled_headers_and_bodies_are_cut_off_and_connections_are_bounded(guarded):
    base, address = guarded
    trickler = raw(address, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    trickler.settimeout(0.1)
    begun, closed_after = time.monotonic(), None
    while closed_after is None and time.monotonic() - begun < 10:  # a header line every 0.1 s, never finished
        try:
            trickler.sendall(b"X-Slow: 1\r\n")
            if trickler.recv(65536) == b"":
                closed_after = time.monotonic() - begun
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - begun
    assert closed_after is not None and closed_after < GUARDED.header_timeout_s + 2  # closed at the header timeout
    slow_body = raw(address, head("/v1/chat/completions", 100) + b"{")  # its body never comes
    answer = slow_body.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive" in answer and closed_within(slow_body, 2.0)
    crowd = [raw(address) for _ in range(GUARDED.max_connections + 2)]
    try:
        assert closed_within(crowd[-1], 2.0)  # past the limit: closed before it sends anything
    finally:
        for sock in crowd:
            sock.close()
    assert httpx.get(f"{base}/health").status_code == 200


def test_bodies_are_admitted_before_they_are_read(guarded, catalogs):
    base, address = guarded
    first = raw(address, head("/v1/chat/completions", 4000) + b"{")  # holds 4000 of the 6000 body bytes
    try:
        time.sleep(0.2)
        second = raw(address, head("/v1/chat/completions", 4000))  # sends no body: answered before it is read
        answer = second.recv(65536)
        assert answer.startswith(b"HTTP/1.1 429") and b"server_busy" in answer and b"retry-after" in answer.lower()
    finally:
        first.close()
    job = {"model": "emoji-motion", "prompt": "a face", "num_frames": 5, "seed": 1}
    with catalogs["video"].using(["emoji-motion"]), httpx.Client(base_url=base, timeout=30) as http:
        running_job = http.post("/v1/videos", json=job).json()
        deadline = time.monotonic() + 30
        while http.get(f"/v1/videos/{running_job['id']}").json()["status"] == "queued" and time.monotonic() < deadline:
            time.sleep(0.02)
        waiting_job = http.post("/v1/videos", json=job).json()  # the one place in the queue
        late = raw(address, head("/v1/videos", 100))  # no body: refused by the full queue before it is read
        answer = late.recv(65536)
        assert answer.startswith(b"HTTP/1.1 429") and b"queue_full" in answer
    for job_id in (running_job["id"], waiting_job["id"]):
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/v1/videos/{job_id}").json()["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.mark.parametrize("path, content, kind, status, words", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}', "text/plain", 415, "application/json"),
    ("/v1/audio/speech", b'{"input": "[S1] Hel\\u0000lo"}', "application/json", 400, "control character"),
    ("/v1/videos", b'{"prompt": "a face", "num_frames": 5, "seconds": "abc"}', "application/json", 400, "seconds"),
    ("/v1/videos", b'{"prompt": "a face", "num_frames": 5, "decoding": "block", "large_steps": 1000000000}',
     "application/json", 400, "large-model steps"),
])
def test_bad_bodies_and_fields_are_refused_before_admission(http, path, content, kind, status, words):
    error = error_of(http.post(path, content=content, headers={"Content-Type": kind}), status)
    assert words in error["message"]


# --- the command ----------------------------------------------------------------------------


def test_the_server_imports_no_cli_module():
    """The server is a library the CLI drives, not the other way round."""
    import subprocess
    import sys

    code = "import sys, mmgen.apps.server; print(sorted(m for m in sys.modules if m in ('mmgen.apps.serve_cli', 'mmgen.apps.cli')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr[-1000:]


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmgen")
    serve_cli.register(parser.add_subparsers(dest="command", required=True), {})
    return parser


def test_serve_command_defaults_are_local_and_the_servers(monkeypatch):
    monkeypatch.delenv(serve_cli.API_KEY_ENV, raising=False)
    args = serve_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    assert serve_cli.settings_of(args) == ServerSettings()
    assert serve_cli.continuous_batch(args.continuous_batch) == {"image": 16, "text": 16, "speech": 16}
    args = serve_parser().parse_args(["serve", "--continuous-batch", "2", "--continuous-batch", "speech=0"])
    assert serve_cli.continuous_batch(args.continuous_batch) == {"image": 2, "text": 2, "speech": 0}
    monkeypatch.setenv(serve_cli.API_KEY_ENV, "from-env")
    assert serve_cli.settings_of(serve_parser().parse_args(["serve"])).api_key == "from-env"
    assert serve_cli.settings_of(serve_parser().parse_args(["serve", "--api-key", "given"])).api_key == "given"
    args = serve_parser().parse_args(["serve", "--max-connections", "8", "--header-timeout", "2", "--body-timeout", "5"])
    settings = serve_cli.settings_of(args)
    assert (settings.max_connections, settings.header_timeout_s, settings.body_timeout_s) == (8, 2.0, 5.0)
    for bad in (["--continuous-batch", "video=2"], ["--continuous-batch", "65"], ["--port", "70000"], ["--max-queue", "x"],
                ["--max-connections", "0"], ["--header-timeout", "0"]):
        with pytest.raises(SystemExit):
            serve_parser().parse_args(["serve", *bad])


def test_the_old_modality_name_vlm_still_sets_the_text_batch_with_a_note(capsys):
    """`--continuous-batch vlm=ROWS` (the text modality's name until issue 37) still sets the text
    rows, with a one-line note on stderr; Python callers of `discover_catalogs` get a
    DeprecationWarning."""
    args = serve_parser().parse_args(["serve", "--continuous-batch", "vlm=3", "--continuous-batch", "speech=5"])
    assert serve_cli.continuous_batch(args.continuous_batch) == {"image": 16, "text": 3, "speech": 5}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--continuous-batch vlm=ROWS is now text=ROWS" in err
    serve_parser().parse_args(["serve", "--continuous-batch", "text=3"])
    assert capsys.readouterr().err == ""  # the new name says nothing
    with pytest.warns(DeprecationWarning, match="'vlm' is now called 'text'"):
        catalogs = discover_catalogs(["emoji-vlm"], continuous_batch={"vlm": 2})
    assert list(catalogs) == ["text"] and catalogs["text"].continuous_batch == 2


def test_serve_command_runs_uvicorn_on_the_given_models(monkeypatch):
    calls = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.update(app=app, **kwargs))
    args = serve_parser().parse_args(["serve", "--model", "speech-tts", "--port", "0", "--no-preload", "--api-key", "k",
                                      "--continuous-batch", "speech=3"])
    assert args.run(args) == 0
    service = calls["app"].state.service
    assert (calls["host"], calls["port"]) == ("127.0.0.1", 0) and list(service.catalogs) == ["speech"]
    assert service.catalogs["speech"].continuous_batch == 3 and service.settings.api_key == "k"
    with pytest.raises(ValueError, match="neither a bundled model"):
        discover_catalogs(["no-such-model"])


def test_a_video_job_answers_on_another_copy_of_the_server(catalogs):
    """Two copies sharing a job board (as `mmgen serve --ray` replicas share one actor): a job
    posted to one streams its blocks, reports its status and gives its MP4 on the other, byte
    for byte what the copy that ran it gives; a job neither holds is still a 404."""
    from mmgen.apps.job_board import JobBoard, JobShelf

    board = JobBoard(shelf=JobShelf(keep=4))
    settings = ServerSettings(api_key=KEY, max_frames=17)
    headers = {"Authorization": f"Bearer {KEY}"}
    with running(create_app(catalogs, settings, board)) as first, running(create_app(catalogs, settings, board)) as second:
        with httpx.Client(base_url=first, headers=headers, timeout=120) as one, \
                httpx.Client(base_url=second, headers=headers, timeout=120) as other:
            job = one.post("/v1/videos", json={"model": "emoji-motion", "prompt": "a smiling face", "num_frames": 9, "seed": 3}).json()
            with other.stream("GET", f"/v1/videos/{job['id']}/events") as response:
                assert response.status_code == 200
                events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
            blocks, done = [json.loads(e) for e in events[:-2]], json.loads(events[-2])
            assert events[-1] == "[DONE]" and done["status"] == "completed" and done["id"] == job["id"]
            assert [b["block"] for b in blocks] == list(range(done["num_blocks"])) and len(blocks) > 1
            assert other.get(f"/v1/videos/{job['id']}").json() == one.get(f"/v1/videos/{job['id']}").json() == {**done, "object": "video"}
            content = other.get(f"/v1/videos/{job['id']}/content")
            assert content.status_code == 200 and content.content == one.get(f"/v1/videos/{job['id']}/content").content
            assert content.content[4:8] == b"ftyp"
            assert error_of(other.get("/v1/videos/video_nope"), 404)["code"] == "not_found"


def test_a_video_jobs_blocks_stream_as_server_sent_events_and_make_up_its_video(client, http, catalogs):
    """`GET /v1/videos/{id}/events`: each committed block (its frames as PNGs) as it commits,
    then the job's final state and [DONE]; the blocks' frames are the video's frames."""
    job = client.videos.create(model="emoji-motion", prompt="a smiling face", extra_body={"num_frames": 9, "seed": 3})
    with http.stream("GET", f"/v1/videos/{job.id}/events", timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    blocks, done = [json.loads(e) for e in events[:-2]], json.loads(events[-2])
    assert done["object"] == "video.done" and done["status"] == "completed"
    assert [b["block"] for b in blocks] == list(range(done["num_blocks"])) and len(blocks) > 1
    assert [b["start_frame"] for b in blocks[1:]] == [b["end_frame"] for b in blocks[:-1]]
    frames = [np.asarray(Image.open(io.BytesIO(base64.b64decode(f)))) for b in blocks for f in b["frames"]]
    layer = video.run_request(video.VideoRequest("emoji-motion", "a smiling face", num_frames=9, seed=3), catalogs["video"])
    assert len(frames) == layer.frames.shape[0] == 9 and all(np.array_equal(a, b) for a, b in zip(frames, layer.frames))
    assert error_of(http.get("/v1/videos/video_nope/events"), 404)["code"] == "not_found"
