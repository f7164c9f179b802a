"""The chunked gated delta rule on the GPU, for prefill chunks (plugins/gated_delta.py has the
math and the references; its recurrent kernel serves decode rows), and the q/k/v preparation
both share.

Two parts per sequence, C = 32 tokens a chunk (the last one padded with g = 0, beta = 0 rows,
which leave the state alone):

1. Everything parallel over chunks, in torch (a few batched launches whatever the length):
   G = cumsum of g in each chunk, Gamma[t, j] = exp(G_t - G_j) (j <= t),
   L = strictly-lower(beta_t Gamma[t, j] k_t.k_j), and by one batched triangular solve
   U = (I + L)^-1 diag(beta) V,  W = (I + L)^-1 diag(beta exp(G)) K
   (so the chunk's deltas from a state S0 are D = U - W S0).
2. The scan over chunks, in Triton: one program per (value head, BV value dims) holds S [Dk, BV]
   in registers and per chunk computes D = U - W S, the output exp(G) Q S + (Q K^T * Gamma) D,
   and S <- exp(G_C) S + (K * exp(G_C - G))^T D; S starts from and ends in the sequence's slot.

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] float32 (a slot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._triton_utils import next_pow2

C = 32  # tokens per chunk
# The scan's launch: float32 "ieee" dots hold S [Dk, BV] and four [C, Dk] tiles per program. At
# C = 64, BV = 64, 4 warps and Triton's 3 stages, Qwen3-Next's scan (Dk = Dv = 128) needed 263 KB
# of shared memory, over every GPU's limit (227 KB on sm_90, 99 KB on sm_89: it could not launch),
# and a 17 KB stack of spills; at C = 32, BV = 32, 8 warps, 1 stage: 48 KB and a 5 KB stack, and
# twice the programs (Hv * Dv / 32). Measured with `python -m benchmarks.speed.kernel_resources
# --model qwen3-next-80b-a3b --kernels chunk_scan` (sm_90a, Triton 3.9); speed not yet on a GPU.
_BV_MAX, _WARPS, _STAGES = 32, 8, 1


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (as fla / transformers)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qkv(q, k, v, num_v_heads: int):
    """float32 q (normalised, scaled), k (normalised), v; q/k repeated to the value heads:
    [T, Hv, D*]."""
    rep = num_v_heads // q.shape[1]
    q, k = l2norm(q), l2norm(k)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q * q.shape[-1] ** -0.5, k, v.float()


def chunk_prepare(q, k, v, g, beta) -> tuple[torch.Tensor, ...]:
    """Part 1: (Q, K, W [Hv, Tp, Dk], U [Hv, Tp, Dv], G [Hv, Tp]) float32 contiguous, Tp = T
    rounded up to C."""
    hv = v.shape[1]
    qf, kf, vf = prepare_qkv(q, k, v, hv)  # [T, Hv, D] float32; q normalised and scaled, k normalised
    t = qf.shape[0]
    pad = (-t) % C
    qf, kf, vf = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (qf, kf, vf))  # [Hv, Tp, D]
    gf, bf = (F.pad(x.float().t(), (0, pad)) for x in (g, beta))  # [Hv, Tp]
    n = (t + pad) // C
    G = gf.view(hv, n, C).cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    gamma = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [Hv, N, C, C]
    kc = kf.view(hv, n, C, -1)
    b = bf.view(hv, n, C, 1)
    system = torch.eye(C, device=q.device) + (b * gamma * (kc @ kc.transpose(-1, -2))).tril(-1)
    U = torch.linalg.solve_triangular(system, b * vf.view(hv, n, C, -1), upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(system, b * G.exp()[..., None] * kc, upper=False, unitriangular=True)
    return (qf.contiguous(), kf.contiguous(), W.reshape(hv, n * C, -1).contiguous(),
            U.reshape(hv, n * C, -1).contiguous(), G.reshape(hv, n * C).contiguous())


@triton.jit
def _chunk_scan_kernel(q_ptr, k_ptr, w_ptr, u_ptr, g_ptr, out_ptr, state_ptr, TP, DK: tl.constexpr,
                       DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, CH: tl.constexpr, DOT: tl.constexpr):
    """Part 2 for one (value head h, value dims vb*BV..): the scan over the TP // CH chunks."""
    h, vb = tl.program_id(0), tl.program_id(1)
    ks, vs, rows = tl.arange(0, BK), vb * BV + tl.arange(0, BV), tl.arange(0, CH)
    km, vm = ks < DK, vs < DV
    sp = state_ptr + h * DK * DV + ks[:, None] * DV + vs[None, :]
    s = tl.load(sp, mask=km[:, None] & vm[None, :], other=0.0)
    lower = rows[:, None] >= rows[None, :]
    base_k = h.to(tl.int64) * TP * DK
    base_v = h.to(tl.int64) * TP * DV
    for c in range(0, TP // CH):
        r = c * CH + rows
        qc = tl.load(q_ptr + base_k + r[:, None] * DK + ks[None, :], mask=km[None, :], other=0.0)
        kc = tl.load(k_ptr + base_k + r[:, None] * DK + ks[None, :], mask=km[None, :], other=0.0)
        wc = tl.load(w_ptr + base_k + r[:, None] * DK + ks[None, :], mask=km[None, :], other=0.0)
        uc = tl.load(u_ptr + base_v + r[:, None] * DV + vs[None, :], mask=vm[None, :], other=0.0)
        gc = tl.load(g_ptr + h.to(tl.int64) * TP + r)
        d = uc - tl.dot(wc, s, input_precision=DOT)
        qk = tl.dot(qc, tl.trans(kc), input_precision=DOT)
        qk = qk * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
        o = tl.exp(gc)[:, None] * tl.dot(qc, s, input_precision=DOT) + tl.dot(qk, d, input_precision=DOT)
        tl.store(out_ptr + base_v + r[:, None] * DV + vs[None, :], o, mask=vm[None, :])
        g_last = tl.load(g_ptr + h.to(tl.int64) * TP + c * CH + CH - 1)
        kd = kc * tl.exp(g_last - gc)[:, None]
        s = tl.exp(g_last) * s + tl.dot(tl.trans(kd), d, input_precision=DOT)
    tl.store(sp, s, mask=km[:, None] & vm[None, :])


def chunked_triton(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One sequence's prefill rows from its state [Hv, Dk, Dv] (a contiguous slot, updated in
    place) -> o [T, Hv, Dv] float32."""
    t, hv, dv = v.shape
    dk = q.shape[2]
    assert state.is_contiguous() and state.shape == (hv, dk, dv), "state must be a contiguous [Hv, Dk, Dv] slot"
    qf, kf, w, u, G = chunk_prepare(q, k, v, g, beta)
    tp = qf.shape[1]
    out = torch.empty(hv, tp, dv, dtype=torch.float32, device=q.device)
    bv = min(max(next_pow2(dv), 16), _BV_MAX)
    _chunk_scan_kernel[(hv, triton.cdiv(dv, bv))](qf, kf, w, u, G, out, state, tp, DK=dk, DV=dv,
                                                   BK=max(next_pow2(dk), 16), BV=bv, CH=C, DOT="ieee",
                                                   num_warps=_WARPS, num_stages=_STAGES)
    return out[:, :t].transpose(0, 1)


def aot_launches(space) -> None:
    """The scan of a prefill chunk (plugins/gated_delta.py gated_delta on the GPU): every input
    float32 and contiguous; the length is a multiple of C (only the loop bound)."""
    la = space.model.linear_attention
    if la is None:
        return
    hv, dk, dv = la.num_value_heads, la.key_head_dim, la.value_head_dim
    qkw = [space.fake(hv, C, dk, dtype=torch.float32) for _ in range(3)]
    bv = min(max(next_pow2(dv), 16), _BV_MAX)
    _chunk_scan_kernel[(hv, triton.cdiv(dv, bv))](
        *qkw, space.fake(hv, C, dv, dtype=torch.float32), space.fake(hv, C, dtype=torch.float32),
        space.fake(hv, C, dv, dtype=torch.float32), space.fake(hv, dk, dv, dtype=torch.float32), C * 16,
        DK=dk, DV=dv, BK=max(next_pow2(dk), 16), BV=bv, CH=C, DOT="ieee", num_warps=_WARPS, num_stages=_STAGES)
