"""Sparse MoE routing and experts (Qwen3-Next): plain-torch reference, expert by expert.

Router: probs = softmax(x W_r^T) in float32; the top_k experts of each token, their probs
renormalised to sum 1 when ``norm_topk_prob``, cast back to x's dtype. Experts: expert e's
gate_up [2I, H] (gate rows first) and down [H, I]; a token's output is
sum over its experts of weight * down(silu(gate x) * up x).

Shapes: x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_ids [T, k] int64; topk_weights [T, k].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """(topk_weights [T, k] in x's dtype, topk_ids [T, k] int64) of rows x [T, H]."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum [T, H], one expert at a time over the tokens routed to it
    (the reference a fused kernel is checked against)."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * topk_weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def moe_experts(x, gate_up, down, topk_weights, topk_ids) -> torch.Tensor:
    """The routed experts of rows x; the launcher the model calls."""
    return experts_ref(x, gate_up, down, topk_weights, topk_ids)
