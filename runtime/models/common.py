"""Building blocks shared by every decoder family: norm, RoPE table, paged attention, gated MLP.

Modules are created on the meta device and their weights assigned from the engine's safetensors
file (`load_state_dict(assign=True)`), so module attribute paths equal the engine's weight names
(see `infhip/config.py`). `forward` takes tensors only; step metadata comes from the forward
context.
"""

from __future__ import annotations

import torch
from torch import nn

from infhip.config import LayerPlan, ModelConfig
from infhip.plugins.activation import gated_act
from infhip.plugins.dtypes import FP8_DTYPE
from infhip.plugins.fp8_linear import Fp8Act, fp8_linear, takes_fp8_act
from infhip.plugins.rms_norm import rms_norm
from infhip.plugins.skinny_gemm import skinny_linear
from infhip.runtime.attention.dense import DENSE
from infhip.runtime.attention.paged_kv import PagedKV
from infhip.runtime.distributed.group import SINGLE
from infhip.runtime.forward_context import get_forward_context

# The plugins the blocks below launch are listed in plugins/catalog.py (MODEL_BLOCKS): the builder
# compiles what their aot_launches enumerate.

# The norms before qkv_proj / gate_up_proj and the MLP's activation write their output as fp8
# rows + scales (plugins/fp8_linear.py Fp8Act) when the next layer is an Fp8Linear on its
# torch._scaled_mm path: the same bytes as its own quantize_act, one kernel and one activation
# round trip fewer. Not a knob (it changes no numerics); tests turn it off to compare.
FUSE_FP8_ACT = True


def quantizes_input(consumer: nn.Module, x: torch.Tensor) -> bool:
    """Should the producer of consumer's input hand it fp8 rows? x: a tensor with the input's
    rows, dtype and device (the producer's own input will do). False for every bf16 engine."""
    return FUSE_FP8_ACT and isinstance(consumer, Fp8Linear) and takes_fp8_act(x, consumer.weight)


class SkinnyLinear(nn.Linear):
    """nn.Linear (same `weight`/`bias` names and state-dict keys) whose forward goes through
    `skinny_linear`: the skinny-GEMM kernel for <= 16 rows on CUDA where its fixed table (measured
    on the H200) names one, F.linear otherwise (plugins/skinny_gemm.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    return SkinnyLinear(in_features, out_features, bias=bias, device="meta")


class Fp8Linear(nn.Module):
    """A linear layer of an fp8 engine: ``weight`` [out, in] float8_e4m3fn, ``weight_scale`` [out]
    float32 (row n of the real weight is weight[n] * weight_scale[n]), ``bias`` [out] in the
    build dtype or None; forward through `fp8_linear` (plugins/fp8_linear.py: the skinny fp8
    kernel, torch._scaled_mm or the dequantizing reference, by device and rows)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        def param(*shape, dtype=torch.float32):  # on meta: the engine's tensors are assigned at load
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)

        self.weight = param(out_features, in_features, dtype=FP8_DTYPE)
        self.weight_scale = param(out_features)
        self.bias = param(out_features) if bias else None

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def use_fp8_linears(model: nn.Module, names: tuple[str, ...]) -> None:
    """Replace the modules at ``names`` (EngineConfig.fp8_linears()) by Fp8Linear of the same
    shape, before the weights are assigned: the module paths, hence the weight names, stay. A
    tied model gets an ``lm_head`` of its own when the LM head is quantized (the embeddings stay
    in the build dtype)."""
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, attr, None)
        if old is None:  # a tied LM head: hidden -> vocab
            shape = (model.cfg.hidden_size, model.cfg.vocab_size, False)
        else:
            shape = (old.in_features, old.out_features, old.bias is not None)
        setattr(owner, attr, Fp8Linear(*shape))


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, in float32; any `1 + w` offset (Gemma) was folded into w by the builder."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, device="meta"), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, consumer: nn.Module | None = None):
        """consumer: the linear layer the output feeds, if it should get fp8 rows when it can
        (`quantizes_input`; the output is then an Fp8Act)."""
        quantize = consumer is not None and quantizes_input(consumer, x)
        return rms_norm(x, self.weight, self.eps, residual, quantize=quantize)


