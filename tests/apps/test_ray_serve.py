"""`mmgen serve --ray` (apps/ray_serve.py): the command itself, run as a subprocess, starts a local
Ray bound to 127.0.0.1 with two CPU replicas of the server over the bundled emoji64, behind Ray
Serve's HTTP proxy. A seeded image from either replica must be the offline pipeline's for that
seed, bad input must get the very JSON error a single `mmgen serve` app gives, both replicas must
answer, and SIGTERM must stop Serve and Ray with every process they started. Needs the optional
extra (`pip install 'mmgen[ray]'`); without it only the command's refusal is tested.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from mmgen import cli
from mmgen.apps import ray_serve, serve_cli  # noqa: F401  (ray_serve before ray: it keeps a local Ray on 127.0.0.1)
from mmgen.apps.server import create_app, discover_catalogs, preload
from mmgen.sampling import make_generator

KEY = "test-key"
MODEL = "emoji64"
SEED = 7
READY = "ready behind Ray Serve"
START_S = 240  # two replicas loading their models on a busy 2-core machine take some 30 s
#: `mmgen serve`'s arguments, for the Ray replicas and for the single app their errors are compared with.
ARGS = ["serve", "--model", MODEL, "--model", "emoji-motion", "--max-frames", "9", "--continuous-batch", "image=4",
        "--max-body-mb", "1", "--api-key", KEY]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    """`mmgen serve --ray --replicas 2` as a subprocess (not yet ready); stopped with SIGTERM at the
    end, which must leave none of the processes it started behind."""
    pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'mmgen[ray]'")
    psutil = pytest.importorskip("psutil")
    folder = tmp_path_factory.mktemp("ray")
    port = free_port()
    log = open(folder / "serve.log", "w+")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "mmgen.cli", *ARGS, "--ray", "--replicas", "2", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder)
    started = time.monotonic()
    yield {"process": process, "port": port, "log": log, "started": started}
    family = psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=60)
    finally:
        _, left = psutil.wait_procs(family, timeout=30)
        for leftover in left:  # never leave a Ray process running, even when the test fails
            leftover.kill()
        log.close()
    assert code == 0, tail(folder / "serve.log")
    assert not left, f"processes left after SIGTERM: {[p.pid for p in left]}"


def tail(path, lines: int = 40) -> str:
    return "\n".join(open(path).read().splitlines()[-lines:])


@pytest.fixture(scope="module")
def catalogs(command):
    """emoji64 loaded here too (while the replicas load theirs), for the offline images and the single app."""
    catalogs = discover_catalogs([MODEL], continuous_batch={"image": 4})
    preload(catalogs)
    return catalogs


@pytest.fixture(scope="module")
def url(command, catalogs):
    """The proxy's base URL once the command says every replica is ready."""
    process, log = command["process"], command["log"]
    while True:
        log.seek(0)
        text = log.read()
        if READY in text:
            break
        assert process.poll() is None, f"mmgen serve --ray exited with {process.returncode}:\n{text[-4000:]}"
        assert time.monotonic() - command["started"] < START_S, f"not ready after {START_S} s:\n{text[-4000:]}"
        time.sleep(0.2)
    print(f"\nmmgen serve --ray: 2 replicas ready in {time.monotonic() - command['started']:.1f} s")
    return f"http://127.0.0.1:{command['port']}"


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as session:
        yield session


@pytest.fixture(scope="module")
def single(catalogs):
    """The single-process `mmgen serve` app with the same settings, in this process."""
    from fastapi.testclient import TestClient

    settings = serve_cli.settings_of(cli.build_parser().parse_args(ARGS))
    with TestClient(create_app(catalogs, settings), headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


# --- without Ray ------------------------------------------------------------------------------


def test_ray_without_ray_installed_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where the extra is missing
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert cli.main([*ARGS, "--ray"]) == 2
    assert capsys.readouterr().err == "mmgen: error: mmgen serve --ray needs Ray Serve: pip install 'mmgen[ray]'\n"


def test_replicas_without_ray_is_refused_in_one_line(capsys):
    assert cli.main([*ARGS, "--replicas", "2"]) == 2
    assert capsys.readouterr().err == "mmgen: error: --replicas runs copies of the server under Ray Serve: add --ray\n"


def test_a_taken_port_is_refused_in_one_line_before_ray_starts(capsys):
    pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra: pip install 'mmgen[ray]'")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main([*ARGS, "--ray", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmgen: error: cannot listen on 127.0.0.1:{port}: ") and err.count("\n") == 1


# --- on Ray -----------------------------------------------------------------------------------


