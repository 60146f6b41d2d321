"""Video input on the command-line surfaces: `mmgen generate text --video` and `mmgen batch` text
jobs with `videos`, on tiny Qwen2-VL and LLaVA folders saved here (no downloads). Answers equal
the pipeline's own on the same decoded files; bad videos, and videos for a model that takes
none, are one line before any model loads (CLI) or before any work (batch).
"""

from __future__ import annotations

import json

import pytest

from mmgen.cli import main
from mmgen.sampling import make_generator
from mmgen.video.export import write_mp4
from mmgen.vlm.videos import read_video

from tests.vlm.test_video_input import clip
from tests.vlm.tiny import PROMPTS, images, tiny_llava, tiny_qwen2

BUDGET = 8


def video_folders(root):
    """Saved here: `tiny-qwen2-vl` (takes video; weights sharp enough that answers depend on the
    input), `tiny-llava` (takes none), two MP4 clips of different lengths and sizes, an image and
    a file that is no video. Returns `root`."""
    tiny_qwen2(0, std=0.1).save_pretrained(root / "tiny-qwen2-vl")
    tiny_llava(0).save_pretrained(root / "tiny-llava")
    write_mp4(root / "clip0.mp4", clip(4, 40, 32, 0), fps=4)
    write_mp4(root / "clip1.mp4", clip(6, 24, 48, 1), fps=4)
    images(1)[0].save(root / "cat.png")
    (root / "broken.mp4").write_bytes(b"not a video")
    return root


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return video_folders(tmp_path_factory.mktemp("video-surfaces"))


@pytest.fixture(scope="module")
def pipe(root):
    import mmgen

    return mmgen.load_pipeline(root / "tiny-qwen2-vl")


def frames(root, *names):
    """The clips as the pipeline's reader decodes them (H.264 is lossy: the files are the input)."""
    return [read_video(root / name) for name in names]


