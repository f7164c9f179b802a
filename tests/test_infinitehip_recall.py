"""Attention recall: 1 for the full key set, strictly between 0 and 1 for a sparse one; masks and
index lists agree; and the 3-stage pruning chain finds planted needles that streaming alone misses."""

from __future__ import annotations

import torch

from infhip.plugins.infinitehip import (PAD, attention_recall, initial_candidates, per_query_key_mask,
                                        pruning_stage)

from .test_infinitehip_common import DEVICE, PagedSeqs

NEEDLES = (4 + 32 * 2, 4 + 32 * 9 + 16, 4 + 32 * 20, 4 + 32 * 28 + 16)  # stage-1 chunk offsets 0 / 16


def test_recall_full_set_is_one_and_sparse_is_partial():
    g = torch.Generator().manual_seed(0)
    Lq, Lk, Hq, Hkv, D = 5, 61, 6, 2, 16
    q, k = torch.randn(Lq, Hq, D, generator=g), torch.randn(Lk, Hkv, D, generator=g)
    per_head, mean = attention_recall(q, k, torch.ones(Lq, Lk, dtype=torch.bool), scale=0.25)
    assert per_head.shape == (Hq,) and torch.allclose(per_head, torch.ones(Hq, dtype=torch.float64))
    keep = torch.rand(Lq, Lk, generator=g) < 0.3
    per_head, mean = attention_recall(q, k, keep, scale=0.25)
    assert (per_head > 0).all() and (per_head < 1).all() and 0 < mean < 1
    # the same set as index lists (PAD entries ignored) and as a per-head mask
    idx = torch.full((Lq, Lk + 2), PAD, dtype=torch.int64)
    for t in range(Lq):
        kept = keep[t].nonzero()[:, 0]
        idx[t, :kept.numel()] = kept
    assert torch.allclose(attention_recall(q, k, idx, scale=0.25)[0], per_head)
    assert torch.allclose(attention_recall(q, k, keep.expand(Hq, Lq, Lk), scale=0.25)[0], per_head)


def test_pruning_chain_recovers_planted_needles():
    """Four runs of 4 keys that one query head strongly attends to, scattered over a 1000-token
    middle: stages (32, 256) -> (8, 64) -> (4, 16) keep exactly those runs, so the final key set
    holds far more attention mass than sink + stream alone. The runs start at offset 0 or 16 of
    a stage-1 chunk, tokens SelectRep compares (a run elsewhere in a chunk of otherwise random
    keys may be missed: the tournament assumes neighbouring keys score alike)."""
    Hq, Hkv, D, page_size, ctx = 4, 2, 16, 16, 1037
    n_sink, n_stream = 4, 16
    seqs = PagedSeqs([ctx], Hkv, D, page_size, seed=8)
    g = seqs.generator
    seqs.k_cache *= 0.3
    q = 0.3 * torch.randn(1, Hq, D, generator=g).to(DEVICE)
    q[0, 3, :4] = 4.0
    table = seqs.block_tables[0]
    for start in NEEDLES:
        for tok in range(start, start + 4):
            seqs.k_cache[table[tok // page_size], tok % page_size, 1, :4] = 2.0
    q_start, lens, ends, tables = seqs.blocks([1], 1)
    sel = n = None
    for chunk_size, k in ((32, 256), (8, 64), (4, 16)):
        sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, sel, n, chunk_size=chunk_size,
                               k=k, block_q=1, n_sink=n_sink, n_stream=n_stream)
    kept = set(sel[0, :int(n[0])].tolist())
    assert kept == {t for start in NEEDLES for t in range(start, start + 4)}

    keys = seqs.keys[0].clone()
    keys *= 0.3
    for start in NEEDLES:
        keys[start:start + 4, 1, :4] = 2.0
    mask = per_query_key_mask(sel.cpu(), lens.cpu(), ends.cpu(), n_sink, n_stream, ctx)
    empty = torch.full_like(sel, PAD).cpu()
    streaming_only = per_query_key_mask(empty, lens.cpu(), ends.cpu(), n_sink, n_stream, ctx)
    full = per_query_key_mask(initial_candidates(ends, n_sink, n_stream)[0].cpu(), lens.cpu(), ends.cpu(),
                              n_sink, n_stream, ctx)
    recall, _ = attention_recall(q.cpu(), keys.cpu(), mask, scale=D ** -0.5)
    baseline, _ = attention_recall(q.cpu(), keys.cpu(), streaming_only, scale=D ** -0.5)
    assert torch.allclose(attention_recall(q.cpu(), keys.cpu(), full, scale=D ** -0.5)[0],
                          torch.ones(Hq, dtype=torch.float64))
    assert recall[3] > 0.9 and baseline[3] < 0.2  # the needle head
    assert (recall >= baseline).all() and (recall < 1).all()
