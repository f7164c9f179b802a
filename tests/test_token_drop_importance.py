"""UniPrefill block importance: the Triton passes (interpreter on CPU) against the float64
reference, batch vs one sequence at a time, the mass identity, strided inputs, odd shapes."""

import doctest

import pytest
import torch

from infhip.plugins.token_drop import importance
from infhip.plugins.token_drop.importance import block_importance_ref, block_importance_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LENS = [37, 130, 5]  # packed together; 5 and 37 are shorter than n = 128


def cu_of(lens):
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    return cu


def make_qk(lens, hq, hkv, d, dtype, seed, spread=2.0):
    """Fresh random q, k (never zeros); `spread` sharpens the softmax so scores span decades."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = (torch.randn(T, hq, d, generator=g) * spread).to(dtype=dtype, device=DEVICE)
    k = torch.randn(T, hkv, d, generator=g).to(dtype=dtype, device=DEVICE)
    cu = torch.tensor(cu_of(lens), dtype=torch.int32, device=DEVICE)
    return q, k, cu


def max_rel_err(got, ref):
    got, ref = got.double().cpu(), ref.double().cpu()
    return ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,G", [(16, 8), (128, 64), (128, 8), (13, 5)])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_importance_matches_float64_reference(dtype, n, G, num_splits):
    q, k, cu = make_qk(LENS, 6, 2, 16, dtype, seed=n * 31 + G * 7 + (num_splits or 0) + 1000 * (dtype == torch.bfloat16))
    scores, cu_blocks = block_importance_triton(q, k, cu, 0.25, n, G, num_splits=num_splits)
    ref, ref_cu_blocks = block_importance_ref(q, k, cu, 0.25, n, G)
    expect_blocks = cu_of([-(-x // G) for x in LENS])
    assert cu_blocks.tolist() == ref_cu_blocks.tolist() == expect_blocks
    assert scores.shape == (expect_blocks[-1],) and scores.dtype == torch.float32
    assert (ref > 0).all() and ref.max() / ref.min() > 10  # a non-trivial spread of scores
    assert max_rel_err(scores, ref) < TOL[dtype]


@pytest.mark.parametrize("n,G", [(16, 8), (128, 64)])
def test_batch_equals_each_sequence_alone(n, G):
    q, k, cu = make_qk(LENS, 6, 2, 16, torch.float32, seed=11)
    scores, cu_blocks = block_importance_triton(q, k, cu, 0.3, n, G)
    cub, cuh = cu_blocks.tolist(), cu.tolist()
    for b in range(len(LENS)):
        one = torch.tensor([0, LENS[b]], dtype=torch.int32, device=DEVICE)
        alone, _ = block_importance_triton(q[cuh[b]:cuh[b + 1]], k[cuh[b]:cuh[b + 1]], one, 0.3, n, G)
        assert max_rel_err(scores[cub[b]:cub[b + 1]], alone) < 1e-6


def test_mass_identity_and_odd_layout():
    """sum_g score[g] * |block g| = Hq for every sequence; an empty sequence and a length-1
    sequence in the batch; GQA group 3; head dim 24 (padded to 32); q, k strided views of one
    fused qkv tensor; a reference computed from the host list agrees."""
    lens, hq, hkv, d, G = [1, 0, 70, 9], 6, 2, 24, 8
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(sum(lens), hq + 2 * hkv, d, generator=g).to(DEVICE)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    assert not q.is_contiguous()
    cu = torch.tensor(cu_of(lens), dtype=torch.int32, device=DEVICE)
    scores, cu_blocks = block_importance_triton(q, k, cu, 0.2, 16, G, cu_seqlens_list=cu_of(lens))
    ref, _ = block_importance_ref(q.contiguous(), k.contiguous(), cu, 0.2, 16, G)
    assert max_rel_err(scores, ref) < 1e-5
    cub = cu_blocks.tolist()
    assert cub == cu_of([1, 0, 9, 2])
    for b, L in enumerate(lens):
        if L == 0:
            continue
        counts = torch.full((cub[b + 1] - cub[b],), float(G), dtype=torch.float64)
        counts[-1] = L - G * (len(counts) - 1)
        mass = (scores[cub[b]:cub[b + 1]].double().cpu() * counts).sum().item()
        assert abs(mass - hq) < 1e-5 * hq


def test_softmax_is_over_full_length_before_blocks():
    """Against an independent per-head formula for one sequence: probabilities of each window
    row normalised over all its visible keys (not per block)."""
    q, k, cu = make_qk([45], 4, 4, 16, torch.float32, seed=3)
    n, G, scale = 7, 10, 0.25
    scores, _ = block_importance_triton(q, k, cu, scale, n, G)
    L = 45
    o = torch.zeros(L, dtype=torch.float64)
    for h in range(4):
        for i in range(L - n, L):
            s = (q[i, h].double() @ k[:i + 1, h].double().T) * scale
            o[:i + 1] += torch.softmax(s, 0).cpu() / n
    expect = torch.stack([o[g:g + G].mean() for g in range(0, L, G)])
    assert max_rel_err(scores, expect) < 1e-5


def test_no_host_read_with_host_list(monkeypatch):
    """With cu_seqlens_list the launcher never reads device values (no .tolist/.item)."""
    q, k, cu = make_qk(LENS, 6, 2, 16, torch.float32, seed=8)
    ref, _ = block_importance_ref(q, k, cu, 0.25, 16, 8)

    def forbidden(*_a, **_k):
        raise AssertionError("host read")

    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    scores, _ = block_importance_triton(q, k, cu, 0.25, 16, 8, cu_seqlens_list=cu_of(LENS))
    monkeypatch.undo()
    assert max_rel_err(scores, ref) < 1e-5


def test_doctests():
    res = doctest.testmod(importance, extraglobs={"torch": torch})
    assert res.failed == 0 and res.attempted > 0


@pytest.mark.parametrize("n,G", [(16, 8), (13, 5)])
def test_window_only_q_equals_full_q(n, G):
    """q_window: q holds only each sequence's last min(n, L) rows (chunked prefill scores the
    chunk's queries against keys of the whole cache); same scores as the full packed q."""
    q, k, cu = make_qk(LENS, 6, 2, 16, torch.float32, seed=5)
    cuh = cu_of(LENS)
    rows = torch.cat([torch.arange(cuh[b + 1] - min(n, LENS[b]), cuh[b + 1]) for b in range(len(LENS))])
    q_win = q[rows.to(q.device)].contiguous()
    full, _ = block_importance_triton(q, k, cu, 0.3, n, G)
    win, _ = block_importance_triton(q_win, k, cu, 0.3, n, G, q_window=True)
    ref, _ = block_importance_ref(q_win, k, cu, 0.3, n, G, q_window=True)
    assert max_rel_err(win, full) < 1e-6 and max_rel_err(ref, full) < 1e-5
    with pytest.raises(AssertionError, match="rows"):
        block_importance_triton(q_win[1:], k, cu, 0.3, n, G, q_window=True)