def generate(capsys, *argv):
    code = main(["generate", "text", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- mmgen generate text --video ----------------------------------------------------------------


def test_cli_videos_answer_as_the_pipeline_and_stream_the_same_text(root, pipe, capsys):
    """--video is repeatable (both clips reach the model, after the image) and --stream prints
    the same answer."""
    args = ["--model", root / "tiny-qwen2-vl", "--image", root / "cat.png", "--video", root / "clip0.mp4",
            "--video", root / "clip1.mp4", "--prompt", PROMPTS[1], "--max-new-tokens", BUDGET]
    code, out, err = generate(capsys, *args)
    expected = pipe(PROMPTS[1], [images(1)[0]], frames(root, "clip0.mp4", "clip1.mp4"), max_new_tokens=BUDGET)
    one_clip = pipe(PROMPTS[1], [images(1)[0]], frames(root, "clip1.mp4"), max_new_tokens=BUDGET)
    assert code == 0 and out.strip() == expected.texts[0]
    assert json.loads(err.strip().splitlines()[-1])["tokens"] == expected.lengths.tolist()
    assert expected.token_ids.tolist() != one_clip.token_ids.tolist()  # the first --video is not dropped
    code, streamed, _ = generate(capsys, *args, "--stream")
    assert code == 0 and streamed.strip() == out.strip()


@pytest.mark.parametrize("model, video, message", [
    ("tiny-qwen2-vl", "broken.mp4", "--video {root}/broken.mp4: not a readable video"),
    ("tiny-qwen2-vl", "missing.mp4", "--video {root}/missing.mp4: not a readable video (not a file)"),
    ("tiny-qwen2-vl", "tiny-llava", "--video {root}/tiny-llava: not a readable video (not a file)"),
    ("tiny-llava", "clip0.mp4", "--video: model_type 'llava' takes no video input in mmgen"),
])
def test_cli_bad_videos_are_one_line_before_any_model_loads(root, capsys, monkeypatch, model, video, message):
    import mmgen.loading

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the videos were checked")

    monkeypatch.setattr(mmgen.loading, "load_pipeline", no_load)
    code, out, err = generate(capsys, "--model", root / model, "--video", root / video, "--prompt", PROMPTS[0])
    assert code == 2 and out == "" and err.count("\n") == 1 and message.format(root=root) in err, err


# --- mmgen batch: videos ------------------------------------------------------------------------


def write_jobs(path, jobs):
    path.write_text("".join(json.dumps(j) + "\n" for j in jobs))
    return path


def test_batch_video_jobs_answer_as_the_pipeline_and_resume(root, pipe, tmp_path, capsys):
    model = str(root / "tiny-qwen2-vl")
    jobs = [{"model": model, "prompt": PROMPTS[0], "videos": [str(root / "clip0.mp4")], "output": "v0", "max_new_tokens": BUDGET},
            {"model": model, "prompt": PROMPTS[1], "images": [str(root / "cat.png")], "videos": [str(root / "clip1.mp4")],
             "output": "v1", "max_new_tokens": BUDGET},
            {"model": model, "prompt": PROMPTS[2], "output": "text", "max_new_tokens": BUDGET}]
    path = write_jobs(tmp_path / "jobs.jsonl", jobs)
    out = tmp_path / "out"
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    inputs = [(None, frames(root, "clip0.mp4")), ([images(1)[0]], frames(root, "clip1.mp4")), (None, None)]
    for job, (imgs, videos) in zip(jobs, inputs):  # greedy: each answer is its job alone, whatever its batch
        alone = pipe(job["prompt"], imgs, videos, max_new_tokens=BUDGET)
        answer = json.loads((out / f"{job['output']}.json").read_text())
        assert answer["token_ids"] == alone.token_ids[0, : alone.lengths[0]].tolist() and answer["text"] == alone.texts[0]
    capsys.readouterr()
    (out / "v1.json").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["total"]["outputs"] == 1 and (out / "v1.json").is_file()
    assert all((out / name).stat().st_mtime_ns == t for name, t in before.items())


def test_batch_continuous_video_jobs_follow_their_own_seeds(root, pipe, tmp_path):
    model = str(root / "tiny-qwen2-vl")
    jobs = [{"model": model, "prompt": PROMPTS[k], "videos": [str(root / f"clip{k % 2}.mp4")] if k < 2 else [],
             "output": f"s{k}", "max_new_tokens": BUDGET, "seed": 20 + k, "temperature": 1.0} for k in range(3)]
    out = tmp_path / "out"
    path = write_jobs(tmp_path / "jobs.jsonl", jobs)
    assert main(["batch", str(path), "--out", str(out), "--batch-size", "2", "--continuous", "--no-progress"]) == 0
    for k, job in enumerate(jobs):
        videos = frames(root, f"clip{k % 2}.mp4") if k < 2 else None
        alone = pipe(job["prompt"], None, videos, max_new_tokens=BUDGET, temperature=1.0, generator=make_generator(20 + k))
        assert json.loads((out / f"s{k}.json").read_text())["token_ids"] == alone.token_ids[0, : alone.lengths[0]].tolist()


def test_bad_video_jobs_are_listed_by_the_dry_run_before_any_work(root, tmp_path, capsys):
    qwen, llava = str(root / "tiny-qwen2-vl"), str(root / "tiny-llava")
    bad = [{"model": qwen, "prompt": PROMPTS[0], "videos": [str(root / "missing.mp4")], "output": "a"},
           {"model": qwen, "prompt": PROMPTS[0], "videos": [str(root / "broken.mp4")], "output": "b"},
           {"model": llava, "prompt": PROMPTS[0], "videos": [str(root / "clip0.mp4")], "output": "c"},
           {"model": qwen, "prompt": PROMPTS[0], "videos": str(root / "clip0.mp4"), "output": "d"},
           {"model": qwen, "prompt": PROMPTS[0], "videos": [str(root / "clip0.mp4")], "output": "ok"}]
    path = write_jobs(tmp_path / "bad.jsonl", bad)
    assert main(["batch", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    for line, message in [(1, f"video {root / 'missing.mp4'}: not a readable video (not a file)"),
                          (2, f"video {root / 'broken.mp4'}: not a readable video"),
                          (3, "model_type 'llava' takes no video input in mmgen"), (4, "videos must be a list of file paths")]:
        assert f"line {line}: " in err and message in err.split(f"line {line}: ")[1].splitlines()[0], err
    assert "line 5" not in err and not (tmp_path / "out").exists()
