"""Un-rotated keys for dynamic-RoPE pruning in prefill: each key moved back to position 0, once.

The KV cache holds keys rotated at their own positions, k_c = R(p) k. The dynamic RoPE styles of
pruning (rope_styles.py) score a key at a *style* position c instead: q' . R(c - p) k_c = q' . R(c) k.
Re-rotating every loaded key inside SelectRep costs a float64 angle reduction and a sine/cosine
per element, and in prefill every query block re-loads the same keys (512 blocks per 32K chunk):
at 1M keys that rotation work is most of the stage. So a prefill step first writes k = R(-p) k_c
of every token of each sequence once (this module, one pass over the keys), and then

    RELATIVE       needs no key rotation at all: the left branch (key at 0) scores q at n_stream + 1,
                   the right branch (key at 1) scores R(-1) of it = q at n_stream — two query tiles
    CHUNK_INDEXED  rotates a key by its chunk index c: sin/cos per chunk, computed once per tile

Layout: keys [N, Hkv, D] in the cache dtype (one rounding, like the bf16 cast before the dot) or,
for an fp8 cache (kv_quant.py), in the given compute dtype (the queries'): rows are dequantized
(times their scales, after the rotation) on the way, so pruning never sees fp8 here;
sequence s at rows [base_s, base_s + len_s) in token order (no page table); block_base int64 [NB]
is the base of each query block's sequence. Decode does not use it (one query: the in-kernel
rotation of the few keys it loads is cheaper than a pass over all of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._triton_utils import next_pow2, triton_on
from ..kv_offload import merged_kv, page_offset
from ..kv_quant import dequantize_tile, is_fp8, read_rows
from ..paged_kv import PagedKV
from .rope_styles import check_rotatable, load_rotated, rotate_by_ref


@dataclass(frozen=True)
class RawKeys:
    """Keys at position 0 in token order: keys [N, Hkv, D]; block_base int64 [NB] (row of token 0
    of each query block's sequence)."""

    keys: torch.Tensor
    block_base: torch.Tensor


# Not specialized (plugins/aot.py): the sequence's length, the host deltas (int64 always) and the
# alignment of its page-table row (a row of the step's [S, width] tables: 16-byte aligned or not
# with the row index and width); the table is read by gathered page index, not vectorized.
@triton.jit(do_not_specialize=["length", "k_host_delta", "ks_host_delta"], do_not_specialize_on_alignment=["table_ptr"])
def _unrotate_kernel(
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    k_scale_ptr,  # KV_SCALED: [num_pages, page_size, Hkv] float32 row scales
    table_ptr,  # [max_pages] int32, one sequence
    inv_freq_ptr,  # [D/2] float32
    out_ptr,  # [len, Hkv, D] this sequence's rows of RawKeys.keys
    length, head_dim,
    stride_cp, stride_cs, stride_ch, stride_ot, stride_oh,
    stride_sp, stride_ss, stride_sh,  # KV_SCALED: the scale tensor's strides
    k_host_delta: tl.int64, ks_host_delta: tl.int64,  # OFFLOAD: elements from k_cache / k_scale to their host twins
    PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, KV_SCALED: tl.constexpr,
    OFFLOAD: tl.constexpr,  # table entries < 0 name host pages (kv_offload.py)
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    valid = tok < length
    page = tl.load(table_ptr + tok // PAGE_SIZE, mask=valid, other=0)
    rows = k_cache_ptr + page_offset(page, stride_cp, k_host_delta, OFFLOAD) + (tok % PAGE_SIZE) * stride_cs \
        + head * stride_ch
    k = load_rotated(rows, valid, -tok, inv_freq_ptr, head_dim, BLOCK_D, True)
    # fp8: each row times its scale after the rotation (scale index from the scale strides: head_dim 1)
    k = dequantize_tile(k, k_scale_ptr, page_offset(page, stride_sp, ks_host_delta, OFFLOAD)
                        + (tok % PAGE_SIZE) * stride_ss + head * stride_sh, valid, 1, KV_SCALED)
    d = tl.arange(0, BLOCK_D)
    out = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out, k.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (d < head_dim)[None, :])


def unrotate_keys(kv: PagedKV, seq_tables: torch.Tensor, seq_lens: list[int],
                  inv_freq: torch.Tensor, block_seq: torch.Tensor, *, dtype: torch.dtype | None = None) -> RawKeys:
    """RawKeys of S sequences: seq_tables int32 [S, max_pages] (their page tables), seq_lens the
    tokens to un-rotate of each (host ints, an upper bound is fine: rows past a sequence's end are
    never read), block_seq int64 [NB] the sequence (0..S-1) of each query block. kv: the layer's
    cache, keys only read (an fp8 one dequantized with its row scales, kv_quant.py; table entries
    < 0 name pages of its host twin, kv_offload.py); dtype: RawKeys.keys' dtype, the queries'
    (default: the cache's; required for an fp8 cache, and never fp8)."""
    k_cache, k_scale = kv.k, kv.k_scale
    num_pages, page_size, Hkv, D = k_cache.shape
    scaled = kv.check(values=False)
    if dtype is None:
        assert not scaled, "unrotate_keys of an fp8 cache needs dtype= (the queries' dtype)"
        dtype = k_cache.dtype
    assert not is_fp8(dtype), "RawKeys hold dequantized keys: dtype must not be fp8"
    assert seq_tables.dtype == torch.int32 and seq_tables.shape[0] == len(seq_lens) and seq_tables.stride(1) == 1
    assert inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32
    check_rotatable(D)
    assert max(seq_lens, default=0) <= seq_tables.shape[1] * page_size, "a sequence is longer than its page table"
    bases = [0]
    for n in seq_lens:
        bases.append(bases[-1] + n)
    keys = torch.empty((bases[-1], Hkv, D), dtype=dtype, device=k_cache.device)
    base_t = torch.tensor(bases[:-1], dtype=torch.int64, device=k_cache.device)
    raw = RawKeys(keys, base_t[block_seq] if block_seq.numel() else block_seq.to(torch.int64))
    on_triton = triton_on(k_cache)
    if on_triton:
        dk, _, dks, _ = kv.host_deltas(values=False)
    else:  # the torch path below reads host pages from a merged pool
        k_cache, _, k_scale, _, seq_tables = merged_kv(k_cache, None, k_scale, None, seq_tables, kv.host)
    for s, n in enumerate(seq_lens):
        if n == 0:
            continue
        out = keys[bases[s]:bases[s] + n]
        if not on_triton:  # CPU without the interpreter
            toks = torch.arange(n, device=k_cache.device)
            stored = read_rows(k_cache, k_scale, seq_tables[s, toks // page_size].long(), toks % page_size,
                               torch.float32 if scaled else k_cache.dtype)
            out.copy_(rotate_by_ref(stored, -toks, inv_freq).to(out.dtype))
            continue
        BLOCK_T = 64
        _unrotate_kernel[(triton.cdiv(n, BLOCK_T), Hkv)](
            k_cache, kv.scale_ptrs()[0], seq_tables[s], inv_freq, out, n, D,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
            *kv.scale_strides(), dk, dks,
            PAGE_SIZE=page_size, BLOCK_T=BLOCK_T, BLOCK_D=max(16, next_pow2(D)), **kv.kernel_flags())
    return raw


def aot_launches(space) -> None:
    """The un-rotation pass's variants (plugins/aot.py): prefill steps under dynamic RoPE prune
    from raw keys (infhip/methods/infinitehip/runtime/planner.py, RAW_KEYS_MIN_BLOCKS or offloading) in layers
    whose pruning style is dynamic; without and with a host twin. One launch per sequence, its
    length unspecialized."""
    from ._aot import sparse_space

    ss = sparse_space(space)
    if ss is None or not any(m.dynamic for m in ss.modes) or all(k.pruning_rope == "none" for k in ss.kinds):
        return
    for offload in ss.offload:
        unrotate_keys(ss.kv(offload), ss.tables(1), [ss.space.build.page_size], ss.inv_freq(), ss.i64(1),
                      dtype=ss.space.act_dtype)


__all__ = ["RawKeys", "unrotate_keys"]
