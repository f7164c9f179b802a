"""Dense paged attention over an fp8 KV cache (row-scaled e4m3): the Triton decode kernel
(interpreter on CPU), gather and the prefill path against attention on the dequantized and on
the original keys / values. The float caches: tests/test_plugins_dense_attention.py; compiled for
the GPU: builder/compile_matrix.py (tests/run.sh)."""

import math

import pytest
import torch

from infhip.plugins import dense_attention
from infhip.plugins.kv_quant import FP8_DTYPE, dequantize_rows, quantize_rows
from infhip.plugins.paged_kv import PagedKV
from infhip.plugins.dense_attention import (
    gather_kv, dense_attention_ref, paged_decode_attention, paged_decode_attention_ref,
    paged_decode_attention_triton, paged_prefill_attention,
)
from tests._dense_cases import DEVICE, TOL, PagedSeqs, decode_expected, pack_queries, rel_err

FP8_CLOSE = 5e-2  # fp8 attention against attention on the unquantized K / V (e4m3: 3 mantissa bits)


class QuantizedKV:
    """The fp8 twin of a PagedSeqs: its caches quantized row by row (kv_quant.quantize_rows; the
    NaN rows of unused slots and released pages stay NaN, scales too), and per sequence the
    keys / values as the cache holds them (dequantized, float32)."""

    def __init__(self, kv: PagedSeqs):
        self.k_cache, self.k_scale = quantize_rows(kv.k_cache)
        self.v_cache, self.v_scale = quantize_rows(kv.v_cache)
        assert self.k_cache.dtype == FP8_DTYPE and self.k_scale.is_contiguous()
        self.block_tables, self.context_lens = kv.block_tables, kv.context_lens
        self.keys = [dequantize_rows(*quantize_rows(k), torch.float32) for k in kv.keys]
        self.values = [dequantize_rows(*quantize_rows(v), torch.float32) for v in kv.values]
        self.scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        self.paged = PagedKV(self.k_cache, self.v_cache, self.k_scale, self.v_scale)


FP8_DECODE_CASES = [
    # Hq, Hkv, D, page_size, q dtype, block_n
    (6, 2, 32, 4, torch.float32, 16),
    (6, 2, 40, 16, torch.float32, 32),  # head dim not a power of two (masked lanes)
    (6, 2, 40, 4, torch.bfloat16, 16),
    (4, 1, 32, 16, torch.bfloat16, 16),
]


