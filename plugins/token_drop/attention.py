"""Prefill attention of the kept queries of one sequence after a UniPrefill drop.

After a drop the queries of a prefill chunk are a subset of its positions (kept blocks, sinks,
window), and at a sliding-window layer so are its new keys. The paged prefill kernel assumes
the queries are the last rows of a contiguous context, so these rows take this path instead:

    q [Mq, Hq, D] at positions q_pos (ascending), k/v [Mk, Hkv, D] at positions k_pos (ascending)
    out[i] = softmax_j(scale q_i . k_j) v_j  over keys with k_pos[j] <= q_pos[i]
                                              (and k_pos[j] > q_pos[i] - window)

GPU (`kept_attention_triton`): one flash-attention kernel with explicit positions. Query tiles
of BLOCK_M kept rows (one program per tile and query head) loop over the keys in their reach
[k_lo, k_hi), found on the host by binary search of the positions, with online softmax; the
visibility mask comes from the loaded positions, so gaps in q or k cost nothing extra.

Torch path (CPU, `kept_attention_ref`): the queries are cut into *runs* of consecutive
positions. A run whose visible keys are a contiguous range of positions ending at its own last
position (every full-attention anchor) is one SDPA call with a lower-right causal bias; other
runs (a sliding layer, whose new keys have gaps) get explicit boolean masks, `_MAX_RUN` rows at
a time (at most _MAX_RUN x (_MAX_RUN + window)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from .._triton_utils import dot_precision, next_pow2, use_triton
from ..aot import recording_target

_MAX_RUN = 1024  # query rows per masked SDPA call (bounds the explicit masks)
_LOG2E = 1.4426950408889634


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [L, H, D] -> [1, H, L, D]


def query_runs(q_pos: torch.Tensor, max_run: int = _MAX_RUN) -> list[tuple[int, int]]:
    """[(i0, i1)] row ranges of q_pos (host int64, ascending) with consecutive positions.

    >>> query_runs(torch.tensor([0, 1, 2, 7, 8, 10]), max_run=2)
    [(0, 2), (2, 3), (3, 5), (5, 6)]
    """
    n = q_pos.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(q_pos[1:] - q_pos[:-1] != 1).flatten() + 1).tolist()
    runs = []
    for i0, i1 in zip([0] + breaks, breaks + [n]):
        runs += [(s, min(s + max_run, i1)) for s in range(i0, i1, max_run)]
    return runs


def kept_attention_ref(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_pos: torch.Tensor, scale: float, window: int | None = None,
                       max_run: int = _MAX_RUN) -> torch.Tensor:
    """Torch path of `kept_attention` (SDPA per run of consecutive query positions)."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for r0, r1 in query_runs(q_pos, max_run=1 << 62):
        first, last = int(q_pos[r0]), int(q_pos[r1 - 1])
        hi = int(torch.searchsorted(k_pos, last, right=True))
        lo = int(torch.searchsorted(k_pos, first - window + 1)) if window else 0
        assert hi > lo and int(k_pos[hi - 1]) == last, f"query at position {last} has no key of its own"
        if int(k_pos[lo]) == last - (hi - lo - 1) and (not window or last - int(k_pos[lo]) < window):
            # contiguous keys ending at the run's last position, none outside any window
            o = F.scaled_dot_product_attention(
                _heads_first(q[r0:r1]), _heads_first(k[lo:hi]), _heads_first(v[lo:hi]),
                attn_mask=causal_lower_right(r1 - r0, hi - lo), scale=scale, enable_gqa=True)
            out[r0:r1] = o[0].transpose(0, 1)
            continue
        for i0 in range(r0, r1, max_run):
            i1 = min(i0 + max_run, r1)
            hi = int(torch.searchsorted(k_pos, int(q_pos[i1 - 1]), right=True))
            lo = int(torch.searchsorted(k_pos, int(q_pos[i0]) - window + 1)) if window else 0
            qp, kp = q_pos[i0:i1, None], k_pos[None, lo:hi]
            mask = kp <= qp
            if window:
                mask &= kp > qp - window
            # heads expanded by hand: SDPA with a mask and enable_gqa falls back to the math kernel
            o = F.scaled_dot_product_attention(
                _heads_first(q[i0:i1]), _heads_first(k[lo:hi].repeat_interleave(group, dim=1)),
                _heads_first(v[lo:hi].repeat_interleave(group, dim=1)),
                attn_mask=mask.to(q.device), scale=scale)
            out[i0:i1] = o[0].transpose(0, 1)
    return out


