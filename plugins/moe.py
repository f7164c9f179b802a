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
import triton
import triton.language as tl

from ._triton_utils import dot_precision, use_triton


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
        out.index_put_((tok,), y.to(out.dtype), accumulate=True)  # (index_add_ is ~1000x slower on the CPU)
    return out


# Fused form: the T * k (token, expert) pairs sorted by expert, cut into blocks of BM pairs of
# one expert each (block_rows); one program per (block, BN output columns) runs that block's GEMM against its
# expert's weights (a grouped GEMM). The block table is made on the device (no host sync: decode
# graphs capture it) for an upper bound of blocks, cdiv(T k, BM) + min(E, T k); programs past the
# real count exit at once.
BN, BK = 64, 64


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Pairs per block: 16 while experts get few pairs each (decode), 64 once they average 64
    (prefill: each block re-reads its expert's weights, so fewer, fuller blocks read less)."""
    return 64 if num_pairs >= 64 * num_experts else 16


@triton.jit
def _expert_gemm_kernel(a_ptr, w_ptr, out_ptr, order_ptr, block_expert_ptr, block_row_ptr, expert_end_ptr, pw_ptr,
                        N, K, sa, sw_e, sw_n, so, TOP_K: tl.constexpr, GATED: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    """GATED: out[pair] = silu(a[token] Wg^T) * (a[token] Wu^T), Wg / Wu rows n / N + n of expert
    e's [2N, K] weights (a: x, one row per token); else out[pair] = (a[pair] W^T) * pw[pair]
    (a: the gated rows, one per pair; W: expert e's [N, K])."""
    pid, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + pid)
    if e < 0:
        return
    r0, r_end = tl.load(block_row_ptr + pid), tl.load(expert_end_ptr + e)
    rows = r0 + tl.arange(0, BM)
    rm = rows < r_end
    pair = tl.load(order_ptr + rows, mask=rm, other=0).to(tl.int64)
    src = pair // TOP_K if GATED else pair
    cols = nb * BN + tl.arange(0, BN)
    cm = cols < N
    ks = tl.arange(0, BK)
    w_e = w_ptr + e.to(tl.int64) * sw_e
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        km = k0 + ks < K
        a = tl.load(a_ptr + src[:, None] * sa + (k0 + ks)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_e + cols[None, :] * sw_n + (k0 + ks)[:, None], mask=cm[None, :] & km[:, None], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT)
        if GATED:
            wu = tl.load(w_e + (N + cols)[None, :] * sw_n + (k0 + ks)[:, None], mask=cm[None, :] & km[:, None], other=0.0)
            acc_u += tl.dot(a, wu, input_precision=DOT)
    if GATED:
        g = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = (g / (1.0 + tl.exp(-g))) * acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(pw_ptr + pair, mask=rm, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * so + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=rm[:, None] & cm[None, :])


def _block_table(topk_ids: torch.Tensor, num_experts: int, bm: int):
    """(order [P]: pair ids sorted by expert, block_expert [G] (-1: unused), block_row [G]: the
    block's first position in order, expert_end [E]: one past each expert's last position)."""
    flat = topk_ids.reshape(-1)
    p = flat.shape[0]
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    blocks = (counts + bm - 1) // bm
    bends = blocks.cumsum(0)
    g = triton.cdiv(p, bm) + min(num_experts, p)
    pid = torch.arange(g, device=flat.device)
    e = torch.searchsorted(bends, pid, right=True)
    valid = e < num_experts
    e = e.clamp(max=num_experts - 1)
    block_row = (ends - counts)[e] + (pid - (bends - blocks)[e]) * bm
    return order, torch.where(valid, e, -1).to(torch.int32), block_row.to(torch.int32), ends.to(torch.int32)


def experts_triton(x, gate_up, down, topk_weights, topk_ids) -> torch.Tensor:
    """The fused form (two grouped GEMMs, the gated activation in the first); experts_ref's
    contract, x [T, H] contiguous rows, gate_up / down contiguous."""
    t, h = x.shape
    e, two_i, _ = gate_up.shape
    i, k = two_i // 2, topk_ids.shape[1]
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous() and down.shape == (e, h, i)
    bm, dot = block_rows(t * k, e), dot_precision(x.dtype)
    order, block_expert, block_row, ends = _block_table(topk_ids, e, bm)
    g = block_expert.shape[0]
    mid = torch.empty(t * k, i, dtype=x.dtype, device=x.device)
    _expert_gemm_kernel[(g, triton.cdiv(i, BN))](x, gate_up, mid, order, block_expert, block_row, ends, topk_weights,
                                                  i, h, x.stride(0), gate_up.stride(0), gate_up.stride(1), mid.stride(0),
                                                  TOP_K=k, GATED=True, BM=bm, BN=BN, BK=BK, DOT=dot)
    y = torch.empty(t * k, h, dtype=x.dtype, device=x.device)
    pw = topk_weights.reshape(-1).contiguous()
    _expert_gemm_kernel[(g, triton.cdiv(h, BN))](mid, down, y, order, block_expert, block_row, ends, pw,
                                                  h, i, mid.stride(0), down.stride(0), down.stride(1), y.stride(0),
                                                  TOP_K=k, GATED=False, BM=bm, BN=BN, BK=BK, DOT=dot)
    return y.view(t, k, h).sum(1)


def moe_experts(x, gate_up, down, topk_weights, topk_ids) -> torch.Tensor:
    """The routed experts of rows x: the fused kernels on the GPU (no host sync: graph-capturable),
    the per-expert reference elsewhere."""
    if use_triton(x):
        return experts_triton(x, gate_up, down, topk_weights, topk_ids)
    return experts_ref(x, gate_up, down, topk_weights, topk_ids)


def aot_launches(space) -> None:
    """The MoE layers' two launches per step (runtime/models/qwen3_next.py): x the normed rows
    [T, H], the stacked experts; T picks the block size (block_rows), else it and the routing
    are only the grid and the block table."""
    moe = space.model.moe
    if moe is None:
        return
    h, e, i = space.model.hidden_size, moe.num_experts, moe.intermediate_size
    gate_up, down = space.fake(e, 2 * i, h, dtype=space.act_dtype), space.fake(e, h, i, dtype=space.act_dtype)
    for t in {1, -(-64 * e // moe.top_k)}:  # both block sizes (block_rows)
        ids = torch.zeros(t, moe.top_k, dtype=torch.int64, device="meta")
        experts_triton(space.fake(t, h, dtype=space.act_dtype), gate_up, down,
                       space.fake(t, moe.top_k, dtype=space.act_dtype), ids)
