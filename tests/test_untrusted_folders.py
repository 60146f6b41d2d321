"""Model folders are not trusted: their config files are read only when they are small regular
files, a config cannot make loading allocate what the weight file does not hold, and no
transformers remote code ever runs."""

from __future__ import annotations

import json
import os
import re
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
    expected = {"huge": "bytes; a config file is at most", "fifo": "is not a regular file", "dev-zero": LINK_OUT}[kind]
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


# ------------------------------------------------------------------ bad folders are one line (issue 62, items 7, 8)
LINK_OUT = "is a symbolic link out of its model folder"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from tests.vlm.tiny import tiny_llava

    folder = tmp_path_factory.mktemp("untrusted-llava") / "llava"
    tiny_llava(0).save_pretrained(folder)
    return folder


def _link_out(path, tmp_path, content: bytes = None):
    """Replace `path` (a file or folder of a model folder) by a link to a copy of it outside the
    folder, or to a file of `content` that no one may read."""
    import shutil

    outside = tmp_path / "outside" / path.name
    outside.parent.mkdir(exist_ok=True)
    if content is None:
        shutil.move(path, outside)
    else:
        if path.exists():
            path.unlink()
        outside.write_bytes(content)
        outside.chmod(0)
    os.symlink(outside, path)


def _pickle_that_runs(path, marker) -> None:
    """A `pytorch_model.bin` that is a plain pickle which, unpickled, would run a command."""
    import pickle

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path.write_bytes(pickle.dumps({"model.embed.weight": Payload()}, protocol=4))


def bad_folder(kind, saved, llava, tmp_path):
    """A copy of a tiny folder made bad in one way: (folder, `mmgen generate` target, message)."""
    import shutil

    if kind.startswith("llamagen"):
        folder = copy_of(saved, tmp_path)
        if kind == "llamagen-dim":  # built, its FFN would overflow int64 sizes
            set_config(folder / "transformer" / "config.json", dim=999_999_744)
            return folder, "image", "transformer/config.json: dim = 999999744 is past what any model has"
        _link_out(folder / "transformer" / "model.safetensors", tmp_path, b"\0" * 64)
        return folder, "image", f"transformer/model.safetensors {LINK_OUT}"
    folder = shutil.copytree(llava, tmp_path / "llava")
    if kind.startswith("llava-hidden"):
        config = json.loads((folder / "config.json").read_text())
        config["text_config"]["hidden_size"] = 1e9 if kind == "llava-hidden-float" else 10**9
        (folder / "config.json").write_text(json.dumps(config))
        return folder, "text", f"text_config.hidden_size = {config['text_config']['hidden_size']} is past what any model has"
    if kind == "llava-pickled-bin":
        (folder / "model.safetensors").unlink()
        _pickle_that_runs(folder / "pytorch_model.bin", tmp_path / "pickle-ran")
        return folder, "text", "a weight file could not be loaded: it holds pickled objects besides tensors"
    _link_out(folder / "model.safetensors", tmp_path, b"\0" * 64)  # llava-weights-link-to-unreadable
    return folder, "text", f"model.safetensors {LINK_OUT}"


BAD_FOLDERS = ["llamagen-dim", "llamagen-weights-link-to-unreadable", "llava-hidden", "llava-hidden-float",
               "llava-pickled-bin", "llava-weights-link-to-unreadable"]


@pytest.mark.parametrize("kind", BAD_FOLDERS)
def test_a_bad_folder_is_one_checkpoint_error(saved, llava, tmp_path, kind):
    """Each of these ended in a library's traceback (an int64 overflow building LlamaGen, a
    transformers size mismatch or type error, torch's unpickling error, a safetensors header
    error through a link out of the folder); now one CheckpointError naming the cause, before
    anything is built, and no pickled code ever runs."""
    folder, _, message = bad_folder(kind, saved, llava, tmp_path)
    with pytest.raises(CheckpointError) as error:
        load_pipeline(folder)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "pickle-ran").exists()


@pytest.mark.parametrize("kind", BAD_FOLDERS)
def test_mmgen_generate_reports_a_bad_folder_in_one_line(saved, llava, tmp_path, capsys, kind):
    from tests.test_cli import mmgen_here

    folder, target, message = bad_folder(kind, saved, llava, tmp_path)
    condition = ["--class-labels", "1", "--out", tmp_path / "out"] if target == "image" else ["--prompt", "what is this ?"]
    result = mmgen_here(capsys, "generate", target, "--model", folder, *condition)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert len(lines) == 1 and lines[0].startswith("mmgen: error: ") and message in lines[0], result.stderr