class RopeTable(nn.Module):
    """inv_freq of one layer type, computed by the builder with transformers' RoPE init."""

    def __init__(self, head_dim: int, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(head_dim // 2, device="meta"))
        self.attention_scaling = attention_scaling


class Attention(nn.Module):
    """Fused-QKV self-attention over the paged KV cache.

    Shapes: hidden [T, hidden] -> qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k/v [T, Hkv, D]
    -> (q/k norm) -> RoPE + K/V written to the cache -> attention [T, Hq, D] -> o_proj [T, hidden].
    Under tensor parallelism Hq and Hkv are this rank's heads (ModelConfig is the rank's view)
    and o_proj's output is a partial sum, completed by one all-reduce (`tp`).
    """

    def __init__(self, cfg: ModelConfig, plan: LayerPlan, rope: RopeTable):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = linear(cfg.q_size, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.attention_scale
        self.window = plan.window
        self.kv_group = plan.attention  # "global" | "sliding": layers of a group share page tables
        self.layer_index = plan.index
        self.rope = [rope]  # a list: not a submodule (its buffer is owned by the model's `rope` dict)
        # Set by the ModelRunner after loading: the layer's paged cache, its attention backend
        # (runtime/attention/: dense, or the registered backend that claims the layer) and that
        # backend's per-layer state, if it keeps one (its attach sets it).
        self.kv: PagedKV | None = None
        self.backend = DENSE
        self.backend_state = None
        self.tp = SINGLE  # the tensor-parallel group (runtime/distributed/; set at load), a no-op at 1

    def forward(self, hidden: torch.Tensor | Fp8Act) -> torch.Tensor:
        """hidden [T, hidden]: the normed rows, or their fp8 form (input_layernorm(..., consumer=qkv_proj))."""
        ctx = get_forward_context().for_layer(self.layer_index, self.kv_group)
        qkv = self.qkv_proj(hidden)
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.contiguous())
            k = self.k_norm(k.contiguous())
        out = ctx.run_attention(self, q, k, v)  # [rows out, Hq, D]: fewer if token drop keeps fewer
        out = self.o_proj(out.view(out.shape[0], -1))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one GEMM: [T, hidden] -> [T, 2I].
    Under tensor parallelism I is this rank's share and down's output a partial sum (`tp`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = cfg.hidden_act
        self.tp = SINGLE  # as Attention.tp

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        """x [T, hidden]: the normed rows, or their fp8 form (the pre-MLP norm's, consumer=gate_up_proj)."""
        gate_up = self.gate_up_proj(x)
        act = gated_act(gate_up, self.act, quantize=quantizes_input(self.down_proj, gate_up))
        out = self.down_proj(act)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class DecoderLayer(nn.Module):
    """One decoder layer as its two halves, ``attend`` and ``feed_forward``, each (hidden,
    residual) -> (hidden, residual): the residual stream is hidden + residual, carried apart so
    that each norm also performs the preceding residual add in one kernel (residual None: the
    first layer, hidden is the whole stream). A family subclasses it with its norms; its
    attention is ``self_attn`` (an Attention), which the runner reads too.

    The seam between the halves is where step transforms that route rows act
    (runtime/step_transform.py TransformStep; UniPrefill token drop, infhip/methods/token_drop/runtime/step.py): before
    the layer (``enter_layer``: dropped rows may come back) and after its attention
    (``after_attention``: the rows attention returned; the residual may lose rows to match), so
    ``feed_forward`` runs on the rows kept. Without routers the layer is its two halves, back to
    back."""

    self_attn: Attention

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, routers=()):
        """routers: the step's TransformSteps that route rows (``routes``), in registration order."""
        if not routers:
            return self.feed_forward(*self.attend(hidden, residual))
        i = self.layer_index if hasattr(self, "layer_index") else self.self_attn.layer_index
        for r in routers:
            hidden, residual = r.enter_layer(i, hidden, residual)
        hidden, residual = self.attend(hidden, residual)
        for r in routers:
            hidden, residual = r.after_attention(i, hidden, residual)
        return self.feed_forward(hidden, residual)

    def attend(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        """The attention half: (stream) -> (attention output [rows attention returned, hidden],
        residual)."""
        raise NotImplementedError

    def feed_forward(self, hidden: torch.Tensor, residual: torch.Tensor):
        """The feed-forward half: (attention output, residual) -> (MLP output, residual)."""
        raise NotImplementedError


class CausalLM(nn.Module):
    """Shared top of every family: embeddings, decoder layers, final norm, LM head.

    Subclasses set `layer_cls` (a DecoderLayer). `forward(input_ids [T]) -> hidden [T, hidden]`;
    `compute_logits(hidden [N, hidden]) -> [N, vocab] float32`.
    """

    layer_cls: type[DecoderLayer]

    def __init__(self, cfg: ModelConfig, layers: tuple[LayerPlan, ...]):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device="meta")
        self.rope = nn.ModuleDict({name: RopeTable(cfg.head_dim, spec.attention_scaling)
                                   for name, spec in cfg.rope.items()})
        # a layer without RoPE (Qwen3-Next's linear attention) gets None
        self.layers = nn.ModuleList(self.layer_cls(cfg, p, self.rope[p.rope_group] if p.rope_group in self.rope else None)
                                    for p in layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.cfg.embedding_multiplier != 1.0:
            # Gemma multiplies by sqrt(hidden) rounded to the model dtype, as transformers does.
            hidden = hidden * torch.tensor(self.cfg.embedding_multiplier, dtype=hidden.dtype)
        return hidden

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Step transforms that route rows (runtime/step_transform.py; e.g. UniPrefill token drop,
        # infhip/methods/token_drop/runtime/step.py) act only here and in DecoderLayer.forward: a router may keep
        # fewer rows after a layer's attention and bring them back before a later layer, and at
        # the end (reconstitute).
        routers = [t for t in get_forward_context().transforms.values() if t.routes]
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, routers)
        for r in routers:
            hidden, residual = r.reconstitute(hidden, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = getattr(self, "lm_head", None)  # absent when tied, unless quantized (use_fp8_linears)
        # the LM head is the skinny GEMM's best case
        logits = (head(hidden) if head is not None else skinny_linear(hidden, self.embed_tokens.weight)).float()
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
