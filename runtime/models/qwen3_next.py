"""Qwen3-Next: gated DeltaNet (linear attention) layers with a gated full-attention layer every
``full_attention_interval``-th, a sparse MoE with a shared expert; names as transformers'
modeling_qwen3_next.py (Qwen3NextGatedDeltaNet, Qwen3NextAttention, Qwen3NextSparseMoeBlock,
Qwen3NextDecoderLayer). Weight layouts (row orders, stacked experts): builder/qwen3_next.py.

A step's rows are packed (decodes first, then prefill chunks, runtime/forward_context.py);
a linear layer reads and writes each sequence's recurrent state in its slot
(runtime/linear_state.py). On the GPU the conv and the decode rows' delta rule take the whole
step in one launch each, by the step's row ranges and slot tensors (graph-capturable), and each
prefill chunk takes the chunked delta rule; the torch references (CPU) batch the decode rows by
slot and run each prefill chunk from the state its earlier chunks left.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infhip.config import LayerPlan, ModelConfig
from infhip.plugins.causal_conv import causal_conv
from infhip.plugins.gated_delta import gated_delta
from infhip.plugins.moe import moe_experts, route
from infhip.runtime.forward_context import get_forward_context
from infhip.runtime.models.common import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, RopeTable, linear


def _param(*shape) -> nn.Parameter:
    """A float32 parameter on meta: the engine's tensor is assigned at load."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


def rows_flowing(ctx) -> tuple[torch.Tensor, list[int]]:
    """(cu [B + 1] int32 on the device, its host copy) of the rows flowing through the layer now:
    the step's, or after a token drop (infhip/methods/token_drop/runtime/step.py) the kept rows' compact offsets, so
    a linear layer runs each sequence's kept tokens in order and its state is theirs. Decode rows
    never drop: they stay the first num_decodes rows."""
    for step in ctx.transforms.values():
        rows = step.flowing_rows()
        if rows is not None:
            return rows
    return ctx.cu_seqlens_q, ctx.cu_seqlens_q_list


def _pending_selection(ctx) -> torch.Tensor | None:
    """The rows a token drop before attention keeps at this layer (its attention returns only
    those), to narrow the output gate alike; None when none is pending."""
    for step in ctx.transforms.values():
        rows = step.attended_rows()
        if rows is not None:
            return rows
    return None


