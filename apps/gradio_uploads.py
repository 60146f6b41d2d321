"""Bounds on what Gradio's upload route takes from the demos' clients. Gradio serves
`/gradio_api/upload` for every app, even one without an upload widget, and to any client, before
any run; by itself it keeps each file for an hour and leaves them behind when the demo stops. So:
each file at most the request layer's upload limit (`max_file_size`, refused with 413 before it
reaches the disk), each client at most `UPLOADS_PER_MINUTE` uploads a minute (429 beyond), and a
demo's uploads deleted when it stops and when the process exits (`remove_uploads`), besides
Gradio's own sweep of files older than `CACHE_SECONDS`.
"""

from __future__ import annotations

import atexit
import collections
import time
from pathlib import Path
from typing import Any, Callable

from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse

from mmgen.apps.requests.bounds import LIMITS

UPLOADS_PER_MINUTE = 30  # per client: a voice, a few images or videos a turn, with room to spare
MAX_CLIENTS = 4096  # clients remembered at once; the least recent beyond them are forgotten
#: Gradio's cache sweep (`gr.Blocks(delete_cache=...)`): every this many seconds, files older than it go.
CACHE_SECONDS = 600
WINDOW_S = 60.0


class UploadLimit:
    """ASGI middleware: at most `per_minute` uploads per client (by address) in any minute."""

    def __init__(self, app: Any, per_minute: int = UPLOADS_PER_MINUTE, clock: Callable[[], float] = time.monotonic):
        self.app, self.per_minute, self.clock = app, per_minute, clock
        self.recent: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and scope["path"].rstrip("/").endswith("/upload"):
            if not self.admit((scope.get("client") or ("unknown",))[0]):
                refusal = PlainTextResponse(f"too many uploads: at most {self.per_minute} a minute; retry in a minute",
                                            status_code=429, headers={"Retry-After": str(int(WINDOW_S))})
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def admit(self, client: str) -> bool:
        now = self.clock()
        times = self.recent.pop(client, None) or collections.deque()
        while times and times[0] <= now - WINDOW_S:
            times.popleft()
        admitted = len(times) < self.per_minute
        if admitted:
            times.append(now)
        self.recent[client] = times  # the most recent client last
        while len(self.recent) > MAX_CLIENTS:
            self.recent.popitem(last=False)
        return admitted


def remove_uploads(demo: Any) -> None:
    """Delete the files clients uploaded to `demo` (and the folders Gradio made for them, once empty)."""
    _remove(getattr(demo, "upload_file_set", set()))


def _remove(uploads: set) -> None:
    for name in list(uploads):
        path = Path(name)
        try:
            path.unlink(missing_ok=True)
            path.parent.rmdir()  # each upload has its own folder; another file in it keeps it
        except OSError:
            pass
    uploads.clear()


#: The upload sets (`Blocks.upload_file_set`) of the demos launched in this process, emptied at exit.
_LAUNCHED: list[set] = []


@atexit.register
def _remove_all() -> None:
    for uploads in _LAUNCHED:
        _remove(uploads)


def upload_bounds(demo: Any) -> dict[str, Any]:
    """`demo.launch` arguments that bound its uploads; its uploads are deleted at exit too."""
    if not any(uploads is demo.upload_file_set for uploads in _LAUNCHED):
        _LAUNCHED.append(demo.upload_file_set)
    return {"max_file_size": LIMITS.upload_bytes, "app_kwargs": {"middleware": [Middleware(UploadLimit)]}}


__all__ = ["CACHE_SECONDS", "UPLOADS_PER_MINUTE", "UploadLimit", "remove_uploads", "upload_bounds"]
