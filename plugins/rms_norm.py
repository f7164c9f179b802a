"""RMSNorm, optionally fused with the residual add.

For a row x of width N and a float32 weight w:

    y = x * rsqrt(mean(x**2) + eps) * w            (computed in float32, stored in x.dtype)

With a residual stream r the layer input is first h = x + r (added in float32,
rounded to x.dtype: h is the new residual stream), and the call returns
(rms_norm(h), h). Normalising the *rounded* h matches what a bf16 model does.

x may be [T, N] (hidden states) or [T, H, N] (per-head q/k norm, possibly a
strided view into a fused qkv output): every leading index is one row, the last
dim must be contiguous.

Fused fp8 output (``quantize=True``, fp8-weight engines whose next linear runs torch._scaled_mm;
plugins/fp8_linear.py): instead of the row y the kernel writes y quantized per row, e4m3 with one
float32 scale (an `Fp8Act`), from y as rounded to x.dtype, with quantize_act's rule and helpers:
the same bytes as quantize_act(rms_norm(x)), without y's round trip through memory. Plain
[T, N] rows only (the decoder's hidden-size norms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton
from .fp8_linear import Fp8Act, quantize_act_ref, row_scale_e4m3, to_e4m3_grid
from .kv_quant import FP8_DTYPE


@triton.jit
def _rms_norm_kernel(
    # inputs
    x_ptr,  # [T, H, N], last dim contiguous
    residual_ptr,  # [T, H, N] or dummy (HAS_RESIDUAL=False)
    weight_ptr,  # [N] float32
    # outputs
    out_ptr,  # [T, H, N] contiguous, x dtype; dummy when QUANT
    residual_out_ptr,  # [T, H, N] contiguous, x dtype (h = x + residual)
    q_ptr,  # QUANT: [T, N] float8_e4m3fn contiguous (H == 1); else dummy
    q_scale_ptr,  # QUANT: [T] float32; else dummy
    # constants
    stride_xt, stride_xh,
    stride_rt, stride_rh,
    num_heads,  # H (1 for a plain [T, N] input)
    N,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,  # write the row as e4m3 + scale (q_ptr, q_scale_ptr) instead of out_ptr
):
    row = tl.program_id(0)  # one program per (t, h) row
    t = row // num_heads
    h = row % num_heads
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    out_row = out_ptr + row.to(tl.int64) * N
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + t.to(tl.int64) * stride_rt + h * stride_rh + cols, mask=mask, other=0.0)
        # The new residual stream is rounded to the activation dtype, and the norm
        # is taken of that rounded value (what the eager bf16 model computes).
        hs = (xf + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row.to(tl.int64) * N + cols, hs, mask=mask)
        xf = hs.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / N
    inv_rms = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * inv_rms * w).to(x.dtype)
    if QUANT:
        # quantize the row as stored in x.dtype (zeros past N): quantize_act's bytes
        yf = y.to(tl.float32)
        s = row_scale_e4m3(tl.abs(yf))  # [BLOCK_N], every entry the row's scale
        tl.store(q_ptr + row.to(tl.int64) * N + cols, to_e4m3_grid(yf, s).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_scale_ptr + row + cols, s, mask=cols == 0)
    else:
        tl.store(out_row + cols, y, mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[T, N] -> [T, 1, N]; [T, H, N] unchanged."""
    assert x.dim() in (2, 3), f"rms_norm expects [T, N] or [T, H, N], got {tuple(x.shape)}"
    return x.unsqueeze(1) if x.dim() == 2 else x


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None, quantize: bool = False):
    """Triton launcher; same contract as `rms_norm`."""
    x3 = _as_3d(x)
    T, H, N = x3.shape
    assert x3.stride(2) == 1, "rms_norm: last dim must be contiguous"
    assert weight.shape == (N,) and weight.is_contiguous(), f"weight must be [{N}]"
    assert not quantize or x.dim() == 2, f"rms_norm: the fp8 output is for [T, N] rows, got {tuple(x.shape)}"
    if quantize:  # the row goes out as e4m3 + scale only; `out` is a dummy
        q = torch.empty((T, N), dtype=FP8_DTYPE, device=x.device)
        q_scale = torch.empty((T,), dtype=torch.float32, device=x.device)
        out = q
    else:
        out = torch.empty((T, H, N), dtype=x.dtype, device=x.device)
        q, q_scale = out, out  # dummies, never touched
    if residual is not None:
        assert residual.shape == x.shape, "residual must have the shape of x"
        r3 = _as_3d(residual)
        assert r3.stride(2) == 1, "rms_norm: residual last dim must be contiguous"
        residual_out = torch.empty((T, H, N), dtype=x.dtype, device=x.device)
    else:
        r3, residual_out = x3, out  # dummies, never touched
    if T * H > 0:
        BLOCK_N = next_pow2(N)
        _rms_norm_kernel[(T * H,)](
            x3, r3, weight,
            out, residual_out, q, q_scale,
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            H, N, float(eps),
            BLOCK_N=BLOCK_N, HAS_RESIDUAL=residual is not None, QUANT=quantize,
            # the same warps with and without QUANT: the sum of squares (hence y) reduces in the
            # same order, so the fused bytes equal quantize_act's of the plain output
            num_warps=min(max(BLOCK_N // 256, 1), 16),
        )
    y = Fp8Act(q, q_scale, x.dtype) if quantize else out.view(x.shape)
    if residual is None:
        return y
    return y, residual_out.view(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, quantize: bool = False):
    """Plain-torch reference (float32 math); quantize: the output through quantize_act's
    reference (an `Fp8Act`)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)  # new residual stream
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    y = y.to(x.dtype)
    if quantize:
        assert x.dim() == 2, f"rms_norm: the fp8 output is for [T, N] rows, got {tuple(x.shape)}"
        y = Fp8Act(*quantize_act_ref(y), x.dtype)
    return y if residual is None else (y, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, quantize: bool = False):
    """RMSNorm over the last dim; with `residual`, returns (norm(x + residual), x + residual).
    quantize: the norm's output as an `Fp8Act` (e4m3 rows + float32 scales, [T, N] x only) for
    an fp8 linear's scaled_mm path (plugins/fp8_linear.py takes_fp8_act)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, quantize)
    return rms_norm_ref(x, weight, eps, residual, quantize)


def aot_launches(space) -> None:
    """Every launch the runtime makes (plugins/aot.py, builder/kernels.py): the hidden-size norms
    of the decoder layers and the final norm, with and without the fused residual add (the first
    layer's input norm, Gemma-3's post-attention / post-feedforward norms and a layer after a
    token-drop anchor take none), and with q/k norm the per-head norms of q [T, Hq, D] and
    k [T, Hkv, D], whose inputs are ``.contiguous()`` of the qkv slices (for T == 1 the slices
    themselves, see _aot_shapes.TOKEN_CLASSES). The token count is only the grid.
    fp8-weight engines: the fp8-output forms of the norms that feed qkv_proj or gate_up_proj,
    where that layer reaches torch._scaled_mm (plugins/fp8_linear.py scaled_mm_reachable; the
    runtime asks takes_fp8_act per call, runtime/models/common.py)."""
    from ._aot_shapes import TOKEN_CLASSES, qkv_views
    from .fp8_linear import scaled_mm_reachable

    m = space.model
    eps = m.rms_norm_eps
    w_hidden = space.fake(m.hidden_size, dtype=torch.float32)
    w_head = space.fake(m.head_dim, dtype=torch.float32)
    fused = any(scaled_mm_reachable(space, name) for name in ("qkv_proj", "gate_up_proj"))
    for T in TOKEN_CLASSES:
        x = space.fake(T, m.hidden_size, dtype=space.act_dtype)
        for quantize in (False, True) if fused else (False,):
            rms_norm(x, w_hidden, eps, quantize=quantize)
            rms_norm(x, w_hidden, eps, space.fake(T, m.hidden_size, dtype=space.act_dtype), quantize=quantize)
        if m.qk_norm:
            q, k, _ = qkv_views(space, T)
            rms_norm(q.contiguous(), w_head, eps)
            rms_norm(k.contiguous(), w_head, eps)
