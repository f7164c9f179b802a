"""Attention backends: how one attention layer turns q, k, v of a step into its output.

Every backend keeps to one contract (backend.py: AttentionBackend; SPEC §8.5, vLLM's shape):
host-side ``plan`` once per step, ``upload`` of its host meta into device meta, per layer
``run(layer, q, k, v, ctx, meta)`` (launches only, so a CUDA graph captures it), graph keys and
static graph metadata, the memory it reserves and the kernels it launches (``launch_space``).
The runner, DecodeGraphs, kv_budget, the builder and the serving metrics loop over the
registered backends (``backends()``) and name none.

The dense backend (dense.py, ``DENSE``) serves every layer no registered backend claims and the
dense rows of the others. Which backend runs a layer is decided in one place,
``ForwardContext.run_attention``: in a step that drops tokens, token drop's at the layers it
handles (infhip/methods/token_drop/runtime/step.py); else the layer's own (``layer.backend``) when the step planned
it, else the dense backend.
"""

from __future__ import annotations

from infhip.runtime.attention.backend import (AttachEnv, AttentionBackend, Limits, RequestCounter, backend_class,
                                              backends, register, unregister)
from infhip.runtime.attention.dense import DENSE, DenseBackend
from infhip.runtime.attention.paged_kv import PagedKV

__all__ = ["AttachEnv", "AttentionBackend", "DENSE", "DenseBackend", "Limits", "PagedKV", "RequestCounter",
           "backend_class", "backends", "register", "unregister"]
