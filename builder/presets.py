"""Execution presets (SPEC §4, §6): one name for the whole per-layer plan of an engine.

    dense      every layer dense (the default)
    3k         InfiniteHiP on full-attention layers: stages (64, 256, 32K) -> (64, 32, 8K) ->
               (64, 8, 2048), final k 4096 in layers 1-3 (1-based), refresh every (16, 8, 4) steps,
               prefill query strides (4, 4, 1), past the trained window a rotated key bank for the
               cached decode steps
    3k-fast    3k with refresh (32, 16, 8)
    3k-flash   3k with refresh (96, 24, 8)
    5k         chunks 64 / 32 / 16, k 32K / 16K / 4096, refresh (16, 8, 4)

Sliding-window layers always stay dense (their window already bounds the work). The knobs are
an :class:`~infhip.config.InfiniteHipConfig` stored in ``config.json`` under
``plan.infinitehip``; ``overrides`` changes any of them at build time (tests use tiny ones), and
the runtime may change the safe ones (:data:`RUNTIME_KNOBS`) per ``LLM(...)``.

    >>> from infhip.builder.presets import infinitehip_config
    >>> infinitehip_config("3k-fast").refresh_intervals
    (32, 16, 8)
    >>> infinitehip_config("5k").stages[-1]
    PruningStage(block_q=64, chunk_size=16, k=4096)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from infhip.config import InfiniteHipConfig, ModelConfig, Plan, PruningStage

N_SINK, N_STREAM, BLOCK_Q = 256, 1024, 64
# Prefill scores stages 1-2 with every 4th query of a block (the paper's public code): on
# SmolLM2 it kept the same passkey / NIAH / perplexity as all queries (1, 1, 1; the paper's
# formula, InfiniteHipConfig's default) within one prompt of 81, and costs 1/4 of the work
# (docs/quality.md, docs/benchmarks.md). A runtime knob: query_strides=[1,1,1] restores it.
QUERY_STRIDES = (4, 4, 1)
# Past the trained window a refresh of the last stage rotates its keys once into a per-request
# bank that the cached decode steps read (plugins/infinitehip/key_bank.py): Llama-3.1-8B shapes at
# 1M keys, 3k-flash 27.2 -> 21.0 µs/layer (34.9x -> 45.3x SDPA), 3k 38.9 -> 32.9 µs
# (docs/benchmarks.md). Memory: (min(max_num_seqs, key_bank_slots = 8) + 1) x final k x Hkv x D
# per layer (4 MiB per row and layer for Llama-8B: about 1.2 GiB for 8 + 1 rows), reserved only when max_seq_len
# exceeds the trained window.
KEY_BANK = True

_STAGES_3K = (PruningStage(BLOCK_Q, 256, 32768), PruningStage(BLOCK_Q, 32, 8192), PruningStage(BLOCK_Q, 8, 2048))
_STAGES_5K = (PruningStage(BLOCK_Q, 64, 32768), PruningStage(BLOCK_Q, 32, 16384), PruningStage(BLOCK_Q, 16, 4096))

# preset -> (stages, refresh intervals per stage)
_INFINITEHIP = {
    "3k": (_STAGES_3K, (16, 8, 4)),
    "3k-fast": (_STAGES_3K, (32, 16, 8)),
    "3k-flash": (_STAGES_3K, (96, 24, 8)),
    "5k": (_STAGES_5K, (16, 8, 4)),
}

PRESETS = ("dense",) + tuple(_INFINITEHIP)

# Knobs a runtime may change per engine load without rebuilding (they change speed/accuracy,
# never the meaning of the weights or of the stored plan's shapes).
RUNTIME_KNOBS = ("refresh_intervals", "dense_threshold", "rope_off_in_trained_window", "stagger_refresh",
                 "chunk_score", "query_strides", "key_bank", "key_bank_slots")


def parse_knobs(spec: str) -> dict[str, Any]:
    """'a=1,b=x,c=[32,16,8]' -> {'a': 1, 'b': 'x', 'c': [32, 16, 8]}: InfiniteHiP knobs as given on
    a command line (values as JSON where they parse, else strings; commas inside brackets do not
    split). ValueError names the part that is not KEY=VALUE."""
    out, depth, start, parts = {}, 0, 0, []
    for i, ch in enumerate(spec + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(spec[start:i])
            start = i + 1
    for part in filter(None, (x.strip() for x in parts)):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"InfiniteHiP knobs are KEY=VALUE pairs separated by commas, got {part!r}")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


def infinitehip_config(preset: str, overrides: dict[str, Any] | None = None,
                       trained_window: int | None = None) -> InfiniteHipConfig:
    """The knobs of an InfiniteHiP preset, with ``overrides`` applied (validated).

    ``dense_threshold`` defaults to n_sink + n_stream + stage-1 k: below that context stage 1
    keeps every candidate, so pruning only narrows the later stages and dense attention over
    that few keys (≤ 34K) is both exact and fast enough — but never above ``trained_window`` + 1
    (a request goes sparse once its context reaches the threshold): a context that fills the
    trained window exactly stays dense, and the first token past it goes sparse, where dense
    attention would see positions the model was not trained on and fail (SmolLM2's 8K); that is
    what InfiniteHiP's dynamic RoPE is for."""
    if preset not in _INFINITEHIP:
        raise ValueError(f"{preset!r} is not an InfiniteHiP preset; those are: {', '.join(_INFINITEHIP)}")
    stages, refresh = _INFINITEHIP[preset]
    cap = trained_window + 1 if trained_window else 1 << 62  # contexts <= the window stay dense
    base = InfiniteHipConfig(n_sink=N_SINK, n_stream=N_STREAM, stages=stages, refresh_intervals=refresh,
                             query_strides=QUERY_STRIDES, key_bank=KEY_BANK,
                             special_layers=(0, 1, 2), special_final_k=4096,
                             dense_threshold=min(cap, N_SINK + N_STREAM + stages[0].k))
    overrides = dict(overrides or {})
    if overrides and "dense_threshold" not in overrides and any(
            k in overrides for k in ("n_sink", "n_stream", "stages")):  # keep the rule, not the number
        probe = base.replace(**overrides)
        overrides["dense_threshold"] = min(cap, probe.n_sink + probe.n_stream + probe.stages[0].k)
    return base.replace(**overrides) if overrides else base


def make_plan(model: ModelConfig, preset: str = "dense", overrides: dict[str, Any] | None = None) -> Plan:
    """The engine plan of ``preset``: full-attention layers get "infinitehip", the rest dense."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; available: {', '.join(PRESETS)}")
    dense = Plan.dense(model)
    if preset == "dense":
        if overrides:
            raise ValueError("the dense preset takes no InfiniteHiP overrides")
        return dense
    cfg = infinitehip_config(preset, overrides, trained_window=model.max_position_embeddings)
    past = [i for i in cfg.special_layers if i >= model.num_layers]
    if past:
        raise ValueError(f"special_layers {past} are past the model's {model.num_layers} layers "
                         f"(0-based indices, 0..{model.num_layers - 1})")
    layers = tuple(dataclasses.replace(layer, plugin="infinitehip") if layer.window is None else layer
                   for layer in dense.layers)
    if not any(layer.plugin == "infinitehip" for layer in layers):
        raise ValueError(f"preset {preset!r} needs full-attention layers; this model has none")
    return Plan(preset=preset, layers=layers, infinitehip=cfg)


def apply_runtime_overrides(plan: Plan, overrides: dict[str, Any] | None) -> Plan:
    """``plan`` with safe InfiniteHiP knobs changed (``LLM(..., infinitehip_overrides=...)``)."""
    if not overrides:
        return plan
    if plan.infinitehip is None:
        raise ValueError("infinitehip_overrides given, but this engine has no InfiniteHiP layers "
                         f"(preset {plan.preset!r}); rebuild with --preset 3k (or another)")
    bad = sorted(set(overrides) - set(RUNTIME_KNOBS))
    if bad:
        raise ValueError(f"infinitehip_overrides may change {', '.join(RUNTIME_KNOBS)} only; "
                         f"{', '.join(bad)} needs a rebuild (infhip-build --preset ...)")
    return dataclasses.replace(plan, infinitehip=plan.infinitehip.replace(**overrides))


__all__ = ["PRESETS", "RUNTIME_KNOBS", "apply_runtime_overrides", "infinitehip_config", "make_plan", "parse_knobs"]
