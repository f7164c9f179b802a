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
strides within a page). Launchers take ``offload: HostKV | None`` and pass the deltas
(:func:`offload_deltas`); kernels that never see an offloaded page are compiled without the
select (``OFFLOAD`` constexpr False). The torch references read a merged copy instead
(:func:`merged_pool`: the host pages appended after the GPU pages, the tables renumbered).

Which pages move, and when, is the runtime's business (runtime/kv_offload.py); this module is
the address arithmetic and the pool itself. Paper 000, "KV Cache Offloading Architecture".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kv_quant import is_fp8, new_kv_scales


def host_page(page: int) -> int:
    """Index in the host twin of a block-table entry < 0 (and back: the map is its own inverse).

        >>> host_page(-1), host_page(-8), host_page(host_page(5))
        (0, 7, 5)
    """
    return -1 - page


def _pin(t: torch.Tensor) -> torch.Tensor:
    """Pinned (page-locked, device-mapped) when a GPU exists; a plain CPU tensor otherwise (CPU
    tests and the interpreter read host pages through ordinary pointers)."""
    return t.pin_memory() if torch.cuda.is_available() else t


@dataclass
class HostKV:
    """The host twin of one layer's paged K/V cache (same dtype and per-page layout); fp8 caches
    also keep their row scales here."""

    k: torch.Tensor  # [num_host_pages, page_size, Hkv, D], pinned
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_host_pages, page_size, Hkv] float32 (fp8 caches)
    v_scale: torch.Tensor | None = None

    @classmethod
    def like(cls, k_cache: torch.Tensor, num_pages: int) -> "HostKV":
        """A zeroed host twin of ``num_pages`` pages for a GPU cache shaped like ``k_cache``.
        Pinned memory is allocated page-locked up front (never managed memory: SPEC §7)."""
        if num_pages < 1:
            raise ValueError(f"a host KV pool needs at least one page, got {num_pages}")
        shape = (num_pages, *k_cache.shape[1:])
        k = _pin(torch.zeros(shape, dtype=k_cache.dtype))
        v = _pin(torch.zeros(shape, dtype=k_cache.dtype))
        ks = vs = None
        if is_fp8(k_cache):
            ks, vs = _pin(new_kv_scales(k)), _pin(new_kv_scales(v))
        return cls(k, v, ks, vs)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    def page_bytes(self) -> int:
        """Host bytes of one page of K and V (and their scales)."""
        per = self.k[0].numel() * self.k.element_size()
        scales = self.k_scale[0].numel() * 4 if self.k_scale is not None else 0
        return 2 * (per + scales)

    def check(self, k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> None:
        """Raise unless this twin matches the GPU cache (dtype, per-page layout, scales)."""
        for name, host in (("k", self.k), ("v", self.v)):
            if host.dtype != k_cache.dtype or host.shape[1:] != k_cache.shape[1:] \
                    or host.stride() != k_cache.stride():
                raise ValueError(f"host {name} pool {host.dtype} {tuple(host.shape)} strides {host.stride()} "
                                 f"does not match the cache {k_cache.dtype} {tuple(k_cache.shape)} "
                                 f"strides {k_cache.stride()} (same dtype and page layout needed)")
            if host.device.type != "cpu":
                raise ValueError(f"host {name} pool must be a (pinned) CPU tensor, got {host.device}")
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
    if torch.cuda.is_available() and k_cache.is_cuda and not offload.k.is_pinned():
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


__all__ = ["HostKV", "host_page", "offload_deltas", "page_offset", "merged_pool", "merged_kv"]
