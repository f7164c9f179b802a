"""PagedKV: one attention layer's paged KV cache, the one cache argument of every plugin launcher
that reads or writes pages (dense attention, RoPE + KV write, InfiniteHiP pruning, key bank,
raw keys and block-sparse attention, page copies).

Shapes: k, v [num_pages, page_size, Hkv, D] in the cache dtype (page 0 is the null page, see
runtime/kv_cache.py); an fp8 cache (kv_quant.py) carries float32 row scales k_scale, v_scale
[num_pages, page_size, Hkv]; an offloaded cache its pinned host twin ``host`` (kv_offload.py:
block-table entries < 0 name host pages). The runtime allocates one per layer at load
(runtime/kv_budget.allocate_layers); nothing else creates or resizes them. Tests and the AOT
enumeration wrap their own tensors in one (``v`` None: a key-only cache for the launchers that
read keys only).

What a kernel needs from it comes from here, in one place: ``kernel_flags`` (the KV_SCALED /
OFFLOAD constexprs), ``scale_ptrs`` / ``scale_strides`` (the fp8 scales, or dummies never read)
and ``host_deltas`` (element offsets to the host twin).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .host_kv import HostKV, offload_deltas
from .kv_quant import check_kv_scales, is_fp8, new_kv_scales


@dataclass
class PagedKV:
    k: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v: torch.Tensor | None  # the same layout; None only for key-only launches (tests)
    k_scale: torch.Tensor | None = None  # [num_pages, page_size, Hkv] float32, fp8 caches only
    v_scale: torch.Tensor | None = None
    host: HostKV | None = None  # the host twin of an offloaded cache (or a staged GPU copy of it)

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, host_pages: int = 0) -> "PagedKV":
        """Zeroed pages (+ scales for an fp8 dtype, + a host twin of host_pages pages if > 0)."""
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k, v, new_kv_scales(k), new_kv_scales(v), HostKV.like(k, host_pages) if host_pages else None)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes of one token of one layer (+ the fp8 row scales)."""
        return 2 * num_kv_heads * (head_dim * dtype.itemsize + (4 if is_fp8(dtype) else 0))

    def with_host(self, host: HostKV | None) -> "PagedKV":
        """The same pages read through another twin (runtime/offload/staging.py: a GPU copy of the
        step's host pages)."""
        return dataclasses.replace(self, host=host)

    # -- what a launcher hands its kernel -------------------------------------------------------
    def check(self, values: bool = True) -> bool:
        """Validate the caches and their scales (kv_quant.check_kv_scales; values=False: K only);
        True when the cache is fp8."""
        return check_kv_scales(self.k, self.v if values else None, self.k_scale, self.v_scale if values else None)

    def kernel_flags(self, *, host: bool = True, reads_pages: bool = True) -> dict[str, bool]:
        """The constexprs of a kernel that reads or writes these pages: KV_SCALED (fp8 rows,
        dequantized / quantized with their scales) and, for kernels that follow table entries < 0
        (host=True), OFFLOAD. reads_pages=False (a launch that reads no page, e.g. SelectRep over
        raw keys): both False."""
        flags = {"KV_SCALED": reads_pages and is_fp8(self.k)}
        if host:
            flags["OFFLOAD"] = reads_pages and self.host is not None
        return flags

    def scale_ptrs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale) for the kernel's scale pointers; without fp8, the caches themselves
        (dummies never read: KV_SCALED is False)."""
        v = self.v if self.v is not None else self.k
        return (self.k_scale if self.k_scale is not None else self.k,
                self.v_scale if self.v_scale is not None else v)

    def scale_strides(self) -> tuple[int, int, int]:
        """The scales' strides (page, slot, head); zeros without fp8."""
        return self.k_scale.stride() if self.k_scale is not None else (0, 0, 0)

    def host_deltas(self, values: bool = True) -> tuple[int, int, int, int]:
        """(k, v, k_scale, v_scale) element offsets to the host twin (host_kv.offload_deltas);
        zeros without one, and for V with values=False."""
        v = self.v if values else None
        return offload_deltas(self.k, v, self.k_scale, self.v_scale if values else None, self.host)


__all__ = ["PagedKV"]
