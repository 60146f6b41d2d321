"""MP4 export: the same frames encode to the same bytes, call after call."""

from __future__ import annotations

import hashlib

import numpy as np

from mmgen.video.export import mp4_bytes


def moving_squares(frames: int = 17, height: int = 64, width: int = 96) -> np.ndarray:
    """Frames [T, H, W, 3] uint8: textured squares sliding over a gradient (motion and detail
    for the encoder's rate control)."""
    rng = np.random.default_rng(0)
    background = np.linspace(0, 200, width, dtype=np.float64)[None, :, None] + rng.normal(0, 6, (height, width, 3))
    video = np.repeat(background[None], frames, 0)
    for t in range(frames):
        for k, colour in enumerate(([255, 40, 40], [40, 200, 255], [250, 250, 60])):
            y, x = 6 + 18 * k, (5 * t + 29 * k) % (width - 16)
            video[t, y : y + 16, x : x + 16] = np.array(colour) - rng.integers(0, 40, (16, 16, 1))
    return video.clip(0, 255).astype(np.uint8)


def test_the_same_frames_encode_to_the_same_bytes():
    frames = moving_squares()
    digests = set()
    for i in range(12):
        # Other allocations between calls change what the encoder's memory held before.
        churn = [bytearray(1000 + 7919 * j % 90000) for j in range(i * 5)]
        digests.add(hashlib.sha256(mp4_bytes(frames, fps=8)).hexdigest())
        del churn
    assert len(digests) == 1, f"{len(digests)} different files from the same frames"
