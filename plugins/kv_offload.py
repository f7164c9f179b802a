"""KV offloading: pages of a paged KV cache that live in pinned host memory, read in place.

A paged cache keeps its pages on the GPU, ``k_cache [num_pages, page_size, Hkv, D]``. With
offloading, a layer also has a *host twin* (:class:`HostKV`): the same page layout in pinned,
device-mapped host memory, ``[num_host_pages, page_size, Hkv, D]``, plus the fp8 row scales when
the cache is fp8 (kv_quant.py). A block-table entry names either pool:

    page >= 0   page ``page`` of the GPU cache
    page <  0   page ``-1 - page`` of the host twin                          (host_page(page))

Kernels read host pages *in place* (zero-copy over PCIe, SPEC §7: ~51 GB/s from a Triton kernel),
so a step that touches offloaded pages needs no copy and stays CUDA-graph capturable: the pools
never move, so every address is fixed. Under unified virtual addressing a pinned host tensor has
one address on host and device, so a kernel reaches the host twin from the GPU cache's pointer
by an element offset, ``host_delta = (host.data_ptr() - cache.data_ptr()) / itemsize``: the row
at (page, slot, head) is at

    page_offset(page, stride_page, host_delta) + slot * stride_slot + head * stride_head

from the cache's pointer, for pages of either pool (:func:`page_offset`; both pools have the same
strides within a page). Launchers take the layer's PagedKV (paged_kv.py), whose ``host`` is the
twin, and pass the deltas (:func:`offload_deltas`, through ``PagedKV.host_deltas``); kernels
that never see an offloaded page are compiled without the select (``OFFLOAD`` constexpr False).
The torch references read a merged copy instead (:func:`merged_pool`: the host pages appended
after the GPU pages, the tables renumbered).

Which pages move, and when, is the runtime's business (runtime/kv_cache.py KVCacheManager.offload,
runtime/offload/policy.py PageMover, which calls copy_pages); this module is the kernels' address
arithmetic and the page copies, host_kv.py the pool itself (HostKV, offload_deltas). Paper 000,
"KV Cache Offloading Architecture".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ._triton_utils import triton_on
# the pool and its deltas live in host_kv.py (paged_kv.py carries a twin); re-exported here, where
# the offload's users have always found them
from .host_kv import HostKV, host_page, offload_deltas

if TYPE_CHECKING:  # annotations only: copy_pages takes a layer's PagedKV
    from .paged_kv import PagedKV


@triton.jit
def page_offset(page, stride_page, host_delta, OFFLOAD: tl.constexpr):
    """Element offset (int64) of page ``page``'s first row from the GPU pool's pointer: page >= 0
    in the GPU pool, page < 0 at host index -1 - page in the host twin (host_delta elements away,
    offload_deltas). Without OFFLOAD every page is a GPU page."""
    if OFFLOAD:
        on_host = page < 0
        index = tl.where(on_host, -1 - page, page).to(tl.int64)
        return index * stride_page + tl.where(on_host, host_delta, 0).to(tl.int64)
    return page.to(tl.int64) * stride_page


# host_delta not specialized (plugins/aot.py): int64 always, any value (address arithmetic only)
@triton.jit(do_not_specialize=["host_delta"])
def _copy_pages_kernel(ptr, src_ptr, dst_ptr, host_delta: tl.int64, stride_page, page_elems, BLOCK: tl.constexpr):
    """Program (i, j): elements [j * BLOCK, (j + 1) * BLOCK) of page src[i] -> page dst[i]
    (block-table entries of either pool)."""
    i = tl.program_id(0)
    src = page_offset(tl.load(src_ptr + i), stride_page, host_delta, True)
    dst = page_offset(tl.load(dst_ptr + i), stride_page, host_delta, True)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < page_elems
    tl.store(ptr + dst + idx, tl.load(ptr + src + idx, mask=mask), mask=mask)


def copy_pages(kv: PagedKV, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages src[i] -> dst[i] (int32 [N] block-table entries: >= 0 GPU, < 0 host) of K,
    V and an fp8 cache's scales between kv's GPU pages and its host twin; e.g. GPU pages to the
    host when they are offloaded. On a GPU the kernel writes the pinned pages directly (no
    staging), in stream order: a GPU page freed after this call may be reused by any later
    kernel."""
    assert src.shape == dst.shape and src.dtype == dst.dtype == torch.int32
    assert kv.host is not None, "copy_pages needs a cache with a host twin"
    if src.numel() == 0:
        return
    k_cache, v_cache, k_scale, v_scale, offload = kv.k, kv.v, kv.k_scale, kv.v_scale, kv.host
    pairs = [(k_cache, offload.k), (v_cache, offload.v)]
    if k_scale is not None:
        pairs += [(k_scale, offload.k_scale), (v_scale, offload.v_scale)]
    if not triton_on(k_cache):  # CPU without the interpreter
        offload.check(k_cache, k_scale)
        for cache, host in pairs:
            rows = [(host[host_page(p)] if p < 0 else cache[p]).clone() for p in src.tolist()]
            for p, row in zip(dst.tolist(), rows):
                (host[host_page(p)] if p < 0 else cache[p]).copy_(row)
        return
    deltas = kv.host_deltas()
    for (cache, _), delta in zip(pairs, deltas):
        assert cache.is_contiguous()
        page_elems = cache[0].numel()
        BLOCK = 4096
        _copy_pages_kernel[(src.numel(), triton.cdiv(page_elems, BLOCK))](
            cache, src, dst, delta, cache.stride(0), page_elems, BLOCK=BLOCK)


# ------------------------------------------------------------------------------------ torch

def merged_pool(cache: torch.Tensor, host: torch.Tensor | None,
                block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the torch references: (pool, tables) where pool holds the GPU pages then the host
    pages (copied to the cache's device) and the tables name host page h as len(cache) + h.
    Without a host pool (or no entry < 0) both come back unchanged."""
    if host is None or not bool((block_tables < 0).any()):
        return cache, block_tables
    pool = torch.cat([cache, host.to(cache.device)])
    tables = torch.where(block_tables < 0, cache.shape[0] - 1 - block_tables, block_tables)
    return pool, tables.to(block_tables.dtype)


def merged_kv(k_cache, v_cache, k_scale, v_scale, block_tables, offload: HostKV | None):
    """merged_pool for every tensor a reference reads: (k, v, k_scale, v_scale, tables); v_cache
    may be None (key-only readers)."""
    if offload is None:
        return k_cache, v_cache, k_scale, v_scale, block_tables
    k, tables = merged_pool(k_cache, offload.k, block_tables)
    v = None if v_cache is None else merged_pool(v_cache, offload.v, block_tables)[0]
    ks = None if k_scale is None else merged_pool(k_scale, offload.k_scale, block_tables)[0]
    vs = None if v_scale is None or v_cache is None else merged_pool(v_scale, offload.v_scale, block_tables)[0]
    return k, v, ks, vs, tables


def aot_launches(space) -> None:
    """copy_pages' variants (plugins/aot.py) for an engine that may be loaded with
    ``kv_offload_bytes`` and move pages (a method of its plan says so: ``space.moves_pages``): K
    and V pages in the cache dtype and, for fp8 caches, their float32 scale pages. The page
    counts only size the grid."""
    from ._aot_shapes import paged_kv

    if not space.moves_pages:
        return
    copy_pages(paged_kv(space, offload=True), space.fake(1, dtype=torch.int32), space.fake(1, dtype=torch.int32))


__all__ = ["HostKV", "host_page", "offload_deltas", "page_offset", "copy_pages", "merged_pool",
           "merged_kv"]
