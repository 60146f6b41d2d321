"""Renamed modules keep their old import paths until the release that removes them: each warns
(DeprecationWarning naming the new path and the release) and is the new module itself."""

import importlib
import subprocess
import sys

import pytest

from mmgen.deprecation import REMOVED_IN

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
