"""Load and faults for `mmgen serve`: a bounded asyncio load generator against a server on
127.0.0.1 that this script starts itself (`python -m mmgen.cli serve`, a free port, ready at
`/health`), one modality's bundled model at a time.

What a request's first output is, per modality (the client's clock, from the request's send):

    speech  speech-tts, streamed POST /v1/audio/speech (wav): the first audio bytes past the 44-byte header
    text    emoji-vlm, streamed POST /v1/chat/completions (SSE, a data: URL image of the held-out
            set): the first event with answer text
    image   emoji64, POST /v1/images/generations (b64_json): the whole response
    video   emoji-motion, POST /v1/videos and polling GET /v1/videos/{id} (0.1 s while it runs, so
            first output is known to 0.1 s): the first committed block, or completion

Per concurrency level (closed loop: that many clients, each sending its next request when its
last one ends, `--requests` in all, at least one per client): p50 / p95 time to first output and
total latency, requests and output units per second (audio seconds, answer tokens, images,
video frames), errors by kind, lost responses (a 200 whose answer never completed, or a video
job that vanished) and duplicated ones (a response that names another request's seed, a
response id seen twice, a stream that ends twice). Every (input, seed) pair is asked at least
twice per level, so each answer is checked against the most common answer to its pair from the
same server over the whole run (`mismatched`): same seed, same bytes, whatever the batch around
it. Across servers, `keys_differing_from_alone` counts the answers that differ from the
one-at-a-time server's: none for fixed windows and `ar`; sampled answers of the adaptive window
differ by design (a batch's rows judge widths at the batch's cost, `AdaptiveWindow.batch_rows`).

Three servers are compared:

    continuous  `--continuous-batch MODALITY=ROWS` (default rows): requests of the model share
                its continuous batch, up to ROWS at once; the others wait in the server's queue
    alone       `--continuous-batch MODALITY=0`: the server admits one request of the model at a
                time (one slot); the others wait in its queue
    static      not a server mode: `mmgen serve` has no static batching, only the continuous
                batch that refills a row as soon as it frees. It is emulated in the client: the
                requests wait at a gate that lets in at most ROWS at a time, and only once the
                whole previous batch has ended (after a 20 ms window to gather it), against the
                continuous server, whose batch then never refills mid-batch. Unlike a true
                static batch, each row is prefilled alone as it joins and a finished row stops
                costing forwards, so the emulation flatters static batching's cost per forward;
                its waiting (a batch lasts as long as its longest request) is what it shows.

A video model makes one video at a time (`mmgen.apps.serve_cli.BATCHED` has no video), so video
runs `alone` only. Whether a request shares the batch also depends on its decoding method:
fixed-window methods of the speculative loop do (speech-tts's default `ar`); two-model methods
such as emoji-vlm's default `draft` decode alone under the model's lock (`--decoding ar` to
batch them).

`--faults` (all, or a comma list) runs against the first server of the run:

    vanish  clients close the connection after their first output (streamed modalities); first
            alone (how long until `/metrics`' `mmgen_rows_running` is back at 0), then beside
            clients that read to the end (they must all succeed, with the right answers), then
            one more request
    slow    clients that read one 4 KiB chunk (speech) or one event (text) per second, beside
            clients that read at full speed
    kill    SIGKILL of the server while the clients run (after the first output), then a
            restart on the same port: every client call ends with an error (each has a
            timeout), not a hang; then the restarted server's answers must match the ones from
            before (it writes nothing to disk; a video job from before is gone: 404)

    python -m benchmarks.serve_load --modality speech --concurrency 1,4,16 --requests 16 --threads 1 \\
        --out results.json [--faults]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import io
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WAV_HEADER = 44
SLOW_CHUNK = 4096  # bytes a slow speech reader takes per second
STATIC_WINDOW_S = 0.02  # the static gate gathers a batch this long once the previous one ended
FAULTS = ("vanish", "slow", "kill")
CONFIGS = ("continuous", "alone", "static")


class HttpError(Exception):
    """A response with a status other than 200, and the start of its body (for a failure's report)."""

    def __init__(self, status: int, body: str = ""):
        super().__init__(f"http {status}")
        self.status, self.body = status, body[:500]


class StreamError(Exception):
    """An error event inside a stream that had begun."""


@dataclass
class Outcome:
    """One request as its client saw it."""

    index: int
    key: int
    mode: str = "normal"  # normal, vanish or slow
    error: Optional[str] = None
    first_s: Optional[float] = None
    total_s: Optional[float] = None
    units: float = 0.0
    digest: Optional[str] = None
    answer_id: Optional[str] = None
    complete: bool = False  # the answer arrived whole
    ends: int = 0  # how many times the answer said it ended (one, unless it came twice)
    foreign: bool = False  # the answer names another request's seed
    started: float = 0.0  # perf_counter at send (before a static gate)
    ended: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None and self.complete

    @property
    def lost(self) -> bool:
        return self.error is None and not self.complete and self.mode == "normal"


# --------------------------------------------------------------------------------------------
# What each modality's clients send and read
# --------------------------------------------------------------------------------------------


class Target:
    """A modality's bundled model, its route, a request body per key and how an answer is read."""

    modality = ""
    model = ""
    unit = ""
    streamed = False

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def seed(self, key: int) -> int:
        return 1000 + key

    def body(self, key: int) -> dict:
        raise NotImplementedError

    async def call(self, client: httpx.AsyncClient, key: int, out: Outcome, start: float) -> None:
        raise NotImplementedError

    def extra(self) -> dict:
        return {} if self.args.decoding is None else {"decoding": self.args.decoding}


class SpeechTarget(Target):
    modality, model, unit, streamed = "speech", "speech-tts", "audio s", True

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        from mmgen.audio.heldout import held_out_texts

        self.texts = held_out_texts(64)

    def body(self, key: int) -> dict:
        return {"model": self.model, "input": self.texts[key % len(self.texts)], "seed": self.seed(key),
                "max_new_frames": self.args.max_new_frames, "response_format": "wav", **self.extra()}

    async def call(self, client: httpx.AsyncClient, key: int, out: Outcome, start: float,
                   request: Optional[dict] = None) -> None:
        """`request` replaces the key's request body (the same seed: the soak's sampling settings)."""
        async with client.stream("POST", "/v1/audio/speech", json=request or self.body(key)) as response:
            if response.status_code != 200:
                await response.aread()
                raise HttpError(response.status_code, response.text)
            out.foreign = response.headers.get("x-seed") != str(self.seed(key))
            rate = int(response.headers.get("x-sample-rate", "0") or 0)
            body = bytearray()
            pieces = response.aiter_raw(SLOW_CHUNK) if out.mode == "slow" else response.aiter_raw()
            async for piece in pieces:
                body += piece
                if out.first_s is None and len(body) > WAV_HEADER:
                    out.first_s = time.perf_counter() - start
                    if out.mode == "vanish":
                        return  # leaving the block closes the connection mid-stream
                if out.mode == "slow":
                    await asyncio.sleep(1.0)
        out.ends = 1
        out.complete = len(body) > WAV_HEADER and body[:4] == b"RIFF"
        out.units = (len(body) - WAV_HEADER) / 2 / rate if rate else 0.0
        out.digest = hashlib.sha256(bytes(body[WAV_HEADER:])).hexdigest()


class VLMTarget(Target):
    modality, model, unit, streamed = "text", "emoji-vlm", "token", True

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        import mmgen.vlm
        from PIL import Image

        from mmgen.vlm.heldout import load_eval

        records, pixels = load_eval(Path(mmgen.vlm.__file__).parent / "assets")
        self.records = records[:64]
        self.urls = {}
        for record in self.records:
            if record["index"] not in self.urls:
                buffer = io.BytesIO()
                Image.fromarray(pixels[record["index"]]).save(buffer, format="PNG")
                self.urls[record["index"]] = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    def body(self, key: int) -> dict:
        record = self.records[key % len(self.records)]
        content = [{"type": "image_url", "image_url": {"url": self.urls[record["index"]]}},
                   {"type": "text", "text": record["question"]}]
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "seed": self.seed(key),
                "max_tokens": self.args.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                **self.extra()}

    async def call(self, client: httpx.AsyncClient, key: int, out: Outcome, start: float,
                   request: Optional[dict] = None) -> None:
        """`request` replaces the key's request body (the same seed: the soak's sampling settings)."""
        text, ids, finishes = [], set(), 0
        async with client.stream("POST", "/v1/chat/completions", json=request or self.body(key)) as response:
            if response.status_code != 200:
                await response.aread()
                raise HttpError(response.status_code, response.text)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    out.ends += 1
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise StreamError(str(event["error"].get("message")))
                ids.add(event["id"])
                for choice in event.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        text.append(piece)
                        if out.first_s is None:
                            out.first_s = time.perf_counter() - start
                            if out.mode == "vanish":
                                return
                    finishes += choice.get("finish_reason") is not None
                if event.get("usage"):
                    out.units = float(event["usage"]["completion_tokens"])
                if out.mode == "slow":
                    await asyncio.sleep(1.0)
        out.ends += max(0, finishes - 1)  # a second finish is a second answer
        out.answer_id = ",".join(sorted(ids))
        out.foreign = len(ids) > 1
        out.complete = out.ends >= 1 and finishes >= 1
        out.digest = hashlib.sha256("".join(text).encode()).hexdigest()


