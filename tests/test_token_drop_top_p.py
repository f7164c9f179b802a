"""UniPrefill top-p selection: the IEEE-754 sort keys, the minimal prefix (exact ties),
p = 1, sinks and window, packed kept indices, force_retention; Triton (interpreter on CPU)
against the plain reference."""

import doctest
import math

import pytest
import torch

from infhip.plugins.token_drop import top_p
from infhip.plugins.token_drop.importance import block_importance_triton, block_layout
from infhip.plugins.token_drop.top_p import (
    descending_sort_keys, force_retention, select_ref, select_triton, sort_keys_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def packed(seq_scores, G):
    """Scores given per sequence (lists) -> (scores, cu_blocks, cu_seqlens, T, max_len), each
    sequence made of len(scores) full blocks except the last, which is G - 1 tokens long
    (a partial block)."""
    lens = [max(G * len(x) - 1, 1) for x in seq_scores]
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32, device=DEVICE)
    scores = torch.tensor([v for x in seq_scores for v in x], dtype=torch.float32, device=DEVICE)
    cu_blocks = block_layout(cu, G)
    assert cu_blocks.tolist()[-1] == scores.numel()
    return scores, cu_blocks, cu, sum(lens), max(lens)


def select(scores, cu_blocks, cu, T, max_len, G, *, A=0, n=0, p=None, rho=None):
    kw = dict(num_tokens=T, max_seqlen=max_len, block_size=G, num_sink=A, obs_window=n,
              p=p, keep_fraction=rho)
    got, ref = select_triton(scores, cu_blocks, cu, **kw), select_ref(scores, cu_blocks, cu, **kw)
    for name in ("keep_mask", "kept_idx", "cu_kept", "block_keep"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.allclose(got.retention, ref.retention)
    return got


def test_sort_keys_order_negative_zero_positive():
    values = [0.5, -1.0, float("inf"), 0.0, -0.0, 1e-40, -1e-40, 2.0, float("-inf"), 0.5, -3.5,
              1e-30, 3.0e38, -2.0, 0.5]
    x = torch.tensor(values, dtype=torch.float32)
    keys = sort_keys_triton(x.to(DEVICE), torch.tensor([0, len(values)], dtype=torch.int32, device=DEVICE),
                            len(values) + 3)[0].cpu()
    assert torch.equal(keys[:len(values)], descending_sort_keys(x, torch.arange(len(values))))
    assert (keys[len(values):] == 2**63 - 1).all()  # padding sorts last
    order = torch.sort(keys).values[:len(values)] & 0xFFFFFFFF
    # descending value, +0 before -0, equal values by ascending index
    expect = sorted(range(len(values)),
                    key=lambda i: (-values[i], math.copysign(1.0, values[i]) < 0, i))
    assert order.tolist() == expect
    # the high word decodes back to the exact float bits
    mono = ~(keys[:len(values)] >> 32).to(torch.int32)
    bits = torch.where(mono >= 0, mono, mono ^ 0x7FFFFFFF)
    assert torch.equal(bits.view(torch.float32).view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("p,kept_blocks", [
    (0.5, {0, 2}),  # 0.25 + 0.25 reaches 0.5 exactly: the tied block 4 is dropped
    (0.6, {0, 2, 4}),
    (0.75, {0, 2, 4}),  # 0.75 reached exactly by three blocks
    (0.8, {0, 1, 2, 4}),  # of the tied 0.125s the lower index stays
    (0.1, {0}),
])
def test_minimal_prefix_with_exact_ties(p, kept_blocks):
    G = 4
    sc = [[0.25, 0.125, 0.25, 0.125, 0.25], [0.5, 0.5, 0.5, 0.5]]
    scores, cu_blocks, cu, T, max_len = packed(sc, G)
    sel = select(scores, cu_blocks, cu, T, max_len, G, p=p)
    assert set(torch.nonzero(sel.block_keep[:5]).flatten().tolist()) == kept_blocks
    # equal scores: the first ceil(p * 4) blocks by index (p * total reached exactly at 0.5, 0.75)
    assert sel.block_keep[5:].tolist() == [i < max(1, math.ceil(p * 4 - 1e-9)) for i in range(4)]
    # tokens follow their blocks (the last block is partial)
    L0 = cu.tolist()[1]
    expect = [i // G in kept_blocks for i in range(L0)]
    assert sel.keep_mask[:L0].tolist() == expect


def test_p_one_keeps_everything_even_zero_mass():
    G = 8
    scores, cu_blocks, cu, T, max_len = packed([[0.3, 0.0, 0.7], [0.0, 0.0], [1.0]], G)
    sel = select(scores, cu_blocks, cu, T, max_len, G, p=1.0)
    assert sel.keep_mask.all() and sel.block_keep.all()
    assert torch.equal(sel.kept_idx, torch.arange(T, dtype=torch.int32, device=DEVICE))
    assert torch.equal(sel.retention, torch.ones(3, device=DEVICE))


def test_random_importance_sinks_window_and_packing():
    """Real importance scores of a random batch (sequences shorter than n and A included)."""
    lens, G, A, n = [37, 130, 5, 300], 8, 11, 16
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 37, 167, 172, 472], dtype=torch.int32, device=DEVICE)
    q = (torch.randn(472, 6, 16, generator=g) * 2).to(DEVICE)
    k = torch.randn(472, 2, 16, generator=g).to(DEVICE)
    scores, cu_blocks = block_importance_triton(q, k, cu, 0.25, n, G)
    for p in (0.3, 0.9, 0.99):
        sel = select(scores, cu_blocks, cu, 472, max(lens), G, A=A, n=n, p=p)
        cuh, kept = cu.tolist(), sel.cu_kept.tolist()
        for b, L in enumerate(lens):
            m = sel.keep_mask[cuh[b]:cuh[b + 1]]
            assert m[:A].all() and m[max(L - n, 0):].all()  # sinks and observation window
            assert kept[b + 1] - kept[b] == int(m.sum())
            assert abs(sel.retention[b].item() - int(m.sum()) / L) < 1e-6
            # kept rows of sequence b: ascending, in its row range, exactly the mask
            rows = sel.kept_idx[kept[b]:kept[b + 1]].long()
            assert torch.equal(rows, torch.nonzero(m).flatten() + cuh[b])
        assert (sel.kept_idx[kept[-1]:] == -1).all()
        # the kept blocks hold >= p of each sequence's mass, and dropping the lowest kept one falls short
        cub = cu_blocks.tolist()
        for b in range(len(lens)):
            x = scores[cub[b]:cub[b + 1]].double()
            kb = sel.block_keep[cub[b]:cub[b + 1]]
            assert x[kb].sum() >= p * x.sum() * (1 - 1e-6)
            assert x[kb].sum() - x[kb].min() < p * x.sum() * (1 + 1e-6)
            assert x[kb].min() >= x[~kb].max() if (~kb).any() else True
        if p == 0.3:
            assert sel.retention[3] < 0.7  # something is actually dropped in the long sequence


def test_long_rows_cross_scan_tiles():
    """More blocks (G = 1) and tokens than one scan / expansion tile (1024)."""
    g = torch.Generator().manual_seed(4)
    lens, G = [2500, 1100], 1
    cu = torch.tensor([0, 2500, 3600], dtype=torch.int32, device=DEVICE)
    scores = torch.rand(3600, generator=g).pow(4).to(DEVICE) + 1e-3
    sel = select(scores, block_layout(cu, G), cu, 3600, 2500, G, A=3, n=5, p=0.8)
    assert 0.2 < sel.retention.min() and sel.retention.max() < 0.9


@pytest.mark.parametrize("rho", [0.0, 0.3, 0.5, 1.0])
def test_force_retention(rho):
    G = 8
    g = torch.Generator().manual_seed(9)
    nb = [5, 17, 1, 40]
    scores, cu_blocks, cu, T, max_len = packed([torch.rand(x, generator=g).tolist() for x in nb], G)
    sel = select(scores, cu_blocks, cu, T, max_len, G, rho=rho)
    cub = cu_blocks.tolist()
    for b, num in enumerate(nb):
        kb, x = sel.block_keep[cub[b]:cub[b + 1]], scores[cub[b]:cub[b + 1]]
        assert int(kb.sum()) == min(math.floor(rho * num + 0.5), num)
        if 0 < kb.sum() < num:
            assert x[kb].min() > x[~kb].max()
    # sinks and window come on top of the forced fraction
    sel = select(scores, cu_blocks, cu, T, max_len, G, A=3, n=9, rho=0.0)
    assert int(sel.cu_kept[-1]) == sum(min(3 + 9, G * x - 1) for x in nb)


def test_selection_reads_nothing_on_host(monkeypatch):
    G = 8
    scores, cu_blocks, cu, T, max_len = packed([[0.1, 0.5, 0.2], [0.3, 0.3]], G)

    def forbidden(*_a, **_k):
        raise AssertionError("host read")

    for name in ("tolist", "item", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    sel = select_triton(scores, cu_blocks, cu, num_tokens=T, max_seqlen=max_len, block_size=G,
                        num_sink=2, obs_window=3, p=0.6)
    monkeypatch.undo()
    assert sel.block_keep.tolist() == [False, True, False, True, True]  # 0.5 >= 0.6 * 0.8


def test_doctests():
    res = doctest.testmod(top_p, extraglobs={"torch": torch})
    assert res.failed == 0 and res.attempted > 0
