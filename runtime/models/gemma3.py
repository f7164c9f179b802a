"""Gemma-3 text decoder: 5:1 sliding/global layers, q/k norm, four norms per layer, GeGLU,
embeddings scaled by sqrt(hidden). Sliding and global layers differ only in their LayerPlan
(window, RoPE table), which the shared `Attention` reads.
"""

from __future__ import annotations

import torch

from infhip.config import LayerPlan, ModelConfig
from infhip.runtime.models.common import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, RopeTable


class Gemma3Attention(Attention):
    pass


class Gemma3MLP(GatedMLP):
    pass


class Gemma3DecoderLayer(DecoderLayer):
    """transformers: h = h + post_attn_norm(attn(in_norm(h))); h = h + post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, rope: RopeTable):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, plan, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = Gemma3MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def attend(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        """in_norm (with the residual add), attention, post_attn_norm: (stream) -> (normed
        attention output, residual)."""
        qkv = self.self_attn.qkv_proj  # fp8 engines: the norm may write its rows in fp8 for it
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, consumer=qkv), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, consumer=qkv)
        return self.post_attention_layernorm(self.self_attn(hidden)), residual

    def feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor):
        """pre_ff_norm (with the residual add), MLP, post_ff_norm."""
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual, consumer=self.mlp.gate_up_proj)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(CausalLM):
    layer_cls = Gemma3DecoderLayer
