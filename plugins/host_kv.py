"""The host twin of a paged KV cache (:class:`HostKV`) and its address deltas: the pool and the
arithmetic, no kernels. kv_offload.py's module docstring describes the layout (page >= 0: the GPU
cache, page < 0: page ``host_page(page)`` of the twin) and holds the kernels that read and copy
host pages. Its own module so that paged_kv.py (which carries a twin) and kv_offload.py (whose
kernels take a PagedKV) both import it without importing each other both ways.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .kv_quant import is_fp8


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
    copies of some host pages serves as a twin too (runtime/offload/staging.py: staged prefill)."""

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


__all__ = ["HostKV", "host_page", "pinned_empty", "offload_deltas"]
