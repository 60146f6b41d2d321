"""`/v1/images/generations` with a prompt serves text-to-image folders (LlamaGen t2i, Janus-Pro),
tiny random ones here: each image is the one `mmgen generate image --prompt` makes for that seed
(the CLI's own call, `prepare_call`, with the same decoder), byte for byte."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
from PIL import Image

pytest.importorskip("uvicorn")

from mmgen.apps.server import ServerSettings, create_app, discover_catalogs  # noqa: E402
from mmgen.image_ar.generation import ImageOptions, prepare_call  # noqa: E402
from mmgen.loading import load_pipeline  # noqa: E402
from tests.apps.test_server import error_of, running  # noqa: E402

PROMPT = "A red cat"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tests.image_ar.test_janus import tiny_janus, tiny_processor
    from tests.image_ar.test_llamagen_t2i import tiny_t2i_pipeline

    from mmgen.image_ar.janus import JanusPipeline

    root = tmp_path_factory.mktemp("t2i")
    tiny_t2i_pipeline().save_pretrained(root / "tiny-t2i")
    JanusPipeline(tiny_janus(), tiny_processor()).save_pretrained(root / "tiny-janus")
    return {"tiny-t2i": root / "tiny-t2i", "tiny-janus": root / "tiny-janus"}


@pytest.fixture(scope="module")
def base(folders):
    catalogs = discover_catalogs([str(f) for f in folders.values()])
    assert list(catalogs) == ["image"] and sorted(catalogs["image"].main) == ["tiny-janus", "tiny-t2i"]
    with running(create_app(catalogs, ServerSettings())) as url:
        yield url


def cli_image(folder, prompt: str, seed: int) -> Image.Image:
    """What `mmgen generate image --model FOLDER --prompt PROMPT --seed SEED` draws."""
    pipe = load_pipeline(str(folder), "cpu", torch.float32)
    pipe.set_progress_bar_config(disable=True)
    call = prepare_call(pipe, str(folder), ImageOptions(), "cpu", torch.float32, prompts=True)
    return call([prompt], seed, "cpu").images[0]


@pytest.mark.parametrize("model", ["tiny-t2i", "tiny-janus"])
def test_a_prompt_draws_what_the_cli_draws(base, folders, model):
    response = httpx.post(f"{base}/v1/images/generations", json={"model": model, "prompt": PROMPT, "seed": 5}, timeout=120)
    assert response.status_code == 200, response.text
    served = Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))).convert("RGB")
    expected = cli_image(folders[model], PROMPT, 5).convert("RGB")
    assert served.size == expected.size and served.tobytes() == expected.tobytes()


def test_a_text_to_image_model_takes_a_prompt_not_a_class(base):
    error = error_of(httpx.post(f"{base}/v1/images/generations", json={"model": "tiny-t2i", "class_label": 1}), 400)
    assert error["param"] == "class_label"
    error = error_of(httpx.post(f"{base}/v1/images/generations", json={"model": "tiny-janus", "prompt": " "}), 400)
    assert error["param"] == "prompt"
