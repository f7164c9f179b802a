"""The model section of the engine format (infhip/config.py): architecture dimensions normalised
from any transformers config style, and the RoPE of each layer type. Its own module so that what
reads only a model (infhip/tensor_parallel.py) does not import the whole format."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infhip.methods.method import require

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
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
            require(t in self.rope, f"no RoPE parameters for layer type {t!r}")
        if "sliding_attention" in self.layer_types:
            require(bool(self.sliding_window) and self.sliding_window > 0,
                   "sliding_attention layers need a positive sliding_window")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window_of(self, layer: int) -> int | None:
        """Sliding window of a layer (None for full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["rope"] = {k: RopeSpec(**v) for k, v in d["rope"].items()}
        return cls(**d)
