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


@pytest.mark.parametrize("argv,message", [
    (["--image", "{root}/broken.png"], "--image {root}/broken.png: not a readable image"),
    (["--image", "{root}/missing.png"], "--image {root}/missing.png: not a readable image"),
    (["--decoding", "draft", "--drafter", "{root}/qwen"], "has another tokenizer than --model"),
    (["--drafter", "{root}/llava-draft"], "--drafter is for --decoding draft, not 'ar'"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_bad_input_is_one_line(folders, capsys, argv, message):
    argv = [a.format(root=folders) for a in argv]
    code, _, err = run(capsys, "--model", folders / "llava", "--prompt", PROMPTS[0], *argv)
    assert code == 2 and err.count("\n") == 1 and message.format(root=folders) in err, err
