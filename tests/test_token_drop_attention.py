"""Kept-query attention after a UniPrefill drop: the Triton kernel (interpreter on CPU) and the
SDPA-per-run torch path against the explicit float64 reference, for an anchor (queries a subset,
keys every position) and a sliding layer (keys with gaps, a window), GQA, odd sizes."""

import doctest

import pytest
import torch

from infhip.plugins.dense_attention import dense_attention_ref
from infhip.plugins.token_drop import attention
from infhip.plugins.token_drop.attention import kept_attention_ref, kept_attention_triton, query_runs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kept_positions(n: int, G: int, seed: int, tail: int) -> torch.Tensor:
    """Random whole blocks of G plus the last `tail` positions, ascending (host int64)."""
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand((n + G - 1) // G, generator=g) < 0.4).repeat_interleave(G)[:n]
    keep[n - tail:] = True
    return torch.nonzero(keep).flatten()


@pytest.mark.parametrize("fn", [kept_attention_triton, kept_attention_ref])
@pytest.mark.parametrize("case", ["anchor", "sliding", "sliding_chunk"])
def test_matches_explicit_reference(fn, case):
    g = torch.Generator().manual_seed(hash(case) % 1000)
    n, hq, hkv, d = 150, 4, 2, 24  # head_dim 24: padded to 32 lanes
    window = None if case == "anchor" else 13
    start = 40 if case == "sliding_chunk" else 0  # a later chunk: earlier keys from the cache
    q_pos = kept_positions(n - start, 8, seed=3, tail=16) + start
    if case == "anchor":
        k_pos = torch.arange(n)
    else:  # the chunk's kept keys plus the earlier window
        k_pos = torch.cat([torch.arange(max(0, start - window + 1), start), q_pos])
    q = torch.randn(q_pos.numel(), hq, d, generator=g).to(DEVICE)
    k = torch.randn(k_pos.numel(), hkv, d, generator=g).to(DEVICE)
    v = torch.randn(k_pos.numel(), hkv, d, generator=g).to(DEVICE)
    got = fn(q, q_pos, k, v, k_pos, 0.3, window)
    ref = dense_attention_ref(q, k, v, q_pos, k_pos, 0.3, window)
    assert (got.float().cpu() - ref.cpu()).abs().max() < 1e-4


def test_small_tiles_and_bf16():
    """Tiles that split runs, keys that span many key tiles, bf16 inputs."""
    g = torch.Generator().manual_seed(7)
    q_pos = kept_positions(300, 16, seed=9, tail=20)
    k_pos = torch.arange(300)
    q = torch.randn(q_pos.numel(), 6, 16, generator=g).to(DEVICE, torch.bfloat16)
    k = torch.randn(300, 3, 16, generator=g).to(DEVICE, torch.bfloat16)
    v = torch.randn(300, 3, 16, generator=g).to(DEVICE, torch.bfloat16)
    got = kept_attention_triton(q, q_pos, k, v, k_pos, 0.25, None, block_m=16, block_n=32)
    ref = dense_attention_ref(q, k, v, q_pos, k_pos, 0.25)
    assert (got.float().cpu() - ref.cpu()).abs().max() < 2e-2


def test_query_runs_and_doctests():
    assert query_runs(torch.tensor([3, 4, 5, 9])) == [(0, 3), (3, 4)]
    assert query_runs(torch.tensor([], dtype=torch.long)) == []
    assert doctest.testmod(attention).failed == 0
