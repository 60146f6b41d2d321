"""Per-block timing and memory of a video decode: what a streaming user waits for."""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch


@dataclass
class VideoProfile:
    """`block_s[i]`: seconds from the previous block's end (or the decode's start) to block i's
    end, its streaming decode included; `first_block_s` is what a viewer waits before the first
    frames. `peak_memory_bytes`: on a GPU, CUDA's peak allocation during the call; on the CPU,
    the peak resident size during the call above the size at its start (Linux's resettable
    high-water mark, `CpuPeak`, so the weights loaded before the call do not count). `cache_bytes`: the transformer
    K/V cache(s) held during the decode."""

    block_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    frames: int = 0
    peak_memory_bytes: int = 0
    cache_bytes: int = 0

    @property
    def first_block_s(self) -> float:
        return self.block_s[0] if self.block_s else 0.0

    @property
    def frames_per_second(self) -> float:
        return self.frames / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(first_block_s=self.first_block_s, frames_per_second=self.frames_per_second)
        return out


def resident_bytes() -> int:
    """This process's resident size now (Linux /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)


def _high_water_bytes() -> Optional[int]:
    """VmHWM of /proc/self/status (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class CpuPeak:
    """Peak resident size of this process between `__init__` and `stop()`, above the size at
    the start. On Linux the kernel tracks it: writing 5 to /proc/self/clear_refs resets the
    high-water mark (VmHWM) to the current size, so nothing runs during the decode (this also
    lowers what `getrusage` reports as the process's peak from then on). Elsewhere a thread samples
    the resident size every 10 ms (a lower bound)."""

    def __init__(self, interval: float = 0.01):
        self.base = resident_bytes()
        self._thread: Optional[threading.Thread] = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.kernel = _high_water_bytes() is not None
        except OSError:
            self.kernel = False
        if not self.kernel:
            self.peak, self._done = self.base, threading.Event()
            self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True)
            self._thread.start()

    def _sample(self, interval: float) -> None:
        while not self._done.wait(interval):
            self.peak = max(self.peak, resident_bytes())

    def stop(self) -> int:
        if self.kernel:
            return max(0, (_high_water_bytes() or self.base) - self.base)
        self._done.set()
        self._thread.join()
        return max(self.peak, resident_bytes()) - self.base


class BlockProfiler:
    """`start()`, `block_done()` after each block, `finish(frames)` -> `VideoProfile`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.profile = VideoProfile()
        self._t0 = self._last = 0.0
        self._sampler: Optional[CpuPeak] = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._sampler = CpuPeak()
        self._sync()
        self._t0 = self._last = time.perf_counter()

    def block_done(self) -> None:
        self._sync()
        now = time.perf_counter()
        self.profile.block_s.append(now - self._last)
        self._last = now

    def finish(self, frames: int, cache_bytes: Optional[int] = None) -> VideoProfile:
        self._sync()
        self.profile.total_s = time.perf_counter() - self._t0
        self.profile.frames = frames
        if cache_bytes is not None:
            self.profile.cache_bytes = cache_bytes
        if self.device.type == "cuda":
            self.profile.peak_memory_bytes = int(torch.cuda.max_memory_allocated(self.device))
        elif self._sampler is not None:
            self.profile.peak_memory_bytes = self._sampler.stop()
            self._sampler = None
        return self.profile

    def close(self) -> None:
        """Stop sampling without a profile (a call that failed)."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
