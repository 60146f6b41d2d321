"""The device suite: what must hold on an accelerator, run on the device `MMGEN_TEST_DEVICE` names.

    python -m pytest -m device                            # cpu (the default), part of the normal suite
    MMGEN_TEST_DEVICE=cuda python -m pytest -m device     # the same tests on the GPU

Every test here takes the `device` fixture; a device torch cannot see skips the folder with
the reason. Tiny random models only, built by the family tests' own builders, so the folder
runs from a copy of the code without `*/assets/` (benchmarks/gpu_check.py runs it there).
"""

from __future__ import annotations

import os

import pytest
import torch

ENV = "MMGEN_TEST_DEVICE"


def requested_device() -> torch.device:
    """The device `MMGEN_TEST_DEVICE` names (default cpu); a value torch cannot parse stops the
    run with one line."""
    name = os.environ.get(ENV, "cpu").strip() or "cpu"
    try:
        return torch.device(name)
    except RuntimeError:
        pytest.exit(f"{ENV}={name!r} is not a torch device (e.g. cpu, cuda, cuda:1)", returncode=4)


def absent_reason(device: torch.device):
    """Why `device` cannot run here, or None when it can."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"{ENV}={device} but torch {torch.__version__} sees no CUDA device"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"{ENV}={device} but only {torch.cuda.device_count()} CUDA device(s) exist"
    elif device.type == "mps" and not torch.backends.mps.is_available():
        return f"{ENV}={device} but the MPS backend is not available"
    elif device.type not in ("cpu", "cuda", "mps"):
        return f"{ENV}={device}: the device suite knows cpu, cuda and mps"
    return None


@pytest.fixture(scope="session")
def device() -> torch.device:
    device = requested_device()
    reason = absent_reason(device)
    if reason:
        pytest.skip(reason)
    return device


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one intra-op CPU thread is as fast and does not thrash a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

