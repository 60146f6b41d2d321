"""`/v1/videos/stream` (apps/http/video_stream.py): a live video over a WebSocket, driven with
Starlette's TestClient on a tiny random video model (`tests/video/tiny.py`, 32×32 frames,
blocks of 2 latent frames) saved as a folder. A seeded stream's frames are `pipe.stream`'s,
a prompt sent mid-stream steers the next block not yet started, bad first messages are one
JSON error, the API key is required, and a client that leaves frees the model.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from starlette.testclient import WebSocketDenialResponse  # noqa: E402
from starlette.websockets import WebSocketDisconnect  # noqa: E402

from mmgen.apps.requests import video  # noqa: E402
from mmgen.apps.server import ServerSettings, create_app, discover_catalogs  # noqa: E402

from tests.video.tiny import tiny_video_pipeline  # noqa: E402

MODEL, PROMPT, NEW = "tiny-video", "cat face moving left", "dog face moving up"
POLICY = "sink:2,window:2"
KEY = "stream-key"
ROUTE = "/v1/videos/stream"


@pytest.fixture(scope="module")
def catalogs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-models")
    tiny_video_pipeline().save_pretrained(root / MODEL)
    return discover_catalogs([str(root / MODEL)])


def client_of(catalogs, **settings) -> TestClient:
    return TestClient(create_app(catalogs, ServerSettings(**{"max_frames": 13, **settings})))


@pytest.fixture(scope="module")
def client(catalogs):
    with client_of(catalogs, max_stream_blocks=8) as client:
        yield client


def start(ws, **changes) -> dict:
    """Send the first message; return the server's `video.stream` message."""
    ws.send_text(json.dumps({"model": MODEL, "prompt": PROMPT, "seed": 3, "cache_policy": POLICY, **changes}))
    started = ws.receive_json()
    assert started["object"] == "video.stream", started
    return started


def next_block(ws, others: list | None = None) -> tuple[dict, np.ndarray]:
    """The next block's header and frames [T, H, W, 3]; other JSON messages on the way go to `others`."""
    while (header := ws.receive_json())["object"] != "video.block":
        assert others is not None, header
        others.append(header)
    t, h, w = header["num_frames"], header["height"], header["width"]
    frames = [np.frombuffer(ws.receive_bytes(), np.uint8) for _ in range(t)]
    assert all(f.size == h * w * 3 for f in frames) and header["format"] == "rgb24"
    return header, np.stack(frames).reshape(t, h, w, 3)


def reference(catalogs, blocks: int, switch_at: int | None = None) -> list[np.ndarray]:
    """`pipe.stream` alone: the frames of its first `blocks` blocks (the new prompt set before
    block `switch_at`)."""
    pipe = catalogs["video"].pipeline(MODEL)
    out = []
    with pipe.stream(PROMPT, cache_policy=POLICY, generator=torch.Generator().manual_seed(3)) as stream:
        for index in range(blocks):
            if index == switch_at:
                stream.set_prompt(NEW)
            out.append(next(stream).frames[0].numpy())
    return out


def model_free(client, catalogs, within: float = 10.0) -> bool:
    """Whether the model's lock and its admission slot are given back within a few seconds."""
    lane = client.app.state.service.admission.lane("video", MODEL)
    deadline = time.monotonic() + within
    while (catalogs["video"]._locks[MODEL].locked() or lane.admitted) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not catalogs["video"]._locks[MODEL].locked() and lane.admitted == 0


def closed_with(ws) -> int:
    with pytest.raises(WebSocketDisconnect) as closed:
        ws.receive_json()
    return closed.value.code


