"""The kernel of the toy backend "sink_window_triton" (tests/_toy_triton_backend.py): the first toy's
pattern (tests/_toy_backend.py: each query attends to the first ``sink`` tokens of its sequence and
its last ``window``) as a Triton kernel over the paged KV cache that follows block-table entries
< 0 into the host twin of an offloaded cache (plugins/kv_offload.py), with its launcher, its torch
reference and its AOT launch space. It lives outside plugins/ on purpose: a method names the
modules of its kernels (``Method.plugin_modules``), wherever they are.

Kernel: one program per (query row t, query head h). The row's keys are the S + W positions
``idx < S: idx`` and ``idx >= S: pos - W + 1 + (idx - S)``, those <= pos kept (a sink inside
the window counts once); an online softmax over blocks of BLOCK_N of them, in float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from infhip.plugins._triton_utils import next_pow2, triton_on
from infhip.plugins.kv_offload import merged_pool, page_offset

BLOCK_N = 16  # keys per step of the online softmax


# the table stride (the step's widest page list) and the host deltas (addresses) vary at run time
@triton.jit(do_not_specialize=["stride_table", "k_delta", "v_delta"])
def _sink_window_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr,  # q [T, Hq, D] (rotated); k, v [pages, PAGE_SIZE, Hkv, D] (+ host twin)
    tables_ptr, seq_ptr, pos_ptr,  # int32 [B, width]; int64 [T] sequence of each row; int64 [T] positions
    # outputs
    out_ptr,  # [T, Hq, D]
    # constants
    stride_qt, stride_qh, stride_ot, stride_oh, stride_page, stride_slot, stride_head, stride_table,
    k_delta, v_delta, scale,
    SINK: tl.constexpr, WINDOW: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, OFFLOAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    b = tl.load(seq_ptr + t)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    m_i = -1.0e30  # finite: a block with no valid key adds exp(-inf) = 0
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, SINK + WINDOW, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        j = tl.where(idx < SINK, idx, pos - WINDOW + 1 + (idx - SINK))
        valid = (idx < SINK + WINDOW) & (j >= 0) & (j <= pos) & ((idx < SINK) | (j >= SINK))
        jj = tl.where(valid, j, 0)
        page = tl.load(tables_ptr + b * stride_table + jj // PAGE_SIZE, mask=valid, other=0)
        row = (jj % PAGE_SIZE) * stride_slot + kvh * stride_head
        k_off = page_offset(page, stride_page, k_delta, OFFLOAD) + row
        v_off = page_offset(page, stride_page, v_delta, OFFLOAD) + row
        tile = valid[:, None] & dmask[None, :]
        k = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=tile, other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + v_off[:, None] + d[None, :], mask=tile, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (acc / l_i).to(out_ptr.dtype.element_ty), mask=dmask)


def sink_window_triton(q: torch.Tensor, kv, tables: torch.Tensor, seq_of_row: torch.Tensor,
                       positions: torch.Tensor, sink: int, window: int, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (rotated, head-contiguous) over the paged cache kv (a PagedKV, host twin or
    not; unscaled caches only); tables int32 [B, width]; seq_of_row, positions int64 [T].
    Launches only: no host sync."""
    T, Hq, D = q.shape
    assert kv.k_scale is None, "the toy reads unscaled (non-fp8) caches only"
    assert q.stride(2) == 1 and kv.k.is_contiguous() and kv.v.is_contiguous()
    assert tables.dtype == torch.int32 and seq_of_row.dtype == positions.dtype == torch.int64
    Hkv, ps = kv.k.shape[2], kv.k.shape[1]
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    flags = kv.kernel_flags()
    k_delta, v_delta = kv.host_deltas()[:2]
    _sink_window_kernel[(T, Hq)](
        q, kv.k, kv.v, tables, seq_of_row, positions, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2),
        tables.stride(0), k_delta, v_delta, scale,
        SINK=sink, WINDOW=window, PAGE_SIZE=ps, GROUP=Hq // Hkv, D=D, BLOCK_D=next_pow2(D), BLOCK_N=BLOCK_N,
        OFFLOAD=flags["OFFLOAD"])
    return out


def sink_window_ref(q: torch.Tensor, kv, tables: torch.Tensor, seq_of_row: torch.Tensor, positions: torch.Tensor,
                    sink: int, window: int, scale: float) -> torch.Tensor:
    """Plain torch, float32: the same keys gathered from the GPU pages and the host twin's
    (merged_pool), an explicit softmax."""
    T, Hq, D = q.shape
    k, tab = merged_pool(kv.k, kv.host.k if kv.host is not None else None, tables)
    v = merged_pool(kv.v, kv.host.v if kv.host is not None else None, tables)[0]
    ps, Hkv = k.shape[1], k.shape[2]
    pos = positions[:, None]
    idx = torch.cat([torch.arange(sink, device=q.device).expand(T, sink),
                     pos - window + 1 + torch.arange(window, device=q.device)], 1)  # [T, S + W] key positions
    valid = (idx >= 0) & (idx <= pos)
    valid[:, sink:] &= idx[:, sink:] >= sink
    safe = idx.clamp(min=0)
    slots = tab.long()[seq_of_row[:, None], safe // ps] * ps + safe % ps
    keys = k.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=2)  # [T, S + W, Hq, D]
    vals = v.reshape(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, dim=2)
    scores = torch.einsum("thd,tkhd->thk", q.float(), keys) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], -math.inf), dim=-1)
    return torch.einsum("thk,tkhd->thd", probs, vals).to(q.dtype)


def sink_window_attention(q, kv, tables, seq_of_row, positions, sink: int, window: int, scale: float):
    """The kernel where Triton runs (CUDA, or CPU under TRITON_INTERPRET=1), else the reference."""
    fn = sink_window_triton if triton_on(q, kv.k) else sink_window_ref
    return fn(q, kv, tables, seq_of_row, positions, sink, window, scale)


def aot_launches(space) -> None:
    """Every launch the backend makes (plugins/aot.py), for an engine whose plan runs the toy: q
    as Attention.forward makes it (a qkv view, or the q norm's output) for each token class, over
    the layer's cache without and, when its method says pages may move, with a host twin."""
    from infhip.methods import method
    from infhip.plugins._aot_shapes import TOKEN_CLASSES, attention_qkv, paged_kv

    m = method("sink_window_triton")
    knobs = space.plan.knobs_of(m.name)
    if knobs is None or space.build.kv_dtype == "fp8":
        return  # no layer of it, or a cache it does not read (its backend refuses it at load)
    M = space.model
    for offload in (False, True) if m.moves_pages(knobs, space.build) else (False,):
        kv = paged_kv(space, offload=offload)
        for T in TOKEN_CLASSES:
            q = attention_qkv(space, T)[0]
            sink_window_triton(q, kv, space.fake(T, 3, dtype=torch.int32), space.fake(T, dtype=torch.int64),
                               space.fake(T, dtype=torch.int64), knobs.sink, knobs.window, M.attention_scale)
