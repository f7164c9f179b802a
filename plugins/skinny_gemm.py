"""Skinny GEMM: y = x @ w^T (+ bias) for a handful of rows, streaming w once.

Shapes (nn.Linear layout): x [M, K] (last dim contiguous), w [N, K] contiguous, bias [N],
y [M, N] in x.dtype, with M <= 16 (batch-1..16 decode):

    y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])        accumulated in float32

At these M the GEMM is a matrix-vector product bound by reading w (2 N K bytes in bf16); x and y
are noise. Why a kernel of our own: in one decode step of Llama-3.1-8B (bf16, H200, M=1)
cuBLAS reaches ~3.27 TB/s on qkv_proj (N=6144, K=4096: 15.4 us against an 11.7 us floor at
4.3 TB/s) and ~2.6 TB/s on o_proj (N=4096, K=4096: 11.0 us plus a 1.7 us split-K reduce kernel,
floor 7.8 us), while gate_up and down are at 94-96% of the floor already.

The kernel: one program per BLOCK_N rows of w (no split of K: at BLOCK_N=16 even N=4096 gives
256 programs for 132 SMs, and a split would cost a second kernel or an atomic fix-up). Each
iteration loads a [BLOCK_N, BLOCK_K] tile of w, contiguous along K (16-byte vector loads),
and either
  * USE_DOT: multiplies a [16, BLOCK_K] x tile (rows past M masked to zero, never stored) by
    the transposed tile with tl.dot, so the loads are software-pipelined (cp.async,
    num_stages deep) like any Triton GEMM; any M <= 16; or
  * not USE_DOT (M == 1 only): multiplies elementwise by the x row into a [BLOCK_N, BLOCK_K]
    float32 accumulator, summed over K once at the end (the classic GEMV, w kept in registers).
Rows of w past N are clamped to N-1 (loaded, never stored), so with K % BLOCK_K == 0 no load
is masked.

When it is used: `skinny_linear` (what the models' linear layers and LM head call) sends CUDA
inputs with M <= 16 to `table_config`, a fixed rule measured on the H200 (the GEMV for M = 1 on
projections up to 8192 wide, the 64-row dot kernel on LM-head-wide outputs, cuBLAS otherwise):
fixed, so the same input always runs the same kernel (reproducible; eager == CUDA graph).
INFHIP_SKINNY_GEMM=auto instead times F.linear and every config per (M bucket, N, K, dtype,
bias, device) the first time a key is seen outside graph capture (CUDA events, L2 flushed,
median) and keeps a config only where it is MIN_GAIN faster — for tuning on other GPUs; its
choice can differ run to run. =0 always uses F.linear, =force always the kernel with
CONFIGS[0]. Off CUDA it is F.linear. `skinny_gemm_decisions()` lists what "auto" chose.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import dot_precision, interpreted

MAX_M = 16  # the x tile of the dot path is [16, BLOCK_K] (tl.dot needs >= 16 rows)
MIN_GAIN = 0.03  # a config must beat F.linear by this fraction to be chosen
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])  # M=1 and M>1 share one compiled kernel
def _skinny_gemm_kernel(
    # inputs
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N, K] contiguous
    bias_ptr,  # [N] or dummy (HAS_BIAS=False)
    # outputs
    y_ptr,  # [M, N] contiguous, x dtype
    # constants
    M, N, K,
    stride_xm,
    BLOCK_M: tl.constexpr,  # 16 with USE_DOT, else 1
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast the dot operands (the interpreter's bf16 tl.dot is wrong)
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    # Rows of w past N are clamped (loaded, not stored): the w loads need no mask. Rows of x
    # past M are masked instead: a masked-off load moves no bytes, where 15 copies of the one
    # row of M=1 would read as much from L2 as w reads from DRAM at BLOCK_N=16.
    w_rows = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    m_mask = m[:, None] < M  # [BLOCK_M, 1], constant along K: the loads stay vectorized
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_rows + k[None, :], mask=m_mask, other=0.0)  # [BLOCK_M, BLOCK_K]
        else:
            w = tl.load(w_rows + k[None, :], mask=k[None, :] < K, other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask & (k[None, :] < K), other=0.0)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)  # [BLOCK_N, BLOCK_K], x row broadcast
    if USE_DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    n_mask = n < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * N + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask & n_mask[None, :])


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration. dot=False configs (elementwise GEMV) apply to M == 1 only."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    dot: bool = True

    def applies(self, m: int) -> bool:
        return self.dot or m == 1

    def __str__(self) -> str:
        kind = "dot" if self.dot else "sum"
        return f"{kind}_n{self.block_n}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}"


# The plausible space for bandwidth-bound GEMV on H100/H200. Programs for N=4096: 256 at
# BLOCK_N=16, 128 at 32, 64 at 64 (several resident per SM); the per-stage w tile is 8-32 KB.
CONFIGS: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(16, 256, 4, 4),  # CONFIGS[0]: INFHIP_SKINNY_GEMM=force
    SkinnyConfig(16, 512, 4, 3),
    SkinnyConfig(32, 128, 4, 4),
    SkinnyConfig(32, 256, 4, 4),
    SkinnyConfig(32, 512, 8, 3),
    SkinnyConfig(64, 128, 4, 4),
    SkinnyConfig(64, 256, 8, 3),
    SkinnyConfig(8, 512, 4, 2, dot=False),
    SkinnyConfig(16, 256, 4, 2, dot=False),
    SkinnyConfig(32, 256, 8, 2, dot=False),
)


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference: F.linear in float32, cast back to x.dtype."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.float(), b).to(x.dtype)


def skinny_gemm_triton(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                       config: SkinnyConfig | None = None) -> torch.Tensor:
    """Triton launcher: x [M, K] (M <= 16, last dim contiguous), w [N, K] contiguous, bias [N]
    -> y [M, N] in x.dtype. Runs on CUDA, and on CPU under TRITON_INTERPRET=1."""
    config = config or CONFIGS[0]
    assert x.dim() == 2, f"skinny_gemm: x must be [M, K], got {tuple(x.shape)}"
    assert w.dim() == 2, f"skinny_gemm: w must be [N, K], got {tuple(w.shape)}"
    M, K = x.shape
    N = w.shape[0]
    assert 1 <= M <= MAX_M, f"skinny_gemm: M={M} rows, supports 1..{MAX_M}"
    assert w.shape[1] == K, f"skinny_gemm: x is [{M}, {K}] but w is {tuple(w.shape)} (want [N, {K}])"
    assert x.stride(1) == 1, "skinny_gemm: x last dim must be contiguous"
    assert w.is_contiguous(), "skinny_gemm: w must be contiguous"
    assert x.dtype in _DTYPES, f"skinny_gemm: unsupported dtype {x.dtype}"
    assert w.dtype == x.dtype, f"skinny_gemm: w dtype {w.dtype} != x dtype {x.dtype}"
    assert x.device == w.device, "skinny_gemm: x and w on different devices"
    if bias is not None:
        assert bias.shape == (N,) and bias.is_contiguous(), f"skinny_gemm: bias must be [{N}] contiguous"
        assert bias.dtype == x.dtype and bias.device == x.device, "skinny_gemm: bias dtype/device != x"
    assert config.applies(M), f"skinny_gemm: config {config} needs M == 1, got M={M}"
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    _skinny_gemm_kernel[(triton.cdiv(N, config.block_n),)](
        x, w, bias if bias is not None else w,
        y,
        M, N, K, x.stride(0),
        BLOCK_M=MAX_M if config.dot else 1, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.dot, EVEN_K=K % config.block_k == 0, HAS_BIAS=bias is not None,
        # the interpreter (CPU) multiplies in float32; compiled (CUDA, or meta while enumerating
        # launches for the GPU target) in x's dtype. float32 inputs need no upcast anywhere.
        DOT_PRECISION=dot_precision(torch.float32 if interpreted(x) else x.dtype),
        DOT_F32=interpreted(x) and x.dtype != torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y


# ----------------------------------------------------------------------------- dispatch

@dataclass
class Decision:
    """What `skinny_linear` runs for one key: config None = F.linear (cuBLAS)."""

    config: SkinnyConfig | None
    timings_us: dict[str, float] = field(default_factory=dict)  # "cublas" and str(config) -> median
    errors: dict[str, str] = field(default_factory=dict)  # configs that failed to launch


_decisions: dict[tuple, Decision] = {}


def skinny_gemm_decisions() -> dict[tuple, Decision]:
    """The decision table, keyed by (M bucket, N, K, dtype, has bias, device index) (a copy)."""
    return dict(_decisions)


def reset_skinny_gemm_decisions() -> None:
    _decisions.clear()


def _mode() -> str:
    value = os.environ.get("INFHIP_SKINNY_GEMM", "table").strip().lower()
    if value in ("", "1", "table"):
        return "table"
    if value in ("0", "force", "auto"):
        return {"0": "off"}.get(value, value)
    raise ValueError(f"INFHIP_SKINNY_GEMM={value!r}: use 0, table, auto or force")


# The fixed rule used by default ("table"), from benchmarks/speed/bench_skinny_gemm.py on the H200
# (docs/benchmarks.md): at M = 1 the elementwise GEMV beat cuBLAS by ~9% on Llama-8B's qkv
# (N 6144) and o (N 4096) projections and lost on the wide ones (gate_up, down); the dot kernel
# with 64-row tiles beat it by ~5% on the LM head (N 128256) at every M. A fixed rule, not
# per-process timing: the same input always takes the same kernel, so results are reproducible
# and a step run eagerly equals its CUDA graph.
_GEMV_M1 = SkinnyConfig(8, 512, 4, 2, dot=False)
_LM_HEAD = SkinnyConfig(64, 128, 4, 4)


def table_config(m: int, n: int, k: int, dtype: torch.dtype) -> SkinnyConfig | None:
    """The default rule: a config for (M, N, K, dtype), None for cuBLAS."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if n >= 65536 and k % _LM_HEAD.block_k == 0:
        return _LM_HEAD
    if m == 1 and n <= 8192 and k <= 8192 and k % _GEMV_M1.block_k == 0:
        return _GEMV_M1
    return None


def m_bucket(m: int) -> int:
    """1, 2, 4, 8, 16: the decision key's row count (next power of two)."""
    return 1 << (m - 1).bit_length()


def _median_us(fn, flush: torch.Tensor, warmup: int = 3, reps: int = 20) -> float:
    """Median GPU time of fn() with a cold L2 (the weights of a decode step are never in L2).
    A sleep kernel ahead of each rep lets the host enqueue fn before the GPU reaches it, so
    launch overhead (absent under CUDA graphs) is not timed."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        torch.cuda._sleep(50_000)
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def _decide(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> Decision:
    """Time F.linear and every config that applies to this M; keep the fastest config if it
    beats F.linear by MIN_GAIN."""
    l2 = getattr(torch.cuda.get_device_properties(x.device), "L2_cache_size", 0) or 64 << 20
    flush = torch.empty(2 * l2, dtype=torch.int8, device=x.device)
    d = Decision(None)
    d.timings_us["cublas"] = _median_us(lambda: F.linear(x, w, bias), flush)
    for cfg in CONFIGS:
        if not cfg.applies(x.shape[0]):
            continue
        try:
            t = _median_us(lambda cfg=cfg: skinny_gemm_triton(x, w, bias, cfg), flush)
        except Exception as exc:  # e.g. out of shared memory for fp32 tiles: skip the config
            d.errors[str(cfg)] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        d.timings_us[str(cfg)] = t
    d.config = pick(d.timings_us)
    return d


def pick(timings_us: dict[str, float]) -> SkinnyConfig | None:
    """The fastest config of a timing table ("cublas" and str(config) -> us) if it beats
    F.linear by MIN_GAIN, else None (F.linear)."""
    by_name = {str(c): c for c in CONFIGS}
    times = {name: t for name, t in timings_us.items() if name in by_name}
    if not times:
        return None
    best = min(times, key=times.get)
    return by_name[best] if times[best] <= (1 - MIN_GAIN) * timings_us["cublas"] else None


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), through the skinny-GEMM kernel where it was measured faster
    (CUDA, at most 16 rows; see the module docstring)."""
    K = w.shape[-1]
    if (not x.is_cuda or x.dim() < 1 or x.shape[-1] != K or not 1 <= x.numel() // max(K, 1) <= MAX_M
            or x.dtype not in _DTYPES or w.dtype != x.dtype or w.dim() != 2 or not w.is_contiguous()
            or x.stride(-1) != 1
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w, bias)
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    config = choose(x2, w, bias)
    if config is None:
        return F.linear(x, w, bias)
    y = skinny_gemm_triton(x2, w, bias, config)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])


