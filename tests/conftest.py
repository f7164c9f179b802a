"""Shared pytest setup.

Without a CUDA GPU the Triton kernels run in Triton's interpreter (on CPU
tensors). TRITON_INTERPRET must be set before any plugin module is imported
(kernels pick interpreter vs compiler when `@triton.jit` decorates them), so it
is set here, at conftest import, ahead of every test module.
"""

import os
import shutil

import pytest

_HAS_NVIDIA = shutil.which("nvidia-smi") is not None
if not _HAS_NVIDIA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402  (after the env var on purpose)

# Under pytest-xdist (the README runs `-n 2`) each worker gets one torch thread: two workers with
# two threads each would fight over a 2-core machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` when no CUDA device is available."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
