"""InfiniteHiP block-sparse attention over a paged KV cache (decode and prefill, one kernel).

Each query block (blocks.py) attends to exactly its key set, listed in original order:

    keys(e) = sink [0, n0) ++ selected middle (sorted, inside [n_sink, s)) ++ stream [s, e)
    n0 = min(n_sink, e),  s = max(n0, e - n_stream),  n_keys = n0 + n_sel + (e - s)

(the list index r is a key's *rank*), with the causal cut key <= query position, and

    out = softmax(scale * q . K_set^T) V_set          (float32 accumulation, exact softmax)

Kernel: grid (NB, Hkv, NUM_SPLITS). A program takes the [b_q * group, D] query rows of one kv
head (per-q-head selections: grid (NB, Hq, NUM_SPLITS), the [b_q, D] rows of one q head) and
walks its share of the rank range [0, n_keys) in tiles of BLOCK_N; a rank maps to a token with
two compares (sink: r, selected: selected[begin + r - n0], stream: s + r - n0 - n_sel)
and a token to a cache row through the page table. Online softmax in base 2 as in
plugins/dense_attention.py; with NUM_SPLITS > 1 (flash-decoding split-K) each split writes a
normalised partial and its log2-sum-exp, and dense_attention's merge kernel combines them:

    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M),  M = max_s lse_s

Decode = blocks of one query (q_start = b, ends = context_lens) with splits; prefill = blocks of
b_q queries, one split. The grid depends only on shapes (graph-capturable); selected entries
outside the middle (a cached mask while the stream moved on) are skipped: the kernel counts the
row's entries below n_sink and below s (`selected_range` in torch), so a decode step is one
launch plus the split merge.

RoPE: NONE keeps the cached rotation; STREAMING (StreamingLLM) moves a key to its rank and a
query to its own token's rank (rope_styles.py). One sine/cosine per distinct delta suffices:
a sink key's rank is its token (delta 0), every stream key moves by the same mid_end - s, and
selected keys come in runs of consecutive tokens (the last stage's chunks) that each move by one
delta, so a tile made of whole runs takes one sin/cos per run (`rope_group`); only tiles at a
run's broken edge pay one per key. The key loads stay outside that branch (a branch around them
cost more than the trig it saved: 21 -> 23.5 µs per decode step at 1M keys on the H200).
Needs n_stream >= b_q so every query's own token is a streaming token (a query always sees
itself).

FP8 cache (plugins/kv_quant.py; a PagedKV with row scales): the kernel loads fp8 K/V tiles, rotates
keys as above in float32 and multiplies each row by its scale afterwards (a rotation is linear:
scaling after it is the same), and casts to the queries' dtype for the dots; the key bank stays
in the queries' dtype (key_bank.py dequantizes when it writes). A tile's row scales are one
[BLOCK_N] float32 load each for K and V, indexed through the scale tensor's own strides (no
division by D in the loop).

Offloaded pages (plugins/kv_offload.py; a PagedKV with a host twin): table entries < 0 are pages of a host
twin, read in place. K, V and the two scale tensors are four allocations on each side, so each
reaches its twin by its own delta and a host row has four offsets where a GPU row has one
(`_tile_tokens`); without a twin the kernel compiles to the same code as before (OFFLOAD False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import device_num_sms, dot_precision, next_pow2, triton_on
from ..aot import recording_target
from ..host_kv import HostKV
from ..kv_offload import merged_kv, page_offset
from ..kv_quant import check_kv_scales, dequantize_tile, read_rows
from ..paged_kv import PagedKV
from ..dense_attention import _decode_merge_kernel, choose_num_splits, dense_attention_ref
from .blocks import block_key_mask
from .rope_styles import (C_STREAMING, NONE, STREAMING, check_rotatable, load_halves, load_rotated,
                          rope_style_id, rotate_by_ref, rotate_halves, run_sin_cos)

_LOG2E = 1.4426950408889634


@triton.jit
def selected_bounds(sel_base, sel_width, n_sink, s, SEL_BLOCK: tl.constexpr):
    """(sel_begin, sel_end): the entries of a sorted selected row (sel_base: its first entry,
    PAD-padded) inside the middle [n_sink, s) — blocks.selected_range in torch."""
    below_sink = tl.zeros([SEL_BLOCK], tl.int32)
    below_stream = tl.zeros([SEL_BLOCK], tl.int32)
    for i in range(0, sel_width, SEL_BLOCK):
        idx = i + tl.arange(0, SEL_BLOCK)
        v = tl.load(sel_base + idx, mask=idx < sel_width, other=2147483647)
        below_sink += (v < n_sink).to(tl.int32)
        below_stream += (v < s).to(tl.int32)
    sel_begin = tl.sum(below_sink, axis=0)
    return sel_begin, tl.maximum(sel_begin, tl.sum(below_stream, axis=0))


@triton.jit
def _row(page, slot, kv_head, stride_page, stride_slot, stride_head, host_delta, OFFLOAD: tl.constexpr):
    """Offset of row (page, slot, kv_head) from its GPU pool's pointer, host pages included
    (kv_offload.page_offset)."""
    return page_offset(page, stride_page, host_delta, OFFLOAD) + slot * stride_slot + kv_head * stride_head


@triton.jit
def _tile_tokens(tile, n0, mid_end, s, n_keys, sel_row, table_row, stride_cp, stride_cs, kv_head, stride_ch,
                 stride_sp, stride_ss, stride_sh, k_host_delta, v_host_delta, ks_host_delta, vs_host_delta,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV_SCALED: tl.constexpr,
                 OFFLOAD: tl.constexpr):
    """Ranks [BLOCK_N] of a key tile -> (token, K row offset of its kv head, V row offset, index
    of the K row's scale, of the V row's (KV_SCALED; else copies of the K offset, unused)); all
    masked to 0 past n_keys. Two dependent loads: the selected row (selected ranks), then the
    page table. Without OFFLOAD, V's offsets are K's (the same values: one row offset, as the
    pools share strides); with it a host page's K and V rows differ (separate host allocations)."""
    rank = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rank < n_keys
    is_sel = (rank >= n0) & (rank < mid_end)
    sel_tok = tl.load(sel_row + rank, mask=valid & is_sel, other=0)
    tok = tl.where(rank < n0, rank, tl.where(is_sel, sel_tok, s + rank - mid_end))
    page = tl.load(table_row + tok // PAGE_SIZE, mask=valid, other=0)
    slot = tok % PAGE_SIZE
    k_row = _row(page, slot, kv_head, stride_cp, stride_cs, stride_ch, k_host_delta, OFFLOAD)
    v_row = _row(page, slot, kv_head, stride_cp, stride_cs, stride_ch, v_host_delta, OFFLOAD) if OFFLOAD else k_row
    if KV_SCALED:
        ks_row = _row(page, slot, kv_head, stride_sp, stride_ss, stride_sh, ks_host_delta, OFFLOAD)
        vs_row = (_row(page, slot, kv_head, stride_sp, stride_ss, stride_sh, vs_host_delta, OFFLOAD)
                  if OFFLOAD else ks_row)
    else:
        ks_row = k_row
        vs_row = k_row
    return tok, k_row, v_row, ks_row, vs_row


# Not specialized (plugins/aot.py): the block-table row stride (the step's longest page list) and
# the host deltas (int64 always: a host twin is far from the GPU pool, a staging twin may be near
# it); both only offset gathered rows.
@triton.jit(do_not_specialize=["stride_bt", "k_host_delta", "v_host_delta", "ks_host_delta", "vs_host_delta"])
def _sparse_attn_kernel(
    # inputs
    q_ptr,  # [T, Hq, D] packed queries
    k_cache_ptr, v_cache_ptr,  # [num_pages, page_size, Hkv, D] (same strides)
    k_scale_ptr, v_scale_ptr,  # KV_SCALED: [num_pages, page_size, Hkv] float32 row scales (same strides)
    #                            OFFLOAD: all four also reach their host twins (the deltas below)
    block_tables_ptr,  # [NB, max_pages] int32
    q_start_ptr, q_lens_ptr, ends_ptr,  # [NB] int32 query blocks (DECODE: q_start/q_lens unused)
    sel_ptr,  # [NB, (H,) K] int32 selected tokens, ascending, PAD-padded (H: one row per program head)
    inv_freq_ptr,  # [D/2] float32 (unused unless ROPE_STYLE == STREAMING)
    bank_ptr,  # BANK: [slots, >= K, Hkv, D] the selected keys rotated to their rank (key_bank.py)
    bank_rows_ptr,  # BANK: [NB] int32 / int64 bank slot of each block
    value_bank_ptr,  # VALUE_BANK: [slots, >= K, Hkv, D] the selected values (the bank's strides)
    # outputs
    out_ptr,  # [T, Hq, D], written when NUM_SPLITS == 1
    part_out_ptr,  # [T, Hq, NUM_SPLITS, D] float32, normalised per split
    part_lse_ptr,  # [T, Hq, NUM_SPLITS] float32, log2-sum-exp per split
    # constants
    stride_qt, stride_qh,
    stride_cp, stride_cs, stride_ch,
    stride_sp, stride_ss, stride_sh,  # KV_SCALED: the scale tensors' strides
    k_host_delta: tl.int64, v_host_delta: tl.int64,  # OFFLOAD: kv_offload.offload_deltas
    ks_host_delta: tl.int64, vs_host_delta: tl.int64,
    stride_bt, stride_sel, stride_sel_h, sel_width,  # stride_sel_h 0: one row for every head
    stride_bank_slot, stride_bank_entry, stride_bank_head,
    stride_ot, stride_oh,
    num_q_heads,
    group_size,  # q heads per program (shared / kv_head: Hq / Hkv; q_head: 1)
    heads_per_kv,  # programs per kv head (shared / kv_head: 1; q_head: Hq / Hkv)
    head_dim,
    n_sink, n_stream,
    scale_log2,  # softmax scale * log2(e)
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # b_q * group_size query rows, padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys (ranks) per iteration
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SEL_BLOCK: tl.constexpr,  # entries of the selected row counted per step
    DECODE: tl.constexpr,  # block i is query row i alone (no q_start / q_lens tensors)
    ROPE_STYLE: tl.constexpr,  # NONE | STREAMING
    ROPE_GROUP: tl.constexpr,  # STREAMING: selected keys come in runs of this many consecutive
    #                            tokens (the last stage's chunks): one sin/cos per run (1: per key)
    VALUE_BANK: tl.constexpr,  # BANK: selected values from the value bank too (offloaded caches)
    BANK: tl.constexpr,  # STREAMING: selected keys from the rotated bank, stream keys scored with
    #                      a counter-rotated query: no key is rotated
    PREFETCH: tl.constexpr,  # load the next tile's tokens and page entries while this one computes
    DOT_F32: tl.constexpr,  # float32 dot operands (CPU interpreter, float32 queries)
    DOT_PRECISION: tl.constexpr,
    KV_SCALED: tl.constexpr,  # fp8 caches with row scales (kv_quant.py): dequantize K/V tiles
    OFFLOAD: tl.constexpr,  # table entries < 0 are host pages (kv_offload.py)
):
    blk = tl.program_id(0)
    head = tl.program_id(1)  # its q heads head * group_size + [0, group_size)
    kv_head = head // heads_per_kv
    split = tl.program_id(2)
    COMPUTE = q_ptr.dtype.element_ty  # dot operands in the queries' dtype (unless DOT_F32)
    if DECODE:
        q_len = 1
        q0 = blk
    else:
        q_len = tl.load(q_lens_ptr + blk)
        q0 = tl.load(q_start_ptr + blk)
    end = tl.load(ends_ptr + blk)
    n0 = tl.minimum(n_sink, end)  # sink keys
    s = tl.maximum(n0, end - n_stream)  # first streaming token
    # The entries of the sorted selected row inside the middle [n_sink, s) are [sel_begin,
    # sel_end): counted here (blocks.selected_range in torch) so a decode step is one launch.
    sel_base = sel_ptr + blk.to(tl.int64) * stride_sel + head * stride_sel_h
    sel_begin, sel_end = selected_bounds(sel_base, sel_width, n_sink, s, SEL_BLOCK)
    mid_end = n0 + sel_end - sel_begin  # rank after the last selected key
    n_keys = mid_end + end - s
    num_tiles = tl.cdiv(n_keys, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    rows = tl.arange(0, BLOCK_Q)
    t = rows // group_size
    heads = head * group_size + rows % group_size
    row_valid = t < q_len
    q_pos = end - q_len + t  # [BLOCK_Q]
    q_rank = tl.where(q_pos < s, q_pos, mid_end + q_pos - s)  # rank of the query's own token
    ROTATE: tl.constexpr = ROPE_STYLE == C_STREAMING
    q = load_rotated(q_ptr + (q0 + t).to(tl.int64) * stride_qt + heads * stride_qh, row_valid,
                     q_rank - q_pos, inv_freq_ptr, head_dim, BLOCK_D, ROTATE)
    if not DOT_F32:
        q = q.to(COMPUTE)
    if BANK:  # every stream key moves by mid_end - s: q . R(d) k = R(-d) q . k, one query tile
        q_stream = load_rotated(q_ptr + (q0 + t).to(tl.int64) * stride_qt + heads * stride_qh, row_valid,
                                q_rank - q_pos - (mid_end - s), inv_freq_ptr, head_dim, BLOCK_D, True)
        if not DOT_F32:
            q_stream = q_stream.to(COMPUTE)
        bank_off = tl.load(bank_rows_ptr + blk).to(tl.int64) * stride_bank_slot + kv_head * stride_bank_head
        bank_base = bank_ptr + bank_off
    d = tl.arange(0, BLOCK_D)
    sel_row = sel_base + sel_begin - n0  # indexed by rank
    table_row = block_tables_ptr + blk.to(tl.int64) * stride_bt

    m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    if PREFETCH:
        tok, k_row, v_row, ks_row, vs_row = _tile_tokens(
            tile_lo, n0, mid_end, s, n_keys, sel_row, table_row, stride_cp, stride_cs, kv_head, stride_ch,
            stride_sp, stride_ss, stride_sh, k_host_delta, v_host_delta, ks_host_delta, vs_host_delta,
            PAGE_SIZE, BLOCK_N, KV_SCALED, OFFLOAD)
    for tile in range(tile_lo, tile_hi):
        rank = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        valid = rank < n_keys
        is_sel = (rank >= n0) & (rank < mid_end)
        if PREFETCH:  # this tile's rows were loaded during the previous one; start the next's
            tok_next, k_row_next, v_row_next, ks_row_next, vs_row_next = _tile_tokens(
                tile + 1, n0, mid_end, s, n_keys, sel_row, table_row, stride_cp, stride_cs, kv_head, stride_ch,
                stride_sp, stride_ss, stride_sh, k_host_delta, v_host_delta, ks_host_delta, vs_host_delta,
                PAGE_SIZE, BLOCK_N, KV_SCALED, OFFLOAD)
        else:
            tok, k_row, v_row, ks_row, vs_row = _tile_tokens(
                tile, n0, mid_end, s, n_keys, sel_row, table_row, stride_cp, stride_cs, kv_head, stride_ch,
                stride_sp, stride_ss, stride_sh, k_host_delta, v_host_delta, ks_host_delta, vs_host_delta,
                PAGE_SIZE, BLOCK_N, KV_SCALED, OFFLOAD)
        # (dequantize_tile with head_dim 1: ks_row / vs_row already index the scale tensors)
        if BANK:  # sink keys as cached (rank = token), selected ones from the bank (entry = index
            #       in the selected row), stream ones as cached with the counter-rotated query
            bank_row = bank_base + (rank - n0 + sel_begin).to(tl.int64) * stride_bank_entry
            if KV_SCALED:  # an fp8 cache and a bank in q's dtype: two masked loads, scales for the cache's
                cached = valid & ~is_sel
                k = tl.where(is_sel[:, None],
                             load_rotated(bank_row, valid & is_sel, rank, inv_freq_ptr, head_dim, BLOCK_D, False),
                             dequantize_tile(load_rotated(k_cache_ptr + k_row, cached, rank, inv_freq_ptr,
                                                          head_dim, BLOCK_D, False),
                                             k_scale_ptr, ks_row, cached, 1, KV_SCALED))
            else:
                k_rows = tl.where(is_sel, bank_row, k_cache_ptr + k_row)
                k = load_rotated(k_rows, valid, rank, inv_freq_ptr, head_dim, BLOCK_D, False)
        elif ROTATE:  # keys to their rank (StreamingLLM): R(rank - tok) applied to the cached key
            k1, k2 = load_halves(k_cache_ptr + k_row, valid, head_dim, BLOCK_D)
            sin, cos = run_sin_cos(rank - tok, inv_freq_ptr, head_dim, BLOCK_N, BLOCK_D, ROPE_GROUP)
            k = rotate_halves(k1, k2, sin, cos)
            k = dequantize_tile(k, k_scale_ptr, ks_row, valid, 1, KV_SCALED)  # scales after the rotation
        else:
            k = load_rotated(k_cache_ptr + k_row, valid, rank - tok, inv_freq_ptr, head_dim, BLOCK_D, False)
            k = dequantize_tile(k, k_scale_ptr, ks_row, valid, 1, KV_SCALED)
        if VALUE_BANK:  # selected values from the bank (q's dtype), sink and stream ones as cached
            cached = valid & ~is_sel
            v_sel = tl.load(value_bank_ptr + bank_off + (rank - n0 + sel_begin).to(tl.int64)[:, None]
                            * stride_bank_entry + d[None, :],
                            mask=(valid & is_sel)[:, None] & (d < head_dim)[None, :], other=0.0)
            v = tl.load(v_cache_ptr + v_row[:, None] + d[None, :],
                        mask=cached[:, None] & (d < head_dim)[None, :], other=0.0)
            v = dequantize_tile(v, v_scale_ptr, vs_row, cached, 1, KV_SCALED)
            v = tl.where(is_sel[:, None], v_sel.to(tl.float32), v)
        else:
            v = tl.load(v_cache_ptr + v_row[:, None] + d[None, :],
                        mask=valid[:, None] & (d < head_dim)[None, :], other=0.0)
            if KV_SCALED:
                v = dequantize_tile(v, v_scale_ptr, vs_row, valid, 1, KV_SCALED)
        if DOT_F32:
            v = v.to(tl.float32)
        else:
            k = k.to(COMPUTE)
            v = v.to(COMPUTE)
        sc = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_Q, BLOCK_N]
        if BANK:
            sc = tl.where((rank >= mid_end)[None, :], tl.dot(q_stream, tl.trans(k), input_precision=DOT_PRECISION), sc)
        sc = sc * scale_log2
        visible = valid[None, :] & (tok[None, :] <= q_pos[:, None])
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing yet (causal)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(sc - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
        if PREFETCH:  # carry only distinct offsets (without OFFLOAD, V's are K's)
            tok = tok_next
            k_row = k_row_next
            v_row = v_row_next if OFFLOAD else k_row
            if KV_SCALED:
                ks_row = ks_row_next
                vs_row = vs_row_next if OFFLOAD else ks_row

    has_keys = l > 0.0
    o = tl.where(has_keys[:, None], acc / tl.where(has_keys, l, 1.0)[:, None], 0.0)
    o_mask = row_valid[:, None] & (d < head_dim)[None, :]
    q_row = (q0 + t).to(tl.int64)
    if NUM_SPLITS == 1:
        out_off = q_row[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        row_id = q_row * num_q_heads + heads  # [BLOCK_Q] index into [T, Hq]
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row_id * NUM_SPLITS + split, lse, mask=row_valid)
        part_off = (row_id * NUM_SPLITS + split)[:, None] * head_dim + d[None, :]
        tl.store(part_out_ptr + part_off, o, mask=o_mask)


def block_sparse_attention(q, kv: PagedKV, block_tables, q_start, q_lens, ends, selected, *,
                     block_q: int, n_sink: int, n_stream: int, scale: float, rope_style="none",
                     inv_freq: torch.Tensor | None = None, num_splits: int = 1, rope_group: int = 1,
                     bank: torch.Tensor | None = None, bank_rows: torch.Tensor | None = None,
                     value_bank: torch.Tensor | None = None,
                     block_n: int | None = None, num_warps: int | None = None,
                     prefetch: bool | None = None, num_stages: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher (CPU tensors without TRITON_INTERPRET: sparse_attention_ref, same
    contract): q [T, Hq, D] packed, query blocks [NB] (blocks.py, q_lens <= block_q),
    selected int32 [NB, K] (last pruning stage), or [NB, H, K] one key set per mask head
    (blocks.MASK_LAYOUTS; program_heads): H = 1 or Hkv keeps one program per kv head and its
    GQA group (each key tile loaded once for the group), H = Hq one program per q head over
    its kv head's keys (as hip-attention's block-sparse kernel; the key bank is for the shared
    layout). Returns out [T, Hq, D] (rows of no block: 0).
    q_start = q_lens = None means decode: block i is query row i alone (no tensors to make).
    rope_group (STREAMING): the selected keys' run length, normally the last stage's chunk size;
    rotations then take one sine/cosine per run (any value gives the same result, a power of two
    up to the key tile). bank / bank_rows (STREAMING): the selected keys already rotated to their
    rank (key_bank.write_key_bank from this same `selected`; bank [slots, >= K, Hkv, D], bank_rows
    int32 / int64 [NB] the slot of each block): no key is rotated in the kernel. value_bank
    (with bank): the selected values, written beside the keys (write_key_bank(value_bank=)): the
    selected rows then come from the banks alone, so a cached decode step over an offloaded
    cache reads only GPU memory (sink and stream pages stay on the GPU). block_n /
    num_warps / prefetch / num_stages: tuning overrides (prefetch: each tile's tokens and page
    entries are loaded one tile ahead; the same result; default: on in prefill). kv: the layer's
    cache (plugins/paged_kv.py), with the float32 row scales of an fp8 cache (kv_quant.py; the
    bank and out stay in q's dtype) and its host twin, whose pages table entries < 0 name
    (kv_offload.py)."""
    k_cache, v_cache = kv.k, kv.v
    T, Hq, D = q.shape
    num_pages, page_size, Hkv, Dk = k_cache.shape
    NB = ends.shape[0]
    decode = q_start is None
    if decode:
        assert q_lens is None and block_q == 1 and T == NB, "decode: one query row per block"
    scaled = kv.check()
    assert Dk == D and Hq % Hkv == 0 and (scaled or q.dtype == k_cache.dtype == v_cache.dtype)
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and page_size & (page_size - 1) == 0
    for meta in (ends,) if decode else (q_start, q_lens, ends):
        assert meta.shape == (NB,) and meta.dtype == torch.int32 and meta.is_contiguous()
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == NB and block_tables.stride(1) == 1
    assert selected.dtype == torch.int32 and selected.shape[0] == NB and selected.stride(-1) == 1
    P, Gp, heads_per_kv, stride_sel_h = program_heads(selected, Hq, Hkv)
    if bank is not None and stride_sel_h:
        raise ValueError("the key bank holds one selection per block (the shared layout); with per-head "
                         f"selections {tuple(selected.shape)} pass bank=None (keys are rotated in the kernel)")
    sel_width = selected.shape[-1]
    assert n_stream >= block_q >= 1, "every query's own token must be a streaming token"
    style = rope_style_id(rope_style)
    assert style in (NONE, STREAMING), "block-sparse attention takes none | streaming"
    if style == STREAMING:
        assert inv_freq is not None and inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32
        check_rotatable(D)
    assert rope_group >= 1 and rope_group & (rope_group - 1) == 0, f"rope_group must be a power of two, got {rope_group}"
    if bank is not None:
        assert style == STREAMING, "a rotated key bank is for the streaming RoPE style"
        assert bank.dtype == q.dtype and bank.dim() == 4 and bank.shape[2:] == (Hkv, D) and bank.stride(3) == 1
        assert bank.shape[1] >= sel_width, f"bank holds {bank.shape[1]} keys per slot, selection {sel_width}"
        assert bank_rows is not None and bank_rows.shape == (NB,) and bank_rows.dtype in (torch.int32, torch.int64)
    if value_bank is not None:
        assert bank is not None, "a value bank comes with the key bank (same entries and slots)"
        assert value_bank.dtype == q.dtype and value_bank.shape[1:] == bank.shape[1:] \
            and value_bank.stride() == bank.stride(), "the value bank must be laid out like the key bank"
    if out is None:
        out = torch.zeros_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if NB == 0:
        return out
    if not triton_on(q, k_cache):  # CPU without the interpreter: torch reference, block rows only
        if decode:
            q_start = torch.arange(NB, dtype=torch.int32, device=q.device)
            q_lens = torch.ones(NB, dtype=torch.int32, device=q.device)
        ref = sparse_attention_ref(q, k_cache, v_cache, block_tables, q_start, q_lens, ends, selected,
                                   n_sink=n_sink, n_stream=n_stream, scale=scale, rope_style=rope_style,
                                   inv_freq=inv_freq, k_scale=kv.k_scale, v_scale=kv.v_scale, offload=kv.host)
        for q0, n in zip(q_start.tolist(), q_lens.tolist()):
            out[q0:q0 + n] = ref[q0:q0 + n].to(out.dtype)
        return out
    BLOCK_D = max(16, next_pow2(D))
    G = Gp  # q heads per program
    # prefill-sized query tiles ([b_q * group, D], 256 rows for Llama-8B) do best with 32-key
    # tiles on the H200 (docs/benchmarks.md); decode's small tiles with 64
    BLOCK_N = block_n or (64 if BLOCK_D <= 128 and block_q * G < 128 else 32)
    # H200, a 32K prefill chunk, Llama-8B heads (docs/benchmarks.md, seventh session): tiles
    # loaded one ahead take 128K keys (no RoPE) from 9.23 to 8.26 ms, and with Triton's pipeline
    # at depth 2 1M keys (STREAMING) from 14.5 to 12.3 ms (prefetch at depth 3 there: 16.2); decode
    # gains nothing (20.8 vs 20.2 µs rotating, 14.1 vs 14.9 from the bank) and keeps the old loop
    if prefetch is None:
        prefetch = not decode
    if num_stages is None and not decode and prefetch and style == STREAMING and bank is None:
        num_stages = 2
    # 256-row prefill tiles without RoPE: 16 warps, 128K keys 8.28 -> 7.65 ms (eighth session;
    # with STREAMING 16 warps lose, 12.3 -> 14.9 ms at 1M: the rotation wants the registers)
    if num_warps is None:
        num_warps = 16 if not decode and style == NONE and block_q * G >= 256 else 8 if block_q * G >= 128 else 4
    gpu = q.is_cuda or recording_target() is not None  # recording for a GPU target: its choices
    if num_splits > 1:
        part_out = torch.empty((T, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, Hq, num_splits), dtype=torch.float32, device=q.device)  # all written
    else:
        part_out = part_lse = out  # unused
    _sparse_attn_kernel[(NB, P, num_splits)](
        q, k_cache, v_cache, *kv.scale_ptrs(),
        block_tables, ends if decode else q_start, ends if decode else q_lens, ends, selected,
        inv_freq if inv_freq is not None else part_lse,
        bank if bank is not None else k_cache, bank_rows if bank_rows is not None else ends,
        value_bank if value_bank is not None else v_cache,
        out, part_out, part_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *kv.scale_strides(), *kv.host_deltas(),
        block_tables.stride(0), selected.stride(0), stride_sel_h, sel_width,
        *(bank.stride()[:3] if bank is not None else (0, 0, 0)),
        out.stride(0), out.stride(1),
        Hq, G, heads_per_kv, D, n_sink, n_stream, float(scale) * _LOG2E,
        PAGE_SIZE=page_size, BLOCK_Q=max(16, next_pow2(block_q * G)), BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, NUM_SPLITS=num_splits, SEL_BLOCK=min(1024, next_pow2(sel_width)),
        DECODE=decode, ROPE_STYLE=style, ROPE_GROUP=min(rope_group, BLOCK_N), BANK=bank is not None, PREFETCH=prefetch,
        VALUE_BANK=value_bank is not None,
        DOT_F32=not gpu or q.dtype == torch.float32,
        DOT_PRECISION=dot_precision(q.dtype if gpu else torch.float32), **kv.kernel_flags(), num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}),
    )
    if num_splits > 1:
        _decode_merge_kernel[(T, Hq)](
            part_out, part_lse, out, out.stride(0), out.stride(1), Hq, D,
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), BLOCK_D=BLOCK_D, num_warps=4,
        )
    return out


def program_heads(selected: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> tuple[int, int, int, int]:
    """The attention grid's head axis for a selection: (programs per block P, q heads per
    program, programs per kv head, the selection's head stride). [NB, K] or [NB, 1, K] (shared)
    and [NB, Hkv, K] (kv_head): a program per kv head, its GQA group's rows sharing every key
    tile; [NB, Hq, K] (q_head, Hq > Hkv): a program per q head (the group's key sets differ)."""
    G = num_q_heads // num_kv_heads
    if selected.dim() == 2 or selected.shape[1] == 1:
        return num_kv_heads, G, 1, 0
    H = selected.shape[1]
    if H == num_kv_heads:
        return num_kv_heads, G, 1, selected.stride(1)
    if H == num_q_heads:
        return num_q_heads, 1, G, selected.stride(1)
    raise ValueError(f"selected {tuple(selected.shape)}: a per-head selection has 1, {num_kv_heads} (kv_head) or "
                     f"{num_q_heads} (q_head) rows per block")


def sparse_decode_attention(q, kv: PagedKV, block_tables, context_lens, selected, *,
                            n_sink: int, n_stream: int, scale: float, rope_style="none",
                            inv_freq=None, num_splits: int | None = None, rope_group: int = 1,
                            bank=None, bank_rows=None, block_n: int | None = None,
                            prefetch: bool | None = None, num_stages: int | None = None, out=None,
                            value_bank=None) -> torch.Tensor:
    """Decode: q [B, Hq, D] (one query per sequence, position context_lens[b] - 1), selected
    int32 [B, K] or [B, H, K] (block_sparse_attention). Flash-decoding split-K over sink +
    selected + stream; out [B, Hq, D].
    bank / bank_rows: the rotated key bank (block_sparse_attention, key_bank.py); value_bank: the
    selected values beside it (offloaded caches: cached steps then read no host page). kv: the
    layer's cache (block_sparse_attention)."""
    B = q.shape[0]
    if num_splits is None:  # per-head selections: the grid's programs per row (program_heads)
        num_splits = decode_num_splits(B, program_heads(selected, q.shape[1], kv.k.shape[2])[0], selected.shape[-1],
                                       n_sink, n_stream, device_num_sms(q.device), block_n)
    return block_sparse_attention(q, kv, block_tables, None, None, context_lens, selected,
                            block_q=1, n_sink=n_sink, n_stream=n_stream, scale=scale,
                            rope_style=rope_style, inv_freq=inv_freq, num_splits=num_splits,
                            rope_group=rope_group, bank=bank, bank_rows=bank_rows, block_n=block_n,
                            prefetch=prefetch, num_stages=num_stages, out=out, value_bank=value_bank)


def decode_num_splits(batch: int, num_kv_heads: int, sel_width: int, n_sink: int, n_stream: int, num_sms: int,
                      block_n: int | None = None) -> int:
    """Split-K of sparse decode: ~2 waves of SMs over batch x kv heads, at most one split per key
    tile of the longest key set (sink + selected + stream); a shape-only choice.

    The batch counts by its power-of-two bucket: a CUDA graph replays a decode batch padded to a
    captured size (powers of two by default, runtime/cuda_graphs.py), so eager steps now split
    as the graph of their bucket does, and an engine compiles one split count per bucket (5 for
    16 rows instead of 9: plugins/aot.py). The grid stays within the same two-wave target
    (e.g. 3 rows of 8 kv heads: 9 splits, 216 programs, instead of 11, 264)."""
    tiles = triton.cdiv(n_sink + sel_width + n_stream, block_n or 64)
    return choose_num_splits(next_pow2(batch), num_kv_heads, tiles, num_sms)


def sparse_prefill_attention(q, kv: PagedKV, block_tables, q_start, q_lens, ends, selected, *,
                             block_q: int, n_sink: int, n_stream: int, scale: float,
                             rope_style="none", inv_freq=None, rope_group: int = 1,
                             block_n: int | None = None, num_warps: int | None = None,
                             prefetch: bool | None = None, num_stages: int | None = None, out=None) -> torch.Tensor:
    """Prefill: flash-style, each query block of <= block_q queries over its own key set with the
    causal cut; q [T, Hq, D] packed, blocks from blocks.plan_query_blocks. kv: the layer's cache
    (block_sparse_attention)."""
    return block_sparse_attention(q, kv, block_tables, q_start, q_lens, ends, selected,
                            block_q=block_q, n_sink=n_sink, n_stream=n_stream, scale=scale,
                            rope_style=rope_style, inv_freq=inv_freq, num_splits=1,
                            rope_group=rope_group, block_n=block_n, num_warps=num_warps, prefetch=prefetch,
                            num_stages=num_stages, out=out)


def sparse_attention_ref(q, k_cache, v_cache, block_tables, q_start, q_lens, ends, selected, *,
                         n_sink: int, n_stream: int, scale: float, rope_style="none",
                         inv_freq=None, k_scale=None, v_scale=None,
                         offload: HostKV | None = None) -> torch.Tensor:
    """Reference: per block, gather the key set (blocks.block_key_mask) and run an explicit
    float64 softmax (dense_attention_ref, causal by position). STREAMING rotates keys to their
    rank and each query to the rank of its own token. fp8 caches (k_scale / v_scale given) are
    dequantized to float32 rows. Returns float32 [T, Hq, D].
    selected [NB, K] (one key set per block) or [NB, H, K] per mask head (blocks.MASK_LAYOUTS: H 1,
    Hkv or Hq): head m's rows are q heads [m Hq/H, (m+1) Hq/H), over their kv head's keys.
    offload: host twin of the caches; table entries < 0 name its pages (kv_offload.py)."""
    k_cache, v_cache, k_scale, v_scale, block_tables = merged_kv(k_cache, v_cache, k_scale, v_scale,
                                                                 block_tables, offload)
    if selected.dim() == 3:  # per mask head: the shared reference on each head's q / kv slice
        Hq, Hkv, H = q.shape[1], k_cache.shape[2], selected.shape[1]
        assert H in (1, Hkv, Hq), f"selected has {H} heads; a layout has 1, {Hkv} (kv) or {Hq} (q)"
        Gs, G = Hq // H, Hq // Hkv
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for m in range(H):
            kv = slice(m * Gs // G, m * Gs // G + 1) if H > 1 else slice(None)
            out[:, m * Gs:(m + 1) * Gs] = sparse_attention_ref(
                q[:, m * Gs:(m + 1) * Gs], k_cache[:, :, kv], v_cache[:, :, kv], block_tables, q_start, q_lens,
                ends, selected[:, m], n_sink=n_sink, n_stream=n_stream, scale=scale, rope_style=rope_style,
                inv_freq=inv_freq, k_scale=None if k_scale is None else k_scale[:, :, kv],
                v_scale=None if v_scale is None else v_scale[:, :, kv])
        return out
    scaled = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    rows_dtype = torch.float32 if scaled else k_cache.dtype
    style = rope_style_id(rope_style)
    page = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    num_keys = int(ends.max()) if ends.numel() else 0
    masks = block_key_mask(selected.cpu(), ends.cpu(), n_sink, n_stream, num_keys)
    for i in range(ends.shape[0]):
        q_len, e, q0 = int(q_lens[i]), int(ends[i]), int(q_start[i])
        if q_len == 0:
            continue
        toks = masks[i].nonzero()[:, 0]  # ascending
        pages, slots = block_tables[i, toks // page].long(), (toks % page).to(block_tables.device)
        k = read_rows(k_cache, k_scale, pages, slots, rows_dtype).cpu()
        v = read_rows(v_cache, v_scale, pages, slots, rows_dtype).cpu()
        q_rows, q_pos = q[q0:q0 + q_len].cpu(), torch.arange(e - q_len, e)
        if style == STREAMING:
            ranks = torch.arange(toks.numel())
            k = rotate_by_ref(k, ranks - toks, inv_freq.cpu())
            q_rows = rotate_by_ref(q_rows, torch.searchsorted(toks, q_pos) - q_pos, inv_freq.cpu())
        out[q0:q0 + q_len] = dense_attention_ref(q_rows, k, v, q_pos, toks, scale)
    return out.to(q.device)


def aot_launches(space) -> None:
    """Every block-sparse attention variant (and split merge) the runtime can launch for the
    engine of ``space`` (plugins/aot.py; shape classes from _aot.py), per layer kind (the last
    stage's k and chunk size), RoPE mode and host twin (without / with):

    * decode (InfiniteHipLayer._decode): q[rows] of 1 to max_batch_size rows, the split count
      chosen from the row count (one launch per distinct split count); under dynamic RoPE with a
      key bank, from the bank (and its value bank when offloading) and, where a row may own no
      bank row (max_batch_size > key_bank_slots) or there is no bank, rotating;
    * prefill (_prefill): query blocks of block_q over the step's whole q, one split."""
    from .._aot_shapes import representatives
    from ._aot import sparse_space

    ss = sparse_space(space)
    if ss is None:
        return
    cfg, fake = ss.cfg, ss.space.fake
    Hq, Hkv, D = ss.dims
    act = ss.space.act_dtype
    kw = dict(n_sink=cfg.n_sink, n_stream=cfg.n_stream, scale=ss.space.model.attention_scale,
              inv_freq=ss.inv_freq())
    for kind in ss.kinds:
        last = kind.stages[-1]
        for mode in ss.modes:
            style = cfg.attention_rope if mode.dynamic else "none"
            banks = [False]
            if mode.dynamic and ss.bank:
                banks = [True] if ss.bank_for_all else [True, False]
            for offload in ss.offload:
                kv = ss.kv(offload)
                for use_bank in banks:
                    P = Hq if ss.mask_layout == "q_head" else Hkv  # program_heads
                    splits = lambda b: decode_num_splits(b, P, last.k, cfg.n_sink, cfg.n_stream,  # noqa: E731
                                                         ss.space.target.num_sms)
                    for B in representatives(1, ss.max_decode_rows, splits):
                        bank = fake(2, last.k, Hkv, D, dtype=act) if use_bank else None
                        sparse_decode_attention(
                            ss.rows_q(B), kv, ss.tables(B), ss.i32(B),
                            ss.index_rows(B, last.k), rope_style=style, rope_group=last.chunk_size,
                            bank=bank, bank_rows=ss.i64(B) if use_bank else None,
                            value_bank=fake(2, last.k, Hkv, D, dtype=act) if use_bank and offload else None, **kw)
                NB = 1  # any block count: the grid only
                sparse_prefill_attention(
                    ss.step_q(NB), kv, ss.tables(NB), ss.i32(NB), ss.i32(NB), ss.i32(NB),
                    ss.index_rows(NB, last.k), block_q=cfg.block_q, rope_style=style,
                    rope_group=last.chunk_size, out=fake(NB, Hq, D, dtype=act), **kw)
