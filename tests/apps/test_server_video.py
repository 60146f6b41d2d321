"""Video input through the request layer: `mmgen serve`'s `/v1/chat/completions` with vLLM-style
`video_url` parts (data: URLs only), and the VLM demo's upload, on a tiny Qwen2-VL folder (takes
video) and a tiny LLaVA folder (takes none) saved here. A seeded chat with a video is the
offline pipeline's answer on the same decoded bytes, streamed or not, in the shared batch or
alone; a URL is never fetched; bad videos and a model without video are one JSON error.
"""

from __future__ import annotations

import base64
import socket

import httpx
import pytest

pytest.importorskip("uvicorn")
from mmgen.apps.requests.text import MAX_VIDEOS  # noqa: E402
from mmgen.apps.server import ServerSettings, create_app, discover_catalogs, preload  # noqa: E402
from mmgen.sampling import make_generator  # noqa: E402

from tests.apps.test_server import error_of, running  # noqa: E402
from tests.vlm.test_video_surfaces import frames, video_folders  # noqa: E402
from tests.vlm.tiny import PROMPTS, images  # noqa: E402

QWEN, LLAVA = "tiny-qwen2-vl", "tiny-llava"
BUDGET = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return video_folders(tmp_path_factory.mktemp("server-video"))


@pytest.fixture(scope="module")
def catalogs(root):
    catalogs = discover_catalogs([str(root / QWEN), str(root / LLAVA)], continuous_batch={"text": 2})
    preload(catalogs)
    return catalogs


@pytest.fixture(scope="module")
def http(catalogs):
    with running(create_app(catalogs, ServerSettings(max_new_tokens=16))) as base:
        with httpx.Client(base_url=base, timeout=120) as session:
            yield session


def data_url(path, kind: str = "video/mp4") -> str:
    return f"data:{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def chat(messages, **changes) -> dict:
    return {"model": QWEN, "messages": messages, "max_tokens": BUDGET, **changes}


def streamed_text(http, body: dict) -> str:
    """The content of a streamed chat's events, joined."""
    import json

    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return "".join(choice["delta"].get("content") or "" for line in lines[:-1] for choice in json.loads(line)["choices"])


def test_a_seeded_chat_with_a_video_is_the_offline_pipelines_answer(http, catalogs, root):
    """Sampled, in the shared batch (ar) and streamed; greedy alone (lookup: an adaptive
    decoder, outside the batch); the image before the video as the pipeline orders them; usage
    counts the video's tokens."""
    image_path = root / "cat.png"
    messages = [{"role": "user", "content": [video_part(data_url(root / "clip0.mp4")),
                                             {"type": "image_url", "image_url": {"url": data_url(image_path, "image/png")}},
                                             {"type": "text", "text": PROMPTS[1]}]}]
    pipe = catalogs["text"].pipeline(QWEN)
    videos, picture = frames(root, "clip0.mp4"), images(1)[0]
    response = http.post("/v1/chat/completions", json=chat(messages, temperature=1.0, seed=5, decoding="ar"))
    assert response.status_code == 200, response.text
    alone = pipe(PROMPTS[1], [picture], videos, max_new_tokens=BUDGET, temperature=1.0, generator=make_generator(5))
    body = response.json()
    assert body["choices"][0]["message"]["content"] == alone.texts[0]
    assert body["usage"]["completion_tokens"] == int(alone.lengths[0])
    assert body["usage"]["prompt_tokens"] == pipe.prepare_inputs(PROMPTS[1], [picture], videos)["input_ids"].shape[-1]
    assert body["usage"]["prompt_tokens"] > pipe.prepare_inputs(PROMPTS[1], [picture])["input_ids"].shape[-1]
    assert streamed_text(http, chat(messages, temperature=1.0, seed=5, decoding="ar")) == alone.texts[0]
    greedy = pipe(PROMPTS[1], [picture], videos, max_new_tokens=BUDGET)
    for stream in (False, True):
        body = chat(messages, seed=0, decoding="lookup")
        text = streamed_text(http, body) if stream else http.post("/v1/chat/completions", json=body).json()["choices"][0][
            "message"]["content"]
        assert text == greedy.texts[0]