@pytest.mark.parametrize("family,name", [
    ("llava", "chat_template.jinja"), ("llava", "tokenizer.json"), ("llava", "tokenizer_config.json"),
    ("llava", "config.json"), ("llava", "processor_config.json"), ("llava", "model.safetensors"),
    ("llamagen", "model_index.json"), ("llamagen", "transformer/config.json"), ("llamagen", "vq/model.safetensors"),
    ("llamagen", "vq"), ("dia", "codec"), ("video", "tokenizer"), ("video", "vae/config.json"),
])
def test_no_file_of_a_folder_is_read_through_a_link_out_of_it(saved, llava, tmp_path, family, name):
    """A file or folder of a model folder that is a link leaving it (a chat template that would
    become every prompt, a private file as weights, another model's codec) is refused before
    anything is read, whichever loader would read it: mmgen's, transformers' or diffusers'."""
    import shutil

    if family == "llamagen":
        folder = copy_of(saved, tmp_path)
    elif family == "llava":
        folder = shutil.copytree(llava, tmp_path / "llava")
    elif family == "dia":
        from tests.audio.tiny import tiny_dia

        folder = tmp_path / "dia"
        tiny_dia(0).save_pretrained(folder)
    else:
        from tests.video.tiny import tiny_video_pipeline

        folder = tmp_path / "video"
        tiny_video_pipeline().save_pretrained(folder)
    _link_out(folder / name, tmp_path)
    with pytest.raises(CheckpointError, match=LINK_OUT):
        load_pipeline(folder)


def test_a_chat_template_linked_out_of_the_folder_is_refused_by_the_cli(llava, tmp_path, capsys):
    """It was followed, and its text became the prompt the model answered."""
    import shutil

    from tests.test_cli import mmgen_here

    folder = shutil.copytree(llava, tmp_path / "llava")
    (folder / "chat_template.jinja").unlink()
    (tmp_path / "elsewhere.jinja").write_text("SECRET {{ messages[0]['content'][0]['text'] }}")
    os.symlink(tmp_path / "elsewhere.jinja", folder / "chat_template.jinja")
    result = mmgen_here(capsys, "generate", "text", "--model", folder, "--prompt", "what is this ?")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"mmgen: error: {folder / 'chat_template.jinja'} {LINK_OUT}; mmgen reads a model's files only from inside its "
        "folder (copy the file in, or link to the whole folder instead)"]


def test_links_inside_a_folder_and_the_hub_cache_layout_still_load(saved, llava, tmp_path):
    """Links that stay inside the folder are fine, and so is a Hugging Face cache snapshot, whose
    files link to the repo's `blobs/` beside `snapshots/`."""
    import shutil

    folder = shutil.copytree(llava, tmp_path / "llava")
    (folder / "files").mkdir()
    shutil.move(folder / "tokenizer.json", folder / "files" / "tokenizer.json")
    os.symlink("files/tokenizer.json", folder / "tokenizer.json")
    assert load_pipeline(folder).processor.tokenizer.get_vocab() == load_pipeline(llava).processor.tokenizer.get_vocab()

    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    for source in saved.rglob("*"):
        if source.is_file():
            blob = repo / "blobs" / f"{abs(hash(str(source)))}"
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, blob)
            (snapshot / source.relative_to(saved)).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(blob, (snapshot / source.relative_to(saved)).parent), snapshot / source.relative_to(saved))
    assert load_pipeline(snapshot).transformer.config == load_pipeline(saved).transformer.config


@pytest.mark.parametrize("config,field", [
    ({"depth": 10**9}, "depth"),  # VAR: a billion blocks would take hours to build, even on the meta device
    ({"encoder_embed_dim": 10**9, "encoder_depth": 2}, "encoder_embed_dim"),  # MAR
    ({"mlp_ratio": 1e9}, "mlp_ratio"),  # MAR, VAR: the MLP width is a multiple of the model's
    ({"encoder_ch_mult": [1, 2, 10**8]}, "encoder_ch_mult"),  # LlamaGen's VQ
    ({"decoder_config": {"hidden_size": 10**7}}, "decoder_config.hidden_size"),  # Dia
    ({"codec_config": {"codebook_size": 10**9}}, "codec_config.codebook_size"),  # CSM's Mimi
    ({"num_layers": 10**6, "attention_head_dim": 128}, "num_layers"),  # Wan's denoiser
    ({"text_config": {"max_position_embeddings": 10**12}}, "text_config.max_position_embeddings"),
    ({"hidden_size": float("nan")}, "hidden_size"),
])
def test_every_familys_size_fields_are_bounded_by_one_rule(config, field):
    from mmgen.hub import check_config_sizes

    with pytest.raises(CheckpointError, match=f"^cfg: {re.escape(field)} = .* is past what any model has"):
        check_config_sizes(config, "cfg")


def test_sizes_within_bounds_may_still_describe_too_many_parameters():
    from mmgen.hub import check_config_sizes

    with pytest.raises(CheckpointError, match=r"the sizes of text_config describe about 2.7e\+14 parameters"):
        check_config_sizes({"text_config": {"hidden_size": 1 << 18, "num_hidden_layers": 4000}}, "cfg")
    check_config_sizes({"hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                        "vocab_size": 128256, "max_position_embeddings": 131072}, "Llama-3.1-405B")


def test_every_bundled_folder_passes_the_folder_checks():
    from mmgen import registry
    from mmgen.hub import check_model_folder

    for name, folder in registry.bundled_models().items():
        check_model_folder(folder)