def test_a_seeded_stream_is_pipe_stream_and_ends_at_its_max_blocks(client, catalogs):
    with client.websocket_connect(ROUTE) as ws:
        started = start(ws, max_blocks=3)
        blocks = [next_block(ws) for _ in range(3)]
        assert ws.receive_json() == {"object": "video.stream.done", "blocks": 3, "reason": "max_blocks"}
        assert closed_with(ws) == 1000
    assert {k: started[k] for k in ("model", "seed", "cache_policy", "block_frames", "fps", "height", "width",
                                    "max_blocks", "realtime", "format")} == {
        "model": MODEL, "seed": 3, "cache_policy": POLICY, "block_frames": 2, "fps": 8.0, "height": 32, "width": 32,
        "max_blocks": 3, "realtime": False, "format": "rgb24"}
    assert [(h["block"], h["first_frame"], h["num_frames"], h["prompt"]) for h, _ in blocks] == [
        (0, 0, 5, PROMPT), (1, 5, 8, PROMPT), (2, 13, 8, PROMPT)]
    assert all(np.array_equal(frames, ref) for (_, frames), ref in zip(blocks, reference(catalogs, 3)))
    assert model_free(client, catalogs)


@pytest.fixture
def hold(monkeypatch):
    """{block index: Event}: the server's stream waits before making such a block until the
    test sets its event, so that what the client sends meanwhile arrives between two blocks."""
    events: dict[int, threading.Event] = {}
    make = video.LiveVideo.next

    def held(self):
        if self.blocks in events:
            events[self.blocks].wait(30)
        return make(self)

    monkeypatch.setattr(video.LiveVideo, "next", held)
    yield events
    for event in events.values():
        event.set()


def test_a_prompt_sent_mid_stream_steers_the_next_block_and_close_ends_it(client, catalogs, hold):
    hold.update({1: threading.Event(), 4: threading.Event()})
    with client.websocket_connect(ROUTE) as ws:
        start(ws)
        blocks = [next_block(ws)]
        ws.send_text(json.dumps({"prompt": NEW}))  # before block 1 starts
        assert ws.receive_json() == {"object": "video.prompt", "prompt": NEW}
        hold[1].set()
        blocks += [next_block(ws) for _ in range(3)]
        ws.send_text(json.dumps({"close": True}))  # while block 4 waits: it is made, and not sent
        hold[4].set()
        assert ws.receive_json() == {"object": "video.stream.done", "blocks": 4, "reason": "closed"}
        assert closed_with(ws) == 1000
    assert [h["prompt"] for h, _ in blocks] == [PROMPT, NEW, NEW, NEW]
    assert all(np.array_equal(frames, ref) for (_, frames), ref in zip(blocks, reference(catalogs, 4, switch_at=1)))
    assert model_free(client, catalogs)


def drain(ws) -> tuple[list, list]:
    """Every message up to the stream's end: (blocks as `next_block` gives them, the other JSON messages)."""
    blocks, others = [], []
    while True:
        message = ws.receive_json()
        if message.get("object") == "video.block":
            t, h, w = message["num_frames"], message["height"], message["width"]
            frames = [np.frombuffer(ws.receive_bytes(), np.uint8) for _ in range(t)]
            blocks.append((message, np.stack(frames).reshape(t, h, w, 3)))
            continue
        others.append(message)
        if message.get("object") == "video.stream.done":
            return blocks, others


def test_a_bad_prompt_mid_stream_is_one_json_error_and_the_stream_runs_on(client, hold):
    hold[1] = threading.Event()
    bad = [({"prompt": "  "}, "type a prompt"), ({"prompt": 3}, "prompt: Input should be a valid string"),
           ({"colour": "red"}, "unknown field 'colour'"), ({}, 'send {"prompt": "..."}'), ("[", "not valid JSON")]
    with client.websocket_connect(ROUTE) as ws:
        start(ws, max_blocks=3)
        next_block(ws)
        for message, _ in bad:
            ws.send_text(message if isinstance(message, str) else json.dumps(message))
        errors = [ws.receive_json()["error"] for _ in bad]  # block 1 waits meanwhile
        hold[1].set()
        blocks, others = drain(ws)
    assert all(set(e) == {"message", "type", "param", "code"} for e in errors)
    assert all(words in e["message"] and "\n" not in e["message"] for e, (_, words) in zip(errors, bad)), errors
    assert [h["prompt"] for h, _ in blocks] == [PROMPT, PROMPT] and others == [
        {"object": "video.stream.done", "blocks": 3, "reason": "max_blocks"}]


