"""Connections to `mmgen serve`: how many may be open, and how long one may take to send its
headers. uvicorn bounds the idle time between requests (`timeout_keep_alive`) but not the time a
request's headers take, so a client that trickles them would hold its connection (and a file
descriptor) forever, and enough such clients would starve the server before any API key is
checked. `GuardedH11Protocol` closes a connection whose headers are not complete within
`header_timeout_s` of their first byte (or of the connection), and one opened past
`max_connections`; `uvicorn_options` gives uvicorn these and its own limits.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import ServerSettings

#: A WebSocket message a client sends, at most: a live stream's messages are a prompt and its settings.
WS_MAX_BYTES = 64 * 1024


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout and a connection limit."""

    def __init__(self, *args: Any, header_timeout_s: float, max_connections: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.header_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # past the limit: closed before anything is read
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are complete: its body has its own timeout
            self._disarm()
        elif self.cycle is None or self.cycle.response_complete:  # the next request's headers are coming
            self._arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """uvicorn.Config's arguments that bound connections as `settings` say."""
    return {"http": partial(GuardedH11Protocol, header_timeout_s=settings.header_timeout_s,
                            max_connections=settings.max_connections),
            "limit_concurrency": settings.max_connections, "timeout_keep_alive": settings.keep_alive_s,
            "ws_max_size": WS_MAX_BYTES}
