"""Plain-torch float64 reference of token dropping (UniPrefill) on Qwen3-Next (linear-attention
layers between the full-attention anchors; MoE feed-forward), for the tests: the whole sequence
(prompt + generated tokens) in one pass, no paging, no kernels, dropping as masks, with the
semantics of eval/token_drop_reference.py (which it follows for the schedule: drop
layers, drop point, re-entry) and, for the layers that reference does not have:

* a linear-attention (gated DeltaNet) layer runs over the rows active at it, in position order:
  its causal conv's previous inputs and its recurrent state are those of the active (kept)
  tokens only; a row not active keeps its stream;
* the MoE (routed top-k + gated shared expert) runs over the rows that run the layer's MLP.

It reads the engine's weights in the engine's layout (builder/qwen3_next.py: [q|k|v|gate] rows
with partial RoPE as a head permutation, [q|k|v|z|b|a] in_proj, stacked experts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from infhip.eval.token_drop_reference import _rms, _rope


def _linear_attention(la_mod, h: torch.Tensor, eps: float) -> torch.Tensor:
    """The gated DeltaNet over rows h [N, hidden] of one sequence, from a zero state (float64)."""
    la = la_mod.spec
    n = h.shape[0]
    proj = F.linear(h, la_mod.in_proj.weight.double())
    qkv, z, b, a = proj.split([la.conv_dim, la.value_dim, la.num_value_heads, la.num_value_heads], -1)
    w = la_mod.conv1d.weight.double()[:, 0]  # [C, K]
    padded = torch.cat([qkv.new_zeros(la.conv_kernel - 1, la.conv_dim), qkv])
    mixed = F.silu(sum(w[:, i] * padded[i:i + n] for i in range(la.conv_kernel)))
    q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], -1)
    rep = la.num_value_heads // la.num_key_heads
    q = F.normalize(q.view(n, la.num_key_heads, -1), dim=-1).repeat_interleave(rep, 1) / la.key_head_dim ** 0.5
    k = F.normalize(k.view(n, la.num_key_heads, -1), dim=-1).repeat_interleave(rep, 1)
    v = v.view(n, la.num_value_heads, -1)
    beta = b.sigmoid()
    g = -la_mod.A_log.double().exp() * F.softplus(a + la_mod.dt_bias.double())
    s = torch.zeros(la.num_value_heads, la.key_head_dim, la.value_head_dim, dtype=torch.float64, device=h.device)
    out = []
    for t in range(n):
        s = s * g[t].exp()[:, None, None]
        s = s + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    o = torch.stack(out)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * la_mod.norm.weight.double()
    o = o * F.silu(z).view_as(o)
    return F.linear(o.reshape(n, -1), la_mod.out_proj.weight.double())


def _feed_forward(mlp, h: torch.Tensor) -> torch.Tensor:
    def gated(gate_up, down, x):
        gate, up = F.linear(x, gate_up.double()).chunk(2, -1)
        return F.linear(F.silu(gate) * up, down.double())

    if not hasattr(mlp, "experts"):
        return gated(mlp.gate_up_proj.weight, mlp.down_proj.weight, h)
    e, i, hid = mlp.experts.shape
    probs = torch.softmax(F.linear(h, mlp.gate.weight.double()), -1)
    top, ids = probs.topk(mlp.top_k, -1)
    if mlp.norm_topk_prob:
        top = top / top.sum(-1, keepdim=True)
    gate_up = mlp.experts.gate_up_proj.weight.view(e, 2 * i, hid)
    down = mlp.experts.down_proj.weight.view(e, hid, i)
    out = torch.zeros_like(h)
    for r in range(h.shape[0]):
        for j in range(mlp.top_k):
            out[r] += top[r, j] * gated(gate_up[ids[r, j]], down[ids[r, j]], h[r:r + 1])[0]
    shared = mlp.shared_expert
    return out + torch.sigmoid(F.linear(h, mlp.shared_expert_gate.weight.double())) * gated(
        shared.gate_up_proj.weight, shared.down_proj.weight, h)


def _attention(attn, h: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor, cfg) -> torch.Tensor:
    n, qs, kvs = h.shape[0], cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q, k, v, gate = F.linear(h, attn.qkv_proj.weight.double()).split([qs, kvs, kvs, qs], -1)
    q = _rms(q.reshape(n, cfg.num_heads, -1), attn.q_norm.weight.double(), cfg.rms_norm_eps)
    k = _rms(k.reshape(n, cfg.num_kv_heads, -1), attn.k_norm.weight.double(), cfg.rms_norm_eps)
    rope = attn.rope[0]
    q, k = _rope(q, pos, rope.inv_freq, rope.attention_scaling), _rope(k, pos, rope.inv_freq, rope.attention_scaling)
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.reshape(n, cfg.num_kv_heads, -1).repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * attn.scale
    o = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~visible[None], -math.inf), -1), v).reshape(n, -1)
    return F.linear(o * torch.sigmoid(gate), attn.o_proj.weight.double())


@torch.no_grad()
def reference_logits(model, ids: list[int], num_prompt: int, kept: dict[int, torch.Tensor], plan_layers,
                     schedule: dict | None = None) -> torch.Tensor:
    """float64 logits [len(ids), vocab]; kept, plan_layers, schedule as token_drop_reference's
    reference_logits (schedule default: every full-attention layer, before, re-entry)."""
    cfg = model.cfg
    L, dev = len(ids), model.embed_tokens.weight.device
    pos = torch.arange(L, device=dev)
    x = model.embed(torch.tensor(ids, device=dev)).double()
    kept = {layer: p.to(dev) for layer, p in kept.items()}
    schedule = dict(schedule or {})
    full = [lp.index for lp in plan_layers if lp.attention != "linear"]
    drop_layers = set(schedule.get("layers", full))
    after, reenter = schedule.get("point", "before") == "after", schedule.get("reenter", True)
    active = torch.ones(L, dtype=torch.bool, device=dev)
    for l, layer in enumerate(model.layers):
        h = _rms(x, layer.input_layernorm.weight.double(), cfg.rms_norm_eps)
        keys = active.clone()
        if hasattr(layer, "linear_attn"):
            rows = torch.nonzero(active).flatten()
            a = torch.zeros_like(x)
            a[rows] = _linear_attention(layer.linear_attn, h[rows], cfg.rms_norm_eps)
        else:
            if l in drop_layers:
                if reenter:
                    active = torch.ones(L, dtype=torch.bool, device=dev)
                    keys = active.clone()
                if l in kept:
                    active = torch.zeros(L, dtype=torch.bool, device=dev)
                    active[kept[l]] = True
                    active[num_prompt:] = True
                    if not after:
                        keys = active.clone()
            visible = (pos[None, :] <= pos[:, None]) & keys[None, :]
            a = _attention(layer.self_attn, h, pos, visible, cfg)
        x1 = x + a
        h2 = _rms(x1, layer.post_attention_layernorm.weight.double(), cfg.rms_norm_eps)
        x = torch.where(active[:, None], x1 + _feed_forward(layer.mlp, h2), torch.where(keys[:, None], x1, x))
    h = _rms(x, model.norm.weight.double(), cfg.rms_norm_eps)
    weight = model.embed_tokens.weight if cfg.tie_word_embeddings else model.lm_head.weight
    return F.linear(h, weight.double())
