"""Quality proxies for moving-emoji clips (`mmgen.video.data`), scored without any download.

They reuse the image side's bundled emoji classifier (`mmgen.image_ar.quality`) and Fréchet
distance (`mmgen.quality`), plus a colour tracker that needs no model:

* **tracking**: the background is the most common colour of the first frame; an object is the
  pixels whose colour differs from it by more than `threshold` (any channel, 0-255) inside the
  object's lane (the whole frame for one object; for two, the halves across the prompted axis,
  first-named object top or left, as `mmgen.video.data` lays them out). Its track is their
  centroid per frame.
* **class accuracy**: each object is cut out per frame (square around its foreground bounding
  box, background pixels set to white, resized to the classifier's 64x64: the image set's
  framing), and counts as right when the classifier's top-1 is the prompted class. Averaged over
  objects and frames; a frame where the object has no pixels counts as wrong. Whole frames are
  not classified: a 16-24 px sprite on a coloured 64x64 frame is far from the classifier's data
  (about 2% top-1), while cut-outs score about as well as the sprite renders themselves.
  **Among the sprites**: the same reading restricted to the data's sprites' classes (the
  corpus' eight by default): the 74-way reading spends its errors on classes no clip holds
  (a face the eye reads as the grinning face may score as another smiling face).
* **direction accuracy**: `motion_of(track)` must equal the prompted motion, per object. The
  motion axis is the one with the longer centroid path; the object bounced if an interior
  extreme along it passes both end points by more than `min_move` (a fraction of the frame
  side), otherwise it moved left/right/up/down by the sign of its net displacement, or is
  "static" when that is under `min_move`.
* **temporal L1**: mean absolute difference between consecutive frames, pixels in [0, 1]
  (lower is smoother). Pixel L1 rather than feature cosine: the classifier's pooled features
  hardly change when a sprite jumps across the frame, so they cannot tell shuffled frames apart.
* **FID-proxy**: Fréchet distance between the classifier's penultimate features of generated
  frames and of real frames (reference statistics from `fit`); order-blind by construction, and
  biased upwards for few frames: compare only at equal frame counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from mmgen.image_ar.quality import ImageQualityProxies
from mmgen.quality import feature_statistics, frechet_distance
from mmgen.video.data import (MOTION_AXIS, MovingEmoji, MovingEmojiConfig, class_names, parse_caption, sprite_class,
                              tensor_to_frames)

Videos = Union[np.ndarray, torch.Tensor]


def as_frames(videos: Videos) -> np.ndarray:
    """uint8 [N, T, H, W, 3] from uint8 [N, T, H, W, 3] or float [N, 3, T, H, W] in [-1, 1]."""
    if isinstance(videos, torch.Tensor) and videos.is_floating_point():
        return tensor_to_frames(videos)
    frames = np.asarray(videos)
    if frames.dtype != np.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 [N, T, H, W, 3] or float [N, 3, T, H, W], got {frames.dtype} {frames.shape}")
    return frames


def background_colour(frame: np.ndarray) -> np.ndarray:
    """The most common colour of an [H, W, 3] uint8 frame."""
    colours, counts = np.unique(frame.reshape(-1, 3), axis=0, return_counts=True)
    return colours[counts.argmax()]


def foreground(frames: np.ndarray, background: np.ndarray, threshold: int = 48) -> np.ndarray:
    """bool [..., H, W]: pixels differing from `background` by more than `threshold` in some channel."""
    return (np.abs(frames.astype(np.int16) - background.astype(np.int16)).max(-1) > threshold)


def lane_masks(height: int, width: int, num_objects: int, axis: int) -> list[np.ndarray]:
    """bool [H, W] per object: the whole frame, or the halves across motion axis `axis` (0 = x)."""
    if num_objects == 1:
        return [np.ones((height, width), dtype=bool)]
    rows, cols = np.mgrid[:height, :width]
    across, side = (rows, height) if axis == 0 else (cols, width)
    return [across < side // 2, across >= side // 2]


def track(frames: np.ndarray, num_objects: int = 1, axis: int = 0, threshold: int = 48) -> np.ndarray:
    """Centroid (x, y) of each object's foreground per frame: float [K, T, 2], NaN where empty."""
    fg = foreground(frames, background_colour(frames[0]), threshold)
    steps, height, width = fg.shape
    rows, cols = np.mgrid[:height, :width]
    out = np.full((num_objects, steps, 2), np.nan)
    for k, lane in enumerate(lane_masks(height, width, num_objects, axis)):
        mask = fg & lane
        count = mask.sum((1, 2))
        present = count > 0
        out[k, present, 0] = (mask * cols).sum((1, 2))[present] / count[present]
        out[k, present, 1] = (mask * rows).sum((1, 2))[present] / count[present]
    return out


