"""Renamed modules and names keep their old spelling until the release that removes them: an old
import path warns (DeprecationWarning naming the new path and the release) and is the new module
itself; an old decoding shortcut or option warns once, naming its replacement, and decodes the same."""

import importlib
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from mmgen.decoding import SCALE_DECODERS, Collaborative, resolve_decoder
from mmgen.deprecation import REMOVED_IN
from tests.core.test_next_scale import ToyScaleModel, run

RENAMED = {"mmgen.decoding.drafts": "mmgen.decoding.jacobi_init", "mmgen.apps.requests.vlm": "mmgen.apps.requests.text",
           "mmgen.apps.vlm_demo": "mmgen.apps.text_demo",
           "mmgen.decoding.continuous": "mmgen.decoding.continuous_tokens",
           "mmgen.metrics": "mmgen.quality"}


@pytest.mark.parametrize("old, new", RENAMED.items())
def test_an_old_path_warns_and_is_the_new_module(old, new):
    probe = (f"import warnings\nwarnings.simplefilter('error', DeprecationWarning)\n"
             f"try:\n    import {old}\nexcept DeprecationWarning as w:\n    print(w)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == f"{old} is deprecated and will be removed in mmgen {REMOVED_IN}: import {new}"
    with pytest.warns(DeprecationWarning):
        sys.modules.pop(old, None)
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_package_itself_imports_no_old_path():
    probe = ("import warnings\nwarnings.simplefilter('error', DeprecationWarning)\n"
             "import mmgen.decoding, mmgen.quality, mmgen.image_ar.quality, mmgen.video.quality, mmgen.calibrate\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def collaborative_cases():
    """(old way, new way, the replacement the warning names): CoDe's names before they were the
    video's (`collaborative`, `small=`, `large_steps=`), each a function of the small model."""
    spec = lambda text, small: replace(resolve_decoder(text, SCALE_DECODERS), small=small)
    return {
        "shortcut": (lambda s: spec("code:large_steps=2", s), lambda s: spec("collaborative:large_steps=2", s), "'collaborative'"),
        "spec option": (lambda s: spec("collaborative:draft_steps=2", s), lambda s: spec("collaborative:large_steps=2", s),
                        "large_steps="),
        "refiner keyword": (lambda s: Collaborative(refiner=s, large_steps=2), lambda s: Collaborative(small=s, large_steps=2),
                            "small="),
        "draft_steps keyword": (lambda s: Collaborative(small=s, draft_steps=2), lambda s: Collaborative(small=s, large_steps=2),
                                "large_steps="),
    }


@pytest.mark.parametrize("case", ["shortcut", "spec option", "refiner keyword", "draft_steps keyword"])
def test_an_old_collaborative_name_warns_once_and_decodes_the_same_tokens(case):
    old, new, instead = collaborative_cases()[case]
    small = ToyScaleModel(seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoder = old(small)
    assert [(w.category, str(w.message).partition(" is deprecated")[2]) for w in caught] == [
        (DeprecationWarning, f" and will be removed in mmgen {REMOVED_IN}: use {instead}")]
    assert decoder == new(small)
    for seed in range(3):
        a, b = run(decoder, ToyScaleModel(seed=1), seed=seed), run(new(small), ToyScaleModel(seed=1), seed=seed)
        assert a.stats.stage_forwards == [2, 1] and all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))


def test_an_old_collaborative_option_beside_its_new_name_is_an_error():
    with pytest.raises(ValueError, match="give small= only"), pytest.warns(DeprecationWarning):
        Collaborative(small=1, refiner=2)
    with pytest.raises(ValueError, match="give large_steps= only"), pytest.warns(DeprecationWarning):
        resolve_decoder("collaborative:large_steps=2,draft_steps=3", SCALE_DECODERS)
    with pytest.warns(DeprecationWarning, match=r"Collaborative.refiner is deprecated .*: use .small"):
        assert Collaborative(small=1).refiner == 1
    with pytest.raises(ValueError, match="unknown decoding 'code'"):  # the old shortcut was VAR's only
        resolve_decoder("code")
