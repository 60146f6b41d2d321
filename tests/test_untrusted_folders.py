"""Model folders are not trusted: their config files are read only when they are small regular
files, a config cannot make loading allocate what the weight file does not hold, and no
transformers remote code ever runs."""

from __future__ import annotations

import json
import os
import threading

import pytest

from mmgen.hub import CheckpointError, read_json
from mmgen.loading import load_pipeline
from mmgen.video.profiler import CpuPeak
from tests.conftest import tiny_pipeline

MB = 1 << 20


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("untrusted") / "pipe"
    tiny_pipeline().save_pretrained(folder)
    return folder


def copy_of(saved, tmp_path):
    import shutil

    return shutil.copytree(saved, tmp_path / "pipe")


def set_config(path, **changes):
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("weights", ["present", "missing"])
def test_a_config_cannot_make_loading_allocate_what_the_weights_do_not_hold(saved, tmp_path, weights):
    """A config of dim 1536 and 16 layers (1.7 GB of parameters) beside a weight file of a few
    kB, or none: refused from the file's header, before any parameter exists."""
    folder = copy_of(saved, tmp_path)
    set_config(folder / "transformer" / "config.json", dim=1536, n_layer=16, n_head=16)
    if weights == "missing":
        (folder / "transformer" / "model.safetensors").unlink()
    peak = CpuPeak()
    with pytest.raises((CheckpointError, FileNotFoundError)) as error:
        load_pipeline(folder)
    grown = peak.stop()
    assert grown < 200 * MB, f"loading grew the process by {grown / MB:.0f} MB"
    assert ("does not exist" if weights == "missing" else "shape mismatches") in str(error.value)


def test_a_matching_folder_still_loads_exactly(saved):
    import torch

    loaded = load_pipeline(saved)
    original = tiny_pipeline()
    for name in ("transformer", "vq"):
        mine, theirs = getattr(loaded, name).state_dict(), getattr(original, name).state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def _replace(path, kind):
    path.unlink()
    if kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:  # a sparse 1 GB file: no disk used
        with open(path, "wb") as file:
            file.truncate(1 << 30)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "huge"])
@pytest.mark.parametrize("which", ["model_index.json", "transformer/config.json", "config.json"])
def test_config_files_are_read_only_when_they_are_small_regular_files(saved, tmp_path, kind, which):
    if which == "config.json":  # a transformers folder: its config names the model_type
        folder = tmp_path / "transformers-folder"
        folder.mkdir()
        (folder / which).write_text('{"model_type": "llava"}')
    else:
        folder = copy_of(saved, tmp_path)
    _replace(folder / which, kind)
    outcome = {}

    def load():
        try:
            load_pipeline(folder)
        except Exception as error:  # noqa: BLE001 - what the test inspects
            outcome["error"] = error

    worker = threading.Thread(target=load, daemon=True)  # a FIFO would block an unguarded open
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), f"loading a folder whose {which} is a {kind} hangs"
    error = outcome.get("error")
    assert isinstance(error, CheckpointError), error
    expected = "bytes; a config file is at most" if kind == "huge" else "is not a regular file"
    assert expected in str(error), error


def test_read_json_takes_a_link_to_a_small_regular_file(tmp_path):
    (tmp_path / "blob").write_text('{"model_type": "llava"}')
    os.symlink(tmp_path / "blob", tmp_path / "config.json")  # the Hub cache's layout
    assert read_json(tmp_path / "config.json") == {"model_type": "llava"}
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not an object"):
        read_json(tmp_path / "list.json")


def _plant_remote_tokenizer(folder, marker) -> None:
    """A tokenizer whose class is the folder's own code (transformers' `auto_map`), which, if
    it ever ran, would leave `marker`."""
    (folder / "evil_tokenizer.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", None]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["csm", "video"])
def test_a_folders_own_code_never_runs_even_when_a_user_would_say_yes(family, tmp_path, monkeypatch):
    """transformers asks on a terminal before it runs a folder's code unless the caller says
    `trust_remote_code`; mmgen always says False, so nothing asks and nothing runs (here the
    prompt would be answered "y")."""
    if family == "csm":
        from tests.audio.tiny import tiny_csm

        folder = tmp_path / "csm"
        tiny_csm(1).save_pretrained(folder)
        tokenizer = folder
    else:
        from tests.video.tiny import tiny_video_pipeline

        folder = tmp_path / "video"
        tiny_video_pipeline().save_pretrained(folder)
        tokenizer = folder / "tokenizer"
    marker = tmp_path / "remote-code-ran"
    _plant_remote_tokenizer(tokenizer, marker)
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    with pytest.raises(ValueError, match="custom code"):
        load_pipeline(folder)
    assert not asked and not marker.exists()
