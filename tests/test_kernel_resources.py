"""Kernel resources checked without a GPU: ptxas's report parsed (benchmarks/speed/kernel_resources.py)
and a binary over its target's shared-memory limit refused at compile time (plugins/aot.py), as
Qwen3-Next's chunked scan was (263 KB on sm_90, where a block may take 227 KB)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from benchmarks.speed import kernel_resources
from infhip.builder import compile_matrix as cm
from infhip.plugins.aot import record

PTXAS_LOG = """ptxas info    : Compiling entry function '_chunk_scan_kernel' for 'sm_90a'
ptxas info    : Function properties for _chunk_scan_kernel
    17456 bytes stack frame, 68740 bytes spill stores, 94056 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 17456 bytes cumulative stack size
"""


def test_ptxas_report_is_parsed():
    assert kernel_resources.parse_ptxas(PTXAS_LOG) == {"regs": 32, "stack": 17456, "spill_stores": 68740,
                                                       "spill_loads": 94056, "smem": 0}
    clean = "ptxas info    : Used 26 registers, used 0 barriers, 16 bytes smem\n"
    assert kernel_resources.parse_ptxas(clean) == {"regs": 26, "stack": 0, "spill_stores": 0, "spill_loads": 0,
                                                   "smem": 16}
    with pytest.raises(ValueError, match="no register count"):
        kernel_resources.parse_ptxas("ptxas fatal: something else")


def test_smoke_report_compiles_one_kernel_and_prints_its_row():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiling needs JITFunctions
    done = subprocess.run([sys.executable, "-m", "benchmarks.speed.kernel_resources", "--smoke"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "_rms_norm_kernel" in done.stdout and "1 variants for sm_90, 0 spill" in done.stdout, done.stdout


@triton.jit
def _pipelined_dot_kernel(a_ptr, out_ptr, K, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + rows[:, None] * K + k + rows[None, :])
        b = tl.load(a_ptr + (k + rows[:, None]) * BLOCK + rows[None, :])
        acc += tl.dot(a, b)
    tl.store(out_ptr + rows[:, None] * BLOCK + rows[None, :], acc)


def test_a_binary_over_the_targets_shared_memory_is_refused():
    """Two pipelined stages of [256, 256] bf16 operands take 256 KB of shared memory: the kernel
    compiles, and would never launch on an sm_90 (227 KB a block); the compile names it. [64, 64]
    takes 16 KB and compiles."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    target = cm.TARGETS["sm_90"]
    a, out = (torch.empty(256 * 512, dtype=dt, device="meta") for dt in (torch.bfloat16, torch.float32))
    with record(target, launch=False) as rec:
        for block in (64, 256):
            _pipelined_dot_kernel[(1,)](a, out, 512, BLOCK=block, num_stages=2)
    small, wide = sorted(rec.variants, key=lambda v: dict(v.constants)["BLOCK"] != "64")
    errors = cm.compile_all([small, wide], target, jobs=1, stage="cubin")
    assert set(errors) == {wide.key}, errors
    assert "bytes of shared memory on sm_90, over the 232448 a block may take" in errors[wide.key], errors[wide.key][-300:]
