"""A soak of `mmgen serve`: minutes of mixed traffic against one server with the bundled model of
every modality, which this command starts itself on 127.0.0.1 (a free port; never another
address) with the clients of `benchmarks.serve_load`.

Before the clock starts, each of a few (input, seed) keys per modality is asked once, one request
at a time: those answers are the reference ("that request alone"). Then `--clients` closed-loop
clients draw their next action from a fixed mix (seeded) until `--minutes` have passed:

    image         POST /v1/images/generations (b64_json)
    chat          POST /v1/chat/completions, whole and streamed (SSE)
    speech        POST /v1/audio/speech, streamed WAV
    video         POST /v1/videos, then its GET /v1/videos/{id}/events (SSE) to the end, then the MP4
    models, metrics  GET /v1/models, GET /metrics
    bad           a bad request of one of `BAD_KINDS` (must be answered 4xx, never 5xx or 2xx)
    sampled       a chat or speech request with its own temperature (0.5 to 1.5, three decimals):
                  many sampling settings must not grow the server's state
    drop          a streamed chat, speech or video events client that closes after its first output
    trickle       an image request whose body arrives in pieces over about two seconds (raw socket)
    abandon       a chat request whose client closes while sending its body (nobody sees an answer:
                  the server's own count of 5xx responses in /metrics must stay 0)

while a poller asks GET /health every `--health-every` seconds and a sampler reads the server
process's VmRSS and Threads from /proc/PID/status every `--sample-every` seconds. Every answered
request of a reference key is compared with its reference: same seed, same bytes, whatever ran
beside it. The report: requests and p50 / p95 latency per route, errors by kind (status codes, or
the transport error), /health p99, the samples, each 5xx and unanswered request (route, request,
status, body) with the tracebacks of the server's log, and the goals:

    no_5xx          no response with a status of 500 or more, as the clients saw them and as the
                    server counted them (`mmgen_responses_total`)
    equal_to_alone  every answer of a reference key equals its reference
    flat            resident memory and threads after warm-up: the median of the samples of the last
                    `min(10 min, a third of the run)` within +-5% of the median of the window before
                    (or 2 threads, 64 MiB, whichever is more)
    health_p99      /health p99 below 100 ms

    nice -n 10 python -m benchmarks.soak --minutes 30 --out soak.json     # exit status 1 if a goal is missed
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx

from benchmarks.serve_load import (HttpError, ImageTarget, Outcome, Server, SpeechTarget, StreamError, Target,
                                   VideoTarget, VLMTarget, error_kind, make_client, percentile)

#: Relative weights of the clients' actions.
MIX = {"image": 3, "chat": 2, "chat_stream": 3, "speech": 3, "video": 1, "sampled": 2, "models": 2, "metrics": 2,
       "bad": 3, "drop": 2, "trickle": 2, "abandon": 1}
BAD_KINDS = ("malformed_json", "unknown_model", "wrong_type", "nan_temperature", "unknown_route", "unknown_video",
             "oversized_body")
#: Threads the level may move by whatever the tolerance says (a few pool workers come and go).
FLAT_THREADS = 2
#: Resident MiB the level may move by whatever the tolerance says: the allocator's arenas breathe
#: by about a hundred MiB within 20 s at 1.2 GB (a one-minute run read 1147-1252 MiB in its last
#: window), enough to move a short run's median past 5% with no leak; a leak keeps growing.
FLAT_RSS_MIB = 64.0
FLAT_TOLERANCE = 0.05
FLAT_WINDOW_S = 600.0  # the last 10 minutes, or the last third of a shorter run
HEALTH_P99_GOAL_S = 0.1
TRICKLE_PIECES, TRICKLE_GAP_S = 8, 0.25
ROUTE_OF = {"text": "POST /v1/chat/completions (stream)", "speech": "POST /v1/audio/speech (stream)"}


@dataclass
class Call:
    """One HTTP exchange as a client saw it."""

    route: str
    action: str
    status: Optional[int] = None  # None: no response (the error says why)
    error: Optional[str] = None
    latency_s: float = 0.0
    key: Optional[tuple] = None  # (modality, key) of a reference request
    digest: Optional[str] = None
    detail: str = ""  # the request and the response's body, for a failure's report


@dataclass
class Soak:
    """The run's shared state: targets, reference answers, calls, samples."""

    targets: dict[str, Target]
    base: str
    timeout: float
    keys: int
    reference: dict[tuple, str] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------------------------


