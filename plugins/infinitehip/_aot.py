"""The InfiniteHiP launch space of one engine, for the plugins' ``aot_launches`` (plugins/aot.py).

infhip/methods/infinitehip/runtime/planner.py decides per step what the sparse kernels see, by the
rules of infhip/methods/infinitehip/rules.py; this module applies the same rules to list the *classes* of
launches an engine's plan and build limits allow, so that
pruning.py, sparse_attention.py, key_bank.py and raw_keys.py enumerate exactly
what serving launches, on fake (meta) tensors shaped as the runtime shapes them:

* layer kinds: the distinct (stages, pruning RoPE style) of the InfiniteHiP layers (the special
  layers keep ``special_final_k`` and their own style);
* RoPE modes: a step is *static* (stored rotations: "none" everywhere) or *dynamic* (the layer's
  pruning style, ``attention_rope`` in attention). Dynamic steps exist when
  ``rope_off_in_trained_window`` is off or ``max_seq_len`` exceeds the trained window; static
  ones when some sparse context fits the window with ``rope_off_in_trained_window`` on;
* stage-1 candidate capacities (rules.candidate_capacity: powers of two >= 1024) per
  mode: a dynamic step's longest sparse context is past the window (with
  ``rope_off_in_trained_window``), a static step's inside it;
* batch shapes: sparse decode rows 1..max_batch_size (CUDA graphs pad to a captured size, which
  is in that range too), prefill query blocks 1..max_num_batched_tokens / block_q (+ one partial
  block per chunk);
* mask layout (plugins/infinitehip/blocks.MASK_LAYOUTS, :func:`mask_layout_of`): shared, or one
  selection per kv / q head (index tensors gain a head axis; q_head launches one SelectRep and
  one attention program per q head); the key bank only with shared;
* KV offloading (``kv_offload_bytes``, a load option of every InfiniteHiP engine): with and
  without a host twin; the key bank (``uses_key_bank``) and its value bank when offloading;
* dtypes: activations ``space.act_dtype``; the cache ``space.kv_dtype`` with float32 row scales
  when fp8.

Limits taken from the build (``max_batch_size``, ``max_num_batched_tokens``, ``max_seq_len``):
loading an engine with larger ``max_num_seqs`` / ``max_num_batched_tokens`` than it was built for,
or with runtime knobs (``query_strides``, ``key_bank``, ``rope_off_in_trained_window``, ...)
other than the stored plan's, can launch variants that were not compiled ahead of time (they
then JIT-compile as before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


from infhip.methods.infinitehip.knobs import InfiniteHipConfig, PruningStage
from infhip.methods.infinitehip.rules import candidate_capacity, rope_modes, sparse_reachable, uses_key_bank


def mask_layout_of(cfg: InfiniteHipConfig) -> str:
    """The mask layout an engine's InfiniteHiP layers select with: the config's ``mask_layout``
    where it has one (issue 32: the runtime gains the knob in its own refactor), else "shared",
    the only layout infhip/methods/infinitehip/runtime/ launches today."""
    return getattr(cfg, "mask_layout", "shared")


@dataclass(frozen=True)
class LayerKind:
    stages: tuple[PruningStage, ...]
    pruning_rope: str  # the layer's style under dynamic RoPE


@dataclass(frozen=True)
class Mode:
    """One RoPE mode of a step: ``dynamic`` and the stage-1 capacities it can see."""

    dynamic: bool
    capacities: tuple[int, ...]


@dataclass(frozen=True)
class SparseSpace:
    space: object  # plugins.aot.LaunchSpace
    cfg: InfiniteHipConfig
    kinds: tuple[LayerKind, ...]
    modes: tuple[Mode, ...]
    mask_layout: str  # blocks.MASK_LAYOUTS
    bank: bool  # the layers keep a rotated key bank (rules.uses_key_bank)
    bank_for_all: bool  # every decode row can own a bank row (max_batch_size <= key_bank_slots)
    offload: tuple[bool, ...]  # without / with a host twin
    max_decode_rows: int
    max_prefill_blocks: int

    # -- fake tensors shaped as the runtime passes them ---------------------------------------
    @property
    def dims(self) -> tuple[int, int, int]:
        m = self.space.model
        return m.num_heads, m.num_kv_heads, m.head_dim

    @property
    def mask_heads(self) -> int | None:
        """Selections per query block of a per-head layout (Hkv / Hq); None for shared (index
        tensors without a head axis)."""
        from .blocks import mask_heads
        Hq, Hkv, _ = self.dims
        return None if self.mask_layout == "shared" else mask_heads(self.mask_layout, Hq, Hkv)

    def index_rows(self, rows: int, width: int) -> torch.Tensor:
        """An index tensor (candidates, a selection) as the layout shapes it: int32 [rows, width]
        or [rows, H, width]."""
        H = self.mask_heads
        return self.space.fake(rows, *((H,) if H else ()), width, dtype=torch.int32)

    def index_lens(self, rows: int) -> torch.Tensor:
        """Its counts: int32 [rows] or [rows, H]."""
        H = self.mask_heads
        return self.space.fake(rows, *((H,) if H else ()), dtype=torch.int32)

    def step_q(self, tokens: int) -> torch.Tensor:
        """A step's q [T, Hq, D] as the attention module hands it over: a view of the fused qkv
        projection [T, (Hq + 2 Hkv) D] (rows strided), or contiguous after a q norm."""
        Hq, Hkv, D = self.dims
        dt = self.space.act_dtype
        if self.space.model.qk_norm:
            return self.space.fake(tokens, Hq, D, dtype=dt)
        return self.space.fake(tokens, (Hq + 2 * Hkv) * D, dtype=dt)[:, :Hq * D].view(tokens, Hq, D)

    def rows_q(self, rows: int) -> torch.Tensor:
        """q[rows] (a gather: contiguous)."""
        Hq, _, D = self.dims
        return self.space.fake(rows, Hq, D, dtype=self.space.act_dtype)

    def kv(self, offload: bool):
        """A layer's PagedKV (plugins/_aot_shapes.paged_kv), with a host twin or not."""
        from .._aot_shapes import paged_kv
        return paged_kv(self.space, offload=offload)

    def tables(self, rows: int) -> torch.Tensor:
        """Block tables [rows, width] int32; the width (the step's longest page list) varies, the
        kernels take its stride unspecialized."""
        return self.space.fake(rows, 3, dtype=torch.int32)

    def i32(self, n: int) -> torch.Tensor:
        return self.space.fake(n, dtype=torch.int32)

    def i64(self, n: int) -> torch.Tensor:
        return self.space.fake(n, dtype=torch.int64)

    def inv_freq(self) -> torch.Tensor:
        return self.space.fake(self.dims[2] // 2, dtype=torch.float32)


def sparse_space(space) -> SparseSpace | None:
    """The InfiniteHiP launch space of ``space`` (plugins.aot.LaunchSpace), None for an engine
    without InfiniteHiP layers or whose sparse threshold no context reaches."""
    cfg: InfiniteHipConfig | None = space.plan.knobs_of("infinitehip")
    build, model = space.build, space.model
    max_len, window = build.max_seq_len, model.max_position_embeddings
    if not sparse_reachable(cfg, max_len):
        return None  # no InfiniteHiP layers, or no context goes sparse
    layers = [lp.index for lp in space.plan.layers if lp.backend == "infinitehip"]
    kinds = tuple(dict.fromkeys(LayerKind(cfg.stages_of(i), cfg.pruning_rope_of(i)) for i in layers))
    cap = lambda end: candidate_capacity(end, cfg.n_sink, cfg.n_stream)  # noqa: E731
    buckets = lambda lo, hi: tuple(c for c in (1 << b for b in range(10, 63)) if cap(lo) <= c <= cap(hi))  # noqa: E731
    modes = [Mode(dynamic, buckets(lo, hi)) for dynamic, lo, hi in rope_modes(cfg, max_len, window)]
    layout = mask_layout_of(cfg)
    bank = uses_key_bank(cfg, max_len, window, layout)
    bq = cfg.block_q
    # plan_query_blocks: per chunk ceil(q_len / block_q) blocks; the chunks of a step share
    # max_num_batched_tokens, at most max_batch_size chunks (one partial block each)
    extra = build.max_batch_size
    return SparseSpace(space=space, cfg=cfg, kinds=kinds, modes=tuple(modes), mask_layout=layout, bank=bank,
                       bank_for_all=build.max_batch_size <= cfg.key_bank_slots, offload=(False, True),
                       max_decode_rows=build.max_batch_size,
                       max_prefill_blocks=build.max_num_batched_tokens // bq + extra)
