"""The key-reading InfiniteHiP kernels over an offloaded cache (plugins/kv_offload.py): pruning
(SelectRep), un-rotated raw keys and the rotated key bank read host pages named by table entries
< 0. Every other page moves to a host twin and its GPU copy is NaN-poisoned (tests/_offload.py),
so a kernel that reads the wrong pool changes its output: the same kernel over the same values
must give *equal* results, and each torch reference over the merged pool equals itself without
offloading."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.infinitehip import (plan_query_blocks, pruning_stage, pruning_stage_ref, write_key_bank,
                                        write_key_bank_ref)
from infhip.plugins.infinitehip.raw_keys import unrotate_keys
from infhip.plugins.paged_kv import PagedKV

from ._offload import offload_pages
from .test_infinitehip_common import DEVICE, PagedSeqs, inv_freq, kv_caches, random_rows
from .test_infinitehip_sparse_attention import random_selection

N_SINK, N_STREAM = 4, 8
HQ, HKV, D, PAGE = 6, 2, 16, 4
CONTEXTS = [61, 97]


def make_cache(fp8: bool, seed: int):
    """(seqs, k_cache, v_cache, k_scale, v_scale): float32 caches, or fp8 ones with row scales."""
    seqs = PagedSeqs(CONTEXTS, HKV, D, PAGE, seed)
    k_cache, v_cache, scales = kv_caches(seqs, fp8)
    return seqs, k_cache, v_cache, scales.get("k_scale"), scales.get("v_scale")


def offload(seqs, k_cache, v_cache, k_scale, v_scale):
    """Every other page of each sequence to a host twin (GPU copies NaN): (host, seq tables)."""
    return offload_pages(k_cache, v_cache, seqs.block_tables, k_scale=k_scale, v_scale=v_scale)


def assert_same(a, b):
    """Bit-equal, NaN where the other is NaN (unwritten bank entries)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def two_stages(stage, q, cache, tables, q_start, lens, ends, **kw):
    """Stage 1 over the whole middle (implicit candidates), then a stage over its survivors
    (explicit candidates): (sel1, n1, sel2, n2). cache: the launcher's PagedKV, the reference's
    k_cache."""
    first = stage(q, cache, tables, q_start, lens, ends, chunk_size=8, k=24, n_sink=N_SINK, n_stream=N_STREAM,
                  **kw)
    second = stage(q, cache, tables, q_start, lens, ends, *first, chunk_size=2, k=8, n_sink=N_SINK,
                   n_stream=N_STREAM, **kw)
    return (*first, *second)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rope_style", ["none", "relative", "chunk_indexed"])
@pytest.mark.parametrize("block_q,q_lens", [(1, [1, 1]), (8, [5, 11])])
def test_pruning_stage_reads_host_pages(block_q, q_lens, rope_style, fp8):
    """Decode and prefill blocks, every RoPE style (keys re-rotated in the kernel), plain and fp8
    caches: both stages equal before and after offloading, kernel and reference."""
    seqs, k_cache, v_cache, k_scale, v_scale = make_cache(fp8, seed=block_q + 3 * fp8)
    q = random_rows(seqs.generator, (sum(q_lens), HQ, D)).to(DEVICE)
    q_start, lens, ends, seq = plan_query_blocks(q_lens, CONTEXTS, block_q, DEVICE)
    kw = dict(rope_style=rope_style, inv_freq=inv_freq(D))
    kv = PagedKV(k_cache, v_cache, k_scale, v_scale)
    tables = seqs.block_tables[seq.long()]
    want = two_stages(pruning_stage, q, kv, tables, q_start, lens, ends, block_q=block_q, **kw)
    want_ref = two_stages(pruning_stage_ref, q, k_cache, tables, q_start, lens, ends, k_scale=k_scale, **kw)
    assert (want[3] > 0).all()

    host, seq_tables = offload(seqs, k_cache, v_cache, k_scale, v_scale)
    tables = seq_tables[seq.long()]
    got = two_stages(pruning_stage, q, kv.with_host(host), tables, q_start, lens, ends, block_q=block_q, **kw)
    got_ref = two_stages(pruning_stage_ref, q, k_cache, tables, q_start, lens, ends, offload=host, k_scale=k_scale,
                         **kw)
    for a, b in zip(got + got_ref, want + want_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fp8", [False, True])
def test_unrotate_keys_reads_host_pages(fp8, monkeypatch):
    """RawKeys from host pages equal those from GPU pages, Triton and the torch path alike (its
    merged pool); pruning from them (the prefill path, no page tables) is unchanged."""
    seqs, k_cache, v_cache, k_scale, v_scale = make_cache(fp8, seed=5 + fp8)
    freq, lens = inv_freq(D), CONTEXTS
    q_start, q_lens, ends, seq = plan_query_blocks([5, 11], lens, 8, DEVICE)
    kv = PagedKV(k_cache, v_cache, k_scale, v_scale)

    def both_paths(tables, host=None):
        raw = unrotate_keys(kv.with_host(host), tables, lens, freq, seq.long(), dtype=torch.float32)
        with monkeypatch.context() as m:
            m.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: the torch path
            raw_torch = unrotate_keys(kv.with_host(host), tables, lens, freq, seq.long(), dtype=torch.float32)
        return raw, raw_torch

    want, want_torch = both_paths(seqs.block_tables)
    host, tables = offload(seqs, k_cache, v_cache, k_scale, v_scale)
    got, got_torch = both_paths(tables, host)
    assert torch.isfinite(want.keys).all()
    assert torch.equal(got.keys, want.keys) and torch.equal(got.block_base, want.block_base)
    assert torch.equal(got_torch.keys, want_torch.keys)

    q = random_rows(seqs.generator, (16, HQ, D)).to(DEVICE)
    stage = dict(chunk_size=4, k=16, block_q=8, n_sink=N_SINK, n_stream=N_STREAM, rope_style="relative",
                 inv_freq=freq)
    a = pruning_stage(q, kv, seqs.block_tables[seq.long()], q_start, q_lens, ends, raw_keys=want, **stage)
    b = pruning_stage(q, kv.with_host(host), tables[seq.long()], q_start, q_lens, ends, raw_keys=got, **stage)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("fp8", [False, True])
def test_write_key_bank_reads_host_pages(fp8):
    """The rotated key bank written from host pages equals the one from GPU pages (kernel and
    reference), skipped entries still unwritten."""
    seqs, k_cache, v_cache, k_scale, v_scale = make_cache(fp8, seed=7 + fp8)
    ends = seqs.context_lens
    sel = random_selection(seqs.generator, ends, N_SINK, N_STREAM, k=21)
    rows = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    kw = dict(n_sink=N_SINK, inv_freq=inv_freq(D))
    kv = PagedKV(k_cache, v_cache, k_scale, v_scale)

    def banks(tables, host=None):
        bank = torch.full((2, sel.shape[1], HKV, D), float("nan"), device=DEVICE)
        ref = bank.clone()
        write_key_bank(kv.with_host(host), tables, ends, sel, bank, rows, rope_group=2, **kw)
        write_key_bank_ref(k_cache, tables, ends, sel, ref, rows, offload=host, k_scale=k_scale, **kw)
        return bank, ref

    want, want_ref = banks(seqs.block_tables)
    host, tables = offload(seqs, k_cache, v_cache, k_scale, v_scale)
    got, got_ref = banks(tables, host)
    assert (~want.isnan()).any() and torch.equal(want.isnan(), want_ref.isnan())
    assert_same(got, want)
    assert_same(got_ref, want_ref)