def motion_of(track: np.ndarray, min_move: float) -> str:
    """A label in `mmgen.video.data.MOTIONS`, "static", or "none" (fewer than two tracked frames)."""
    track = track[~np.isnan(track).any(-1)]
    if len(track) < 2:
        return "none"
    axis = int(np.abs(np.diff(track, axis=0)).sum(0).argmax())
    p = track[:, axis]
    if p.max() - max(p[0], p[-1]) > min_move or min(p[0], p[-1]) - p.min() > min_move:
        return ("bounce-horizontal", "bounce-vertical")[axis]
    net = p[-1] - p[0]
    if abs(net) <= min_move:
        return "static"
    return (("left", "right"), ("up", "down"))[axis][int(net > 0)]


def object_crops(frames: np.ndarray, num_objects: int, axis: int, threshold: int = 48, size: int = 64) -> tuple[torch.Tensor, np.ndarray]:
    """Each object cut out per frame, as the image set frames an emoji: float [K, T, 3, size, size]
    in [0, 1] (square around the foreground box, background -> white), and bool [K, T] present."""
    fg = foreground(frames, background_colour(frames[0]), threshold)
    steps, height, width = fg.shape
    crops = torch.ones(num_objects, steps, 3, size, size)
    present = np.zeros((num_objects, steps), dtype=bool)
    for k, lane in enumerate(lane_masks(height, width, num_objects, axis)):
        for t in range(steps):
            ys, xs = np.nonzero(fg[t] & lane)
            if len(ys) == 0:
                continue
            side = int(max(ys.max() - ys.min(), xs.max() - xs.min())) + 1
            y0 = (ys.min() + ys.max() + 1 - side) // 2 + side  # in the frame padded by `side`
            x0 = (xs.min() + xs.max() + 1 - side) // 2 + side
            cut = np.where((fg[t] & lane)[..., None], frames[t], np.uint8(255))  # only this object, on white
            crop = np.pad(cut, ((side, side), (side, side), (0, 0)), constant_values=255)[y0:y0 + side, x0:x0 + side]
            x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1)[None].float() / 255
            crops[k, t] = torch.nn.functional.interpolate(x, size=size, mode="bilinear", antialias=True)[0]
            present[k, t] = True
    return crops, present


@dataclass
class Prompt:
    """What a caption asks for: per object, its image class and motion."""

    class_ids: list[int]
    motions: list[str]

    @classmethod
    def from_caption(cls, caption: str) -> "Prompt":
        objects = parse_caption(caption)
        if len({MOTION_AXIS[m][0] for _, m in objects}) > 1:
            raise ValueError(f"two objects must move along one axis: {caption!r}")
        return cls([sprite_class(name) for name, _ in objects], [m for _, m in objects])

    @property
    def axis(self) -> int:
        return MOTION_AXIS[self.motions[0]][0]


