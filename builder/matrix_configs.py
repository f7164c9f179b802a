"""The compile matrix's engine configurations (builder/compile_matrix.py): the model shapes of
builder/model_configs (GQA ratios, head dims 64-256, sliding layers, biases, q/k norms) crossed
with the presets the registered backend methods give the matrix (``Method.matrix_presets``), KV
dtype (bf16, fp8 where the target has e4m3), weight form (bf16, fp8, fp8 LM head), each
registered step-transform method, a context past the trained window (dynamic RoPE, raw keys, the
key bank) and tensor-parallel shards. No method is named here: a registered one joins the matrix.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from infhip.plugins.aot import Target

CONFIGS = Path(__file__).resolve().parent / "model_configs"

# The GPUs the builder's users have, with their SM counts (split-K grids are sized by them):
# A100 (sm_80), RTX 4090 (sm_89), H100 / H200 (sm_90).
TARGETS = {"sm_80": Target("sm_80", 108), "sm_89": Target("sm_89", 128), "sm_90": Target("sm_90", 132)}
MODELS = ("llama-3.1-8b", "gemma-3-12b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "smollm2-135m",
          "qwen2.5-coder-0.5b", "gemma-3-270m", "llama-3.2-1b", "qwen3-next-80b-a3b")
# The targets compiled through TTGIR take the shapes that differ most (head dims 128 / 256 / 64,
# GQA groups 4 / 2 / 3 / 7, sliding layers, biases): enumerating is half their time.
TTGIR_MODELS = ("llama-3.1-8b", "gemma-3-12b", "smollm2-135m", "qwen2.5-coder-0.5b")


def presets() -> tuple[str, ...]:
    """The presets the matrix builds: dense, then each registered backend method's
    ``matrix_presets`` (every preset of it when it names none), in registration order."""
    from infhip.methods import BACKEND, methods

    return ("dense",) + tuple(p for m in methods(BACKEND)
                              for p in (m.presets if m.matrix_presets is None else m.matrix_presets))


def engine_config(model: str, kv_dtype: str = "bfloat16", preset: str = "dense", transforms: list[str] = (),
                  max_batch_size: int = 16, max_seq_len: int = 131072, weight_dtype: str = "bf16",
                  quantize_lm_head: bool = False, target: str = "sm_90", tp: int = 1):
    """The EngineConfig ``infhip-build`` writes for ``model`` (a builder/model_configs name) on a
    GPU target, without a checkpoint; ``transforms``: the step-transform methods turned on (their
    default knobs). With ``tp`` > 1 it is one rank's (the shard's shapes), as the builder
    compiles it."""
    from infhip.builder.build import _graph_batch_sizes
    from infhip.builder.hf_config import model_config_from_hf
    from infhip.builder.presets import plan_of
    from infhip.config import BuildConfig, EngineConfig

    mcfg, _ = model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))
    build = BuildConfig(dtype="bfloat16", kv_dtype=kv_dtype, max_seq_len=min(mcfg.max_position_embeddings, max_seq_len)
                        if preset == "dense" else max_seq_len,
                        max_batch_size=max_batch_size, max_num_batched_tokens=32768,
                        cuda_graph_batch_sizes=_graph_batch_sizes(max_batch_size), target=target,
                        weight_dtype=weight_dtype, quantize_lm_head=quantize_lm_head)
    plan = plan_of(mcfg, preset, {name: True for name in transforms} or None)
    if tp > 1:
        from infhip.tensor_parallel import local_model_config, shard_layout
        mcfg = local_model_config(mcfg, shard_layout(mcfg, tp)[0])
    return EngineConfig(model=mcfg, plan=plan, build=build)


def configurations(target: Target, models: tuple[str, ...] = MODELS) -> dict[str, dict]:
    """name -> engine_config keywords: every preset (:func:`presets`) x KV dtype x weight form on
    each model, each step-transform method on each preset, past-the-window contexts and TP shards
    of 2 and 4 where the heads divide (dense and each backend method's first matrix preset)."""
    from infhip.methods import BACKEND, TRANSFORM, methods
    from infhip.plugins.fp8_linear import FP8_MIN_CAPABILITY

    kv_dtypes = ("bfloat16", "fp8") if target.capability >= FP8_MIN_CAPABILITY else ("bfloat16",)
    tp_presets = [m.presets if m.matrix_presets is None else m.matrix_presets for m in methods(BACKEND)]
    tp_presets = [next(iter(p)) for p in tp_presets if p]
    out: dict[str, dict] = {}
    for model in models:
        for preset in presets():
            for kv in kv_dtypes:
                for weights in ("bf16", "fp8", "fp8-lm-head"):
                    out[f"{model} {preset} kv={kv} w={weights}"] = dict(
                        model=model, preset=preset, kv_dtype=kv, weight_dtype=weights[:4].rstrip("-"),
                        quantize_lm_head=weights == "fp8-lm-head")
                if preset != "dense":  # past the trained window: dynamic RoPE, raw keys, the rotated key bank
                    out[f"{model} {preset} kv={kv} 1M"] = dict(model=model, preset=preset, kv_dtype=kv,
                                                               max_seq_len=1 << 20)
            for m in methods(TRANSFORM):  # its default knobs ("token-drop": --token-drop)
                out[f"{model} {preset} {m.flag()[2:]}"] = dict(model=model, preset=preset, transforms=[m.name])
        for tp in (2, 4):
            if _heads_divide(model, tp):
                out[f"{model} dense tp={tp}"] = dict(model=model, tp=tp)
                for preset in tp_presets:
                    out[f"{model} {preset} kv={kv_dtypes[-1]} tp={tp}"] = dict(model=model, preset=preset,
                                                                               kv_dtype=kv_dtypes[-1], tp=tp)
    return {name: kw for name, kw in out.items() if _buildable(kw)}


@functools.lru_cache(maxsize=None)
def _model_config(model: str):
    from infhip.builder.hf_config import model_config_from_hf
    return model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))[0]


def _buildable(kw: dict) -> bool:
    """Whether infhip-build builds this configuration: a family may refuse some (Qwen3-Next:
    dense, bf16 weights, one rank only; builder/qwen3_next.py)."""
    from infhip.builder.qwen3_next import build_problem

    mcfg = _model_config(kw["model"])
    return build_problem(mcfg, kw.get("preset", "dense"), tuple(kw.get("transforms", ())), kw.get("weight_dtype", "bf16"),
                         kw.get("tp", 1)) is None


def _heads_divide(model: str, tp: int) -> bool:
    """Whether the model splits over tp ranks (the builder's rule: it refuses the others)."""
    from infhip.builder.hf_config import model_config_from_hf
    from infhip.tensor_parallel import tp_problem

    mcfg, _ = model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))
    return tp_problem(mcfg, tp) is None
