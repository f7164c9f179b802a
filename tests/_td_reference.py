"""Plain-torch reference of UniPrefill token dropping: the whole sequence (prompt + generated
tokens) in one causal pass, with no paging, no compaction, no kernels, dropping expressed as
masks only. It reads the engine's weights (the runtime modules' tensors) and the kept prompt
positions each anchor chose, and applies the semantics of runtime/token_drop.py:

* at an anchor every row re-enters (dropped rows carry the stream they had when dropped) and the
  anchor chooses its kept set from them;
* from the anchor on (its own attention included), active rows = its kept prompt positions plus
  every generated token; a layer updates active rows only, and its keys are the active rows (a
  dropped token wrote no KV there);
* sliding layers see keys in (p - W, p], global layers all keys <= p.

Logits at row t equal what an engine decoding token t + 1 should compute.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, inv_freq, scaling):
    angle = pos.double()[:, None] * inv_freq.double()[None, :]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None, :] * scaling
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None, :] * scaling
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


@torch.no_grad()
def reference_logits(model, ids: list[int], num_prompt: int, kept: dict[int, torch.Tensor],
                     plan_layers) -> torch.Tensor:
    """float64 logits [len(ids), vocab]. kept: anchor layer -> kept prompt positions (a layer not
    in kept keeps every row); plan_layers: the engine plan's LayerPlan tuple."""
    cfg = model.cfg
    gemma = cfg.architecture == "gemma3"
    L = len(ids)
    dev = model.embed_tokens.weight.device
    pos = torch.arange(L, device=dev)
    x = model.embed(torch.tensor(ids, device=dev)).double()
    kept = {layer: p.to(dev) for layer, p in kept.items()}
    active = torch.ones(L, dtype=torch.bool, device=dev)
    for l, layer in enumerate(model.layers):
        lp, attn = plan_layers[l], layer.self_attn
        if lp.window is None:
            active = torch.ones(L, dtype=torch.bool, device=dev)  # reconstitution: every row re-enters
            if l in kept:  # this anchor's drop: only its kept tokens (and generated ones) from here on
                active = torch.zeros(L, dtype=torch.bool, device=dev)
                active[kept[l]] = True
                active[num_prompt:] = True
        keys = active.clone()  # a token writes KV at a layer exactly when it runs that layer
        h = _rms(x, layer.input_layernorm.weight.double(), cfg.rms_norm_eps)
        qkv = F.linear(h, attn.qkv_proj.weight.double(),
                       None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.double())
        qs, kvs = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q = qkv[:, :qs].view(L, cfg.num_heads, cfg.head_dim)
        k = qkv[:, qs:qs + kvs].view(L, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, qs + kvs:].view(L, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = _rms(q, attn.q_norm.weight.double(), cfg.rms_norm_eps)
            k = _rms(k, attn.k_norm.weight.double(), cfg.rms_norm_eps)
        rope = attn.rope[0]
        q, k = _rope(q, pos, rope.inv_freq, rope.attention_scaling), _rope(k, pos, rope.inv_freq, rope.attention_scaling)
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        visible = (pos[None, :] <= pos[:, None]) & keys[None, :]
        if lp.window is not None:
            visible &= pos[None, :] > pos[:, None] - lp.window
        s = torch.einsum("qhd,khd->hqk", q, k) * attn.scale
        p = torch.softmax(s.masked_fill(~visible[None], -math.inf), -1)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(L, -1)
        a = F.linear(o, attn.o_proj.weight.double())
        mlp = layer.mlp
        if gemma:
            x1 = x + _rms(a, layer.post_attention_layernorm.weight.double(), cfg.rms_norm_eps)
            h2 = _rms(x1, layer.pre_feedforward_layernorm.weight.double(), cfg.rms_norm_eps)
        else:
            x1 = x + a
            h2 = _rms(x1, layer.post_attention_layernorm.weight.double(), cfg.rms_norm_eps)
        gate, up = F.linear(h2, mlp.gate_up_proj.weight.double()).chunk(2, -1)
        act = F.gelu(gate, approximate="tanh") if cfg.hidden_act == "gelu_tanh" else F.silu(gate)
        m = F.linear(act * up, mlp.down_proj.weight.double())
        if gemma:
            m = _rms(m, layer.post_feedforward_layernorm.weight.double(), cfg.rms_norm_eps)
        x = torch.where(active[:, None], x1 + m, x)
    h = _rms(x, model.norm.weight.double(), cfg.rms_norm_eps)
    weight = model.embed_tokens.weight if cfg.tie_word_embeddings else model.lm_head.weight
    logits = F.linear(h, weight.double())
    if cfg.final_logit_softcapping:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits
