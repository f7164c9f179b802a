"""Exact dense attention over a paged KV cache (the baseline attention plugin).

KV cache: k_cache, v_cache [num_pages, page_size, Hkv, D]; page 0 is a reserved
null page. block_tables [B, max_pages] int32 maps logical page i of sequence b
to a physical page (0 past the sequence or for released pages). GQA: query head
h reads kv head h // (Hq // Hkv). A query at position p attends keys j with

    j <= p  and  (no window  or  j > p - W)
    out = softmax(scale * q . K^T) V        (float32 accumulation)

Decode (one query per sequence, at position context_lens[b] - 1) is a Triton
flash-decoding kernel: grid (B, Hkv, NUM_SPLITS), each program takes all the
query heads of one kv head (padded to >= 16 rows for tl.dot) over a contiguous
share of the sequence's key blocks (BLOCK_N keys = BLOCK_N / page_size pages,
one table lookup per key), with an online softmax in base 2:

    m = max_j s_j,  l = sum_j 2^(s_j - m),  acc = sum_j 2^(s_j - m) v_j
    split result: o_s = acc / l, lse_s = m + log2(l)
    merge: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),  M = max_s lse_s

The share of each program is computed in-kernel from context_lens, so the grid
depends only on shapes (CUDA-graph capturable). Empty sequences (context 0,
padded batch slots) give zeros and read no cache.

Prefill (packed variable-length queries, each sequence's last q_len tokens) loops
over sequences in Python and calls torch SDPA per sequence.

Every entry point takes the layer's cache as one PagedKV (plugins/paged_kv.py). FP8 caches
(plugins/kv_quant.py) carry their float32 [num_pages, page_size, Hkv] row scales in it. The
decode kernel dequantizes each loaded K / V tile (one scale per key row) and casts it to q's
dtype for the dots; the torch paths gather and dequantize to q's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

from ._triton_utils import device_num_sms, dot_precision, interpreted, next_pow2, use_triton
from .kv_quant import check_kv_scales, dequantize_tile, read_pages
from .paged_kv import PagedKV

_LOG2E = 1.4426950408889634
_PREFILL_MAX_Q_SLICE = 4096  # query rows per SDPA call when an explicit window mask is built
_PREFILL_MIN_Q_SLICE = 1024
_DECODE_NUM_WARPS = 4  # decode launch tuning (module-level so benchmarks can sweep them)
_DECODE_NUM_STAGES = 2
# A split walks at least this many key blocks of the length bound it is sized for. CUDA graphs
# size splits for their length bucket (512 / 2048 / 8192, runtime/cuda_graphs.py), so short
# contexts no longer meet 33 idle splits; with 4 blocks per split a 300-token decode took one
# split and 9.5 µs per layer (one program walking every block), so a split may take one block.
_DECODE_MIN_BLOCKS_PER_SPLIT = 1


# ============================================================================ decode (Triton)

# Not specialized, so that one binary serves every step (plugins/aot.py): max_pages and
# stride_bt, the block-table width, which eager steps size to their longest sequence (1 for
# contexts within one page); they only bound a mask and offset one row pointer, and the page
# indices are gathered (pages of >= 2 tokens: repeated entries, no vector load to align). context_lens_ptr's alignment, read one int per
# program, which is a row of a [layers, B] tensor in drop-history steps (forward_context.LayerKV).
@triton.jit(do_not_specialize=["max_pages", "stride_bt"], do_not_specialize_on_alignment=["context_lens_ptr"])
def _decode_split_kernel(
    # inputs
    q_ptr,  # [B, Hq, D]
    k_cache_ptr, v_cache_ptr,  # [num_pages, page_size, Hkv, D] (same strides)
    k_scale_ptr, v_scale_ptr,  # [num_pages, page_size, Hkv] float32 when KV_SCALED (else dummies)
    block_tables_ptr,  # [B, max_pages] int32
    context_lens_ptr,  # [B] int32
    # outputs
    out_ptr,  # [B, Hq, D], written when NUM_SPLITS == 1
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] float32, normalised per split
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] float32, log2-sum-exp per split
    # constants
    stride_qb, stride_qh,
    stride_cp, stride_cs, stride_ch,
    stride_bt,
    stride_ob, stride_oh,
    max_pages, num_q_heads, group_size, head_dim,
    window,  # 0 = no window
    scale_log2,  # softmax scale * log2(e)
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per iteration, multiple of PAGE_SIZE
    BLOCK_G: tl.constexpr,  # query heads of the group, padded to >= 16
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast dot operands (Triton's interpreter mis-multiplies bf16)
    KV_SCALED: tl.constexpr,  # fp8 caches: dequantize K / V tiles with their row scales
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + b)
    # first key the query (position context_len - 1) may see: the window start
    key_start = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    # Blocks of BLOCK_N keys overlapping [key_start, context_len), shared out contiguously.
    first_block = key_start // BLOCK_N
    end_block = tl.cdiv(context_len, BLOCK_N)
    per_split = tl.cdiv(end_block - first_block, NUM_SPLITS)
    block_lo = first_block + split * per_split
    block_hi = tl.minimum(block_lo + per_split, end_block)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q_heads = kv_head * group_size + g  # [BLOCK_G]
    q_mask = (g < group_size)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for block in range(block_lo, block_hi):
        tok = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        valid = (tok >= key_start) & (tok < context_len)
        logical_page = tok // PAGE_SIZE
        page = tl.load(table_row + logical_page, mask=valid & (logical_page < max_pages), other=0)
        row = page.to(tl.int64) * stride_cp + (tok % PAGE_SIZE) * stride_cs + kv_head * stride_ch
        kv_off = row[:, None] + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_SCALED:
            k = dequantize_tile(k, k_scale_ptr, row, valid, head_dim, True)
        k = k.to(q.dtype)  # q's dtype (float32 under DOT_F32): a no-op for an unscaled cache on GPU
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # every block holds >= 1 valid key, so m_new is finite and alpha = 0 on the first block
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_SCALED:
            v = dequantize_tile(v, v_scale_ptr, row, valid, head_dim, True)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    has_keys = l > 0.0  # False for an empty share (context 0, or more splits than blocks)
    o = tl.where(has_keys[:, None], acc / tl.where(has_keys, l, 1.0)[:, None], 0.0)
    if NUM_SPLITS == 1:
        out_off = b.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row_id = b.to(tl.int64) * num_q_heads + q_heads  # [BLOCK_G] index into [B, Hq]
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row_id * NUM_SPLITS + split, lse, mask=g < group_size)
        part_off = (row_id * NUM_SPLITS + split)[:, None] * head_dim + d[None, :]
        tl.store(part_out_ptr + part_off, o, mask=q_mask)


@triton.jit
def _decode_merge_kernel(
    # inputs
    part_out_ptr,  # [B, Hq, NUM_SPLITS, D] float32
    part_lse_ptr,  # [B, Hq, NUM_SPLITS] float32
    # outputs
    out_ptr,  # [B, Hq, D]
    # constants
    stride_ob, stride_oh,
    num_q_heads, head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row_id = b.to(tl.int64) * num_q_heads + h
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row_id * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    has = lse > float("-inf")
    lse_max = tl.max(tl.where(has, lse, -1e30), axis=0)  # finite even when every split is empty
    w = tl.where(has, tl.exp2(lse - lse_max), 0.0)  # [BLOCK_S]
    o_mask = (s < NUM_SPLITS)[:, None] & (d < head_dim)[None, :]
    o = tl.load(part_out_ptr + (row_id * NUM_SPLITS + s)[:, None] * head_dim + d[None, :],
                mask=o_mask & has[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    denom = tl.sum(w, axis=0)
    merged = tl.sum(w[:, None] * o, axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d,
             merged.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def default_block_n(block_d: int, elem_bytes: int, page_size: int) -> int:
    """Keys per iteration: 128 measured best on H200 (Llama-8B shapes); smaller for wide heads
    so the pipelined K and V tiles (x num_stages) stay within ~128 KB of shared memory."""
    block_n = 128
    while block_n > 16 and block_n * block_d * elem_bytes * 2 * _DECODE_NUM_STAGES > 128 * 1024:
        block_n //= 2
    return max(block_n, page_size)


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, num_sms: int,
                      min_blocks_per_split: int = 1) -> int:
    """Splits per (sequence, kv head) so the grid fills ~2 waves of SMs, each split walking at
    least min_blocks_per_split key blocks of the longest context; a shape-only choice."""
    want = triton.cdiv(2 * num_sms, max(batch * num_kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_blocks, min_blocks_per_split), 128))


def paged_decode_attention_triton(q, kv: PagedKV, block_tables, context_lens, scale: float,
                                  window: int | None = None, out: torch.Tensor | None = None,
                                  num_splits: int | None = None, block_n: int | None = None,
                                  max_len: int | None = None):
    """Triton launcher for `paged_decode_attention` (num_splits / block_n: tuning/test overrides;
    max_len: a bound on every context length, which sizes the split count when the block table
    is wider, as in CUDA graphs)."""
    k_cache, v_cache = kv.k, kv.v
    B, Hq, D = q.shape
    num_pages, page_size, Hkv, Dk = k_cache.shape
    assert Dk == D and Hq % Hkv == 0, "q [B, Hq, D] vs cache [P, page, Hkv, D] mismatch"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.stride(3) == 1 and q.stride(2) == 1, "last dims must be contiguous"
    scaled = kv.check()
    assert scaled or q.dtype == k_cache.dtype == v_cache.dtype, "q and cache dtypes must match (tl.dot)"
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.shape[0] == B
    assert block_tables.stride(1) == 1
    assert context_lens.shape == (B,) and context_lens.dtype == torch.int32 and context_lens.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if B == 0:
        return out
    max_pages = block_tables.shape[1]
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_N = block_n or default_block_n(BLOCK_D, q.element_size(), page_size)
    assert BLOCK_N % page_size == 0 and BLOCK_N >= 16 and BLOCK_N & (BLOCK_N - 1) == 0
    window = int(window or 0)
    # max_len alone sizes the splits when given (not the table width): callers pass the same
    # bound for a step run eagerly and in a graph, so both split, and round, alike.
    max_keys = max_len if max_len is not None else max_pages * page_size
    if window > 0:
        max_keys = min(max_keys, window + BLOCK_N)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, triton.cdiv(max_keys, BLOCK_N), device_num_sms(q.device),
                                       _DECODE_MIN_BLOCKS_PER_SPLIT)
    if num_splits > 1:
        part_out = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, *kv.scale_ptrs(), block_tables, context_lens,
        out, part_out, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        max_pages, Hq, Hq // Hkv, D, window, float(scale) * _LOG2E,
        PAGE_SIZE=page_size, BLOCK_N=BLOCK_N, BLOCK_G=max(16, next_pow2(Hq // Hkv)),
        BLOCK_D=BLOCK_D, NUM_SPLITS=num_splits,
        # the interpreter (CPU) multiplies in float32; compiled (CUDA, or meta while enumerating
        # launches for the GPU target) in q's dtype. float32 queries need no upcast anywhere.
        DOT_PRECISION=dot_precision(torch.float32 if interpreted(q) else q.dtype),
        DOT_F32=interpreted(q) and q.dtype != torch.float32,
        **kv.kernel_flags(host=False), num_warps=_DECODE_NUM_WARPS, num_stages=_DECODE_NUM_STAGES,
    )
    if num_splits > 1:
        _decode_merge_kernel[(B, Hq)](
            part_out, part_lse, out,
            out.stride(0), out.stride(1), Hq, D,
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=BLOCK_D, num_warps=4,
        )
    return out


# ============================================================================ torch paths

def gather_kv(kv: PagedKV, table_row, start: int, end: int, *, dtype: torch.dtype | None = None):
    """Keys/values of positions [start, end) of one sequence: 2 x [end - start, Hkv, D] in dtype
    (None: the cache's own dtype; required for an fp8 cache, whose rows come back dequantized
    with its scales)."""
    k_cache, v_cache, k_scale, v_scale = kv.k, kv.v, kv.k_scale, kv.v_scale
    scaled = kv.check()
    assert dtype is not None or not scaled, "an fp8 cache is gathered into a dtype (pass dtype=q.dtype)"
    page_size = k_cache.shape[1]
    first_page, num_pages = start // page_size, triton.cdiv(end, page_size) - start // page_size
    pages = table_row[first_page:first_page + num_pages]
    lo = start - first_page * page_size
    k = read_pages(k_cache, k_scale, pages, k_cache.dtype if dtype is None else dtype)
    v = read_pages(v_cache, v_scale, pages, v_cache.dtype if dtype is None else dtype)
    return k.flatten(0, 1)[lo:lo + end - start], v.flatten(0, 1)[lo:lo + end - start]


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> SDPA layout [1, H, L, D]."""
    return x.transpose(0, 1).unsqueeze(0)


