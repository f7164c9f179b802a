"""FP8 weight-only skinny GEMM: y = x @ (w * scale)^T (+ bias) for a handful of rows.

Shapes (nn.Linear layout): x [M, K] bf16/fp16/fp32 (last dim contiguous), w [N, K] float8_e4m3fn
contiguous, scale [N] float32 (one per output channel: row n of the real weight is
w[n, :] * scale[n]), bias [N] in x's dtype, y [M, N] in x's dtype, with M <= 16 (decode):

    y[m, n] = scale[n] * sum_k x[m, k] * float(w[n, k])  (+ bias[n])     accumulated in float32

Why: a decode step reads every weight once; fp8 halves those bytes against bf16, so at batch 1
the step's floor halves. cuBLAS has no weight-only fp8 GEMM (torch._scaled_mm wants x in fp8
too, with a quantization kernel of its own ahead of it), so this kernel keeps x as it is and
converts each loaded fp8 weight tile to x's dtype in registers; the per-channel scale is applied
once per output in the epilogue (it is constant along K).

The kernel is plugins/skinny_gemm.py's with fp8 weight tiles: one program per BLOCK_N rows of w
(rows past N clamped, loaded and never stored) and per K split; each iteration loads a
[BLOCK_N, BLOCK_K] fp8 tile (contiguous along K: 16-byte loads are 16 weights) and either
  * USE_DOT: a [16, BLOCK_K] x tile (rows past M masked) times the converted tile with tl.dot
    (software-pipelined loads, any M <= 16); or
  * not USE_DOT (M == 1): an elementwise product into a [BLOCK_N, BLOCK_K] float32 accumulator,
    summed over K once at the end (GEMV).
SPLIT_K > 1 splits K among that many programs per row block (more programs for narrow outputs
such as o_proj / down_proj: N = 4096 at BLOCK_N = 32 is 128 programs for 132 SMs); each writes a
float32 partial [SPLIT_K, M, N] that one torch sum reduces (deterministic, no atomics).

GEMV_CANDIDATES are more M == 1 configs of this kernel that `bench_fp8_weights.py --gemv-sweep`
times beside the table's (docs/fp8_weights.md "Speed"): none beat it by more than 5 % on any
Llama-8B shape on the H200.

When it runs: plugins/fp8_linear.py's `fp8_linear` sends CUDA bf16 inputs of M <= MAX_M rows on
an fp8-capable GPU (sm_89+) to `table_config`'s config, and everything else to torch._scaled_mm
(or the dequantizing reference off such GPUs). The table is a placeholder until measured: TODO
fix it from benchmarks/speed/bench_fp8_weights.py on the H200 (the `kernel` section of its output
times every CONFIGS entry against torch._scaled_mm and bf16 F.linear per shape and M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import dot_precision, interpreted
from .dtypes import FP8_DTYPE

MAX_M = 16  # the x tile of the dot path is [16, BLOCK_K] (tl.dot needs >= 16 rows)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])  # M=1 and M>1 share one compiled kernel
def _fp8_skinny_kernel(
    # inputs
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    scale_ptr,  # [N] float32
    bias_ptr,  # [N] or dummy (HAS_BIAS=False)
    # outputs
    y_ptr,  # SPLIT_K == 1: [M, N] in x's dtype; else float32 partials [SPLIT_K, M, N]
    # constants
    M, N, K,
    stride_xm,
    k_per_split,  # K / SPLIT_K rounded up to BLOCK_K (== K when SPLIT_K == 1)
    BLOCK_M: tl.constexpr,  # 16 with USE_DOT, else 1
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast the dot operands (the interpreter's bf16 tl.dot is wrong)
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    m_mask = m[:, None] < M  # [BLOCK_M, 1]: rows past M move no bytes
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + ks
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])  # [BLOCK_N, BLOCK_K] fp8
            x = tl.load(x_rows + k[None, :], mask=m_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        else:
            w = tl.load(w_rows + k[None, :], mask=k[None, :] < K, other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask & (k[None, :] < K), other=0.0)
        if USE_DOT:
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K], x row broadcast
    if USE_DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    n_mask = n < N
    y = y * tl.load(scale_ptr + n, mask=n_mask, other=0.0)[None, :]  # per-channel scale, once
    if HAS_BIAS:
        b = tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        y += tl.where(split == 0, b, 0.0)[None, :]  # split 0 adds it
    out = y_ptr + split.to(tl.int64) * M * N + m[:, None] * N + n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=m_mask & n_mask[None, :])


@dataclass(frozen=True)
class Fp8SkinnyConfig:
    """One launch configuration. dot=False (elementwise GEMV) applies to M == 1 only."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot: bool = True
    split_k: int = 1

    def applies(self, m: int) -> bool:
        return self.dot or m == 1

    def __str__(self) -> str:
        kind = "dot" if self.dot else "sum"
        split = f"_split{self.split_k}" if self.split_k > 1 else ""
        return f"{kind}_n{self.block_n}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}{split}"