def image_of(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert len(data) == 1
    return Image.open(io.BytesIO(base64.b64decode(data[0]["b64_json"]))).convert("RGB").tobytes()


def test_each_replica_gives_the_offline_pipelines_image_for_a_seed(http, catalogs):
    pipe = catalogs["image"].pipeline(MODEL)
    alone = pipe([pipe.class_index("face-smiling")], decoding="ar", generator=make_generator(SEED)).images[0]
    body = {"model": MODEL, "prompt": "face-smiling", "response_format": "b64_json", "seed": SEED, "decoding": "ar"}
    answered: set[str] = set()
    with ThreadPoolExecutor(2) as pool:  # two at once: Serve sends the second to the less busy replica
        for _ in range(10):
            for response in pool.map(lambda _: http.post("/v1/images/generations", json=body), range(2)):
                assert image_of(response) == alone.convert("RGB").tobytes()
                answered.add(response.headers[ray_serve.REPLICA_HEADER])
            if len(answered) == 2:
                break
    assert len(answered) == 2, f"only replica {answered} answered"


def test_a_video_job_answers_on_every_replica(http):
    """A job runs on the replica that took its POST; its status and MP4 answer on both (the
    replicas share a job board), the same on each."""
    job = http.post("/v1/videos", json={"model": "emoji-motion", "prompt": "a smiling face", "num_frames": 5, "seed": 1})
    assert job.status_code == 200, job.text
    job_id, seen, deadline = job.json()["id"], {}, time.monotonic() + 180
    with ThreadPoolExecutor(2) as pool:  # two at once: Serve spreads them over the replicas
        while time.monotonic() < deadline:
            for response in pool.map(lambda _: http.get(f"/v1/videos/{job_id}"), range(2)):
                assert response.status_code == 200, response.text
                seen[response.headers[ray_serve.REPLICA_HEADER]] = response.json()["status"]
            if len(seen) == 2 and set(seen.values()) == {"completed"}:
                break
            time.sleep(0.2)
    assert len(seen) == 2 and set(seen.values()) == {"completed"}, seen
    contents = {}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(10):
            for response in pool.map(lambda _: http.get(f"/v1/videos/{job_id}/content"), range(2)):
                assert response.status_code == 200 and response.content[4:8] == b"ftyp"
                contents[response.headers[ray_serve.REPLICA_HEADER]] = response.content
            if len(contents) == 2:
                break
    assert len(contents) == 2 and len(set(contents.values())) == 1


@pytest.mark.parametrize("method, path, body, headers", [
    ("POST", "/v1/images/generations", {"prompt": "face-smiling", "qualty": "hd"}, {}),
    ("POST", "/v1/images/generations", {"prompt": "face-smiling", "n": "2"}, {}),
    ("POST", "/v1/images/generations", {"prompt": "no-such-class"}, {}),
    ("POST", "/v1/images/generations", b'{"prompt": "face-', {"Content-Type": "application/json"}),
    ("POST", "/v1/images/generations", b"x" * (1024 * 1024 + 1), {"Content-Type": "application/json"}),
    ("POST", "/v1/images/generations", {"prompt": "face-smiling"}, {"Authorization": "Bearer wrong"}),
    ("GET", "/v1/nothing", None, {}),
    ("GET", "/v1/images/generations", None, {}),
])
def test_bad_input_gets_the_single_servers_one_json_error(http, single, method, path, body, headers):
    kwargs = {"json": body} if isinstance(body, (dict, list)) else {"content": body}
    on_ray = http.request(method, path, headers=headers, **kwargs)
    alone = single.request(method, path, headers=headers, **kwargs)
    assert 400 <= alone.status_code < 500
    assert (on_ray.status_code, on_ray.json()) == (alone.status_code, alone.json())
    assert set(on_ray.json()) == {"error"} and "Traceback" not in on_ray.text
    assert ray_serve.REPLICA_HEADER in on_ray.headers  # answered by the app in a replica, not by Ray's proxy


def test_ray_listens_on_the_loopback_address(url, command):
    psutil = pytest.importorskip("psutil")
    family = [psutil.Process(command["process"].pid), *psutil.Process(command["process"].pid).children(recursive=True)]
    listening = []
    for process in family:
        try:
            sockets = process.net_connections(kind="tcp")
            name = " ".join(process.cmdline()[:1])
        except psutil.NoSuchProcess:
            continue
        listening += [(name, s.laddr.ip, s.laddr.port) for s in sockets if s.status == psutil.CONN_LISTEN]
    assert ("127.0.0.1", command["port"]) in {(ip, port) for _, ip, port in listening}
    # Ray Serve 2.60's replicas also open a server for calls between deployments on every
    # interface (guarded by Ray's cluster token); everything else stays on 127.0.0.1.
    outside = [(name, ip, port) for name, ip, port in listening
               if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1") and not name.startswith("ray::ServeReplica")]
    assert not outside, outside
