"""InfiniteHiP mask layouts (blocks.MASK_LAYOUTS, issue 32): one chunk selection per query block
("shared"), per kv head ("kv_head") or per query head ("q_head", hip-attention's layout). Per
stage the Triton kernels (interpreter on CPU) equal the float64 reference for GQA groups 1, 2
and 7; end to end, stages -> block-sparse attention equals dense attention over each head's own
key set; a quiet q head keeps its chunk only with its own budget; shared stays what it was."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.infinitehip import (PAD, block_key_mask, mask_heads, plan_query_blocks, pruning_stage,
                                        pruning_stage_ref, select_rep_scores, select_rep_scores_ref,
                                        sparse_attention_ref, sparse_decode_attention, sparse_prefill_attention)
from infhip.plugins.infinitehip.pruning import topk_chunks
from infhip.plugins.infinitehip.raw_keys import unrotate_keys
from infhip.plugins.paged_kv import PagedKV

from .test_infinitehip_common import DEVICE, PagedSeqs, inv_freq, quantize_seqs, random_rows, rel_err

N_SINK, N_STREAM = 4, 8
GROUPS = [(3, 3), (4, 2), (7, 1)]  # Hq, Hkv: GQA groups 1, 2, 7
STAGES = [(8, 48), (4, 16)]  # (l_c, k): a two-stage chain, stage 2 from stage 1's per-head rows
BLOCK_Q = 8


def setup(Hq, Hkv, D, seed, dyadic=True):
    """Two sequences (odd contexts 45 and 77); query blocks of b_q = 8: one query of the first
    (a partial block) and a prefill chunk of 8 queries of the second. Returns
    (seqs, q, (q_start, q_lens, ends, tables), the blocks' sequences)."""
    seqs = PagedSeqs([45, 77], Hkv, D, 4, seed, dyadic=dyadic)
    q_lens = [1, 8]
    q = random_rows(seqs.generator, (sum(q_lens), Hq, D), dyadic).to(DEVICE)
    seq = plan_query_blocks(q_lens, seqs.context_lens.tolist(), BLOCK_Q)[3]
    return seqs, q, seqs.blocks(q_lens, BLOCK_Q), seq


def dense_over_head_sets(q, seqs, seq, q_start, lens, ends, sel, scale):
    """Dense float64 attention where q head h of a block (of sequence seq[i]) sees exactly sink |
    sel[block, m(h)] | stream (blocks.block_key_mask of its own row), causal: float32 [T, Hq, D].
    No sparse code."""
    T, Hq, D = q.shape
    Hkv, H = seqs.k_cache.shape[2], sel.shape[1]
    out = torch.zeros(T, Hq, D)
    for i in range(ends.shape[0]):
        b = int(seq[i])
        e, q_len, q0 = int(ends[i]), int(lens[i]), int(q_start[i])
        keys, values = seqs.keys[b][:e].double().cpu(), seqs.values[b][:e].double().cpu()
        for h in range(Hq):
            m = h * H // Hq
            allowed = block_key_mask(sel[i:i + 1, m].cpu(), ends[i:i + 1].cpu(), N_SINK, N_STREAM, e)[0]
            for t in range(q_len):
                pos = e - q_len + t
                visible = allowed & (torch.arange(e) <= pos)
                logits = keys[visible, h * Hkv // Hq] @ q[q0 + t, h].double().cpu() * scale
                out[q0 + t, h] = (torch.softmax(logits, 0) @ values[visible, h * Hkv // Hq]).float()
    return out


# GQA groups 1, 2, 7 per layout; with group 1 kv_head and q_head are the same launches (H = Hq =
# Hkv), and shared at groups 1 and 2 is tested in test_infinitehip_pruning / _sparse_attention.
CASES = [("kv_head", *GROUPS[0]), ("kv_head", *GROUPS[1]), ("kv_head", *GROUPS[2]), ("q_head", *GROUPS[1]),
         ("q_head", *GROUPS[2]), ("shared", *GROUPS[2])]


@pytest.mark.parametrize("layout,Hq,Hkv", CASES)
def test_stages_then_attention_match_references(layout, Hq, Hkv):
    """Dyadic inputs (exact dots, so ties resolve alike): per stage the Triton survivors [NB, H, k]
    and counts [NB, H] (shared: [NB, k], [NB]) equal the float64 reference's, stage 2 reading
    stage 1's per-head rows; rows sorted, PAD-padded, inside the middle; the heads choose apart.
    Then block-sparse attention on those masks, prefill and split-K decode (each block's last
    query: it sees what a decode step at the block's end sees), equals dense float64 attention
    restricted to each head's own key set."""
    D = 24  # not a power of two
    seqs, q, (q_start, lens, ends, tables), seq = setup(Hq, Hkv, D, seed=Hq + 7 * Hkv)
    H = mask_heads(layout, Hq, Hkv)
    NB, shape = ends.shape[0], (() if layout == "shared" else (H,))
    sel = n = ref_sel = ref_n = None
    for chunk_size, k in STAGES:
        kw = dict(chunk_size=chunk_size, k=k, n_sink=N_SINK, n_stream=N_STREAM, mask_layout=layout)
        sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, sel, n, block_q=BLOCK_Q, **kw)
        ref_sel, ref_n = pruning_stage_ref(q, seqs.k_cache, tables, q_start, lens, ends, ref_sel, ref_n, **kw)
        assert sel.shape == (NB, *shape, k) and n.shape == (NB, *shape)
        assert torch.equal(sel.cpu(), ref_sel) and torch.equal(n.cpu(), ref_n)
    heads, counts = (sel, n) if shape else (sel[:, None], n[:, None])
    s = torch.maximum(ends.long().clamp(max=N_SINK), ends.long() - N_STREAM).cpu()
    for i in range(NB):
        for h in range(heads.shape[1]):
            toks = heads[i, h, :int(counts[i, h])].cpu().long()
            assert (heads[i, h, int(counts[i, h]):] == PAD).all() and (toks[1:] > toks[:-1]).all()
            assert (toks >= N_SINK).all() and (toks < s[i]).all() and int(counts[i, h]) > 0
    if H > 1:  # the per-head rows are not one row repeated
        assert any(not torch.equal(heads[i, 0], heads[i, h]) for i in range(NB) for h in range(1, H))

    scale = D ** -0.5
    out = sparse_prefill_attention(q, seqs.paged, tables, q_start, lens, ends, sel, block_q=BLOCK_Q, n_sink=N_SINK,
                                   n_stream=N_STREAM, scale=scale, block_n=16)
    assert rel_err(out, dense_over_head_sets(q, seqs, seq, q_start, lens, ends, heads, scale)) < 1e-5
    last = (q_start + lens - 1).long()  # decode rows: each block's last query
    rows = torch.arange(NB, dtype=torch.int32, device=DEVICE)
    out = sparse_decode_attention(q[last].contiguous(), seqs.paged, tables, ends, sel, n_sink=N_SINK,
                                  n_stream=N_STREAM, scale=scale, num_splits=2, block_n=16)
    want = dense_over_head_sets(q[last], seqs, seq, rows, torch.ones_like(rows), ends, heads, scale)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("layout", ["kv_head", "q_head"])
def test_decode_pruning_and_streaming_rope_attention(layout):
    """Decode blocks (b_q 1, each block's last query) under RELATIVE pruning RoPE: the per-head
    stage equals the reference (these inputs have no float near-tie); STREAMING attention
    (keys moved to their rank within each head's own key set) on per-head masks, decode and
    prefill, equals the reference."""
    Hq, Hkv, D = 4, 2, 16
    seqs, q, (q_start, lens, ends, tables), _ = setup(Hq, Hkv, D, seed=5, dyadic=False)
    freq = inv_freq(D)
    NB = ends.shape[0]
    rows = torch.arange(NB, dtype=torch.int32, device=DEVICE)
    qd = q[(q_start + lens - 1).long()].contiguous()
    prune = dict(chunk_size=4, k=20, n_sink=N_SINK, n_stream=N_STREAM, mask_layout=layout, rope_style="relative",
                 inv_freq=freq)
    dec = (qd, seqs.paged, tables, rows, torch.ones_like(rows), ends)
    scores, _ = select_rep_scores(*dec, block_q=1, **{k: v for k, v in prune.items() if k != "k"})
    ref_scores, _, margins = select_rep_scores_ref(qd, seqs.k_cache, *dec[2:], max_candidates=scores.shape[-1] * 4,
                                                   **{k: v for k, v in prune.items() if k != "k"})
    assert torch.allclose(scores.double().cpu(), ref_scores, rtol=1e-5, atol=1e-5)
    sel_d, _ = pruning_stage(*dec, block_q=1, **prune)
    ref_d, _ = pruning_stage_ref(qd, seqs.k_cache, *dec[2:], **prune)
    assert (margins > 1e-4).all()  # no float near-tie in these inputs: the selections must agree
    assert torch.equal(sel_d.cpu(), ref_d)
    opts = dict(n_sink=N_SINK, n_stream=N_STREAM, scale=0.3, rope_style="streaming", inv_freq=freq)
    out = sparse_decode_attention(qd, seqs.paged, tables, ends, ref_d, num_splits=3, block_n=16, rope_group=4, **opts)
    ref = sparse_attention_ref(qd, seqs.k_cache, seqs.v_cache, tables, rows, torch.ones_like(rows), ends, ref_d, **opts)
    assert rel_err(out, ref) < 1e-5
    sel, _ = pruning_stage_ref(q, seqs.k_cache, tables, q_start, lens, ends, **prune)
    out = sparse_prefill_attention(q, seqs.paged, tables, q_start, lens, ends, sel, block_q=BLOCK_Q, block_n=16,
                                   rope_group=4, **opts)
    assert rel_err(out, sparse_attention_ref(q, seqs.k_cache, seqs.v_cache, tables, q_start, lens, ends, sel,
                                             **opts)) < 1e-5


def test_q_head_from_fp8_raw_keys_at_a_query_stride():
    """The prefill path past the window, per q head: keys un-rotated once from an fp8 cache
    (raw_keys.py), RELATIVE pruning at query stride 4, then STREAMING attention over the fp8
    cache == the float64 references on the dequantized cache (representatives where the
    tournament is not a near-tie)."""
    Hq, Hkv, D = 4, 2, 16
    seqs, q, (q_start, lens, ends, tables), seq = setup(Hq, Hkv, D, seed=9, dyadic=False)
    fp8 = quantize_seqs(seqs)
    freq = inv_freq(D)
    raw = unrotate_keys(fp8.paged, seqs.block_tables, seqs.context_lens.tolist(), freq, seq.long(), dtype=q.dtype)
    kw = dict(chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM, mask_layout="q_head", rope_style="relative",
              inv_freq=freq, query_stride=4)
    scores, reps = select_rep_scores(q, fp8.paged, tables, q_start, lens, ends, block_q=BLOCK_Q, store_reps=True,
                                     raw_keys=raw, **kw)
    ref_scores, ref_reps, margins = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends,
                                                          max_candidates=scores.shape[-1] * 8, **kw)
    assert torch.allclose(scores.double().cpu(), ref_scores, rtol=1e-5, atol=1e-5)
    clear = margins > 1e-4
    assert clear.float().mean() > 0.9 and torch.equal(reps.cpu()[clear], ref_reps[clear])
    sel, _ = pruning_stage(q, fp8.paged, tables, q_start, lens, ends, block_q=BLOCK_Q, k=24, raw_keys=raw, **kw)
    opts = dict(n_sink=N_SINK, n_stream=N_STREAM, scale=0.25, rope_style="streaming", inv_freq=freq)
    out = sparse_prefill_attention(q, fp8.paged, tables, q_start, lens, ends, sel, block_q=BLOCK_Q, rope_group=8,
                                   **opts)
    ref = sparse_attention_ref(q, seqs.k_cache, seqs.v_cache, tables, q_start, lens, ends, sel, **opts)
    assert rel_err(out, ref) < 1e-5


def test_a_quiet_q_head_keeps_its_chunk_with_its_own_budget():
    """One kv head, two q heads: head 0 is loud on chunk 0 (logit 8), head 1 quiet on chunk 5
    (logit 1). With one chunk of budget, shared and kv_head keep chunk 0 for both heads; q_head
    gives head 1 its own chunk 5 (and head 0 still chunk 0)."""
    ctx, D, page = 48, 16, 4
    k = torch.zeros(ctx, 1, D)
    k[N_SINK:N_SINK + 4, 0, 0] = 8.0
    k[N_SINK + 20:N_SINK + 24, 0, 1] = 1.0
    k_cache = k.view(ctx // page, page, 1, D).to(DEVICE)
    table = torch.arange(ctx // page, dtype=torch.int32, device=DEVICE)[None]
    q = torch.zeros(1, 2, D, device=DEVICE)
    q[0, 0, 0] = 1.0
    q[0, 1, 1] = 1.0
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    args = (q, PagedKV(k_cache, None), table, one * 0, one, torch.tensor([ctx], dtype=torch.int32, device=DEVICE))
    kw = dict(chunk_size=4, k=4, block_q=1, n_sink=N_SINK, n_stream=N_STREAM)
    chunk0, chunk5 = list(range(N_SINK, N_SINK + 4)), list(range(N_SINK + 20, N_SINK + 24))
    shared, _ = pruning_stage(*args, **kw)
    assert shared[0].tolist() == chunk0
    kv, _ = pruning_stage(*args, mask_layout="kv_head", **kw)
    assert kv.shape == (1, 1, 4) and kv[0, 0].tolist() == chunk0
    per_q, _ = pruning_stage(*args, mask_layout="q_head", **kw)
    assert per_q[0, 0].tolist() == chunk0 and per_q[0, 1].tolist() == chunk5


def test_shared_spellings_agree_bit_for_bit():
    """A shared selection as [NB, K] or [NB, 1, K], and kv_head on one kv head (H = 1, scores not
    head-normalized) give the same attention and the same survivors as today's shared layout."""
    Hq, Hkv, D = 6, 1, 16
    seqs, q, (q_start, lens, ends, tables), _ = setup(Hq, Hkv, D, seed=2, dyadic=False)
    block_q = BLOCK_Q
    kw = dict(chunk_size=8, k=24, block_q=block_q, n_sink=N_SINK, n_stream=N_STREAM)
    sel, n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, **kw)
    kv_sel, kv_n = pruning_stage(q, seqs.paged, tables, q_start, lens, ends, mask_layout="kv_head", **kw)
    assert torch.equal(kv_sel[:, 0], sel) and torch.equal(kv_n[:, 0], n)
    opts = dict(block_q=block_q, n_sink=N_SINK, n_stream=N_STREAM, scale=0.3, block_n=16)
    flat = sparse_prefill_attention(q, seqs.paged, tables, q_start, lens, ends, sel, **opts)
    axis = sparse_prefill_attention(q, seqs.paged, tables, q_start, lens, ends, sel[:, None], **opts)
    assert torch.equal(flat, axis)


def test_bad_layouts_are_refused_with_a_reason():
    Hq, Hkv, D = 4, 2, 16
    seqs, q, (q_start, lens, ends, tables), _ = setup(Hq, Hkv, D, seed=1)
    q = q[:ends.shape[0]].contiguous()  # one query row per block, as decode
    rows = torch.arange(ends.shape[0], dtype=torch.int32, device=DEVICE)
    args = (q, seqs.paged, tables, rows, torch.ones_like(rows), ends)
    kw = dict(chunk_size=8, k=16, block_q=1, n_sink=N_SINK, n_stream=N_STREAM)
    with pytest.raises(ValueError, match="mask_layout must be one of"):
        pruning_stage(*args, mask_layout="per_head", **kw)
    with pytest.raises(ValueError, match="reduce_scores"):
        pruning_stage(*args, mask_layout="q_head", reduce_scores=lambda s: s, **kw)
    NB = ends.shape[0]
    bad = torch.full((NB, 3, 16), PAD, dtype=torch.int32, device=DEVICE)  # 3 rows: neither Hkv nor Hq
    with pytest.raises(ValueError, match="1, 2 \\(kv_head\\) or 4 \\(q_head\\)"):
        sparse_decode_attention(q, seqs.paged, tables, ends, bad, n_sink=N_SINK, n_stream=N_STREAM, scale=0.3)
    per_q = torch.full((NB, Hq, 16), PAD, dtype=torch.int32, device=DEVICE)
    bank = torch.zeros(2, 16, Hkv, D, device=DEVICE)
    with pytest.raises(ValueError, match="key bank"):
        sparse_decode_attention(q, seqs.paged, tables, ends, per_q, n_sink=N_SINK, n_stream=N_STREAM, scale=0.3,
                                rope_style="streaming", inv_freq=inv_freq(D), bank=bank,
                                bank_rows=torch.zeros(NB, dtype=torch.int32, device=DEVICE))


def test_topk_rows_given_as_a_stride_0_view_read_their_own_lengths():
    """pruning_stage's per-head rows of one query block: ends [1] expanded to H rows and reshaped
    is a stride-0 view, which the kernel read as contiguous rows (row 1 read the next int32: here
    0, so no candidate: the quiet head lost its chunk about half the time, depending on memory)."""
    scores = torch.tensor([[0.0, 2.0, 1.0], [0.0, 1.0, 2.0]], device=DEVICE)  # [H = 2 rows, 3 chunks]
    backing = torch.tensor([N_SINK + 12 + N_STREAM, 0], dtype=torch.int32, device=DEVICE)
    ends = backing[:1].expand(2)  # stride 0: row 1 is backing[0] too, not backing[1]
    kw = dict(chunk_size=4, k=4, n_sink=N_SINK, n_stream=N_STREAM)
    got, n = topk_chunks(scores, None, None, ends=ends, **kw)
    want, n_want = topk_chunks(scores, None, None, ends=ends.contiguous(), **kw)
    assert n.tolist() == n_want.tolist() == [4, 4]
    assert got.tolist() == want.tolist() == [[N_SINK + 4 + i for i in range(4)], [N_SINK + 8 + i for i in range(4)]]
