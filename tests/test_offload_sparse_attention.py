"""Block-sparse attention reading offloaded pages (plugins/kv_offload.py): decode (split-K, the
rotated key bank) and prefill (tiles loaded one ahead or not), over float32 and fp8 caches.

Each test runs on the original cache, then moves every other page to a host twin (tests/_offload.py:
the GPU copies turn NaN, fp8 scales too) and runs again with the host twin and the negative
tables: the outputs must be equal bit for bit (the same rows, read from the other pool), and so
must the references (merged pool). A row read from the wrong pool, or a V row (or scale) read at
K's host offset, poisons or changes the output."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.infinitehip import (sparse_attention_ref, sparse_decode_attention, sparse_prefill_attention,
                                        write_key_bank)
from infhip.plugins.kv_offload import offload_deltas
from infhip.plugins.paged_kv import PagedKV

from ._offload import offload_pages
from .test_infinitehip_common import DEVICE, PagedSeqs, inv_freq, kv_caches
from .test_infinitehip_sparse_attention import random_selection, run_selection

N_SINK, D = 4, 16


def offload(k_cache, v_cache, tables, scales):
    """Every other page (the sink's first one included) to a host twin: (host, negative tables).
    The twins of V (and of its scales) move one page on, so that V's delta is never K's by the
    allocators' chance (pools allocated alike, twins alike): a V read at K's delta must miss."""
    host, tables = offload_pages(k_cache, v_cache, tables, every=2, **scales)
    host.v = shifted(host.v)
    if scales:
        host.v_scale = shifted(host.v_scale)
    deltas = offload_deltas(k_cache, v_cache, scales.get("k_scale"), scales.get("v_scale"), host)
    assert deltas[0] != deltas[1] and (not scales or deltas[2] != deltas[3])
    return host, tables


def shifted(t):
    """A copy of t one page into a larger (pinned, as HostKV's) allocation, with t's strides."""
    buf = torch.empty((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype, pin_memory=torch.cuda.is_available())
    buf[1:] = t
    return buf[1:]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rope_style,bank", [("none", False), ("streaming", False), ("streaming", True)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_reads_host_pages(num_splits, rope_style, bank, fp8):
    """Decode over offloaded sink, selected and stream pages; split-K loads tiles one ahead
    (prefetch; 3 tiles in 2 splits: one split carries a tile's rows into the next). The bank (selected keys, rotated) is written from the original cache: with it
    only sink and stream keys come from the pools."""
    n_stream = 8
    seqs = PagedSeqs([97, 203, 7], 2, D, 4, seed=num_splits + 2 * bank + 5 * fp8)
    k_cache, v_cache, scales = kv_caches(seqs, fp8)
    ends = seqs.context_lens
    sel = (run_selection(seqs.generator, ends, N_SINK, n_stream, runs=7, run_len=4) if bank
           else random_selection(seqs.generator, ends, N_SINK, n_stream, k=24))
    q = torch.randn(3, 6, D, generator=seqs.generator).to(DEVICE)
    kv = PagedKV(k_cache, v_cache, **scales)
    opts = dict(n_sink=N_SINK, n_stream=n_stream, scale=0.3, rope_style=rope_style, inv_freq=inv_freq(D))
    if bank:
        rows = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
        opts.update(bank_rows=rows, bank=torch.full((3, sel.shape[1], 2, D), float("nan"), device=DEVICE))
        write_key_bank(kv, seqs.block_tables, ends, sel, opts["bank"], rows, n_sink=N_SINK,
                       inv_freq=inv_freq(D), rope_group=4)
    run = dict(num_splits=num_splits, block_n=16, prefetch=num_splits > 1, rope_group=4 if bank else 1)
    expected = sparse_decode_attention(q, kv, seqs.block_tables, ends, sel, **run, **opts)
    blocks = (torch.arange(3, dtype=torch.int32, device=DEVICE), torch.ones(3, dtype=torch.int32, device=DEVICE),
              ends, sel)
    ref_opts = {k: v for k, v in opts.items() if k not in ("bank", "bank_rows")} | scales
    ref = sparse_attention_ref(q, k_cache, v_cache, seqs.block_tables, *blocks, **ref_opts)
    assert not expected.isnan().any()

    host, tables = offload(k_cache, v_cache, seqs.block_tables, scales)
    out = sparse_decode_attention(q, kv.with_host(host), tables, ends, sel, **run, **opts)
    assert torch.equal(out, expected)
    assert torch.equal(sparse_attention_ref(q, k_cache, v_cache, tables, *blocks, offload=host, **ref_opts), ref)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rope_style", ["none", "streaming"])
def test_prefill_reads_host_pages(rope_style, fp8):
    """Prefill blocks of 8 queries over offloaded pages, tiles loaded one ahead or not."""
    block_q, n_stream = 8, 8
    seqs = PagedSeqs([97, 203], 2, D, 4, seed=11 + fp8)
    k_cache, v_cache, scales = kv_caches(seqs, fp8)
    q = torch.randn(33, 6, D, generator=seqs.generator).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks([13, 20], block_q)
    sel = random_selection(seqs.generator, ends, N_SINK, n_stream, k=20)
    opts = dict(n_sink=N_SINK, n_stream=n_stream, scale=0.3, rope_style=rope_style, inv_freq=inv_freq(D))
    kv = PagedKV(k_cache, v_cache, **scales)
    blocks = (q_start, lens, ends, sel)
    expected = {p: sparse_prefill_attention(q, kv, tables, *blocks, block_q=block_q, block_n=16,
                                            prefetch=p, **opts) for p in (False, True)}
    ref = sparse_attention_ref(q, k_cache, v_cache, tables, *blocks, **opts, **scales)
    assert not expected[True].isnan().any()

    host, host_tables = offload(k_cache, v_cache, tables, scales)
    for prefetch in (False, True):
        out = sparse_prefill_attention(q, kv.with_host(host), host_tables, *blocks, block_q=block_q, block_n=16,
                                       prefetch=prefetch, **opts)
        assert torch.equal(out, expected[prefetch]), prefetch
    assert torch.equal(sparse_attention_ref(q, k_cache, v_cache, host_tables, *blocks, offload=host, **opts,
                                            **scales), ref)
