"""Engine format v2: the typed configuration that the builder writes and the runtime reads.

One place for the contract between `infhip.builder` and `infhip.runtime`, which meet only here
and at the plugins. Everything here is plain data (dataclasses validated in ``__post_init__``)
serialised to ``config.json``; values computed at load time (number of KV pages, CUDA-graph pools)
live in runtime objects instead. The plan names registered methods (attention backends, step
transforms: infhip/methods/), whose knobs it carries by name; this module names none of them.
Version 1 engines (knobs under ``plan.<method>``, a layer's backend under ``plugin``) are read
through :func:`migrate_v1`.

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

from infhip.methods import BACKEND, method, methods, require
from infhip.model_config import (  # noqa: F401 - the model section of the format: re-exported
    ACTIVATIONS, ARCHITECTURES, LAYER_TYPES, ModelConfig, RopeSpec)

FORMAT_VERSION = 2
READS_VERSIONS = (1, 2)  # version 1 is migrated on read (migrate_v1)
# config.json's "format": what tells an engine from other folders with a config.json (a Hugging
# Face checkpoint), e.g. before `infhip-build --force` replaces one. Engines written before the
# marker are told by their format_version and sections (is_engine_dir).
ENGINE_FORMAT = "infhip-engine"

DTYPES = ("bfloat16", "float16", "float32")
# KV cache dtypes: the weights' dtype, or fp8 (float8_e4m3fn rows with a float32 scale per token
# and kv head, plugins/kv_quant.py; half the bytes of bf16)
KV_DTYPES = DTYPES + ("fp8",)
# Linear-layer weight formats (``infhip-build --weight-dtype``): "bf16" keeps them in the build
# dtype (``--dtype``; unquantized, named for the common case), "fp8" stores the qkv/o/gate_up/down
# (and with ``quantize_lm_head`` the LM head) weights as float8_e4m3fn with one float32 scale per
# output channel (plugins/fp8_linear.py); embeddings and norms stay in the build dtype / float32.
WEIGHT_DTYPES = ("bf16", "fp8")


class EngineFormatError(ValueError):
    """An engine directory that this runtime cannot load (wrong version, target, or damaged)."""


DENSE = "dense"  # the backend of every layer that no registered backend runs


@dataclass(frozen=True)
class LayerPlan:
    """What runs at one decoder layer."""

    index: int
    attention: str  # "global" | "sliding" | "linear" (a recurrent-state layer: no KV pages, no backend)
    window: int | None  # sliding window, None for global
    backend: str  # DENSE, or a registered backend method that runs such a layer (Method.runs)
    rope_group: str  # key into ModelConfig.rope

    def __post_init__(self) -> None:
        if self.backend != DENSE:
            m = method(self.backend)
            require(m.kind == BACKEND, f"layer {self.index}: {self.backend!r} is a {m.kind}, not an attention backend")
            require(m.runs(self), f"layer {self.index}: {self.backend} cannot run a "
                    f"{'sliding-window' if self.window else 'full-attention'} layer")


@dataclass(frozen=True)
class Plan:
    """The per-layer plan of an engine and the knobs of every method it uses, by name (a backend's
    knobs exactly when some layer runs it; a transform's when it is on)."""

    preset: str
    layers: tuple[LayerPlan, ...]
    knobs: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name, knobs in self.knobs.items():
            m = method(name)
            require(isinstance(knobs, m.knobs), f"plan knobs of {name} must be a {m.knobs.__name__}, "
                    f"got {type(knobs).__name__}")
        for m in methods(BACKEND):
            uses = any(layer.backend == m.name for layer in self.layers)
            require(uses == (m.name in self.knobs),
                    f"a plan has {m.name} knobs exactly when some layer runs the {m.name} backend")
        for name, knobs in self.knobs.items():
            method(name).check(knobs, self)

    def knobs_of(self, name: str):
        """The knobs of method ``name`` in this plan; None: no layer runs it / it is off."""
        return self.knobs.get(name)

    def with_knobs(self, name: str, knobs) -> "Plan":
        """This plan with method ``name``'s knobs replaced (None: taken out, a transform off)."""
        new = {k: v for k, v in self.knobs.items() if k != name}
        if knobs is not None:
            new[name] = knobs
        return dataclasses.replace(self, knobs=new)

    def at_load(self, overrides: dict[str, Any] | None) -> "Plan":
        """This plan with a load's changes: ``overrides`` maps a method's name to a dict of knobs
        that a load may change (laid over the built ones) or, for a transform, True / False (on as
        built or with the defaults / off); validated, one line per error (Method.at_load)."""
        plan = self
        for name, value in (overrides or {}).items():
            plan = plan.with_knobs(name, method(name).at_load(plan.knobs_of(name), value, plan))
        return plan

    @classmethod
    def dense(cls, model: ModelConfig) -> "Plan":
        kinds = {"sliding_attention": "sliding", "linear_attention": "linear"}
        layers = tuple(
            LayerPlan(index=i, attention=kinds.get(t, "global"), window=model.window_of(i), backend=DENSE, rope_group=t)
            for i, t in enumerate(model.layer_types))
        return cls(preset="dense", layers=layers)

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "layers": [dataclasses.asdict(lp) for lp in self.layers],
                "knobs": {name: dataclasses.asdict(k) for name, k in self.knobs.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        knobs = d.get("knobs", {})
        for name, k in knobs.items():
            require(isinstance(k, dict), f"plan knobs of {name} must be an object of knobs, got {k!r} "
                    "(format 2 leaves an unused method out)")
        return cls(preset=d["preset"], layers=tuple(LayerPlan(**x) for x in d["layers"]),
                   knobs={name: method(name).from_dict(k) for name, k in knobs.items()})


def migrate_v1(d: dict[str, Any]) -> dict[str, Any]:
    """A version-1 config.json as version 2: a layer's ``plugin`` becomes its ``backend``; each
    method's knobs move from ``plan.<name>`` (null: unused / off) to ``plan.knobs[<name>]``."""
    plan = d["plan"]
    layers = [{("backend" if k == "plugin" else k): v for k, v in lp.items()} for lp in plan["layers"]]
    knobs = {k: v for k, v in plan.items() if k not in ("preset", "layers") and v is not None}
    return {**d, "format_version": 2, "plan": {"preset": plan["preset"], "layers": layers, "knobs": knobs}}


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
            "plan": self.plan.to_dict(),
            "preset": {"name": self.plan.preset},  # the knobs live in plan.knobs
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
        if version not in READS_VERSIONS:
            raise EngineFormatError(
                f"engine {engine_dir} has format version {version}, this infhip reads versions "
                f"{', '.join(map(str, READS_VERSIONS))}; rebuild it with this infhip's infhip-build")
        if version == 1:
            d = migrate_v1(d)
        _check_methods_registered(engine_dir, d)
        try:
            config = cls(model=ModelConfig.from_dict(d["model"]), plan=Plan.from_dict(d["plan"]),
                         build=BuildConfig.from_dict(d["build"]), format_version=FORMAT_VERSION,
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


def _check_methods_registered(engine_dir, d: dict[str, Any]) -> None:
    """EngineFormatError naming the plan methods of config.json ``d`` that no module of this
    process has registered (an engine built with an extension, loaded without importing it)."""
    plan = d.get("plan") if isinstance(d.get("plan"), dict) else {}
    named = set(plan.get("knobs") or {}) | {lp.get("backend") for lp in plan.get("layers") or [] if isinstance(lp, dict)}
    known = {m.name for m in methods()} | {DENSE}
    missing = sorted(str(n) for n in named - known if n is not None)
    if missing:
        raise EngineFormatError(
            f"engine {engine_dir} uses plan method(s) {', '.join(missing)}, which this process has not registered "
            f"(registered: {', '.join(sorted(known - {DENSE}))}); import the module that registers them before loading")


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
