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
import triton
import triton.language as tl

from ._triton_utils import next_pow2, use_triton
from .gated_delta_chunked import chunked_triton, prepare_qkv

CHUNK = 64  # tokens per chunk of the chunked form (transformers' default too)


def recurrent_ref(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """Token by token; updates ``state`` [Hv, Dk, Dv] float32 in place; returns o [T, Hv, Dv]
    float32. Also the decode form: q/k/v/g/beta of B sequences' one token each, state [B, Hv, Dk, Dv]
    (pass T = 1 rows per sequence as a batch: see decode_ref)."""
    q, k, v = prepare_qkv(q, k, v, v.shape[1])
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
    q, k, v = prepare_qkv(q, k, v, v.shape[1])
    states.mul_(g.float().exp()[:, :, None, None])
    pred = torch.einsum("bhkv,bhk->bhv", states, k)
    d = (v - pred) * beta.float()[:, :, None]
    states.add_(k[:, :, :, None] * d[:, :, None, :])
    return torch.einsum("bhkv,bhk->bhv", states, q)


def chunked_ref(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The chunked form of one sequence's T tokens (module docstring); updates ``state`` in
    place; returns o [T, Hv, Dv] float32. Equal to recurrent_ref up to float32 rounding."""
    q, k, v = prepare_qkv(q, k, v, v.shape[1])
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


def gated_delta_ref(q, k, v, g, beta, states: torch.Tensor, cu: list[int], slots: torch.Tensor,
                    slots_list: list[int] | None, num_decodes: int) -> torch.Tensor:
    """The step's rows through the references: the first num_decodes sequences one row each
    (decode_ref, batched by the slots tensor [B]), then each prefill chunk (chunked_ref) from its
    slot's state (slots_list: the host copy; None when every row decodes). states
    [S, Hv, Dk, Dv] float32 (updated in place); cu [B + 1] row ranges."""
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    if num_decodes:
        idx = slots[:num_decodes]
        st = states[idx]
        out[:num_decodes] = decode_ref(q[:num_decodes], k[:num_decodes], v[:num_decodes], g[:num_decodes],
                                       beta[:num_decodes], st)
        states.index_copy_(0, idx, st)
    for i in range(num_decodes, slots.shape[0]):
        lo, hi = cu[i], cu[i + 1]
        out[lo:hi] = chunked_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states[slots_list[i]])
    return out


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, cu_ptr, slot_ptr,
                      sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sgb_t, so_t, so_h, s_slot, s_head,
                      HV: tl.constexpr, REP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr):
    """One (sequence, value head, block of BV value dims): the state block [BK, BV] in registers
    over the sequence's rows cu[b]..cu[b+1] in order; read from and written back to its slot."""
    b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi = tl.load(cu_ptr + b).to(tl.int64), tl.load(cu_ptr + b + 1).to(tl.int64)  # 64-bit row offsets
    slot = tl.load(slot_ptr + b).to(tl.int64)
    ks = tl.arange(0, BK)
    vs = vb * BV + tl.arange(0, BV)
    km, vm = ks < DK, vs < DV
    sp = state_ptr + slot * s_slot + h * s_head + ks[:, None] * DV + vs[None, :]
    smask = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=smask, other=0.0)
    hk = h // REP
    for t64 in range(lo, hi):
        q = tl.load(q_ptr + t64 * sq_t + hk * sq_h + ks, mask=km, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * sk_t + hk * sk_h + ks, mask=km, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * sv_t + h * sv_h + vs, mask=vm, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * sgb_t + h).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * sgb_t + h).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q) + 1e-6)) * (1.0 / tl.sqrt(DK * 1.0))
        k = k * (1.0 / tl.sqrt(tl.sum(k * k) + 1e-6))
        s = s * tl.exp(g)
        d = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * d[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + t64 * so_t + h * so_h + vs, o, mask=vm)
    tl.store(sp, s, mask=smask)


def gated_delta_triton(q, k, v, g, beta, states: torch.Tensor, cu: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton launcher (one launch for the whole step, no host sync: graph-capturable); same
    contract as gated_delta_ref with cu [B + 1] int32 and slots [B] int64 on the device. q, k
    [T, Hk, Dk] and v [T, Hv, Dv] may be strided views (last dim contiguous); g [T, Hv] float32
    and beta [T, Hv] share strides."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert states.is_contiguous() and states.shape[1:] == (hv, dk, dv), "states must be [S, Hv, Dk, Dv]"
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.stride() == beta.stride() and g.stride(1) == 1
    out = torch.empty(t, hv, dv, dtype=torch.float32, device=q.device)
    bk, bv = next_pow2(dk), min(next_pow2(dv), 64)
    grid = (slots.shape[0], hv, triton.cdiv(dv, bv))
    _recurrent_kernel[grid](q, k, v, g, beta, out, states, cu, slots, q.stride(0), q.stride(1), k.stride(0),
                            k.stride(1), v.stride(0), v.stride(1), g.stride(0), out.stride(0), out.stride(1),
                            states.stride(0), states.stride(1), HV=hv, REP=hv // hk, DK=dk, DV=dv, BK=bk, BV=bv)
    return out


def gated_delta(q, k, v, g, beta, states, cu: torch.Tensor, slots: torch.Tensor, cu_list: list[int],
                slots_list: list[int] | None, num_decodes: int) -> torch.Tensor:
    """The gated delta rule of a step's packed rows (decodes first), each sequence from and back
    to its state slot: o [T, Hv, Dv] float32. On the GPU the recurrent kernel for the decode
    rows (one launch) and the chunked form for each prefill chunk (plugins/gated_delta_chunked.py;
    the tests run both on the CPU under TRITON_INTERPRET=1); elsewhere the torch references."""
    if not use_triton(q):
        return gated_delta_ref(q, k, v, g, beta, states, cu_list, slots, slots_list, num_decodes)
    nd = num_decodes
    if slots_list is None or nd == slots.shape[0]:  # decode rows only (a decode graph: always)
        return gated_delta_triton(q, k, v, g, beta, states, cu, slots)
    out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    if nd:
        out[:nd] = gated_delta_triton(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], states, cu[:nd + 1], slots[:nd])
    for i in range(nd, len(slots_list)):
        lo, hi = cu_list[i], cu_list[i + 1]
        out[lo:hi] = chunked_triton(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states[slots_list[i]])
    return out


def aot_launches(space) -> None:
    """A linear-attention layer's one launch per step (runtime/models/qwen3_next.py): q, k, v
    views of the conv output [T, 2 Dk Hk + Dv Hv] (the token count and batch are only the grid and
    loop bounds), g float32 and beta [T, Hv] (the activation dtype), both contiguous."""
    la = space.model.linear_attention
    if la is None:
        return
    mixed = space.fake(1, la.conv_dim, dtype=space.act_dtype)
    q = mixed[:, :la.key_dim].view(1, la.num_key_heads, la.key_head_dim)
    k = mixed[:, la.key_dim:2 * la.key_dim].view(1, la.num_key_heads, la.key_head_dim)
    v = mixed[:, 2 * la.key_dim:].view(1, la.num_value_heads, la.value_head_dim)
    g = space.fake(1, la.num_value_heads, dtype=torch.float32)
    beta = space.fake(1, la.num_value_heads, dtype=space.act_dtype)
    states = space.fake(2, la.num_value_heads, la.key_head_dim, la.value_head_dim, dtype=torch.float32)
    gated_delta_triton(q, k, v, g, beta, states, space.fake(2, dtype=torch.int32), space.fake(1, dtype=torch.int64))
