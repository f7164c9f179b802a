"""Tensors shaped as the runtime hands them to the dense-family plugins, for their ``aot_launches``.

Only what Triton specializes on matters for a variant (plugins/aot.py): dtypes, constexprs,
integers == 1 or divisible by 16, pointers 16-byte aligned or not. The helpers below rebuild the
runtime's tensors, views included, on the meta device (runtime/models/common.py: q, k and v are
slices of the fused qkv projection output, or the fresh outputs of the q/k norms), so strides and
start offsets come out exactly as on the GPU.

Token counts: no dense-family kernel takes the token count as an argument (it is a grid
dimension), but it still shapes the views: with T == 1 a slice of qkv is already "contiguous"
(``.contiguous()`` returns the view itself, at its offset into qkv) and its row stride is
recomputed by ``view``; for T >= 2 it is the qkv row width. TOKEN_CLASSES holds one T of each
class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

TOKEN_CLASSES = (1, 2)


def qkv_views(space, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D]: the views Attention.forward slices from qkv [T, (Hq + 2 Hkv) D]."""
    m = space.model
    qkv = space.fake(T, m.q_size + 2 * m.kv_size, dtype=space.act_dtype)
    q = qkv[:, :m.q_size].view(T, m.num_heads, m.head_dim)
    k = qkv[:, m.q_size:m.q_size + m.kv_size].view(T, m.num_kv_heads, m.head_dim)
    v = qkv[:, m.q_size + m.kv_size:].view(T, m.num_kv_heads, m.head_dim)
    return q, k, v


def attention_qkv(space, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as RoPE and attention receive them: with q/k norm (Qwen3, Gemma-3) q and k are the
    norms' fresh contiguous outputs, v stays a view of qkv."""
    q, k, v = qkv_views(space, T)
    if space.model.qk_norm:
        q = space.fake(*q.shape, dtype=q.dtype)
        k = space.fake(*k.shape, dtype=k.dtype)
    return q, k, v


def paged_kv(space, num_pages: int = 4, offload: bool = False):
    """One layer's PagedKV (plugins/paged_kv.py): k, v [num_pages, page_size, Hkv, D] in the KV
    dtype, for fp8 caches their float32 scales [num_pages, page_size, Hkv], and with offload a
    host twin of the same layout. The page count changes no stride."""
    from .host_kv import HostKV
    from .paged_kv import PagedKV

    m, page = space.model, space.build.page_size
    shape, scale = (num_pages, page, m.num_kv_heads, m.head_dim), (num_pages, page, m.num_kv_heads)
    fp8 = space.build.kv_dtype == "fp8"

    def caches():
        k, v = space.fake(*shape, dtype=space.kv_dtype), space.fake(*shape, dtype=space.kv_dtype)
        if not fp8:
            return k, v, None, None
        return k, v, space.fake(*scale, dtype=torch.float32), space.fake(*scale, dtype=torch.float32)

    return PagedKV(*caches(), host=HostKV(*caches()) if offload else None)


def representatives(lo: int, hi: int, key: Callable[[int], object]) -> list[int]:
    """The first v in [lo, hi] of each distinct ``key(v)``, for a key constant on intervals (a
    monotone choice such as a tile or split count): one launch per class of a run-time quantity
    whose only effect on the variant is ``key``. Bisection: O(classes x log(hi - lo)) keys.

        >>> representatives(1, 100, lambda n: min(n // 10, 3))
        [1, 10, 20, 30]
    """
    out, v = [], lo
    while v <= hi:
        k = key(v)
        out.append(v)
        a, b = v, hi + 1  # key(a) == k; the next class starts in (a, b]
        while b - a > 1:
            m = (a + b) // 2
            a, b = (m, b) if key(m) == k else (a, m)
        v = b
    return out


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer as the runtime calls it: weight [n, k], a bias or not, at most max_rows
    rows per call, stored in fp8 or in the build dtype."""

    name: str  # module path suffix ("qkv_proj", ...) or "lm_head"
    n: int
    k: int
    bias: bool
    max_rows: int
    fp8: bool


def linear_layers(space) -> list[LinearLayer]:
    """The decoder's qkv, o, gate_up and down projections (up to one step's token budget of rows)
    and the LM head (tied or not; up to max_batch_size sampled rows), each marked fp8 when the
    engine stores it so (EngineConfig.fp8_linears)."""
    m, b = space.model, space.build
    fp8 = {name.rsplit(".", 1)[-1] for name in space.config.fp8_linears()}
    decoder = [("qkv_proj", m.q_size + 2 * m.kv_size, m.hidden_size, m.attention_bias),
               ("o_proj", m.hidden_size, m.q_size, False),
               ("gate_up_proj", 2 * m.intermediate_size, m.hidden_size, False),
               ("down_proj", m.hidden_size, m.intermediate_size, False)]
    layers = [LinearLayer(name, n, k, bias, b.max_num_batched_tokens, name in fp8) for name, n, k, bias in decoder]
    return layers + [LinearLayer("lm_head", m.vocab_size, m.hidden_size, False, b.max_batch_size, "lm_head" in fp8)]