class ImageTarget(Target):
    modality, model, unit = "image", "emoji64", "image"

    def body(self, key: int) -> dict:
        return {"model": self.model, "class_label": key % 16, "n": 1, "seed": self.seed(key),
                "response_format": "b64_json", **self.extra()}

    async def call(self, client: httpx.AsyncClient, key: int, out: Outcome, start: float) -> None:
        response = await client.post("/v1/images/generations", json=self.body(key))
        if response.status_code != 200:
            raise HttpError(response.status_code, response.text)
        out.first_s = time.perf_counter() - start
        answer = response.json()
        out.ends, out.foreign = 1, answer.get("seed") != self.seed(key)
        images = [base64.b64decode(d["b64_json"]) for d in answer.get("data", [])]
        out.complete, out.units = len(images) == 1, float(len(images))
        out.digest = hashlib.sha256(b"".join(images)).hexdigest()


class VideoTarget(Target):
    modality, model, unit = "video", "emoji-motion", "frame"

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        from mmgen.video.data import DEFAULT_SPRITES, MOTIONS, caption

        self.prompts = [caption([DEFAULT_SPRITES[k % len(DEFAULT_SPRITES)]], [MOTIONS[k % len(MOTIONS)]]) for k in range(48)]
        self.jobs: list[str] = []  # every job id made, for the check after a restart

    def body(self, key: int) -> dict:
        return {"model": self.model, "prompt": self.prompts[key % len(self.prompts)], "seed": self.seed(key),
                "num_frames": self.args.video_frames, **self.extra()}

    async def call(self, client: httpx.AsyncClient, key: int, out: Outcome, start: float) -> None:
        response = await client.post("/v1/videos", json=self.body(key))
        if response.status_code != 200:
            raise HttpError(response.status_code, response.text)
        job = response.json()
        out.answer_id, out.foreign = job["id"], job.get("seed") != self.seed(key)
        self.jobs.append(job["id"])
        while job["status"] in ("queued", "in_progress"):
            if out.first_s is None and job.get("blocks_done", 0) > 0:
                out.first_s = time.perf_counter() - start
            await asyncio.sleep(0.1 if job["status"] == "in_progress" else 0.5)
            polled = await client.get(f"/v1/videos/{job['id']}")
            if polled.status_code == 404:
                return  # the job vanished: lost
            if polled.status_code != 200:
                raise HttpError(polled.status_code, polled.text)
            job = polled.json()
        if job["status"] != "completed":
            raise StreamError(f"job {job['status']}: {(job.get('error') or {}).get('code')}")
        if out.first_s is None:
            out.first_s = time.perf_counter() - start
        content = await client.get(f"/v1/videos/{job['id']}/content")
        if content.status_code != 200:
            raise HttpError(content.status_code, content.text)
        out.ends, out.complete = 1, content.content[4:8] == b"ftyp"
        out.units = float(job["num_frames"])
        out.digest = hashlib.sha256(content.content).hexdigest()


