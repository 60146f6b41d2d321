"""`mmgen serve`: every modality's models behind OpenAI-compatible HTTP routes (FastAPI + uvicorn),
on the same request layer as the Gradio demos (`mmgen.apps.requests`).

    POST /v1/images/generations   images, b64_json: of a prompt (text-to-image models: LlamaGen t2i,
                                  Janus-Pro), or of a class (class-conditional ones: prompt = a class name)
    POST /v1/chat/completions     vision-language chat; image_url and video_url parts as data: URLs; SSE streaming
    POST /v1/audio/speech         speech, streamed as its frames decode (wav or raw pcm16)
    POST /v1/videos               a video job; GET /v1/videos/{id} its status, .../content the MP4,
                                  .../events its blocks as they commit (server-sent events)
    WS   /v1/videos/stream        a live video, block by block as it is read, steered by new prompts
                                  on the same connection (`mmgen.apps.http.video_stream`)
    GET  /v1/models, /health, /metrics (Prometheus)

A model family's own options (`mmgen.registry.Option`) are listed in each `/v1/models` entry
(`"options"`) and given in a request body's `"options"` object (the live video stream aside).

Every request is checked by the request layer (its modality's `check_request`) before it waits
for or takes a model, so bad input is one JSON error in OpenAI's shape (`{"error": {"message",
"type", "param", "code"}}`) with a 4xx status and never a traceback; an unexpected failure is logged here and
answered with a generic 500. Requests queue per model in a bounded waiting room: a model takes as
many requests at once as its catalogue's continuous batch has rows (one without), and a request
that would wait when `max_queue` requests already wait is refused with 429 and `Retry-After`.
Model work runs in worker threads, so a long decode never holds up `/health`. A streamed
response whose client goes away closes its request's stream, which stops the run at its next
output and frees the model (`mmgen.apps.requests.runs`).

The server listens on 127.0.0.1 unless told otherwise, never fetches a URL a client sends and,
given an API key, requires it as `Authorization: Bearer KEY` on every route but `/health`. Before
a body is read it is bounded by its Content-Length, refused when the queue it would join is full
or the bodies the server holds at once would pass `max_body_bytes_in_flight`, and refused (415)
when it is not JSON; it must arrive within `body_timeout_s`, and a connection's headers within
`header_timeout_s`; at most `max_connections` are open (`mmgen.apps.http.guard`, `.connections`).
A client that goes away mid-body is counted (status 499), not logged as a failure.

This module builds the app (`create_app`) and holds the service's shared state (`Service`). It
names no modality: the catalogues, `/v1/models`, admission and metrics iterate the request layer's
registered services (`mmgen.apps.requests.service`: each modality's catalogue, request, checks,
run and limits), and the app mounts the routes each modality registered (`mmgen.apps.http.routes`).
The built-in modalities' routes are a mixin each (`mmgen.apps.http.images`, `.chat_routes`,
`.speech_routes`, `.video_routes`, `.video_stream`), over the OpenAI error format (`.errors`), request bodies
(`.bodies`), admission (`.admission`), encoders (`.encoders`) and streams (`.streams`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, AsyncIterator, Callable, Mapping, Optional, Sequence

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mmgen import registry
from mmgen.apps.http.admission import Admission, Ticket
from mmgen.apps.http.chat_routes import ChatRoutes
from mmgen.apps.http.encoders import pcm16, wav_header  # noqa: F401 (the server's public names)
from mmgen.apps.http.errors import ApiError, error_body, error_response, one_line, validation_message
from mmgen.apps.http.guard import Guard
from mmgen.apps.http.images import ImageRoutes
from mmgen.apps.http.routes import admitting_routes, main_route, routes_of
from mmgen.apps.http.settings import BATCHED, ServerSettings
from mmgen.apps.http.speech_routes import SpeechRoutes
from mmgen.apps.http.video_routes import VideoJob, VideoRoutes
from mmgen.apps.http.video_stream import VideoStreamRoutes
from mmgen.apps.job_board import JobBoard
from mmgen.apps.metrics import CONTENT_TYPE, ServerMetrics
from mmgen.apps.requests.bounds import MAX_SEED, shown
from mmgen.apps.requests.service import services

log = logging.getLogger("mmgen.serve")

#: Extra worker threads beyond one per model slot: request checks and response assembly.
SPARE_THREADS = 16
CLIENT_GONE = 499  # the status counted for a request whose client went away mid-body (nginx's)


def discover_catalogs(models: Optional[Sequence[str]] = None, device: str = "cpu",
                      continuous_batch: Optional[Mapping[str, int]] = None) -> dict[str, Any]:
    """The catalogues a server offers, keyed by modality in the registered services' order (which
    `/v1/models` lists them in): each modality's bundled models present in this installation
    (default), or the given bundled names and folders, each assigned to the first modality whose
    catalogue takes it (each recognises its own folders). `continuous_batch` gives a modality's
    shared batch rows (0: off; the old key "vlm" is "text", with a DeprecationWarning)."""
    modalities = services()
    batch_rows: dict[str, int] = {}
    for modality, rows in (continuous_batch or {}).items():
        batch_rows[registry.modality_name(modality)] = rows
    catalogs: dict[str, Any] = {}
    if not models:
        for modality, found in modalities.items():
            try:
                catalogs[modality] = found.discover(device=device)
            except ValueError:  # this modality's bundled models are missing from the installation
                continue
    else:
        groups: dict[str, list[str]] = {}
        for entry in models:
            groups.setdefault(_modality_of(str(entry), modalities), []).append(str(entry))
        catalogs = {m: found.discover(groups[m], device=device) for m, found in modalities.items() if m in groups}
    if not catalogs:
        raise ValueError("no models to serve: the bundled models are missing from this installation; pass --model FOLDER")
    seen: dict[str, str] = {}
    for modality, catalog in catalogs.items():
        for name in catalog.main:
            if name in seen:
                raise ValueError(f"two models go by the name {name!r} ({seen[name]} and {modality}): requests name a "
                                 "model by its folder's name, so rename one folder")
            seen[name] = modality
        rows = batch_rows.get(modality, 0)
        catalog.continuous_batch = rows if modality in BATCHED else 0
    return catalogs


def _modality_of(entry: str, modalities: Mapping[str, Any]) -> str:
    for modality, found in modalities.items():
        try:
            found.discover([entry])  # finds and checks the entry's files; loads nothing
        except ValueError:
            continue
        return modality
    nouns = [found.noun for found in modalities.values()]
    raise ValueError(f"--model {entry!r} is neither a bundled model ({', '.join(registry.bundled_models())}) nor a "
                     f"model folder of a modality mmgen serves ({', '.join(nouns[:-1])} or {nouns[-1]})")


#: An option's value type as JSON Schema names it (`/v1/models`).
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def option_entry(option: registry.Option) -> dict:
    """A family option as `/v1/models` lists it (a request gives it in its `"options"` object):
    its name, JSON type, default, help, and choices or inclusive bounds (empty, null: none)."""
    return {"name": option.name, "type": JSON_TYPES[option.type], "default": option.default, "help": option.help,
            "choices": list(option.choices), "minimum": option.minimum, "maximum": option.maximum}


def preload(catalogs: Mapping[str, Any]) -> None:
    """Load every model of the catalogues now (main models and companions), so that the first
    requests do not wait for a load and a model that cannot load fails before the server listens."""
    for catalog in catalogs.values():
        for name in catalog.names:
            catalog.pipeline(name)


# --------------------------------------------------------------------------------------------
# The service
# --------------------------------------------------------------------------------------------


class Service(ImageRoutes, ChatRoutes, SpeechRoutes, VideoRoutes, VideoStreamRoutes):
    """The server's state and route handlers: catalogues, settings, metrics, admission, jobs."""

    def __init__(self, catalogs: Mapping[str, Any], settings: ServerSettings = ServerSettings(),
                 board: Optional[JobBoard] = None):
        self.services = services()
        self.catalogs = {m: catalogs[m] for m in self.services if m in catalogs}
        self.board = board  # where other copies of the server read this one's video jobs (`apps/job_board.py`)
        self.settings = settings
        self.metrics = ServerMetrics({m: self.services[m].unit for m in self.catalogs})
        slots = {m: max(1, int(getattr(c, "continuous_batch", 0) or 0)) for m, c in self.catalogs.items()}
        self.admission = Admission(settings.max_queue, self.metrics, slots,
                                   {m: list(c.main) for m, c in self.catalogs.items()})
        threads = sum(slots[m] * len(c.main) for m, c in self.catalogs.items()) + SPARE_THREADS
        self.limiter = anyio.CapacityLimiter(threads)  # above every slot's thread: a stream can always take its next step
        self.jobs: dict[str, VideoJob] = {}
        self.created = int(time.time())
        self.info: dict[str, dict] = {}

    async def thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self.limiter)

    def find(self, modality: str, name: Optional[str]) -> tuple[Any, str]:
        """The catalogue and main model a request names (default: the modality's first); 404 otherwise."""
        catalog = self.catalogs.get(modality)
        if catalog is None:
            raise ApiError(404, f"this server serves no {self.services[modality].noun} models", param="model",
                           code="model_not_found")
        if name is None:
            return catalog, next(iter(catalog.main))
        if name not in catalog.main:
            other = next((self.services[m].noun for m, c in self.catalogs.items() if name in c.main), None)
            hint = f" ({shown(name)} is a{'n' if other[0] in 'aeiou' else ''} {other} model)" if other else ""
            raise ApiError(404, f"model {shown(name)} does not exist here{hint}; this route serves {list(catalog.main)}",
                           param="model", code="model_not_found")
        return catalog, name

    def checker(self, modality: str, request: Any, catalog: Any) -> Callable[[], Any]:
        """The request layer's check of `request` (`ModalityService.check`) within this server's
        limits (its settings named as the service's `limits`), for `admitted` or a worker thread."""
        found = self.services[modality]
        return partial(found.check, request, catalog, **found.bounds(vars(self.settings)))

    def seed(self, value: Optional[int]) -> int:
        """The request's seed, or a fresh one (reported back, so that the output can be made again)."""
        return secrets.randbelow(MAX_SEED + 1) if value is None else value

    async def admitted(self, ticket: Ticket, check: Callable[[], Any]) -> Any:
        """Check an admitted request with the request layer's check (`checker`: 400 before any
        model work), then wait for its model's slot; the ticket is given up when either fails.
        Returns the checked request."""
        try:
            checked = await self.thread(check)
            await ticket.start()
        except BaseException:
            ticket.done()
            raise
        return checked

    def stream_error(self, error: BaseException) -> dict:
        """An error met after a stream began, as the one event that ends it."""
        if isinstance(error, ApiError):
            return error.body()
        if isinstance(error, ValueError):
            return error_body(one_line(str(error)))
        log.error("a streamed request failed", exc_info=error)
        return error_body("the server failed while streaming this response; see its log", "server_error")

    # ---- models, health, metrics -----------------------------------------------------------

    async def models(self) -> JSONResponse:
        data = []
        for modality, catalog in self.catalogs.items():
            for name in catalog.main:
                if name not in self.info:
                    self.info[name] = await self.thread(self._model_info, catalog, name)
                data.append({"id": name, "object": "model", "created": self.created, "owned_by": "mmgen",
                             "modality": modality, "route": main_route(modality), **self.info[name]})
        return JSONResponse({"object": "list", "data": data})

    @staticmethod
    def _model_info(catalog: Any, name: str) -> dict:
        companions = [c for c in catalog.companions if c.startswith(name + "-")]
        family = registry.pipeline_family(catalog.pipeline(name))
        return {"companions": companions, "decoding": catalog.methods(name), "default_decoding": catalog.default_method(name),
                "options": [option_entry(option) for option in (family.options if family is not None else ())]}

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def shutdown(self) -> None:
        """Stop the video jobs still queued or running (each stops at its next block)."""
        tasks = [job.task for job in self.jobs.values() if job.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def create_app(catalogs: Mapping[str, Any], settings: ServerSettings = ServerSettings(),
               board: Optional[JobBoard] = None) -> FastAPI:
    """The FastAPI app serving `catalogs` (modality -> catalogue, as `discover_catalogs` gives);
    `board`: where its video jobs are published to, and others' read, when several copies of
    the server share the requests (`apps/job_board.py`)."""
    service = Service(catalogs, settings, board)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await service.shutdown()

    app = FastAPI(title="mmgen", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = f"no route {request.method} {shown(request.url.path)}"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {shown(request.url.path)}"
        else:
            message = one_line(str(error.detail))
        return error_response(error.status_code, message, code=None, headers=getattr(error, "headers", None))

    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        message, where = validation_message(error.errors())
        return error_response(400, message, param=where)

    async def value_error(request: Request, error: ValueError) -> JSONResponse:
        return error_response(400, one_line(str(error)))

    async def client_gone(request: Request, error: ClientDisconnect) -> Response:
        """The client went away while sending its body: no one to answer, nothing to log."""
        service.metrics.rejected.labels("client_gone").inc()
        return Response(status_code=CLIENT_GONE)

    async def server_error(request: Request, error: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return error_response(500, "the server failed to answer this request; see its log", "server_error")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ValueError, value_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, server_error)
    app.add_middleware(Guard, service=service, modality_of=admitting_routes(service.services))

    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.prometheus, methods=["GET"])
    app.add_api_route("/v1/models", service.models, methods=["GET"])
    for modality in service.services:  # every registered modality's routes: one it does not serve answers 404
        for route in routes_of(modality):
            handler = route.handler.__get__(service)  # a function of (service, request), bound
            if route.method == "WEBSOCKET":
                app.add_api_websocket_route(route.path, handler)
            else:
                app.add_api_route(route.path, handler, methods=[route.method])
    return app


def _version() -> str:
    import mmgen

    return str(getattr(mmgen, "__version__", "0"))


__all__ = ["ApiError", "ServerSettings", "Service", "create_app", "discover_catalogs", "preload",
           "wav_header", "pcm16"]