async def answered(soak: Soak, route: str, action: str, target: Optional[Target], key: Optional[int],
                   call: Any, client: httpx.AsyncClient, mode: str = "normal") -> Call:
    """A target's request through `serve_load`'s client code, as a Call (its digest kept when the
    answer came whole)."""
    out = Outcome(0, key if key is not None else 0, mode)
    record = Call(route, action, key=None if target is None else (target.modality, key))
    begun = time.perf_counter()
    try:
        async with asyncio.timeout(soak.timeout):
            await call(client, key, out, begun)
        record.status = 200
    except HttpError as error:
        record.status, record.error, record.detail = error.status, error_kind(error), f"answer {error.body!r}"
    except Exception as error:  # noqa: BLE001 - every failure is counted by kind
        record.error = error_kind(error)
        record.detail = f"{type(error).__name__}: {error}"[:300]
    record.latency_s = time.perf_counter() - begun
    if record.status == 200 and out.complete and not out.foreign:
        record.digest = out.digest
    elif record.status == 200 and mode == "normal":
        record.error = "incomplete answer" if not out.complete else "another request's answer"
    if record.error and target is not None and key is not None:
        record.detail = f"body {json.dumps(target.body(key))[:300]} {record.detail}"
    return record


async def chat_whole(target: VLMTarget, client: httpx.AsyncClient, key: int, out: Outcome, start: float) -> None:
    """The streamed chat's request without `stream`: the answer's text digested as the stream's is."""
    body = {k: v for k, v in target.body(key).items() if k not in ("stream", "stream_options")}
    response = await client.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        raise HttpError(response.status_code, response.text)
    answer = response.json()
    out.first_s = time.perf_counter() - start
    out.ends, out.complete = 1, answer["choices"][0]["finish_reason"] is not None
    out.foreign = answer.get("seed") != target.seed(key)
    out.digest = hashlib.sha256(answer["choices"][0]["message"]["content"].encode()).hexdigest()


async def video_events(target: VideoTarget, client: httpx.AsyncClient, key: int, out: Outcome, start: float) -> None:
    """A video job followed through its events stream (the blocks as they commit), then its status
    and MP4; in `vanish` mode the client leaves after the first block."""
    response = await client.post("/v1/videos", json=target.body(key))
    if response.status_code != 200:
        raise HttpError(response.status_code, response.text)
    job = response.json()
    out.answer_id, out.foreign = job["id"], job.get("seed") != target.seed(key)
    final = None
    async with client.stream("GET", f"/v1/videos/{job['id']}/events") as events:
        if events.status_code != 200:
            await events.aread()
            raise HttpError(events.status_code, events.text)
        async for line in events.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if event["object"] == "video.block" and out.first_s is None:
                out.first_s = time.perf_counter() - start
                if out.mode == "vanish":
                    return
            elif event["object"] == "video.done":
                final = event
    if final is None or final["status"] != "completed":
        raise StreamError(f"job ended {final and final['status']}: {final and final.get('error')}")
    status = await client.get(f"/v1/videos/{job['id']}")
    if status.status_code != 200:
        raise HttpError(status.status_code, status.text)
    if status.json()["status"] != "completed":
        raise StreamError(f"the job's events ended completed, its status says {status.json()['status']}")
    content = await client.get(f"/v1/videos/{job['id']}/content")
    if content.status_code != 200:
        raise HttpError(content.status_code, content.text)
    out.ends, out.complete = 1, content.content[4:8] == b"ftyp"
    out.digest = hashlib.sha256(content.content).hexdigest()


