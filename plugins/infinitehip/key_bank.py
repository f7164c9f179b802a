"""Rotated key bank: cached sparse decode steps with dynamic RoPE and no per-key rotation.

Past the trained window, block-sparse attention places keys at their StreamingLLM rank
(rope_styles.py); rotating every selected key on every decode step costs as much as the
attention itself (1M keys, H200: 20.8 µs per layer against 11.8 µs unrotated, docs/benchmarks.md).
But between two refreshes of the last pruning stage a request's selection is fixed (mask
caching), and with it each selected key's rank

    rank(i) = n0 + i - sel_begin     i: index in the sorted selected row, n0 = min(n_sink, end),
                                     sel_begin: the row's entries below n_sink (blocks.py)

(only the stream moves as the request grows). So when the selection is made, its keys are
rotated to their ranks once, into a bank

    bank[slot, i, h] = R(rank(i) - tok_i) k_cache[tok_i, h]            (the queries' dtype)

and `sparse_decode_attention(..., bank=, bank_rows=)` reads them instead: sink keys sit at their
own rank (no rotation), selected keys come rotated from the bank, and the stream keys, which all
move by one shift mid_end - s, are scored with a second query tile rotated the other way
(q . R(d) k = R(-d) q . k). Entries outside the middle (stray sink tokens, PAD) are not written;
the attention never reads them.

The bank holds keys in the queries' dtype: an fp8 cache (kv_quant.py, with its row scales) is
dequantized here (each row times its scale, after the rotation), so attention reads bank keys
without scales. (Unscaled caches are in the queries' dtype already.)

Memory: [slots, K, Hkv, D] per layer — Llama-3.1-8B with the 3k budget (K = 2048): 4 MiB per
request and layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton_utils import next_pow2, triton_on
from ..kv_offload import merged_kv, page_offset
from ..kv_quant import check_kv_scales, dequantize_tile, is_fp8, read_rows
from ..paged_kv import PagedKV
from .rope_styles import check_rotatable, load_halves, rotate_by_ref, rotate_halves, run_sin_cos
from .sparse_attention import selected_bounds


# Not specialized (plugins/aot.py): the block-table row stride (the step's longest page list), the
# scratch row (min(max_num_seqs, key_bank_slots), a load option) and the host deltas (int64
# always: a host twin is far from the GPU pool); address arithmetic and one compare only.
@triton.jit(do_not_specialize=["stride_bt", "skip_row", "k_host_delta", "ks_host_delta", "v_host_delta",
                               "vs_host_delta"])
def _write_bank_kernel(
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    k_scale_ptr,  # KV_SCALED: [num_pages, page_size, Hkv] float32 row scales
    block_tables_ptr,  # [B, max_pages] int32
    ends_ptr,  # [B] int32 context lengths when the selection was made
    sel_ptr,  # [B, K] int32 ascending selected tokens, PAD-padded
    bank_ptr,  # [slots, >= K, Hkv, D]
    bank_rows_ptr,  # [B] int32 / int64 slot of each row
    inv_freq_ptr,  # [D/2] float32
    stride_cp, stride_cs, stride_ch, stride_bt, stride_sel, sel_width,
    stride_bank_slot, stride_bank_entry, stride_bank_head,
    head_dim, n_sink, skip_row,
    stride_sp, stride_ss, stride_sh,  # KV_SCALED: the scale tensor's strides
    k_host_delta: tl.int64, ks_host_delta: tl.int64,  # OFFLOAD: elements from k_cache / k_scale to their host twins
    v_cache_ptr, v_scale_ptr, value_bank_ptr,  # VALUES: the value rows, their scales, the value bank
    v_host_delta: tl.int64, vs_host_delta: tl.int64,  # VALUES and OFFLOAD: elements from v_cache / v_scale to their host twins
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SEL_BLOCK: tl.constexpr,
    ROPE_GROUP: tl.constexpr, KV_SCALED: tl.constexpr,
    OFFLOAD: tl.constexpr,  # table entries < 0 name host pages (kv_offload.py)
    VALUES: tl.constexpr,  # also copy the selected values (unrotated) into the value bank
):
    row = tl.program_id(0)
    head = tl.program_id(2)
    slot = tl.load(bank_rows_ptr + row).to(tl.int64)
    end = tl.load(ends_ptr + row)
    n0 = tl.minimum(n_sink, end)
    sel_base = sel_ptr + row.to(tl.int64) * stride_sel
    sel_begin, _ = selected_bounds(sel_base, sel_width, n_sink, end, SEL_BLOCK)
    idx = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok = tl.load(sel_base + idx, mask=idx < sel_width, other=2147483647)
    in_bank = (slot + idx * 0) != skip_row  # [BLOCK_T]: a scratch row writes (and loads) nothing
    valid = (idx < sel_width) & (tok >= n_sink) & (tok < end) & in_bank  # the middle's entries
    tok = tl.where(valid, tok, 0)
    rank = n0 + idx - sel_begin
    page = tl.load(block_tables_ptr + row.to(tl.int64) * stride_bt + tok // PAGE_SIZE, mask=valid, other=0)
    rows = k_cache_ptr + page_offset(page, stride_cp, k_host_delta, OFFLOAD) + (tok % PAGE_SIZE) * stride_cs \
        + head * stride_ch
    k1, k2 = load_halves(rows, valid, head_dim, BLOCK_D)
    sin, cos = run_sin_cos(rank - tok, inv_freq_ptr, head_dim, BLOCK_T, BLOCK_D, ROPE_GROUP)
    k = rotate_halves(k1, k2, sin, cos)
    # fp8: each row times its scale after the rotation (scale index from the scale strides: head_dim 1)
    k = dequantize_tile(k, k_scale_ptr, page_offset(page, stride_sp, ks_host_delta, OFFLOAD)
                        + (tok % PAGE_SIZE) * stride_ss + head * stride_sh, valid, 1, KV_SCALED)
    d = tl.arange(0, BLOCK_D)
    dst = slot * stride_bank_slot + idx.to(tl.int64)[:, None] * stride_bank_entry + head * stride_bank_head \
        + d[None, :]
    in_row = valid[:, None] & (d < head_dim)[None, :]
    tl.store(bank_ptr + dst, k.to(bank_ptr.dtype.element_ty), mask=in_row)
    if VALUES:
        v_rows = page_offset(page, stride_cp, v_host_delta, OFFLOAD) + (tok % PAGE_SIZE) * stride_cs + head * stride_ch
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=in_row, other=0.0)
        v = dequantize_tile(v, v_scale_ptr, page_offset(page, stride_sp, vs_host_delta, OFFLOAD)
                            + (tok % PAGE_SIZE) * stride_ss + head * stride_sh, valid, 1, KV_SCALED)
        tl.store(value_bank_ptr + dst, v.to(value_bank_ptr.dtype.element_ty), mask=in_row)


def write_key_bank(kv: PagedKV, block_tables: torch.Tensor, ends: torch.Tensor,
                   selected: torch.Tensor, bank: torch.Tensor, bank_rows: torch.Tensor, *,
                   n_sink: int, inv_freq: torch.Tensor, rope_group: int = 1, skip_row: int | None = None,
                   value_bank: torch.Tensor | None = None) -> None:
    """Rotate the middle entries of each selected row b (int32 [B, K], ascending, PAD-padded; the
    context was ends[b] tokens long) to their StreamingLLM rank into bank[bank_rows[b], i]
    (bank [slots, >= K, Hkv, D], the queries' dtype: the cache's, or any non-fp8 dtype for an fp8
    cache kv, whose row scales then dequantize the keys). rope_group: the selection's run length
    (the last stage's chunk size), as in block_sparse_attention. skip_row: rows b with
    bank_rows[b] == skip_row load and write nothing: requests without a bank row of their own,
    pointed at a scratch row that no step reads (infhip/methods/infinitehip/runtime/mask_cache.py).
    Table entries < 0 name pages of kv's host twin (kv_offload.py).
    value_bank (kv with its values): also copy the same entries' values, as they
    are (dequantized), into value_bank [slots, >= K, Hkv, D] (the key bank's layout), for decode
    attention to read the selected rows from the banks alone (block_sparse_attention)."""
    k_cache, v_cache = kv.k, kv.v
    num_pages, page_size, Hkv, D = k_cache.shape
    B, K = selected.shape
    assert selected.dtype == torch.int32 and selected.stride(1) == 1
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == B and block_tables.stride(1) == 1
    assert ends.shape == (B,) and ends.dtype == torch.int32 and ends.is_contiguous()
    assert bank_rows.shape == (B,) and bank_rows.dtype in (torch.int32, torch.int64)
    scaled = kv.check(values=False)
    assert (bank.dtype == k_cache.dtype if not scaled else not is_fp8(bank)), (
        f"a {bank.dtype} bank for a {k_cache.dtype} cache (the bank holds keys in the queries' dtype)")
    assert bank.dim() == 4 and bank.shape[1] >= K and bank.shape[2:] == (Hkv, D)
    assert bank.stride(3) == 1
    assert inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32
    assert rope_group >= 1 and rope_group & (rope_group - 1) == 0, f"rope_group must be a power of two, got {rope_group}"
    check_rotatable(D)
    values = value_bank is not None
    if values:
        assert v_cache is not None and v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
        kv.check()
        assert value_bank.dtype == bank.dtype and value_bank.shape[1:] == bank.shape[1:] \
            and value_bank.stride() == bank.stride(), "the value bank must be laid out like the key bank"
    if B == 0 or K == 0:
        return
    if not triton_on(k_cache, selected):  # CPU without the interpreter
        write_key_bank_ref(k_cache, block_tables, ends, selected, bank, bank_rows, n_sink=n_sink, inv_freq=inv_freq,
                           skip_row=skip_row, k_scale=kv.k_scale, offload=kv.host, v_cache=v_cache,
                           v_scale=kv.v_scale, value_bank=value_bank)
        return
    dk, dv, dks, dvs = kv.host_deltas(values=values)
    k_scale_ptr, v_scale_ptr = kv.scale_ptrs()
    BLOCK_T = 64
    _write_bank_kernel[(B, triton.cdiv(K, BLOCK_T), Hkv)](
        k_cache, k_scale_ptr, block_tables, ends, selected, bank, bank_rows, inv_freq,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), selected.stride(0), K,
        bank.stride(0), bank.stride(1), bank.stride(2), D, n_sink, -1 if skip_row is None else skip_row,
        *kv.scale_strides(), dk, dks,
        v_cache if values else k_cache, v_scale_ptr if values and scaled else k_cache, value_bank if values else bank,
        dv, dvs,
        PAGE_SIZE=page_size, BLOCK_T=BLOCK_T, BLOCK_D=D, SEL_BLOCK=min(1024, next_pow2(K)),
        ROPE_GROUP=min(rope_group, BLOCK_T), **kv.kernel_flags(), VALUES=values,
        num_warps=4)


def write_key_bank_ref(k_cache, block_tables, ends, selected, bank, bank_rows, *, n_sink: int,
                       inv_freq: torch.Tensor, skip_row: int | None = None, k_scale=None, offload=None,
                       v_cache=None, v_scale=None, value_bank=None) -> None:
    """Reference of write_key_bank: per row (but those pointed at skip_row), the middle entries i
    of the selection, rotated by rank(i) - tok_i in float64, stored in the bank's dtype (an fp8
    cache's rows dequantized to float32 first, k_scale); with value_bank, the same entries' values
    as they are. offload: host twin of the cache; table entries < 0 name its pages (kv_offload.py)."""
    k_cache, v_cache, k_scale, v_scale, block_tables = merged_kv(k_cache, v_cache, k_scale, v_scale, block_tables,
                                                                 offload)
    scaled = check_kv_scales(k_cache, None, k_scale, None)
    page = k_cache.shape[1]
    for b in range(selected.shape[0]):
        if skip_row is not None and int(bank_rows[b]) == skip_row:
            continue
        end, row = int(ends[b]), selected[b].long()
        in_middle = (row >= n_sink) & (row < end)
        idx = in_middle.nonzero()[:, 0]
        if idx.numel() == 0:
            continue
        sel_begin = int((row < n_sink).sum())
        tok = row[idx]
        rank = min(n_sink, end) + idx - sel_begin
        k = read_rows(k_cache, k_scale, block_tables[b, tok // page].long(), tok % page,
                      torch.float32 if scaled else k_cache.dtype)
        bank[int(bank_rows[b]), idx] = rotate_by_ref(k.cpu(), (rank - tok).cpu(), inv_freq.cpu()).to(
            bank.dtype).to(bank.device)
        if value_bank is not None:
            value_bank[int(bank_rows[b]), idx] = read_rows(v_cache, v_scale, block_tables[b, tok // page].long(),
                                                           tok % page, value_bank.dtype)


def aot_launches(space) -> None:
    """The bank writer's variants (plugins/aot.py): for engines whose layers keep a key bank
    (infhip/methods/infinitehip/rules.uses_key_bank), per layer kind (the last stage's k and chunk size),
    without and with a host twin; with one the runtime keeps a value bank beside the keys
    (VALUES). Written at every refresh of the last stage, dynamic RoPE or not; the row count
    only sizes the grid."""
    from ._aot import sparse_space

    ss = sparse_space(space)
    if ss is None or not ss.bank:
        return
    _, Hkv, D = ss.dims
    fake, act = ss.space.fake, ss.space.act_dtype
    for kind in ss.kinds:
        last = kind.stages[-1]
        for offload in ss.offload:
            B = 1
            bank = fake(2, last.k, Hkv, D, dtype=act)
            write_key_bank(ss.kv(offload), ss.tables(B), ss.i32(B), fake(B, last.k, dtype=torch.int32), bank,
                           ss.i64(B), n_sink=ss.cfg.n_sink, inv_freq=ss.inv_freq(), rope_group=last.chunk_size,
                           skip_row=1, value_bank=fake(2, last.k, Hkv, D, dtype=act) if offload else None)


__all__ = ["write_key_bank", "write_key_bank_ref"]
