"""FP8 linear layers: y = x @ (w * scale)^T (+ bias) with fp8 weights, on whatever runs it best.

Weights (written by infhip-build --weight-dtype fp8, `quantize_weight`): w [N, K] float8_e4m3fn and
one float32 scale per output channel,

    scale[n] = max(amax_k |W[n, k]|, 1e-30) / 448        w[n, k] = fp8(W[n, k] / scale[n])

(448: the largest e4m3 value; the same rounding as the fp8 KV cache, plugins/kv_quant.py). A
per-channel scale needs no calibration data and keeps every row's relative error at e4m3's 2^-4.

`fp8_linear` picks one of three paths per call:
  * reference (`fp8_linear_ref`): dequantize w to x's dtype and F.linear. The CPU's path, the
    tests' reference, and the path of GPUs without fp8 tensor cores (below sm_89; the runtime
    warns once at load).
  * small M (<= 16 rows, decode) on an sm_89+ GPU: the weight-only fp8 skinny kernel
    (plugins/fp8_skinny_gemm.py) at the config its `table_config` names; x stays in its dtype.
  * otherwise (prefill; an M the table sends away): torch._scaled_mm (cuBLASLt FP8 tensor cores)
    with per-token dynamic activation scales — `quantize_act` turns x into fp8 rows and a float32
    scale per row (one Triton kernel: one read of x, the scaled_mm reads a third of x's bytes), and
    rowwise scaling applies scale_a[m] * scale_b[n] to each output. Its output is bf16 (the one
    dtype every rowwise kernel writes: CUTLASS on sm_89, cuBLAS on sm_90), cast to x's dtype
    (float16 / float32 engines lose 2^-9 there, far below the weights' 2^-4). Needs K and N
    divisible by 16 (every supported model's are); other shapes take the reference path.
All paths are CUDA-graph safe: no host sync, output shapes fixed by the input's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, triton_on
from .aot import Target, recording_target
from .fp8_skinny_gemm import FP8_DTYPE, MAX_M, fp8_linear_ref, fp8_skinny_gemm_triton, table_config
from .kv_quant import FP8_MAX, _round_to_e4m3, quantize_rows

FP8_MIN_CAPABILITY = 89  # Ada / Hopper: fp8 tensor cores; Triton's fp8e4nv needs it too
MAX_BLOCK_K = 4096  # quantize_act reads a row in tiles of at most this many elements
# torch._scaled_mm's use_fast_accum (Hopper: fp8 accumulation without periodic promotion).
# Measured on the H200 (benchmarks/bench_fp8_weights.py, Llama-8B shapes): 0.96x (M = 4096) and
# 0.97x (M = 32768) of the promoted GEMM's time on down_proj. Off: 3-4 % of a prefill GEMM does
# not pay for an accumulation precision that nothing here has measured on a real model.
FAST_ACCUM = False


def quantize_weight(w: torch.Tensor, rows_per_chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (fp8 [N, K], float32 scale [N]), a chunk of rows at a time
    (bounds the float32 temporaries of a 128K-row LM head)."""
    parts = [quantize_rows(w[i:i + rows_per_chunk]) for i in range(0, w.shape[0], rows_per_chunk)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


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
    return dtype in (torch.bfloat16, torch.float16, torch.float32)


def _fast_device(x: torch.Tensor) -> bool:
    """The fp8 kernels' device: an sm_89+ GPU, or any tensor while plugins/aot.py records launches
    for an sm_89+ target (the coverage tests then run them under the interpreter)."""
    target = recording_target()
    if target is not None:
        return target_has_fp8(target)
    return device_has_fp8(x.device)


@triton.jit
def _quantize_act_kernel(
    # inputs
    x_ptr,  # [M, K], last dim contiguous; one program per row
    # outputs
    q_ptr,  # [M, K] float8_e4m3fn, contiguous
    s_ptr,  # [M] float32
    # constants
    K, stride_xm,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 1: the row's amax
        x = tl.load(x_ptr + row * stride_xm + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE divisions (div_rn; `/` compiles to an approximate one): the same bits as quantize_rows
    amax = tl.maximum(tl.max(amax, axis=0), 1e-30) + tl.zeros((BLOCK_K,), dtype=tl.float32)
    s = tl.math.div_rn(amax, tl.full((BLOCK_K,), 448.0, tl.float32))  # [BLOCK_K], every entry the scale
    for k0 in range(0, K, BLOCK_K):  # pass 2: the row again (from L1/L2), scaled and rounded
        mask = k0 + ks < K
        x = tl.load(x_ptr + row * stride_xm + k0 + ks, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0)
        tl.store(q_ptr + row * K + k0 + ks, _round_to_e4m3(y).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row + ks, s, mask=ks == 0)


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `quantize_act`: x [M, K] -> (fp8 [M, K], float32 scale [M]), per row."""
    return quantize_rows(x)


def quantize_act_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of per-token dynamic quantization: x [M, K] (last dim contiguous) ->
    (fp8 [M, K] contiguous, float32 scale [M]); row m of x ~ float(q[m]) * scale[m]."""
    assert x.dim() == 2 and x.stride(1) == 1, f"quantize_act: x must be [M, K] with contiguous rows, got {tuple(x.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"quantize_act: unsupported dtype {x.dtype}"
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s.fill_(1e-30 / FP8_MAX)
    block_k = min(next_pow2(K), MAX_BLOCK_K)
    _quantize_act_kernel[(M,)](x, q, s, K, x.stride(0), BLOCK_K=block_k, num_warps=8 if block_k >= 2048 else 4)
    return q, s


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 quantization: the Triton kernel on CUDA (and under the interpreter), else torch."""
    return quantize_act_triton(x) if triton_on(x) else quantize_act_ref(x)


def scaled_mm_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype through fp8 x fp8: per-token x scales, per-channel w
    scales, the product rounded to bf16 (module docstring). On CUDA torch._scaled_mm; elsewhere
    (interpreter runs of the coverage tests) the same product from the dequantized operands."""
    xq, xs = quantize_act(x)
    if x.is_cuda:
        # w.t() is [K, N] column-major as cuBLASLt wants; scale_a [M, 1], scale_b [1, N] (rowwise)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=scale[None, :], out_dtype=torch.bfloat16,
                             use_fast_accum=FAST_ACCUM)
    else:
        y = (xq.float() * xs[:, None]) @ (w.float() * scale[:, None]).t()
    y = y.to(torch.bfloat16).to(x.dtype)
    if bias is not None:  # added apart: bias support of the rowwise kernels varies across torch versions
        y += bias
    return y


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w * scale[:, None], bias) for fp8 w [N, K] and float32 scale [N], x [..., K];
    the path by device, dtype and rows (module docstring)."""
    N, K = w.shape
    if not (fast_dtype(x.dtype) and _fast_device(x)) or x.dim() < 1 or x.shape[-1] != K:
        return fp8_linear_ref(x, w, scale, bias)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*x.shape[:-1], N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    config = table_config(M, N, K) if M <= MAX_M else None
    if config is not None:
        y = fp8_skinny_gemm_triton(x2, w, scale, bias, config)
    elif K % 16 == 0 and N % 16 == 0:
        y = scaled_mm_linear(x2, w, scale, bias)
    else:
        return fp8_linear_ref(x, w, scale, bias)
    return y.view(*x.shape[:-1], N)


def aot_launches(space) -> None:
    """The per-token quantization kernel of `scaled_mm_linear` (plugins/aot.py): once per input
    width K of the engine's fp8 layers that reach it (a row bound above MAX_M, or an M <= MAX_M
    the table sends to torch._scaled_mm). The row count is the grid, not an argument."""
    from ._aot_shapes import linear_layers

    if space.build.weight_dtype != "fp8" or not target_has_fp8(space.target) or not fast_dtype(space.act_dtype):
        return
    for layer in linear_layers(space):
        if not layer.fp8 or layer.n % 16 or layer.k % 16:
            continue
        small = range(1, min(MAX_M, layer.max_rows) + 1)
        if layer.max_rows > MAX_M or any(table_config(M, layer.n, layer.k) is None for M in small):
            quantize_act_triton(space.fake(2, layer.k, dtype=space.act_dtype))

