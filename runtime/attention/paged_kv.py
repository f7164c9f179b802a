"""PagedKV: one attention layer's paged KV cache, the one object every attention backend reads.

Shapes: k, v [num_pages, page_size, Hkv, D] in the cache dtype (page 0 is the null page, see
runtime/kv_cache.py); an fp8 cache (plugins/kv_quant.py) carries float32 row scales k_scale,
v_scale [num_pages, page_size, Hkv]; an offloaded cache its pinned host twin `host`
(plugins/kv_offload.py: block-table entries < 0 name host pages). The runner allocates one per
layer at load (ModelRunner); nothing else creates or resizes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infhip.plugins.kv_offload import HostKV
from infhip.plugins.kv_quant import is_fp8, new_kv_scales


@dataclass
class PagedKV:
    k: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_pages, page_size, Hkv] float32, fp8 caches only
    v_scale: torch.Tensor | None = None
    host: HostKV | None = None  # the host twin of an offloaded cache

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

    @property
    def scales(self) -> dict:
        """The fp8 scales as the plugins' keyword arguments (both None unless fp8)."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}
