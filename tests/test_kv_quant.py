"""The FP8 KV row format (plugins/kv_quant.py): torch quantize/dequantize and the Triton tile
helpers under the interpreter agree, and the round trip stays within e4m3's precision."""

import pytest
import torch
import triton
import triton.language as tl


from infhip.plugins.kv_quant import (FP8_DTYPE, FP8_MAX, check_kv_scales, dequantize_rows, dequantize_tile,
                                     new_kv_scales, quantize_rows, quantize_tile, read_rows, write_rows)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_round_trip_is_within_e4m3_precision():
    """Each element comes back within 2^-4 of itself relative (3 mantissa bits, round to nearest)
    or, when small against its row's largest element, within the subnormal step; zero rows stay
    zero; the row's largest element maps to exactly +-448."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 40, generator=g) * torch.logspace(-3, 3, 7)[:, None, None]
    x[2, 1] = 0.0
    q, s = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and s.shape == (7, 3) and s.dtype == torch.float32
    back = dequantize_rows(q, s, torch.float32)
    step = s[..., None] * 2.0 ** -9  # e4m3 subnormal spacing, in the row's units
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, step)).all()
    assert torch.equal(back[2, 1], torch.zeros(40))
    assert torch.equal(q.float().abs().amax(-1)[torch.arange(7) != 2], torch.full((6, 3), FP8_MAX))


def test_write_and_read_rows_through_pages():
    cache = torch.zeros(5, 4, 2, 16, dtype=FP8_DTYPE)
    scale = new_kv_scales(cache)
    assert check_kv_scales(cache, cache.clone(), scale, scale.clone())
    x = torch.randn(3, 2, 16)
    page, row = torch.tensor([4, 0, 2]), torch.tensor([1, 3, 0])
    write_rows(cache, scale, page, row, x)
    assert torch.allclose(read_rows(cache, scale, page, row, torch.float32), x, rtol=2 ** -4, atol=1e-6)
    plain = torch.zeros(5, 4, 2, 16)
    assert not check_kv_scales(plain, plain, None, None)
    write_rows(plain, None, page, row, x)
    assert torch.equal(read_rows(plain, None, page, row, torch.float32), x)


def test_check_kv_scales_refuses_mismatches():
    cache = torch.zeros(2, 4, 2, 8, dtype=FP8_DTYPE)
    with pytest.raises(AssertionError, match="needs its k_scale"):
        check_kv_scales(cache, cache, None, None)
    with pytest.raises(AssertionError, match="float32"):
        check_kv_scales(cache, cache, torch.ones(2, 4, 2, dtype=torch.float16), torch.ones(2, 4, 2))
    with pytest.raises(AssertionError, match="scales are for fp8"):
        plain = torch.zeros(2, 4, 2, 8)
        check_kv_scales(plain, plain, torch.ones(2, 4, 2), None)


@triton.jit
def _round_trip_kernel(x_ptr, cache_ptr, scale_ptr, out_ptr, head_dim, BLOCK_R: tl.constexpr,
                       BLOCK_D: tl.constexpr, SCALED: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = (d < head_dim)[None, :]
    off = r[:, None] * head_dim + d[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0)
    y, s = quantize_tile(x, SCALED)
    tl.store(cache_ptr + off, y.to(cache_ptr.dtype.element_ty), mask=mask)
    if SCALED:
        tl.store(scale_ptr + r, s)
    back = dequantize_tile(tl.load(cache_ptr + off, mask=mask, other=0.0), scale_ptr, r * head_dim,
                           r < BLOCK_R, head_dim, SCALED)
    tl.store(out_ptr + off, back, mask=mask)


@pytest.mark.parametrize("scaled", [True, False])
def test_triton_tiles_match_torch(scaled):
    """quantize_tile + an fp8 store write the same bytes and scales as quantize_rows (to one fp8
    step: the interpreter's division may round differently at a tie), and dequantize_tile reads
    them back like dequantize_rows; 124.86 and -31.47 round up to the next power of two (the CPU
    interpreter's own cast gets that wrong, hence _round_to_e4m3)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 24, generator=g) * torch.logspace(-2, 2, 8)[:, None]
    x[0, :4] = torch.tensor([448.0, 124.86, -31.47, 0.0015])  # scale 1: rounding carries into the exponent
    x = x.to(DEVICE)
    cache = torch.zeros(8, 24, dtype=FP8_DTYPE if scaled else torch.float32, device=DEVICE)
    scale = torch.zeros(8, dtype=torch.float32, device=DEVICE)
    out = torch.zeros(8, 24, dtype=torch.float32, device=DEVICE)
    _round_trip_kernel[(1,)](x, cache, scale, out, 24, BLOCK_R=8, BLOCK_D=32, SCALED=scaled)
    if not scaled:
        assert torch.equal(out, x)
        return
    q_ref, s_ref = quantize_rows(x)
    assert torch.allclose(scale, s_ref, rtol=1e-6)
    assert torch.allclose(cache.float(), q_ref.float(), rtol=2 ** -3)
    assert cache[0, :4].float().tolist() == [448.0, 128.0, -32.0, 2.0 ** -9]
    assert torch.allclose(out, dequantize_rows(cache, scale, torch.float32), rtol=1e-6)
    assert torch.allclose(out, x, rtol=2 ** -4, atol=float(scale.max()) * 2 ** -9)