# The space benchmarks/speed/bench_fp8_weights.py times on the GPU. An fp8 tile of BLOCK_K = 512 is
# 512 bytes per row: the per-stage w tile is 4-32 KB.
CONFIGS: tuple[Fp8SkinnyConfig, ...] = (
    Fp8SkinnyConfig(16, 512, 4, 4),
    Fp8SkinnyConfig(32, 256, 4, 4),
    Fp8SkinnyConfig(32, 512, 4, 3),
    Fp8SkinnyConfig(64, 256, 8, 3),
    Fp8SkinnyConfig(32, 512, 4, 3, split_k=2),
    Fp8SkinnyConfig(16, 512, 4, 4, split_k=4),
    Fp8SkinnyConfig(8, 1024, 4, 2, dot=False),
    Fp8SkinnyConfig(16, 512, 4, 2, dot=False),
    Fp8SkinnyConfig(16, 1024, 8, 2, dot=False),
    Fp8SkinnyConfig(16, 512, 4, 2, dot=False, split_k=2),
)

# M == 1 configs beyond CONFIGS for benchmarks/speed/bench_fp8_weights.py --gemv-sweep: more bytes in
# flight (wider K tiles, more rows, stages, warps). Timed on the H200 (2026-12-02): within 5 % of
# the table's on every Llama-8B shape (qkv 10.9 vs 11.5 us at 4 x 2048, the rest equal or slower).
# Two other designs lost there and were removed: fp8 -> fp32 by integer ops instead of Triton's
# cvt (1.1-1.6x slower) and split-K reduced in the kernel (1.1-1.9x slower).
GEMV_CANDIDATES: tuple[Fp8SkinnyConfig, ...] = (
    Fp8SkinnyConfig(8, 2048, 4, 2, dot=False),
    Fp8SkinnyConfig(8, 2048, 8, 3, dot=False),
    Fp8SkinnyConfig(8, 1024, 4, 3, dot=False),
    Fp8SkinnyConfig(8, 1024, 8, 4, dot=False),
    Fp8SkinnyConfig(4, 2048, 4, 3, dot=False),
    Fp8SkinnyConfig(16, 1024, 8, 3, dot=False),
    Fp8SkinnyConfig(8, 4096, 8, 2, dot=False),
)

# The table, from benchmarks/speed/bench_fp8_weights.py's kernel table on the H200 (2026-12-02,
# docs/fp8_weights.md "Speed"; Llama-8B shapes, weights from DRAM, CUDA graphs):
# - M == 1: the GEMV, 8 x 1024 tiles (o 7.8 us, gate_up 37.8, down 18.3: best of the space);
#   16 x 512 on LM-head-wide weights (128256 rows: 145 us against 153).
# - M = 2..16: the dot kernel with 32 x 256 tiles, 4 stages: best or within 1 % of best on qkv,
#   o, down and the LM head at every M, 0.84-0.90x of the 32 x 512 placeholder's time. Only
#   torch._scaled_mm with fast accumulation beat it (gate_up and LM head from M = 4, by 5-8 %),
#   and FAST_ACCUM is off (plugins/fp8_linear.py), so nothing goes there.
_GEMV_M1 = Fp8SkinnyConfig(8, 1024, 4, 2, dot=False)
_GEMV_M1_WIDE = Fp8SkinnyConfig(16, 512, 4, 2, dot=False)
_WIDE_N = 65536  # output rows from which the M == 1 GEMV takes the narrower K tile (LM heads)
_DOT = Fp8SkinnyConfig(32, 256, 4, 4)


