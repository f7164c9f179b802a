"""Host pages of a paged cache (plugins/kv_offload.py): the address arithmetic the kernels share,
and the merged pool the torch references read."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from infhip.plugins.kv_offload import HostKV, copy_pages, host_page, merged_pool, offload_deltas, page_offset
from infhip.plugins.paged_kv import PagedKV
from infhip.plugins.kv_quant import FP8_DTYPE, new_kv_scales

from ._offload import offload_pages
from .test_infinitehip_common import DEVICE, PagedSeqs


@triton.jit
def _gather_rows(k_ptr, table_ptr, out_ptr, host_delta, n, stride_p, stride_s,
                 PAGE: tl.constexpr, N: tl.constexpr, W: tl.constexpr, OFFLOAD: tl.constexpr):
    tok = tl.arange(0, N)
    valid = tok < n
    page = tl.load(table_ptr + tok // PAGE, mask=valid, other=0)
    off = page_offset(page, stride_p, host_delta, OFFLOAD) + (tok % PAGE) * stride_s
    w = tl.arange(0, W)
    x = tl.load(k_ptr + off[:, None] + w[None, :], mask=valid[:, None])
    tl.store(out_ptr + tok[:, None] * W + w[None, :], x, mask=valid[:, None])


def test_host_page_is_an_involution():
    assert [host_page(p) for p in (-1, -2, -9)] == [0, 1, 8]
    assert all(host_page(host_page(p)) == p for p in range(-5, 5))


@pytest.mark.parametrize("offload", [False, True])
def test_page_offset_reads_both_pools(offload):
    """A kernel gathering a sequence's rows through page_offset: GPU and host pages alike."""
    seqs = PagedSeqs([37], 2, 8, 4, seed=3)
    ctx = 37
    host, tables = offload_pages(seqs.k_cache, seqs.v_cache, seqs.block_tables) if offload else (None, seqs.block_tables)
    dk = offload_deltas(seqs.k_cache, seqs.v_cache, None, None, host)[0]
    out = torch.full((ctx, 16), float("nan"), device=DEVICE)
    _gather_rows[(1,)](seqs.k_cache, tables[0], out, dk, ctx, seqs.k_cache.stride(0), seqs.k_cache.stride(1),
                       PAGE=4, N=64, W=16, OFFLOAD=offload)
    assert torch.equal(out, seqs.keys[0].reshape(ctx, 16))


def test_merged_pool_renumbers_host_pages():
    seqs = PagedSeqs([21, 30], 1, 4, 4, seed=5)
    host, tables = offload_pages(seqs.k_cache, seqs.v_cache, seqs.block_tables)
    pool, merged = merged_pool(seqs.k_cache, host.k, tables)
    assert (merged >= 0).all() and pool.shape[0] == seqs.k_cache.shape[0] + host.num_pages
    for b, ctx in enumerate((21, 30)):
        tok = torch.arange(ctx)
        rows = pool[merged[b, tok // 4].long(), tok % 4]
        assert torch.equal(rows, seqs.keys[b])
    same = merged_pool(seqs.k_cache, None, tables)
    assert same[0] is seqs.k_cache and same[1] is tables


def test_host_twin_layout_and_checks():
    cache = torch.zeros(5, 16, 2, 8, dtype=FP8_DTYPE)
    host = HostKV.like(cache, 3)
    assert host.k.shape == (3, 16, 2, 8) and host.k.dtype == FP8_DTYPE and host.k_scale.shape == (3, 16, 2)
    scales = new_kv_scales(cache)
    deltas = offload_deltas(cache, cache.clone(), scales, scales.clone(), host)
    assert deltas[0] == host.k.data_ptr() - cache.data_ptr()
    with pytest.raises(ValueError, match="same dtype and page layout"):
        offload_deltas(torch.zeros(5, 8, 2, 8, dtype=FP8_DTYPE), None, scales, None, host)
    with pytest.raises(ValueError, match="row scales"):
        offload_deltas(cache, None, None, None, host)
    with pytest.raises(ValueError, match="at least one page"):
        HostKV.like(cache, 0)
    assert offload_deltas(cache, cache, scales, scales, None) == (0, 0, 0, 0)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("interpreter", [True, False])
def test_copy_pages_moves_pages_both_ways(fp8, interpreter, monkeypatch):
    """GPU pages -> host pages and back: every byte (and the fp8 scales) arrives; other pages
    are untouched."""
    if not interpreter:
        if DEVICE == "cuda":
            pytest.skip("the torch fallback runs on CPU tensors only")
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(9)
    k = torch.randn(6, 4, 2, 8, generator=g).to(DEVICE)
    v = torch.randn(6, 4, 2, 8, generator=g).to(DEVICE)
    ks = vs = None
    if fp8:
        k, v = k.to(FP8_DTYPE), v.to(FP8_DTYPE)
        ks, vs = torch.rand(6, 4, 2, generator=g).to(DEVICE), torch.rand(6, 4, 2, generator=g).to(DEVICE)
    host = HostKV.like(k, 4)
    host.k.zero_()
    k0, v0 = k.clone(), v.clone()
    src = torch.tensor([3, 1, 5], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([host_page(2), host_page(0), host_page(3)], dtype=torch.int32, device=DEVICE)
    copy_pages(PagedKV(k, v, ks, vs, host), src, dst)
    for s, h in ((3, 2), (1, 0), (5, 3)):
        assert torch.equal(host.k[h].view(torch.uint8), k0[s].cpu().view(torch.uint8))
        assert torch.equal(host.v[h].view(torch.uint8), v0[s].cpu().view(torch.uint8))
        if fp8:
            assert torch.equal(host.k_scale[h], ks[s].cpu()) and torch.equal(host.v_scale[h], vs[s].cpu())
    assert not host.k[1].view(torch.uint8).any(), "host page 1 was not a destination"
    back = torch.tensor([4], dtype=torch.int32, device=DEVICE)
    copy_pages(PagedKV(k, v, ks, vs, host), torch.tensor([host_page(0)], dtype=torch.int32, device=DEVICE), back)
    assert torch.equal(k[4].view(torch.uint8), k0[1].view(torch.uint8))
    assert torch.equal(k[:4].view(torch.uint8), k0[:4].view(torch.uint8))