class VideoQualityProxies:
    """Class accuracy, direction accuracy, temporal L1 and FID-proxy of clips (module docstring).

    `frames_scorer` is the image classifier whose reference statistics are real video frames'."""

    def __init__(self, frames_scorer: ImageQualityProxies, threshold: int = 48, min_move: float = 0.05,
                 sprites: Sequence[str] = MovingEmojiConfig.sprites):
        self.scorer = frames_scorer
        self.sprite_classes = sorted({sprite_class(name) for name in sprites})  # what "among the sprites" reads
        self.threshold = threshold
        self.min_move = min_move  # fraction of the frame side

    @classmethod
    def fit(cls, real_videos: Videos, classifier: Union[str, os.PathLike, None] = None, **kwargs) -> "VideoQualityProxies":
        """Proxies whose FID reference is the frames of `real_videos`, scored by the bundled
        emoji classifier (or the classifier folder `classifier`)."""
        from mmgen.image_ar.bundled import QUALITY_CLASSIFIER

        base = ImageQualityProxies.from_pretrained(classifier or QUALITY_CLASSIFIER)
        frames = as_frames(real_videos)
        return cls(ImageQualityProxies.fit(base.classifier, base.config, _flat_images(frames)), **kwargs)

    @classmethod
    def from_dataset(cls, num_clips: int = 256, seed: int = 1, config: Optional[MovingEmojiConfig] = None, **kwargs) -> "VideoQualityProxies":
        """`fit` on clips 0..num_clips-1 of the corpus `seed` (keep it apart from the training seed);
        "among the sprites" reads among `config`'s."""
        data = MovingEmoji(config, seed, num_clips)
        kwargs.setdefault("sprites", (config or MovingEmojiConfig()).sprites)
        return cls.fit(np.stack([data[i].frames for i in range(num_clips)]), **kwargs)

    def __call__(self, videos: Videos, captions: Sequence[str]) -> dict[str, float]:
        """{"class_accuracy", "class_accuracy_among_sprites", "direction_accuracy", "temporal_l1",
        "fid_proxy", "num_clips", "class_accuracy_by_sprite", "class_accuracy_by_frame",
        "class_accuracy_among_sprites_by_frame", "read_as"}: the breakdowns are {sprite name: class
        accuracy of its cut-outs}, the accuracy of each frame position (a causal VAE encodes frame 0
        alone; whether a subject holds as the clip goes on), and {sprite name: {class name: share}},
        the classes its cut-outs are read as (the three most common; "absent" where the object has
        no pixels)."""
        frames = as_frames(videos)
        if len(frames) != len(captions):
            raise ValueError(f"{len(frames)} clips for {len(captions)} captions")
        logits, labels, present, names, directions = self._readings(frames, captions)
        predicted, correct = read_classes(logits, labels, present)
        _, correct_among = read_classes(logits, labels, present, among=self.sprite_classes)
        names, steps = np.array(names), frames.shape[1]
        features, _ = self.scorer.features_and_logits(_flat_images(frames))
        mean, cov = feature_statistics(features)
        return {
            "class_accuracy": float(correct.mean()),
            "class_accuracy_among_sprites": float(correct_among.mean()),
            "direction_accuracy": float(np.mean(directions)),
            "temporal_l1": float(np.abs(np.diff(frames.astype(np.float32), axis=1)).mean() / 255),
            "fid_proxy": frechet_distance(mean, cov, self.scorer.reference_mean, self.scorer.reference_cov),
            "num_clips": len(frames),
            "class_accuracy_by_sprite": {name: float(correct[names == name].mean()) for name in sorted(set(names))},
            "class_accuracy_by_frame": [float(a) for a in correct.reshape(-1, steps).mean(0)],
            "class_accuracy_among_sprites_by_frame": [float(a) for a in correct_among.reshape(-1, steps).mean(0)],
            "read_as": {name: read_as(predicted[names == name], present[names == name]) for name in sorted(set(names))},
        }

    def class_accuracy(self, videos: Videos, captions: Sequence[str], among: Optional[Sequence[int]] = None) -> float:
        """The class accuracy alone (no reference statistics needed: any number of frames);
        `among`: class ids the reading is restricted to (e.g. the data's sprites' classes,
        where the 74-way reading spends its errors on classes the clips never hold)."""
        frames = as_frames(videos)
        if len(frames) != len(captions):
            raise ValueError(f"{len(frames)} clips for {len(captions)} captions")
        logits, labels, present, _, _ = self._readings(frames, captions)
        return float(read_classes(logits, labels, present, among)[1].mean())

    def _readings(self, frames: np.ndarray, captions: Sequence[str]) -> tuple:
        """(the classifier's logits, the prompted class, present) per object cut-out of every frame
        (object-major, then frame), each cut-out's sprite name, and per object whether it moved as
        prompted."""
        image_size = self.scorer.config.image_size
        crops, present, labels, names, directions = [], [], [], [], []
        for clip, caption in zip(frames, captions):
            prompt = Prompt.from_caption(caption)
            k = len(prompt.class_ids)
            clip_crops, clip_present = object_crops(clip, k, prompt.axis, self.threshold, image_size)
            crops.append(clip_crops.flatten(0, 1))
            present.append(clip_present.reshape(-1))
            labels.append(np.repeat(prompt.class_ids, clip.shape[0]))
            names += [name for name, _ in parse_caption(caption) for _ in range(clip.shape[0])]
            tracks = track(clip, k, prompt.axis, self.threshold)
            min_move = self.min_move * max(clip.shape[1:3])
            directions += [motion_of(tracks[i], min_move) == prompt.motions[i] for i in range(k)]
        _, logits = self.scorer.features_and_logits(torch.cat(crops))
        return logits, np.concatenate(labels), np.concatenate(present), names, directions


