"""The attention-backend contract and its registry.

A backend owns the attention of some decoder layers: what it plans per step, the device
metadata its layers read, the state of its CUDA graphs, the memory it keeps besides KV pages,
the kernels it launches (for the builder) and its serving metrics. The runner, DecodeGraphs,
kv_budget, the builder and the metrics loop over the registered backends; none names one.

Life of a backend (every method below; the default does nothing or says "none"):

* its engine-format side is the plan method of the same ``name`` (infhip/methods/: knobs, presets,
  plugin modules), registered separately and torch-free so that the builder never imports this;
* at load, ``knobs_of(config)`` (the plan's knobs of its method; None: the engine has no layers of
  the backend; it is skipped), ``layers_of(config)`` the layers it claims (those whose plan names
  it), ``offload_window(config)`` whether (and from
  which context) its layers read offloaded pages in place (runtime/offload/policy.py),
  ``reserved_bytes(config, limits)`` (kv_budget), then ``attach(config, knobs, layers, env)``
  returns the instance that sets ``attn.backend = self`` on the layers it claims;
* per step, on the host: ``plan(step, seqs) -> host meta`` (None: no row of this step is the
  backend's; its layers then run the dense backend), or ``skip(seqs)`` when a step transform
  runs the step's rows densely (runtime/step_transform.py ``runs_dense``: token drop's drops);
* eager: ``upload(host, step) -> device meta``; per layer ``run(layer, q, k, v, ctx, meta)``,
  launches only (no host sync), so a CUDA graph captures it;
* CUDA graphs of pure decode steps: ``graph_key(host)`` (None: the step runs eagerly),
  ``graph_keys(layer_kv)`` the keys captured at load (layer_kv: those also allowed in steps with
  a transform's per-layer KV shift), ``graph_rows`` the padding value of each per-step int64 row
  its graphs read, staged with the step's tokens (``graph_fill(host, rows)`` writes one step's),
  ``graph_state(max_bs, rows)`` constant buffers and the rows' device view,
  ``graph_meta(key, bs, state, common)`` the device meta a graph reads (common: the graph's
  ForwardContext), built by the code ``upload`` uses; ``graph_warm_kind(key)`` which graphs
  share their kernels (one warm-up run each);
* positions: ``stored_rotation_context(config)``, the longest context at which its layers read
  every cached key at the rotation it was stored with (step transforms that compact a layer's
  KV, as token drop, rely on it);
* ahead of time: the builder (builder/kernels.py) asks its method's ``plugin_modules`` for their
  ``aot_launches(space)``, which launch every kernel variant the engine's plan allows on fake
  tensors; its method's ``moves_pages`` says whether page copies may run (the offload's kernels);
* serving: ``request_counters(config)`` — Prometheus counters of finished requests
  (runtime/serving/metrics.py);
* read-outs: ``debug_view()``, a JSON-able dict of the instance's state now, which
  ``EngineCore.debug_view()`` gathers under "backends" by name (tests and debugging read it
  instead of the backend's attributes; the default shows nothing).

Registration: ``register(cls)`` (a decorator) under ``cls.name``; the registry imports the
built-in backends' modules (their methods' ``runtime_module``) on first use. Registration order is the order in which
backends attach (a later one may claim a layer an earlier one took).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Hashable

import torch

from infhip.methods import BACKEND, runtime_modules
from infhip.registry import Registry



def _builtin() -> tuple[str, ...]:
    """The modules of the built-in backends, each of which registers its backend on import: the
    ``runtime_module`` of each built-in backend method (infhip/methods/<name>/)."""
    return runtime_modules(BACKEND)


@dataclass(frozen=True)
class Limits:
    """Load-time limits a backend sizes its memory by."""

    max_num_seqs: int
    offloading: bool = False  # KV pages of the global group move to host memory


@dataclass
class AttachEnv:
    """What ``attach`` gets besides the config: the runner's limits, device, the global group's
    OffloadSpec (None: pages stay on the GPU) and the staged-prefill buffers (offloading)."""

    limits: Limits
    device: torch.device
    offload: Any = None
    staging: Any = None


@dataclass(frozen=True)
class RequestCounter:
    """A counter of finished requests a backend or a step transform adds to /metrics:
    ``counts(seq)`` says how much a finished request adds (True / False: one or none; a number:
    that many, e.g. token drop's skipped KV entries)."""

    name: str
    help: str
    counts: Callable[[Any], bool | float]


class AttentionBackend:
    """Base class of the backends that claim layers (the dense backend serves the others)."""

    name: ClassVar[str]  # its plan method's name (infhip/methods/)
    offload_hint: ClassVar[str] = ""  # how to build an engine whose layers it serves offloaded
    graph_rows: tuple[int, ...] = ()  # padding value of each per-step row its graphs read

    # -- load ------------------------------------------------------------------------------------
    @classmethod
    def knobs_of(cls, config):
        """The backend's knobs in an engine's config (its method's); None: no layer runs it."""
        return config.plan.knobs_of(cls.name)

    @classmethod
    def layers_of(cls, config) -> list[int]:
        """The indexes of the layers it claims in an engine's plan: those that name it."""
        return [lp.index for lp in config.plan.layers if lp.backend == cls.name]

    @classmethod
    def offload_window(cls, config) -> tuple[int, int, int] | None:
        """(min_context, head_tokens, tail_tokens): its layers read host pages of requests from
        min_context tokens on, all but the first head and last tail tokens' (runtime/offload/);
        None: its kernels read GPU pages only."""
        return None

    @classmethod
    def reserved_bytes(cls, config, limits: Limits) -> int:
        """Device memory the backend keeps besides KV pages (scratch, banks)."""
        return 0

    @classmethod
    def attach(cls, config, knobs, layers: list, env: AttachEnv) -> "AttentionBackend":
        """An instance serving its layers of ``layers`` (Attention modules, with their PagedKV):
        it sets ``attn.backend = self`` (and any per-layer state) on each it claims."""
        raise NotImplementedError

    # -- one step (host) ---------------------------------------------------------------------------
    def plan(self, step, seqs: list):
        """Host meta of StepPlan ``step`` (seqs: its sequences, batch order), None: no row is this
        backend's."""
        return None

    def skip(self, seqs: list) -> None:
        """A step whose rows a step transform runs densely on this backend's layers (its
        ``runs_dense``: token drop's drops); the backend plans nothing for it."""

    # -- eager -------------------------------------------------------------------------------------
    def upload(self, host, step):
        """Device meta of host meta ``host`` of StepPlan ``step`` (non-blocking uploads)."""
        return host

    def run(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, meta) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (not yet rotated) -> out [T, Hq, D]; writes K/V. ctx:
        the layer's view of the step's ForwardContext; meta: this backend's device meta (never
        None: a step or graph without it runs the layer through the dense backend instead)."""
        raise NotImplementedError

    # -- CUDA graphs of pure decode steps ----------------------------------------------------------
    def graph_key(self, host) -> Hashable | None:
        """The key of a step's graph (with the batch size), None: the step runs eagerly."""
        return None

    def graph_keys(self, layer_kv: bool = False) -> list[Hashable]:
        """Every key captured at load (layer_kv: those also allowed in steps with a step
        transform's per-layer KV shift, GraphKey.kv_shift: e.g. after token drop)."""
        return []

    def graph_state(self, max_bs: int, rows: torch.Tensor):
        """Buffers the graphs read besides ``rows`` (the device view [len(graph_rows), max_bs] of
        the per-step rows, filled before each replay)."""
        return rows

    def graph_meta(self, key, bs: int, state, common):
        """The device meta a graph of (bs, key) reads: views of ``state``."""
        raise NotImplementedError

    def graph_fill(self, host, rows) -> None:
        """Write one step's per-step rows (numpy int64 [len(graph_rows), >= n]), columns 0..n-1."""

    def graph_warm_kind(self, key) -> Hashable:
        """The part of a key that decides which kernels its graph loads: the first graph of each
        kind (and batch size) runs once before its capture, so that kernels load outside it."""
        return key

    @classmethod
    def prefix_granule(cls, config) -> int:
        """Prefix caching reuses prefixes that are multiples of this many tokens (and of the page
        size), so a suffix's steps see the prefix as its own prefill would
        (docs/design/prefix_caching.md, "Exactness per plan"); 1: any page boundary."""
        return 1

    @classmethod
    def caches_decode_pages(cls, config) -> bool:
        """Whether pages that decode steps filled may be named for reuse (False when a prefill
        would compute them differently)."""
        return True

    @classmethod
    def stored_rotation_context(cls, config) -> int | None:
        """The longest context at which this backend's layers attend with every cached key at the
        RoPE rotation it was stored with (its original position); None: at any context. Past it
        a backend may re-rotate keys by their index in the layer's cache (InfiniteHiP's dynamic
        RoPE), which differs from the original position once a layer's KV is compacted."""
        return None

    # -- ahead of time and serving -------------------------------------------------------------------
    @classmethod
    def request_counters(cls, config) -> list[RequestCounter]:
        return []

    def debug_view(self) -> dict:
        """Its state now, JSON-able (tests, debugging; read between steps): a copy, never live
        state."""
        return {}


_REGISTRY = Registry("an attention backend", _builtin)
register = _REGISTRY.register  # a decorator: the class under its ``name``; the built-in ones come first
unregister = _REGISTRY.unregister  # (tests)


def backends() -> list[type[AttentionBackend]]:
    """The registered classes, in registration order (the built-in ones first)."""
    return _REGISTRY.classes()


def backend_class(name: str) -> type[AttentionBackend]:
    for cls in backends():
        if cls.name == name:
            return cls
    raise KeyError(f"no attention backend {name!r}; registered: {[c.name for c in backends()]}")
