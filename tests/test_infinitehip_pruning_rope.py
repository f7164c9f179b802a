"""InfiniteHiP pruning with RoPE styles: SelectRep re-rotating cached keys in-kernel (relative,
chunk_indexed) and scoring un-rotated keys (raw keys), against the float64 torch reference
(interpreter on CPU). The plain stage: tests/test_infinitehip_pruning.py."""

from __future__ import annotations

import pytest
import torch

from infhip.plugins.infinitehip import select_rep_scores, select_rep_scores_ref

from ._pruning_cases import N_SINK, N_STREAM, QUERIES, random_candidates, raw_keys_of, setup
from .test_infinitehip_common import PagedSeqs, inv_freq, rotate_by_ref


@pytest.mark.parametrize("rope_style", ["relative", "chunk_indexed"])
@pytest.mark.parametrize("block_q,q_lens", QUERIES)
def test_select_rep_rope_styles_match_reference(rope_style, block_q, q_lens):
    """Keys re-rotated in-kernel to the style's positions (float32 vs float64: representatives
    compared where the reference tournament is not a near-tie)."""
    Hq, Hkv, D = 6, 2, 32
    seqs, q, (q_start, lens, ends, tables) = setup(Hq, Hkv, D, 16, q_lens, block_q, seed=5, dyadic=False)
    kw = dict(chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM, rope_style=rope_style, inv_freq=inv_freq(D))
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_q=block_q,
                                     store_reps=True, **kw)
    ref_scores, ref_reps, margins = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, **kw)
    assert torch.allclose(scores.double().cpu(), ref_scores, rtol=1e-5, atol=1e-5)
    clear = margins > 1e-4
    assert clear.float().mean() > 0.95 and torch.equal(reps.cpu()[clear], ref_reps[clear])
    # the style matters: the same inputs without re-rotation pick differently somewhere
    plain, _ = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_q=block_q,
                                 chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM)
    assert not torch.allclose(plain, scores)


def test_unrotate_keys_moves_every_key_to_position_zero():
    """keys[base_s + p] = R(-p) k_s[p] for every sequence (Triton under the interpreter and the
    torch path agree with rotate_by_ref); block_base points each block at its sequence."""
    seqs = PagedSeqs([37, 70], 2, 16, 4, seed=3)
    freq = inv_freq(16)
    raw = raw_keys_of(seqs, [5, 9], 4, freq)
    want = torch.cat([rotate_by_ref(k.cpu(), -torch.arange(k.shape[0]), freq.cpu()) for k in seqs.keys])
    assert torch.allclose(raw.keys.double().cpu(), want, atol=2e-5)
    assert raw.block_base.tolist() == [0, 0, 37, 37, 37]


@pytest.mark.parametrize("rope_style", ["relative", "chunk_indexed"])
@pytest.mark.parametrize("block_q,q_lens,query_stride", [(1, [1, 1], 1), (8, [13, 20], 1), (8, [13, 20], 4)])
@pytest.mark.parametrize("explicit", [False, True])
def test_raw_keys_match_reference(rope_style, block_q, q_lens, query_stride, explicit):
    """Pruning from un-rotated keys (relative: the branch offset moved onto a second query tile;
    chunk_indexed: one sin/cos per chunk) == the float64 reference of the styles, like the
    in-kernel rotation (representatives compared where the tournament is not a near-tie)."""
    Hq, Hkv, D = 6, 2, 32
    seqs, q, (q_start, lens, ends, tables) = setup(Hq, Hkv, D, 16, q_lens, block_q, seed=8, dyadic=False)
    cand, cand_lens = random_candidates(seqs.generator, ends) if explicit else (None, None)
    freq = inv_freq(D)
    kw = dict(chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM, rope_style=rope_style, inv_freq=freq,
              query_stride=query_stride)
    raw = raw_keys_of(seqs, q_lens, block_q, freq)
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens,
                                     block_q=block_q, store_reps=True, raw_keys=raw, **kw)
    ref_scores, ref_reps, margins = select_rep_scores_ref(
        q, seqs.k_cache, tables, q_start, lens, ends, cand, cand_lens,
        max_candidates=None if explicit else scores.shape[1] * 8, **kw)
    assert torch.allclose(scores.double().cpu()[:, :ref_scores.shape[1]], ref_scores, rtol=1e-5, atol=1e-5)
    clear = margins > 1e-4
    assert clear.float().mean() > 0.9 and torch.equal(reps.cpu()[..., :ref_reps.shape[2]][clear], ref_reps[clear])


@pytest.mark.parametrize("chunk_size", [1, 2, 16])
def test_relative_tournament_lengths_match_reference(chunk_size):
    """RELATIVE runs its last halving after the loop (no left re-score): l_c 1 (no halving), 2
    (only the peeled one) and 16 (three in the loop) still pick the reference's representatives,
    from un-rotated keys (prefill) and from re-rotated cached keys (decode)."""
    Hq, Hkv, D, q_lens, block_q = 6, 2, 32, [13, 20], 8
    seqs, q, (q_start, lens, ends, tables) = setup(Hq, Hkv, D, 16, q_lens, block_q, seed=17, dyadic=False)
    cand, cand_lens = random_candidates(seqs.generator, ends)
    freq = inv_freq(D)
    kw = dict(chunk_size=chunk_size, n_sink=N_SINK, n_stream=N_STREAM, rope_style="relative", inv_freq=freq)
    ref_scores, ref_reps, margins = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, cand,
                                                          cand_lens, **kw)
    clear = margins > 1e-4
    assert clear.float().mean() > 0.9
    for raw in (None, raw_keys_of(seqs, q_lens, block_q, freq)):
        scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, cand, cand_lens,
                                         block_q=block_q, store_reps=True, raw_keys=raw, **kw)
        assert torch.allclose(scores.double().cpu()[:, :ref_scores.shape[1]], ref_scores, rtol=1e-5, atol=1e-5)
        assert torch.equal(reps.cpu()[..., :ref_reps.shape[2]][clear], ref_reps[clear])


def test_query_stride_with_relative_rope_matches_reference():
    """Stride 4 with RELATIVE re-rotation (each sampled query rotated by its own offset)."""
    Hq, Hkv, D = 6, 2, 32
    seqs, q, (q_start, lens, ends, tables) = setup(Hq, Hkv, D, 16, [13, 20], 8, seed=6, dyadic=False)
    kw = dict(chunk_size=8, n_sink=N_SINK, n_stream=N_STREAM, rope_style="relative", inv_freq=inv_freq(D),
              query_stride=4)
    scores, reps = select_rep_scores(q, seqs.paged, tables, q_start, lens, ends, block_q=8,
                                     store_reps=True, **kw)
    ref_scores, ref_reps, margins = select_rep_scores_ref(q, seqs.k_cache, tables, q_start, lens, ends, **kw)
    assert torch.allclose(scores.double().cpu(), ref_scores, rtol=1e-5, atol=1e-5)
    clear = margins > 1e-4
    assert clear.float().mean() > 0.95 and torch.equal(reps.cpu()[clear], ref_reps[clear])
