"""InfiniteHiP pruning stage: the Triton SelectRep kernel (interpreter on CPU) against the float64
torch reference, GQA, sink/stream exclusion, a 3-stage chain, query strides, ties, head
normalisation and fp8 keys. RoPE styles and raw keys: tests/test_infinitehip_pruning_rope.py."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.infinitehip import (PAD, pruning_stage, pruning_stage_ref, select_rep_scores,
                                        select_rep_scores_ref, stream_starts, topk_chunks,
                                        topk_chunks_ref)

from infhip.plugins.infinitehip import plan_query_blocks
from infhip.plugins.infinitehip.raw_keys import unrotate_keys
from infhip.plugins.paged_kv import PagedKV

from ._pruning_cases import (N_SINK, N_STREAM, QUERIES, SHAPES, chosen_chunk_scores, random_candidates, raw_keys_of,
                             setup)
from .test_infinitehip_common import DEVICE, PagedSeqs, inv_freq, quantize_seqs, rotate_by_ref


@pytest.mark.parametrize("Hq,Hkv,D,page_size", SHAPES)
@pytest.mark.parametrize("block_q,q_lens", QUERIES)
@pytest.mark.parametrize("chunk_size", [4, 8])
@pytest.mark.parametrize("explicit", [False, True])
def test_select_rep_matches_reference_exactly(Hq, Hkv, D, page_size, block_q, q_lens, chunk_size, explicit):
    """Dyadic inputs: every dot product is exact, so representatives and chunk scores must agree
    bit for bit, and the kept chunks must have the same scores (identical sets barring ties)."""
    seed = hash((Hq, D, block_q, chunk_size, explicit)) % 10_000
    seqs, q, (q_start, lens, ends, tables) = setup(Hq, Hkv, D, page_size, q_lens, block_q, seed, True)
    cand, cand_lens = random_candidates(seqs.generator, ends) if explicit else (None, None)
    kw = dict(chunk_size=chunk_size, n_sink=N_SINK, n_stream=N_STREAM)
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens,
                                     block_q=block_q, store_reps=True, **kw)
    ref_scores, ref_reps, _ = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, cand,
                                                    cand_lens, max_candidates=scores.shape[1] * chunk_size
                                                    if not explicit else None, **kw)
    assert torch.equal(scores.double().cpu()[:, :ref_scores.shape[1]], ref_scores)
    assert torch.equal(reps.cpu()[..., :ref_reps.shape[2]], ref_reps)
    if not explicit:
        cand_lens = (stream_starts(ends, N_SINK, N_STREAM) - N_SINK).clamp(min=0)
    k = 3 * chunk_size
    sel, n = topk_chunks(scores, cand, cand_lens, chunk_size=chunk_size, k=k, n_sink=N_SINK)
    ref_sel, ref_n = topk_chunks_ref(ref_scores, cand, cand_lens, chunk_size=chunk_size, k=k, n_sink=N_SINK)
    assert (chosen_chunk_scores(sel, n, cand, ref_scores, chunk_size)
            == chosen_chunk_scores(ref_sel, ref_n, cand, ref_scores, chunk_size))


@pytest.mark.parametrize("block_q,q_lens", QUERIES)
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("rope_style", ["none", "relative"])
def test_keys_as_rows_scores_the_same(block_q, q_lens, explicit, rope_style):
    """The transposed score tiles (keys_as_rows, a launch choice; stage 1's default for 32-128-row
    query tiles) give the same representatives and chunk scores as the default tiles and the
    reference: dyadic inputs without RoPE (exact dots), and un-rotated keys under RELATIVE (the
    prefill path), where they must match the default launch to float tolerance and the same
    winners. n_stream 2 < b_q: the causal mask inside the block is exercised too."""
    Hq, Hkv, D = 6, 2, 32
    seqs, q, (q_start, lens, ends, tables) = setup(Hq, Hkv, D, 16, q_lens, block_q, seed=11,
                                                   dyadic=rope_style == "none")
    cand, cand_lens = random_candidates(seqs.generator, ends) if explicit else (None, None)
    kw = dict(chunk_size=8, n_sink=N_SINK, n_stream=2, block_q=block_q, store_reps=True)
    if rope_style != "none":
        freq = inv_freq(D)
        kw.update(rope_style=rope_style, inv_freq=freq, raw_keys=raw_keys_of(seqs, q_lens, block_q, freq))
    base, base_reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens,
                                        keys_as_rows=False, **kw)
    rows, rows_reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens,
                                        keys_as_rows=True, **kw)
    assert torch.isfinite(base).any()
    if rope_style == "none":
        assert torch.equal(rows, base) and torch.equal(rows_reps, base_reps)
        ref_scores, ref_reps, _ = select_rep_scores_ref(
            q, seqs.k_cache, tables, q_start, lens, ends, cand, cand_lens, chunk_size=8, n_sink=N_SINK,
            n_stream=2, max_candidates=None if explicit else rows.shape[1] * 8)
        assert torch.equal(rows.double().cpu()[:, :ref_scores.shape[1]], ref_scores)
        assert torch.equal(rows_reps.cpu()[..., :ref_reps.shape[2]], ref_reps)
    else:
        torch.testing.assert_close(rows, base, rtol=1e-5, atol=1e-5)
        assert (rows_reps == base_reps).float().mean() > 0.95  # near-ties may flip a winner


@pytest.mark.parametrize("block_q,q_lens", QUERIES)
def test_candidates_in_runs_match_reference_exactly(block_q, q_lens):
    """Candidates as the previous stage leaves them, runs of consecutive tokens, some runs broken
    by a missing token and chunks straddling two runs: representatives and chunk scores bit for
    bit (dyadic inputs)."""
    seqs, q, (q_start, lens, ends, tables) = setup(6, 2, 16, 4, q_lens, block_q, seed=21, dyadic=True)
    g, rows = seqs.generator, []
    for s in stream_starts(ends.cpu(), N_SINK, N_STREAM).tolist():
        runs = torch.arange(N_SINK, max(s, N_SINK)).split(12)  # runs of 12: chunks of 8 straddle
        keep = [r for r in runs if torch.rand(1, generator=g) < 0.7]
        row = torch.cat([r[torch.arange(r.numel()) != int(torch.randint(r.numel(), (1,), generator=g))]
                         if torch.rand(1, generator=g) < 0.3 else r for r in keep])
        rows.append(row)
    cand = torch.full((len(rows), max(r.numel() for r in rows)), PAD, dtype=torch.int32)
    for i, r in enumerate(rows):
        cand[i, :r.numel()] = r
    cand, cand_lens = cand.to(DEVICE), torch.tensor([r.numel() for r in rows], dtype=torch.int32, device=DEVICE)
    kw = dict(chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM)
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens,
                                     block_q=block_q, store_reps=True, **kw)
    ref_scores, ref_reps, _ = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, cand,
                                                    cand_lens, **kw)
    assert torch.isfinite(ref_scores).any()
    assert torch.equal(scores.double().cpu()[:, :ref_scores.shape[1]], ref_scores)
    assert torch.equal(reps.cpu()[..., :ref_reps.shape[2]], ref_reps)


def test_topk_chunks_matches_reference():
    """Continuous random scores (no ties): identical survivors, ascending, PAD-padded, short last
    chunk and blocks with fewer chunks than K included."""
    g = torch.Generator().manual_seed(7)
    cand_lens = torch.tensor([37, 40, 9, 0], dtype=torch.int32)
    cand = torch.full((4, 43), PAD, dtype=torch.int32)
    for i, n in enumerate(cand_lens.tolist()):
        cand[i, :n] = torch.randperm(500, generator=g)[:n].sort().values
    scores = torch.randn(4, 11, generator=g)
    scores[torch.arange(11)[None, :] >= (cand_lens[:, None] + 3) // 4] = float("-inf")
    for c in (cand, None):
        sel, n = topk_chunks(scores, c, cand_lens, chunk_size=4, k=16, n_sink=N_SINK)
        ref_sel, ref_n = topk_chunks_ref(scores, c, cand_lens, chunk_size=4, k=16, n_sink=N_SINK)
        assert torch.equal(sel, ref_sel) and torch.equal(n, ref_n)
        assert n[2] == 9 and n[3] == 0 and 12 < n[0] <= 16 and n[1] == 16


def test_gqa_one_query_head_keeps_a_chunk():
    """Only q head 4 (kv head 1's second query head) sees a strong run of keys at offsets 4..7
    of one chunk: the tournament finds it for kv head 1 and the chunk is the one kept."""
    Hq, Hkv, D, page_size, ctx, chunk_size = 6, 2, 16, 4, 203, 8
    seqs = PagedSeqs([ctx], Hkv, D, page_size, seed=3)
    seqs.k_cache *= 0.05
    q = 0.05 * torch.randn(1, Hq, D, generator=seqs.generator).to(DEVICE)
    q[0, 4] = 0.0
    q[0, 4, 0] = 4.0
    run = [N_SINK + 12 * chunk_size + j for j in range(4, 8)]  # tokens 104..107
    for tok in run:
        page, row = seqs.block_tables[0, tok // page_size], tok % page_size
        seqs.k_cache[page, row, 1, 0] = 4.0
    q_start, lens, ends, tables = seqs.blocks([1], 1)
    kw = dict(chunk_size=chunk_size, n_sink=N_SINK, n_stream=N_STREAM, block_q=1)
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, store_reps=True, **kw)
    assert int(reps[0, 1, 12]) in run and scores[0].argmax() == 12
    sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, k=chunk_size, **kw)
    assert sel[0, :int(n[0])].tolist() == list(range(N_SINK + 96, N_SINK + 104))


@pytest.mark.parametrize("block_q,q_lens", QUERIES)
def test_three_stage_chain_keeps_k(block_q, q_lens):
    """(l_c, k) = (16, 64) -> (8, 32) -> (4, 16): every stage equals the reference chain, keeps
    sorted unique tokens of its input inside the middle (never sink or stream), and exactly k of
    them when the middle is a multiple of l_c (always more than k - l_c otherwise)."""
    stages = [(16, 64), (8, 32), (4, 16)]
    seqs, q, (q_start, lens, ends, tables) = setup(6, 2, 16, 4, q_lens, block_q, seed=11, dyadic=False,
                                                   contexts=(97, 204))
    s = stream_starts(ends, N_SINK, N_STREAM).cpu()
    sel = n = ref_sel = ref_n = None
    prev = [set(range(N_SINK, int(x))) for x in s]
    for chunk_size, k in stages:
        kw = dict(chunk_size=chunk_size, k=k, n_sink=N_SINK, n_stream=N_STREAM)
        sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, sel, n,
                               block_q=block_q, **kw)
        ref_sel, ref_n = pruning_stage_ref(q, seqs.k_cache, tables, q_start, lens, ends, ref_sel, ref_n, **kw)
        assert torch.equal(sel.cpu(), ref_sel) and torch.equal(n.cpu(), ref_n)
        for i in range(ends.shape[0]):
            toks = sel[i, :int(n[i])].cpu()
            assert (sel[i, int(n[i]):] == PAD).all() and (toks[1:] > toks[:-1]).all()
            assert set(toks.tolist()) <= prev[i] and (toks >= N_SINK).all() and (toks < s[i]).all()
            available = len(prev[i])
            if available <= k:
                assert int(n[i]) == available
            elif (int(s[i]) - N_SINK) % stages[0][0] == 0:
                assert int(n[i]) == k
            else:
                assert k - stages[0][0] < int(n[i]) <= k
            prev[i] = set(toks.tolist())
    assert any(int(x) - N_SINK == 192 for x in s)  # the aligned case (context 204) was exercised


def test_select_rep_causal_within_block():
    """n_stream < b_q: the newest candidates lie after the block's first queries, which must not
    score them (causal), exactly as in the reference."""
    seqs, q, (q_start, lens, ends, tables) = setup(6, 2, 16, 4, [13, 20], 8, seed=9, dyadic=True)
    kw = dict(chunk_size=4, n_sink=N_SINK, n_stream=2)
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_q=8,
                                     store_reps=True, **kw)
    ref_scores, ref_reps, _ = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, **kw)
    assert torch.equal(scores.double().cpu(), ref_scores) and torch.equal(reps.cpu(), ref_reps)


def test_tiles_and_tile_width_do_not_change_scores():
    """16 or 32 chunks per tile, one or several tiles per program (the query tile reused; a
    program's last tiles may lie past the row): the same chunk scores and representatives, bit
    for bit."""
    seqs, q, (q_start, lens, ends, tables) = setup(8, 4, 16, 4, [5, 9], 4, seed=11, dyadic=True)
    kw = dict(chunk_size=4, block_q=4, n_sink=N_SINK, n_stream=N_STREAM, store_reps=True)
    base = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_c=16, tiles=1, **kw)
    assert base[0].shape[1] > 32  # several tiles per row
    for block_c, tiles in ((16, 2), (16, 4), (32, 2)):
        other = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_c=block_c,
                                  tiles=tiles, **kw)
        assert torch.equal(other[0], base[0]) and torch.equal(other[1], base[1]), (block_c, tiles)


@pytest.mark.parametrize("query_stride", [3, 8])
@pytest.mark.parametrize("n_stream", [N_STREAM, 2])
def test_query_stride_matches_reference(query_stride, n_stream):
    """Every s-th query of a block scores (the last of each group, so short blocks too): kernel ==
    reference bit for bit on dyadic inputs, including n_stream < b_q (causality per sampled
    query), and the stride changes some scores (the subsample is really used)."""
    seqs, q, (q_start, lens, ends, tables) = setup(6, 2, 16, 4, [13, 20], 8, seed=21, dyadic=True)
    kw = dict(chunk_size=4, n_sink=N_SINK, n_stream=n_stream)
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_q=8,
                                     store_reps=True, query_stride=query_stride, **kw)
    ref_scores, ref_reps, _ = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends,
                                                    query_stride=query_stride, **kw)
    assert torch.equal(scores.double().cpu(), ref_scores) and torch.equal(reps.cpu(), ref_reps)
    full, _ = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_q=8, **kw)
    assert not torch.equal(scores, full)
    sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, block_q=8, k=8,
                           query_stride=query_stride, **kw)
    ref_sel, ref_n = pruning_stage_ref(q, seqs.k_cache, tables, q_start, lens, ends, k=8,
                                       query_stride=query_stride, **kw)
    assert torch.equal(n.cpu(), ref_n)


def test_topk_ties_keep_lower_chunks_and_exactly_k():
    """The fused top-k (bisection on the scores' int32 image): with ties at the boundary the
    lower chunk indices win, exactly K chunks are kept, negative scores and -inf order right,
    and a 3000-chunk row agrees with the torch path (distinct scores)."""
    scores = torch.tensor([[1.0, 3.0, 3.0, -2.0, 3.0, float("-inf"), 3.0, 0.5],
                           [-1.0, -0.5, -0.5, float("-inf"), -3.0, -0.5, -2.0, -0.25]]).to(DEVICE)
    lens = torch.tensor([8, 8], dtype=torch.int32, device=DEVICE)
    sel, n = topk_chunks(scores, None, lens, chunk_size=1, k=3, n_sink=0)
    assert sel.cpu().tolist() == [[1, 2, 4], [1, 2, 7]] and n.cpu().tolist() == [3, 3]
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 3000, generator=g).to(DEVICE)
    wide_lens = torch.tensor([3000 * 2, 2999 * 2 - 1], dtype=torch.int32, device=DEVICE)
    got = topk_chunks(wide, None, wide_lens, chunk_size=2, k=512, n_sink=4)
    want = topk_chunks_ref(wide.cpu(), None, wide_lens.cpu(), chunk_size=2, k=512, n_sink=4)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_head_normalized_scores_match_reference_and_rescue_a_quiet_head():
    """chunk_score="head_normalized": per kv head, scores minus that head's best chunk, then the
    max over heads — Triton equals the float64 reference bit for bit (dyadic inputs), and a kv
    head whose logits are 8x smaller than the other's still gets its best chunk kept, which the
    raw max (the paper's score) drops."""
    seqs, q, (q_start, lens, ends, tables) = setup(4, 2, 16, 4, [1, 1], 1, seed=5, dyadic=True)
    kw = dict(chunk_size=4, n_sink=N_SINK, n_stream=N_STREAM)
    got, _ = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_q=1, head_normalized=True, **kw)
    ref, _, _ = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, head_normalized=True,
                                      max_candidates=got.shape[1] * 4, **kw)
    assert torch.equal(got.double().cpu()[:, :ref.shape[1]], ref)
    assert (got[:, :ref.shape[1]].cpu().amax(1) == 0).all()  # some head's best chunk scores 0

    # kv head 0: loud (logit 8 on chunk 0 keys, 4 elsewhere); kv head 1: quiet (1 on chunk 5 only)
    ctx, D = 48, 16
    k = torch.zeros(ctx, 2, D)
    k[:, 0, 0] = 4.0
    k[N_SINK:N_SINK + 4, 0, 0] = 8.0
    k[N_SINK + 20:N_SINK + 24, 1, 1] = 1.0
    page = 4
    k_cache = k.view(ctx // page, page, 2, D).to(DEVICE)
    table = torch.arange(ctx // page, dtype=torch.int32, device=DEVICE)[None]
    qq = torch.zeros(1, 4, D, device=DEVICE)
    qq[0, :2, 0] = 1.0  # q heads 0-1 -> kv head 0
    qq[0, 2:, 1] = 1.0  # q heads 2-3 -> kv head 1
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    e = torch.tensor([ctx], dtype=torch.int32, device=DEVICE)
    args = (qq, PagedKV(k_cache, None), table, one * 0, one, e)
    for normalized, want in ((False, False), (True, True)):
        sel, n = pruning_stage(*args, chunk_size=4, k=8, block_q=1, n_sink=N_SINK, n_stream=N_STREAM,
                               head_normalized=normalized)
        assert (N_SINK + 20 in sel[0, :int(n[0])].tolist()) == want


# ------------------------------------------------------------------------------ fp8 KV cache

@pytest.mark.parametrize("rope_style,raw", [("none", False), ("relative", False), ("relative", True),
                                            ("chunk_indexed", False), ("chunk_indexed", True)])
@pytest.mark.parametrize("block_q,q_lens", QUERIES)
@pytest.mark.parametrize("explicit", [False, True])
def test_fp8_select_rep_matches_dequantized(rope_style, raw, block_q, q_lens, explicit):
    """Keys from an fp8 cache (kv_quant.py; row scales after the in-kernel rotation) or from
    RawKeys un-rotated out of it (dequantized into the queries' dtype) == the float64 reference on
    the dequantized float32 cache (representatives where the tournament is not a near-tie); the
    reference reading the fp8 cache agrees exactly; without RoPE the float32 kernel on the
    dequantized cache agrees bit for bit (the same keys), and so does the whole stage."""
    Hq, Hkv, D, page_size = 6, 2, 32, 8
    seqs, q, (q_start, lens, ends, tables) = setup(Hq, Hkv, D, page_size, q_lens, block_q, seed=23, dyadic=False,
                                                   contexts=(97, 150))
    fp8 = quantize_seqs(seqs)
    cand, cand_lens = random_candidates(seqs.generator, ends) if explicit else (None, None)
    freq = inv_freq(D)
    kw = dict(chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM, rope_style=rope_style, inv_freq=freq)
    raw_keys = None
    if raw:
        seq = plan_query_blocks(q_lens, seqs.context_lens.tolist(), block_q, DEVICE)[3]
        raw_keys = unrotate_keys(fp8.paged, seqs.block_tables, seqs.context_lens.tolist(), freq, seq.long(),
                                 dtype=q.dtype)
    scores, reps = select_rep_scores(q, fp8.paged, tables, q_start, lens, ends, cand, cand_lens, block_q=block_q,
                                     store_reps=True, raw_keys=raw_keys, **kw)
    width = None if explicit else scores.shape[1] * 8
    ref_scores, ref_reps, margins = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, cand,
                                                          cand_lens, max_candidates=width, **kw)
    ref8 = select_rep_scores_ref(q, fp8.k_cache, tables, q_start, lens, ends, cand, cand_lens, max_candidates=width,
                                 k_scale=fp8.k_scale, **kw)
    assert torch.equal(ref8[0], ref_scores) and torch.equal(ref8[1], ref_reps)
    assert torch.isfinite(ref_scores).any()
    assert torch.allclose(scores.double().cpu()[:, :ref_scores.shape[1]], ref_scores, rtol=1e-5, atol=1e-5)
    clear = margins > 1e-4
    assert clear.float().mean() > 0.9 and torch.equal(reps.cpu()[..., :ref_reps.shape[2]][clear], ref_reps[clear])
    if rope_style == "none":
        plain = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens, block_q=block_q,
                                  store_reps=True, **kw)
        assert torch.equal(scores, plain[0]) and torch.equal(reps, plain[1])
        stage = dict(chunk_size=8, k=24, block_q=block_q, n_sink=N_SINK, n_stream=N_STREAM)
        got = pruning_stage(q, fp8.paged, tables, q_start, lens, ends, cand, cand_lens, **stage)
        want = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens, **stage)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fp8_unrotate_keys_dequantizes():
    """RawKeys of an fp8 cache hold R(-p) of the dequantized keys in the given dtype (the
    queries'), never fp8; an fp8 cache without dtype= is refused."""
    seqs = PagedSeqs([37, 70], 2, 16, 4, seed=5)
    fp8 = quantize_seqs(seqs)
    freq = inv_freq(16)
    seq = plan_query_blocks([5, 9], seqs.context_lens.tolist(), 4, DEVICE)[3].long()
    want = torch.cat([rotate_by_ref(k.cpu(), -torch.arange(k.shape[0]), freq.cpu()) for k in seqs.keys])
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2)):
        raw = unrotate_keys(fp8.paged, seqs.block_tables, seqs.context_lens.tolist(), freq, seq, dtype=dtype)
        assert raw.keys.dtype == dtype and raw.block_base.tolist() == [0, 0, 37, 37, 37]
        assert torch.allclose(raw.keys.double().cpu(), want, atol=tol, rtol=tol)
    with pytest.raises(AssertionError, match="needs dtype="):
        unrotate_keys(fp8.paged, seqs.block_tables, seqs.context_lens.tolist(), freq, seq)
