"""The gated delta rule (Gated DeltaNet, Qwen3-Next's linear-attention layers): plain-torch
references of its recurrent form (decode, one token per sequence) and its chunked form (prefill).

Per value head, with a state S [Dk, Dv] (float32), a token t with query q_t, key k_t [Dk] (both
L2-normalised, q scaled by Dk**-0.5), value v_t [Dv], log decay g_t <= 0 and write strength
beta_t in (0, 1):

    S'    = exp(g_t) * S                       (decay)
    d_t   = beta_t * (v_t - S'^T k_t)          (the delta: what S' does not yet predict of v_t)
    S     = S' + k_t d_t^T
    o_t   = S^T q_t

Chunked form over a chunk of C tokens starting from S0, with G_t = g_1 + ... + g_t (the decay
from the chunk's start) and Gamma[t, j] = exp(G_t - G_j) for j <= t:

    (I + L) D = diag(beta) (V - diag(exp(G)) K S0),   L[t, j] = beta_t Gamma[t, j] k_t.k_j  (j < t)
    O   = diag(exp(G)) Q S0 + (Q K^T * Gamma, lower incl. diagonal) D
    S_C = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j d_j^T

(one unit-lower-triangular solve per chunk instead of C sequential steps). Grouped heads: each of
the Hk query/key heads serves Hv / Hk consecutive value heads.

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv] (float32); state [Hv, Dk, Dv] float32.
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per chunk of the chunked form (transformers' default too)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (as fla / transformers)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, num_v_heads: int):
    """float32 q (normalised, scaled), k (normalised), v; q/k repeated to the value heads:
    [T, Hv, D*]."""
    rep = num_v_heads // q.shape[1]
    q, k = l2norm(q), l2norm(k)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
    return q * q.shape[-1] ** -0.5, k, v.float()


def recurrent_ref(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Token by token; updates ``state`` [Hv, Dk, Dv] float32 in place; returns o [T, Hv, Dv]
    float32. Also the decode form: q/k/v/g/beta of B sequences' one token each, state [B, Hv, Dk, Dv]
    (pass T = 1 rows per sequence as a batch: see decode_ref)."""
    q, k, v = _prepare(q, k, v, v.shape[1])
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state.mul_(g[t].float().exp()[:, None, None])
        pred = torch.einsum("hkv,hk->hv", state, k[t])
        d = (v[t] - pred) * beta[t].float()[:, None]
        state.add_(k[t][:, :, None] * d[:, None, :])
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out


def decode_ref(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv];
    states [B, Hv, Dk, Dv] float32 (updated in place). Returns o [B, Hv, Dv] float32. Device
    ops only (no host sync): what a decode graph captures."""
    q, k, v = _prepare(q, k, v, v.shape[1])
    states.mul_(g.float().exp()[:, :, None, None])
    pred = torch.einsum("bhkv,bhk->bhv", states, k)
    d = (v - pred) * beta.float()[:, :, None]
    states.add_(k[:, :, :, None] * d[:, :, None, :])
    return torch.einsum("bhkv,bhk->bhv", states, q)


def chunked_ref(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The chunked form of one sequence's T tokens (module docstring); updates ``state`` in
    place; returns o [T, Hv, Dv] float32. Equal to recurrent_ref up to float32 rounding."""
    q, k, v = _prepare(q, k, v, v.shape[1])
    g, beta = g.float(), beta.float()
    out = torch.empty_like(v)
    s = state
    for lo in range(0, q.shape[0], chunk):
        hi = min(lo + chunk, q.shape[0])
        # [Hv, C, D] per head
        qc, kc, vc = (x[lo:hi].transpose(0, 1) for x in (q, k, v))
        G = g[lo:hi].transpose(0, 1).cumsum(-1)  # [Hv, C]
        b = beta[lo:hi].transpose(0, 1)  # [Hv, C]
        c = hi - lo
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        gamma = (G[:, :, None] - G[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [Hv, C, C]
        kk = kc @ kc.transpose(1, 2)
        L = (b[:, :, None] * gamma * kk).tril(-1)
        eye = torch.eye(c, dtype=q.dtype, device=q.device)
        rhs = b[:, :, None] * (vc - G.exp()[:, :, None] * (kc @ s))
        d = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
        out[lo:hi] = (G.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * gamma) @ d).transpose(0, 1)
        tail = (G[:, -1:] - G).exp()  # [Hv, C]: decay from each token to the chunk's end
        s.copy_(G[:, -1].exp()[:, None, None] * s + (kc * tail[:, :, None]).transpose(1, 2) @ d)
    return out


def gated_delta_prefill(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One sequence's chunk of tokens from its state (updated in place); o [T, Hv, Dv] float32."""
    return chunked_ref(q, k, v, g, beta, state)


def gated_delta_decode(q, k, v, g, beta, states: torch.Tensor) -> torch.Tensor:
    """B sequences' one token each; states [B, Hv, Dk, Dv] updated in place."""
    return decode_ref(q, k, v, g, beta, states)
