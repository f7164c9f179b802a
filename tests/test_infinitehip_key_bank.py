"""Rotated key bank (plugins/infinitehip/key_bank.py): the writer against its float64 reference,
and decode attention reading the bank against the gather + softmax reference — fresh, and after
the context grew with the selection cached."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.infinitehip import (sparse_attention_ref, sparse_decode_attention, write_key_bank,
                                        write_key_bank_ref)
from infhip.plugins.paged_kv import PagedKV

from .test_infinitehip_common import DEVICE, PagedSeqs, inv_freq, kv_caches, quantize_seqs, rel_err
from .test_infinitehip_sparse_attention import random_selection, run_selection

N_SINK, N_STREAM, D = 8, 24, 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_bank(seqs, slots, K, dtype):
    """A NaN-filled bank, so reading an entry the writer skipped poisons the output."""
    Hkv = seqs.k_cache.shape[2]
    return torch.full((slots, K, Hkv, D), float("nan"), dtype=dtype, device=DEVICE)


def decode_ref(seqs, q, ends, sel):
    B = q.shape[0]
    return sparse_attention_ref(q, seqs.k_cache, seqs.v_cache, seqs.block_tables,
                                torch.arange(B, dtype=torch.int32, device=DEVICE),
                                torch.ones(B, dtype=torch.int32, device=DEVICE), ends, sel,
                                n_sink=N_SINK, n_stream=N_STREAM, scale=0.3, rope_style="streaming",
                                inv_freq=inv_freq(D))


@pytest.mark.parametrize("selection", ["runs", "scattered"])
def test_writer_matches_reference(selection):
    seqs = PagedSeqs([150, 211], 2, D, 4, seed=11)
    ends = seqs.context_lens
    sel = (run_selection(seqs.generator, ends, N_SINK, N_STREAM, runs=9, run_len=4) if selection == "runs"
           else random_selection(seqs.generator, ends, N_SINK, N_STREAM, k=30))
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)  # slots out of order
    bank = make_bank(seqs, 3, sel.shape[1], torch.float32)
    ref = bank.clone()
    write_key_bank(seqs.paged, seqs.block_tables, ends, sel, bank, rows, n_sink=N_SINK, inv_freq=inv_freq(D),
                   rope_group=4)
    write_key_bank_ref(seqs.k_cache, seqs.block_tables, ends, sel, ref, rows, n_sink=N_SINK, inv_freq=inv_freq(D))
    written = ~ref.isnan()
    assert written.any() and torch.equal(bank.isnan(), ref.isnan()), "the writer skips exactly the non-middle entries"
    assert rel_err(bank[written], ref[written]) < 1e-6


def test_writer_skips_rows_pointed_at_the_scratch_row():
    """skip_row (the runtime's scratch row of requests without a bank row): those rows write
    nothing, the others exactly what they write without it."""
    seqs = PagedSeqs([150, 211, 97], 2, D, 4, seed=12)
    ends = seqs.context_lens
    sel = random_selection(seqs.generator, ends, N_SINK, N_STREAM, k=30)
    rows = torch.tensor([0, 2, 2], dtype=torch.int32, device=DEVICE)  # rows 1 and 2 share scratch row 2
    bank = make_bank(seqs, 3, sel.shape[1], torch.float32)
    ref = bank.clone()
    write_key_bank(seqs.paged, seqs.block_tables, ends, sel, bank, rows, n_sink=N_SINK, inv_freq=inv_freq(D),
                   skip_row=2)
    write_key_bank_ref(seqs.k_cache, seqs.block_tables, ends[:1], sel[:1], ref, rows[:1], n_sink=N_SINK,
                       inv_freq=inv_freq(D))
    assert bank[2].isnan().all() and bank[1].isnan().all(), "nothing written to the scratch (or unused) row"
    written = ~ref.isnan()
    assert written[0].any() and torch.equal(bank.isnan(), ref.isnan())
    assert rel_err(bank[written], ref[written]) < 1e-6


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("selection", ["runs", "scattered"])
def test_decode_with_bank_matches_reference(dtype, num_splits, selection, fp8):
    """The bank, the queries and (fp8 False) the caches in dtype == the reference. fp8: the caches
    in fp8 (sink and stream keys dequantized from the cache in the kernel, selected ones from the
    bank) == the reference on the dequantized caches."""
    seqs = PagedSeqs([150, 211, 97], 2, D, 4, seed=num_splits + (17 if fp8 else 7),
                     dtype=torch.float32 if fp8 else dtype)
    k_cache, v_cache, scales = kv_caches(seqs, fp8)
    kv = PagedKV(k_cache, v_cache, **scales)
    ends = seqs.context_lens
    sel = (run_selection(seqs.generator, ends, N_SINK, N_STREAM, runs=9, run_len=4) if selection == "runs"
           else random_selection(seqs.generator, ends, N_SINK, N_STREAM, k=30))
    rows = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEVICE)
    bank = make_bank(seqs, 4, sel.shape[1], dtype)
    write_key_bank(kv, seqs.block_tables, ends, sel, bank, rows, n_sink=N_SINK, inv_freq=inv_freq(D),
                   rope_group=4)
    q = torch.randn(3, 6, D, generator=seqs.generator).to(dtype).to(DEVICE)
    ref = decode_ref(seqs, q, ends, sel)
    for prefetch in (False, True):
        out = sparse_decode_attention(q, kv, seqs.block_tables, ends, sel, n_sink=N_SINK,
                                      n_stream=N_STREAM, scale=0.3, rope_style="streaming", inv_freq=inv_freq(D),
                                      num_splits=num_splits, block_n=16, bank=bank, bank_rows=rows, prefetch=prefetch)
        assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype], prefetch


def test_bank_stays_valid_while_the_context_grows():
    """A cached selection (mask caching): the bank written at context 190 serves steps at 191 ..
    211, where the stream (and every stream key's rank shift) has moved on and tokens the
    selection never saw entered the middle."""
    seqs = PagedSeqs([211], 2, D, 4, seed=3)
    written_at = torch.tensor([190], dtype=torch.int32, device=DEVICE)
    sel = run_selection(seqs.generator, written_at, N_SINK, N_STREAM, runs=12, run_len=4)
    rows = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    bank = make_bank(seqs, 1, sel.shape[1], torch.float32)
    write_key_bank(seqs.paged, seqs.block_tables, written_at, sel, bank, rows, n_sink=N_SINK,
                   inv_freq=inv_freq(D), rope_group=4)
    for end in (191, 200, 211):
        ends = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        q = torch.randn(1, 6, D, generator=seqs.generator).to(DEVICE)
        out = sparse_decode_attention(q, seqs.paged, seqs.block_tables, ends, sel,
                                      n_sink=N_SINK, n_stream=N_STREAM, scale=0.3, rope_style="streaming",
                                      inv_freq=inv_freq(D), num_splits=2, block_n=16, bank=bank, bank_rows=rows)
        assert rel_err(out, decode_ref(seqs, q, ends, sel)) < TOL[torch.float32]


def test_bank_needs_the_streaming_style():
    seqs = PagedSeqs([97], 2, D, 4, seed=1)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, N_STREAM, k=8)
    bank = make_bank(seqs, 1, sel.shape[1], torch.float32)
    q = torch.randn(1, 6, D, generator=seqs.generator).to(DEVICE)
    with pytest.raises(AssertionError, match="streaming RoPE style"):
        sparse_decode_attention(q, seqs.paged, seqs.block_tables, seqs.context_lens, sel,
                                n_sink=N_SINK, n_stream=N_STREAM, scale=0.3, bank=bank,
                                bank_rows=torch.zeros(1, dtype=torch.int32, device=DEVICE))


# ------------------------------------------------------------------------------ fp8 KV cache

@pytest.mark.parametrize("selection", ["runs", "scattered"])
def test_fp8_writer_matches_dequantized(selection):
    """An fp8 cache (kv_quant.py): the writer dequantizes (row scales after the rotation) into a
    bank in the queries' dtype == the reference on the dequantized float32 cache; the reference
    reading the fp8 cache itself agrees exactly."""
    seqs = PagedSeqs([150, 211], 2, D, 4, seed=13)
    fp8 = quantize_seqs(seqs)
    ends = seqs.context_lens
    sel = (run_selection(seqs.generator, ends, N_SINK, N_STREAM, runs=9, run_len=4) if selection == "runs"
           else random_selection(seqs.generator, ends, N_SINK, N_STREAM, k=30))
    rows = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    bank = make_bank(seqs, 3, sel.shape[1], torch.float32)
    ref, ref8 = bank.clone(), bank.clone()
    write_key_bank(fp8.paged, seqs.block_tables, ends, sel, bank, rows, n_sink=N_SINK, inv_freq=inv_freq(D),
                   rope_group=4)
    write_key_bank_ref(seqs.k_cache, seqs.block_tables, ends, sel, ref, rows, n_sink=N_SINK, inv_freq=inv_freq(D))
    write_key_bank_ref(fp8.k_cache, seqs.block_tables, ends, sel, ref8, rows, n_sink=N_SINK, inv_freq=inv_freq(D),
                       k_scale=fp8.k_scale)
    written = ~ref.isnan()
    assert written.any() and torch.equal(bank.isnan(), ref.isnan()) and torch.equal(ref8.isnan(), ref.isnan())
    assert rel_err(bank[written], ref[written]) < 1e-6
    assert torch.equal(ref8[written], ref[written])


def test_fp8_bank_is_never_fp8():
    seqs = PagedSeqs([97], 2, D, 4, seed=2)
    fp8 = quantize_seqs(seqs)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, N_STREAM, k=8)
    bank = make_bank(seqs, 1, sel.shape[1], torch.float32).to(fp8.k_cache.dtype)
    with pytest.raises(AssertionError, match="queries' dtype"):
        write_key_bank(fp8.paged, seqs.block_tables, seqs.context_lens, sel, bank,
                       torch.zeros(1, dtype=torch.int32, device=DEVICE), n_sink=N_SINK, inv_freq=inv_freq(D))


# ------------------------------------------------------------------------------ value bank

def _middle_only_pages(seqs, n_stream):
    """Physical pages of seqs holding no sink and no stream token (only middle tokens)."""
    ps, pages = seqs.k_cache.shape[1], set()
    for b, end in enumerate(seqs.context_lens.tolist()):
        lo, hi = -(-N_SINK // ps), (end - n_stream) // ps  # wholly after the sink, before the stream
        pages |= {int(p) for p in seqs.block_tables[b, lo:hi].tolist()}
    return sorted(pages)


@pytest.mark.parametrize("fp8", [False, True])
def test_value_bank_serves_every_selected_row(fp8):
    """write_key_bank(value_bank=) copies the selection's values (dequantized) == the reference;
    decode with both banks == decode with the key bank alone, and still does after every page
    holding only middle tokens turned NaN: the selected rows come from the banks alone."""
    seqs = PagedSeqs([150, 211, 97], 2, D, 4, seed=23 + fp8)
    k_cache, v_cache, scales = kv_caches(seqs, fp8)
    kv = PagedKV(k_cache, v_cache, **scales)
    ends = seqs.context_lens
    sel = run_selection(seqs.generator, ends, N_SINK, N_STREAM, runs=9, run_len=4)
    rows = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEVICE)
    bank, values = make_bank(seqs, 4, sel.shape[1], torch.float32), make_bank(seqs, 4, sel.shape[1], torch.float32)
    ref_bank, ref_values = bank.clone(), values.clone()
    kw = dict(n_sink=N_SINK, inv_freq=inv_freq(D))
    write_key_bank(kv, seqs.block_tables, ends, sel, bank, rows, rope_group=4, value_bank=values, **kw)
    write_key_bank_ref(k_cache, seqs.block_tables, ends, sel, ref_bank, rows, value_bank=ref_values, **kw,
                       k_scale=scales.get("k_scale"), v_cache=v_cache, v_scale=scales.get("v_scale"))
    assert torch.equal(values.isnan(), bank.isnan()) and (~values.isnan()).any()
    assert torch.equal(values[~values.isnan()], ref_values[~ref_values.isnan()])

    q = torch.randn(3, 6, D, generator=seqs.generator).to(DEVICE)
    run = dict(n_sink=N_SINK, n_stream=N_STREAM, scale=0.3, rope_style="streaming", inv_freq=inv_freq(D),
               num_splits=2, block_n=16, bank=bank, bank_rows=rows)
    keys_only = sparse_decode_attention(q, kv, seqs.block_tables, ends, sel, **run)
    both = sparse_decode_attention(q, kv, seqs.block_tables, ends, sel, value_bank=values, **run)
    assert torch.equal(both, keys_only)
    middle = _middle_only_pages(seqs, N_STREAM)
    assert middle, "the test must poison some pages"
    for t in (k_cache, v_cache, *scales.values()):
        t[middle] = float("nan")
    poisoned = sparse_decode_attention(q, kv, seqs.block_tables, ends, sel, value_bank=values, **run)
    assert torch.equal(poisoned, keys_only)
    assert sparse_decode_attention(q, kv, seqs.block_tables, ends, sel, **run).isnan().any(), \
        "without the value bank the poisoned pages are read"
