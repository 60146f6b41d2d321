"""`mmgen serve`: every modality's models behind an OpenAI-compatible HTTP API (`mmgen.apps.server`).

    mmgen serve                                   # the bundled models of every modality, on 127.0.0.1:8000
    mmgen serve --model emoji-vlm --model speech-tts --continuous-batch speech=16 --api-key KEY
    mmgen serve --ray --replicas 2                # two copies behind Ray Serve's proxy (`mmgen.apps.ray_serve`)

FastAPI and uvicorn are imported only when the server runs, and Ray only with --ray, so building the
`mmgen` parser stays cheap.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
import time
from typing import Optional

from mmgen import registry
from mmgen.apps.cli import bounded_int
from mmgen.apps.http.settings import BATCHED
from mmgen.apps.requests.bounds import LIMITS
from mmgen.apps.requests.video import DEFAULT_STREAM_BLOCKS, MAX_STREAM_BLOCKS

#: A batch's width follows its requests (`mmgen.decoding.feed.FeedRows.fit`), so rows cost
#: nothing until requests fill them; 16 served the bundled speech model at 3.5x the
#: one-at-a-time server's requests per second at 16 clients (docs/benchmarks.md).
DEFAULT_ROWS = 16
MAX_ROWS = 64
API_KEY_ENV = "MMGEN_API_KEY"
MIB = 1024 * 1024
MAX_REPLICAS = 1024
MAX_CONNECTIONS = 65536
MAX_TIMEOUT_S = 3600
MAX_STREAM_SECONDS = 24 * 3600


def register(commands, groups) -> None:
    """Add the `serve` command."""
    serve = commands.add_parser("serve", help="serve the models over an OpenAI-compatible HTTP API",
                                description="Serve image, vision-language, speech and video models over OpenAI-compatible "
                                            "routes (/v1/images/generations, /v1/chat/completions, /v1/audio/speech, "
                                            "/v1/videos, and /v1/videos/stream over a WebSocket), with /v1/models, /health "
                                            "and Prometheus /metrics.")
    serve.add_argument("--model", action="append", default=None, metavar="NAME_OR_FOLDER",
                       help="a bundled model name or a model folder of any modality (repeatable; default: the bundled "
                            "models of every modality present). A model's companions (NAME-draft, NAME-small) come along")
    serve.add_argument("--device", default="cpu", help="torch device of the models (default: cpu)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=bounded_int(0, 65535, "--port"), default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV} "
                            "when set, else no key; prefer the variable: a flag shows in the process list)")
    serve.add_argument("--max-queue", type=bounded_int(0, 100_000, "--max-queue"), default=64, metavar="N",
                       help="requests that may wait for a busy model, over the whole server; one more is refused with "
                            "429 and Retry-After (default: 64)")
    serve.add_argument("--continuous-batch", action="append", default=None, metavar="[MODALITY=]ROWS", type=_rows,
                       help=f"rows of each model's shared continuous batch: requests of one model that overlap in time "
                            f"and ask for a method that batches continuously (ar, the sjd family) with the "
                            f"same sampling decode together, each giving "
                            f"what it gives alone; a model takes that many requests at once. ROWS sets every batched "
                            f"modality ({', '.join(BATCHED)}), MODALITY=ROWS one of them; 0 turns it off "
                            f"(repeatable; default: {DEFAULT_ROWS}; vlm=ROWS, text's old name, still works)")
    # The defaults are `ServerSettings`' (tests/apps/test_server.py checks that they agree).
    serve.add_argument("--max-images", type=bounded_int(1, LIMITS.images, "--max-images"), default=4,
                       help="images one request makes, or one conversation reads (default: 4)")
    serve.add_argument("--max-new-tokens", type=bounded_int(1, LIMITS.new_tokens, "--max-new-tokens"), default=256,
                       help="an answer's tokens, at most; the default of max_tokens (default: 256)")
    serve.add_argument("--max-new-frames", type=bounded_int(1, LIMITS.new_frames, "--max-new-frames"), default=1024,
                       help="an utterance's decoder frames, at most (a model's context bounds them too; default: 1024)")
    serve.add_argument("--max-frames", type=bounded_int(1, LIMITS.video_frames, "--max-frames"), default=81,
                       help="a video's frames, at most (default: 81)")
    serve.add_argument("--max-stream-blocks", type=bounded_int(1, MAX_STREAM_BLOCKS, "--max-stream-blocks"),
                       default=DEFAULT_STREAM_BLOCKS, metavar="N",
                       help=f"blocks one /v1/videos/stream connection makes, at most (default: {DEFAULT_STREAM_BLOCKS})")
    serve.add_argument("--max-stream-seconds", type=bounded_int(1, MAX_STREAM_SECONDS, "--max-stream-seconds"),
                       default=600, metavar="S", help="seconds one /v1/videos/stream connection runs, at most (default: 600)")
    serve.add_argument("--max-body-mb", type=bounded_int(1, LIMITS.body_bytes // MIB, "--max-body-mb"), default=32, metavar="MB",
                       help="request bodies larger than this are refused before they are read (default: 32)")
    serve.add_argument("--max-connections", type=bounded_int(1, MAX_CONNECTIONS, "--max-connections"), default=1024,
                       metavar="N", help="open connections, at most; more are closed at once (default: 1024)")
    serve.add_argument("--header-timeout", type=bounded_int(1, MAX_TIMEOUT_S, "--header-timeout"), default=10, metavar="S",
                       help="seconds a request's headers may take to arrive; slower connections are closed (default: 10)")
    serve.add_argument("--body-timeout", type=bounded_int(1, MAX_TIMEOUT_S, "--body-timeout"), default=60, metavar="S",
                       help="seconds a request's body may take to arrive; slower ones get 408 (default: 60)")
    serve.add_argument("--no-preload", action="store_true",
                       help="load each model at its first request instead of before listening")
    serve.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve (pip install 'mmgen[ray]'): a local Ray instance on 127.0.0.1 runs "
                            "--replicas copies of this server, each loading its own models, behind Serve's HTTP proxy "
                            "on --host and --port")
    serve.add_argument("--replicas", type=bounded_int(1, MAX_REPLICAS, "--replicas"), default=None, metavar="N",
                       help="with --ray: copies of the server (default: one per GPU with --device cuda, each on its "
                            "own GPU, else 1); the machine's CPUs are shared evenly among them")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level, or with --ray Ray Serve's (default: info)")
    serve.set_defaults(run=run_serve)


def continuous_batch(values: Optional[list[tuple[Optional[str], int]]]) -> dict[str, int]:
    """Rows per batched modality from `--continuous-batch` values (later ones win)."""
    rows = {modality: DEFAULT_ROWS for modality in BATCHED}
    for modality, count in values or []:
        for name in [modality] if modality else BATCHED:
            rows[name] = count
    return rows


def settings_of(args: argparse.Namespace):
    """The server's settings from the parsed command line (the key from $MMGEN_API_KEY unless given)."""
    from mmgen.apps.http.settings import ServerSettings

    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise ValueError("--api-key is empty: give a key, or leave the flag out to serve without one")
    return ServerSettings(api_key=key, max_queue=args.max_queue, max_body_bytes=args.max_body_mb * MIB,
                          max_images=args.max_images, max_new_tokens=args.max_new_tokens,
                          max_new_frames=args.max_new_frames, max_frames=args.max_frames,
                          max_stream_blocks=args.max_stream_blocks, max_stream_seconds=float(args.max_stream_seconds),
                          max_connections=args.max_connections, header_timeout_s=float(args.header_timeout),
                          body_timeout_s=float(args.body_timeout))


