"""Video input (`videos=`) for the families that take it (Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision),
on tiny random models of their own transformers classes (`tests/vlm/tiny.py`): greedy answers
equal the model's own `generate(do_sample=False)` on the processor's same inputs at batch 1 and
at batch 3 (prompts of different lengths, videos of different lengths and sizes: left padding,
M-RoPE positions of the video tokens in padded rows), under every lossless decoder (drafts
accepted and rejected), with images, videos and text-only rows mixed in one batch; sampled
answers follow their own seed at any batch; dropping counts video tokens as visual tokens; bad
videos are one line before any forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from mmgen.decoding import make_decoder
from mmgen.sampling import make_generator
from mmgen.vlm.layout import video_token_id
from mmgen.vlm.videos import Video

from tests.vlm.test_families import speculated
from tests.vlm.tiny import BUILDERS, PROMPTS, drafter_for, images, qwen_visionzip_reference, tiny_llava

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "llava_onevision"]
BUDGET = 10


def clip(frames: int, width: int, height: int, seed: int) -> np.ndarray:
    """A random [T, H, W, 3] uint8 video."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(frames, height, width, 3, generator=g) * 255).byte().numpy()


def clips(name: str) -> list:
    """Three videos of different sizes, in the three forms a video takes (PIL frames, a numpy
    array, a torch tensor); of different lengths too, except for LLaVA-OneVision, whose model
    stacks a batch's videos (one frame count per batch, as in its own `generate`)."""
    lengths = [4, 4, 4] if name == "llava_onevision" else [4, 6, 2]
    first, second, third = (clip(t, w, h, k) for k, (t, (w, h)) in enumerate(zip(lengths, [(40, 36), (24, 48), (56, 20)])))
    return [[Image.fromarray(f) for f in first], second, torch.from_numpy(third)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(name, target, drafter): the drafter is the family's smaller model (`drafter_for`)."""
    name = request.param
    target = BUILDERS[name](0, std=0.1)
    drafter = drafter_for(target, BUILDERS[name])
    for pipe in (target, drafter):  # every frame given is a frame seen, so the videos' lengths differ in tokens
        pipe.processor.video_processor.do_sample_frames = False
    return name, target, drafter


def video_tokens(pipe, prompts, imgs, videos) -> list[int]:
    ids = pipe.prepare_inputs(prompts, imgs, videos)["input_ids"]
    return (ids == video_token_id(pipe.model.config)).sum(1).tolist()


def generate_with(pipe, prompts, imgs, videos, budget=BUDGET):
    """`generate`'s greedy answer tokens on the processor's inputs with images and videos."""
    inputs = pipe.prepare_inputs(prompts, imgs, videos)
    out = pipe.model.generate(**inputs, max_new_tokens=budget, do_sample=False, eos_token_id=[], pad_token_id=pipe.pad_token_id)
    return out[:, inputs["input_ids"].shape[1]:]


def test_greedy_equals_generate_alone_batched_and_continuous(family):
    name, pipe, _ = family
    videos = clips(name)
    mask = pipe.prepare_inputs(PROMPTS, None, videos)["attention_mask"]
    assert len(set(mask.sum(1).tolist())) == 3  # three prompt lengths: two rows are left-padded
    if name != "llava_onevision":
        assert len(set(video_tokens(pipe, PROMPTS, None, videos))) == 3  # three video lengths in tokens
    reference = generate_with(pipe, PROMPTS, None, videos)
    for row in range(3):  # transformers' own answer at batch 1 is its answer at batch 3
        assert torch.equal(generate_with(pipe, PROMPTS[row], None, videos[row])[0], reference[row])
        out = pipe(PROMPTS[row], videos=videos[row], max_new_tokens=BUDGET, stop_token_ids=[])
        assert torch.equal(out.token_ids[0], reference[row]) and int(out.lengths[0]) == BUDGET > 1
    assert torch.equal(pipe(PROMPTS, videos=videos, max_new_tokens=BUDGET, stop_token_ids=[]).token_ids, reference)
    each = pipe.answer_each(PROMPTS, None, [make_generator(k) for k in range(3)], batch_size=2, max_new_tokens=BUDGET,
                            stop_token_ids=[], videos=videos)
    assert torch.equal(each.token_ids, reference)
    server = pipe.serve("ar", batch_size=3, max_new_tokens=BUDGET, stop_token_ids=[])
    futures = [server.submit(PROMPTS[row], None, make_generator(row), videos=videos[row]) for row in range(3)]
    assert all(torch.equal(f.result(timeout=120)[1], reference[row]) for row, f in enumerate(futures))


@pytest.mark.parametrize("decoding", ["sjd", "lookup", "draft"])
def test_speculative_decoders_equal_generate(family, decoding):
    name, pipe, drafter = family
    videos = clips(name)
    if decoding == "sjd":
        decoder = make_decoder("sjd", window=4, adapt=False, draft_init="left")
    elif decoding == "lookup":
        decoder = make_decoder("lookup", adapt=False)
    else:  # a smaller model of the family drafts with the videos
        decoder = make_decoder("draft", drafter=drafter, num_draft=3)
    out = pipe(PROMPTS, videos=videos, max_new_tokens=16, stop_token_ids=[], decoding=decoder)
    assert torch.equal(out.token_ids, generate_with(pipe, PROMPTS, None, videos, 16))
    assert speculated(out.stats), out.stats.accepted_histogram


def test_one_batch_mixes_an_image_a_video_and_text(family):
    name, pipe, drafter = family
    picture, video = images(1)[0], clips(name)[1]
    imgs, videos = [picture, None, None], [None, video, None]
    reference = generate_with(pipe, PROMPTS, imgs, videos)
    for row in range(3):
        alone = pipe(PROMPTS[row], imgs[row], videos[row], max_new_tokens=BUDGET, stop_token_ids=[]).token_ids[0]
        assert torch.equal(alone, reference[row])
    for decoder in ["ar", make_decoder("draft", drafter=drafter, num_draft=3)]:
        out = pipe(PROMPTS, imgs, videos, max_new_tokens=BUDGET, stop_token_ids=[], decoding=decoder)
        assert torch.equal(out.token_ids, reference), decoder


def test_sampled_answers_follow_their_seed_at_any_batch(family):
    name, pipe, _ = family
    videos = clips(name)
    call = dict(max_new_tokens=8, temperature=1.0, top_k=20, stop_token_ids=[])
    together = pipe.answer_each(PROMPTS, None, [make_generator(7 + k) for k in range(3)], batch_size=3, videos=videos, **call)
    for row in range(3):
        alone = pipe(PROMPTS[row], videos=videos[row], generator=make_generator(7 + row), **call)
        assert torch.equal(together.token_ids[row], alone.token_ids[0])
    other = pipe.answer_each(PROMPTS, None, [make_generator(8 + k) for k in range(3)], batch_size=3, videos=videos, **call)
    assert not torch.equal(other.token_ids, together.token_ids)


def test_dropping_counts_video_tokens(family):
    """Keep 0.999 runs each policy's hooks yet keeps every video token: the unpruned answer. A
    low keep drops video tokens, ceil(keep x n) kept per row (VisionZip reads Qwen's tower)."""
    name, pipe, _ = family
    videos = clips(name)
    counts = video_tokens(pipe, PROMPTS, None, videos)
    plain = pipe(PROMPTS, videos=videos, max_new_tokens=8, stop_token_ids=[])
    policies = ["fastv:layer=1,keep_ratio={}", "mustdrop:layer=1,keep_ratio={},merge_threshold=1.0,decode_keep=1.0"]
    if name != "llava_onevision":
        policies.append("visionzip:keep_ratio={},contextual=0")
    for spec in policies:
        out = pipe(PROMPTS, videos=videos, max_new_tokens=8, stop_token_ids=[], dropping=spec.format(0.999))
        assert out.dropping.image_tokens == out.dropping.kept_tokens == counts, spec
        assert torch.equal(out.token_ids, plain.token_ids), spec
        low = pipe(PROMPTS, videos=videos, max_new_tokens=8, stop_token_ids=[], dropping=spec.format(0.3))
        assert low.dropping.image_tokens == counts, spec
        assert low.dropping.kept_tokens == [-(-n * 3 // 10) for n in counts], spec
        assert low.lengths.tolist() == [8, 8, 8]


def test_visionzip_scores_a_video_as_when_it_is_alone():
    """With an image and a video in one batch Qwen's tower runs twice (images, then videos):
    the video row keeps the video tokens it keeps alone, so its scores are its own."""
    pipe = BUILDERS["qwen2_5_vl"](0, std=0.1)
    picture, video = images(1)[0], clip(4, 40, 36, 5)
    spec = "visionzip:keep_ratio=0.3,contextual=0"
    alone = pipe(PROMPTS[1], videos=video, max_new_tokens=2, stop_token_ids=[], dropping=spec).dropping
    mixed = pipe(PROMPTS, [picture, None, None], [None, video, None], max_new_tokens=2, stop_token_ids=[], dropping=spec)
    width = pipe.prepare_inputs(PROMPTS, [picture, None, None], [None, video, None])["input_ids"].shape[1]
    pad = width - mixed.dropping.prompt_tokens[1]
    assert [slot - pad for slot in mixed.dropping.kept_slots[1]] == alone.kept_slots[0]
    assert mixed.dropping.kept_tokens[1] < mixed.dropping.image_tokens[1]


def test_qwen_visionzip_scores_follow_the_prompts_video_tokens(monkeypatch):
    """Qwen2.5-VL's tower runs a video's patches in window order, frame by frame: VisionZip's
    scores (the attention each merged token's patches receive in the last block) come in the
    order of the prompt's video tokens. Checked against the tower's own outputs: its merged
    features in block order, matched to the pooled features the LM receives, give the order."""
    from mmgen.vlm import dropping

    pipe, videos = BUILDERS["qwen2_5_vl"](0), [clip(4, 40, 36, 3), clip(2, 24, 48, 4)]
    pipe.model.model.visual.window_size = 16  # windows of 2x2 merged tokens, so block order is not the prompt's
    seen, original = {}, dropping.Prefill._vision_scores
    monkeypatch.setattr(dropping.Prefill, "_vision_scores", lambda self: seen.setdefault("scores", original(self)))
    pipe(PROMPTS[:2], videos=videos, max_new_tokens=2, stop_token_ids=[], dropping="visionzip:keep_ratio=0.5")

    inputs = pipe.prepare_inputs(PROMPTS[:2], None, videos)
    expected = qwen_visionzip_reference(pipe, inputs["pixel_values_videos"], inputs["video_grid_thw"])
    torch.testing.assert_close(seen["scores"], expected, rtol=1e-5, atol=1e-6)


def test_a_video_file_a_conversation_and_the_batch_form_are_the_same_video(family, tmp_path):
    import av

    name, pipe, _ = family
    video = clip(4, 32, 32, 9)
    with av.open(str(tmp_path / "clip.mkv"), mode="w") as container:  # lossless: decoded frames are the array's
        stream = container.add_stream("ffv1", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "bgr0"
        for frame in video:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    call = dict(max_new_tokens=6, stop_token_ids=[])
    at_rate = Video(video, 4.0)  # the file's frames at the file's rate
    expected = pipe(PROMPTS[0], videos=at_rate, **call).token_ids
    chat = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": PROMPTS[0]}]}]
    assert torch.equal(pipe(PROMPTS[0], videos=tmp_path / "clip.mkv", **call).token_ids, expected)
    assert torch.equal(pipe(chat, videos=at_rate, **call).token_ids, expected)
    assert torch.equal(pipe([PROMPTS[0]], videos=[[at_rate]], **call).token_ids, expected)
    assert torch.equal(pipe(PROMPTS[0], videos=[Video(list(video), 4)], **call).token_ids, expected)


def test_a_videos_frame_rate_reaches_the_processor(family, monkeypatch):
    """Qwen2.5-VL spaces a video's temporal positions by 2 frames / fps, Qwen3-VL writes each
    frame pair's timestamp into the prompt: from the file's own rate, or a `Video`'s; frames
    alone read as transformers' default 24 fps."""
    name, pipe, _ = family
    texts = []
    tokenize = type(pipe.processor.tokenizer).__call__
    monkeypatch.setattr(type(pipe.processor.tokenizer), "__call__",
                        lambda self, text=None, *args, **kwargs: texts.append(text) or tokenize(self, text, *args, **kwargs))
    video = clip(4, 32, 32, 9)
    at_4, at_24, plain = (pipe.prepare_inputs(PROMPTS[0], None, v) for v in (Video(video, 4.0), Video(video, 24), video))
    assert torch.equal(at_24["input_ids"], plain["input_ids"]) and texts[1] == texts[2]
    if name == "qwen2_5_vl":
        assert at_4["second_per_grid_ts"].tolist() == [0.5] and plain["second_per_grid_ts"].tolist() == [pytest.approx(2 / 24)]
    if name == "qwen3_vl":  # frames 0-1 and 2-3: at 4 fps their midpoints are 0.1 s and 0.6 s
        assert "<0.1 seconds>" in str(texts[0]) and "<0.6 seconds>" in str(texts[0]) and "<0.6 seconds>" not in str(texts[2])
    for fps in (0, -1.0, float("nan"), "4", True):
        with pytest.raises(ValueError, match=f"^prompt 0's video 0's fps must be a positive number, got {fps!r}$"):
            pipe(PROMPTS[0], videos=Video(video, fps), max_new_tokens=1)


@pytest.fixture(scope="module")
def qwen():
    return BUILDERS["qwen2_5_vl"](0)


@pytest.mark.parametrize("videos,message", [
    (5, "prompt 0's video 0 must be a list of frames (PIL images or [H, W, 3] uint8 arrays), a [T, H, W, 3] uint8 array "
        "or a video file path, got int"),
    (np.zeros((0, 8, 8, 3), np.uint8), "prompt 0's video 0 has no frames"),
    (np.zeros((2, 8, 8, 3), np.float32),
     "prompt 0's video 0 must be a [T, H, W, 3] uint8 array, got shape [2, 8, 8, 3] of float32"),
    ([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 6, 3), np.uint8)],
     "prompt 0's video 0's frames differ in size: frame 0 is 8x8, frame 1 is 6x8"),
    ([np.zeros((8, 8), np.uint8)], "prompt 0's video 0 must be a list of frames"),
    (np.zeros((769, 1, 1, 3), np.uint8), "prompt 0's video 0 has 769 frames; a video may have at most 768"),
    ("{tmp}/notes.txt", "prompt 0's video 0 ({tmp}/notes.txt): not a readable video"),
    ("{tmp}/missing.mp4", "prompt 0's video 0 ({tmp}/missing.mp4): not a readable video (not a file)"),
    ([[Image.new("RGB", (8, 8))], 3], "prompt 0's video 1 must be a list of frames"),
])
def test_a_bad_video_is_one_line_before_any_forward(qwen, tmp_path, monkeypatch, videos, message):
    (tmp_path / "notes.txt").write_text("not a video")
    videos = videos.format(tmp=tmp_path) if isinstance(videos, str) else videos
    monkeypatch.setattr(type(qwen.model), "forward", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(ValueError) as error:
        qwen(PROMPTS[0], videos=videos, max_new_tokens=2)
    assert message.format(tmp=tmp_path) in str(error.value) and "\n" not in str(error.value)


def test_videos_where_they_cannot_go_are_one_line(qwen, monkeypatch):
    video = clip(2, 8, 8, 0)
    llava = tiny_llava(0)
    for pipe in (qwen, llava):
        monkeypatch.setattr(type(pipe.model), "forward", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(ValueError, match=r"^model_type 'llava' takes no video input in mmgen \(videos go to llava_onevision, "):
        llava(PROMPTS[0], videos=video, max_new_tokens=2)
    with pytest.raises(ValueError, match="^3 prompts need a list of 3 videos"):
        qwen(PROMPTS, videos=video, max_new_tokens=2)
    chat = [{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}]
    with pytest.raises(ValueError, match=r"^the conversation has 0 video placeholder\(s\) but 1 video\(s\) were given$"):
        qwen(chat, videos=video, max_new_tokens=2)
    onevision = BUILDERS["llava_onevision"](0)
    monkeypatch.setattr(type(onevision.model), "forward", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(ValueError, match=r"^llava_onevision takes a batch's videos at one frame count only, got \[2, 3\]"):
        onevision(PROMPTS[:2], videos=[video, clip(3, 8, 8, 1)], max_new_tokens=2)