TARGETS: dict[str, type[Target]] = {"speech": SpeechTarget, "text": VLMTarget, "image": ImageTarget, "video": VideoTarget}


# --------------------------------------------------------------------------------------------
# The server, in a subprocess
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`python -m mmgen.cli serve` for the targets' models on 127.0.0.1 (never another address),
    its torch threads set through OMP_NUM_THREADS / MKL_NUM_THREADS, its log in a file; started,
    SIGKILLed and restarted on the same port."""

    def __init__(self, targets: Sequence[Target], rows: Optional[int], threads: int, max_queue: int, log: Path,
                 port: int = 0, start_timeout: float = 600.0):
        from mmgen.apps.serve_cli import BATCHED

        self.port = port or free_port()
        self.log, self.start_timeout = log, start_timeout
        self.command = [sys.executable, "-m", "mmgen.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                        "--max-queue", str(max_queue), "--log-level", "warning"]
        for target in targets:
            self.command += ["--model", target.model]
            if target.modality in BATCHED and rows is not None:
                self.command += ["--continuous-batch", f"{target.modality}={rows}"]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.env.pop("MMGEN_API_KEY", None)
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start the server and wait for /health; returns the seconds it took."""
        begun = time.perf_counter()
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        while time.perf_counter() - begun < self.start_timeout:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the server exited with {self.process.returncode} before it was ready:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - begun
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server was not ready within {self.start_timeout:g} s (log: {self.log})")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no cleanup; the kernel closes its sockets."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