async def raw_exchange(base: str, head: str, body: bytes, pieces: int = 1, gap_s: float = 0.0,
                       send_body: bool = True) -> tuple[int, bytes]:
    """One request over a raw socket (Connection: close), its body sent in `pieces` with `gap_s`
    between them: (status, response body). Without `send_body` only the headers go."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode())
        await writer.drain()
        if send_body:
            size = max(1, -(-len(body) // pieces))
            for i in range(0, len(body), size):
                writer.write(body[i:i + size])
                await writer.drain()
                if i + size < len(body):
                    await asyncio.sleep(gap_s)
        data = await reader.read()
    finally:
        writer.close()
    header, _, payload = data.partition(b"\r\n\r\n")
    status = re.match(rb"HTTP/1\.[01] (\d{3})", header)
    if status is None:
        raise httpx.RemoteProtocolError(f"no status line in {header[:80]!r}")
    return int(status.group(1)), payload


def post_head(path: str, length: int) -> str:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n")


async def trickle(soak: Soak, key: int) -> Call:
    """An image request whose body arrives in pieces over about two seconds."""
    target = soak.targets["image"]
    body = json.dumps(target.body(key)).encode()
    record = Call("POST /v1/images/generations (trickled body)", "trickle", key=("image", key))
    begun = time.perf_counter()
    try:
        async with asyncio.timeout(soak.timeout):
            record.status, payload = await raw_exchange(soak.base, post_head("/v1/images/generations", len(body)), body,
                                                        TRICKLE_PIECES, TRICKLE_GAP_S)
        if record.status == 200:
            answer = json.loads(payload)
            if answer.get("seed") == target.seed(key):
                record.digest = hashlib.sha256(b"".join(base64.b64decode(d["b64_json"]) for d in answer["data"])).hexdigest()
        else:
            record.error, record.detail = f"http {record.status}", f"body {body[:300]!r} answer {payload[:300]!r}"
    except Exception as error:  # noqa: BLE001
        record.error, record.detail = error_kind(error), f"{type(error).__name__}: {error}"[:300]
    record.latency_s = time.perf_counter() - begun
    return record


async def abandon(soak: Soak, key: int) -> Call:
    """A chat request whose client sends half its body, then closes the connection."""
    body = json.dumps(soak.targets["text"].body(key)).encode()
    record = Call("abandoned body", "abandon")
    begun = time.perf_counter()
    try:
        _, writer = await asyncio.open_connection(*soak.base.removeprefix("http://").split(":"))
        writer.write(post_head("/v1/chat/completions", len(body)).encode() + body[: len(body) // 2])
        await writer.drain()
        await asyncio.sleep(TRICKLE_GAP_S)
        writer.close()
        await writer.wait_closed()
    except Exception as error:  # noqa: BLE001
        record.error, record.detail = error_kind(error), f"{type(error).__name__}: {error}"[:300]
    record.latency_s = time.perf_counter() - begun
    return record


async def bad(soak: Soak, client: httpx.AsyncClient, kind: str) -> Call:
    """A bad request of `kind`: it must be refused with a 4xx."""
    chat = {"model": "emoji-vlm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    record = Call(f"bad {kind}", "bad")
    begun = time.perf_counter()
    try:
        async with asyncio.timeout(soak.timeout):
            if kind == "oversized_body":  # declared larger than the server takes; the body never comes
                record.status, payload = await raw_exchange(soak.base, post_head("/v1/chat/completions", 10**12), b"",
                                                            send_body=False)
                text = payload.decode(errors="replace")
            else:
                if kind == "unknown_route":
                    response = await client.get("/v1/nothing-here")
                elif kind == "unknown_video":
                    response = await client.get("/v1/videos/video_00000000000000000000000000000000")
                else:
                    content = {"malformed_json": b'{"model": "emoji-vlm", "messages": [',
                               "unknown_model": json.dumps({**chat, "model": "no-such-model"}).encode(),
                               "wrong_type": json.dumps({**chat, "max_tokens": "many"}).encode(),
                               "nan_temperature": json.dumps({**chat, "temperature": float("nan")}).encode()}[kind]
                    response = await client.post("/v1/chat/completions", content=content,
                                                 headers={"Content-Type": "application/json"})
                record.status, text = response.status_code, response.text
    except Exception as error:  # noqa: BLE001
        record.error, text = error_kind(error), f"{type(error).__name__}: {error}"
    record.latency_s = time.perf_counter() - begun
    if record.status is not None and not 400 <= record.status < 500:
        record.error = f"http {record.status}"
    elif record.status is not None:
        try:
            one_line = "error" in json.loads(text) and "Traceback" not in text
        except ValueError:
            one_line = False
        record.error = None if one_line else "not one JSON error"
    if record.error:
        record.detail = f"{kind}: answer {text[:300]!r}"
    return record


async def simple_get(soak: Soak, client: httpx.AsyncClient, path: str) -> Call:
    record = Call(f"GET {path}", path.strip("/").replace("v1/", ""))
    begun = time.perf_counter()
    try:
        response = await client.get(path, timeout=soak.timeout)
        record.status = response.status_code
        if response.status_code != 200:
            record.error, record.detail = f"http {response.status_code}", response.text[:300]
    except Exception as error:  # noqa: BLE001
        record.error, record.detail = error_kind(error), f"{type(error).__name__}: {error}"[:300]
    record.latency_s = time.perf_counter() - begun
    return record


async def act(soak: Soak, client: httpx.AsyncClient, action: str, rng: random.Random, key: Optional[int] = None) -> Call:
    """One action of the mix, for `key` or a reference key drawn from the `soak.keys` of each modality."""
    t = soak.targets
    key = rng.randrange(soak.keys) if key is None else key
    if action == "image":
        return await answered(soak, "POST /v1/images/generations", action, t["image"], key, t["image"].call, client)
    if action == "chat":
        call = lambda c, k, o, s: chat_whole(t["text"], c, k, o, s)
        return await answered(soak, "POST /v1/chat/completions", action, t["text"], key, call, client)
    if action == "chat_stream":
        return await answered(soak, ROUTE_OF["text"], action, t["text"], key, t["text"].call, client)
    if action == "speech":
        return await answered(soak, ROUTE_OF["speech"], action, t["speech"], key, t["speech"].call, client)
    if action == "video":
        call = lambda c, k, o, s: video_events(t["video"], c, k, o, s)
        return await answered(soak, "POST /v1/videos + events + status + content", action, t["video"], key, call, client)
    if action in ("models", "metrics"):
        return await simple_get(soak, client, "/v1/models" if action == "models" else "/metrics")
    if action == "bad":
        return await bad(soak, client, rng.choice(BAD_KINDS))
    if action == "sampled":
        which = t[rng.choice(("text", "speech"))]
        body = {**which.body(key), "temperature": round(rng.uniform(0.5, 1.5), 3)}
        call = lambda c, k, o, s: which.call(c, k, o, s, request=body)
        return await answered(soak, f"{ROUTE_OF[which.modality]} (sampled)", action, None, key, call, client)
    if action == "trickle":
        return await trickle(soak, key)
    if action == "abandon":
        return await abandon(soak, key)
    # drop: a stream left after its first output (its answer is not compared)
    which = rng.choice(("text", "speech", "video"))
    call = (lambda c, k, o, s: video_events(t["video"], c, k, o, s)) if which == "video" else t[which].call
    return await answered(soak, f"drop {which} stream", action, None, key, call, client, mode="vanish")


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def proc_status(pid: int) -> dict:
    """Resident memory (MiB) and thread count of a process, from /proc/PID/status."""
    text = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", text, re.M).group(1))
    return {"rss_mib": round(rss / 1024, 1), "threads": threads}


async def references(soak: Soak) -> float:
    """Each reference key of each modality once, alone: the answers the soak's must equal."""
    begun = time.perf_counter()
    calls = {"image": "image", "text": "chat_stream", "speech": "speech", "video": "video"}
    async with make_client(soak.base, soak.timeout, 1) as client:
        for modality, action in calls.items():
            for key in range(soak.keys):
                record = await act(soak, client, action, random.Random(0), key)
                if record.digest is None:
                    raise RuntimeError(f"the reference request {modality} key {key} failed: {record.error} {record.detail}")
                soak.reference[(modality, key)] = record.digest
    return time.perf_counter() - begun


