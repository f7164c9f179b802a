"""Llama-family decoders: Llama-3.x, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The four differ only in flags of `ModelConfig` (attention_bias, qk_norm, rope) that the shared
`Attention` reads, so one decoder layer serves them all. The residual stream is carried as
(hidden, residual) so each norm also performs the preceding residual add in one kernel.
"""

from __future__ import annotations

import torch

from infhip.config import LayerPlan, ModelConfig
from infhip.runtime.models.common import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, RopeTable


class LlamaAttention(Attention):
    pass


class LlamaMLP(GatedMLP):
    pass


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, plan: LayerPlan, rope: RopeTable):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, plan, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def attend(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        """in_norm (with the residual add), attention: (stream) -> (attention output, residual)."""
        qkv = self.self_attn.qkv_proj  # fp8 engines: the norm may write its rows in fp8 for it
        if residual is None:
            hidden, residual = self.input_layernorm(hidden, consumer=qkv), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual, consumer=qkv)
        return self.self_attn(hidden), residual

    def feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor):
        """post_attn_norm (with the residual add), MLP."""
        hidden, residual = self.post_attention_layernorm(hidden, residual, consumer=self.mlp.gate_up_proj)
        return self.mlp(hidden), residual


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
