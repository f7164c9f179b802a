"""InfiniteHiP block-sparse attention: decode (split-K) and prefill kernels (interpreter on CPU)
against the gather + explicit-softmax reference, against dense attention when nothing is pruned,
decode == the last prefill query, sink/stream always attended, StreamingLLM RoPE."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.dense_attention import dense_attention_ref
from infhip.plugins.infinitehip import (PAD, initial_candidates, pruning_stage, sparse_attention_ref,
                                        sparse_decode_attention, sparse_prefill_attention,
                                        stream_starts)
from infhip.plugins.paged_kv import PagedKV

from .test_infinitehip_common import DEVICE, PagedSeqs, inv_freq, paged_args, quantize_seqs, rel_err

N_SINK = 4
SHAPES = [(6, 2, 16, 4), (4, 4, 32, 16)]  # Hq, Hkv, D, page_size
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def random_selection(g, ends, n_sink, n_stream, k, strays=True):
    """Up to k random sorted middle tokens per block, PAD-padded to k + 2; with strays, a sink
    token and a stream token too (what a cached mask holds once the stream moved on: the
    kernels must skip them, not count them twice)."""
    sel = torch.full((ends.shape[0], k + 2), PAD, dtype=torch.int32)
    for i, (e, s) in enumerate(zip(ends.tolist(), stream_starts(ends.cpu(), n_sink, n_stream).tolist())):
        middle = torch.arange(n_sink, max(s, n_sink))
        row = middle[torch.randperm(middle.numel(), generator=g)[:k]].sort().values
        if strays and s > n_sink:
            row = torch.cat([torch.tensor([1]), row, torch.tensor([e - 2])])
        sel[i, :row.numel()] = row
    return sel.to(DEVICE)


def kw(n_stream, scale=0.3, **extra):
    return dict(n_sink=N_SINK, n_stream=n_stream, scale=scale, **extra)


@pytest.mark.parametrize("Hq,Hkv,D,page_size", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("rope_style", ["none", "streaming"])
def test_decode_matches_reference(Hq, Hkv, D, page_size, num_splits, rope_style):
    seqs = PagedSeqs([97, 203, 6], Hkv, D, page_size, seed=D + num_splits)  # 6: all sink + stream
    q = torch.randn(3, Hq, D, generator=seqs.generator).to(DEVICE)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, 8, k=24)
    args = (q, seqs.k_cache, seqs.v_cache, seqs.block_tables)
    opts = kw(8, rope_style=rope_style, inv_freq=inv_freq(D))
    out = sparse_decode_attention(*paged_args(args), seqs.context_lens, sel, num_splits=num_splits, block_n=16, **opts)
    ones = torch.ones(3, dtype=torch.int32, device=DEVICE)
    ref = sparse_attention_ref(*args, torch.arange(3, dtype=torch.int32, device=DEVICE), ones,
                               seqs.context_lens, sel, **opts)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_decode_bf16_and_default_splits():
    seqs = PagedSeqs([203, 150], 2, 64, 16, seed=4, dtype=torch.bfloat16)
    q = torch.randn(2, 6, 64, generator=seqs.generator).to(torch.bfloat16).to(DEVICE)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, 16, k=40)
    args = (q, seqs.k_cache, seqs.v_cache, seqs.block_tables)
    out = sparse_decode_attention(*paged_args(args), seqs.context_lens, sel, **kw(16, scale=0.125))
    ref = sparse_attention_ref(*args, torch.arange(2, dtype=torch.int32, device=DEVICE),
                               torch.ones(2, dtype=torch.int32, device=DEVICE), seqs.context_lens, sel,
                               **kw(16, scale=0.125))
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("num_splits,rope_group", [(1, 1), (3, 1), (3, 4)])
def test_streaming_rope_tiles_of_sink_and_of_stream_only(num_splits, rope_group):
    """n_sink and n_stream of several 16-key tiles: tiles wholly in the sink (rank = token, delta
    0), wholly in the stream (one shared rank - token delta) and mixed ones (a delta per key) all
    match the reference, in decode and in prefill, with a sin/cos per key or per group of 4."""
    D, n_sink, n_stream = 32, 16, 40
    seqs = PagedSeqs([150, 211], 2, D, 4, seed=31 + num_splits)
    opts = dict(n_sink=n_sink, n_stream=n_stream, scale=0.3, rope_style="streaming", inv_freq=inv_freq(D))
    q = torch.randn(2, 6, D, generator=seqs.generator).to(DEVICE)
    sel = random_selection(seqs.generator, seqs.context_lens, n_sink, n_stream, k=30)
    args = (q, seqs.k_cache, seqs.v_cache, seqs.block_tables)
    out = sparse_decode_attention(*paged_args(args), seqs.context_lens, sel, num_splits=num_splits, block_n=16, rope_group=rope_group, **opts)
    ref = sparse_attention_ref(*args, torch.arange(2, dtype=torch.int32, device=DEVICE),
                               torch.ones(2, dtype=torch.int32, device=DEVICE), seqs.context_lens, sel, **opts)
    assert rel_err(out, ref) < TOL[torch.float32]
    q_start, lens, ends, tables = seqs.blocks([13, 20], 8)
    qp = torch.randn(33, 6, D, generator=seqs.generator).to(DEVICE)
    sel = random_selection(seqs.generator, ends, n_sink, n_stream, k=30)
    pargs = (qp, seqs.k_cache, seqs.v_cache, tables, q_start, lens, ends, sel)
    out = sparse_prefill_attention(*paged_args(pargs), block_q=8, block_n=16, rope_group=rope_group, **opts)
    assert rel_err(out, sparse_attention_ref(*pargs, **opts)) < TOL[torch.float32]


def run_selection(g, ends, n_sink, n_stream, runs, run_len):
    """Up to `runs` random runs of run_len consecutive middle tokens per block (what the last
    pruning stage's chunks give), sorted, PAD-padded; a short run where the middle ends."""
    sel = torch.full((ends.shape[0], runs * run_len), PAD, dtype=torch.int32)
    for i, s in enumerate(stream_starts(ends.cpu(), n_sink, n_stream).tolist()):
        starts = torch.arange(n_sink, max(s, n_sink), run_len)
        chosen = starts[torch.randperm(starts.numel(), generator=g)[:runs]].sort().values
        row = [t for c in chosen.tolist() for t in range(c, min(c + run_len, s))]
        sel[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return sel.to(DEVICE)


@pytest.mark.parametrize("selection", ["runs", "scattered"])
def test_streaming_rope_in_runs(selection):
    """rope_group = 4 (one sin/cos per run of 4 selected keys): tiles made of whole runs take the
    per-run path, tiles with scattered keys or a sink/stream edge the per-key one; both match the
    reference, in decode and in prefill."""
    D, n_sink, n_stream, group = 32, 8, 24, 4
    seqs = PagedSeqs([150, 211], 2, D, 4, seed=5 if selection == "runs" else 6)
    opts = dict(n_sink=n_sink, n_stream=n_stream, scale=0.3, rope_style="streaming", inv_freq=inv_freq(D))

    def select(ends):
        if selection == "runs":
            return run_selection(seqs.generator, ends, n_sink, n_stream, runs=9, run_len=group)
        return random_selection(seqs.generator, ends, n_sink, n_stream, k=30)

    q = torch.randn(2, 6, D, generator=seqs.generator).to(DEVICE)
    sel = select(seqs.context_lens)
    args = (q, seqs.k_cache, seqs.v_cache, seqs.block_tables)
    ref = sparse_attention_ref(*args, torch.arange(2, dtype=torch.int32, device=DEVICE),
                               torch.ones(2, dtype=torch.int32, device=DEVICE), seqs.context_lens, sel, **opts)
    for prefetch in (False, True):  # split-K with tiles loaded one ahead (a split's last tile too)
        out = sparse_decode_attention(*paged_args(args), seqs.context_lens, sel, num_splits=2, block_n=16, rope_group=group,
                                      prefetch=prefetch, **opts)
        assert rel_err(out, ref) < TOL[torch.float32], prefetch
    q_start, lens, ends, tables = seqs.blocks([13, 20], 8)
    qp = torch.randn(33, 6, D, generator=seqs.generator).to(DEVICE)
    sel = select(ends)
    pargs = (qp, seqs.k_cache, seqs.v_cache, tables, q_start, lens, ends, sel)
    out = sparse_prefill_attention(*paged_args(pargs), block_q=8, block_n=16, rope_group=group, **opts)
    assert rel_err(out, sparse_attention_ref(*pargs, **opts)) < TOL[torch.float32]


PREFILL = [(8, 8, [13, 20]), (16, 16, [16, 37])]  # block_q, n_stream, q_lens


@pytest.mark.parametrize("Hq,Hkv,D,page_size", SHAPES)
@pytest.mark.parametrize("block_q,n_stream,q_lens", PREFILL)
@pytest.mark.parametrize("rope_style", ["none", "streaming"])
def test_prefill_matches_reference(Hq, Hkv, D, page_size, block_q, n_stream, q_lens, rope_style):
    seqs = PagedSeqs([97, 203], Hkv, D, page_size, seed=block_q + D)
    q = torch.randn(sum(q_lens), Hq, D, generator=seqs.generator).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks(q_lens, block_q)
    sel = random_selection(seqs.generator, ends, N_SINK, n_stream, k=20)
    args = (q, seqs.k_cache, seqs.v_cache, tables, q_start, lens, ends, sel)
    opts = kw(n_stream, rope_style=rope_style, inv_freq=inv_freq(D))
    ref = sparse_attention_ref(*args, **opts)
    for prefetch in (False, True):  # each tile's tokens and pages loaded one tile ahead
        out = sparse_prefill_attention(*paged_args(args), block_q=block_q, block_n=16, prefetch=prefetch, **opts)
        assert rel_err(out, ref) < TOL[torch.float32], prefetch


def test_prefill_last_query_equals_decode():
    """The last query of a prefill block sees what a decode step at that length sees."""
    Hq, Hkv, D, block_q, n_stream = 6, 2, 16, 8, 8
    seqs = PagedSeqs([97, 203], Hkv, D, 4, seed=21)
    q = torch.randn(33, Hq, D, generator=seqs.generator).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks([13, 20], block_q)
    sel, _ = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, chunk_size=4, k=16,
                           block_q=block_q, n_sink=N_SINK, n_stream=n_stream)
    out = sparse_prefill_attention(q, seqs.paged, tables, q_start, lens, ends, sel,
                                   block_q=block_q, **kw(n_stream))
    last = (q_start + lens - 1).long()  # every block's last query
    dec = sparse_decode_attention(q[last].contiguous(), seqs.paged, tables, ends, sel,
                                  num_splits=3, block_n=16, **kw(n_stream))
    assert rel_err(dec, out[last]) < 1e-6


@pytest.mark.parametrize("Hq,Hkv,D,page_size", SHAPES)
def test_full_selection_equals_dense(Hq, Hkv, D, page_size):
    """Selecting the whole middle makes the key set every earlier token: dense attention, with
    the STREAMING RoPE a no-op (ranks are the original positions)."""
    block_q, n_stream, q_lens = 8, 8, [13, 20]
    seqs = PagedSeqs([97, 203], Hkv, D, page_size, seed=31 + D)
    q = torch.randn(sum(q_lens), Hq, D, generator=seqs.generator).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks(q_lens, block_q)
    sel, _ = initial_candidates(ends, N_SINK, n_stream)
    args = (q, seqs.k_cache, seqs.v_cache, tables, q_start, lens, ends, sel)
    expected, row = [], 0
    for b, ctx in enumerate(seqs.context_lens.tolist()):
        pos = torch.arange(ctx, device=DEVICE)
        expected.append(dense_attention_ref(q[row:row + q_lens[b]], seqs.keys[b], seqs.values[b],
                                            pos[ctx - q_lens[b]:], pos, 0.3))
        row += q_lens[b]
    expected = torch.cat(expected)
    for style in ("none", "streaming"):
        out = sparse_prefill_attention(*paged_args(args), block_q=block_q, **kw(n_stream, rope_style=style,
                                                                     inv_freq=inv_freq(D)))
        assert rel_err(out, expected) < 1e-5
    last = (q_start + lens - 1).long()[[1, 4]]  # the two sequences' newest tokens
    dec = sparse_decode_attention(q[last].contiguous(), seqs.paged, seqs.block_tables,
                                  seqs.context_lens, sel[[1, 4]].contiguous(), **kw(n_stream))
    assert rel_err(dec, expected[last]) < 1e-5


def test_sink_and_stream_always_attended():
    """Nothing selected: a query aligned with one sink key and one stream key attends to those two
    (values averaged); a middle key aligned even more strongly is not in the set and is ignored."""
    Hq, Hkv, D, ctx, n_stream = 2, 1, 16, 97, 8
    seqs = PagedSeqs([ctx], Hkv, D, 4, seed=2)
    seqs.k_cache *= 0.01
    q = torch.zeros(1, Hq, D, device=DEVICE)
    q[0, :, 0] = 1.0
    table = seqs.block_tables[0]
    for tok, strength in ((1, 20.0), (ctx - 3, 20.0), (50, 40.0)):  # sink, stream, middle
        seqs.k_cache[table[tok // 4], tok % 4, 0, 0] = strength
    sel = torch.full((1, 8), PAD, dtype=torch.int32, device=DEVICE)
    out = sparse_decode_attention(q, seqs.paged, seqs.block_tables, seqs.context_lens, sel,
                                  **kw(n_stream, scale=1.0))
    v = seqs.values[0][:, 0]
    assert rel_err(out[0, 0], (v[1] + v[ctx - 3]) / 2) < 1e-4


# ------------------------------------------------------------------------------ fp8 KV cache

FP8_SHAPES = [(6, 2, 16, 4, "none"), (6, 2, 24, 8, "none"), (6, 2, 16, 4, "streaming"),
              (3, 1, 32, 16, "streaming")]  # Hq, Hkv, D (24: not a power of two), page_size, rope style


@pytest.mark.parametrize("Hq,Hkv,D,page_size,rope_style", FP8_SHAPES)
def test_fp8_cache_decode_matches_dequantized(Hq, Hkv, D, page_size, rope_style):
    """fp8 caches with row scales (kv_quant.py): decode (split-K, tiles loaded one ahead or not)
    == the same attention on the dequantized float32 caches — the float64 reference, and
    without RoPE bit for bit the float32 kernel (the same dequantized keys and values); the
    reference reading the fp8 caches itself agrees exactly."""
    seqs = PagedSeqs([97, 203, 6], Hkv, D, page_size, seed=D + Hq)
    fp8 = quantize_seqs(seqs)
    q = torch.randn(3, Hq, D, generator=seqs.generator).to(DEVICE)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, 8, k=24)
    opts = kw(8, rope_style=rope_style, inv_freq=inv_freq(D))
    blocks = (torch.arange(3, dtype=torch.int32, device=DEVICE), torch.ones(3, dtype=torch.int32, device=DEVICE),
              seqs.context_lens, sel)
    ref = sparse_attention_ref(q, seqs.k_cache, seqs.v_cache, seqs.block_tables, *blocks, **opts)
    ref8 = sparse_attention_ref(q, fp8.k_cache, fp8.v_cache, seqs.block_tables, *blocks, **opts, **fp8.scales())
    assert torch.equal(ref8, ref)
    for num_splits, prefetch in ((1, False), (3, False), (3, True)):
        out = sparse_decode_attention(q, fp8.paged, seqs.block_tables, seqs.context_lens, sel,
                                      num_splits=num_splits, block_n=16, prefetch=prefetch, **opts)
        assert out.dtype == q.dtype and rel_err(out, ref) < TOL[torch.float32], (num_splits, prefetch)
        if rope_style == "none":
            plain = sparse_decode_attention(q, seqs.paged, seqs.block_tables, seqs.context_lens,
                                            sel, num_splits=num_splits, block_n=16, prefetch=prefetch, **opts)
            assert torch.equal(out, plain), (num_splits, prefetch)


@pytest.mark.parametrize("Hq,Hkv,D,page_size,rope_style", FP8_SHAPES)
@pytest.mark.parametrize("rope_group", [1, 4])
def test_fp8_cache_prefill_matches_dequantized(Hq, Hkv, D, page_size, rope_style, rope_group):
    """Prefill blocks over fp8 caches == the dequantized float32 caches (reference; without RoPE
    the float32 kernel bit for bit), prefetching or not, a sin/cos per key or per run of 4."""
    block_q, n_stream, q_lens = 8, 8, [13, 20]
    seqs = PagedSeqs([97, 203], Hkv, D, page_size, seed=3 * D + Hq)
    fp8 = quantize_seqs(seqs)
    q = torch.randn(sum(q_lens), Hq, D, generator=seqs.generator).to(DEVICE)
    q_start, lens, ends, tables = seqs.blocks(q_lens, block_q)
    sel = random_selection(seqs.generator, ends, N_SINK, n_stream, k=20)
    blocks = (tables, q_start, lens, ends, sel)
    opts = kw(n_stream, rope_style=rope_style, inv_freq=inv_freq(D))
    ref = sparse_attention_ref(q, seqs.k_cache, seqs.v_cache, *blocks, **opts)
    for prefetch in (False, True):
        out = sparse_prefill_attention(q, fp8.paged, *blocks, block_q=block_q, block_n=16,
                                       prefetch=prefetch, rope_group=rope_group, **opts)
        assert rel_err(out, ref) < TOL[torch.float32], prefetch
        if rope_style == "none":
            plain = sparse_prefill_attention(q, seqs.paged, *blocks, block_q=block_q, block_n=16,
                                             prefetch=prefetch, **opts)
            assert torch.equal(out, plain), prefetch


@pytest.mark.parametrize("rope_style", ["none", "streaming"])
def test_fp8_cache_with_bf16_queries(rope_style):
    """bf16 queries over fp8 caches (the serving case): dots in the queries' dtype, out bf16,
    within bf16 tolerance of the float64 reference on the dequantized caches."""
    D = 64
    seqs = PagedSeqs([203, 150], 2, D, 16, seed=4)
    fp8 = quantize_seqs(seqs)
    opts = kw(16, scale=0.125, rope_style=rope_style, inv_freq=inv_freq(D))
    q = torch.randn(2, 6, D, generator=seqs.generator).to(torch.bfloat16).to(DEVICE)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, 16, k=40)
    out = sparse_decode_attention(q, fp8.paged, seqs.block_tables, seqs.context_lens, sel,
                                  **opts)
    ref = sparse_attention_ref(q, seqs.k_cache, seqs.v_cache, seqs.block_tables,
                               torch.arange(2, dtype=torch.int32, device=DEVICE),
                               torch.ones(2, dtype=torch.int32, device=DEVICE), seqs.context_lens, sel, **opts)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOL[torch.bfloat16]
    q_start, lens, ends, tables = seqs.blocks([13, 20], 16)
    qp = torch.randn(33, 6, D, generator=seqs.generator).to(torch.bfloat16).to(DEVICE)
    sel = random_selection(seqs.generator, ends, N_SINK, 16, k=30)
    blocks = (tables, q_start, lens, ends, sel)
    out = sparse_prefill_attention(qp, fp8.paged, *blocks, block_q=16, **opts)
    ref = sparse_attention_ref(qp, seqs.k_cache, seqs.v_cache, *blocks, **opts)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < TOL[torch.bfloat16]


def test_fp8_cache_needs_its_scales():
    seqs = PagedSeqs([97], 2, 16, 4, seed=1)
    fp8 = quantize_seqs(seqs)
    q = torch.randn(1, 6, 16, generator=seqs.generator).to(DEVICE)
    sel = random_selection(seqs.generator, seqs.context_lens, N_SINK, 8, k=8)
    with pytest.raises(AssertionError, match="needs its k_scale"):
        sparse_decode_attention(q, PagedKV(fp8.k_cache, fp8.v_cache), seqs.block_tables, seqs.context_lens, sel,
                                **kw(8))
    with pytest.raises(AssertionError, match="scales are for fp8"):
        sparse_decode_attention(q, PagedKV(seqs.k_cache, seqs.v_cache, fp8.k_scale, fp8.v_scale),
                                seqs.block_tables, seqs.context_lens, sel, **kw(8))
