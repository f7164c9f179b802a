"""Rotary position embedding (neox / Hugging Face Llama "rotate half" style), fused
with the write of the new keys and values into the paged KV cache.

For a head vector x of width D (half = D/2) at position p, with j < half:

    angle[j] = float32(p) * inv_freq[j]               (float32 product, as HF)
    cos[j]   = cos(angle[j]) * attention_scaling,  sin[j] likewise
    out[:half] = x[:half] * cos - x[half:] * sin
    out[half:] = x[half:] * cos + x[:half] * sin

which is HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin) with
rotate_half(x) = cat(-x[half:], x[:half]). Math in float32, stored in x.dtype.

KV write: token t goes to flat slot s = slot_mapping[t] of the layer's cache (a PagedKV,
paged_kv.py: [num_pages, page_size, Hkv, D]), i.e. page s // page_size, row s % page_size;
s < 0 means "skip" (padding). The cache dtype may differ (cast on store). An fp8 cache
(float8_e4m3fn, with k_scale / v_scale [num_pages, page_size, Hkv] float32 beside it) gets each
row quantized as plugins/kv_quant.py describes: the stored k row is the rotated key, in k's
dtype, divided by its own scale (amax / 448).

Accuracy note: angles reach ~1e5 rad at 128K context; GPU sin/cos may use fast
approximations that are only accurate near [-pi, pi], so the kernel reduces the
float32 angle modulo 2*pi in float64 first (cheap: D/2 values per token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton
from .kv_quant import _round_to_e4m3, check_kv_scales, write_rows
from .paged_kv import PagedKV


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin, half_dim,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the [num_heads, D] rows at x_ptr in place; returns the rotated halves."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half_dim)
    ptr1 = x_ptr + heads * stride_h + cols  # [BLOCK_H, BLOCK_HALF] first halves
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + half_dim, mask=mask, other=0.0)
    y1 = (x1.to(tl.float32) * cos - x2.to(tl.float32) * sin).to(x1.dtype)
    y2 = (x2.to(tl.float32) * cos + x1.to(tl.float32) * sin).to(x1.dtype)
    tl.store(ptr1, y1, mask=mask)
    tl.store(ptr1 + half_dim, y2, mask=mask)
    return y1, y2


@triton.jit
def _quantize_halves(x1, x2):
    """kv_quant.quantize_tile(x, True) for rows held as two halves x1, x2 [R, BLOCK_HALF] (float32,
    zeros past half_dim): one scale per row over both halves; returns (y1, y2, scale [R]). The
    same arithmetic as quantize_tile (448 = FP8_MAX, 1e-30 = its zero-row floor)."""
    s = tl.maximum(tl.max(tl.maximum(tl.abs(x1), tl.abs(x2)), axis=1), 1e-30) / 448.0
    y1 = tl.minimum(tl.maximum(x1 / s[:, None], -448.0), 448.0)
    y2 = tl.minimum(tl.maximum(x2 / s[:, None], -448.0), 448.0)
    return _round_to_e4m3(y1), _round_to_e4m3(y2), s


@triton.jit
def _store_row(x1, x2, cache_ptr, scale_ptr, row_off, scale_off, cols, kv_mask, head_mask, half_dim,
               KV_SCALED: tl.constexpr):
    """Store rows given as halves at cache_ptr + row_off ([R, 1]; + cols, + half_dim + cols); an
    fp8 cache gets the quantized rows and their scales at scale_ptr + scale_off ([R])."""
    if KV_SCALED:
        y1, y2, s = _quantize_halves(x1.to(tl.float32), x2.to(tl.float32))
        tl.store(scale_ptr + scale_off, s, mask=head_mask)
    else:
        y1, y2 = x1, x2
    tl.store(cache_ptr + row_off + cols, y1.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(cache_ptr + row_off + cols + half_dim, y2.to(cache_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _write_kv_row(k1, k2, v_row_ptr, slot, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_vh,
                  stride_cp, stride_cs, stride_ch, num_kv_heads, half_dim, page_size,
                  BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, KV_SCALED: tl.constexpr):
    """Store one token's k halves (k1, k2: [BLOCK_HKV, BLOCK_HALF]) and its v row at cache `slot`
    (quantized, with the row scales, when KV_SCALED)."""
    heads = tl.arange(0, BLOCK_HKV)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    kv_mask = (heads < num_kv_heads) & (cols < half_dim)
    heads_1d = tl.arange(0, BLOCK_HKV)
    head_mask = heads_1d < num_kv_heads
    page = slot // page_size
    base = page * stride_cp + (slot - page * page_size) * stride_cs
    row_off = base + heads * stride_ch  # [BLOCK_HKV, 1]
    scale_off = (base + heads_1d * stride_ch) // (2 * half_dim)  # kv_quant: a row's scale at offset // D
    _store_row(k1, k2, k_cache_ptr, k_scale_ptr, row_off, scale_off, cols, kv_mask, head_mask, half_dim,
               KV_SCALED)
    v_row = v_row_ptr + heads * stride_vh + cols
    v1 = tl.load(v_row, mask=kv_mask, other=0.0)
    v2 = tl.load(v_row + half_dim, mask=kv_mask, other=0.0)
    _store_row(v1, v2, v_cache_ptr, v_scale_ptr, row_off, scale_off, cols, kv_mask, head_mask, half_dim,
               KV_SCALED)


# positions and slot_mapping are read one int per program, so their alignment cannot matter for
# speed, and it varies at run time: a CUDA graph reads them as rows of one [rows, max_bs] int64
# block, a drop-history step as rows of a [layers, T] tensor (runtime/cuda_graphs.py,
# forward_context.LayerKV); not specializing on it keeps one binary for all (plugins/aot.py).
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _rope_kv_kernel(
    # inputs
    q_ptr,  # [T, Hq, D] (rotated in place; any row/head stride)
    k_ptr,  # [T, Hkv, D] (rotated in place)
    v_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T] int32/int64
    inv_freq_ptr,  # [D/2] float32
    slot_mapping_ptr,  # [T] int32/int64, < 0 = do not write
    # outputs
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,  # [num_pages, page_size, Hkv, D], same strides as k_cache
    k_scale_ptr, v_scale_ptr,  # [num_pages, page_size, Hkv] float32 (fp8 caches; dummies otherwise)
    # constants
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_cp, stride_cs, stride_ch,  # cache page / slot / head strides
    num_q_heads, num_kv_heads, half_dim, page_size,
    attention_scaling,
    BLOCK_HQ: tl.constexpr,  # query heads per program
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    WRITE_KV: tl.constexpr,
    KV_SCALED: tl.constexpr,  # fp8 caches: quantize rows, store their scales
):
    # Grid (T, 1 + cdiv(Hq, BLOCK_HQ)): program 0 of a token handles k (rotation, cache write of
    # k and v); programs 1.. rotate BLOCK_HQ query heads each, so a decode step (T = 1..16) does
    # not run all heads on one SM.
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    k_row = k_ptr + t * stride_kt
    v_row = v_ptr + t * stride_vt
    if APPLY_ROPE:
        j = tl.arange(0, BLOCK_HALF)
        inv_freq = tl.load(inv_freq_ptr + j, mask=j < half_dim, other=0.0)
        angle = tl.load(positions_ptr + t).to(tl.float32) * inv_freq  # [BLOCK_HALF] float32
        # float64 reduction to [-pi, pi]: exact enough that the fast sin/cos see a small argument
        a64 = angle.to(tl.float64)
        turns = tl.floor(a64 * 0.15915494309189535 + 0.5)  # round(angle / 2pi)
        reduced = (a64 - turns * 6.283185307179586).to(tl.float32)
        cos = (tl.cos(reduced) * attention_scaling)[None, :]
        sin = (tl.sin(reduced) * attention_scaling)[None, :]
        if part > 0:
            h0 = (part - 1) * BLOCK_HQ
            _rotate_heads(q_ptr + t * stride_qt + h0 * stride_qh, stride_qh, num_q_heads - h0,
                          cos, sin, half_dim, BLOCK_HQ, BLOCK_HALF)
        else:
            k1, k2 = _rotate_heads(k_row, stride_kh, num_kv_heads, cos, sin, half_dim,
                                   BLOCK_HKV, BLOCK_HALF)
            if WRITE_KV:
                slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
                if slot >= 0:  # slot < 0: padding token, nothing to write
                    _write_kv_row(k1, k2, v_row, slot, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                  stride_vh, stride_cp, stride_cs, stride_ch, num_kv_heads, half_dim, page_size,
                                  BLOCK_HKV, BLOCK_HALF, KV_SCALED)
    else:
        heads = tl.arange(0, BLOCK_HKV)[:, None]
        cols = tl.arange(0, BLOCK_HALF)[None, :]
        kv_mask = (heads < num_kv_heads) & (cols < half_dim)
        k1 = tl.load(k_row + heads * stride_kh + cols, mask=kv_mask, other=0.0)
        k2 = tl.load(k_row + heads * stride_kh + cols + half_dim, mask=kv_mask, other=0.0)
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot >= 0:
            _write_kv_row(k1, k2, v_row, slot, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                          stride_vh, stride_cp, stride_cs, stride_ch, num_kv_heads, half_dim, page_size,
                          BLOCK_HKV, BLOCK_HALF, KV_SCALED)


def rope_kv_triton(q, k, v, positions, inv_freq, attention_scaling, kv: PagedKV | None, slot_mapping,
                   apply_rope: bool) -> None:
    """Launcher for every combination: rope only (kv None), rope + KV write, KV write only (q
    unused); kv: the layer's cache (an fp8 one with its scales)."""
    write = kv is not None
    T, Hkv, D = k.shape
    assert D % 2 == 0 and k.stride(2) == 1, "k: [T, Hkv, D], last dim contiguous, D even"
    if apply_rope:
        assert q.dim() == 3 and q.shape[0] == T and q.shape[2] == D and q.stride(2) == 1
        assert inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32
        assert positions.shape == (T,) and positions.dtype in (torch.int32, torch.int64)
        assert inv_freq.is_contiguous() and positions.is_contiguous()
    else:
        q, positions, inv_freq = k, slot_mapping, k  # dummies, never read
    if write:
        k_cache, v_cache = kv.k, kv.v
        assert v.shape == k.shape and v.stride(2) == 1
        assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (Hkv, D) and k_cache.stride(3) == 1
        assert slot_mapping.shape == (T,) and slot_mapping.dtype in (torch.int32, torch.int64)
        assert slot_mapping.is_contiguous()
        kv.check()
        (k_scale, v_scale), flags = kv.scale_ptrs(), kv.kernel_flags(host=False)
    else:
        v, k_cache, v_cache, slot_mapping = k, k, k, positions  # dummies
        k_scale = v_scale = k_cache
        flags = {"KV_SCALED": False}
    if T == 0:
        return
    Hq = q.shape[1] if apply_rope else 0
    page_size = k_cache.shape[1] if write else 1
    cache_strides = k_cache.stride()[:3] if write else (0, 0, 0)
    BLOCK_HQ = min(next_pow2(Hq), 8) if apply_rope else 1
    num_q_parts = triton.cdiv(Hq, BLOCK_HQ) if apply_rope else 0
    _rope_kv_kernel[(T, 1 + num_q_parts)](
        q, k, v, positions, inv_freq, slot_mapping,
        k_cache, v_cache, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *cache_strides,
        Hq, Hkv, D // 2, page_size, float(attention_scaling),
        BLOCK_HQ=BLOCK_HQ, BLOCK_HKV=next_pow2(Hkv), BLOCK_HALF=next_pow2(D // 2),
        APPLY_ROPE=apply_rope, WRITE_KV=write, **flags, num_warps=4,
    )


# ----------------------------------------------------------------------------- references

def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D/2] float32 -> rotated x in x.dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def apply_rope_ref_(q, k, positions, inv_freq, attention_scaling) -> None:
    """Reference in-place rope of q [T, Hq, D] and k [T, Hkv, D] (float32 math)."""
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    cos, sin = angle.cos() * attention_scaling, angle.sin() * attention_scaling
    q.copy_(_rotate_ref(q, cos, sin))
    k.copy_(_rotate_ref(k, cos, sin))


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Reference KV write: cache[slot // page_size, slot % page_size] = k/v[t] for slot >= 0
    (quantized, with the row scales, into fp8 caches)."""
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, row = slots // k_cache.shape[1], slots % k_cache.shape[1]
    write_rows(k_cache, k_scale, page, row, k[keep])
    write_rows(v_cache, v_scale, page, row, v[keep])


# ----------------------------------------------------------------------------- public API

def apply_rope_(q, k, positions, inv_freq, attention_scaling: float) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (row-strided views allowed)."""
    if use_triton(q, k):
        rope_kv_triton(q, k, None, positions, inv_freq, attention_scaling, None, None, apply_rope=True)
    else:
        apply_rope_ref_(q, k, positions, inv_freq, attention_scaling)


def write_kv(k, v, kv: PagedKV, slot_mapping) -> None:
    """Write k, v [T, Hkv, D] into the paged cache kv at slot_mapping (slot < 0 skipped)."""
    if use_triton(k, kv.k):
        rope_kv_triton(None, k, v, None, None, 1.0, kv, slot_mapping, apply_rope=False)
    else:
        write_kv_ref(k, v, kv.k, kv.v, slot_mapping, kv.k_scale, kv.v_scale)


def rope_and_write_kv(q, k, v, positions, inv_freq, attention_scaling: float, kv: PagedKV, slot_mapping) -> None:
    """Rotate q and k in place and write rotated k and v into the paged KV cache kv (one launch
    on CUDA)."""
    if use_triton(q, k, kv.k):
        rope_kv_triton(q, k, v, positions, inv_freq, attention_scaling, kv, slot_mapping, apply_rope=True)
    else:
        apply_rope_ref_(q, k, positions, inv_freq, attention_scaling)
        write_kv_ref(k, v, kv.k, kv.v, slot_mapping, kv.k_scale, kv.v_scale)


def aot_launches(space) -> None:
    """Every fused launch the attention layers make (plugins/aot.py): rope + KV write of every
    attention layer (runtime/models/common.py, and token drop's sliding layers between anchors) on
    q, k, v as Attention.forward makes them (qkv slices, or the q/k norms' outputs: _aot_shapes).
    A method that calls the separate rotation or KV write enumerates those launches itself (token
    drop's anchors: plugins/token_drop/anchors.py). Positions and slots are int64;
    the token count is only the grid; page size, head counts and the KV dtype (fp8: quantized rows
    with scales) come from the plan."""
    from ._aot_shapes import TOKEN_CLASSES, attention_qkv, paged_kv

    m = space.model
    kv = paged_kv(space)
    inv_freq = space.fake(m.head_dim // 2, dtype=torch.float32)
    scaling = 1.0  # attention_scaling: a float argument, which Triton never specializes
    for T in TOKEN_CLASSES:
        q, k, v = attention_qkv(space, T)
        positions = space.fake(T, dtype=torch.int64)
        slots = space.fake(T, dtype=torch.int64)
        rope_and_write_kv(q, k, v, positions, inv_freq, scaling, kv, slots)