def table_config(m: int, n: int, k: int) -> Fp8SkinnyConfig | None:
    """The config `fp8_linear` launches for M = m rows (1..MAX_M) of an [n, k] fp8 weight; None
    sends the call to torch._scaled_mm."""
    if not 1 <= m <= MAX_M:
        return None
    if m == 1:
        return _GEMV_M1_WIDE if n >= _WIDE_N else _GEMV_M1
    return _DOT


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference (and the CPU path): dequantize w to float32 (w * scale per row), cast
    to x's dtype, F.linear in x's dtype. Any leading dims of x; y [..., N]."""
    wd = (w.float() * scale.float()[:, None]).to(x.dtype)
    return F.linear(x, wd, bias)


def fp8_skinny_gemm_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None,
                           config: Fp8SkinnyConfig | None = None) -> torch.Tensor:
    """Triton launcher: x [M, K] (M <= 16), w [N, K] fp8, scale [N] float32, bias [N] -> y [M, N]
    in x.dtype. Runs on CUDA (sm_89+), and on CPU under TRITON_INTERPRET=1."""
    config = config or _DOT
    assert x.dim() == 2, f"fp8_skinny_gemm: x must be [M, K], got {tuple(x.shape)}"
    assert w.dim() == 2, f"fp8_skinny_gemm: w must be [N, K], got {tuple(w.shape)}"
    M, K = x.shape
    N = w.shape[0]
    assert 1 <= M <= MAX_M, f"fp8_skinny_gemm: M={M} rows, supports 1..{MAX_M}"
    assert w.shape[1] == K, f"fp8_skinny_gemm: x is [{M}, {K}] but w is {tuple(w.shape)} (want [N, {K}])"
    assert w.dtype == FP8_DTYPE, f"fp8_skinny_gemm: w must be float8_e4m3fn, got {w.dtype}"
    assert x.dtype in _DTYPES, f"fp8_skinny_gemm: unsupported x dtype {x.dtype}"
    assert x.stride(1) == 1 and w.is_contiguous(), "fp8_skinny_gemm: x rows and w must be contiguous"
    assert scale.shape == (N,) and scale.dtype == torch.float32 and scale.is_contiguous(), (
        f"fp8_skinny_gemm: scale must be float32 [{N}] contiguous, got {scale.dtype} {tuple(scale.shape)}")
    assert x.device == w.device == scale.device, "fp8_skinny_gemm: x, w and scale on different devices"
    if bias is not None:
        assert bias.shape == (N,) and bias.is_contiguous(), f"fp8_skinny_gemm: bias must be [{N}] contiguous"
        assert bias.dtype == x.dtype and bias.device == x.device, "fp8_skinny_gemm: bias dtype/device != x"
    assert config.applies(M), f"fp8_skinny_gemm: config {config} needs M == 1, got M={M}"
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(K, split), config.block_k) * config.block_k
    out_dtype = x.dtype if split == 1 else torch.float32
    y = torch.empty((split, M, N), dtype=out_dtype, device=x.device)
    if N == 0:
        return y[0].to(x.dtype)
    _fp8_skinny_kernel[(triton.cdiv(N, config.block_n), split)](
        x, w, scale, bias if bias is not None else scale,
        y,
        M, N, K, x.stride(0), k_per_split,
        BLOCK_M=MAX_M if config.dot else 1, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
        USE_DOT=config.dot, EVEN_K=K % (config.block_k * split) == 0, HAS_BIAS=bias is not None,
        # as plugins/skinny_gemm.py: the interpreter multiplies in float32, compiled code in x's dtype
        DOT_PRECISION=dot_precision(torch.float32 if interpreted(x) else x.dtype),
        DOT_F32=interpreted(x) and x.dtype != torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y[0] if split == 1 else y.sum(0).to(x.dtype)


def aot_launches(space) -> None:
    """Every launch `fp8_linear` makes through this kernel (plugins/aot.py): the engine's fp8
    linear layers (plugins/_aot_shapes.linear_layers) for 1..min(16, their row bound) rows under
    `table_config`, for fp8 engines with bf16 activations on an fp8-capable target. M is not
    specialized: rows matter only through the rule's choice."""
    from ._aot_shapes import linear_layers
    from .fp8_support import fast_dtype, target_has_fp8

    if space.build.weight_dtype != "fp8" or not target_has_fp8(space.target) or not fast_dtype(space.act_dtype):
        return
    dtype = space.act_dtype
    for layer in linear_layers(space):
        if not layer.fp8:
            continue
        w = space.fake(layer.n, layer.k, dtype=FP8_DTYPE)
        scale = space.fake(layer.n, dtype=torch.float32)
        bias = space.fake(layer.n, dtype=dtype) if layer.bias else None
        for M in range(1, min(MAX_M, layer.max_rows) + 1):
            config = table_config(M, layer.n, layer.k)
            if config is not None:
                fp8_skinny_gemm_triton(space.fake(M, layer.k, dtype=dtype), w, scale, bias, config)