def read_classes(logits: torch.Tensor, labels: np.ndarray, present: np.ndarray,
                 among: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class, correct) per cut-out: the classifier's top-1 (among the classes `among`
    when given); a cut-out of an absent object is wrong whatever it reads as."""
    if among is not None:
        allowed = torch.full_like(logits, float("-inf"))
        allowed[:, list(among)] = 0.0
        logits = logits + allowed
    predicted = logits.argmax(-1).numpy()
    return predicted, (predicted == labels) & present


def read_as(predicted: np.ndarray, present: np.ndarray, top: int = 3) -> dict[str, float]:
    """{class name: share} of the `top` most common readings of some cut-outs ("absent": no pixels)."""
    names = class_names()
    readings = [names[c] if here else "absent" for c, here in zip(predicted.tolist(), present.tolist())]
    kinds, counts = np.unique(readings, return_counts=True)
    order = np.argsort(-counts, kind="stable")[:top]
    return {str(kinds[i]): float(counts[i] / len(readings)) for i in order}


def _flat_images(frames: np.ndarray) -> torch.Tensor:
    """uint8 [N, T, H, W, 3] -> float [N*T, 3, H, W] in [0, 1] (the image scorer's input)."""
    return torch.from_numpy(frames.reshape(-1, *frames.shape[2:])).permute(0, 3, 1, 2).float() / 255


def degrade(videos: np.ndarray, kind: str, seed: int = 0) -> np.ndarray:
    """Known-bad versions of real clips: "shuffled" (frames in a random order per clip), "frozen"
    (the first frame repeated) or "noise" (uniform random pixels)."""
    rng = np.random.default_rng(seed)
    if kind == "shuffled":
        return np.stack([clip[rng.permutation(len(clip))] for clip in videos])
    if kind == "frozen":
        return np.repeat(videos[:, :1], videos.shape[1], axis=1)
    if kind == "noise":
        return rng.integers(0, 256, videos.shape, dtype=np.uint8)
    raise ValueError(f"unknown degradation {kind!r}")


def calibrate(num_clips: int = 64, seed: int = 0, reference_clips: int = 256, reference_seed: int = 1,
              config: Optional[MovingEmojiConfig] = None, scorer: Optional[VideoQualityProxies] = None) -> dict[str, dict[str, float]]:
    """The proxies on real clips (corpus `seed`) and on their degradations (shuffled, frozen,
    noise), against reference frames from another corpus: what a good and a broken model score."""
    scorer = scorer or VideoQualityProxies.from_dataset(reference_clips, reference_seed, config)
    data = MovingEmoji(config, seed, num_clips)
    clips = [data[i] for i in range(num_clips)]
    real, captions = np.stack([c.frames for c in clips]), [c.caption for c in clips]
    results = {"real": scorer(real, captions)}
    for kind in ("shuffled", "frozen", "noise"):
        results[kind] = scorer(degrade(real, kind, seed), captions)
    return results
