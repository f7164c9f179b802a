"""Qwen3-Next's MoE experts: the fused grouped-GEMM kernels (interpreted) against the per-expert
reference at small odd shapes (an expert with more routed pairs than a block, experts with none,
a top-k row whose weights do not sum to 1), and the router against transformers' arithmetic."""

from __future__ import annotations

import torch

from infhip.plugins.moe import experts_ref, experts_triton, route


def test_fused_experts_equal_the_reference():
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 13, 24, 20, 7, 3
    x = torch.randn(t, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    ids = torch.stack([torch.randperm(5, generator=g)[:k] for _ in range(t)])  # experts 5, 6 get none
    ids[:, 0] = 2  # expert 2: 13 + pairs, more than one 16-row block with the others
    ids[:, 1] = torch.where(ids[:, 1] == 2, 4, ids[:, 1])
    ids[:, 2] = torch.where((ids[:, 2] == 2) | (ids[:, 2] == ids[:, 1]), 3, ids[:, 2])
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 2], 0, ids[:, 1])
    w = torch.rand(t, k, generator=g)
    torch.testing.assert_close(experts_triton(x, gate_up, down, w, ids), experts_ref(x, gate_up, down, w, ids),
                               atol=1e-4, rtol=1e-4)


def test_route_is_softmax_topk_renormalised():
    g = torch.Generator().manual_seed(1)
    x, wr = torch.randn(5, 8, generator=g), torch.randn(6, 8, generator=g)
    weights, ids = route(x, wr, 2, True)
    probs = torch.softmax(x @ wr.t(), -1)
    top = probs.topk(2, -1)
    torch.testing.assert_close(ids, top.indices)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