async def rows_running(client: httpx.AsyncClient, modality: str) -> Optional[float]:
    """The server's `mmgen_rows_running` for the modality (None when /metrics cannot be read)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return None
    found = re.search(rf'^mmgen_rows_running\{{modality="{modality}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


async def settle_rows(client: httpx.AsyncClient, modality: str, timeout: float = 30.0) -> tuple[Optional[float], float]:
    """Wait for the modality's running rows to reach 0: (the last value read, seconds waited)."""
    begun = time.perf_counter()
    value = await rows_running(client, modality)
    while value != 0 and time.perf_counter() - begun < timeout:
        await asyncio.sleep(0.05)
        value = await rows_running(client, modality)
    return value, time.perf_counter() - begun


# --------------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------------


class StaticGate:
    """A static-batching server, emulated in the client: waiting requests go in at most `size`
    at a time, and only once every request of the previous batch has ended."""

    def __init__(self, size: int):
        self.size, self.running = size, 0
        self.waiting: collections.deque = collections.deque()
        self.pending: Optional[asyncio.TimerHandle] = None

    async def enter(self) -> None:
        ticket = asyncio.get_running_loop().create_future()
        self.waiting.append(ticket)
        self._schedule()
        try:
            await ticket
        except asyncio.CancelledError:  # timed out at the gate: a place given at that moment is given back
            if ticket.done() and not ticket.cancelled():
                self.leave()
            raise

    def leave(self) -> None:
        self.running -= 1
        self._schedule()

    def _schedule(self) -> None:
        if self.running == 0 and self.waiting and self.pending is None:
            self.pending = asyncio.get_running_loop().call_later(STATIC_WINDOW_S, self._admit)

    def _admit(self) -> None:
        self.pending = None
        while self.waiting and self.running < self.size:
            ticket = self.waiting.popleft()
            if not ticket.done():
                ticket.set_result(None)
                self.running += 1


def error_kind(error: BaseException) -> str:
    if isinstance(error, HttpError):
        return f"http {error.status}"
    if isinstance(error, StreamError):
        return "error in stream"
    if isinstance(error, (asyncio.TimeoutError, httpx.TimeoutException)):
        return "timeout"
    if isinstance(error, httpx.ConnectError):
        return "connection refused"
    if isinstance(error, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError)):
        return "connection lost"
    return type(error).__name__


async def issue(target: Target, client: httpx.AsyncClient, index: int, key: int, timeout: float,
                mode: str = "normal", gate: Optional[StaticGate] = None, live: Optional[list] = None) -> Outcome:
    """One request, start to end, within `timeout` seconds; every failure becomes its `error`.
    `live` gets its outcome as it starts (to watch requests in flight)."""
    out = Outcome(index, key, mode, started=time.perf_counter())
    if live is not None:
        live.append(out)
    try:
        async with asyncio.timeout(timeout):
            if gate is not None:
                await gate.enter()
            try:
                await target.call(client, key, out, out.started)
            finally:
                if gate is not None:
                    gate.leave()
    except Exception as error:  # noqa: BLE001 - every failure is counted by kind, none is raised
        out.error = error_kind(error)
    out.ended = time.perf_counter()
    out.total_s = out.ended - out.started
    return out


