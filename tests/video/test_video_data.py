"""Moving-emoji clips (`mmgen.video.data`) and their quality proxies (`mmgen.video.quality`):
clips are pure functions of (seed, index), captions follow the documented grammar, the tracker
reads every real clip's motion back, and the proxies tell real clips from broken ones."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from training.data.emoji import FONT

# The clips are drawn with Debian's emoji font: a test requirement like espeak-ng (.ci/run
# installs it), so its absence fails here with the remedy instead of skipping.
assert os.path.exists(FONT), f"{FONT} is missing: apt-get install fonts-noto-color-emoji unicode-data"

from mmgen.video.data import (MOTIONS, PHRASES, MovingEmoji, MovingEmojiConfig, caption, class_names, load_shard, make_clip,
                              parse_caption, sprite_class, tensor_to_frames, write_shard)
from mmgen.video.quality import Prompt, VideoQualityProxies, calibrate, motion_of, track


@pytest.fixture(scope="module")
def clips():
    data = MovingEmoji(seed=0, length=64)
    return [data[i] for i in range(len(data))]


def test_clip_is_a_pure_function_of_seed_and_index():
    config = MovingEmojiConfig()
    a, b = make_clip(config, 3, 7), MovingEmoji(config, seed=3, length=10)[7]
    assert np.array_equal(a.frames, b.frames) and a.caption == b.caption and np.array_equal(a.tracks, b.tracks)
    assert not np.array_equal(a.frames, make_clip(config, 3, 8).frames)
    assert not np.array_equal(a.frames, make_clip(config, 4, 7).frames)


def test_clip_shapes_and_tensor_round_trip(clips):
    clip = clips[0]
    assert clip.frames.shape == (17, 64, 64, 3) and clip.frames.dtype == np.uint8
    assert clip.tracks.shape == (len(clip.names), 17, 2)
    x = clip.tensor()
    assert x.shape == (3, 17, 64, 64) and x.min() >= -1 and x.max() <= 1
    assert np.array_equal(tensor_to_frames(x), clip.frames)
    small = make_clip(MovingEmojiConfig(size=48, num_frames=9, sprite_sizes=(12, 16)), 0, 0)
    assert small.frames.shape == (9, 48, 48, 3)


def test_captions_follow_the_grammar(clips):
    assert caption(["dog face", "sun"], ["left", "bounce-vertical"]) == "dog face moving left and sun bouncing vertically"
    for clip in clips:
        assert parse_caption(clip.caption) == list(zip(clip.names, clip.motions))
        assert Prompt.from_caption(clip.caption).class_ids == clip.class_ids.tolist()
    assert {m for c in clips for m in c.motions} == set(MOTIONS)
    assert {len(c.names) for c in clips} == {1, 2}
    for bad in ("dog face", "dog face moving sideways", "dog face moving left, sun moving up", "a moving left and b moving up and c moving down"):
        with pytest.raises(ValueError):
            parse_caption(bad)
    with pytest.raises(ValueError, match="one axis"):
        Prompt.from_caption(f"dog face {PHRASES['left']} and sun {PHRASES['up']}")


def test_tracker_reads_back_every_real_motion(clips):
    for clip in clips:
        prompt = Prompt.from_caption(clip.caption)
        tracks = track(clip.frames, len(clip.names), prompt.axis)
        assert [motion_of(t, 0.05 * 64) for t in tracks] == clip.motions, clip.caption
        assert np.abs(tracks - clip.tracks).max() < 2.0  # pixels near the background colour shift it a little


def test_shard_round_trip(tmp_path):
    data = MovingEmoji(seed=2, length=3)
    digest = write_shard(tmp_path / "clips.npz", data)
    assert len(digest) == 64 and not [p for p in tmp_path.iterdir() if p.name != "clips.npz"]
    shard = load_shard(tmp_path / "clips.npz")
    assert shard["meta"]["seed"] == 2 and shard["frames"].shape == (3, 17, 64, 64, 3)
    for i in range(3):
        clip = data[i]
        k = len(clip.names)
        assert np.array_equal(shard["frames"][i], clip.frames) and shard["captions"][i] == clip.caption
        assert shard["num_objects"][i] == k and (shard["class_ids"][i, k:] == -1).all()
        assert np.array_equal(shard["tracks"][i, :k], clip.tracks) and np.isnan(shard["tracks"][i, k:]).all()


def test_proxies_separate_real_shuffled_and_noise():
    torch.set_num_threads(1)
    config = MovingEmojiConfig(num_frames=9)  # half the classifier calls of 17 frames
    data = MovingEmoji(config, seed=1, length=8)
    scorer = VideoQualityProxies.fit(np.stack([data[i].frames for i in range(8)]))
    results = calibrate(num_clips=8, seed=0, config=config, scorer=scorer)
    real, shuffled, frozen, noise = (results[k] for k in ("real", "shuffled", "frozen", "noise"))
    assert real["direction_accuracy"] == 1.0 and shuffled["direction_accuracy"] < 0.7 and frozen["direction_accuracy"] == 0
    assert real["temporal_l1"] < shuffled["temporal_l1"] < noise["temporal_l1"] and frozen["temporal_l1"] == 0
    assert real["class_accuracy"] >= 0.9 and noise["class_accuracy"] < 0.2  # 1.0 on 64 clips
    assert noise["fid_proxy"] > 10 * real["fid_proxy"]
    # Per sprite: the objects' accuracies, whose object-weighted mean is the whole figure.
    names = [name for c in (MovingEmoji(config, seed=0, length=8)[i] for i in range(8)) for name in c.names]
    for r in (real, noise):
        by_sprite = r["class_accuracy_by_sprite"]
        assert set(by_sprite) == set(names)
        assert np.isclose(sum(by_sprite[n] for n in names) / len(names), r["class_accuracy"])
        # Per frame position, 9 figures averaging to the whole; and what each sprite is read as.
        assert len(r["class_accuracy_by_frame"]) == 9 and np.isclose(np.mean(r["class_accuracy_by_frame"]), r["class_accuracy"])
        # Among the data's eight sprites: never below the 74-way reading, per frame as a whole.
        among = r["class_accuracy_among_sprites_by_frame"]
        assert r["class_accuracy_among_sprites"] >= r["class_accuracy"] and np.isclose(np.mean(among), r["class_accuracy_among_sprites"])
        for name in set(names):
            shares = r["read_as"][name]
            assert 0 < len(shares) <= 3 and sum(shares.values()) <= 1 + 1e-9 and list(shares.values()) == sorted(shares.values(), reverse=True)
            if r is real:  # read right: its own class leads
                assert next(iter(shares)) == class_names()[sprite_class(name)]
    # float videos in [-1, 1] score like their uint8 frames
    clips = [MovingEmoji(config, seed=0, length=2)[i] for i in range(2)]
    as_float = torch.stack([c.tensor() for c in clips])
    assert scorer(as_float, [c.caption for c in clips])["direction_accuracy"] == 1.0


def test_class_accuracy_among_the_sprites_reads_the_likeliest_of_the_data_s_classes():
    """A cut-out whose top-1 is a class no clip holds (a smiling face beside the grinning one) is
    wrong over the 74 classes and right among the data's sprites when the prompted sprite leads
    them; an absent object is wrong either way."""
    from mmgen.video.quality import read_classes

    grinning, cat = sprite_class("grinning face"), sprite_class("cat face")
    other = next(c for c in range(len(class_names())) if c not in {sprite_class(n) for n in MovingEmojiConfig.sprites})
    logits = torch.zeros(3, len(class_names()))
    logits[0, [other, grinning, cat]] = torch.tensor([3.0, 2.0, 1.0])  # read as another class, grinning next
    logits[1, [other, cat, grinning]] = torch.tensor([3.0, 2.0, 1.0])  # read as another class, then cat face
    logits[2, grinning] = 5.0  # right, but the object has no pixels
    labels, present = np.array([grinning] * 3), np.array([True, True, False])
    eight = sorted({sprite_class(n) for n in MovingEmojiConfig.sprites})
    assert read_classes(logits, labels, present)[1].tolist() == [False, False, False]
    predicted, correct = read_classes(logits, labels, present, among=eight)
    assert correct.tolist() == [True, False, False] and predicted.tolist() == [grinning, cat, grinning]
