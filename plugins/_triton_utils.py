"""Small helpers shared by the Triton plugins.

Dispatch rule used by every plugin: a tensor on CUDA goes to the Triton launcher,
anything else to the plain-torch reference. The launchers themselves also run on
CPU tensors under ``TRITON_INTERPRET=1`` (that is how the tests exercise them).
"""

from __future__ import annotations

import functools
import os
import tempfile

import torch
import triton

from infhip.plugins import aot
from infhip.plugins.aot import recording_target


def _writable(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            return True
    except OSError:
        return False


def _ensure_writable_cache() -> None:
    """A Triton cache dir that cannot be written (a read-only home, a locked-down container)
    would fail the first compile of a launcher or kernel: use a private temporary one instead.
    Engines' own kernels come from the engine either way (runtime/kernel_store.py)."""
    from triton import knobs
    if os.environ.get("TRITON_INTERPRET") != "1" and not _writable(knobs.cache.dir):
        knobs.cache.dir = tempfile.mkdtemp(prefix="infhip-triton-")


_ensure_writable_cache()


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the fused Triton path should run (all given tensors on CUDA; any tensors while
    plugins/aot.py records launches for a GPU target)."""
    return all(t.is_cuda for t in tensors) or (aot.ACTIVE > 0 and recording_target() is not None)


def triton_on(*tensors: torch.Tensor) -> bool:
    """Like use_triton, but CPU tensors also take the Triton launcher under TRITON_INTERPRET=1
    (the plugins whose launchers the tests exercise through the interpreter)."""
    return use_triton(*tensors) or os.environ.get("TRITON_INTERPRET") == "1"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tl.arange needs power-of-two extents)."""
    return triton.next_power_of_2(max(int(n), 1))


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query is slow)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_num_sms(device: torch.device) -> int:
    """SM count for `device`; the target's while recording launches (plugins/aot.py); a nominal 4
    off-GPU (interpreter tests)."""
    target = recording_target()
    if target is not None:
        return target.num_sms
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_sms(index)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 for fp32 inputs, default tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreted(t: torch.Tensor) -> bool:
    """True when a launch on ``t`` runs in Triton's CPU interpreter (a CPU tensor). CUDA tensors,
    and the meta tensors plugins/aot.py enumerates launches with (they stand for the GPU target),
    are compiled: launchers choose interpreter-only workarounds (float32 dot operands) from this,
    not from ``not t.is_cuda``, so that an enumerated launch specializes as the GPU's does."""
    return t.device.type == "cpu"