def make_client(base: str, timeout: float, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(base_url=base, limits=limits,
                             timeout=httpx.Timeout(timeout, connect=10.0, write=30.0, pool=timeout))


def keys_for(count: int) -> list[int]:
    """Request i asks key i mod ceil(count / 2): each key at least twice, its copies apart in time."""
    distinct = max(1, math.ceil(count / 2))
    return [i % distinct for i in range(count)]


async def closed_loop(target: Target, client: httpx.AsyncClient, keys: Sequence[int], concurrency: int, timeout: float,
                      gate: Optional[StaticGate] = None, live: Optional[list] = None) -> list[Outcome]:
    """`concurrency` clients, each sending its next request as soon as its last one ended."""
    queue = collections.deque(enumerate(keys))
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while queue:
            index, key = queue.popleft()
            outcomes.append(await issue(target, client, index, key, timeout, gate=gate, live=live))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(outcomes, key=lambda o: o.index)


def rounded(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 4)


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    return round(float(np.percentile(values, q)), 4) if values else None


def summary(outcomes: Sequence[Outcome], wall_s: float, unit: str, issued: Optional[int] = None) -> dict:
    """A level's figures (mismatches are added once the whole run's answers are in)."""
    ok = [o for o in outcomes if o.ok]
    ids = collections.Counter(o.answer_id for o in outcomes if o.answer_id)
    errors = collections.Counter(o.error for o in outcomes if o.error)
    firsts = [o.first_s for o in ok if o.first_s is not None]
    totals = [o.total_s for o in ok]
    return {"requests": len(outcomes) if issued is None else issued, "ok": len(ok), "errors": dict(errors),
            "lost": sum(o.lost for o in outcomes) + (0 if issued is None else issued - len(outcomes)),
            "duplicated": sum(o.ends > 1 or o.foreign for o in outcomes) + sum(n - 1 for n in ids.values()),
            "first_output_s": {"p50": percentile(firsts, 50), "p95": percentile(firsts, 95)},
            "latency_s": {"p50": percentile(totals, 50), "p95": percentile(totals, 95)},
            "requests_per_s": round(len(ok) / wall_s, 4) if wall_s else None,
            "units_per_s": round(sum(o.units for o in ok) / wall_s, 4) if wall_s else None, "unit": unit,
            "wall_s": round(wall_s, 3)}


async def run_level(target: Target, base: str, concurrency: int, count: int, timeout: float,
                    static_size: Optional[int]) -> tuple[dict, list[Outcome]]:
    keys = keys_for(max(count, concurrency))
    gate = StaticGate(static_size) if static_size else None
    async with make_client(base, timeout, concurrency) as client:
        begun = time.perf_counter()
        outcomes = await closed_loop(target, client, keys, concurrency, timeout, gate)
        wall = time.perf_counter() - begun
        left, _ = await settle_rows(client, target.modality, 10.0)
    level = {"concurrency": concurrency, **summary(outcomes, wall, target.unit, len(keys)), "rows_running_after": left}
    return level, outcomes


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


#: A fault's report, and (figures, outcomes) groups whose answers are checked with the run's.
FaultResult = tuple[dict, list[tuple[dict, list[Outcome]]]]


async def vanish_fault(target: Target, base: str, clients: int, rows: int, timeout: float) -> FaultResult:
    if not target.streamed:
        return {"skipped": f"{target.modality} responses are not streamed: a client has nothing to leave mid-stream"}, []
    vanishing = max(1, min(clients, max(rows, 1)) // 2)
    readers = max(1, clients - vanishing)
    async with make_client(base, timeout, clients + 1) as client:
        alone = await asyncio.gather(*(issue(target, client, i, i, timeout, "vanish") for i in range(vanishing)))
        left_alone, freed_s = await settle_rows(client, target.modality)
        mixed = await asyncio.gather(*(issue(target, client, i, i, timeout, "vanish") for i in range(vanishing)),
                                     *(issue(target, client, vanishing + i, i, timeout) for i in range(readers)))
        left_mixed, _ = await settle_rows(client, target.modality)
        after = await issue(target, client, 0, 0, timeout)
    others = [o for o in mixed if o.mode == "normal"]
    report = {"vanishing_clients": vanishing, "reading_clients": readers,
              "vanished_after_first_output": sum(o.first_s is not None for o in (*alone, *mixed) if o.mode == "vanish"),
              "vanish_errors": dict(collections.Counter(o.error for o in (*alone, *mixed) if o.mode == "vanish" and o.error)),
              "rows_running_after_vanishing": left_alone, "rows_freed_s": round(freed_s, 3),
              "others": summary(others, max((o.total_s for o in others), default=0.0), target.unit),
              "rows_running_after": left_mixed, "next_request_ok": after.ok}
    return report, [(report["others"], [*others, after])]


async def slow_fault(target: Target, base: str, clients: int, timeout: float) -> FaultResult:
    if not target.streamed:
        return {"skipped": f"{target.modality} responses are not streamed: nothing to read slowly"}, []
    slow = max(1, min(2, clients // 2))
    readers = max(1, clients - slow)
    async with make_client(base, timeout, clients) as client:
        outcomes = await asyncio.gather(*(issue(target, client, i, i, timeout, "slow") for i in range(slow)),
                                        *(issue(target, client, slow + i, i, timeout) for i in range(readers)))
        left, _ = await settle_rows(client, target.modality)
    slowed = [o for o in outcomes if o.mode == "slow"]
    others = [o for o in outcomes if o.mode == "normal"]
    report = {"slow_clients": slow, "reading_clients": readers,
              "slow": summary(slowed, max((o.total_s for o in slowed), default=0.0), target.unit),
              "others": summary(others, max((o.total_s for o in others), default=0.0), target.unit),
              "rows_running_after": left}
    return report, [(report["slow"], slowed), (report["others"], others)]


async def kill_fault(target: Target, server: Server, clients: int, count: int, timeout: float,
                     kill_after: float = 0.3) -> FaultResult:
    keys = keys_for(max(count, 3 * clients))  # more than the clients: some are sent after the kill
    live: list[Outcome] = []
    async with make_client(server.url, timeout, clients) as client:
        loop = asyncio.create_task(closed_loop(target, client, keys, clients, timeout, live=live))
        # Killed once outputs flow: `kill_after` seconds after the first output of any request.
        begun = time.perf_counter()
        while not any(o.first_s is not None for o in live) and not loop.done() and time.perf_counter() - begun < timeout:
            await asyncio.sleep(0.01)
        await asyncio.sleep(kill_after)
        killed = time.perf_counter()
        server.kill()
        outcomes = await loop
    ended_after = [o.ended - killed for o in outcomes if o.ended >= killed]
    in_flight = [o for o in outcomes if o.started < killed <= o.ended]
    errors = collections.Counter(o.error for o in outcomes if o.error)
    restart_s = server.start()
    check_keys = keys_for(min(len(keys), max(2, clients)))
    async with make_client(server.url, timeout, clients) as client:
        begun = time.perf_counter()
        after = await closed_loop(target, client, check_keys, min(clients, 4), timeout)
        after_wall = time.perf_counter() - begun
        old_job = None
        if isinstance(target, VideoTarget) and target.jobs:
            old_job = (await client.get(f"/v1/videos/{target.jobs[0]}")).status_code
    report = {"clients": clients, "requests": len(keys), "ok_before_kill": sum(o.ok for o in outcomes),
              "in_flight_at_kill": len(in_flight), "errors": dict(errors),
              "hangs": errors.get("timeout", 0), "longest_after_kill_s": round(max(ended_after, default=0.0), 3),
              "unaccounted": len(keys) - len(outcomes), "restart_s": round(restart_s, 3),
              "after_restart": summary(after, after_wall, target.unit)}
    if old_job is not None:
        report["job_from_before_after_restart_status"] = old_job
    return report, [(report, [o for o in outcomes if o.ok]), (report["after_restart"], after)]


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def check_answers(runs: dict, fault_groups: list[tuple[dict, list[Outcome]]], fault_server: Optional[str] = None) -> dict:
    """Each answer against the most common answer to its key from the same server (the first one
    seen wins a tie; the fault runs belong to `fault_server`): `mismatched` in each level's and
    fault's figures, and per config how many keys' answers differ from the one-at-a-time
    server's. A server's answers must not depend on the requests around it; across servers a
    sampled answer may differ where the method depends on the server's rows (the adaptive
    window's rows judge widths at the batch's cost, `AdaptiveWindow.batch_rows`)."""
    servers = {name: list(config) for name, config in runs.items()}
    if fault_groups:
        servers.setdefault(fault_server or next(iter(servers), ""), []).extend(fault_groups)
    keys: set = set()
    answers_total = mismatched = 0
    for groups in servers.values():
        answers: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        for _, outs in groups:
            for o in outs:
                if o.ok:
                    answers[o.key][o.digest] += 1
        reference = {key: counts.most_common(1)[0][0] for key, counts in answers.items()}
        keys |= set(reference)
        answers_total += sum(sum(c.values()) for c in answers.values())
        for figures, outs in groups:
            figures["mismatched"] = sum(o.ok and o.digest != reference[o.key] for o in outs)
            mismatched += figures["mismatched"]
            figures["per_request"] = [{"index": o.index, "key": o.key, "first_s": rounded(o.first_s), "total_s": rounded(o.total_s),
                                       "error": o.error, "answer": o.digest and o.digest[:12],
                                       "matches": o.digest == reference.get(o.key) if o.ok else None} for o in outs]
    alone: dict[int, set] = collections.defaultdict(set)
    for _, outs in runs.get("alone", []):
        for o in outs:
            if o.ok:
                alone[o.key].add(o.digest)
    differs = {}
    for name, config in runs.items():
        if name != "alone" and alone:
            mine = {(o.key, o.digest) for _, outs in config for o in outs if o.ok}
            differs[name] = sum(1 for key, digest in mine if key in alone and digest not in alone[key])
    return {"keys": len(keys), "answers": answers_total, "mismatched": mismatched, "keys_differing_from_alone": differs}


def goals(report: dict) -> dict:
    """The issue's goals (stated for speech; computed for any modality): p95 time to first output
    at the highest concurrency within 2x a single request's, and requests per second there at
    least 2x the one-at-a-time server's."""
    levels = {name: {lv["concurrency"]: lv for lv in config.get("levels", [])} for name, config in report["configs"].items()}
    out: dict[str, Any] = {}
    batched = levels.get("continuous", {})
    if batched:
        top = max(batched)
        p95 = batched[top]["first_output_s"]["p95"]
        one = batched[1]["first_output_s"]["p50"] if 1 in batched and top > 1 else None
        if p95 is not None and one:
            out["first_output"] = {"concurrency": top, "p95_s": p95, "single_p50_s": one, "ratio": round(p95 / one, 3),
                                   "goal": "<= 2", "met": p95 <= 2 * one}
            # The same against a single request on the one-at-a-time server, which does not
            # compute a batch's idle rows: the stricter reading of "a single request's".
            alone_one = levels.get("alone", {}).get(1, {}).get("first_output_s", {}).get("p50")
            if alone_one:
                out["first_output"].update(alone_single_p50_s=alone_one, ratio_to_alone=round(p95 / alone_one, 3),
                                           met_against_alone=p95 <= 2 * alone_one)
        alone = levels.get("alone", {}).get(top)
        if alone and alone["requests_per_s"]:
            ratio = batched[top]["requests_per_s"] / alone["requests_per_s"]
            out["throughput"] = {"concurrency": top, "continuous_requests_per_s": batched[top]["requests_per_s"],
                                 "alone_requests_per_s": alone["requests_per_s"], "ratio": round(ratio, 3),
                                 "goal": ">= 2", "met": ratio >= 2}
    return out


def without_requests(figures: Any) -> Any:
    """Figures without their per-request lists (for printing)."""
    if isinstance(figures, dict):
        return {k: without_requests(v) for k, v in figures.items() if k != "per_request"}
    return figures


def table(report: dict) -> str:
    unit = TARGETS[report["modality"]].unit
    lines = [f"| server | clients | requests | ok | errors | lost | dup | mismatched | first output p50 / p95 (s) | "
             f"latency p50 / p95 (s) | requests/s | {unit}/s |", "|" + "---|" * 12]
    for name, config in report["configs"].items():
        if "skipped" in config:
            lines.append(f"| {name} | skipped: {config['skipped']} |" + " |" * 10)
            continue
        for lv in config["levels"]:
            errors = ", ".join(f"{k} {v}" for k, v in lv["errors"].items()) or "0"
            first, total = lv["first_output_s"], lv["latency_s"]
            lines.append(f"| {name} | {lv['concurrency']} | {lv['requests']} | {lv['ok']} | {errors} | {lv['lost']} | "
                         f"{lv['duplicated']} | {lv.get('mismatched', '')} | {first['p50']} / {first['p95']} | "
                         f"{total['p50']} / {total['p95']} | {lv['requests_per_s']} | {lv['units_per_s']} |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    def int_list(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
        return values

    def names(allowed: Sequence[str], flag: str) -> Callable[[str], list[str]]:
        def parse(text: str) -> list[str]:
            chosen = [v.strip() for v in text.split(",") if v.strip()]
            unknown = [v for v in chosen if v not in allowed]
            if unknown or not chosen:
                raise argparse.ArgumentTypeError(f"{flag} takes a comma list of {list(allowed)}, got {text!r}")
            return chosen

        return parse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modality", choices=list(TARGETS), default="speech")
    parser.add_argument("--concurrency", type=int_list, default=[1, 4, 16], help="client counts (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=16, help="requests per level, at least one per client (default 16)")
    parser.add_argument("--configs", type=names(CONFIGS, "--configs"), default=list(CONFIGS),
                        help="servers to compare, of continuous,alone,static (default all)")
    parser.add_argument("--rows", type=int, default=None,
                        help="the continuous batch's rows, and the static gate's batch size (default: mmgen serve's)")
    parser.add_argument("--decoding", default=None, help="the requests' decoding method (default: the server's for the model)")
    parser.add_argument("--max-new-frames", type=int, default=96, help="speech: frames per utterance, at most (default 96)")
    parser.add_argument("--max-tokens", type=int, default=16, help="text: answer tokens, at most (default 16)")
    parser.add_argument("--video-frames", type=int, default=5, help="video: frames per video (default 5: one block)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server process (default 1)")
    parser.add_argument("--max-queue", type=int, default=64, help="the server's --max-queue (default 64)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a client call may take, at most (default 300)")
    parser.add_argument("--faults", type=names(FAULTS, "--faults"), nargs="?", const=list(FAULTS), default=[],
                        help=f"run the faults too: all, or a comma list of {list(FAULTS)}")
    parser.add_argument("--out", default=None, help="write the report here as JSON")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.threads < 1 or args.timeout <= 0:
        parser.error("--requests and --threads must be at least 1 and --timeout positive")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    from mmgen.apps.serve_cli import BATCHED, DEFAULT_ROWS

    target = TARGETS[args.modality](args)
    rows = DEFAULT_ROWS if args.rows is None else args.rows
    report: dict[str, Any] = {
        "modality": target.modality, "model": target.model, "unit": target.unit,
        "settings": {"concurrency": args.concurrency, "requests": args.requests, "rows": rows, "decoding": args.decoding,
                     "max_new_frames": args.max_new_frames, "max_tokens": args.max_tokens,
                     "video_frames": args.video_frames, "server_threads": args.threads, "timeout_s": args.timeout,
                     "cpus": os.cpu_count()},
        "configs": {}, "faults": {}}
    runs: dict[str, list] = {}
    fault_groups: list[tuple[dict, list[Outcome]]] = []
    servers = {"continuous": rows, "alone": 0, "static": rows}
    with tempfile.TemporaryDirectory() as scratch:
        logs = Path(args.log_dir or scratch)
        logs.mkdir(parents=True, exist_ok=True)
        faults_to_run = list(args.faults)
        for name in args.configs:
            if target.modality not in BATCHED and name != "alone":
                report["configs"][name] = {"skipped": f"{target.modality} is not batched: a {target.modality} model makes "
                                                      "one request at a time, so every server runs requests alone"}
                continue
            if name == "static" and rows < 1:
                report["configs"][name] = {"skipped": "static batches need --rows of at least 1"}
                continue
            server = Server([target], servers[name], args.threads, args.max_queue, logs / f"{target.modality}-{name}.log")
            with server:
                asyncio.run(warm_up(target, server.url, args.timeout))
                config: dict[str, Any] = {"server": " ".join(server.command[1:]).replace(str(server.port), "PORT"),
                                          "clients": "closed loop" + (f", static gate of {rows}" if name == "static" else ""),
                                          "levels": []}
                runs[name] = []
                for concurrency in args.concurrency:
                    level, outcomes = asyncio.run(run_level(target, server.url, concurrency, args.requests, args.timeout,
                                                            rows if name == "static" else None))
                    config["levels"].append(level)
                    runs[name].append((level, outcomes))
                    print(f"{target.modality} {name} x{concurrency}: {level['ok']}/{level['requests']} ok, "
                          f"first output p95 {level['first_output_s']['p95']} s, {level['requests_per_s']} requests/s",
                          flush=True)
                report["configs"][name] = config
                if faults_to_run and name != "static":
                    report["faults"]["server"] = name
                    fault_groups += run_faults(target, server, faults_to_run, args, servers[name], report["faults"])
                    faults_to_run = []
    report["answers"] = check_answers(runs, fault_groups, report["faults"].get("server"))
    report["goals"] = goals(report)
    print(table(report))
    for name, figures in report["faults"].items():
        if isinstance(figures, dict):
            print(f"fault {name}: {json.dumps(without_requests(figures))}")
    if report["goals"]:
        print(f"goals: {json.dumps(report['goals'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


async def warm_up(target: Target, base: str, timeout: float) -> None:
    """One request before the levels (not counted): the first forwards of a process are slow."""
    async with make_client(base, timeout, 1) as client:
        await issue(target, client, -1, 0, timeout)


def run_faults(target: Target, server: Server, faults: Sequence[str], args: argparse.Namespace, rows: int,
               into: dict) -> list[tuple[dict, list[Outcome]]]:
    clients, groups = max(args.concurrency), []
    for fault in (f for f in FAULTS if f in faults):  # kill last: it restarts the server
        if fault == "vanish":
            into["vanish"], outs = asyncio.run(vanish_fault(target, server.url, clients, rows, args.timeout))
        elif fault == "slow":
            into["slow"], outs = asyncio.run(slow_fault(target, server.url, clients, args.timeout))
        else:
            into["kill"], outs = asyncio.run(kill_fault(target, server, clients, args.requests, args.timeout))
        groups += outs
        print(f"fault {fault}: done", flush=True)
    return groups


if __name__ == "__main__":
    main()
