"""UniPrefill compaction / reconstitution: gather and scatter round trip, dropped rows keep
their pre-drop values, kept positions and compact cu_seqlens; the whole anchor pipeline."""

import doctest

import pytest
import torch

from infhip.plugins.token_drop import gather
from infhip.plugins.token_drop.gather import (
    compact_batch, gather_rows, reconstitute, reconstitute_ref, scatter_rows_, token_positions,
)
from infhip.plugins.token_drop.importance import block_importance_triton
from infhip.plugins.token_drop.top_p import select_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENS = [37, 130, 5]


def anchor(lens, p, G=8, A=4, n=16, seed=0):
    """Importance + top-p on a random packed batch; returns (selection, cu_seqlens)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=DEVICE)
    q = (torch.randn(T, 6, 16, generator=g) * 2).to(DEVICE)
    k = torch.randn(T, 2, 16, generator=g).to(DEVICE)
    scores, cu_blocks = block_importance_triton(q, k, cu, 0.25, n, G)
    sel = select_triton(scores, cu_blocks, cu, num_tokens=T, max_seqlen=max(lens), block_size=G,
                        num_sink=A, obs_window=n, p=p)
    return sel, cu


def test_token_positions():
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device=DEVICE)
    assert token_positions(cu, 7).tolist() == [0, 1, 2, 0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_and_reconstitution(dtype):
    sel, cu = anchor(LENS, 0.5)
    cb = compact_batch(sel, cu_seqlens=cu)
    T, M = sum(LENS), cb.num_tokens
    assert 0 < M < T  # something is dropped
    g = torch.Generator().manual_seed(1)
    prev = torch.randn(T, 24, generator=g).to(dtype=dtype, device=DEVICE)  # state before the drop
    small = gather_rows(prev, cb.idx)
    assert small.shape == (M, 24) and torch.equal(small, prev[sel.keep_mask])
    # the compact rows are "propagated" (any update), then scattered back
    updated = small * 3 + 1
    out = reconstitute(prev, updated, cb.idx)
    assert torch.equal(out[sel.keep_mask], updated)
    assert torch.equal(out[~sel.keep_mask], prev[~sel.keep_mask])  # dropped rows untouched
    assert torch.equal(out, reconstitute_ref(prev, updated, sel.keep_mask))
    # unchanged rows round-trip exactly; the in-place form edits its argument
    assert torch.equal(reconstitute(prev, small, cb.idx), prev)
    full = prev.clone()
    assert scatter_rows_(full, updated, cb.idx) is full and torch.equal(full, out)


def test_compact_metadata_and_explicit_positions():
    sel, cu = anchor(LENS, 0.4, seed=3)
    T = sum(LENS)
    offsets = torch.tensor([100, 0, 7], device=DEVICE)  # chunked prefill: earlier context per sequence
    seq = torch.repeat_interleave(torch.arange(3, device=DEVICE), torch.tensor(LENS, device=DEVICE))
    positions = token_positions(cu, T) + offsets[seq]
    cb = compact_batch(sel, positions)
    keep = sel.keep_mask
    assert torch.equal(cb.idx, torch.nonzero(keep).flatten())
    assert torch.equal(cb.positions, positions[keep])
    counts = [int(keep[a:b].sum()) for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])]
    assert cb.cu_seqlens_list == [0, counts[0], counts[0] + counts[1], sum(counts)]
    assert cb.cu_seqlens.tolist() == cb.cu_seqlens_list and cb.cu_seqlens.dtype == torch.int32
    # positions stay increasing within each compact sequence (RoPE / window order preserved)
    for a, b in zip(cb.cu_seqlens_list[:-1], cb.cu_seqlens_list[1:]):
        assert (cb.positions[a + 1:b] > cb.positions[a:b - 1]).all()


def test_keep_everything_is_identity():
    sel, cu = anchor(LENS, 1.0)
    cb = compact_batch(sel, cu_seqlens=cu)
    x = torch.randn(sum(LENS), 5).to(DEVICE)
    assert cb.num_tokens == sum(LENS) and torch.equal(gather_rows(x, cb.idx), x)
    assert cb.cu_seqlens_list == cu.tolist()


def test_doctests():
    res = doctest.testmod(gather, extraglobs={"torch": torch})
    assert res.failed == 0 and res.attempted > 0
