"""The ASGI guard in front of every route of `mmgen serve`. Before a body is read it checks the
API key (all routes but /health), the body's declared size, the waiting room (a request whose
every model would have to wait while the queue is full is refused before its body is read), and
the bytes of bodies the server holds at once: each request reserves its body's bytes until its
response ends, so concurrent large bodies cannot grow memory past `max_body_bytes_in_flight`.
While a body is read it must keep to its size and arrive within `body_timeout_s`. Every response
is counted by route and status. A WebSocket's handshake needs the API key too (`/v1/videos/stream`).
"""

from __future__ import annotations

import hmac
import time
from typing import Any, Callable, Mapping, Optional

import anyio
from fastapi.responses import Response
from starlette.websockets import WebSocket

from .errors import ApiError, error_response


class BodyBudget:
    """The bytes of request bodies the server holds at once, at most `limit`."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, size: int) -> bool:
        """Reserve `size` bytes; False (nothing reserved) when they do not fit."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class Guard:
    """ASGI middleware over the app: refusals before a body is read, bounds while it is read, and
    the response count by route and status. `modality_of` maps a POST route to the modality
    whose models it serves (for the waiting room's check)."""

    def __init__(self, app: Any, service: Any, modality_of: Mapping[str, str]):
        self.app, self.service, self.modality_of = app, service, dict(modality_of)
        key = service.settings.api_key
        self.key = None if key is None else key.encode()
        self.budget = BodyBudget(service.settings.max_body_bytes_in_flight)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            return await self.websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}
        reserved = {"bytes": 0}

        async def counted_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope, reserved)
            if refusal is not None:
                return await refusal(scope, receive, counted_send)
            await self.app(scope, self.bounded(receive, reserved), counted_send)
        finally:
            self.budget.give(reserved["bytes"])
            route = scope.get("route")
            self.service.metrics.responses.labels(getattr(route, "path", "unrouted"), str(status["code"])).inc()

    async def websocket(self, scope: Any, receive: Any, send: Any) -> None:
        """A WebSocket needs the API key too (in its handshake's headers): without it, the
        handshake is answered with the 401 JSON error (or, where the server cannot send an HTTP
        answer to a handshake, closed with 1008) and no route runs."""
        refusal = self.unauthorized(dict(scope.get("headers") or []), scope["path"])
        if refusal is None:
            return await self.app(scope, receive, send)
        socket = WebSocket(scope, receive, send)
        if "websocket.http.response" in scope.get("extensions", {}):
            await socket.send_denial_response(refusal)
        else:
            await socket.close(1008, "missing or wrong API key")
        self.service.metrics.responses.labels(scope["path"], "401").inc()

    def unauthorized(self, headers: dict, path: str) -> Optional[Response]:
        """The 401 for a request to `path` without the server's API key, or None."""
        if self.key is None or path == "/health":
            return None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        self.service.metrics.rejected.labels("unauthorized").inc()
        return error_response(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'",
                              param=None, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def refusal(self, scope: Any, reserved: dict) -> Optional[Response]:
        """The response refusing this request before its body is read, or None (its declared
        body's bytes then reserved in `reserved`)."""
        headers = dict(scope.get("headers") or [])
        metrics, settings = self.service.metrics, self.service.settings
        unauthorized = self.unauthorized(headers, scope["path"])
        if unauthorized is not None:
            return unauthorized
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return error_response(400, "the Content-Length header is not a number")
            if int(length) > settings.max_body_bytes:
                metrics.rejected.labels("too_large").inc()
                return error_response(413, f"the request body is {int(length)} bytes; this server takes at most "
                                           f"{settings.max_body_bytes}", code="request_too_large")
        modality = self.modality_of.get(scope["path"]) if scope.get("method") == "POST" else None
        if modality is not None and self.service.admission.full(modality):
            metrics.rejected.labels("queue_full").inc()
            return self.busy(f"the server's queue is full ({settings.max_queue} requests waiting)", "queue_full",
                             self.service.admission.retry_after(modality))
        if length is not None and int(length):
            if not self.budget.take(int(length)):
                metrics.rejected.labels("bodies_in_flight").inc()
                return self.busy(f"the server holds as many request bodies as it takes "
                                 f"({settings.max_body_bytes_in_flight} bytes)", "server_busy", 1)
            reserved["bytes"] = int(length)
        return None

    @staticmethod
    def busy(why: str, code: str, retry: int) -> Response:
        return error_response(429, f"{why}; retry in {retry} s", type="rate_limit_error", code=code,
                              headers={"Retry-After": str(retry), "Connection": "close"})

    def bounded(self, receive: Callable, reserved: dict) -> Callable:
        """`receive`, with the body bounded: at most `max_body_bytes` (a body without a length
        reserves its bytes as they come), all of it within `body_timeout_s` of the request's
        headers. Past either: an ApiError (413, 429 or 408) that ends the request."""
        settings, metrics = self.service.settings, self.service.metrics
        limit, deadline = settings.max_body_bytes, time.monotonic() + settings.body_timeout_s
        seen = {"bytes": 0, "done": False}

        async def read() -> Any:
            if seen["done"]:  # the body is in: what follows is the client going away, whenever it does
                return await receive()
            try:
                with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                metrics.rejected.labels("body_timeout").inc()
                raise ApiError(408, f"the request body did not arrive within {settings.body_timeout_s:g} s",
                               code="request_timeout", headers={"Connection": "close"}) from None
            if message["type"] != "http.request":
                return message
            seen["done"] = not message.get("more_body", False)
            size = len(message.get("body", b""))
            seen["bytes"] += size
            if seen["bytes"] > limit:
                metrics.rejected.labels("too_large").inc()
                raise ApiError(413, f"the request body is over {limit} bytes, the most this server takes",
                               code="request_too_large", headers={"Connection": "close"})
            unreserved = seen["bytes"] - reserved["bytes"]
            if unreserved > 0:  # no Content-Length: reserve as it comes
                if not self.budget.take(unreserved):
                    metrics.rejected.labels("bodies_in_flight").inc()
                    raise ApiError(429, "the server holds as many request bodies as it takes; retry in 1 s",
                                   type="rate_limit_error", code="server_busy",
                                   headers={"Retry-After": "1", "Connection": "close"})
                reserved["bytes"] += unreserved
            return message

        return read

