"""Qwen3-Next's kernels and their plain-torch references at small odd shapes. Linear attention:
the chunked gated delta rule equals the token-by-token recurrence (from a nonzero state, with a
partial last chunk, grouped value heads) and a float64 recurrence written from the paper's
update rule (to catch a wrong shared derivation); a sequence split into pieces equals it whole
(the state carries); the batched decode step equals the recurrence; the causal conv likewise;
the Triton kernels (interpreted) equal the references. MoE: the fused grouped-GEMM kernels equal
the per-expert loop, and the router is softmax-top-k renormalised."""

from __future__ import annotations

import torch

from infhip.plugins.causal_conv import conv_decode, conv_prefill
from infhip.plugins.gated_delta import chunked_ref, decode_ref, recurrent_ref
from infhip.plugins.moe import block_rows, experts_ref, experts_triton, route


def _inputs(t: int, hk: int = 3, hv: int = 6, dk: int = 5, dv: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay = -torch.rand(t, hv, generator=g) * 0.5
    beta = torch.rand(t, hv, generator=g)
    state = torch.randn(hv, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, state


def _naive64(q, k, v, decay, beta, state):
    """S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T q (q, k unit, q / sqrt(dk)), float64."""
    rep = v.shape[1] // q.shape[1]
    q, k = (torch.nn.functional.normalize(x.double(), dim=-1).repeat_interleave(rep, 1) for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    s, out = state.double().clone(), []
    for t in range(q.shape[0]):
        s = s * decay[t].double().exp()[:, None, None]
        err = v[t].double() - torch.einsum("hkv,hk->hv", s, k[t])
        s = s + beta[t].double()[:, None, None] * k[t][:, :, None] * err[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out), s


def test_chunked_equals_recurrent_and_float64():
    q, k, v, decay, beta, state = _inputs(37)
    s_rec, s_chunk = state.clone(), state.clone()
    o_rec = recurrent_ref(q, k, v, decay, beta, s_rec)
    o_chunk = chunked_ref(q, k, v, decay, beta, s_chunk, chunk=16)  # 16 + 16 + 5
    o64, s64 = _naive64(q, k, v, decay, beta, state)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_chunk, s_rec, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o_rec.double(), o64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_rec.double(), s64, atol=1e-4, rtol=1e-4)


def test_pieces_carry_the_state_and_decode_matches():
    q, k, v, decay, beta, state = _inputs(23, seed=1)
    whole_s = state.clone()
    whole = chunked_ref(q, k, v, decay, beta, whole_s, chunk=8)
    s = state.clone()
    parts = [chunked_ref(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], s, chunk=8) for a, b in ((0, 11), (11, 20))]
    last = decode_ref(q[20:21], k[20:21], v[20:21], decay[20:21], beta[20:21], s_b := s[None].clone())
    parts.append(last)
    s = s_b[0]
    for t in (21, 22):
        parts.append(decode_ref(q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1], s[None]))
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, whole_s, atol=1e-4, rtol=1e-4)


def test_causal_conv_pieces_and_decode_equal_whole():
    g = torch.Generator().manual_seed(2)
    c, kk, t = 11, 4, 13
    x, w = torch.randn(t, c, generator=g), torch.randn(c, kk, generator=g)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(x.t()[None], w[:, None], padding=kk - 1, groups=c)[0, :, :t]).t()
    state = torch.zeros(c, kk - 1)
    out = [conv_prefill(x[:5], w, state), conv_prefill(x[5:11], w, state)]
    states = state[None].clone()
    for i in (11, 12):
        out.append(conv_decode(x[i:i + 1], w, states))
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], x[-(kk - 1):].t())


def _step(seed: int = 3, lens=(1, 1, 9, 4), hk: int = 3, hv: int = 6, dk: int = 5, dv: int = 7, c: int = 11):
    """A step of two decode rows then two prefill chunks of sequences in slots 4, 1, 0, 2 of 5."""
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    t = cu[-1]
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay, beta = -torch.rand(t, hv, generator=g) * 0.5, torch.rand(t, hv, generator=g)
    states = torch.randn(5, hv, dk, dv, generator=g) * 0.3
    x, w, conv_states = torch.randn(t, c + 3, generator=g)[:, :c], torch.randn(c, 4, generator=g), torch.randn(5, c, 3, generator=g)
    return cu, [4, 1, 0, 2], (q, k, v, decay, beta, states), (x, w, conv_states)


def test_triton_kernels_equal_the_references():
    """One launch per step (Triton, interpreted) equals the references' per-sequence path, the
    untouched slot (3) included; the conv input a strided view as the model passes it."""
    from infhip.plugins.causal_conv import conv_ref, conv_triton
    from infhip.plugins.gated_delta import gated_delta_ref, gated_delta_triton

    cu, slots, (q, k, v, decay, beta, states), (x, w, conv_states) = _step()
    cu_t, slots_t = torch.tensor(cu, dtype=torch.int32), torch.tensor(slots)
    s_ref, s_tri = states.clone(), states.clone()
    o_ref = gated_delta_ref(q, k, v, decay, beta, s_ref, cu, slots_t, slots, 2)
    o_tri = gated_delta_triton(q, k, v, decay, beta, s_tri, cu_t, slots_t)
    torch.testing.assert_close(o_tri, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-4, rtol=1e-4)
    c_ref, c_tri = conv_states.clone(), conv_states.clone()
    y_ref = conv_ref(x, w, c_ref, cu, slots_t, slots, 2)
    y_tri = conv_triton(x, w, c_tri, cu_t, slots_t)
    torch.testing.assert_close(y_tri, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_tri, c_ref)
    assert torch.equal(c_tri[3], conv_states[3]) and torch.equal(s_tri[3], states[3])


def test_chunked_triton_scan_equals_the_reference():
    """The GPU prefill path (batched chunk preparation + the Triton scan, interpreted) from a
    nonzero state over 2 chunks and a partial third (64 + 64 + 9 tokens)."""
    from infhip.plugins.gated_delta_chunked import chunked_triton

    q, k, v, decay, beta, state = _inputs(137, seed=4)
    s_ref, s_tri = state.clone(), state.clone()
    o_ref = chunked_ref(q, k, v, decay, beta, s_ref)
    o_tri = chunked_triton(q, k, v, decay, beta, s_tri)
    torch.testing.assert_close(o_tri, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-4, rtol=1e-4)


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
    # the prefill block size: 100 tokens top-2 of 3 experts (200 pairs >= 64 x 3), blocks of 64
    # pairs, the experts' last blocks partial
    assert block_rows(190, 3) == 16 and block_rows(200, 3) == 64
    x2 = torch.randn(100, h, generator=g)
    ids2 = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(100)])
    w2, gu2, dn2 = torch.rand(100, 2, generator=g), gate_up[:3].contiguous(), down[:3].contiguous()
    torch.testing.assert_close(experts_triton(x2, gu2, dn2, w2, ids2), experts_ref(x2, gu2, dn2, w2, ids2),
                               atol=1e-4, rtol=1e-4)


def test_route_is_softmax_topk_renormalised():
    g = torch.Generator().manual_seed(1)
    x, wr = torch.randn(5, 8, generator=g), torch.randn(6, 8, generator=g)
    weights, ids = route(x, wr, 2, True)
    probs = torch.softmax(x @ wr.t(), -1)
    top = probs.topk(2, -1)
    torch.testing.assert_close(ids, top.indices)
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True))
