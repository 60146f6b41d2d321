"""`mmgen serve --ray`: the `mmgen serve` app as a Ray Serve deployment, for more than one copy of
the models (`mmgen.apps.ray_serve`; the optional extra `pip install 'mmgen[ray]'`).

    mmgen serve --ray --replicas 2 --model emoji64               # two CPU replicas on 127.0.0.1:8000
    mmgen serve --ray --device cuda                              # one replica per GPU

A replica is one Ray actor serving exactly the FastAPI app of `create_app` (Serve's FastAPI
ingress) over catalogues it builds and loads itself, with the arguments `mmgen serve` takes; Ray
Serve's HTTP proxy spreads the requests over the replicas (the fewer requests a replica holds, the
likelier it gets the next one). Everything else is the single server's: routes, limits, errors,
the 429 of a full waiting room (per replica), `/metrics` (per replica). Each response names the
replica that answered in its `x-mmgen-replica` header. A video job runs on the replica that took
its POST and is published to a board the replicas share (one small named actor,
`apps/job_board.py`), so its status, events and MP4 answer on any replica.

The Ray instance is local and kept on the loopback address: its node address is 127.0.0.1 (the
setting below, read when `ray` is first imported, keeps Ray from replacing it with this
machine's network address), the dashboard is off, usage statistics are not sent, and Serve's
proxy listens on `--host` (127.0.0.1 by default). Ray is imported only by the functions here;
importing this module before `ray` is what keeps the node on 127.0.0.1, so a driver meant to
join a multi-machine Ray cluster sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 first. One thing Ray does
not let us bind: Ray Serve 2.60's replicas each open a server for calls between deployments on
every interface (guarded by Ray's cluster token, which Ray writes to ~/.ray/auth_token).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any, Mapping, Optional, Sequence

from mmgen.apps.job_board import ACTOR_NAME, JobBoard, JobShelf
from mmgen.apps.server import SPARE_THREADS, ServerSettings, create_app, discover_catalogs, preload as preload_models

INSTALL = "pip install 'mmgen[ray]'"
APP_NAME = "mmgen"
REPLICA_HEADER = "x-mmgen-replica"
LOOPBACK = "127.0.0.1"
#: Ray's switch for "no multi-machine cluster": with it off, a node asked to run on 127.0.0.1 stays
#: there (else Ray swaps in this machine's network address, and its servers listen on it).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray would report usage to its makers


def require_ray() -> Any:
    """The `ray.serve` module, or ImportError saying how to install it."""
    try:
        from ray import serve
    except ImportError:
        raise ImportError(f"mmgen serve --ray needs Ray Serve: {INSTALL}") from None
    return serve


def available_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def replica_plan(device: str = "cpu", replicas: Optional[int] = None) -> tuple[int, float]:
    """How many replicas (default: one per GPU on cuda, else 1) and CPUs each takes (this
    machine's, shared evenly), checked against the machine in one line."""
    if _on_gpus(device):
        import torch

        gpus = torch.cuda.device_count()
        replicas = gpus if replicas is None else replicas
        if replicas > gpus:
            raise ValueError(f"--replicas {replicas}: this machine has {gpus} GPU(s), and each replica takes one")
    replicas = 1 if replicas is None else replicas
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    return replicas, available_cpus() / replicas


def replica_app(models: Optional[Sequence[str]], device: str, settings: ServerSettings,
                continuous_batch: Optional[Mapping[str, int]], preload: bool) -> Any:
    """One replica's app: its own catalogues (loaded now unless `preload` is off) behind
    `create_app`, each response naming the replica."""
    from ray import serve

    catalogs = discover_catalogs(models, device=device, continuous_batch=continuous_batch)
    if preload:
        preload_models(catalogs)
    app = create_app(catalogs, settings, shared_job_board(settings.max_finished_jobs))
    app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
    return app


def shared_job_board(keep: int) -> JobBoard:
    """The board every replica publishes its video jobs to and reads the others' from: one named
    Ray actor holding a `JobShelf`, created by the first replica that asks (no CPU reserved: it
    only stores), so a job's status, events and MP4 answer on whichever replica a GET reaches."""
    import ray

    shelf = ray.remote(JobShelf).options(name=ACTOR_NAME, get_if_exists=True, num_cpus=0).remote(keep)
    return JobBoard(actor=shelf)


def deployment(models: Optional[Sequence[str]] = None, device: str = "cpu", replicas: int = 1,
               settings: ServerSettings = ServerSettings(), continuous_batch: Optional[Mapping[str, int]] = None,
               preload: bool = True, cpus_per_replica: float = 1.0) -> Any:
    """The bound Ray Serve application: `replicas` copies of `mmgen serve`'s app, each building
    its catalogues from these arguments (those of `discover_catalogs`, `preload` and
    `create_app`). On cuda each replica takes one GPU and runs on it as `cuda`. The models are
    found here first, so a bad name fails in one line before any replica starts."""
    serve = require_ray()
    resources = {"num_gpus": 1, "num_cpus": cpus_per_replica} if _on_gpus(device) else {"num_cpus": cpus_per_replica}
    # A replica's working folder is Ray's, not ours: model folders travel as absolute paths.
    models = None if not models else [str(os.path.abspath(m)) if os.path.isdir(m) else str(m) for m in models]
    catalogs = discover_catalogs(models, device=device, continuous_batch=continuous_batch)
    slots = sum(max(1, int(catalog.continuous_batch or 0)) * len(catalog.main) for catalog in catalogs.values())

    def build() -> Any:  # runs in each replica as it starts
        return replica_app(models, device, settings, continuous_batch, preload)

    # Ray holds back at most `max_ongoing_requests` per replica: room for every request the app
    # itself admits or queues, so that its own admission answers (and a full queue is its 429).
    ingress = serve.deployment(serve.ingress(build)(), name=APP_NAME, num_replicas=replicas,
                               ray_actor_options=resources,
                               max_ongoing_requests=slots + settings.max_queue + SPARE_THREADS,
                               max_queued_requests=max(1, settings.max_queue))
    return ingress.bind()


def start_local_ray(num_cpus: Optional[float] = None, num_gpus: Optional[int] = None) -> None:
    """Start a Ray instance of this machine alone, on 127.0.0.1, without its dashboard."""
    require_ray()
    import ray

    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             _node_ip_address=LOOPBACK)
    node = ray.util.get_node_ip_address()
    if node != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"Ray placed its node on {node}, not {LOOPBACK}: import mmgen.apps.ray_serve before ray, "
                           "or unset RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def run(application: Any, host: str = LOOPBACK, port: int = 8000, log_level: str = "info") -> str:
    """Serve `application` on Ray (started with `start_local_ray`) behind Serve's HTTP proxy on
    host:port; returns once every replica is ready, with the base URL."""
    serve = require_ray()
    check_port(host, port)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    serve.run(application, name=APP_NAME, route_prefix="/", logging_config={"log_level": log_level.upper()})
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def shutdown() -> None:
    """Stop the Serve application and proxy, then Ray."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


class ReplicaHeader:
    """ASGI middleware adding `x-mmgen-replica: ID` to every response, so that a client (or a
    test) can tell which replica answered."""

    def __init__(self, app: Any, replica: str):
        self.app, self.value = app, replica.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.value)]}
            await send(message)

        await self.app(scope, receive, named)


def check_port(host: str, port: int) -> None:
    """ValueError in one line when host:port cannot be listened on (Serve's proxy would retry a
    taken port in the background instead)."""
    family = socket.AF_INET6 if _is_v6(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise ValueError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def _on_gpus(device: str) -> bool:
    if device == "cuda":
        return True
    if device.startswith("cuda:"):
        raise ValueError(f"--device {device}: under Ray each replica gets a GPU of its own; pass --device cuda")
    if device != "cpu":
        raise ValueError(f"--ray serves on cpu or cuda devices, not {device}")
    return False


def _is_v6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


__all__ = ["check_port", "deployment", "replica_app", "replica_plan", "run", "shared_job_board", "shutdown", "start_local_ray",
           "ReplicaHeader", "INSTALL", "REPLICA_HEADER"]