def test_a_video_in_an_earlier_turn_stays_in_the_conversation(http, catalogs, root):
    messages = [{"role": "user", "content": [video_part(data_url(root / "clip1.mp4")), {"type": "text", "text": PROMPTS[0]}]},
                {"role": "assistant", "content": "a cat"}, {"role": "user", "content": PROMPTS[2]}]
    response = http.post("/v1/chat/completions", json=chat(messages, seed=0))
    assert response.status_code == 200, response.text
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPTS[0]}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]},
                    {"role": "user", "content": [{"type": "text", "text": PROMPTS[2]}]}]
    alone = catalogs["text"].pipeline(QWEN)([conversation], None, frames(root, "clip1.mp4"), max_new_tokens=BUDGET)
    assert response.json()["choices"][0]["message"]["content"] == alone.texts[0]


def test_a_video_url_is_never_fetched(http):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.3)
    try:
        for scheme in ("http", "https"):
            target = f"{scheme}://127.0.0.1:{listener.getsockname()[1]}/clip.mp4"
            messages = [{"role": "user", "content": [video_part(target), {"type": "text", "text": PROMPTS[0]}]}]
            error = error_of(http.post("/v1/chat/completions", json=chat(messages)), 400)
            assert "never fetches" in error["message"] and error["code"] == "unsupported_url"
            assert error["param"] == "messages[0].content[0].video_url.url"
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody came
    finally:
        listener.close()


def bad_video_messages(root, case: str) -> list:
    parts = {"base64": [video_part("data:video/mp4;base64,!!not base64!!")],
             "image": [video_part(data_url(root / "cat.png", "image/png"))],
             "not a video": [video_part(data_url(root / "broken.mp4"))],
             "too many": [video_part(data_url(root / "clip0.mp4"))] * (MAX_VIDEOS + 1)}[case]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPTS[0]}]}]


@pytest.mark.parametrize("case, model, words", [
    ("base64", QWEN, "messages[0].content[0].video_url.url's video is not valid base64"),
    ("image", QWEN, "a data: URL of 'image/png', not a video"),
    ("not a video", QWEN, "video 1 of the conversation: not a readable video"),
    ("too many", QWEN, f"at most {MAX_VIDEOS} videos per conversation"),
    ("not a video", LLAVA, "model_type 'llava' takes no video input in mmgen"),  # refused before the bytes are read
])
def test_bad_videos_get_one_json_error(http, root, case, model, words):
    for stream in (False, True):
        error = error_of(http.post("/v1/chat/completions", json=chat(bad_video_messages(root, case), model=model,
                                                                     stream=stream)), 400)
        assert words in error["message"], error


def test_the_demo_sends_an_uploaded_video_to_the_request(catalogs, root):
    """An uploaded .mp4 goes into the request's videos (an image upload stays an image), and the
    next turn keeps it in the conversation."""
    pytest.importorskip("gradio")
    from mmgen.apps.text_demo import handle_send

    def send(message, state):
        *_, last = handle_send(catalogs["text"], 4, 16, message, state, QWEN, "ar", "none", 0.25, 0.0, 0, BUDGET, False)
        return last[3]  # the new state

    state = send({"text": PROMPTS[0], "files": [str(root / "clip0.mp4"), str(root / "cat.png")]}, None)
    pipe = catalogs["text"].pipeline(QWEN)
    alone = pipe(PROMPTS[0], [images(1)[0]], frames(root, "clip0.mp4"), max_new_tokens=BUDGET)
    assert state["chat"][-1]["content"] == alone.texts[0]
    assert len(state["videos"]) == 1 and len(state["images"]) == 1
    state = send({"text": PROMPTS[2], "files": []}, state)
    assert len(state["videos"]) == 1 and state["history"][0]["content"][1] == {"type": "video"}