class Qwen3NextAttention(Attention):
    """Attention with an output gate: qkv_proj rows [q | k | v | gate]; out * sigmoid(gate)
    before o_proj. Partial RoPE is the builder's row order (rotary dims paired for rotate-half)."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, rope: RopeTable):
        super().__init__(cfg, plan, rope)
        self.qkv_proj = linear(cfg.hidden_size, 2 * cfg.q_size + 2 * cfg.kv_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context().for_layer(self.layer_index, self.kv_group)
        qkv = self.qkv_proj(hidden)
        t, qs, kvs = qkv.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v, gate = qkv.split([qs, kvs, kvs, qs], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim).contiguous())
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim).contiguous())
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = ctx.run_attention(self, q, k, v)
        if out.shape[0] != t:  # token drop before attention: only the kept rows attended
            gate = gate.index_select(0, _pending_selection(ctx))
        return self.o_proj(out.reshape(out.shape[0], -1) * torch.sigmoid(gate))


class Qwen3NextGatedDeltaNet(nn.Module):
    """in_proj -> [q k v | z | b | a]; causal conv + silu over q k v; gated delta rule (beta =
    sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)); RMSNorm(o) * silu(z); out_proj."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan):
        super().__init__()
        la = self.spec = cfg.linear_attention
        self.layer_index = plan.index
        self.in_proj = linear(cfg.hidden_size, la.conv_dim + la.value_dim + 2 * la.num_value_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = _param(la.conv_dim, 1, la.conv_kernel)
        self.dt_bias = _param(la.num_value_heads)
        self.A_log = _param(la.num_value_heads)
        self.norm = RMSNorm(la.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = linear(la.value_dim, cfg.hidden_size)
        self.state = None  # the engine's RecurrentState (runtime/linear_state.py), set by the ModelRunner

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        la, t = self.spec, hidden.shape[0]
        slots, slots_list = ctx.recurrent.slots, ctx.recurrent.slots_list
        row = self.state.row[self.layer_index]
        conv_states, ssm_states = self.state.conv[row], self.state.ssm[row]  # [S + 1, ...] views
        qkv, z, b, a = self.in_proj(hidden).split([la.conv_dim, la.value_dim, la.num_value_heads,
                                                   la.num_value_heads], dim=-1)
        nd, (cu, cu_list) = ctx.num_decodes, rows_flowing(ctx)
        mixed = causal_conv(qkv, self.conv1d.weight[:, 0], conv_states, cu, slots, cu_list, slots_list, nd)
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = q.view(t, la.num_key_heads, la.key_head_dim)
        k = k.view(t, la.num_key_heads, la.key_head_dim)
        v = v.view(t, la.num_value_heads, la.value_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = gated_delta(q, k, v, g, beta, ssm_states, cu, slots, cu_list, slots_list, nd)
        return self.out_proj(self.gated_norm(core.to(hidden.dtype), z).reshape(t, la.value_dim))

    def gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Qwen3NextRMSNormGated: (o / rms(o), cast to o's dtype) * w * silu(z), over each head's
        Dv: o [T, Hv, Dv], z [T, Hv * Dv]."""
        x = o.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm.eps)).to(o.dtype)
        x = self.norm.weight.to(o.dtype) * x
        return (x * F.silu(z.float()).view_as(x)).to(o.dtype)


class Qwen3NextMLP(GatedMLP):
    """The dense gated MLP (mlp_only_layers) and the shared expert, of any width."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__(cfg)
        if intermediate_size is not None:
            self.gate_up_proj = linear(cfg.hidden_size, 2 * intermediate_size)
            self.down_proj = linear(intermediate_size, cfg.hidden_size)


class Qwen3NextExperts(nn.Module):
    """The routed experts, stacked: gate_up_proj.weight [E * 2I, H], down_proj.weight [E * H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, i, h = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size
        self.shape = (e, i, h)
        self.gate_up_proj, self.down_proj = nn.Module(), nn.Module()
        self.gate_up_proj.weight = _param(e * 2 * i, h)
        self.down_proj.weight = _param(e * h, i)

    def forward(self, x, topk_weights, topk_ids):
        e, i, h = self.shape
        return moe_experts(x, self.gate_up_proj.weight.view(e, 2 * i, h), self.down_proj.weight.view(e, h, i),
                           topk_weights, topk_ids)


class Qwen3NextSparseMoeBlock(nn.Module):
    """routed experts (top-k of a softmax router) + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.moe.top_k, cfg.moe.norm_topk_prob
        self.gate = linear(cfg.hidden_size, cfg.moe.num_experts)
        self.experts = Qwen3NextExperts(cfg)
        self.shared_expert = Qwen3NextMLP(cfg, cfg.moe.shared_intermediate_size)
        self.shared_expert_gate = linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.gate.weight, self.top_k, self.norm_topk_prob)
        routed = self.experts(x, weights, ids)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(DecoderLayer):
    """h = h + mixer(in_norm(h)); h = h + mlp(post_attn_norm(h)); the mixer is ``linear_attn``
    or ``self_attn`` by the layer's kind."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, rope: RopeTable | None):
        super().__init__()
        self.layer_index = plan.index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if plan.attention == "linear":
            self.linear_attn = Qwen3NextGatedDeltaNet(cfg, plan)
        else:
            self.self_attn = Qwen3NextAttention(cfg, plan, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        moe = cfg.moe is not None and plan.index in cfg.moe.layers
        self.mlp = Qwen3NextSparseMoeBlock(cfg) if moe else Qwen3NextMLP(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def attend(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.mixer(hidden), residual

    def feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor):
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3NextForCausalLM(CausalLM):
    layer_cls = Qwen3NextDecoderLayer
