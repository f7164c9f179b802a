"""RMSNorm, optionally fused with the residual add.

For a row x of width N and a float32 weight w:

    y = x * rsqrt(mean(x**2) + eps) * w            (computed in float32, stored in x.dtype)

With a residual stream r the layer input is first h = x + r (added in float32,
rounded to x.dtype: h is the new residual stream), and the call returns
(rms_norm(h), h). Normalising the *rounded* h matches what a bf16 model does.

x may be [T, N] (hidden states) or [T, H, N] (per-head q/k norm, possibly a
strided view into a fused qkv output): every leading index is one row, the last
dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton


@triton.jit
def _rms_norm_kernel(
    # inputs
    x_ptr,  # [T, H, N], last dim contiguous
    residual_ptr,  # [T, H, N] or dummy (HAS_RESIDUAL=False)
    weight_ptr,  # [N] float32
    # outputs
    out_ptr,  # [T, H, N] contiguous, x dtype
    residual_out_ptr,  # [T, H, N] contiguous, x dtype (h = x + residual)
    # constants
    stride_xt, stride_xh,
    stride_rt, stride_rh,
    num_heads,  # H (1 for a plain [T, N] input)
    N,
    eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
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
    tl.store(out_row + cols, (xf * inv_rms * w).to(x.dtype), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[T, N] -> [T, 1, N]; [T, H, N] unchanged."""
    assert x.dim() in (2, 3), f"rms_norm expects [T, N] or [T, H, N], got {tuple(x.shape)}"
    return x.unsqueeze(1) if x.dim() == 2 else x


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None):
    """Triton launcher; same contract as `rms_norm`."""
    x3 = _as_3d(x)
    T, H, N = x3.shape
    assert x3.stride(2) == 1, "rms_norm: last dim must be contiguous"
    assert weight.shape == (N,) and weight.is_contiguous(), f"weight must be [{N}]"
    out = torch.empty((T, H, N), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape, "residual must have the shape of x"
        r3 = _as_3d(residual)
        assert r3.stride(2) == 1, "rms_norm: residual last dim must be contiguous"
        residual_out = torch.empty_like(out)
    else:
        r3, residual_out = x3, out  # dummies, never touched
    if T * H > 0:
        BLOCK_N = next_pow2(N)
        _rms_norm_kernel[(T * H,)](
            x3, r3, weight,
            out, residual_out,
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            H, N, float(eps),
            BLOCK_N=BLOCK_N, HAS_RESIDUAL=residual is not None,
            num_warps=min(max(BLOCK_N // 256, 1), 16),
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, residual_out.view(x.shape)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Plain-torch reference (float32 math)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)  # new residual stream
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    y = y.to(x.dtype)
    return y if residual is None else (y, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim; with `residual`, returns (norm(x + residual), x + residual)."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)


def aot_launches(space) -> None:
    """Every launch the runtime makes (plugins/aot.py, builder/kernels.py): the hidden-size norms
    of the decoder layers and the final norm, with and without the fused residual add (the first
    layer's input norm, Gemma-3's post-attention / post-feedforward norms and a layer after a
    token-drop anchor take none), and with q/k norm the per-head norms of q [T, Hq, D] and
    k [T, Hkv, D], whose inputs are ``.contiguous()`` of the qkv slices (for T == 1 the slices
    themselves, see _aot_shapes.TOKEN_CLASSES). The token count is only the grid."""
    from ._aot_shapes import TOKEN_CLASSES, qkv_views

    m = space.model
    eps = m.rms_norm_eps
    w_hidden = space.fake(m.hidden_size, dtype=torch.float32)
    w_head = space.fake(m.head_dim, dtype=torch.float32)
    for T in TOKEN_CLASSES:
        x = space.fake(T, m.hidden_size, dtype=space.act_dtype)
        rms_norm(x, w_hidden, eps)
        rms_norm(x, w_hidden, eps, space.fake(T, m.hidden_size, dtype=space.act_dtype))
        if m.qk_norm:
            q, k, _ = qkv_views(space, T)
            rms_norm(q.contiguous(), w_head, eps)
            rms_norm(k.contiguous(), w_head, eps)
