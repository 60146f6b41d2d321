"""Video jobs that every copy of the server can answer for (`mmgen serve --ray --replicas N`).

A `/v1/videos` job runs in the replica that took its POST, but Ray Serve's proxy sends the
client's later GETs (status, events, content) to any replica. The replica that runs a job
publishes each change to a `JobBoard` (the job's OpenAI view, each committed block, the MP4 at
the end); a replica asked about a job it does not hold reads the board. Under Ray the board's
`JobShelf` lives in one named actor all replicas share (`apps/ray_serve.py`); a single server
needs none (its jobs are its own), and tests share one shelf between two apps in a process.

The shelf keeps at most `keep` finished jobs (the oldest go first), as a server keeps its own.
"""

from __future__ import annotations

from typing import Any, Optional

#: The name of the Ray actor holding the replicas' shared shelf.
ACTOR_NAME = "mmgen-video-jobs"


class JobShelf:
    """Published jobs: job id -> its latest view, its committed blocks and, once made, its MP4."""

    def __init__(self, keep: int):
        self.keep, self.jobs = keep, {}

    def publish(self, job_id: str, view: dict, blocks: Optional[list] = None, mp4: Optional[bytes] = None) -> None:
        """The job's new view, with the blocks committed since the last publish and its MP4."""
        job = self.jobs.setdefault(job_id, {"view": view, "blocks": [], "mp4": None})
        job["view"] = view
        job["blocks"].extend(blocks or [])
        if mp4 is not None:
            job["mp4"] = mp4
        finished = [key for key, j in self.jobs.items() if j["view"]["status"] in ("completed", "failed")]
        for key in finished[: max(0, len(finished) - self.keep)]:
            del self.jobs[key]

    def read(self, job_id: str, start: int = 0) -> Optional[dict]:
        """{"view", "blocks" from index `start` on} of a published job; None for an unknown one."""
        job = self.jobs.get(job_id)
        return None if job is None else {"view": job["view"], "blocks": job["blocks"][start:]}

    def content(self, job_id: str) -> Optional[bytes]:
        """A published job's MP4 (None before it is made, or for an unknown job)."""
        job = self.jobs.get(job_id)
        return None if job is None else job["mp4"]


class JobBoard:
    """A server's access to a `JobShelf`: one in this process (`shelf`) or a Ray actor's
    (`actor`, a handle to `ray.remote(JobShelf)`), both awaited the same way."""

    def __init__(self, shelf: Optional[JobShelf] = None, actor: Any = None):
        if (shelf is None) == (actor is None):
            raise ValueError("a JobBoard reads one shelf: pass shelf= or actor=")
        self.shelf, self.actor = shelf, actor

    async def _call(self, method: str, *args: Any) -> Any:
        if self.actor is not None:
            return await getattr(self.actor, method).remote(*args)
        return getattr(self.shelf, method)(*args)

    async def publish(self, job_id: str, view: dict, blocks: Optional[list] = None, mp4: Optional[bytes] = None) -> None:
        await self._call("publish", job_id, view, blocks, mp4)

    async def read(self, job_id: str, start: int = 0) -> Optional[dict]:
        return await self._call("read", job_id, start)

    async def content(self, job_id: str) -> Optional[bytes]:
        return await self._call("content", job_id)
