"""Where the fp8 kernels run: GPUs of sm_89 or later (fp8 tensor cores; Triton's fp8e4nv needs
them too), activations in any of the three build dtypes. Asked by fp8_linear.py's dispatch
(``linear_path``) and by the ahead-of-time enumerations of both fp8 kernels (fp8_linear.py,
fp8_skinny_gemm.py), which is why it is a module of its own.
"""

from __future__ import annotations

import functools

import torch

from .aot import Target
from .dtypes import DTYPES

FP8_MIN_CAPABILITY = 89  # Ada / Hopper: fp8 tensor cores; Triton's fp8e4nv needs it too


@functools.lru_cache(maxsize=None)
def _cuda_has_fp8(index: int) -> bool:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor >= FP8_MIN_CAPABILITY


def device_has_fp8(device: torch.device) -> bool:
    """Does this device run the fp8 kernels (a CUDA GPU of sm_89 or later)?"""
    if device.type != "cuda":
        return False
    return _cuda_has_fp8(device.index if device.index is not None else torch.cuda.current_device())


def target_has_fp8(target: Target) -> bool:
    return target.capability >= FP8_MIN_CAPABILITY


def fast_dtype(dtype: torch.dtype) -> bool:
    """Activations the fp8 kernels take: all three build dtypes (module docstring)."""
    return dtype in DTYPES.values()


__all__ = ["FP8_MIN_CAPABILITY", "device_has_fp8", "target_has_fp8", "fast_dtype"]
