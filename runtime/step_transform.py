"""Step transforms: features that reshape a step around the attention backends instead of being
one (UniPrefill token drop, infhip/methods/token_drop/runtime/transform.py, is the built-in one), and their
registry, which mirrors the attention backends' (runtime/attention/backend.py).

A transform may (a) route rows through the layer loop (drop some after a layer's attention, bring
them back later), (b) run the attention of the layers it handles in a step, and (c) leave some
full-attention layers holding fewer keys of a sequence than its positions (per-layer KV,
forward_context.LayerKV), which later steps, eager or in a CUDA graph, must honour. Its state
travels by name, as the backends' does: host meta in ``StepPlan.transforms``, the step object in
``ForwardContext.transforms``. The runner, DecodeGraphs and the engine core loop over the
registered transforms and name none.

Life of a transform:

* at load, every registered one is attached (``attach(config)``: even one that is off may have to
  honour what steps under earlier knobs left, as token drop's drop histories), then
  ``configure(knobs_of(config), env)``; ``ModelRunner.set_transform(name, knobs)`` configures it
  again later (benchmarks, tests), on every tensor-parallel rank;
* per step: ``plan`` (host; None: the step is untouched) -> ``upload`` (a ``TransformStep``, read by
  the layer loop and each layer's context view) -> ``after_step`` (what an eager step leaves);
* CUDA graphs: ``shifts_kv``, ``kv_shift(host)``, ``graph_step(layer_kv)``;
* its engine-format side is the plan method of the same ``name`` (infhip/methods/: knobs, build
  and load flags, the plugin modules whose kernels the builder compiles ahead of time);
* the engine core: ``keeps_prompt(seq)`` (prefix caching and prompt logprobs; ``prompt_hint`` in
  the error of a request it refuses); ``release(seq)`` when a sequence's KV is freed (finished
  or preempted): a transform keeps its per-sequence state itself, by seq_id, and drops it then
  (token drop's drop histories), never on the Sequence;
* serving: ``request_counters()``, counters of finished requests for /metrics;
* read-outs: ``debug_view()``, a JSON-able dict of its state now (token drop: knobs, drop layers,
  tail, retention per request), which ``EngineCore.debug_view()`` gathers under "transforms" by
  name: what tests and debugging read instead of the transform's attributes.

Registration: ``register(cls)`` (a decorator) under ``cls.name``; the registry imports the
built-in transforms' modules (their methods' ``runtime_module``) on first use; registration order is the order in which the
runner attaches them and the layer loop calls their steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from infhip.methods import TRANSFORM, runtime_modules
from infhip.registry import Registry



def _builtin() -> tuple[str, ...]:
    """The modules of the built-in transforms, each of which registers its transform on import: the
    ``runtime_module`` of each built-in transform method (infhip/methods/<name>/)."""
    return runtime_modules(TRANSFORM)


class TransformStep:
    """A transform's object of one forward pass. The decoder layers (runtime/models/common.py
    DecoderLayer.forward) call, when ``routes``: ``enter_layer(i, ...)`` before layer i and
    ``after_attention(i, ...)`` between its ``attend`` and ``feed_forward`` halves; the layer loop
    (CausalLM.forward) calls ``reconstitute`` at the end. Every layer reads its context through
    ``layer_view`` and its attention backend through ``backend_for``. The defaults change nothing."""

    routes = False  # whether the layers call the stream methods

    def enter_layer(self, i: int, hidden: torch.Tensor, residual: torch.Tensor | None):
        return hidden, residual

    def after_attention(self, i: int, hidden: torch.Tensor, residual: torch.Tensor):
        return hidden, residual

    def reconstitute(self, hidden: torch.Tensor, residual: torch.Tensor | None):
        return hidden, residual

    def layer_view(self, ctx, layer: int, group: str):
        """The forward context as layer ``layer`` (KV group ``group``) sees it."""
        return ctx

    def backend_for(self, layer: int):
        """The attention backend that runs ``layer`` this step, None: the layer's own."""
        return None

    def key_shift(self, layer: int) -> torch.Tensor | None:
        """int32 [B]: keys that layer ``layer``'s cache lacks of each sequence (a transform
        compacted its KV: the key ranges end that much earlier); None: it holds them all."""
        return None

    # -- rows for layers that keep per-sequence state (runtime/models/qwen3_next.py's linear layers)
    def flowing_rows(self) -> tuple[torch.Tensor, list[int]] | None:
        """(cu [B + 1] int32 on the device, its host copy) of the rows flowing through the layers
        now when the transform narrowed them (after a token drop: each sequence's kept rows, in
        order; decode rows stay the first ones); None: the step's own rows."""
        return None

    def attended_rows(self) -> torch.Tensor | None:
        """int64 [M]: the rows of the current ones that this layer's attention returns when the
        transform narrows them at its attention (token drop before attention), so a gate computed
        on every row narrows alike; None: every row."""
        return None


