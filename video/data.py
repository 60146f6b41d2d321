"""Moving-emoji clips: a synthetic, download-free video corpus for the small video models.

Each clip is a plain background (one colour from `PALETTE`) with one or two emoji sprites moving
at constant speed. Sprites are Noto Color Emoji glyphs rendered by the image set's own renderer
(`mmgen.image_ar.emoji.render`, on white), cut out by removing the white that touches the
sprite's border. An object either moves in one direction (left, right, up, down; it stays
inside the frame) or bounces along one axis (its velocity flips at the walls; every bouncing
object reaches a wall in the middle third of the clip, so the reversal is visible).

Two-object clips move both objects along the same axis, each in its own lane so they never
overlap: for horizontal motion the first object named in the caption is in the top half and
the second in the bottom half; for vertical motion, left half and right half.

Caption grammar (`caption` builds it, `parse_caption` reads it back)::

    caption := object | object " and " object
    object  := NAME " " motion
    motion  := "moving left" | "moving right" | "moving up" | "moving down"
             | "bouncing horizontally" | "bouncing vertically"

NAME is the sprite's Unicode name ("grinning cat", "dog face"); its class is its Unicode
subgroup, an index into the image models' 74 classes (`class_names()`), so the bundled emoji
classifier (`mmgen.image_ar.quality`) scores the objects. ("bouncing left and right" would make
"... and ..." ambiguous in two-object captions.)

Clip `i` of a corpus is a pure function of `(seed, i)` and the config (numpy generator seeded
with `[seed, i]`), so a training run can resume anywhere and reproduce its data exactly.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from mmgen.files import write_atomic

#: Motion labels (index = motion id) and the phrase each one has in a caption.
MOTIONS = ("left", "right", "up", "down", "bounce-horizontal", "bounce-vertical")
PHRASES = {"left": "moving left", "right": "moving right", "up": "moving up", "down": "moving down",
           "bounce-horizontal": "bouncing horizontally", "bounce-vertical": "bouncing vertically"}
#: Motion -> (axis: 0 = x, 1 = y; sign of the initial velocity, 0 for bouncing).
MOTION_AXIS = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1), "bounce-horizontal": (0, 0), "bounce-vertical": (1, 0)}

#: Background colours: light, away from the sprites' own colours (dark ones swallow outlines and
#: dark parts, which then cannot be told from the background), and not white (sprites are cut out
#: of white, and their white parts should stay visible).
PALETTE = ((200, 200, 200), (135, 190, 235), (170, 225, 190), (235, 215, 170),
           (200, 185, 230), (240, 185, 195), (150, 215, 215), (215, 230, 150))

#: The default sprites: one emoji from each of eight classes, varied in colour and shape, that the
#: bundled classifier names from their cut-outs (as `mmgen.video.quality` scores them) at 16-24 px
#: on this palette: 100% on 400 clips but "grinning face", 87%, and "cat face", 79% (faces differ
#: in details). "cat face" (not "dog face", 100%, of the same class) so that the documented
#: example prompt, "cat face moving left", is one the bundled model was trained on.
DEFAULT_SPRITES = ("grinning face", "cat face", "red heart", "sun",
                   "watermelon", "snake", "automobile", "airplane")


@dataclass(frozen=True)
class MovingEmojiConfig:
    """What a corpus looks like. `speed` and `bounce_speed` are pixels per frame (a moving object's
    speed is capped so it stays in frame; a bouncing one's so it reaches a wall mid-clip)."""

    size: int = 64
    num_frames: int = 17  # 1 + 4k: the Wan VAE's temporal compression
    sprites: tuple[str, ...] = DEFAULT_SPRITES
    sprite_sizes: tuple[int, int] = (16, 24)  # inclusive range
    two_objects_p: float = 0.5
    bounce_p: float = 1 / 3
    speed: tuple[float, float] = (1.5, 3.0)
    bounce_speed: tuple[float, float] = (3.0, 5.0)

    def __post_init__(self):
        if 2 * self.sprite_sizes[1] > self.size:
            raise ValueError(f"sprites up to {self.sprite_sizes[1]} px do not fit two lanes of a {self.size} px frame")
        if self.num_frames < 3:
            raise ValueError("clips need at least 3 frames")


@dataclass
class Clip:
    """One clip. frames: uint8 [T, H, W, 3]; per object k: class_ids[k] (image classes),
    motions[k] (in `MOTIONS`), tracks[k] = the sprite's centroid (x, y) in pixels per frame [T, 2]."""

    frames: np.ndarray
    caption: str
    names: list[str]
    class_ids: np.ndarray  # int64 [K]
    motions: list[str]
    tracks: np.ndarray  # float32 [K, T, 2]
    background: tuple[int, int, int]

    @property
    def motion_ids(self) -> np.ndarray:
        return np.array([MOTIONS.index(m) for m in self.motions], dtype=np.int64)

    def tensor(self) -> torch.Tensor:
        """The frames as float [3, T, H, W] in [-1, 1] (what a video VAE encodes)."""
        return frames_to_tensor(self.frames)


def frames_to_tensor(frames: Union[np.ndarray, torch.Tensor]) -> torch.Tensor:
    """uint8 [..., T, H, W, 3] -> float [..., 3, T, H, W] in [-1, 1]."""
    x = torch.as_tensor(np.asarray(frames)).float().div(127.5).sub(1)
    return x.movedim(-1, -4)


def tensor_to_frames(video: torch.Tensor) -> np.ndarray:
    """float [..., 3, T, H, W] in [-1, 1] -> uint8 [..., T, H, W, 3] (rounded, clamped)."""
    x = video.detach().float().cpu().movedim(-4, -1)
    return x.add(1).mul(127.5).round().clamp(0, 255).to(torch.uint8).numpy()


def caption(names: Sequence[str], motions: Sequence[str]) -> str:
    return " and ".join(f"{name} {PHRASES[motion]}" for name, motion in zip(names, motions))


def parse_caption(text: str) -> list[tuple[str, str]]:
    """[(NAME, motion)] per object; ValueError for a caption outside the grammar."""
    objects = []
    rest = text.strip()
    while rest:
        hits = [(rest.find(" " + phrase), motion, phrase) for motion, phrase in PHRASES.items()]
        hits = [h for h in hits if h[0] > 0]
        if not hits:
            raise ValueError(f"no motion in caption part {rest!r} of {text!r}")
        start, motion, phrase = min(hits)
        objects.append((rest[:start], motion))
        rest = rest[start + 1 + len(phrase):]
        if rest and not rest.startswith(" and "):
            raise ValueError(f"expected ' and ' after {phrase!r} in {text!r}")
        rest = rest[len(" and "):]
    if not 1 <= len(objects) <= 2:
        raise ValueError(f"captions name one or two objects: {text!r}")
    return objects


@lru_cache(maxsize=None)
def class_names() -> tuple[str, ...]:
    """The image models' 74 classes (Unicode subgroups), in class-id order."""
    from mmgen.image_ar.bundled import BUNDLED_MODELS

    return tuple(json.loads((BUNDLED_MODELS["emoji64"] / "model_index.json").read_text())["config"]["class_names"])


@lru_cache(maxsize=None)
def _emoji_table() -> dict[str, tuple[str, str]]:
    """Unicode name -> (emoji, subgroup) for every fully-qualified emoji."""
    from mmgen.image_ar.emoji import parse_emoji_test

    return {name: (emoji, subgroup) for emoji, name, _group, subgroup in parse_emoji_test()}


def sprite_class(name: str) -> int:
    """The image class id of the emoji called `name`."""
    table = _emoji_table()
    if name not in table:
        raise ValueError(f"no emoji is called {name!r}")
    subgroup = table[name][1]
    if subgroup not in class_names():
        raise ValueError(f"{name!r} is in subgroup {subgroup!r}, not one of the image classes")
    return class_names().index(subgroup)


@lru_cache(maxsize=None)
def sprite(name: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """RGB uint8 [size, size, 3] and mask bool [size, size] of the emoji called `name`: the image
    set's rendering (on white, Lanczos-resized), minus the near-white region touching the border."""
    from PIL import ImageFont

    from mmgen.image_ar.emoji import FONT, render

    image = render(_emoji_table()[name][0], ImageFont.truetype(FONT, 109), size)
    if image is None:
        raise ValueError(f"the font draws {name!r} as several glyphs")
    rgb = np.asarray(image, dtype=np.uint8).copy()
    white = rgb.min(-1) >= 235
    outside = np.zeros_like(white)
    outside[[0, -1], :], outside[:, [0, -1]] = white[[0, -1], :], white[:, [0, -1]]
    while True:  # flood fill of the white connected to the border (4-neighbourhood)
        grown = outside.copy()
        grown[1:] |= outside[:-1]
        grown[:-1] |= outside[1:]
        grown[:, 1:] |= outside[:, :-1]
        grown[:, :-1] |= outside[:, 1:]
        grown &= white
        if (grown == outside).all():
            break
        outside = grown
    rgb.flags.writeable = False
    mask = ~outside
    mask.flags.writeable = False
    return rgb, mask


def _reflect(q: np.ndarray, room: float) -> np.ndarray:
    """Positions on an unbounded line folded into [0, room] (a ball bouncing between two walls)."""
    m = np.mod(q, 2 * room)
    return np.where(m <= room, m, 2 * room - m)


def make_clip(config: MovingEmojiConfig, seed: int, index: int) -> Clip:
    """Clip `index` of the corpus `seed`: a pure function of (config, seed, index)."""
    rng = np.random.default_rng([seed, index])
    size, steps = config.size, config.num_frames
    background = PALETTE[rng.integers(len(PALETTE))]
    num_objects = 2 if rng.random() < config.two_objects_p else 1
    chosen = rng.choice(len(config.sprites), num_objects, replace=False)
    axis = int(rng.integers(2))  # shared by both objects: each keeps to its lane
    frames = np.empty((steps, size, size, 3), dtype=np.uint8)
    frames[:] = background
    names, motions, tracks = [], [], []
    t = np.arange(steps, dtype=np.float64)
    for k, sprite_index in enumerate(chosen):
        name = config.sprites[sprite_index]
        side = int(rng.integers(config.sprite_sizes[0], config.sprite_sizes[1] + 1))
        room = size - side
        bounce = rng.random() < config.bounce_p
        sign = 1 if rng.random() < 0.5 else -1
        if bounce:
            hit = rng.uniform(1 / 3, 2 / 3) * (steps - 1)  # frame at which it reaches the wall
            speed = min(rng.uniform(*config.bounce_speed), room / hit)
            wall = room if sign > 0 else 0
            along = _reflect(wall - sign * speed * hit + sign * speed * t, room)
            motion = ("bounce-horizontal", "bounce-vertical")[axis]
        else:
            speed = min(rng.uniform(*config.speed), room / (steps - 1))
            span = room - speed * (steps - 1)
            start = rng.uniform(0, span) if sign > 0 else rng.uniform(speed * (steps - 1), room)
            along = start + sign * speed * t
            motion = {(0, -1): "left", (0, 1): "right", (1, -1): "up", (1, 1): "down"}[(axis, sign)]
        lane_lo, lane_hi = (0, size) if num_objects == 1 else (k * size // 2, (k + 1) * size // 2)
        across = int(rng.integers(lane_lo, lane_hi - side + 1))
        along = np.clip(np.round(along), 0, room).astype(np.int64)
        rgb, mask = sprite(name, side)
        ys, xs = np.nonzero(mask)
        track = np.empty((steps, 2), dtype=np.float32)
        for i, a in enumerate(along):
            x, y = (a, across) if axis == 0 else (across, a)
            frames[i, y:y + side, x:x + side][mask] = rgb[mask]
            track[i] = (x + xs.mean(), y + ys.mean())
        names.append(name)
        motions.append(motion)
        tracks.append(track)
    return Clip(frames, caption(names, motions), names, np.array([sprite_class(n) for n in names], dtype=np.int64),
                motions, np.stack(tracks), tuple(int(c) for c in background))


class MovingEmoji:
    """`length` clips of the corpus `seed` (index -> `Clip`, computed on access)."""

    def __init__(self, config: Optional[MovingEmojiConfig] = None, seed: int = 0, length: int = 10_000):
        self.config = config or MovingEmojiConfig()
        self.seed, self.length = seed, length
        for name in self.config.sprites:
            sprite_class(name)  # fail early on an unknown name or a class the classifier lacks

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Clip:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return make_clip(self.config, self.seed, index)

    def class_ids(self) -> list[int]:
        """The image class of each sprite, in `config.sprites` order."""
        return [sprite_class(name) for name in self.config.sprites]


def write_shard(path: Union[str, Path], dataset: MovingEmoji, indices: Optional[Iterable[int]] = None) -> str:
    """Write clips (all of `dataset` by default) as one compressed npz, atomically; returns its sha256.

    Arrays: frames uint8 [N, T, H, W, 3], captions [N], num_objects [N], class_ids and motion_ids
    int64 [N, 2] (-1 pads a missing second object), tracks float32 [N, 2, T, 2] (NaN pads),
    indices [N], and `meta` (JSON: config and seed)."""
    indices = list(range(len(dataset)) if indices is None else indices)
    clips = [dataset[i] for i in indices]

    def pad(a: np.ndarray, fill) -> np.ndarray:  # per-object arrays -> two rows
        return np.concatenate([a, np.full((2 - len(a),) + a.shape[1:], fill, a.dtype)])

    arrays = {
        "frames": np.stack([c.frames for c in clips]),
        "captions": np.array([c.caption for c in clips]),
        "num_objects": np.array([len(c.names) for c in clips], dtype=np.int64),
        "class_ids": np.stack([pad(c.class_ids, -1) for c in clips]),
        "motion_ids": np.stack([pad(c.motion_ids, -1) for c in clips]),
        "tracks": np.stack([pad(c.tracks, np.nan) for c in clips]),
        "indices": np.array(indices, dtype=np.int64),
        "meta": np.array(json.dumps({"config": asdict(dataset.config), "seed": dataset.seed})),
    }
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return write_atomic(path, buffer.getvalue())


def load_shard(path: Union[str, Path]) -> dict[str, np.ndarray]:
    """The arrays `write_shard` wrote (`meta` decoded into a dict)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    arrays["meta"] = json.loads(str(arrays["meta"]))
    return arrays
