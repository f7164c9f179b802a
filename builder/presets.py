"""Execution presets (SPEC §4, §6): one name for the whole per-layer plan of an engine.

    dense      every layer dense (the default)
    3k         InfiniteHiP on full-attention layers with the knobs' defaults
               (infhip/knobs.py InfiniteHipConfig: stages (64, 256, 32K) -> (64, 32, 8K) ->
               (64, 8, 2048), final k 4096 in layers 1-3 (1-based), refresh every (16, 8, 4)
               steps, prefill query strides (4, 4, 1), past the trained window a rotated key bank
               for the cached decode steps)
    3k-fast    3k with refresh (32, 16, 8)
    3k-flash   3k with refresh (96, 24, 8)
    5k         3k with chunks 64 / 32 / 16, k 32K / 16K / 4096

Sliding-window layers always stay dense (their window already bounds the work). The knobs are
an :class:`~infhip.config.InfiniteHipConfig` stored in ``config.json`` under
``plan.infinitehip``; ``overrides`` changes any of them at build time (tests use tiny ones), and
a load may change those marked ``runtime`` (:data:`~infhip.knobs.RUNTIME_KNOBS`, docs/knobs.md).

    >>> from infhip.builder.presets import infinitehip_config
    >>> infinitehip_config("3k-fast").refresh_intervals
    (32, 16, 8)
    >>> infinitehip_config("5k").stages[-1]
    PruningStage(block_q=64, chunk_size=16, k=4096)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from infhip.config import (  # noqa: F401 - RUNTIME_KNOBS, apply_runtime_overrides: re-exported
    RUNTIME_KNOBS, InfiniteHipConfig, ModelConfig, Plan, apply_runtime_overrides)
from infhip.knob_specs import parse_knobs  # noqa: F401 - re-exported

# Each InfiniteHiP preset as its differences from InfiniteHipConfig() (= 3k). Refresh intervals:
# docs/benchmarks.md (decode amortized over the refresh cycle; 3k-flash, the fastest, keeps
# passkey / NIAH on SmolLM2: docs/quality.md).
PRESET_CHANGES: dict[str, dict[str, Any]] = {
    "3k": {},
    "3k-fast": {"refresh_intervals": (32, 16, 8)},
    "3k-flash": {"refresh_intervals": (96, 24, 8)},
    "5k": {"stages": ((64, 64, 32768), (64, 32, 16384), (64, 16, 4096))},
}

PRESETS = ("dense",) + tuple(PRESET_CHANGES)


def infinitehip_config(preset: str, overrides: dict[str, Any] | None = None,
                       trained_window: int | None = None) -> InfiniteHipConfig:
    """The knobs of an InfiniteHiP preset, with ``overrides`` applied (validated).

    ``dense_threshold`` (unless overridden) is n_sink + n_stream + stage-1 k of the result: below
    that context stage 1 keeps every candidate, so pruning only narrows the later stages and
    dense attention over that few keys (≤ 34K) is both exact and fast enough — but never above
    ``trained_window`` + 1 (a request goes sparse once its context reaches the threshold): a
    context that fills the trained window exactly stays dense, and the first token past it goes
    sparse, where dense attention would see positions the model was not trained on and fail
    (SmolLM2's 8K); that is what InfiniteHiP's dynamic RoPE is for."""
    if preset not in PRESET_CHANGES:
        raise ValueError(f"{preset!r} is not an InfiniteHiP preset; those are: {', '.join(PRESET_CHANGES)}")
    overrides = dict(overrides or {})
    cfg = InfiniteHipConfig().replace(**{**PRESET_CHANGES[preset], **overrides})
    if "dense_threshold" in overrides:
        return cfg
    cap = trained_window + 1 if trained_window else 1 << 62  # contexts <= the window stay dense
    return cfg.replace(dense_threshold=min(cap, cfg.n_sink + cfg.n_stream + cfg.stages[0].k))


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


__all__ = ["PRESETS", "PRESET_CHANGES", "RUNTIME_KNOBS", "apply_runtime_overrides", "infinitehip_config",
           "make_plan", "parse_knobs"]
