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

Fused activation quantization: the RMSNorm and gated-activation kernels (plugins/rms_norm.py,
plugins/activation.py) can write their output row directly as e4m3 + a float32 scale (`Fp8Act`)
with the rounding and scale rule of `quantize_act` (the shared helpers `row_scale_e4m3` and
`to_e4m3_grid` below): `fp8_linear` then skips `quantize_act`, and the product is bit-identical
to quantizing their bf16 output separately. The model blocks hand an `Fp8Act` only where
`takes_fp8_act` says the consumer runs torch._scaled_mm (runtime/models/common.py); any other
path dequantizes it (correct, not the fast path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, triton_on
from .aot import recording_target
from .fp8_skinny_gemm import FP8_DTYPE, MAX_M, fp8_linear_ref, fp8_skinny_gemm_triton, table_config
# which devices, targets and dtypes run the fp8 kernels (the skinny kernel's enumeration asks too)
from .fp8_support import FP8_MIN_CAPABILITY, device_has_fp8, fast_dtype, target_has_fp8
from .kv_quant import FP8_MAX, _round_to_e4m3, dequantize_rows, quantize_rows

MAX_BLOCK_K = 4096  # quantize_act reads a row in tiles of at most this many elements
# torch._scaled_mm's use_fast_accum (Hopper: fp8 accumulation without periodic promotion).
# Measured on the H200 (benchmarks/speed/bench_fp8_weights.py, Llama-8B shapes): 0.96x (M = 4096) and
# 0.97x (M = 32768) of the promoted GEMM's time on down_proj. Off: 3-4 % of a prefill GEMM does
# not pay for an accumulation precision that nothing here has measured on a real model.
FAST_ACCUM = False


def quantize_weight(w: torch.Tensor, rows_per_chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (fp8 [N, K], float32 scale [N]), a chunk of rows at a time
    (bounds the float32 temporaries of a 128K-row LM head)."""
    parts = [quantize_rows(w[i:i + rows_per_chunk]) for i in range(0, w.shape[0], rows_per_chunk)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _fast_device(device: torch.device) -> bool:
    """The fp8 kernels' device: an sm_89+ GPU, or any device while plugins/aot.py records
    launches for an sm_89+ target (the coverage tests then run them under the interpreter)."""
    target = recording_target()
    if target is not None:
        return target_has_fp8(target)
    return device_has_fp8(device)


@triton.jit
def row_scale_e4m3(amax):
    """amax [B] float32: elementwise maxima of |row| over parts of one row (zeros allowed) ->
    [B], every entry the row's scale max(amax, 1e-30) / 448 as an IEEE division (div_rn; `/`
    compiles to an approximate one): the same bits as quantize_rows. Every launcher of per-token
    activation quantization (this module, rms_norm, activation) goes through it."""
    m = tl.maximum(tl.max(amax, axis=0), 1e-30) + tl.zeros_like(amax)
    return tl.math.div_rn(m, tl.zeros_like(amax) + 448.0)


@triton.jit
def to_e4m3_grid(x, s):
    """float32 x [B] / scale s [B] (row_scale_e4m3), clamped to +-448 and rounded to the e4m3
    grid (still float32: the caller's cast to fp8 is exact)."""
    return _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0))


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
    s = row_scale_e4m3(amax)  # [BLOCK_K], every entry the scale
    for k0 in range(0, K, BLOCK_K):  # pass 2: the row again (from L1/L2), scaled and rounded
        mask = k0 + ks < K
        x = tl.load(x_ptr + row * stride_xm + k0 + ks, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * K + k0 + ks, to_e4m3_grid(x, s).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row + ks, s, mask=ks == 0)