@dataclass(frozen=True)
class TransformEnv:
    """What ``configure`` gets besides the knobs: the engine's EngineConfig, the runner's
    attached attention backends by name, and whether KV pages are offloaded to the host."""

    config: Any
    backends: dict
    offloading: bool = False


class StepTransform:
    """A transform attached to the runner for the engine's life (runtime/model_runner.py)."""

    name: ClassVar[str]
    # what it does to a prompt and how a user keeps prompts whole (the error of a request that
    # needs every prompt position, e.g. prompt_logprobs, when keeps_prompt says no)
    prompt_hint: ClassVar[str] = "turn it off"

    # -- load and knobs --------------------------------------------------------------------------
    @classmethod
    def knobs_of(cls, config):
        """Its knobs in an engine's config (its method's, in the plan), None: off."""
        return config.plan.knobs_of(cls.name)

    @classmethod
    def attach(cls, config) -> "StepTransform":
        """The instance of one runner of an engine with EngineConfig ``config``, off until
        ``configure``."""
        raise NotImplementedError

    def configure(self, knobs, env: TransformEnv) -> None:
        """Knobs ``knobs`` (None: off) from the next step on; raises ValueError, changing
        nothing, when they cannot apply to this runner (``env``)."""

    def keeps_prompt(self, seq) -> bool:
        """Whether the transform computes every prompt position of Sequence ``seq`` as a plan
        without it would (its pages may be named for prefix caching; prompt logprobs exist)."""
        return True

    def release(self, seq) -> None:
        """Sequence ``seq``'s KV pages were freed: it finished (``seq.is_finished``) or was
        preempted (its tokens are recomputed from 0 later). What the transform keeps of it that
        describes that KV goes now."""

    def debug_view(self) -> dict:
        """Its state now, JSON-able (tests, debugging; read between steps): a copy, never live
        state. The default: nothing to show."""
        return {}

    def request_counters(self) -> list:
        """Prometheus counters of finished requests it adds to /metrics when the engine loads with
        it on (runtime/attention/backend.py RequestCounter; read when a request ends, before the
        transform forgets it). The default: none."""
        return []

    # -- one step --------------------------------------------------------------------------------
    def plan(self, p, chunks) -> Any | None:
        """Host meta of StepPlan ``p`` (chunks: the scheduler's, batch order); None: untouched."""
        raise NotImplementedError

    def runs_dense(self, host) -> bool:
        """Whether the step's rows bypass the attention backends' plans (they are told: skip)."""
        return False

    def upload(self, host, p, ctx) -> TransformStep:
        """The step object of ``host`` (ctx: the step's common forward context, on the device)."""
        raise NotImplementedError

    def after_step(self, seqs: list, step: TransformStep) -> None:
        """After an eager forward: what the step leaves on its sequences (seqs, batch order)."""

    # -- per-layer KV in CUDA graphs (runtime/cuda_graphs.py) ------------------------------------
    @property
    def shifts_kv(self) -> bool:
        """Whether decode steps may carry per-layer KV shifts (their graphs are captured). Turning
        it on also turns prefix caching off (ModelRunner.set_transform): running requests may
        hold shared pages whose keys it would compact."""
        return False

    def kv_shift(self, host) -> list[list[int]] | None:
        """[full-attention layer][b] keys that layer lacks of sequence b, None: it holds them all."""
        return None

    def graph_step(self, layer_kv) -> TransformStep:
        """The step object a decode graph with per-layer KV (``layer_kv``: static views) reads."""
        raise NotImplementedError


_REGISTRY = Registry("a step transform", _builtin)
register = _REGISTRY.register  # a decorator: the class under its ``name``; the built-in ones come first
unregister = _REGISTRY.unregister  # (tests)


def transforms() -> list[type[StepTransform]]:
    """The registered classes, in registration order (the built-in ones first)."""
    return _REGISTRY.classes()
