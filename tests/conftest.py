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


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory):
    """The run's cache of tiny checkpoints and engines (tests/_tiny.py TinyEngines): a test or a
    module fixture asking for an engine another module already built gets the same folder, so
    each distinct engine is built once per session (per pytest-xdist worker). Read-only."""
    from tests._tiny import TinyEngines
    return TinyEngines(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_engine(tiny_engines):
    """``tiny_engine(arch="llama", *, tokenizer=False, hf=None, **build_engine_kwargs) -> Path``:
    a cached tiny engine (float32, CPU unless told); ``tiny_engine(**API_ENGINE)`` is the API and
    server tests' engine."""
    return tiny_engines.engine


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_engines):
    """``tiny_checkpoint(arch="llama", tokenizer=False, seed=0, **hf_overrides) -> Path``: the
    cached tiny Hugging Face checkpoint folder the same-argument engines were built from."""
    return tiny_engines.checkpoint


@pytest.fixture
def reference_pruning(monkeypatch):
    """Pruning stages through their float64 torch reference while every other plugin stays on
    the interpreter: for runtime tests about a decode-side kernel path (key / value banks), where
    the interpreted SelectRep kernel would take ~3/4 of the time (it is checked against the
    reference in test_infinitehip_pruning / test_offload_pruning, and interpreted in the runtime
    by test_raw_keys_in_prefill_under_interpreter and the offloaded-prefill test). Both runs a
    test compares take the same path, so their tokens still compare exactly."""
    import infhip.plugins.infinitehip.pruning as pruning
    monkeypatch.setattr(pruning, "triton_on", lambda *tensors: False)