@triton.jit
def _kept_attention_kernel(
    # inputs
    q_ptr,  # [Mq, Hq, D], last dim contiguous
    k_ptr,  # [Mk, Hkv, D], last dim contiguous
    v_ptr,  # [Mk, Hkv, D], last dim contiguous
    q_pos_ptr,  # [Mq] int32, ascending
    k_pos_ptr,  # [Mk] int32, ascending
    tiles_ptr,  # [num_tiles, 4] int32: first q row, q rows (<= BLOCK_M), k_lo, k_hi
    # outputs
    o_ptr,  # [Mq, Hq, D]
    # constants
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    group_size, head_dim,
    window,  # 0: none
    scale_log2,  # scale * log2(e)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOWED: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    q0 = tl.load(tiles_ptr + tile * 4)
    nq = tl.load(tiles_ptr + tile * 4 + 1)
    k_lo = tl.load(tiles_ptr + tile * 4 + 2)
    k_hi = tl.load(tiles_ptr + tile * 4 + 3)
    r = tl.arange(0, BLOCK_M)
    row_valid = r < nq
    rows = (q0 + r).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    qp = tl.load(q_pos_ptr + rows, mask=row_valid, other=-1)
    kvh = h // group_size

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(k_lo, k_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_valid = cols < k_hi
        cols64 = cols.to(tl.int64)
        k = tl.load(k_ptr + cols64[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                    mask=col_valid[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_ptr + cols64[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                    mask=col_valid[:, None] & d_mask[None, :], other=0.0)
        kp = tl.load(k_pos_ptr + cols64, mask=col_valid, other=2147483647)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = kp[None, :] <= qp[:, None]
        if WINDOWED:
            visible = visible & (kp[None, :] > qp[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_mask[None, :])


def _tiles(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, block_m: int) -> torch.Tensor:
    """[num_tiles, 4] int32 (host): first q row, rows, and the key range [k_lo, k_hi) in reach
    of each tile of block_m consecutive query rows."""
    n = q_pos.numel()
    first = torch.arange(0, n, block_m)
    last = torch.clamp(first + block_m, max=n) - 1
    k_hi = torch.searchsorted(k_pos, q_pos[last], right=True)
    k_lo = torch.searchsorted(k_pos, q_pos[first] - window + 1) if window else torch.zeros_like(k_hi)
    return torch.stack([first, last - first + 1, k_lo, k_hi], 1).to(torch.int32)


def kept_attention_triton(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_pos: torch.Tensor, scale: float, window: int | None = None,
                          block_m: int = 64, block_n: int | None = None) -> torch.Tensor:
    """Triton launcher of `kept_attention` (positions given on the host, copied once).
    block_m = 64 matches G = 64 kept blocks; block_n 64 (32 for head_dim > 128: shared memory)."""
    Mq, Hq, D = q.shape
    Mk, Hkv, Dk = k.shape
    assert Dk == D and v.shape == k.shape and Hq % Hkv == 0, "q [Mq, Hq, D], k/v [Mk, Hkv, D]"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "last dims must be contiguous"
    assert q.dtype == k.dtype == v.dtype
    out = torch.empty_like(q)
    if Mq == 0:
        return out
    block_n = block_n or (64 if D <= 128 else 32)
    tiles = _tiles(q_pos, k_pos, window, block_m).to(q.device)
    qp = q_pos.to(device=q.device, dtype=torch.int32)
    kp = k_pos.to(device=q.device, dtype=torch.int32)
    gpu = q.is_cuda or recording_target() is not None  # recording for a GPU target: its choices
    _kept_attention_kernel[(tiles.shape[0], Hq)](
        q, k, v, qp, kp, tiles,
        out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        Hq // Hkv, D, int(window or 0), float(scale) * _LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)), WINDOWED=bool(window),
        DOT_PRECISION=dot_precision(q.dtype if gpu else torch.float32), DOT_F32=not gpu,
        num_warps=4, num_stages=2,
    )
    return out


def kept_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   k_pos: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal (optionally windowed) attention of queries at positions q_pos over keys at k_pos.

    q_pos / k_pos are host int64 tensors, ascending; every query must find its own position among
    the keys (a kept query always wrote its key). Returns [Mq, Hq, D].

    >>> q, k = torch.randn(3, 2, 8), torch.randn(6, 1, 8)
    >>> out = kept_attention(q, torch.tensor([1, 4, 5]), k, k, torch.arange(6), 0.3)
    >>> out.shape
    torch.Size([3, 2, 8])
    """
    assert q_pos.device.type == "cpu" and k_pos.device.type == "cpu", "positions are host tensors"
    assert q.shape[0] == q_pos.numel() and k.shape[0] == k_pos.numel() == v.shape[0]
    if use_triton(q, k, v):
        return kept_attention_triton(q, q_pos, k, v, k_pos, scale, window)
    return kept_attention_ref(q, q_pos, k, v, k_pos, scale, window)


__all__ = ["kept_attention", "kept_attention_ref", "kept_attention_triton", "query_runs"]


def aot_launches(space) -> None:
    """kept_attention's variants (plugins/aot.py): with a token-drop plan, the sliding-window
    layers between two anchors attend with it (infhip/methods/token_drop/runtime/step.py _compact) — none on models
    without sliding layers. The queries are the layer's q (contiguous after a q norm, else a view
    of the fused qkv projection), the keys and values the layer's own rows (views of the same
    projection) or, past a chunk's first, those rows concatenated after the cache's (contiguous)."""
    m = space.model
    if space.plan.knobs_of("token_drop") is None:
        return
    windows = sorted({m.window_of(i) for i in range(m.num_layers)} - {None})
    Hq, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    dt, n = space.act_dtype, 2
    qkv = space.fake(n, (Hq + 2 * Hkv) * D, dtype=dt)
    q = space.fake(n, Hq, D, dtype=dt) if m.qk_norm else qkv[:, :Hq * D].view(n, Hq, D)
    k_view = space.fake(n, Hkv, D, dtype=dt) if m.qk_norm else qkv[:, Hq * D:(Hq + Hkv) * D].view(n, Hkv, D)
    v_view = qkv[:, (Hq + Hkv) * D:].view(n, Hkv, D)
    cat = space.fake(n, Hkv, D, dtype=dt)
    pos = torch.arange(n)
    for window in windows:
        for k, v in ((k_view, v_view), (cat, cat)):
            kept_attention(q, pos, k, v, pos, m.attention_scale, window)

