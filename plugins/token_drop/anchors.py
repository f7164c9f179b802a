"""The shared kernels as token drop's anchors call them, for the AOT enumeration (plugins/aot.py).

At a drop layer (infhip/methods/token_drop/runtime/step.py) token drop does not call the fused
RoPE + KV write of every attention layer (plugins/rope.py ``rope_and_write_kv``, which rope's own
``aot_launches`` enumerates): it rotates q and k of all current rows separately
(``apply_rope_``), then writes K/V of all rows or of the kept rows only (``write_kv``; kept rows
are fresh ``[n, Hkv, D]`` gathers). Those launches are token drop's, so they are enumerated here,
from its method's ``plugin_modules``, and plugins/rope.py names no method. No kernel of its own.
"""

from __future__ import annotations

import torch

from .._aot_shapes import TOKEN_CLASSES, attention_qkv, paged_kv
from ..rope import apply_rope_, write_kv


def aot_launches(space) -> None:
    """With token drop in the plan: per token class, on q, k, v shaped as Attention.forward makes
    them (plugins/_aot_shapes.py), the separate rotation (attention_scaling a float: never
    specialized), the KV write of all rows and of kept rows; positions and slots int64."""
    if space.plan.knobs_of("token_drop") is None:
        return
    m = space.model
    kv = paged_kv(space)
    inv_freq = space.fake(m.head_dim // 2, dtype=torch.float32)
    for T in TOKEN_CLASSES:
        q, k, v = attention_qkv(space, T)
        positions = space.fake(T, dtype=torch.int64)
        slots = space.fake(T, dtype=torch.int64)
        apply_rope_(q, k, positions, inv_freq, 1.0)
        write_kv(k, v, kv, slots)
        kept_k = space.fake(T, m.num_kv_heads, m.head_dim, dtype=k.dtype)
        kept_v = space.fake(T, m.num_kv_heads, m.head_dim, dtype=v.dtype)
        write_kv(kept_k, kept_v, kv, slots)
