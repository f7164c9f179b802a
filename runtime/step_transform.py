"""Step transforms: features that reshape a step around the attention backends instead of being
one (UniPrefill token drop, runtime/token_drop_transform.py, is the one there is).

A transform may (a) route rows through the layer loop (drop some after a layer's attention, bring
them back later), (b) run the attention of the layers it handles in a step, and (c) leave some
full-attention layers holding fewer keys of a sequence than its positions (per-layer KV,
forward_context.LayerKV), which later steps, eager or in a CUDA graph, must honour. Its state
travels by name, as the backends' does: host meta in ``StepPlan.transforms``, the step object in
``ForwardContext.transforms``.

Per step: ``plan`` (host; None: the step is untouched) -> ``upload`` (a ``TransformStep``, read by
the layer loop and each layer's context view) -> ``after_step`` (what the step leaves behind).
"""

from __future__ import annotations

from typing import Any

import torch


class TransformStep:
    """A transform's object of one forward pass. The layer loop (runtime/models/common.py
    CausalLM.forward) calls, when ``routes``: ``enter_layer(i, ...)`` before layer i,
    ``after_attention(i, ...)`` between its attention and feed-forward halves, and
    ``reconstitute`` at the end; every layer reads its context through ``layer_view`` and its
    attention backend through ``backend_for``. The defaults change nothing."""

    routes = False  # whether the layer loop calls the three stream methods

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


class StepTransform:
    """A transform attached to the runner for the engine's life (runtime/model_runner.py)."""

    name: str

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
        """Whether decode steps may carry per-layer KV shifts (their graphs are captured)."""
        return False

    def kv_shift(self, host) -> list[list[int]] | None:
        """[full-attention layer][b] keys that layer lacks of sequence b, None: it holds them all."""
        return None

    def graph_step(self, layer_kv) -> TransformStep:
        """The step object a decode graph with per-layer KV (``layer_kv``: static views) reads."""
        raise NotImplementedError
