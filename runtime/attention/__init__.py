"""Attention backends: how one attention layer turns q, k, v of a step into its output.

Every backend keeps to one contract (SPEC §8.5, vLLM's attention-backend shape):

* ``plan`` — host side, once per step, before any kernel: decides which rows the backend serves
  and how, into a metadata object the forward context carries (dense: the context's own
  fields, built by ModelRunner._context; InfiniteHiP: ``InfiniteHipBackend.plan`` ->
  SparseStepHost -> ``to_device`` -> SparseStep; token drop: ``plan_drops`` -> TokenDropStep).
* ``run(layer, q, k, v, ctx) -> out`` — per layer, launches only (no host sync, no allocation
  that depends on data), so a CUDA graph captures it. ``layer`` is the Attention module: its
  PagedKV (``layer.kv``), scale, window, RoPE table and, for InfiniteHiP, its per-layer state
  (``layer.sparse``). ``ctx`` is the layer's view of the step's ForwardContext.
* graph keys — typed frozen dataclasses: ``SparseGraphKey`` (refresh pattern, capacity, dynamic
  RoPE, bank), folded with the dense length bucket and drop histories into
  runtime/cuda_graphs.GraphKey; ``InfiniteHipBackend.graph_step(key, ...)`` builds the static
  metadata a graph of one key reads, from the graph's fixed buffers.
* ``plugin_modules`` — the plugins whose ``aot_launches(space)`` enumerate every kernel variant
  the backend can launch for an engine's plan (builder/kernels.py compiles their union).

Which backend runs a layer is decided in one place, ``ForwardContext.backend_for``: the layer's
own (``layer.backend``: DENSE, or the runner's InfiniteHipBackend on "infinitehip" layers), or
token drop's at the layers a dropping step hands it (runtime/token_drop.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from infhip.runtime.attention.dense import DENSE, DenseBackend
from infhip.runtime.attention.infinitehip import InfiniteHipBackend
from infhip.runtime.attention.sparse_plan import SparseGraphKey
from infhip.runtime.attention.paged_kv import PagedKV


class AttentionBackend(Protocol):
    name: str
    plugin_modules: tuple[str, ...]

    def run(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (not yet rotated) -> out [rows, Hq, D]; writes K/V."""
        ...


__all__ = ["AttentionBackend", "DENSE", "DenseBackend", "InfiniteHipBackend", "PagedKV", "SparseGraphKey"]