@dataclass(frozen=True)
class Fp8Act:
    """An activation already quantized per token, as `quantize_act` returns it: q [M, K]
    float8_e4m3fn (contiguous), scale [M] float32 (row m ~ float(q[m]) * scale[m]), and dtype:
    the activation dtype it stands for (fp8_linear's output dtype). Written by the fused norm /
    activation kernels for an fp8 linear's torch._scaled_mm path."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self):
        assert self.q.dim() == 2 and self.q.dtype == FP8_DTYPE and self.q.is_contiguous(), (
            f"Fp8Act.q must be contiguous float8_e4m3fn [M, K], got {self.q.dtype} {tuple(self.q.shape)}")
        assert self.scale.shape == self.q.shape[:1] and self.scale.dtype == torch.float32, (
            f"Fp8Act.scale must be float32 [{self.q.shape[0]}], got {self.scale.dtype} {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """[M, K] in dtype (the reference path's input)."""
        return dequantize_rows(self.q, self.scale, self.dtype)


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


def _scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp8 xq [M, K] with per-row scales xs [M] times fp8 w [N, K] with per-channel scales ->
    [M, N] in dtype (rounded to bf16 first). On CUDA torch._scaled_mm; elsewhere (interpreter
    runs of the coverage tests) the same product from the dequantized operands."""
    if xq.is_cuda:
        # w.t() is [K, N] column-major as cuBLASLt wants; scale_a [M, 1], scale_b [1, N] (rowwise)
        y = torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=scale[None, :], out_dtype=torch.bfloat16,
                             use_fast_accum=FAST_ACCUM)
    else:
        y = (xq.float() * xs[:, None]) @ (w.float() * scale[:, None]).t()
    y = y.to(torch.bfloat16).to(dtype)
    if bias is not None:  # added apart: bias support of the rowwise kernels varies across torch versions
        y += bias
    return y


def scaled_mm_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype through fp8 x fp8: per-token x scales (`quantize_act`),
    per-channel w scales, the product rounded to bf16 (module docstring)."""
    xq, xs = quantize_act(x)
    return _scaled_mm(xq, xs, w, scale, bias, x.dtype)


def linear_path(M: int, N: int, K: int, dtype: torch.dtype, device: torch.device) -> str:
    """Which path `fp8_linear` takes for M rows [M, K] of an activation in dtype on device
    against w [N, K]: "ref", "skinny" or "scaled_mm" (module docstring). The one rule both
    fp8_linear and `takes_fp8_act` read."""
    if not (fast_dtype(dtype) and _fast_device(device)):
        return "ref"
    if M <= MAX_M and table_config(M, N, K) is not None:
        return "skinny"
    return "scaled_mm" if K % 16 == 0 and N % 16 == 0 else "ref"


def takes_fp8_act(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Would fp8_linear(x', w, ...) quantize x' per token for torch._scaled_mm, for an x' of x's
    rows, dtype and device (x [M, K] may be the producer's input, e.g. the norm's)? Then its
    producer may hand it an `Fp8Act` instead (fused quantization). Decode rows (the skinny
    kernel), CPUs and GPUs below sm_89 say no: they keep the activation dtype."""
    N, K = w.shape
    return x.dim() == 2 and x.shape[0] > 0 and linear_path(x.shape[0], N, K, x.dtype, x.device) == "scaled_mm"


def _fp8_linear_quantized(x: Fp8Act, w: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """fp8_linear of a pre-quantized activation: the scaled_mm product without `quantize_act`;
    any other path (not what the model blocks hand one to) takes the dequantized rows."""
    M, K = x.shape
    assert w.shape[1] == K, f"fp8_linear: Fp8Act of width {K} against w {tuple(w.shape)}"
    if M > 0 and linear_path(M, w.shape[0], K, x.dtype, x.q.device) == "scaled_mm":
        return _scaled_mm(x.q, x.scale, w, scale, bias, x.dtype)
    return fp8_linear(x.dequantize(), w, scale, bias)


def fp8_linear(x: torch.Tensor | Fp8Act, w: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w * scale[:, None], bias) for fp8 w [N, K] and float32 scale [N], x [..., K]
    (or an `Fp8Act` [M, K]: already quantized per token); the path by device, dtype and rows
    (module docstring)."""
    if isinstance(x, Fp8Act):
        return _fp8_linear_quantized(x, w, scale, bias)
    N, K = w.shape
    if x.dim() < 1 or x.shape[-1] != K:
        return fp8_linear_ref(x, w, scale, bias)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    path = linear_path(M, N, K, x.dtype, x.device)
    if path == "ref":
        return fp8_linear_ref(x, w, scale, bias)
    if M == 0:
        return x.new_empty(*x.shape[:-1], N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if path == "skinny":
        y = fp8_skinny_gemm_triton(x2, w, scale, bias, table_config(M, N, K))
    else:
        y = scaled_mm_linear(x2, w, scale, bias)
    return y.view(*x.shape[:-1], N)


def scaled_mm_reachable(space, name: str) -> bool:
    """Does the engine's fp8 linear layer ``name`` ("qkv_proj", "down_proj", ...) reach the
    scaled_mm path for some row count (a row bound above MAX_M, or an M <= MAX_M the table sends
    away)? What the builder enumerates activation quantization by (plugins/aot.py): here, and
    the fused forms in plugins/rms_norm.py and plugins/activation.py."""
    from ._aot_shapes import linear_layers

    if space.build.weight_dtype != "fp8" or not target_has_fp8(space.target) or not fast_dtype(space.act_dtype):
        return False
    for layer in linear_layers(space):
        if layer.name != name or not layer.fp8 or layer.n % 16 or layer.k % 16:
            continue
        small = range(1, min(MAX_M, layer.max_rows) + 1)
        return layer.max_rows > MAX_M or any(table_config(M, layer.n, layer.k) is None for M in small)
    return False


def aot_launches(space) -> None:
    """The per-token quantization kernel of `scaled_mm_linear` (plugins/aot.py): once per input
    width K of the engine's fp8 layers that reach it (`scaled_mm_reachable`). The row count is
    the grid, not an argument. o_proj (attention's output) and the LM head always quantize here;
    the layers whose producer quantizes fused (qkv, gate_up, down) are enumerated too (their
    widths mostly give the same variants: BLOCK_K stops at 4096), so that the separate path
    stays compiled for them."""
    from ._aot_shapes import linear_layers

    for layer in linear_layers(space):
        if scaled_mm_reachable(space, layer.name):
            quantize_act_triton(space.fake(2, layer.k, dtype=space.act_dtype))