async def traffic(soak: Soak, pid: int, seconds: float, clients: int, health_every: float, sample_every: float,
                  seed: int) -> float:
    """The soak itself: `clients` closed-loop clients, the /health poller and the sampler."""
    actions, weights = list(MIX), list(MIX.values())
    begun = time.perf_counter()
    deadline = begun + seconds

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        async with make_client(soak.base, soak.timeout, 2) as client:
            while time.perf_counter() < deadline:
                soak.calls.append(await act(soak, client, rng.choices(actions, weights)[0], rng))

    async def health() -> None:
        async with make_client(soak.base, soak.timeout, 1) as client:
            while time.perf_counter() < deadline:
                soak.calls.append(await simple_get(soak, client, "/health"))
                await asyncio.sleep(health_every)

    async def sampler() -> None:
        while True:
            soak.samples.append({"t_s": round(time.perf_counter() - begun, 1), **proc_status(pid)})
            if time.perf_counter() >= deadline:
                return
            await asyncio.sleep(min(sample_every, max(0.0, deadline - time.perf_counter())))

    await asyncio.gather(*(client_loop(i) for i in range(clients)), health(), sampler())
    return time.perf_counter() - begun


async def counted_5xx(base: str) -> dict[str, float]:
    """The server's own count of its 5xx responses, read from its /metrics."""
    async with make_client(base, 30.0, 1) as client:
        return five_xx((await client.get("/metrics")).text)