@pytest.mark.parametrize("Hq,Hkv,D,page_size,dtype,block_n", FP8_DECODE_CASES)
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp8_cache(Hq, Hkv, D, page_size, dtype, block_n, window, num_splits):
    """The kernel on an fp8 cache = exact attention over the dequantized cache (the tolerance of
    the unquantized tests), and close to attention over the original K / V."""
    contexts = [1, 5, 37, 0, 70]
    release = [max(0, c - window) for c in contexts] if window else None
    kv = PagedSeqs(contexts, Hkv, D, page_size, dtype, seed=30 + D + page_size, release_before=release)
    fp8 = QuantizedKV(kv)
    q = torch.randn(len(contexts), Hq, D, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    scale = D ** -0.5
    expected = decode_expected(q, fp8, contexts, scale, window)
    original = decode_expected(q, kv, contexts, scale, window)
    got = paged_decode_attention_triton(q, fp8.paged, fp8.block_tables, fp8.context_lens, scale,
                                        window=window, num_splits=num_splits, block_n=block_n)
    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(got).all(), "read a NaN row or scale: masked/released memory was touched"
    assert torch.equal(got[3], torch.zeros_like(got[3])), "padded slot must give zeros"
    assert rel_err(got, expected) < TOL[dtype]
    assert rel_err(got, original) < FP8_CLOSE
    # the torch path and the public dispatch dequantize to q's dtype alike
    torch_out = paged_decode_attention_ref(q, fp8.k_cache, fp8.v_cache, fp8.block_tables, fp8.context_lens,
                                           scale, window, **fp8.scales)
    assert torch_out.dtype == dtype and torch.equal(torch_out[3], torch.zeros_like(torch_out[3]))
    assert rel_err(torch_out, expected) < TOL[dtype]
    public = paged_decode_attention(q, fp8.paged, fp8.block_tables, fp8.context_lens, scale,
                                    window, max_len=80)
    assert rel_err(public, expected) < TOL[dtype]


def test_decode_fp8_cache_validates_scales():
    kv = PagedSeqs([9], 2, 16, 4, torch.float32, seed=6)
    fp8 = QuantizedKV(kv)
    q = torch.randn(1, 6, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="needs its k_scale"):
        paged_decode_attention_triton(q, PagedKV(fp8.k_cache, fp8.v_cache), fp8.block_tables, fp8.context_lens, 0.3)
    with pytest.raises(AssertionError, match="scales are for fp8"):
        paged_decode_attention_triton(q, PagedKV(kv.k_cache, kv.v_cache, fp8.k_scale, fp8.v_scale), kv.block_tables,
                                      kv.context_lens, 0.3)
    with pytest.raises(AssertionError, match="dtypes must match"):  # unscaled: q and cache dtypes still match
        paged_decode_attention_triton(q.bfloat16(), kv.paged, kv.block_tables, kv.context_lens, 0.3)


def test_gather_kv_fp8_dequantizes():
    """gather_kv (also used by infhip/methods/token_drop/runtime/step.py): without scales it returns the cache's own
    rows as before; with them, rows dequantized to the requested dtype."""
    contexts = [37]
    kv = PagedSeqs(contexts, 2, 16, 4, torch.float32, seed=7)
    fp8 = QuantizedKV(kv)
    k, v = gather_kv(kv.paged, kv.block_tables[0], 3, 30)
    assert k.dtype == torch.float32 and torch.equal(k, kv.keys[0][3:30]) and torch.equal(v, kv.values[0][3:30])
    for dtype in (torch.float32, torch.bfloat16):
        k, v = gather_kv(fp8.paged, fp8.block_tables[0], 3, 30, dtype=dtype)
        assert k.dtype == dtype and k.shape == (27, 2, 16)
        assert torch.equal(k, fp8.keys[0][3:30].to(dtype)) and torch.equal(v, fp8.values[0][3:30].to(dtype))
    with pytest.raises(AssertionError, match="dtype"):
        gather_kv(fp8.paged, fp8.block_tables[0], 0, 5)


FP8_PREFILL_CASES = [
    # Hq, Hkv, D, page_size, q dtype
    (6, 2, 32, 4, torch.float32),
    (6, 2, 40, 16, torch.bfloat16),
]


@pytest.mark.parametrize("Hq,Hkv,D,page_size,dtype", FP8_PREFILL_CASES)
@pytest.mark.parametrize("window", [None, 9])
def test_prefill_fp8_cache(Hq, Hkv, D, page_size, dtype, window):
    """Prefill over an fp8 cache = exact attention over the dequantized cache, close to attention
    over the original K / V; k_new / v_new (the unquantized rows) are not used, so a fresh prompt
    sees the cached rows as a chunked one does."""
    contexts = [5, 37, 70, 9, 20]
    q_lens = [5, 10, 1, 3, 20]
    release = [max(0, c - n - window + 1) for c, n in zip(contexts, q_lens)] if window else None
    kv = PagedSeqs(contexts, Hkv, D, page_size, dtype, seed=40 + D, release_before=release)
    fp8 = QuantizedKV(kv)
    q, cu = pack_queries(q_lens, Hq, D, dtype, seed=41)
    k_new = torch.cat([kv.keys[b][c - n:] for b, (c, n) in enumerate(zip(contexts, q_lens))])
    v_new = torch.cat([kv.values[b][c - n:] for b, (c, n) in enumerate(zip(contexts, q_lens))])
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = 0.7 * D ** -0.5
    gathered = paged_prefill_attention(q, fp8.paged, fp8.block_tables, cu_t, fp8.context_lens,
                                       scale, window=window)
    fast = paged_prefill_attention(q, fp8.paged, fp8.block_tables, cu_t, fp8.context_lens,
                                   scale, window=window, k_new=k_new, v_new=v_new)
    for out in (gathered, fast):
        assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()
    for b, (ctx, n) in enumerate(zip(contexts, q_lens)):
        rows = slice(cu[b], cu[b + 1])
        pos = torch.arange(ctx, device=DEVICE)
        on_fp8 = dense_attention_ref(q[rows], fp8.keys[b], fp8.values[b], pos[ctx - n:], pos, scale, window)
        on_orig = dense_attention_ref(q[rows], kv.keys[b], kv.values[b], pos[ctx - n:], pos, scale, window)
        assert rel_err(gathered[rows], on_fp8) < TOL[dtype], f"sequence {b}"
        assert rel_err(gathered[rows], on_orig) < FP8_CLOSE, f"sequence {b}"
    assert torch.equal(fast, gathered)

    # decode of each sequence's last query == the last (gathered) prefill row
    last = torch.tensor([c - 1 for c in cu[1:]], device=DEVICE)
    dec = paged_decode_attention_triton(q[last].contiguous(), fp8.paged, fp8.block_tables,
                                        fp8.context_lens, scale, window=window, num_splits=2, block_n=16)
    assert rel_err(dec, gathered[last]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_what_rope_writes_fp8(dtype):
    """End to end on the kernels: rope_kv_triton writes a prompt's K / V into an fp8 cache, the
    decode kernel reads it back; close to attention over the unquantized rows."""
    from infhip.plugins.rope import rope_kv_triton
    g = torch.Generator().manual_seed(8)
    ctx, Hq, Hkv, D, page_size = 45, 6, 2, 40, 4
    k = torch.randn(ctx, Hkv, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(ctx, Hkv, D, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(1, Hq, D, generator=g).to(dtype).to(DEVICE)
    num_pages = 1 + math.ceil(ctx / page_size)
    kc = torch.zeros(num_pages, page_size, Hkv, D, dtype=FP8_DTYPE, device=DEVICE)
    vc = torch.zeros_like(kc)
    ks = torch.ones(num_pages, page_size, Hkv, device=DEVICE)
    vs = torch.ones_like(ks)
    pages = 1 + torch.randperm(num_pages - 1, generator=g)  # page 0 stays the null page
    block_tables = pages[None].to(torch.int32).to(DEVICE)
    slots = (pages.repeat_interleave(page_size) * page_size + torch.arange(page_size).repeat(num_pages - 1))[:ctx]
    rope_kv_triton(None, k, v, None, None, 1.0, PagedKV(kc, vc, ks, vs), slots.to(DEVICE), apply_rope=False)
    context_lens = torch.tensor([ctx], dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention_triton(q, PagedKV(kc, vc, ks, vs), block_tables, context_lens, D ** -0.5,
                                        num_splits=2, block_n=16)
    pos = torch.arange(ctx, device=DEVICE)
    original = dense_attention_ref(q, k, v, pos[-1:], pos, D ** -0.5)
    assert torch.isfinite(got).all() and rel_err(got, original) < FP8_CLOSE
