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
runtime/offload/policy.py PageMover, which calls copy_pages); this module is
the address arithmetic and the pool itself. Paper 000, "KV Cache Offloading Architecture".
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ._triton_utils import triton_on
from .kv_quant import is_fp8

if TYPE_CHECKING:  # paged_kv imports this module
    from .paged_kv import PagedKV


def host_page(page: int) -> int:
    """Index in the host twin of a block-table entry < 0 (and back: the map is its own inverse).

        >>> host_page(-1), host_page(-8), host_page(host_page(5))
        (0, 7, 5)
    """
    return -1 - page


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, page-locked with cudaHostRegister (mapped: under UVA its
    address is valid on the GPU), unregistered when the tensor is freed. Not
    ``torch.empty(pin_memory=True)``: torch's caching host allocator rounds every block up to a
    power of two, so a 17 GiB pool would pin 32 GiB."""
    t = torch.empty(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise MemoryError(f"cudaHostRegister of {t.numel() * t.element_size() / 2**30:.2f} GiB failed "
                           f"(error {int(err)}): not enough lockable host memory for the KV offload pool")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


@dataclass
class HostKV:
    """The host twin of one layer's paged K/V cache (same dtype and per-page layout); fp8 caches
    also keep their row scales here. Kernels need only the twin's address, so a GPU buffer with
    copies of some host pages serves as a twin too (runtime/offload_staging.py: staged prefill)."""

    k: torch.Tensor  # [num_host_pages, page_size, Hkv, D], pinned
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_host_pages, page_size, Hkv] float32 (fp8 caches)
    v_scale: torch.Tensor | None = None

    @classmethod
    def like(cls, k_cache: torch.Tensor, num_pages: int) -> "HostKV":
        """A host twin of ``num_pages`` pages for a GPU cache shaped like ``k_cache``, allocated
        page-locked up front when a GPU exists (never managed memory: SPEC §7). Not initialised:
        a host page is written (copy_pages) before any table names it."""
        if num_pages < 1:
            raise ValueError(f"a host KV pool needs at least one page, got {num_pages}")
        shape = (num_pages, *k_cache.shape[1:])
        new = pinned_empty if torch.cuda.is_available() else torch.empty
        k, v = new(shape, dtype=k_cache.dtype), new(shape, dtype=k_cache.dtype)
        ks = vs = None
        if is_fp8(k_cache):
            ks, vs = new(shape[:3], dtype=torch.float32), new(shape[:3], dtype=torch.float32)
        return cls(k, v, ks, vs)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    def check(self, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> None:
        """Raise unless this twin matches the GPU cache (dtype, per-page layout, scales)."""
        for name, host in (("k", self.k), ("v", self.v)):
            if host.dtype != k_cache.dtype or host.shape[1:] != k_cache.shape[1:] \
                    or host.stride() != k_cache.stride():
                raise ValueError(f"host {name} pool {host.dtype} {tuple(host.shape)} strides {host.stride()} "
                                 f"does not match the cache {k_cache.dtype} {tuple(k_cache.shape)} "
                                 f"strides {k_cache.stride()} (same dtype and page layout needed)")
            if host.device.type != "cpu" and host.device != k_cache.device:
                raise ValueError(f"host {name} pool must be a (pinned) CPU tensor or a staging copy on the "
                                 f"cache's device {k_cache.device}, got {host.device}")
        if (k_scale is None) != (self.k_scale is None):
            raise ValueError("an fp8 cache's host twin needs its row scales, a non-fp8 one none")


def _delta(cache: torch.Tensor, host: torch.Tensor) -> int:
    """Elements from cache's first element to host's (exact: both are aligned allocations)."""
    nbytes = host.data_ptr() - cache.data_ptr()
    size = cache.element_size()
    assert nbytes % size == 0, f"pools not aligned to their {size}-byte elements"
    return nbytes // size


def offload_deltas(k_cache: torch.Tensor, v_cache: torch.Tensor | None, k_scale: torch.Tensor | None,
                   v_scale: torch.Tensor | None, offload: HostKV | None) -> tuple[int, int, int, int]:
    """(k, v, k_scale, v_scale) element offsets from each GPU tensor to its host twin, for the
    kernels' page_offset; zeros without offloading (and for absent tensors)."""
    if offload is None:
        return 0, 0, 0, 0
    offload.check(k_cache, k_scale)
    if k_cache.is_cuda and offload.k.device.type == "cpu" and not offload.k.is_pinned():
        raise ValueError("the host KV pool must be pinned memory for the GPU to read it")
    return (_delta(k_cache, offload.k), 0 if v_cache is None else _delta(v_cache, offload.v),
            0 if k_scale is None else _delta(k_scale, offload.k_scale),
            0 if v_scale is None or v_cache is None else _delta(v_scale, offload.v_scale))


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
    """copy_pages' variants (plugins/aot.py): every InfiniteHiP engine may be loaded with
    ``kv_offload_bytes`` (runtime/model_runner.py moves pages to the host twin): K and V pages in the cache dtype and,
    for fp8 caches, their float32 scale pages. The page counts only size the grid."""
    from ._aot_shapes import paged_kv
    from .infinitehip._aot import sparse_space

    if sparse_space(space) is None:
        return
    copy_pages(paged_kv(space, offload=True), space.fake(1, dtype=torch.int32), space.fake(1, dtype=torch.int32))


__all__ = ["HostKV", "host_page", "offload_deltas", "page_offset", "copy_pages", "merged_pool",
           "merged_kv"]
