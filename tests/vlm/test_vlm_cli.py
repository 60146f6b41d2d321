"""`mmgen generate text` on tiny VLM folders saved here (no downloads)."""

from __future__ import annotations

import json

import pytest

from mmgen.cli import main
from tests.vlm.test_vlm_pipeline import PROMPTS, images, tiny_llava, tiny_qwen


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    tiny_llava(0).save_pretrained(root / "llava")
    tiny_llava(1).save_pretrained(root / "llava-draft")
    tiny_qwen(0).save_pretrained(root / "qwen")
    images(1)[0].save(root / "cat.png")
    (root / "broken.png").write_bytes(b"not a png")
    return root


def run(capsys, *argv):
    code = main(["generate", "text", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_answers_as_the_pipeline_does_and_streams_the_same_text(folders, capsys):
    code, out, err = run(capsys, "--model", folders / "llava", "--image", folders / "cat.png", "--prompt", PROMPTS[0],
                         "--max-new-tokens", 8)
    assert code == 0
    expected = tiny_llava(0)(PROMPTS[0], images(1)[0], max_new_tokens=8)
    assert out.strip() == expected.texts[0]
    assert json.loads(err.strip().splitlines()[-1])["tokens"] == expected.lengths.tolist()
    code, streamed, _ = run(capsys, "--model", folders / "llava", "--image", folders / "cat.png", "--prompt", PROMPTS[0],
                            "--max-new-tokens", 8, "--stream")
    assert code == 0 and streamed.strip() == out.strip()


def test_drafting_with_a_smaller_vlm_gives_the_greedy_answer(folders, capsys):
    args = ["--model", folders / "llava", "--image", folders / "cat.png", "--prompt", PROMPTS[1], "--max-new-tokens", 8]
    _, plain, _ = run(capsys, *args)
    code, drafted, err = run(capsys, *args, "--decoding", "draft", "--drafter", folders / "llava-draft")
    assert code == 0 and drafted == plain and json.loads(err.strip().splitlines()[-1])["stats"]["draft_forwards"] > 0


def test_dropping_flags_reach_the_pipeline(folders, capsys):
    args = ["--model", folders / "llava", "--image", folders / "cat.png", "--prompt", PROMPTS[1], "--max-new-tokens", 8]
    _, plain, _ = run(capsys, *args)
    code, kept_all, _ = run(capsys, *args, "--keep-ratio", "1.0")  # fastv keeping every token: the same answer
    assert code == 0 and kept_all == plain
    code, _, err = run(capsys, *args, "--dropping", "fastv:layer=1", "--keep-ratio", "0.25")
    report = json.loads(err.strip().splitlines()[-1])["dropping"]
    assert code == 0 and report["policy"].startswith("fastv") and report["kept_tokens"][0] < report["image_tokens"][0]
    code, drafted, err = run(capsys, *args, "--decoding", f"draft:drafter={folders / 'llava-draft'}",
                             "--draft-dropping", "fastv:layer=1,keep_ratio=0.25")
    assert code == 0 and drafted == plain  # the drafter sees a pruned image; the answer is still the model's


@pytest.mark.parametrize("argv,message", [
    (["--image", "{root}/broken.png"], "--image {root}/broken.png: not a readable image"),
    (["--image", "{root}/missing.png"], "--image {root}/missing.png: not a readable image"),
    (["--decoding", "draft", "--drafter", "{root}/qwen"], "has another tokenizer than --model"),
    (["--drafter", "{root}/llava-draft"], "--drafter is for --decoding draft, not 'ar'"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer in [1, 1048576]"),
    (["--max-new-tokens", "1000000000000"], "max_new_tokens must be an integer in [1, 1048576]"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "1e308"], "temperature must be at most 100.0"),
    (["--top-k", "-5"], "top_k must be an integer >= 0"),
    (["--top-p", "5"], "top_p must be in (0, 1]"),
    (["--dropping", "zip"], "unknown dropping policy 'zip'"),
    (["--dropping", "fastv:keep_ratio=0.5", "--keep-ratio", "0.25"], "sets keep_ratio=0.5 but keep_ratio is 0.25"),
    (["--decoding", "draft"], "decoding 'draft' needs a smaller VLM of the same tokenizer: add drafter=NAME_OR_PATH"),
    (["--decoding", "draft:drafter={root}/qwen"], "another tokenizer than the model"),
    (["--decoding", "draft:drafter={root}/llava-draft", "--drafter", "{root}/llava"], "give the setting once"),
])
def test_bad_input_is_one_line(folders, capsys, argv, message):
    argv = [a.format(root=folders) for a in argv]
    code, _, err = run(capsys, "--model", folders / "llava", "--prompt", PROMPTS[0], *argv)
    assert code == 2 and err.count("\n") == 1 and message.format(root=folders) in err, err


def test_the_bundled_pair_is_the_default_model(tmp_path, capsys):
    """No --model: the bundled emoji-vlm answers offline; --decoding draft takes its bundled drafter."""
    import numpy as np
    import torch
    from PIL import Image

    import mmgen

    from mmgen.image_ar.bundled import EVAL_SET

    held_out = np.load(EVAL_SET)["images"][5]
    Image.fromarray(held_out).save(tmp_path / "emoji.png")
    code, plain, _ = run(capsys, "--image", tmp_path / "emoji.png", "--prompt", "What is the main colour?")
    expected = mmgen.load_pipeline("emoji-vlm", dtype=torch.float32)("What is the main colour?", Image.fromarray(held_out))
    assert code == 0 and plain.strip() == expected.texts[0]
    code, drafted, err = run(capsys, "--image", tmp_path / "emoji.png", "--prompt", "What is the main colour?", "--decoding", "draft")
    assert code == 0 and drafted == plain and json.loads(err.strip().splitlines()[-1])["stats"]["draft_forwards"] > 0
