"""The model section of the engine format (infhip/config.py): architecture dimensions normalised
from any transformers config style, and the RoPE of each layer type. Its own module so that what
reads only a model (infhip/tensor_parallel.py) does not import the whole format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infhip.methods.method import require

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_next")
# linear_attention: a gated DeltaNet layer (Qwen3-Next): a recurrent state per sequence, no KV
# pages and no RoPE
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type. ``inv_freq`` itself is a tensor in the weights file
    (``rope.<layer_type>.inv_freq``) so every rope flavour (default, linear, llama3, yarn) is
    reduced at build time to: angle = position * inv_freq; cos/sin multiplied by
    ``attention_scaling``."""

    rope_type: str
    rope_theta: float
    attention_scaling: float = 1.0
    params: dict[str, Any] = field(default_factory=dict)  # the HF rope_parameters, for the record


@dataclass(frozen=True)
class LinearAttentionSpec:
    """A gated DeltaNet layer's shapes (Qwen3-Next ``linear_*``): q/k heads of ``key_head_dim``,
    v heads of ``value_head_dim`` (num_value_heads a multiple of num_key_heads), a depthwise
    causal conv of ``conv_kernel`` taps over the [q | k | v] channels."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        require(self.num_value_heads % self.num_key_heads == 0,
                f"linear attention: {self.num_value_heads} value heads not a multiple of {self.num_key_heads} key heads")
        require(self.conv_kernel >= 2, f"linear attention: conv kernel {self.conv_kernel} < 2")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:  # channels of the conv: q, k, v
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoeSpec:
    """A sparse MoE feed-forward (Qwen3-Next): softmax router over ``num_experts``, top
    ``top_k`` (renormalised when ``norm_topk_prob``), experts of width ``intermediate_size``,
    and a shared expert of ``shared_intermediate_size`` gated by sigmoid(shared_expert_gate(x)).
    ``layers``: the layers whose MLP is this block (the others keep the dense gated MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        require(0 < self.top_k <= self.num_experts, f"MoE top_k {self.top_k} not in 1..{self.num_experts}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture dimensions, normalised from any transformers config style."""

    architecture: str  # one of ARCHITECTURES
    hf_model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str  # one of ACTIVATIONS
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (Qwen2)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma-3)
    attention_scale: float  # softmax scale (head_dim**-0.5, Gemma-3: query_pre_attn_scalar**-0.5)
    embedding_multiplier: float  # Gemma-3: sqrt(hidden_size), cast to the model dtype; else 1.0
    max_position_embeddings: int  # trained context window
    layer_types: tuple[str, ...]  # per layer, one of LAYER_TYPES
    sliding_window: int | None  # tokens a sliding layer sees, the query included
    rope: dict[str, RopeSpec]  # keyed by layer type
    final_logit_softcapping: float | None = None
    # Qwen3-Next: RoPE on the first rotary_dim dims of a head only (None: all); the builder
    # permutes q/k so the runtime's rotate-half kernel rotates exactly those (builder/qwen3_next.py)
    rotary_dim: int | None = None
    attn_output_gate: bool = False  # attention output * sigmoid(gate), gate rows after v in qkv_proj
    linear_attention: LinearAttentionSpec | None = None  # shapes of the linear_attention layers
    moe: MoeSpec | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require(self.architecture in ARCHITECTURES,
               f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        require(self.hidden_act in ACTIVATIONS, f"hidden_act {self.hidden_act!r} not in {ACTIVATIONS}")
        require(self.num_heads % self.num_kv_heads == 0,
               f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        require(len(self.layer_types) == self.num_layers,
               f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        for t in self.layer_types:
            require(t in LAYER_TYPES, f"layer type {t!r} not in {LAYER_TYPES}")
            require(t not in ATTENTION_LAYER_TYPES or t in self.rope, f"no RoPE parameters for layer type {t!r}")
        require(("linear_attention" in self.layer_types) == (self.linear_attention is not None),
                "linear_attention layers come with their shapes (linear_attention), and only with them")
        if "sliding_attention" in self.layer_types:
            require(bool(self.sliding_window) and self.sliding_window > 0,
                   "sliding_attention layers need a positive sliding_window")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the linear_attention (recurrent-state) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def window_of(self, layer: int) -> int | None:
        """Sliding window of a layer (None for full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["rope"] = {k: RopeSpec(**v) for k, v in d["rope"].items()}
        if d.get("linear_attention") is not None:
            d["linear_attention"] = LinearAttentionSpec(**d["linear_attention"])
        if d.get("moe") is not None:
            d["moe"] = MoeSpec(**{**d["moe"], "layers": tuple(d["moe"]["layers"])})
        return cls(**d)
