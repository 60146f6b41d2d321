"""`POST /v1/videos` and its jobs: status, content (the MP4) and events (blocks as they commit),
here or, through a job board, on another copy of the server."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image

from mmgen.apps.http.admission import Ticket
from mmgen.apps.http.bodies import VideoBody, check_plain_fields, parse_form_or_json
from mmgen.apps.http.encoders import png_base64
from mmgen.apps.http.errors import ApiError
from mmgen.apps.http.routes import Route, register_routes
from mmgen.apps.http.streams import END, Pull, Timing
from mmgen.apps.requests import video
from mmgen.apps.requests.bounds import shown

EVENT_POLL_S = 0.05  # how often a video job's event stream looks for a newly committed block


@dataclass
class VideoJob:
    """A `/v1/videos` job: queued, in_progress, completed (its MP4 kept) or failed."""

    id: str
    model: str
    prompt: str
    seed: int
    num_frames: int
    fps: float
    size: str
    num_blocks: int
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    blocks_done: int = 0
    completed_at: Optional[int] = None
    error: Optional[dict] = None
    mp4: Optional[bytes] = None
    task: Optional[asyncio.Task] = None
    #: Each committed block, as `/v1/videos/{id}/events` sends it: its index, frame range,
    #: seconds since the job started and its frames as base64 PNGs (none when decoded at the end).
    blocks: list = field(default_factory=list)

    def view(self) -> dict:
        """The job as OpenAI's video object, with mmgen's fields: progress in blocks, frames, seed."""
        percent = 100 if self.status == "completed" else int(100 * self.blocks_done / self.num_blocks) if self.num_blocks else 0
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status, "progress": percent,
                "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": None, "error": self.error,
                "prompt": self.prompt, "remixed_from_video_id": None, "seconds": f"{self.num_frames / self.fps:g}",
                "size": self.size, "blocks_done": self.blocks_done, "num_blocks": self.num_blocks,
                "num_frames": self.num_frames, "seed": self.seed}



class VideoRoutes:
    """The video routes of `Service` (a mixin: it uses the service's catalogues, admission, threads and board)."""

    async def create_video(self, request: Request) -> JSONResponse:
        body: VideoBody = await parse_form_or_json(request, VideoBody)
        check_plain_fields(body, "prompt")
        timing = Timing(self.metrics, "video")
        catalog, model = self.find("video", body.model)
        pipe = await self.thread(catalog.main_pipeline, model)
        size = f"{pipe.width}x{pipe.height}"
        if body.size not in (None, size):
            raise ApiError(400, f"size must be {size} (the model's), got {shown(body.size)}", param="size")
        offered = video.lengths(pipe, self.settings.max_frames)
        from_seconds = self._frames_for(body.seconds, offered, float(pipe.fps))  # checked even when num_frames is given
        frames = body.num_frames if body.num_frames is not None else from_seconds
        if frames is None:
            frames = video.default_length(pipe, offered) or pipe.num_frames
        seed = self.seed(body.seed)
        method = body.decoding or await self.thread(catalog.default_method, model)
        ask = video.SERVICE.parse(model=model, prompt=body.prompt, num_frames=frames, method=method,
                                  large_steps=body.large_steps, cache_policy=body.cache_policy,
                                  cache_threshold=body.cache_threshold, drop_threshold=body.drop_threshold, seed=seed,
                                  family_options=body.options)
        ticket = self.admission.admit("video", model)
        try:
            checked = await self.thread(self.checker("video", ask, catalog))
        except BaseException:
            ticket.done()
            raise  # the job waits for its slot in the background (`_run_video`)
        blocks = math.ceil(pipe.latent_frames(frames) / pipe.block_frames)
        job = VideoJob(f"video_{uuid.uuid4().hex}", model, ask.prompt, seed, frames, float(pipe.fps), size, blocks)
        self._keep(job)
        await self._publish(job)
        job.task = asyncio.get_running_loop().create_task(self._run_video(job, ticket, timing,
                                                                            partial(video.SERVICE.stream, checked, catalog)))
        return JSONResponse(job.view())

    @staticmethod
    def _frames_for(seconds: Any, offered: list[int], fps: float) -> Optional[int]:
        """The offered length nearest `seconds` of video (OpenAI's field), or None when not given."""
        if seconds is None:
            return None
        try:
            wanted = float(seconds)
        except (TypeError, ValueError):
            wanted = float("nan")
        if not math.isfinite(wanted) or wanted <= 0:
            raise ApiError(400, f"seconds must be a positive number, got {shown(seconds)}", param="seconds")
        if not offered or wanted * fps > offered[-1] + (offered[1] - offered[0] if len(offered) > 1 else 1):
            longest = offered[-1] / fps if offered else 0
            raise ApiError(400, f"seconds must be at most {longest:g} for this model on this server, got {wanted:g}",
                           param="seconds")
        return min(offered, key=lambda n: (abs(n - wanted * fps), n))

    def _keep(self, job: VideoJob) -> None:
        """Store a new job; the oldest finished ones beyond `max_finished_jobs` are dropped."""
        self.jobs[job.id] = job
        finished = [j for j in self.jobs.values() if j.status in ("completed", "failed")]
        for old in finished[: max(0, len(finished) - self.settings.max_finished_jobs)]:
            del self.jobs[old.id]

    async def _run_video(self, job: VideoJob, ticket: Ticket, timing: Timing, begin: Callable[[], Any]) -> None:
        pull: Optional[Pull] = None
        try:
            await ticket.start()
            job.status = "in_progress"
            await self._publish(job)
            pull = Pull(begin(), self.limiter)
            while (item := await pull.next()) is not END:
                timing.first_output()
                frames = [] if item.frames is None else await self.thread(
                    lambda: [png_base64(Image.fromarray(frame)) for frame in item.frames])
                job.blocks.append({"block": item.index, "num_blocks": item.num_blocks, "start_frame": item.start,
                                   "end_frame": item.start + len(frames), "seconds": round(item.seconds, 4),
                                   "frames": frames})
                job.blocks_done, job.num_blocks = item.index + 1, item.num_blocks
                await self._publish(job, job.blocks[-1:])
            result = pull.result
            job.mp4 = await self.thread(result.mp4)
            job.status, job.completed_at = "completed", int(time.time())
            timing.end(int(result.frames.shape[0]))
        except asyncio.CancelledError:
            job.status, job.error = "failed", {"code": "cancelled", "message": "the server stopped before the video was made"}
            raise
        except Exception as error:
            body = self.stream_error(error)["error"]
            job.status, job.error = "failed", {"code": body["code"] or body["type"], "message": body["message"]}
        finally:
            if pull is not None:
                await pull.close()
            ticket.done()
            job.task = None
            self._keep(job)
            await asyncio.shield(self._publish(job, mp4=job.mp4))  # the last word, even when cancelled

    async def _publish(self, job: VideoJob, blocks: Optional[list] = None, mp4: Optional[bytes] = None) -> None:
        """Show the job's change to the other copies of the server, where there are any."""
        if self.board is not None:
            await self.board.publish(job.id, job.view(), blocks, mp4)

    async def job(self, video_id: str) -> Union[VideoJob, dict]:
        """This server's job, else the one another copy published ({"view", "blocks"}); 404 for neither."""
        job = self.jobs.get(video_id)
        if job is None and self.board is not None:
            job = await self.board.read(video_id)
        if job is None:
            raise ApiError(404, f"no video job {shown(video_id)} on this server (finished jobs are kept for a while)",
                           param="video_id", code="not_found")
        return job

    async def video_status(self, video_id: str) -> JSONResponse:
        job = await self.job(video_id)
        return JSONResponse(job["view"] if isinstance(job, dict) else job.view())

    async def video_events(self, video_id: str) -> StreamingResponse:
        """The job's blocks as server-sent events, each as it commits (those already committed
        first), then one event with the job's final state and `data: [DONE]`: a viewer shows
        the video while it is made. A client that goes away stops only its own stream. A job
        another copy of the server runs is followed on the board it publishes to."""
        job = await self.job(video_id)

        async def state(sent: int) -> Optional[tuple[dict, list]]:
            """(the job's view, its blocks from `sent` on); the view is read first, so no block
            committed before a final view is missed. None once the board has dropped the job."""
            if isinstance(job, VideoJob):
                return job.view(), job.blocks[sent:]
            published = await self.board.read(video_id, sent)
            return None if published is None else (published["view"], published["blocks"])

        async def events() -> AsyncIterator[str]:
            sent, view = 0, None
            while (snapshot := await state(sent)) is not None:
                view, blocks = snapshot
                for block in blocks:
                    yield f"data: {json.dumps({'object': 'video.block', 'id': video_id, **block})}\n\n"
                sent += len(blocks)
                if view["status"] in ("completed", "failed"):
                    break
                await asyncio.sleep(EVENT_POLL_S)
            if view is not None:
                yield f"data: {json.dumps({**view, 'object': 'video.done'})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def video_content(self, video_id: str, variant: Optional[str] = None) -> Response:
        job = await self.job(video_id)
        if variant not in (None, "video"):
            raise ApiError(400, f"variant must be video (the MP4), got {shown(variant)}", param="variant")
        status = job["view"]["status"] if isinstance(job, dict) else job.status
        mp4 = (await self.board.content(video_id)) if isinstance(job, dict) else job.mp4
        if status != "completed" or mp4 is None:
            raise ApiError(409, f"video {video_id} is {status}, not completed", param="video_id", code="video_not_ready")
        return Response(mp4, media_type="video/mp4")



register_routes("video", Route("POST", "/v1/videos", VideoRoutes.create_video),
                Route("GET", "/v1/videos/{video_id}", VideoRoutes.video_status),
                Route("GET", "/v1/videos/{video_id}/content", VideoRoutes.video_content),
                Route("GET", "/v1/videos/{video_id}/events", VideoRoutes.video_events))
