"""Hugging Face ``config.json`` dict -> :class:`infhip.config.ModelConfig` + RoPE inverse frequencies.

transformers itself normalises the many config styles found on the Hub (``rope_theta`` /
``rope_scaling`` / ``rope_local_base_freq`` / ``sliding_window_pattern`` of older releases, and
``rope_parameters`` / ``layer_types`` of newer ones): we instantiate its config class and read the
normalised attributes, so old and new files give the same ModelConfig. RoPE of any static flavour
(default, linear, llama3, yarn, ...) is reduced here to one ``inv_freq`` vector [head_dim // 2]
plus a cos/sin ``attention_scaling`` per layer type, computed by transformers' own init functions.

    >>> import json, importlib.resources as r
    >>> d = json.loads(r.files("infhip.builder.model_configs").joinpath("gemma-3-4b.json").read_text())
    >>> model, inv_freq = model_config_from_hf(d)
    >>> model.layer_types[:6], inv_freq["full_attention"].shape
    (('sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention', 'sliding_attention', 'full_attention'), torch.Size([128]))
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from infhip.config import LAYER_TYPES, ModelConfig, RopeSpec
from infhip.model_config import ATTENTION_LAYER_TYPES, LinearAttentionSpec, MoeSpec
from infhip.errors import BuildError

# HF model_type -> our architecture. gemma3 is the multimodal wrapper: we take its text_config.
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "qwen3_next": "qwen3_next",
}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# RoPE types whose frequencies change with the running sequence length: not reducible to one vector.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def _quiet_transformers():
    """transformers logs harmless notes while normalising old configs; keep the CLI output clean."""
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    return lambda: hf_logging.set_verbosity(level)


def hf_config_object(d: dict[str, Any], where: str = "config.json"):
    """The text-decoder transformers config object of a config dict (multimodal Gemma-3 unwrapped)."""
    from transformers import AutoConfig

    model_type = d.get("model_type")
    if model_type is None:
        raise BuildError(f"{where} has no 'model_type'; is this a Hugging Face causal-LM config?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise BuildError(
            f"{where}: model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    kwargs = {k: v for k, v in d.items() if k != "model_type"}
    restore = _quiet_transformers()
    try:
        cfg = AutoConfig.for_model(model_type, **kwargs)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise BuildError(f"{where}: invalid {model_type} config ({e})") from e
    finally:
        restore()
    if model_type == "gemma3":
        text = cfg.get_text_config()
        # The multimodal wrapper carries the generation ids at the top level.
        for key in ("bos_token_id", "eos_token_id"):
            if d.get(key) is not None:
                setattr(text, key, d[key])
        cfg = text
    return cfg


def _layer_types(cfg, arch: str, num_layers: int) -> tuple[str, ...]:
    if arch == "mistral":
        # MistralModel ignores layer_types: one window for every layer, or none (v0.2+: null).
        kind = "sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"
        return (kind,) * num_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Llama: no sliding layers
        return ("full_attention",) * num_layers
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise BuildError(f"layer types {bad} are not supported; supported: {', '.join(LAYER_TYPES)}")
    return tuple(types)


def _inv_freq_default(theta: float, head_dim: int) -> torch.Tensor:
    # Same expression as transformers' compute_default_rope_parameters (int64 arange, then float32).
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponent)


def _rope(cfg, layer_types: tuple[str, ...], head_dim: int) -> tuple[dict[str, RopeSpec], dict[str, torch.Tensor]]:
    """RopeSpec and inv_freq [head_dim // 2] (float32) per layer type in use."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    # Per-layer-type dicts (Gemma-3) are keyed by layer type; otherwise one dict serves every layer.
    per_type = bool(set(rp) & set(LAYER_TYPES)) and all(isinstance(v, dict) for v in rp.values())
    specs, inv_freqs = {}, {}
    for lt in sorted(set(layer_types) & set(ATTENTION_LAYER_TYPES)):
        params = dict(rp.get(lt) or {}) if per_type else rp
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
        if theta is None:
            raise BuildError(f"no rope_theta for {lt} layers in the config")
        rotary = _rotary_dim(cfg, params, head_dim)
        if rope_type == "default":
            inv_freq, scaling = _inv_freq_default(float(theta), rotary), 1.0
        elif rope_type in DYNAMIC_ROPE_TYPES or rope_type not in ROPE_INIT_FUNCTIONS:
            supported = ["default"] + [t for t in ROPE_INIT_FUNCTIONS if t not in DYNAMIC_ROPE_TYPES]
            raise BuildError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(supported)}")
        else:
            restore = _quiet_transformers()
            try:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", layer_type=lt if per_type else None)
            finally:
                restore()
        inv_freq = inv_freq.to(torch.float32).contiguous()
        if rotary != head_dim:
            # Partial RoPE (Qwen3-Next): the builder lays each head out so that the runtime's
            # rotate-half over the whole head pairs the rotary dims as HF does, and the rest with
            # frequency 0 (cos 1, sin 0: unchanged; builder/qwen3_next.py, rotary_order)
            if tuple(inv_freq.shape) != (rotary // 2,) or float(scaling) != 1.0:
                raise BuildError(f"partial RoPE with rope_type {rope_type!r} (attention scaling {scaling}) "
                                 "is not supported; supported: a cos/sin scaling of 1")
            inv_freq = torch.cat([inv_freq, inv_freq.new_zeros(head_dim // 2 - rotary // 2)])
        if tuple(inv_freq.shape) != (head_dim // 2,):
            raise BuildError(f"RoPE {rope_type} gave inv_freq of shape {tuple(inv_freq.shape)}, expected ({head_dim // 2},)")
        record = json.loads(json.dumps(params, default=str))  # JSON-safe copy for config.json
        specs[lt] = RopeSpec(rope_type=rope_type, rope_theta=float(theta),
                             attention_scaling=float(scaling), params=record)
        inv_freqs[lt] = inv_freq
    return specs, inv_freqs


def _rotary_dim(cfg, params: dict, head_dim: int) -> int:
    """Dims of a head that RoPE rotates: head_dim, or head_dim * partial_rotary_factor where the
    family has it (Qwen3-Next); elsewhere a partial factor is refused."""
    factor = float(params.get("partial_rotary_factor", 1.0) or 1.0)
    if factor == 1.0:
        return head_dim
    if cfg.model_type != "qwen3_next":
        raise BuildError("partial_rotary_factor != 1 (partial RoPE) is supported for qwen3_next only")
    rotary = int(head_dim * factor)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise BuildError(f"partial_rotary_factor {factor} gives {rotary} rotary dims of {head_dim}: need an even count")
    return rotary


def _hybrid(cfg, num_layers: int) -> dict[str, Any]:
    """Qwen3-Next's extra ModelConfig fields: partial RoPE, the attention output gate, the linear
    (gated DeltaNet) layers' shapes, the sparse MoE and its layers (as Qwen3NextDecoderLayer
    picks them: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)."""
    if cfg.model_type != "qwen3_next":
        return {}
    rp = dict(getattr(cfg, "rope_parameters", None) or {})
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    rotary = _rotary_dim(cfg, rp, head_dim)
    linear = LinearAttentionSpec(
        num_key_heads=int(cfg.linear_num_key_heads), num_value_heads=int(cfg.linear_num_value_heads),
        key_head_dim=int(cfg.linear_key_head_dim), value_head_dim=int(cfg.linear_value_head_dim),
        conv_kernel=int(cfg.linear_conv_kernel_dim))
    step, only = int(cfg.decoder_sparse_step or 1), set(cfg.mlp_only_layers or ())
    moe_layers = tuple(i for i in range(num_layers) if i not in only and cfg.num_experts > 0 and (i + 1) % step == 0)
    moe = MoeSpec(num_experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
                  intermediate_size=int(cfg.moe_intermediate_size),
                  shared_intermediate_size=int(cfg.shared_expert_intermediate_size),
                  norm_topk_prob=bool(cfg.norm_topk_prob), layers=moe_layers) if moe_layers else None
    return dict(rotary_dim=rotary if rotary != head_dim else None, attn_output_gate=True,
                linear_attention=linear if "linear_attention" in cfg.layer_types else None, moe=moe)


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(x) for x in value)


ROPE_SCALING_TYPES = ("linear", "yarn")


def with_rope_scaling(d: dict[str, Any], spec: str, where: str = "config.json") -> tuple[dict[str, Any], str]:
    """A copy of HF config ``d`` with ``--rope-scaling TYPE:FACTOR`` applied, as a model card's
    long-context recipe edits config.json (Qwen2.5: ``{"type": "yarn", "factor": 4.0,
    "original_max_position_embeddings": 32768}``); and the build-report note. The trained window
    becomes ``factor`` times the checkpoint's, so the engine treats the scaled length as inside
    its window (dense + YaRN is the baseline past the window). BuildError on a bad spec, a
    checkpoint that already scales RoPE, or Gemma-3 (RoPE per layer type)."""
    kind, _, factor_s = spec.partition(":")
    kind = kind.strip().lower()
    try:
        factor = float(factor_s)
    except ValueError:
        factor = float("nan")
    if kind not in ROPE_SCALING_TYPES or not factor > 1.0:
        raise BuildError(f"--rope-scaling takes TYPE:FACTOR with TYPE one of {', '.join(ROPE_SCALING_TYPES)} "
                         f"and FACTOR > 1 (e.g. yarn:4), got {spec!r}")
    if str(d.get("model_type", "")).startswith("gemma3"):
        raise BuildError(f"{where}: --rope-scaling is not supported for Gemma-3 (its RoPE differs per layer "
                         "type); set rope_scaling for its global layers in config.json instead")
    have = d.get("rope_scaling") or {k: v for k, v in (d.get("rope_parameters") or {}).items()
                                     if k in ("rope_type", "type") and v != "default"}
    if have:
        raise BuildError(f"{where}: the checkpoint already scales RoPE ({have}); --rope-scaling would replace "
                         "its recipe: edit config.json instead")
    original = int(d.get("max_position_embeddings") or 0)
    if original <= 0:
        raise BuildError(f"{where}: --rope-scaling needs max_position_embeddings in the config")
    recipe = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        recipe["original_max_position_embeddings"] = original
    out = dict(d)
    if isinstance(d.get("rope_parameters"), dict):  # a transformers-5 config: rope_theta lives there
        out["rope_parameters"] = {**d["rope_parameters"], **recipe}
    else:
        out["rope_scaling"] = recipe
    out["max_position_embeddings"] = int(round(original * factor))
    return out, (f"RoPE scaled by --rope-scaling {kind}:{factor:g}: trained window {original} -> "
                 f"{out['max_position_embeddings']} tokens")


def model_config_from_hf(d: dict[str, Any], where: str = "config.json") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Normalised ModelConfig and ``{layer_type: inv_freq [head_dim // 2] float32}`` of a HF config dict."""
    cfg = hf_config_object(d, where)
    arch = SUPPORTED_MODEL_TYPES[d["model_type"]]
    gemma = arch == "gemma3"

    act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act_name not in ACTIVATIONS:
        raise BuildError(f"{where}: activation {act_name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    if getattr(cfg, "mlp_bias", False):
        raise BuildError(f"{where}: mlp_bias=true is not supported")
    # Qwen2 has q/k/v biases by construction; elsewhere attention_bias also adds an o_proj bias.
    if arch != "qwen2" and getattr(cfg, "attention_bias", False):
        raise BuildError(f"{where}: attention_bias=true (with an o_proj bias) is not supported for {arch}")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise BuildError(f"{where}: attn_logit_softcapping is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise BuildError(f"{where}: use_bidirectional_attention (embedding models) is not supported")

    num_layers = int(cfg.num_hidden_layers)
    num_heads = int(cfg.num_attention_heads)
    num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
    layer_types = _layer_types(cfg, arch, num_layers)
    sliding = "sliding_attention" in layer_types
    rope, inv_freqs = _rope(cfg, layer_types, head_dim)
    softcap = getattr(cfg, "final_logit_softcapping", None) if gemma else None
    try:
        model = ModelConfig(
            architecture=arch,
            hf_model_type=cfg.model_type,
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            hidden_act=ACTIVATIONS[act_name],
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3", "qwen3_next"),
            attention_scale=float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else head_dim ** -0.5,
            embedding_multiplier=float(cfg.hidden_size) ** 0.5 if gemma else 1.0,
            max_position_embeddings=int(cfg.max_position_embeddings),
            layer_types=layer_types,
            sliding_window=int(cfg.sliding_window) if sliding else None,
            rope=rope,
            final_logit_softcapping=float(softcap) if softcap is not None else None,
            bos_token_id=cfg.bos_token_id if cfg.bos_token_id is None else int(cfg.bos_token_id),
            eos_token_ids=_eos_ids(cfg.eos_token_id),
            **_hybrid(cfg, num_layers),
        )
    except ValueError as e:
        raise BuildError(f"{where}: {e}") from e
    return model, inv_freqs
