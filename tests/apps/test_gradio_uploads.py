"""The demos' upload route (`apps/gradio_uploads.py`, through every demo's `launch_demo`): files
bounded in bytes, clients in uploads per minute, and a demo's uploads deleted when it stops and
when its process exits. A bare Blocks stands in for a demo: Gradio serves the route for any app."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

gr = pytest.importorskip("gradio")

from mmgen.apps.gradio_common import launch_demo  # noqa: E402
from mmgen.apps.gradio_uploads import UPLOADS_PER_MINUTE, UploadLimit, remove_uploads  # noqa: E402
from mmgen.apps.requests.bounds import LIMITS  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def upload(url: str, data: bytes, name: str = "voice.wav") -> httpx.Response:
    return httpx.post(f"{url}/gradio_api/upload", files={"files": (name, data)}, timeout=60)


@pytest.fixture
def demo_url():
    with gr.Blocks() as demo:
        gr.Markdown("a demo")
    port = free_port()
    launch_demo(demo, host="127.0.0.1", port=port, block=False)
    try:
        yield demo, f"http://127.0.0.1:{port}"
    finally:
        demo.close()
        remove_uploads(demo)


def test_uploads_are_bounded_per_file_and_per_client_minute_and_removed(demo_url):
    demo, url = demo_url
    assert upload(url, b"x" * (LIMITS.upload_bytes + 1)).status_code == 413  # refused before it reaches the disk
    paths = []
    for _ in range(UPLOADS_PER_MINUTE - 1):  # the refused one counted too
        response = upload(url, b"RIFF....")
        assert response.status_code == 200, response.text
        paths.extend(response.json())
    refused = upload(url, b"RIFF....")
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
    assert all(Path(p).is_file() for p in paths)
    remove_uploads(demo)  # what a stopping demo does
    assert not any(Path(p).exists() for p in paths)


def test_a_clients_minute_slides():
    now = [0.0]
    limit = UploadLimit(app=None, per_minute=2, clock=lambda: now[0])
    assert limit.admit("a") and limit.admit("a") and not limit.admit("a") and limit.admit("b")
    now[0] = 61.0
    assert limit.admit("a")


def test_a_demos_uploads_are_removed_when_its_process_exits(tmp_path):
    script = textwrap.dedent(f"""
        import httpx, gradio as gr
        from mmgen.apps.gradio_common import launch_demo
        with gr.Blocks() as demo:
            gr.Markdown("a demo")
        launch_demo(demo, host="127.0.0.1", port={free_port()}, block=False)
        url = demo.local_url.rstrip("/")
        response = httpx.post(url + "/gradio_api/upload", files={{"files": ("a.png", b"x" * 64)}}, timeout=60)
        print(response.json()[0])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.name == "a.png" and not path.exists()
