"""The InfiniteHiP attention backend (runtime/attention/backend.py's contract) of "infinitehip"
layers: rows whose context reaches ``dense_threshold`` run the layer's pruning stages and
block-sparse kernels (InfiniteHipLayer, layer.py: the layer's ``backend_state``), the step's other
rows the dense backend's calls. Host side: one SparsePlanner (planner.py) per runner plans each
step; its ``graph_keys()`` are the sparse graph keys captured at load and ``graph_step`` the
metadata a graph of one key reads, built by the constructor eager steps use.
"""

from __future__ import annotations

import dataclasses

import torch

from infhip.methods.infinitehip.knobs import InfiniteHipConfig
from infhip.plugins.dtypes import DTYPES
from infhip.runtime.attention.backend import AttachEnv, AttentionBackend, Limits, RequestCounter, register
from infhip.runtime.attention.dense import DENSE
from infhip.runtime.forward_context import upload

from .layer import InfiniteHipLayer
from .mask_cache import MaskCache
from .planner import GraphBuffers, SparseGraphKey, SparsePlanner, SparseStep, SparseStepHost, uses_key_bank


@register
class InfiniteHipBackend(AttentionBackend):
    name = "infinitehip"  # its plan method: infhip/methods/infinitehip/ (knobs, presets, plugin modules)

    def __init__(self, planner: SparsePlanner, device: torch.device, staging=None):
        self.planner, self.device, self.staging = planner, device, staging
        # the graphs' per-step row of mask-cache slots; padding rows point at the scratch slot
        self.graph_rows = (planner.slots.scratch,)
        # planned steps with sparse prefill chunks / sparse decode rows (debug_view)
        self.steps = {"sparse_prefill": 0, "sparse_decode": 0}

    offload_hint = "InfiniteHiP: build it with --preset 3k | 3k-fast | 3k-flash | 5k"

    @classmethod
    def offload_window(cls, config) -> tuple[int, int, int]:
        """From the dense threshold on (past the trained window when RoPE stays off inside it:
        runtime/offload/policy.py says why), keeping sink and stream on the GPU."""
        ih, window = cls.knobs_of(config), config.model.max_position_embeddings
        min_context = max(ih.dense_threshold, window + 1) if ih.rope_off_in_trained_window else ih.dense_threshold
        return min_context, ih.n_sink, ih.n_stream

    @classmethod
    def attach(cls, config, ih: InfiniteHipConfig, layers: list, env: AttachEnv) -> "InfiniteHipBackend":
        """The backend of an engine's "infinitehip" layers under knobs ``ih`` (the engine's, or
        with runtime overrides): a host planner (mask-cache slots, refresh schedule) and, on each
        such layer of ``layers`` (Attention modules with their PagedKV), the per-layer state with
        a mask cache of max_num_seqs slots; the layers' backend is set to it."""

        offload, max_num_seqs = env.offload, env.limits.max_num_seqs
        if offload is not None and ih.dense_threshold > offload.min_context:
            raise ValueError(f"dense_threshold {ih.dense_threshold} is above {offload.min_context}, where this "
                             "runner starts offloading KV pages: dense kernels would meet host pages")
        window, max_seq_len = config.model.max_position_embeddings, config.build.max_seq_len
        claimed = set(cls.layers_of(config))
        sparse = [(attn, lp) for attn, lp in zip(layers, config.plan.layers) if lp.index in claimed]
        backend = cls(SparsePlanner(ih, max_num_seqs, window, len(sparse), raw_keys_max_tokens=max_seq_len,
                                    offloading=offload is not None, max_seq_len=max_seq_len), env.device, env.staging)
        bank = uses_key_bank(ih, max_seq_len, window)
        for k, (attn, lp) in enumerate(sparse):
            # the bank holds rotated keys in the queries' (the weights') dtype, whatever the cache's
            kv_layout = (attn.kv.k.shape[2], attn.kv.k.shape[3], DTYPES[config.build.dtype])
            attn.backend_state = InfiniteHipLayer(
                ih, lp.index, max_num_seqs, attn.scale, attn.rope[0].inv_freq, env.device,
                group=backend.planner.layer_group[k], bank_layout=kv_layout if bank else None,
                value_bank=bank and offload is not None,
                reduce_scores=attn.tp.all_reduce_max if attn.tp.size > 1 else None)
            attn.backend = backend
        return backend

    @classmethod
    def reserved_bytes(cls, config, limits: Limits) -> int:
        """One sequence's raw-keys scratch and, where the layers keep one (uses_key_bank), the
        key banks — twice that with value banks (offloading). Both hold keys in the weights' dtype."""

        cfg, ih, build = config.model, cls.knobs_of(config), config.build
        itemsize = DTYPES[build.dtype].itemsize
        total = build.max_seq_len * cfg.num_kv_heads * cfg.head_dim * itemsize
        if uses_key_bank(ih, build.max_seq_len, cfg.max_position_embeddings):
            claimed = set(cls.layers_of(config))
            total += (1 + limits.offloading) * sum(
                MaskCache.bank_bytes(ih.stages_of(lp.index)[-1].k, min(limits.max_num_seqs, ih.key_bank_slots),
                                     cfg.num_kv_heads, cfg.head_dim, itemsize)
                for lp in config.plan.layers if lp.index in claimed)
        return total

    # -- one step ---------------------------------------------------------------------------------
    def plan(self, step, seqs: list) -> SparseStepHost | None:
        """Host decisions of one step (SparsePlanner.plan); None when no row goes sparse."""
        h = self.planner.plan(seqs, step.ctx_lens, step.num_decodes)
        self.steps["sparse_prefill"] += bool(h.prefill_seqs)
        self.steps["sparse_decode"] += bool(h.decode_rows)
        return h if h.decode_rows or h.prefill_seqs else None

    def skip(self, seqs: list) -> None:
        self.planner.skip(seqs)

    def upload(self, h: SparseStepHost, step) -> SparseStep:
        """The SparseStep of host plan h of StepPlan step (with its sparse prefill chunks' host
        pages staged, runtime/offload/staging.py, when pages are offloaded)."""
        sparse = self.planner.to_device(h, step.cu, step.ctx_lens, self._tensor)
        if self.staging is not None:
            sparse.staged = self.staging.stage(step.tables["global"], h.prefill_seqs)
        return sparse

    def _tensor(self, values, dtype: torch.dtype) -> torch.Tensor:
        return upload(values, dtype, self.device)

    def run(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, sparse) -> torch.Tensor:
        meta = ctx.groups[layer.kv_group]
        DENSE.rope_and_write(layer, q, k, v, ctx.positions, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = ctx.num_decodes
        if nd and sparse.num_dense_decodes:  # sparse decode rows have context 0 here: read nothing
            DENSE.decode(layer, q[:nd], out[:nd], meta.block_tables[:nd], sparse.dense_decode_lens,
                         ctx.decode_len_bound)
        for lo, hi in sparse.dense_prefill_runs:
            DENSE.prefill_run(layer, q, k, v, out, ctx, lo, hi)
        layer.backend_state.run(q, layer.kv, meta.block_tables, sparse, out, ctx.key_shift(layer.layer_index))
        return out

    # -- CUDA graphs --------------------------------------------------------------------------------
    def graph_key(self, h: SparseStepHost) -> SparseGraphKey | None:
        return h.graph_key

    def graph_keys(self, layer_kv: bool = False) -> list[SparseGraphKey]:
        """Every key a pure sparse-decode step can have; with drop histories only the keys
        without dynamic RoPE (requests drop tokens only inside the trained window)."""
        return [k for k in self.planner.graph_keys() if not (layer_kv and k.dynamic_rope)]

    def graph_state(self, max_bs: int, rows: torch.Tensor) -> GraphBuffers:
        return GraphBuffers.of(max_bs, rows[0])

    def graph_meta(self, key: SparseGraphKey, bs: int, state: GraphBuffers, common) -> SparseStep:
        return self.planner.graph_step(key, bs, state, common.context_lens)

    def graph_warm_kind(self, key: SparseGraphKey) -> bool:
        return key.dynamic_rope  # the RoPE mode picks the kernels' variants

    def graph_fill(self, h: SparseStepHost, rows) -> None:
        rows[0, :len(h.decode_slots)] = h.decode_slots

    @classmethod
    def prefix_granule(cls, config) -> int:
        """Prefill is block-causal (a query block of block_q reads only keys before its end): a
        reused prefix keeps the suffix's query blocks on the prefix's grid."""
        return cls.knobs_of(config).block_q

    @classmethod
    def caches_decode_pages(cls, config) -> bool:
        """Mask caches and key banks are decode state, rebuilt at the first sparse decode step:
        pages sparse decode steps filled would differ from a prefill's."""
        return False

    @classmethod
    def stored_rotation_context(cls, config) -> int:
        """Inside the trained window keys keep their stored rotations; past it dynamic RoPE
        rotates them by their index in the layer's cache (infhip/methods/token_drop/runtime/step.py says what that
        means for token drop)."""
        return config.model.max_position_embeddings

    def debug_view(self) -> dict:
        """knobs: the InfiniteHiP knobs in force (after load overrides) as a dict; offloading:
        whether its layers read offloaded pages in place; clock: steps with sparse decode rows so
        far (the refresh schedule's time); steps: planned steps with sparse prefill chunks and
        with sparse decode rows, counted since attach."""
        return {"knobs": dataclasses.asdict(self.planner.cfg), "offloading": self.planner.offloading,
                "clock": self.planner.clock, "steps": dict(self.steps)}

    # -- serving ------------------------------------------------------------------------------------
    @classmethod
    def request_counters(cls, config) -> list[RequestCounter]:
        threshold = cls.knobs_of(config).dense_threshold
        return [RequestCounter("infhip_infinitehip_sparse_requests",
                               "Finished requests whose context reached InfiniteHiP's dense_threshold (decoded sparse)",
                               lambda seq: seq.num_tokens >= threshold)]