def run_serve(args: argparse.Namespace) -> int:
    from mmgen.cli import check_device

    check_device(args.device)  # a bad device fails here, in one line, before any model loads
    settings = settings_of(args)
    if args.replicas is not None and not args.ray:
        raise ValueError("--replicas runs copies of the server under Ray Serve: add --ray")
    if args.ray:
        return run_ray(args, settings)
    from mmgen.apps.http.connections import uvicorn_options
    from mmgen.apps.server import create_app, discover_catalogs, preload

    catalogs = discover_catalogs(args.model, device=args.device, continuous_batch=continuous_batch(args.continuous_batch))
    if not args.no_preload:
        preload(catalogs)
    app = create_app(catalogs, settings)
    _describe(catalogs, settings, args.host)
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, **uvicorn_options(settings))
    return 0


def run_ray(args: argparse.Namespace, settings) -> int:
    """`mmgen serve --ray`: a local Ray instance on 127.0.0.1, `--replicas` copies of the server on
    it, Serve's proxy on --host:--port, until Ctrl-C or SIGTERM; then Serve and Ray stop."""
    try:
        from mmgen.apps import ray_serve

        ray_serve.require_ray()
    except ImportError as error:
        raise ValueError(str(error)) from None
    from mmgen.apps.server import discover_catalogs

    rows = continuous_batch(args.continuous_batch)
    replicas, cpus = ray_serve.replica_plan(args.device, args.replicas)
    app = ray_serve.deployment(args.model, device=args.device, replicas=replicas, settings=settings,
                               continuous_batch=rows, preload=not args.no_preload, cpus_per_replica=cpus)
    catalogs = discover_catalogs(args.model, device=args.device, continuous_batch=rows)
    _describe(catalogs, settings, args.host)
    if "video" in catalogs and replicas > 1:
        print(f"mmgen serve: warning: a video job lives in the replica that made it, and Serve may send its "
              f"GET /v1/videos/{{id}} to another of the {replicas} (404); serve video models with one replica")
    ray_serve.check_port(args.host, args.port)  # before Ray's start, which takes seconds
    try:
        ray_serve.start_local_ray(num_cpus=ray_serve.available_cpus())
        signal.signal(signal.SIGTERM, _interrupt)  # after Ray's start, which sets a handler that aborts
        url = ray_serve.run(app, host=args.host, port=args.port, log_level=args.log_level)
        print(f"mmgen serve: {replicas} replica(s) ready behind Ray Serve on {url} (Ctrl-C stops them)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        ray_serve.shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the Ray server as Ctrl-C does, Ray included


def _describe(catalogs, settings, host: str) -> None:
    for modality, catalog in catalogs.items():
        rows = catalog.continuous_batch
        print(f"mmgen serve: {modality} models {list(catalog.main)} (companions {list(catalog.companions)}), "
              f"continuous batch {rows or 'off'}")
    if settings.api_key is None and not _loopback(host):
        print(f"mmgen serve: warning: listening on {host} without an API key: anyone who reaches it may use "
              f"the models (set ${API_KEY_ENV})")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _rows(text: str) -> tuple[Optional[str], int]:
    modality, _, count = text.rpartition("=")
    if modality in registry.RENAMED_MODALITIES:  # the old name still works until the next release, with a note
        new = registry.RENAMED_MODALITIES[modality]
        print(f"mmgen serve: note: --continuous-batch {modality}=ROWS is now {new}=ROWS; the old name goes in the "
              "next release", file=sys.stderr)
        modality = new
    if modality and modality not in BATCHED:
        raise argparse.ArgumentTypeError(f"--continuous-batch {text!r}: the modality must be one of {list(BATCHED)}")
    return (modality or None), bounded_int(0, MAX_ROWS, "--continuous-batch")(count)