def _windowed_sdpa(q, k, v, q_pos0: int, k_pos0: int, window: int, scale: float) -> torch.Tensor:
    """Causal sliding-window attention of q [Lq, Hq, D] (positions q_pos0..) over k/v [Lk, Hkv, D]
    (positions k_pos0..) with explicit boolean masks, in query slices; returns [Lq, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    # a slice of S queries scores S x (S + W - 1) keys for S x W useful ones: keep S ~ 2W
    q_slice = min(_PREFILL_MAX_Q_SLICE, max(2 * window, _PREFILL_MIN_Q_SLICE))
    for s in range(0, q.shape[0], q_slice):
        e = min(s + q_slice, q.shape[0])
        # keys this slice can see: (first query pos - W, last query pos]
        lo = max(q_pos0 + s - window + 1, k_pos0) - k_pos0
        hi = q_pos0 + e - k_pos0
        q_pos = torch.arange(q_pos0 + s, q_pos0 + e, device=q.device)[:, None]
        k_pos = torch.arange(k_pos0 + lo, k_pos0 + hi, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [e - s, hi - lo]
        # heads expanded by hand: SDPA with a mask and enable_gqa would fall back to the math kernel
        kb = _heads_first(k[lo:hi].repeat_interleave(group, dim=1))
        vb = _heads_first(v[lo:hi].repeat_interleave(group, dim=1))
        o = F.scaled_dot_product_attention(_heads_first(q[s:e]), kb, vb, attn_mask=mask, scale=scale)
        out[s:e] = o[0].transpose(0, 1)
    return out


def paged_prefill_attention(q, kv: PagedKV, block_tables, cu_seqlens_q, context_lens,
                            scale: float, window: int | None = None,
                            k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                            cu_seqlens_q_list: list[int] | None = None,
                            context_lens_list: list[int] | None = None) -> torch.Tensor:
    """Causal attention of packed queries q [T, Hq, D]; sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1], the last q_len of its context_lens[b] tokens
    (whose k/v are already in the cache; k_new/v_new [T, Hkv, D] are the same fresh
    rows, used directly when a sequence has no earlier context). With an fp8 cache
    every key and value is read back from the cache, dequantized to q's dtype, k_new / v_new
    unused: attention sees the cached rows whether a prompt comes whole or in chunks, and decode
    sees the same ones."""
    if kv.check():
        k_new = v_new = None
    cu = cu_seqlens_q_list if cu_seqlens_q_list is not None else cu_seqlens_q.tolist()
    ctxs = context_lens_list if context_lens_list is not None else context_lens.tolist()
    window = int(window or 0)
    out = torch.empty_like(q)
    for b in range(len(ctxs)):
        q0, q1, ctx = cu[b], cu[b + 1], ctxs[b]
        q_len = q1 - q0
        if q_len == 0:
            continue
        assert ctx >= q_len, f"sequence {b}: {q_len} queries but only {ctx} tokens of context"
        windowed = 0 < window < ctx  # a window at least as long as the context changes nothing
        if not windowed and ctx == q_len and k_new is not None:
            o = F.scaled_dot_product_attention(
                _heads_first(q[q0:q1]), _heads_first(k_new[q0:q1]), _heads_first(v_new[q0:q1]),
                is_causal=True, scale=scale, enable_gqa=True)
            out[q0:q1] = o[0].transpose(0, 1)
            continue
        kv_start = max(0, ctx - q_len - window + 1) if windowed else 0
        k, v = gather_kv(kv, block_tables[b], kv_start, ctx, dtype=q.dtype)
        if windowed:
            out[q0:q1] = _windowed_sdpa(q[q0:q1], k, v, ctx - q_len, kv_start, window, scale)
        else:
            o = F.scaled_dot_product_attention(
                _heads_first(q[q0:q1]), _heads_first(k), _heads_first(v),
                attn_mask=causal_lower_right(q_len, ctx), scale=scale, enable_gqa=True)
            out[q0:q1] = o[0].transpose(0, 1)
    return out


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                               window: int | None = None, out: torch.Tensor | None = None,
                               k_scale=None, v_scale=None):
    """Torch path for decode: per sequence, gather the visible keys (dequantized to q's dtype
    from an fp8 cache) and run SDPA."""
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    window = int(window or 0)
    out = torch.empty_like(q) if out is None else out
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx == 0:  # padded batch slot
            out[b] = 0
            continue
        k, v = gather_kv(PagedKV(k_cache, v_cache, k_scale, v_scale), block_tables[b],
                         max(0, ctx - window) if window else 0, ctx, dtype=q.dtype)
        o = F.scaled_dot_product_attention(q[b][None, :, None, :], _heads_first(k), _heads_first(v),
                                           scale=scale, enable_gqa=True)
        out[b] = o[0, :, 0, :]
    return out


def paged_decode_attention(q, kv: PagedKV, block_tables, context_lens, scale: float,
                           window: int | None = None, out: torch.Tensor | None = None,
                           max_len: int | None = None) -> torch.Tensor:
    """One query per sequence (position context_lens[b] - 1) over the paged cache kv; [B, Hq, D].
    max_len: optional bound on context_lens (launch sizing only)."""
    if use_triton(q, kv.k):
        return paged_decode_attention_triton(q, kv, block_tables, context_lens, scale, window, out, max_len=max_len)
    return paged_decode_attention_ref(q, kv.k, kv.v, block_tables, context_lens, scale, window, out,
                                      k_scale=kv.k_scale, v_scale=kv.v_scale)


def aot_launches(space) -> None:
    """Every decode launch the runtime makes (plugins/aot.py; prefill is torch SDPA): decode rows
    of eager steps (runtime/models/common.py, the dense rows of a backend's steps, token drop's
    dense rows) and of CUDA graphs, for every decode batch B the engine allows and every bound on the
    context lengths that sizes the split count — the short-context buckets some context of the
    engine can fall in, and the table width (always for the graphs captured at start-up; for
    eager steps when contexts can pass the last bucket or the steps of a backend's rows use it:
    runtime/cuda_graphs.decode_len_bound, plugins/plan_rules.py) — with each layer's window (sliding layers cap the keys).
    NUM_SPLITS = choose_num_splits(B, Hkv, blocks of the bound, 132 SMs) is the only
    step-dependent constexpr; q is a slice of the step's q (qkv view or q-norm output), out of
    ``empty_like(q)``."""
    import math

    from ._aot_shapes import attention_qkv, paged_kv
    from .plan_rules import DECODE_LEN_BUCKETS, reachable_len_buckets

    m, b = space.model, space.build
    kv = paged_kv(space)
    table_tokens = math.ceil(b.max_seq_len / b.page_size) * b.page_size
    buckets = reachable_len_buckets(b.max_seq_len)
    eager_table = b.max_seq_len > DECODE_LEN_BUCKETS[-1] or space.has_backend_layers
    eager_bounds = set(buckets) | ({table_tokens} if eager_table else set())
    graph_sizes = {s for s in b.cuda_graph_batch_sizes if s <= b.max_batch_size}
    windows = sorted({lp.window or 0 for lp in space.plan.layers})
    for B in range(1, b.max_batch_size + 1):
        bounds = eager_bounds | (set(buckets) | {table_tokens} if B in graph_sizes else set())
        for T in ((1, 2) if B == 1 else (B,)):  # decode rows first in the step's T rows
            q = attention_qkv(space, T)[0]
            out = torch.empty_like(q)
            tables = space.fake(B, math.ceil(b.max_seq_len / b.page_size), dtype=torch.int32)
            lens = space.fake(B, dtype=torch.int32)
            for window in windows:
                for bound in sorted(bounds):
                    paged_decode_attention(q[:B], kv, tables, lens, m.attention_scale, window, out=out[:B],
                                           max_len=bound)


# ============================================================================ test reference

def dense_attention_ref(q_rows, keys, values, q_positions, k_positions, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """Explicit-softmax float64 attention: q_rows [Lq, Hq, D], keys/values [Lk, Hkv, D],
    positions [Lq] / [Lk]. Returns float32 [Lq, Hq, D]; rows with no visible key are 0."""
    group = q_rows.shape[1] // keys.shape[1]
    q = q_rows.double()
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    qp, kp = q_positions[:, None].long(), k_positions[None, :].long()
    visible = kp <= qp
    if window:
        visible &= kp > qp - window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~visible[None], -math.inf)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return torch.einsum("hqk,khd->qhd", probs, v).float()