def choose(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> SkinnyConfig | None:
    """The config `skinny_linear` launches for x [M, K] (an eligible CUDA input), None for
    F.linear: by INFHIP_SKINNY_GEMM, then the decision table (timed here on a new key, unless
    the current stream is capturing a CUDA graph)."""
    mode = _mode()
    if mode == "table":
        return table_config(x.shape[0], w.shape[0], w.shape[1], x.dtype)
    if mode != "auto":
        return CONFIGS[0] if mode == "force" else None
    key = (m_bucket(x.shape[0]), w.shape[0], w.shape[1], x.dtype, bias is not None, x.device.index)
    decision = _decisions.get(key)
    if decision is None:
        if torch.cuda.is_current_stream_capturing():  # never time inside a graph
            return None
        decision = _decisions[key] = _decide(x, w, bias)
    return decision.config


def aot_launches(space) -> None:
    """Every launch `skinny_linear` makes under the default rule, ``table_config`` (plugins/aot.py):
    the decoder's qkv (with its bias where the model has one), o, gate_up and down projections for
    1..min(16, max_num_batched_tokens) rows, and the LM head (tied or not) for up to
    min(16, max_batch_size) sampled rows (plugins/_aot_shapes.linear_layers); bf16 / fp16 engines
    only (float32 takes F.linear), and only the layers not stored in fp8 (those run
    plugins/fp8_linear.py). M is not specialized, so the rows matter only through the rule's
    choice (M == 1 or not). x is contiguous at every call site. INFHIP_SKINNY_GEMM=auto / force
    (tuning modes) launch other configs, which are not enumerated: they compile on first use."""
    from ._aot_shapes import linear_layers

    dtype = space.act_dtype
    for layer in linear_layers(space):
        if layer.fp8:
            continue
        w = space.fake(layer.n, layer.k, dtype=dtype)
        bias = space.fake(layer.n, dtype=dtype) if layer.bias else None
        for M in range(1, min(MAX_M, layer.max_rows) + 1):
            config = table_config(M, layer.n, layer.k, dtype)
            if config is not None:
                skinny_gemm_triton(space.fake(M, layer.k, dtype=dtype), w, bias, config)