BAD_FIRST = [
    ("not json", "the message is not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    (json.dumps({"model": MODEL}), "prompt is required"),
    (json.dumps({"prompt": PROMPT, "frames": 9}), "unknown field 'frames'"),
    (json.dumps({"prompt": PROMPT, "seed": "1"}), "seed"),
    (json.dumps({"prompt": "  "}), "type a prompt"),
    (json.dumps({"prompt": "a\x00b"}), "prompt"),
    (json.dumps({"prompt": PROMPT, "model": "nope"}), "model 'nope' does not exist here"),
    (json.dumps({"prompt": PROMPT, "cache_policy": "global"}), "a stream needs a rolling cache"),
    (json.dumps({"prompt": PROMPT, "cache_policy": "sink:2,window:40"}), "overflow the model's rotary table"),
    (json.dumps({"prompt": PROMPT, "max_blocks": 9}), r"max_blocks must be an integer in [1, 8], got 9"),
    (json.dumps({"prompt": PROMPT, "decoding": "lantern"}), "unknown method 'lantern'"),
    (b"binary", "send JSON text messages"),
]


@pytest.mark.parametrize("first, words", BAD_FIRST, ids=[w for _, w in BAD_FIRST])
def test_a_bad_first_message_is_one_json_error_then_the_close_before_any_work(client, catalogs, first, words):
    with client.websocket_connect(ROUTE) as ws:
        ws.send_bytes(first) if isinstance(first, bytes) else ws.send_text(first)
        body = ws.receive_json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert words in body["error"]["message"] and "\n" not in body["error"]["message"]
        assert closed_with(ws) == 1008
    assert model_free(client, catalogs, within=0)  # nothing was taken


def test_the_api_key_is_required_and_the_queue_bounds_streams(catalogs):
    with client_of(catalogs, api_key=KEY, max_queue=0) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(WebSocketDenialResponse) as denied, client.websocket_connect(ROUTE, headers=headers):
                pass
            assert denied.value.status_code == 401 and denied.value.json()["error"]["code"] == "invalid_api_key"
        key = {"Authorization": f"Bearer {KEY}"}
        with client.websocket_connect(ROUTE, headers=key) as ws:
            start(ws)
            next_block(ws)
            with client.websocket_connect(ROUTE, headers=key) as second:  # the model is taken and no one may wait
                second.send_text(json.dumps({"prompt": PROMPT}))
                error = second.receive_json()["error"]
                assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
                assert closed_with(second) == 1013


def test_a_client_that_leaves_mid_stream_frees_the_model_for_the_next_request(catalogs):
    with client_of(catalogs) as client, client.websocket_connect(ROUTE) as ws:  # a stream of up to 1000 blocks
        start(ws)
        next_block(ws)
        job = client.post("/v1/videos", json={"model": MODEL, "prompt": PROMPT, "num_frames": 5, "seed": 1}).json()
        time.sleep(0.3)  # the job waits for the model the stream holds
        assert client.get(f"/v1/videos/{job['id']}").json()["status"] == "queued"
        next_block(ws)
        ws.close()  # the client leaves without a word: its stream ends at its block, and the job runs
        deadline = time.monotonic() + 30
        while client.get(f"/v1/videos/{job['id']}").json()["status"] != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get(f"/v1/videos/{job['id']}").json()["status"] == "completed"
        assert model_free(client, catalogs)


def test_a_stream_ends_at_the_servers_time_limit(catalogs):
    with client_of(catalogs, max_stream_seconds=0.0) as client, client.websocket_connect(ROUTE) as ws:
        start(ws)
        assert ws.receive_json() == {"object": "video.stream.done", "blocks": 0, "reason": "max_seconds"}
        assert closed_with(ws) == 1000


def test_serve_takes_the_stream_limits_from_its_command_line():
    from mmgen.apps import serve_cli
    from mmgen.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-stream-blocks", "20", "--max-stream-seconds", "30"])
    settings = serve_cli.settings_of(args)
    assert (settings.max_stream_blocks, settings.max_stream_seconds) == (20, 30.0)
    for bad in (["--max-stream-blocks", "0"], ["--max-stream-blocks", "10001"], ["--max-stream-seconds", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])


def test_a_realtime_stream_keeps_one_block_ahead_of_its_player(client):
    """At 8 fps, block 0 (5 frames) plays for 0.625 s: block 2 is made once block 1 starts
    playing, 0.625 s after block 0 went out, and block 1 at once."""
    with client.websocket_connect(ROUTE) as ws:
        assert start(ws, max_blocks=3, realtime=True)["realtime"] is True
        (first, _), (second, _), (third, _) = [next_block(ws) for _ in range(3)]
        assert ws.receive_json()["reason"] == "max_blocks"
    assert second["seconds"] - first["seconds"] < 0.5 and third["seconds"] - first["seconds"] >= 0.6


def test_a_queued_stream_takes_prompts_and_a_close_and_starts_when_the_model_is_free(client, catalogs, hold):
    hold[1] = threading.Event()
    with client.websocket_connect(ROUTE) as first, client.websocket_connect(ROUTE) as second, \
            client.websocket_connect(ROUTE) as third:
        start(first)
        next_block(first)  # the first stream holds the model, waiting before its block 1
        second.send_text(json.dumps({"model": MODEL, "prompt": PROMPT, "seed": 3, "cache_policy": POLICY, "max_blocks": 1}))
        second.send_text(json.dumps({"prompt": NEW}))  # queued: its first block will follow this one
        assert second.receive_json() == {"object": "video.prompt", "prompt": NEW}
        third.send_text(json.dumps({"prompt": PROMPT}))
        third.send_text(json.dumps({"close": True}))  # leaves the queue
        assert third.receive_json() == {"object": "video.stream.done", "blocks": 0, "reason": "closed"}
        first.send_text(json.dumps({"close": True}))
        hold[1].set()
        assert drain(first)[1][-1] == {"object": "video.stream.done", "blocks": 1, "reason": "closed"}
        assert second.receive_json()["object"] == "video.stream"
        header, frames = next_block(second)
        assert header["prompt"] == NEW and second.receive_json()["reason"] == "max_blocks"
    assert np.array_equal(frames, reference(catalogs, 1, switch_at=0)[0])
    assert model_free(client, catalogs)


def test_the_route_under_uvicorn_with_a_websocket_client(catalogs):
    """As `mmgen serve` runs it (uvicorn, its connection bounds): the key is checked at the
    handshake (401, the JSON error), frames arrive as binary messages, and a message over
    64 KiB closes the socket (1009)."""
    websockets = pytest.importorskip("websockets")
    from websockets.sync.client import connect

    from tests.apps.test_server import running

    app = create_app(catalogs, ServerSettings(api_key=KEY, max_frames=13))
    with running(app) as base:
        url, key = base.replace("http://", "ws://") + ROUTE, {"Authorization": f"Bearer {KEY}"}
        with pytest.raises(websockets.exceptions.InvalidStatus) as denied:
            connect(url).close()
        assert denied.value.response.status_code == 401
        assert json.loads(bytes(denied.value.response.body))["error"]["code"] == "invalid_api_key"
        with connect(url, additional_headers=key) as ws:
            ws.send(json.dumps({"model": MODEL, "prompt": PROMPT, "seed": 3, "cache_policy": POLICY, "max_blocks": 1}))
            assert json.loads(ws.recv())["object"] == "video.stream"
            header = json.loads(ws.recv())
            frames = [ws.recv() for _ in range(header["num_frames"])]
            assert all(isinstance(f, bytes) and len(f) == 32 * 32 * 3 for f in frames) and len(frames) == 5
            assert json.loads(ws.recv())["reason"] == "max_blocks"
        with connect(url, additional_headers=key) as ws:
            ws.send(json.dumps({"prompt": "x" * (64 * 1024)}))
            with pytest.raises(websockets.exceptions.ConnectionClosedError):
                ws.recv()
            assert ws.close_code == 1009
