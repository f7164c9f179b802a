"""Execution presets (SPEC §4, §6): one name for the whole per-layer plan of an engine.

``dense`` runs every layer densely (the default); every other preset is declared by a registered
backend method (infhip/methods/: InfiniteHiP's 3k, 3k-fast, 3k-flash, 5k), which runs the layers
it claims (full-attention layers; sliding-window layers stay dense: their window already bounds
the work) with its knobs for that preset, ``overrides`` laid over them (tests use tiny ones). The
knobs are stored in ``config.json`` under ``plan.knobs[<method>]``; a load may change those marked
``runtime`` (docs/knobs.md).

    >>> "3k-flash" in preset_names()
    True
"""

from __future__ import annotations

import dataclasses
from typing import Any

from infhip.config import ModelConfig, Plan
from infhip.methods import BACKEND, method, presets


def preset_names() -> tuple[str, ...]:
    """``dense`` and every registered backend's presets, in registration order."""
    return tuple(presets())


def make_plan(model: ModelConfig, preset: str = "dense", overrides: dict[str, Any] | None = None) -> Plan:
    """The engine plan of ``preset``: the layers its backend claims run it, the rest dense."""
    table = presets()
    if preset not in table:
        raise ValueError(f"unknown preset {preset!r}; available: {', '.join(table)}")
    dense, backend = Plan.dense(model), table[preset]
    if backend is None:
        if overrides:
            raise ValueError("the dense preset takes no knob overrides")
        return dense
    knobs = backend.preset_knobs(preset, model, overrides)
    layers = tuple(dataclasses.replace(layer, backend=backend.name) if backend.claims(layer, knobs) else layer
                   for layer in dense.layers)
    if all(layer.backend != backend.name for layer in layers):
        raise ValueError(f"preset {preset!r} needs layers that {backend.name} runs (full-attention layers); "
                         "this model has none")
    return Plan(preset=preset, layers=layers, knobs={backend.name: knobs})


def plan_of(model: ModelConfig, preset: str = "dense", knobs: dict[str, Any] | None = None) -> Plan:
    """The plan of a build: ``preset``, and ``knobs`` by method name: the preset's backend's knob
    changes (a dict, or a ``KEY=VALUE,...`` string), a transform's build value (Method.build_knobs:
    True / a spec string / a dict / its knobs; None or False: off)."""
    overrides: dict[str, Any] = {}
    transforms = {}
    for name, value in (knobs or {}).items():
        m = method(name)
        if m.kind == BACKEND:
            if presets().get(preset) is not m:
                raise ValueError(f"{m.keyword()} given, but preset {preset!r} does not run {m.name}; "
                                 f"its presets: {', '.join(m.presets)}")
            overrides = m.parse(value) if isinstance(value, str) else dict(value or {})
        else:
            transforms[name] = m.build_knobs(value)
    plan = make_plan(model, preset, overrides)
    for name, value in transforms.items():
        plan = plan.with_knobs(name, value)
    return plan


__all__ = ["make_plan", "plan_of", "preset_names"]
