"""Engine format v1: the typed configuration that the builder writes and the runtime reads.

One place for the contract between `infhip.builder` and `infhip.runtime`. Everything here is
plain data (dataclasses validated in ``__post_init__``) serialised to ``config.json``; values
computed at load time (number of KV pages, CUDA-graph pools) live in runtime objects instead.
The knobs of a plan are in infhip/knobs.py (InfiniteHiP) and infhip/token_drop_knobs.py, with their descriptions.

Engine directory (SPEC §3)::

    <engine>/config.json        EngineConfig.to_dict(), "format": "infhip-engine" first (is_engine_dir)
    <engine>/rank0.safetensors  weights, our names (see WEIGHT NAMES below); a tensor-parallel engine
                                (build.tp = N) has rank0..rank{N-1}.safetensors, each rank's shard of
                                the same names (infhip/tensor_parallel.py; "tensor_parallel" records it)
    <engine>/tokenizer/         tokenizer.json + tokenizer_config.json (may be absent: random weights)
    <engine>/kernels/index.json plugin kernels known for the target
    <engine>/build_report.json  what was built, sizes, timings, warnings

WEIGHT NAMES (``L`` = layer index; norm weights are float32 with any ``1 + w`` offset folded in):
    embed_tokens.weight                      [vocab, hidden]
    layers.L.input_layernorm.weight          [hidden]
    layers.L.self_attn.qkv_proj.weight       [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    layers.L.self_attn.qkv_proj.bias         (only when ``attention_bias``)
    layers.L.self_attn.q_norm.weight         [head_dim]   (only when ``qk_norm``)
    layers.L.self_attn.k_norm.weight         [head_dim]   (only when ``qk_norm``)
    layers.L.self_attn.o_proj.weight         [hidden, num_heads * head_dim]
    layers.L.post_attention_layernorm.weight [hidden]     (Llama: the pre-MLP norm; Gemma-3: after attention)
    layers.L.pre_feedforward_layernorm.weight, layers.L.post_feedforward_layernorm.weight  (Gemma-3 only)
    layers.L.mlp.gate_up_proj.weight         [2 * intermediate, hidden]  (gate rows first, then up)
    layers.L.mlp.down_proj.weight            [hidden, intermediate]
    norm.weight                              [hidden]
    lm_head.weight                           [vocab, hidden]  (absent when ``tie_word_embeddings``,
                                             unless an fp8 engine quantizes the LM head: then an fp8 copy)
    <linear>.weight_scale                    [out_features] float32, beside every fp8 ``<linear>.weight``
                                             (fp8 engines: EngineConfig.fp8_linears())
    rope.<layer_type>.inv_freq               [head_dim // 2] float32, from transformers' RoPE init
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infhip.knobs import (  # noqa: F401 - the knobs are part of the engine format: re-exported
    ATTENTION_ROPE_STYLES, CHUNK_SCORES, PRUNING_ROPE_STYLES, REMOVED_INFINITEHIP_KNOBS, RUNTIME_KNOBS,
    InfiniteHipConfig, PruningStage, check_runtime_knobs, require)
from infhip.token_drop_knobs import TokenDropConfig, resolve_drop_layers  # noqa: F401 - re-exported

FORMAT_VERSION = 1
# config.json's "format": what tells an engine from other folders with a config.json (a Hugging
# Face checkpoint), e.g. before `infhip-build --force` replaces one. Engines written before the
# marker are told by their format_version and sections (is_engine_dir).
ENGINE_FORMAT = "infhip-engine"

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("bfloat16", "float16", "float32")
# KV cache dtypes: the weights' dtype, or fp8 (float8_e4m3fn rows with a float32 scale per token
# and kv head, plugins/kv_quant.py; half the bytes of bf16)
KV_DTYPES = DTYPES + ("fp8",)
# Linear-layer weight formats (``infhip-build --weight-dtype``): "bf16" keeps them in the build
# dtype (``--dtype``; unquantized, named for the common case), "fp8" stores the qkv/o/gate_up/down
# (and with ``quantize_lm_head`` the LM head) weights as float8_e4m3fn with one float32 scale per
# output channel (plugins/fp8_linear.py); embeddings and norms stay in the build dtype / float32.
WEIGHT_DTYPES = ("bf16", "fp8")
ACTIVATIONS = ("silu", "gelu_tanh")


class EngineFormatError(ValueError):
    """An engine directory that this runtime cannot load (wrong version, target, or damaged)."""


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


ATTENTION_PLUGINS = ("dense", "infinitehip")


@dataclass(frozen=True)
class LayerPlan:
    """What runs at one decoder layer. Later plugins (token drop) add fields here."""

    index: int
    attention: str  # "global" | "sliding"
    window: int | None  # sliding window, None for global
    plugin: str  # attention plugin, one of ATTENTION_PLUGINS ("infinitehip": global layers only)
    rope_group: str  # key into ModelConfig.rope

    def __post_init__(self) -> None:
        require(self.plugin in ATTENTION_PLUGINS, f"plugin {self.plugin!r} not in {ATTENTION_PLUGINS}")
        require(self.plugin != "infinitehip" or self.window is None,
               f"layer {self.index}: infinitehip runs on full-attention layers only")


@dataclass(frozen=True)
class Plan:
    preset: str
    layers: tuple[LayerPlan, ...]
    # Knobs of the "infinitehip" layers; None when no layer uses it (dense engines).
    infinitehip: InfiniteHipConfig | None = None
    # UniPrefill token dropping in prefill; None (or absent from config.json) = off.
    token_drop: TokenDropConfig | None = None

    def __post_init__(self) -> None:
        uses = any(layer.plugin == "infinitehip" for layer in self.layers)
        require(uses == (self.infinitehip is not None),
               "a plan has infinitehip knobs exactly when some layer uses the infinitehip plugin")
        if self.token_drop is not None:  # an explicit drop_layers list names full-attention layers only
            resolve_drop_layers(self.token_drop, [lp.index for lp in self.layers if lp.window is None],
                                len(self.layers))

    @classmethod
    def dense(cls, model: ModelConfig) -> "Plan":
        layers = tuple(
            LayerPlan(index=i, attention="sliding" if t == "sliding_attention" else "global",
                      window=model.window_of(i), plugin="dense", rope_group=t)
            for i, t in enumerate(model.layer_types))
        return cls(preset="dense", layers=layers)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        ih = d.get("infinitehip")  # absent in engines written before InfiniteHiP: dense
        td = d.get("token_drop")  # absent in engines written before token drop: off
        return cls(preset=d["preset"], layers=tuple(LayerPlan(**x) for x in d["layers"]),
                   infinitehip=InfiniteHipConfig.from_dict(ih) if ih is not None else None,
                   token_drop=TokenDropConfig.from_dict(td) if td is not None else None)


def apply_runtime_overrides(plan: Plan, overrides: dict[str, Any] | None) -> Plan:
    """``plan`` with InfiniteHiP knobs that a load may change changed (RUNTIME_KNOBS;
    ``LLM(..., infinitehip_overrides=...)``), validated."""
    if not overrides:
        return plan
    if plan.infinitehip is None:
        raise ValueError("infinitehip_overrides given, but this engine has no InfiniteHiP layers "
                         f"(preset {plan.preset!r}); rebuild with --preset 3k (or another)")
    check_runtime_knobs(overrides)
    return dataclasses.replace(plan, infinitehip=plan.infinitehip.replace(**overrides))


@dataclass(frozen=True)
class BuildConfig:
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    max_seq_len: int = 8192
    max_batch_size: int = 16
    page_size: int = 16  # tokens per KV page
    max_num_batched_tokens: int = 8192  # token budget of one scheduler step (chunked prefill)
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    target: str = "cpu"  # "cpu" or "sm_<major><minor>"
    created_at: str = ""
    random_weights: bool = False
    weight_dtype: str = "bf16"  # WEIGHT_DTYPES; absent from engines built before fp8 weights: "bf16"
    quantize_lm_head: bool = False  # fp8 engines: the LM head in fp8 too
    tp: int = 1  # tensor-parallel ranks (rank{r}.safetensors each; infhip/tensor_parallel.py); absent: 1

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, f"dtype {self.dtype!r} not in {DTYPES}")
        require(self.kv_dtype in KV_DTYPES, f"kv_dtype {self.kv_dtype!r} not in {KV_DTYPES}")
        # the kernels dequantize an fp8 cache to the queries' dtype; any other KV dtype must be
        # the weights' own (the dots run in the queries' dtype)
        require(self.kv_dtype in (self.dtype, "fp8"), f"kv_dtype {self.kv_dtype!r} differs from dtype {self.dtype!r}; "
               "the KV cache is kept in the weights' dtype or in fp8: omit --kv-dtype or pass --kv-dtype fp8")
        require(self.max_seq_len > 0, f"max_seq_len must be positive, got {self.max_seq_len}")
        require(self.max_batch_size > 0, f"max_batch_size must be positive, got {self.max_batch_size}")
        require(self.page_size > 0 and self.page_size & (self.page_size - 1) == 0,
               f"page_size must be a power of two, got {self.page_size}")
        require(self.max_num_batched_tokens >= self.max_batch_size,
               "max_num_batched_tokens must be at least max_batch_size")
        require(self.target == "cpu" or self.target.startswith("sm_"),
               f"target must be 'cpu' or 'sm_XY', got {self.target!r}")
        require(self.weight_dtype in WEIGHT_DTYPES,
               f"weight_dtype {self.weight_dtype!r} not in {WEIGHT_DTYPES}")
        require(isinstance(self.quantize_lm_head, bool), f"quantize_lm_head must be true or false, "
               f"got {self.quantize_lm_head!r}")
        require(isinstance(self.tp, int) and self.tp >= 1, f"tp must be a positive integer, got {self.tp!r}")
        require(not self.quantize_lm_head or self.weight_dtype == "fp8",
               "quantize_lm_head needs weight_dtype fp8 (--quantize-lm-head goes with --weight-dtype fp8)")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BuildConfig":
        d = dict(d)
        d["cuda_graph_batch_sizes"] = tuple(d.get("cuda_graph_batch_sizes", ()))
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    plan: Plan
    build: BuildConfig
    format_version: int = FORMAT_VERSION
    infhip_version: str = ""

    def fp8_linears(self) -> tuple[str, ...]:
        """Module paths of the linear layers stored in fp8 (their ``.weight`` float8_e4m3fn, a
        float32 ``.weight_scale`` beside it); () for a bf16 engine. The one list the builder
        quantizes and the runtime swaps modules by (runtime/models/common.py)."""
        if self.build.weight_dtype != "fp8":
            return ()
        names = tuple(f"layers.{i}.{m}" for i in range(self.model.num_layers) for m in
                      ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
        return names + (("lm_head",) if self.build.quantize_lm_head else ())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": ENGINE_FORMAT,
            "format_version": self.format_version,
            "infhip_version": self.infhip_version,
            "model": dataclasses.asdict(self.model),
            "plan": dataclasses.asdict(self.plan),
            "preset": {"name": self.plan.preset},  # the knobs live in plan.infinitehip
            "build": dataclasses.asdict(self.build),
            **self._tp_record(),
        }

    def _tp_record(self) -> dict[str, Any]:
        """The shard layout of a tensor-parallel engine, for the record (derived from model and
        build.tp, infhip/tensor_parallel.py; the loader recomputes it)."""
        if self.build.tp == 1:
            return {}
        from infhip.tensor_parallel import layout_record
        return {"tensor_parallel": layout_record(self.model, self.build.tp)}

    def save(self, engine_dir: str | Path) -> None:
        Path(engine_dir, "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, engine_dir: str | Path) -> "EngineConfig":
        """Read and validate ``<engine_dir>/config.json``; every failure names the fix."""
        path = Path(engine_dir) / "config.json"
        if not path.is_file():
            raise EngineFormatError(
                f"{engine_dir} is not an infhip engine (no config.json). "
                "Build one with: infhip-build --model NAME --output DIR")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise EngineFormatError(f"{path} is not valid JSON ({e}); rebuild the engine") from e
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise EngineFormatError(
                f"engine {engine_dir} has format version {version}, this infhip reads version "
                f"{FORMAT_VERSION}; rebuild it with this infhip's infhip-build")
        try:
            config = cls(model=ModelConfig.from_dict(d["model"]), plan=Plan.from_dict(d["plan"]),
                         build=BuildConfig.from_dict(d["build"]), format_version=version,
                         infhip_version=d.get("infhip_version", ""))
            config._check_tp(d.get("tensor_parallel"))
            return config
        except (KeyError, TypeError, ValueError) as e:
            raise EngineFormatError(f"{path} is damaged or incomplete ({e}); rebuild the engine") from e

    def _check_tp(self, recorded: dict | None) -> None:
        """The tensor-parallel size splits the model, and the recorded layout is the one it implies."""
        from infhip.tensor_parallel import tp_problem

        problem = tp_problem(self.model, self.build.tp)
        require(problem is None, problem or "")
        implied = json.loads(json.dumps(self._tp_record().get("tensor_parallel", {})))  # tuples as lists
        require((recorded or {}) == implied,
               "its tensor_parallel layout differs from the one build.tp implies")


def is_engine_dir(path: str | Path) -> bool:
    """Does ``path`` hold an infhip engine, of any format version? Its config.json says
    ``"format": "infhip-engine"`` or, written before that marker, has an int format_version and
    the model, plan and build sections."""
    try:
        d = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError):  # no config.json, unreadable, not JSON (or not UTF-8)
        return False
    if not isinstance(d, dict):
        return False
    if "format" in d:
        return d["format"] == ENGINE_FORMAT
    return isinstance(d.get("format_version"), int) and all(
        isinstance(d.get(k), dict) for k in ("model", "plan", "build"))
