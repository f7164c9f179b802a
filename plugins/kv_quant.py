"""FP8 KV cache: float8_e4m3fn rows with one float32 scale per (token, kv head).

A cache row x [D] (one token of one kv head; keys already rotated by RoPE) is stored as

    scale = max(amax_j |x_j|, 1e-30) / 448          (float32; 448 = largest e4m3 value)
    q_j   = fp8(x_j / scale)                          (round to nearest even, |x_j / scale| <= 448)

and read back as x_j ~ float(q_j) * scale. e4m3 keeps 3 mantissa bits, so every element is within
2^-4 of itself relative (down to 2^-6 of the row's largest element, below which it turns
subnormal). A per-row scale needs no calibration, follows outlier heads and random weights
alike, and costs 4 bytes per D-byte row (3 % at D = 128). On SmolLM2-135M (KJV, 2 x 2048 tokens,
CPU float32) perplexity goes 17.43 -> 17.52 with it and 17.64 with a fixed scale of 1
(benchmarks/quality/fp8_scale_choice.py).

Layout: the scales of a cache [num_pages, page_size, Hkv, D] live in a float32 tensor
[num_pages, page_size, Hkv] beside it (k_scale, v_scale). Both contiguous, so the row that starts
at element offset o of the cache has its scale at o // D — kernels that already compute a row's
offset (page * stride_cp + slot * stride_cs + head * stride_ch) find its scale with one division.

Every launcher that reads or writes a paged cache takes the layer's PagedKV (paged_kv.py), whose
k_scale / v_scale are None for a cache in the queries' dtype (no quantization) and both given for
an fp8 cache (check_kv_scales); the torch references take the loose tensors.
Dots run in the queries' dtype: kernels dequantize a loaded tile (dequantize_tile) and cast it to
q's dtype, never q to the cache's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dtypes import FP8_DTYPE

FP8_MAX = 448.0
_TINY = 1e-30  # an all-zero row gets a tiny scale (stores zeros, reads back zeros)


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    """True for float8_e4m3fn tensors (or that dtype)."""
    return (t if isinstance(t, torch.dtype) else t.dtype) == FP8_DTYPE


def scale_shape(cache: torch.Tensor) -> tuple[int, int, int]:
    """[num_pages, page_size, Hkv] of a cache [num_pages, page_size, Hkv, D]."""
    return tuple(cache.shape[:3])


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Validate the (cache, scale) pairs a launcher got; True when the cache is fp8 (scaled).
    v_cache None: a launcher that reads keys only (then v_scale must be None too)."""
    scaled = is_fp8(k_cache)
    pairs = [(k_cache, k_scale, "k")] + ([(v_cache, v_scale, "v")] if v_cache is not None else [])
    if v_cache is None:
        assert v_scale is None, "v_scale given without v_cache"
    for cache, scale, name in pairs:
        assert is_fp8(cache) == scaled, "k and v caches must both be fp8 or neither"
        if not scaled:
            assert scale is None, f"{name}_scale given for a {cache.dtype} cache (scales are for fp8 caches)"
            continue
        assert scale is not None, f"an fp8 {name} cache needs its {name}_scale [num_pages, page_size, Hkv]"
        assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(cache), (
            f"{name}_scale must be float32 {scale_shape(cache)}, got {scale.dtype} {tuple(scale.shape)}")
        assert scale.is_contiguous() and cache.is_contiguous(), f"fp8 {name} cache and its scales must be contiguous"
        assert scale.device == cache.device, f"{name}_scale on {scale.device}, cache on {cache.device}"
    return scaled


def new_kv_scales(cache: torch.Tensor) -> torch.Tensor | None:
    """The scale tensor an fp8 cache needs (ones: zero rows read back as zeros), else None."""
    return torch.ones(scale_shape(cache), dtype=torch.float32, device=cache.device) if is_fp8(cache) else None


# ------------------------------------------------------------------------------------ torch

def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (fp8 [..., D], float32 scale [...]) as the module docstring."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=_TINY)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (1 ulp off
    # IEEE at times); this is the IEEE quotient on every device, as the kernels' div_rn
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [..., D] and scale [...] -> dtype; a non-fp8 q (scale None) is only cast."""
    if scale is None:
        return q.to(dtype)
    return (q.float() * scale[..., None].float()).to(dtype)


def write_rows(cache: torch.Tensor, scale: torch.Tensor | None, page: torch.Tensor, row: torch.Tensor,
               x: torch.Tensor) -> None:
    """cache[page, row] = x (x [N, Hkv, D]), quantized with its scales when the cache is fp8."""
    if scale is None:
        cache[page, row] = x.to(cache.dtype)
        return
    qx, sx = quantize_rows(x)
    cache[page, row] = qx
    scale[page, row] = sx


def read_rows(cache: torch.Tensor, scale: torch.Tensor | None, page: torch.Tensor, row: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """cache[page, row] as dtype [N, Hkv, D], dequantized when the cache is fp8."""
    return dequantize_rows(cache[page, row], None if scale is None else scale[page, row], dtype)


def read_pages(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """cache.index_select(0, pages) as dtype [len(pages), page_size, Hkv, D] (gathers)."""
    x = cache.index_select(0, pages)
    return dequantize_rows(x, None if scale is None else scale.index_select(0, pages), dtype)


# ----------------------------------------------------------------------------------- triton

@triton.jit
def dequantize_tile(x, scale_ptr, row_off, row_mask, head_dim, SCALED: tl.constexpr):
    """A loaded tile x [R, BLOCK_D] of cache rows -> float32, times each row's scale when SCALED.
    row_off [R]: element offset of each row's start in its cache (scale index row_off // D)."""
    x = x.to(tl.float32)
    if SCALED:
        s = tl.load(scale_ptr + row_off // head_dim, mask=row_mask, other=0.0)
        x = x * s[:, None]
    return x


@triton.jit
def _round_to_e4m3(y):
    """float32 y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, still float32.
    The cast to fp8 then has nothing left to round: Triton's CPU interpreter (3.9) rounds wrongly
    when rounding carries into the exponent (124.9 -> 64, not 128), the GPU's cvt does not."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6 e4m3 is subnormal: a fixed step
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    v = y / step  # exact (a power of two), |v| < 16
    v = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds v to an integer, ties to even
    return v * step


@triton.jit
def quantize_tile(x, SCALED: tl.constexpr):
    """float32 rows x [R, BLOCK_D] (zeros past D) -> (x / scale on the e4m3 grid, scale [R]); the
    caller stores the first cast to the fp8 cache and the second to the scales. Not SCALED: (x,
    ones) — the caller casts x to the cache dtype."""
    if SCALED:
        s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) / 448.0
        y = tl.minimum(tl.maximum(x / s[:, None], -448.0), 448.0)
        return _round_to_e4m3(y), s
    return x, tl.full([x.shape[0]], 1.0, tl.float32)
