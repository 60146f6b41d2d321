"""`/v1/videos/stream`: a live video over a WebSocket, block by block for as long as the client
reads it, steered by new prompts on the same connection.

The client's first message (JSON text) says what to stream: `{"prompt", "model", "seed",
"cache_policy", "decoding", "large_steps", "cache_threshold", "drop_threshold", "max_blocks",
"realtime"}`, checked by the request layer (`video.check_stream`) before any work; a bad one is answered with
one JSON error in OpenAI's shape and the connection is closed (1008; 1013 when the queue is
full). The stream then waits for its model's slot like a `/v1/videos` job (they share the
admission queue, so a job and a stream of one model take turns), and the server sends:

    {"object": "video.stream", ...}        once the model is taken: the settings it runs with
    {"object": "video.block", "block", "first_frame", "num_frames", "height", "width", "fps",
     "format": "rgb24", "prompt", "seconds"}
    then num_frames binary messages        each frame's height·width·3 bytes, RGB, row by row
    {"object": "video.prompt", "prompt"}   a new prompt was taken: the next block not yet started follows it
    {"object": "video.stream.done", "blocks", "reason"}   the blocks sent; then the server closes (1000)

and takes `{"prompt": "..."}` (at any time, as often as wanted: the last one before a block
wins; a bad one is one JSON error and the stream runs on) and `{"close": true}`. A stream ends
at the client's close, its `max_blocks` (at most the server's `max_stream_blocks`), or the
server's `max_stream_seconds`; a client that goes away ends it likewise. A stream runs as fast as
its model makes blocks, or with `"realtime": true` one block ahead of a viewer playing it at the
video's frame rate (block n is made once block n − 1 starts playing), so that a new prompt shows
within two blocks whatever the model's speed. However it ends, the stream is closed and the
model freed within the block being made, before the last message goes out. The model runs in
worker threads; the event loop only relays.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Optional

import anyio
from fastapi import WebSocket
from pydantic import BaseModel, ValidationError
from starlette.websockets import WebSocketDisconnect

from mmgen.apps.requests import video
from mmgen.apps.requests.service import request_of

from .admission import Ticket
from .bodies import StreamControl, VideoStreamBody, check_plain_fields
from .errors import ApiError, error_body, one_line, validation_message
from .routes import Route, register_routes
from .streams import Timing

ROUTE = "/v1/videos/stream"
FORMAT = "rgb24"  # each frame: height·width·3 bytes, RGB, row by row (a browser draws it through ImageData)
#: WebSocket close codes: done, a refused request, a full queue (retry later), a failure.
NORMAL, REFUSED, TRY_LATER, FAILED = 1000, 1008, 1013, 1011


class Gone(Exception):
    """The client went away (or closed its side): there is no one to send to."""


class StreamSession:
    """One connection's live stream: its socket (sends serialised, so that a block's header and
    frames are never split by another message), its `LiveVideo` once open, and why it ends."""

    def __init__(self, websocket: WebSocket):
        self.websocket = websocket
        self.sending = asyncio.Lock()
        self.stop = asyncio.Event()  # the client closed or went away
        self.reason = "closed"
        self.sent = 0  # blocks sent
        self.realtime = False  # pace the blocks to the video's frame rate
        self.live: Optional[video.LiveVideo] = None
        self.pending: Optional[str] = None  # a prompt sent before the stream opened

    async def send(self, *messages: Any) -> None:
        """Send JSON objects (dicts) and binary frames (bytes) back to back."""
        try:
            async with self.sending:
                for message in messages:
                    if isinstance(message, bytes):
                        await self.websocket.send_bytes(message)
                    else:
                        await self.websocket.send_text(json.dumps(message))
        except (WebSocketDisconnect, RuntimeError, OSError) as error:  # the socket closed under us
            self.stop.set()
            raise Gone() from error

    async def waited(self, seconds: float) -> bool:
        """Wait `seconds` unless the client stops the stream first; whether it did."""
        if seconds > 0:
            try:
                await asyncio.wait_for(self.stop.wait(), seconds)
            except asyncio.TimeoutError:
                pass
        return self.stop.is_set()

    async def receive(self) -> Optional[str]:
        """The client's next text message; None once it has gone away or closed."""
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            self.stop.set()
            return None
        if message.get("text") is None:
            raise ApiError(400, "send JSON text messages (this stream takes no binary messages)")
        return message["text"]


def parsed(text: str, model: type[BaseModel]) -> Any:
    """A message's JSON as `model` (an ApiError naming the first bad field otherwise)."""
    try:
        return model.model_validate_json(text)
    except ValidationError as error:
        message, where = validation_message(error.errors(include_url=False, include_input=False))
        raise ApiError(400, message.replace("the request body", "the message"), param=where) from None


