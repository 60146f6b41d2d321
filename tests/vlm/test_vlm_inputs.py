"""What a VLM call or load refuses, in one line and before any work: images of the wrong kind,
a chat template the sandbox blocks, a folder of a family mmgen does not serve (named by its
model_type); a folder's own code is never run; `from mmgen.vlm import VLMPipeline` is lazy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import mmgen
from mmgen.hub import CheckpointError

from tests.vlm.tiny import PROMPTS, images, tiny_llava


@pytest.fixture(scope="module")
def pipe():
    return tiny_llava(0)


@pytest.mark.parametrize("image,message", [
    (5, "prompt 0's image 0 must be a PIL image, an image array [H, W, C] or a file path, got int"),
    ("{tmp}/notes.txt", "prompt 0's image 0 ({tmp}/notes.txt): not a readable image"),
    ("{tmp}/missing.png", "prompt 0's image 0 ({tmp}/missing.png): not a readable image"),
    (torch.zeros(0, 4, 3), "must be a PIL image, an image array [H, W, C] or a file path, got Tensor"),
])
def test_an_image_of_the_wrong_kind_is_one_line(pipe, tmp_path, image, message, monkeypatch):
    (tmp_path / "notes.txt").write_text("not an image")
    image = image.format(tmp=tmp_path) if isinstance(image, str) else image
    monkeypatch.setattr(type(pipe.model), "forward", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(ValueError) as error:
        pipe(PROMPTS[0], image, max_new_tokens=2)
    assert message.format(tmp=tmp_path) in str(error.value) and "\n" not in str(error.value)


def test_one_prompt_takes_its_images_bare_or_as_a_batch_of_one(pipe):
    """`pipe([q], [[image]])` (the batch form, one row) is `pipe(q, image)`, not an error."""
    picture = images(1)[0]
    alone = pipe(PROMPTS[0], picture, max_new_tokens=4)
    assert torch.equal(pipe([PROMPTS[0]], [[picture]], max_new_tokens=4).token_ids, alone.token_ids)
    assert torch.equal(pipe([PROMPTS[0]], [picture], max_new_tokens=4).token_ids, alone.token_ids)


def test_an_image_file_path_is_read(pipe, tmp_path):
    images(1)[0].save(tmp_path / "a.png")
    by_path = pipe(PROMPTS[0], tmp_path / "a.png", max_new_tokens=4).token_ids
    assert torch.equal(by_path, pipe(PROMPTS[0], images(1)[0], max_new_tokens=4).token_ids)


def test_a_chat_template_the_sandbox_blocks_is_one_line(tmp_path):
    pipe = tiny_llava(0)
    pipe.processor.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match=r"^the model's chat template failed \(SecurityError\): .*unsafe") as error:
        pipe(PROMPTS[0], images(1)[0], max_new_tokens=2)
    assert "\n" not in str(error.value)


def test_a_family_mmgen_does_not_serve_is_refused_by_its_model_type(tmp_path):
    from mmgen.vlm.pipeline import VLMPipeline

    folder = tmp_path / "kosmos"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "kosmos-2"}))
    with pytest.raises(CheckpointError, match="model_type 'kosmos-2' \\(its config.json\\) is not one mmgen opens"):
        mmgen.load_pipeline(folder)
    with pytest.raises(ValueError, match="model_type 'kosmos-2' is not a vision-language family mmgen serves"):
        VLMPipeline.from_pretrained(folder)


def test_a_folders_own_code_never_runs(tmp_path, monkeypatch):
    """A folder whose configs name its own classes (`auto_map`) loads with transformers' classes;
    every transformers loader is told not to trust remote code, so none asks or runs it."""
    import transformers

    folder = tmp_path / "llava"
    tiny_llava(0).save_pretrained(folder)
    (folder / "evil.py").write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"
                                    "from transformers import LlavaConfig as C, LlavaProcessor as P, "
                                    "LlavaForConditionalGeneration as M\n")
    auto_map = {"AutoConfig": "evil.C", "AutoProcessor": "evil.P", "AutoModelForImageTextToText": "evil.M"}
    for name in ("config.json", "processor_config.json", "tokenizer_config.json"):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "auto_map": auto_map}))
    asked = []
    for cls in (transformers.AutoConfig, transformers.AutoProcessor, transformers.AutoModelForImageTextToText):
        original = cls.from_pretrained.__func__
        monkeypatch.setattr(cls, "from_pretrained", classmethod(
            lambda c, *a, _original=original, **k: asked.append((c.__name__, k.get("trust_remote_code"))) or _original(c, *a, **k)))
    pipe = mmgen.load_pipeline(folder)
    assert type(pipe.model) is transformers.LlavaForConditionalGeneration and type(pipe.processor) is transformers.LlavaProcessor
    assert not (folder / "RAN").exists()
    assert {name for name, _ in asked} >= {"AutoConfig", "AutoProcessor", "AutoModelForImageTextToText"}
    assert all(trust is False for _, trust in asked), asked


def test_the_pipeline_imports_from_its_package_lazily():
    code = ("import sys, mmgen.vlm; assert 'mmgen.vlm.pipeline' not in sys.modules and 'transformers' not in sys.modules; "
            "from mmgen.vlm import VLMPipeline; import mmgen; assert VLMPipeline is mmgen.VLMPipeline; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