def five_xx(metrics: str) -> dict[str, float]:
    """The 5xx responses a Prometheus text counts in `mmgen_responses_total`, by "route status"."""
    counted = {}
    for labels, value in re.findall(r"^mmgen_responses_total\{([^}]*)\} (\S+)$", metrics, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields.get("status", "").startswith("5") and float(value) > 0:
            counted[f"{fields.get('route')} {fields['status']}"] = float(value)
    return counted


def flatness(samples: Sequence[dict], seconds: float) -> dict:
    """Memory and threads after warm-up: the level (median of the samples) of the last window,
    `min(FLAT_WINDOW_S, seconds / 3)` long, within `FLAT_TOLERANCE` of the window's before it
    (or `FLAT_THREADS` threads, `FLAT_RSS_MIB` MiB, whichever is more).
    A median, not each sample: the server's thread pool spawns and reaps idle workers as load
    comes and goes, and the allocator's arenas breathe; a leak moves the level."""
    window = min(FLAT_WINDOW_S, seconds / 3)
    end = samples[-1]["t_s"]
    last = [s for s in samples if s["t_s"] > end - window]
    before = [s for s in samples if end - 2 * window < s["t_s"] <= end - window] or samples[:1]
    out: dict[str, Any] = {"window_s": round(window, 1), "samples": len(last)}
    for name in ("rss_mib", "threads"):
        values = [s[name] for s in last]
        level, previous = statistics.median(values), statistics.median(s[name] for s in before)
        change = (level - previous) / previous
        # Threads are a few dozen at most: a pool worker more or less is 5-10% of them, no leak.
        slack = max(FLAT_TOLERANCE * previous, FLAT_THREADS if name == "threads" else FLAT_RSS_MIB)
        out[name] = {"level": level, "level_before": previous, "min": min(values), "max": max(values),
                     "change": round(change, 4), "flat": abs(level - previous) <= slack}
    out["growth_from_start"] = {"rss_mib": round(samples[-1]["rss_mib"] - samples[0]["rss_mib"], 1),
                                "threads": samples[-1]["threads"] - samples[0]["threads"]}
    return out


def summarize(soak: Soak, seconds: float, log: Path, counted: dict[str, float]) -> dict:
    """The report's figures from the calls and samples."""
    routes: dict[str, dict] = {}
    by_route: dict[str, list[Call]] = collections.defaultdict(list)
    for call in soak.calls:
        by_route[call.route].append(call)
    for route, calls in sorted(by_route.items()):
        answered_ = [c.latency_s for c in calls if c.status is not None]
        routes[route] = {"requests": len(calls), "ok": sum(c.error is None for c in calls),
                         "statuses": dict(collections.Counter(str(c.status) for c in calls if c.status is not None)),
                         "errors": dict(collections.Counter(c.error for c in calls if c.error)),
                         "latency_s": {"p50": percentile(answered_, 50), "p95": percentile(answered_, 95)}}
    health = [c.latency_s for c in by_route.get("GET /health", []) if c.status == 200]
    compared = [c for c in soak.calls if c.key in soak.reference and c.digest is not None]
    mismatched = [c for c in compared if c.digest != soak.reference[c.key]]
    server_errors = [c for c in soak.calls if c.status is not None and c.status >= 500]
    failures = [c for c in soak.calls if c.error and not (c.action == "drop" and c.status == 200)]
    log_text = log.read_text(errors="replace") if log.exists() else ""
    tracebacks = [t[:2000] for t in re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*", log_text)]
    flat = flatness(soak.samples, seconds)
    goals = {"no_5xx": {"seen_by_clients": len(server_errors), "counted_by_server": counted,
                        "met": not server_errors and not counted},
             "equal_to_alone": {"compared": len(compared), "mismatched": len(mismatched),
                                "met": bool(compared) and not mismatched},
             "flat": {"rss": flat["rss_mib"]["flat"], "threads": flat["threads"]["flat"],
                      "met": flat["rss_mib"]["flat"] and flat["threads"]["flat"]},
             "health_p99": {"p99_s": percentile(health, 99), "goal_s": HEALTH_P99_GOAL_S,
                            "met": bool(health) and percentile(health, 99) < HEALTH_P99_GOAL_S}}
    return {"requests": len(soak.calls), "routes": routes,
            "errors_by_kind": dict(collections.Counter(c.error for c in failures)),
            "health": {"requests": len(health), "p50_s": percentile(health, 50), "p99_s": percentile(health, 99),
                       "max_s": round(max(health), 4) if health else None},
            "flat": flat, "samples": soak.samples, "goals": goals,
            "failures": [{"route": c.route, "action": c.action, "status": c.status, "error": c.error, "detail": c.detail,
                          "key": c.key} for c in failures[:50]],
            "mismatches": [{"route": c.route, "key": c.key} for c in mismatched[:50]],
            "server_tracebacks": {"count": len(tracebacks), "first": tracebacks[:5]}}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of traffic (default 30)")
    parser.add_argument("--clients", type=int, default=6, help="closed-loop clients (default 6)")
    parser.add_argument("--keys", type=int, default=3, help="reference (input, seed) keys per modality (default 3)")
    parser.add_argument("--health-every", type=float, default=0.5, help="seconds between /health polls (default 0.5)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between memory samples (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server process (default 1)")
    parser.add_argument("--max-queue", type=int, default=64, help="the server's --max-queue (default 64)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a client call may take (default 300)")
    parser.add_argument("--max-new-frames", type=int, default=48, help="speech: frames per utterance (default 48)")
    parser.add_argument("--max-tokens", type=int, default=12, help="chat: answer tokens (default 12)")
    parser.add_argument("--video-frames", type=int, default=5, help="video: frames per video (default 5: one block)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' action draws (default 0)")
    parser.add_argument("--out", default=None, help="write the report here as JSON")
    parser.add_argument("--log-dir", default=None, help="keep the server's log here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or min(args.clients, args.keys, args.threads) < 1 or min(args.health_every, args.sample_every,
                                                                                  args.timeout) <= 0:
        parser.error("--minutes, --health-every, --sample-every and --timeout must be positive, "
                     "--clients, --keys and --threads at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    args.decoding = None  # the targets' requests use each model's default method
    targets = {cls.modality: cls(args) for cls in (ImageTarget, VLMTarget, SpeechTarget, VideoTarget)}
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(args.log_dir or scratch) / "soak-server.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        server = Server(list(targets.values()), None, args.threads, args.max_queue, log)
        with server:
            soak = Soak(targets, server.url, args.timeout, args.keys)
            reference_s = asyncio.run(references(soak))
            print(f"soak: {len(soak.reference)} reference answers in {reference_s:.1f} s; traffic for "
                  f"{args.minutes:g} min", flush=True)
            seconds = asyncio.run(traffic(soak, server.process.pid, args.minutes * 60, args.clients, args.health_every,
                                          args.sample_every, args.seed))
            counted = asyncio.run(counted_5xx(server.url))
            report = {"command": "python -m benchmarks.soak " + " ".join(sys.argv[1:] if argv is None else argv),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                      "server": " ".join(server.command[1:]).replace(str(server.port), "PORT"),
                      "settings": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir", "decoding")},
                      "cpus": os.cpu_count(), "nice": os.nice(0), "load_average_at_end": os.getloadavg(), "reference_s": round(reference_s, 1),
                      "traffic_s": round(seconds, 1), **summarize(soak, seconds, log, counted)}
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return report


def table(report: dict) -> str:
    """The report as Markdown: per route, then the goals."""
    lines = ["| route | requests | ok | statuses | errors | latency p50 / p95 (s) |", "|---|---|---|---|---|---|"]
    for route, r in report["routes"].items():
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items()))
        errors = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
        lines.append(f"| {route} | {r['requests']} | {r['ok']} | {statuses} | {errors} | "
                     f"{r['latency_s']['p50']} / {r['latency_s']['p95']} |")
    flat = report["flat"]
    lines += ["", f"/health: p50 {report['health']['p50_s']} s, p99 {report['health']['p99_s']} s, "
                  f"max {report['health']['max_s']} s over {report['health']['requests']}",
              f"last {flat['window_s']} s: resident {flat['rss_mib']['min']}-{flat['rss_mib']['max']} MiB "
              f"(median {flat['rss_mib']['change']:+.1%} on the window before), threads "
              f"{flat['threads']['min']}-{flat['threads']['max']} (median {flat['threads']['change']:+.1%})",
              "goals: " + ", ".join(f"{k} {'met' if v['met'] else 'MISSED'}" for k, v in report["goals"].items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(0 if all(goal["met"] for goal in main()["goals"].values()) else 1)