class VideoStreamRoutes:
    """The live video route of `Service` (a mixin: it uses the service's catalogues, admission,
    threads, settings and metrics)."""

    async def video_stream(self, websocket: WebSocket) -> None:
        await websocket.accept()
        session = StreamSession(websocket)
        try:
            ticket, checked, catalog = await self._stream_request(session)
        except Gone:
            return
        except (ApiError, ValueError) as error:
            body = error.body() if isinstance(error, ApiError) else error_body(one_line(str(error)))
            code = TRY_LATER if isinstance(error, ApiError) and error.status == 429 else REFUSED
            await self._end(session, code, body)
            return
        control = asyncio.get_running_loop().create_task(self._controls(session))
        try:
            await self._run_stream(session, ticket, checked, catalog)
        finally:
            control.cancel()
            await asyncio.gather(control, return_exceptions=True)

    async def _stream_request(self, session: StreamSession) -> tuple[Ticket, video.CheckedStream, Any]:
        """The first message, checked (before any work) and admitted: (ticket, checked request, catalogue)."""
        try:
            text = await asyncio.wait_for(session.receive(), self.settings.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the first message did not arrive within {self.settings.body_timeout_s:g} s",
                           code="request_timeout") from None
        if text is None:
            raise Gone()
        body: VideoStreamBody = parsed(text, VideoStreamBody)
        check_plain_fields(body, "prompt")
        session.realtime = bool(body.realtime)
        catalog, model = self.find("video", body.model)
        method = body.decoding or await self.thread(catalog.default_method, model)
        ask = request_of(video.StreamRequest, model=model, prompt=body.prompt, cache_policy=body.cache_policy,
                         method=method, large_steps=body.large_steps, cache_threshold=body.cache_threshold,
                         drop_threshold=body.drop_threshold, seed=self.seed(body.seed), max_blocks=body.max_blocks)
        checked = await self.thread(video.check_stream, ask, catalog, self.settings.max_stream_blocks)
        return self.admission.admit("video", model), checked, catalog

    async def _run_stream(self, session: StreamSession, ticket: Ticket, checked: video.CheckedStream, catalog: Any) -> None:
        """Wait for the model (unless the client leaves first), open the stream, relay its blocks."""
        timing, frames = Timing(self.metrics, "video"), 0
        ending: Optional[tuple[int, dict]] = None
        try:
            waiting = asyncio.ensure_future(ticket.start())
            stopped = asyncio.ensure_future(session.stop.wait())
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not waiting.done():  # the client closed or left while the stream waited for its model
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                ending = (NORMAL, {"object": "video.stream.done", "blocks": 0, "reason": session.reason})
                return
            with anyio.CancelScope(shield=True):  # opened, it must be kept to be closed
                session.live = live = await self.thread(video.LiveVideo, checked, catalog)
            if session.pending is not None:
                await self.thread(live.set_prompt, session.pending)
            v = checked.video
            await session.send({"object": "video.stream", "model": v.request.model, "seed": v.seed,
                                "cache_policy": v.cache_policy, "decoding": v.label, "block_frames": v.pipe.block_frames,
                                "fps": live.fps, "height": v.pipe.height, "width": v.pipe.width,
                                "max_blocks": live.max_blocks, "realtime": session.realtime, "format": FORMAT})
            playing: Optional[float] = None  # when the first block went out: a player starts it then
            last = 0  # the first frame of the last block sent
            while not session.stop.is_set():
                if time.perf_counter() - live.started > self.settings.max_stream_seconds:
                    session.reason = "max_seconds"
                    break
                if live.blocks >= live.max_blocks:
                    session.reason = "max_blocks"
                    break
                # realtime: block n is made once block n - 1 starts playing (one block ahead of the viewer)
                if session.realtime and playing is not None and await session.waited(playing + last / live.fps
                                                                                     - time.perf_counter()):
                    break
                block = await self.thread(live.next)
                if session.stop.is_set():  # the client closed while the block was made: it wants no more
                    break
                if block is None:  # closed under it (the server stopping)
                    break
                timing.first_output()
                frames += len(block.frames)
                t, h, w = block.frames.shape[:3]
                await session.send({"object": "video.block", "block": block.index, "first_frame": block.start,
                                    "num_frames": t, "height": h, "width": w, "fps": live.fps, "format": FORMAT,
                                    "prompt": block.prompt, "seconds": round(block.seconds, 4)},
                                   *(frame.tobytes() for frame in block.frames))
                session.sent += 1
                playing, last = playing or time.perf_counter(), block.start
            ending = (NORMAL, {"object": "video.stream.done", "blocks": session.sent, "reason": session.reason})
        except Gone:
            pass
        except Exception as error:  # the model failed mid-stream: one error, then the connection ends
            ending = (FAILED, self.stream_error(error))
        finally:  # the model is free before the last message goes: a client may start the next request on it
            with anyio.CancelScope(shield=True):  # even when cancelled (the server stopping)
                if session.live is not None:
                    await self.thread(session.live.close)  # waits for a block being made
            ticket.done()
            timing.end(frames)
            if ending is not None:
                await self._end(session, *ending)

    async def _controls(self, session: StreamSession) -> None:
        """The client's messages after the first: new prompts and close, until it leaves."""
        while True:
            try:
                text = await session.receive()
                if text is None:
                    return
                control: StreamControl = parsed(text, StreamControl)
                if control.close:
                    session.stop.set()
                    return
                if control.prompt is None:
                    raise ApiError(400, 'send {"prompt": "..."} to steer the stream or {"close": true} to end it')
                check_plain_fields(control, "prompt")
                if session.live is None:  # still waiting for the model: the first block follows it
                    session.pending = video.LiveVideo.checked_prompt(control.prompt)
                    taken = session.pending
                else:
                    taken = await self.thread(session.live.set_prompt, control.prompt)
                await session.send({"object": "video.prompt", "prompt": taken})
            except (ApiError, ValueError) as error:  # a refused prompt: the stream runs on with its own
                body = error.body() if isinstance(error, ApiError) else error_body(one_line(str(error)), param="prompt")
                try:
                    await session.send(body)
                except Gone:
                    return
            except Gone:
                return

    async def _end(self, session: StreamSession, code: int, last: dict) -> None:
        """Send the last message and close the connection (nothing, if the client has gone)."""
        try:
            await session.send(last)
            await session.websocket.close(code)
        except (Gone, RuntimeError, OSError):
            pass


register_routes("video", Route("WEBSOCKET", ROUTE, VideoStreamRoutes.video_stream))
