"""The InfiniteHiP attention backend: the per-layer run (kernels only) of the plan that
runtime/attention/sparse_plan.py makes once per step.

run (per layer, :class:`InfiniteHipLayer`): decode rows recompute the stages they must (each
from the previous stage's cached or fresh output), store them in the layer's MaskCache, then
attend over sink + the last stage's survivors + stream; prefill blocks run every stage fresh
and the flash-style block-sparse kernel. RoPE: the dynamic styles (config) apply only when some
sparse context exceeds the trained window, unless ``rope_off_in_trained_window`` is off. With
``key_bank``, a refresh of the last stage also rotates its keys into the layer's bank, and
decode attention under dynamic RoPE reads them from there (plugins/infinitehip/key_bank.py)
when every decode row owns a bank row (``key_bank_slots``; otherwise it rotates, same tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from infhip.config import InfiniteHipConfig
from infhip.plugins._triton_utils import triton_on
from infhip.plugins.infinitehip import (pruning_stage, sparse_decode_attention, sparse_prefill_attention,
                                        unrotate_keys, write_key_bank)
from infhip.runtime.attention.dense import DENSE
from infhip.runtime.attention.sparse_plan import (SparseGraphKey, SparsePlanner, SparseStep, SparseStepHost,
                                                  uses_key_bank)
from infhip.runtime.mask_cache import MaskCache

if TYPE_CHECKING:
    from infhip.runtime.attention.paged_kv import PagedKV


class InfiniteHipLayer:
    """Run side of one "infinitehip" layer: its stages, RoPE styles and mask cache."""

    def __init__(self, cfg: InfiniteHipConfig, layer: int, max_slots: int, scale: float,
                 inv_freq: torch.Tensor, device: torch.device, group: int = 0,
                 bank_layout: tuple[int, int, torch.dtype] | None = None, value_bank: bool = False,
                 reduce_scores=None):
        """bank_layout: (Hkv, D, dtype) of the KV cache to keep a rotated key bank of
        (uses_key_bank), else None; value_bank: keep the selected values beside it (offloaded
        caches: cached decode steps then read only GPU pages). reduce_scores: tensor parallelism's
        max of the chunk scores over the ranks (pruning_stage), None on one GPU. The rank's mask
        cache, key bank and RoPE are its own; its selections equal every other rank's."""
        assert inv_freq.dtype == torch.float32, "RoPE inv_freq is stored in float32"
        self.cfg, self.scale, self.inv_freq = cfg, scale, inv_freq
        self.layer = layer
        self.group = group  # refresh-phase group (SparsePlanner.layer_group)
        self.stages = cfg.stages_of(layer)
        self.pruning_rope = cfg.pruning_rope_of(layer)
        self.cache = MaskCache(self.stages, max_slots, device, bank=bank_layout, bank_slots=cfg.key_bank_slots,
                               value_bank=value_bank)
        self.reduce_scores = reduce_scores

    def run(self, q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, step: SparseStep, out: torch.Tensor,
            dropped: torch.Tensor | None = None) -> None:
        """Write the sparse rows of out [T, Hq, D]; q [T, Hq, D] is already rotated and this
        step's K/V are in the layer's cache ``kv`` (fp8 scales and host twin included, table
        entries < 0 name host pages). dropped: int32 [B] tokens this layer does not hold of each
        sequence (UniPrefill drop histories, compacted KV), None = all held: the key ranges end
        that much earlier in the layer's cache."""
        if step.decode_rows.numel():
            ends = step.decode_ends if dropped is None else step.decode_ends - dropped[step.decode_rows]
            self._decode(q, kv, block_tables, step, out, ends)
        if step.prefill_seqs.numel():
            ends = step.prefill_ends if dropped is None else step.prefill_ends - dropped[step.prefill_seqs]
            if step.staged is None:
                self._prefill(q, kv, block_tables, step, out, ends)
            else:  # the chunks' host pages, copied to a GPU twin (their tables renumbered)
                self._prefill(q, kv.with_host(step.staged.acquire(self.layer)), step.staged.tables, step, out, ends)
                step.staged.release(self.layer)

    def _common(self) -> dict:
        return dict(n_sink=self.cfg.n_sink, n_stream=self.cfg.n_stream, inv_freq=self.inv_freq)

    def _prune_kw(self) -> dict:
        return dict(self._common(), head_normalized=self.cfg.chunk_score == "head_normalized",
                    reduce_scores=self.reduce_scores)

    def _decode(self, q, kv: PagedKV, block_tables, step: SparseStep, out, ends) -> None:
        kw, cache = self._common(), self.cache
        prune_kw = self._prune_kw()
        rope = self.pruning_rope if step.dynamic_rope else "none"
        bank = cache.bank is not None and step.dynamic_rope and step.bank_ok  # else rotate: same tokens
        for i, stage in enumerate(self.stages):
            if not step.refresh[self.group][i]:
                continue
            r = step.stage_rows[self.group][i]  # rows recomputing stage i, indices into the decode rows
            slots, rows = step.decode_slots[r], step.decode_rows[r]
            prev = (None, None) if i == 0 else (cache.selected[i - 1][slots], cache.lens[i - 1][slots])
            sel, num = pruning_stage(q, kv, block_tables[rows], step.decode_q_start[r],
                                     step.decode_q_lens[r], ends[r], *prev,
                                     chunk_size=stage.chunk_size, k=stage.k, block_q=1,
                                     max_candidates=step.max_middle if i == 0 else None,
                                     rope_style=rope, **prune_kw)
            cache.selected[i][slots], cache.lens[i][slots] = sel, num
            if cache.bank is not None and i == len(self.stages) - 1:
                # the new selection's keys, rotated to their ranks once (read by the cached
                # steps); written with or without dynamic RoPE so the bank is valid when it turns on
                write_key_bank(kv, block_tables[rows], ends[r], sel, cache.bank, cache.bank_rows(slots),
                               n_sink=self.cfg.n_sink, inv_freq=self.inv_freq, rope_group=stage.chunk_size,
                               skip_row=cache.scratch_bank_row, value_bank=cache.value_bank)
        rows = step.decode_rows
        selected = cache.selected[-1][step.decode_slots]
        out[rows] = sparse_decode_attention(
            q[rows], kv, block_tables[rows], ends, selected, scale=self.scale,
            rope_style=self.cfg.attention_rope if step.dynamic_rope else "none",
            rope_group=self.stages[-1].chunk_size, bank=cache.bank if bank else None,
            bank_rows=cache.bank_rows(step.decode_slots) if bank else None,
            value_bank=cache.value_bank if bank else None, **kw)

    def _prefill(self, q, kv: PagedKV, block_tables, step: SparseStep, out, ends) -> None:
        kw, prune_kw = self._common(), self._prune_kw()
        tables = block_tables[step.prefill_seqs]
        blocks = (step.prefill_q_start, step.prefill_q_lens, ends)
        rope = self.pruning_rope if step.dynamic_rope else "none"
        raw = None  # dynamic RoPE over many blocks: un-rotate each key once, not once per block
        if step.raw_keys and rope != "none" and triton_on(q, kv.k):
            raw = unrotate_keys(kv, block_tables[step.prefill_seq_rows], step.prefill_seq_ends,
                                self.inv_freq, step.prefill_block_seq, dtype=q.dtype)
        sel = num = None
        for i, stage in enumerate(self.stages):
            sel, num = pruning_stage(q, kv, tables, *blocks, sel, num, chunk_size=stage.chunk_size,
                                     k=stage.k, block_q=self.cfg.block_q, query_stride=self.cfg.query_strides[i],
                                     max_candidates=step.max_middle if i == 0 else None, rope_style=rope,
                                     raw_keys=raw, **prune_kw)
        sparse_prefill_attention(q, kv, tables, *blocks, sel, block_q=self.cfg.block_q,
                                 scale=self.scale, out=out, rope_group=self.stages[-1].chunk_size,
                                 rope_style=self.cfg.attention_rope if step.dynamic_rope else "none", **kw)


class InfiniteHipBackend:
    """The backend of "infinitehip" layers: rows whose context reaches ``dense_threshold`` run
    the layer's pruning stages and block-sparse kernels (InfiniteHipLayer, the layer's
    ``sparse`` state), the step's other rows the dense backend's calls. Host side: ``planner``
    (one per runner) plans each step; its ``graph_keys()`` are the sparse graph keys captured at
    load and ``graph_step`` the static metadata a graph of one key reads."""

    name = "infinitehip"
    plugin_modules = ("infinitehip.pruning", "infinitehip.sparse_attention", "infinitehip.key_bank",
                      "infinitehip.raw_keys", "kv_offload")

    def __init__(self, planner: SparsePlanner):
        self.planner = planner

    @classmethod
    def attach(cls, config, ih: InfiniteHipConfig, layers: list, max_num_seqs: int, device: torch.device,
               offload=None) -> "InfiniteHipBackend":
        """The backend of an engine's "infinitehip" layers under knobs ``ih`` (the engine's, or
        with runtime overrides): a host planner (mask-cache slots, refresh schedule) and, on each
        such layer of ``layers`` (Attention modules with their PagedKV), the per-layer state with
        a mask cache of max_num_seqs slots; the layers' backend is set to it. offload: the
        global group's OffloadSpec, None when pages stay on the GPU."""
        from infhip.runtime.engine import DTYPES

        if offload is not None and ih.dense_threshold > offload.min_context:
            raise ValueError(f"dense_threshold {ih.dense_threshold} is above {offload.min_context}, where this "
                             "runner starts offloading KV pages: dense kernels would meet host pages")
        window, max_seq_len = config.model.max_position_embeddings, config.build.max_seq_len
        sparse = [(attn, lp) for attn, lp in zip(layers, config.plan.layers) if lp.plugin == "infinitehip"]
        backend = cls(SparsePlanner(ih, max_num_seqs, window, len(sparse), raw_keys_max_tokens=max_seq_len,
                                    offloading=offload is not None, max_seq_len=max_seq_len))
        bank = uses_key_bank(ih, max_seq_len, window)
        for k, (attn, lp) in enumerate(sparse):
            # the bank holds rotated keys in the queries' (the weights') dtype, whatever the cache's
            kv_layout = (attn.kv.k.shape[2], attn.kv.k.shape[3], DTYPES[config.build.dtype])
            attn.sparse = InfiniteHipLayer(ih, lp.index, max_num_seqs, attn.scale, attn.rope[0].inv_freq, device,
                                           group=backend.planner.layer_group[k],
                                           bank_layout=kv_layout if bank else None,
                                           value_bank=bank and offload is not None,
                                           reduce_scores=attn.tp.all_reduce_max if attn.tp.size > 1 else None)
            attn.backend = backend
        return backend

    @staticmethod
    def reserved_bytes(config, max_num_seqs: int, value_banks: bool = False) -> int:
        """Device memory the backend keeps besides KV pages (runtime/kv_budget.py): one sequence's
        raw-keys scratch and, where the layers keep one (uses_key_bank), the key banks — twice
        that with value banks (offloading). Both hold keys in the weights' dtype."""
        from infhip.runtime.engine import DTYPES

        cfg, ih, build = config.model, config.plan.infinitehip, config.build
        itemsize = DTYPES[build.dtype].itemsize
        total = build.max_seq_len * cfg.num_kv_heads * cfg.head_dim * itemsize
        if uses_key_bank(ih, build.max_seq_len, cfg.max_position_embeddings):
            total += (1 + value_banks) * sum(
                MaskCache.bank_bytes(ih.stages_of(lp.index)[-1].k, min(max_num_seqs, ih.key_bank_slots),
                                     cfg.num_kv_heads, cfg.head_dim, itemsize)
                for lp in config.plan.layers if lp.plugin == "infinitehip")
        return total

    def plan(self, seqs: list, ctx_lens: list[int], num_decodes: int) -> SparseStepHost:
        """Host decisions of one step (SparsePlanner.plan); to_device turns them into SparseStep."""
        return self.planner.plan(seqs, ctx_lens, num_decodes)

    def to_device(self, h: SparseStepHost, cu: list[int], ctx_lens: list[int], tensor) -> SparseStep:
        return self.planner.to_device(h, cu, ctx_lens, tensor)

    def graph_keys(self) -> list[SparseGraphKey]:
        """Every key a pure sparse-decode step can have (captured at load, runtime/cuda_graphs.py)."""
        return self.planner.graph_keys()

    def run(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> torch.Tensor:
        sparse = ctx.sparse
        if sparse is None:  # no row of the step reaches dense_threshold
            return DENSE.run(layer, q, k, v, ctx)
        meta = ctx.groups[layer.kv_group]
        DENSE.rope_and_write(layer, q, k, v, ctx.positions, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = ctx.num_decodes
        if nd and sparse.num_dense_decodes:  # sparse decode rows have context 0 here: read nothing
            DENSE.decode(layer, q[:nd], out[:nd], meta.block_tables[:nd], sparse.dense_decode_lens,
                         ctx.decode_len_bound)
        for lo, hi in sparse.dense_prefill_runs:
            DENSE.prefill_run(layer, q, k, v, out, ctx, lo, hi)
        layer.sparse.run(q, layer.kv, meta.block_tables, sparse, out, ctx.dropped)
        return out

    @staticmethod
    def graph_step(key: SparseGraphKey, context_lens: torch.Tensor, mask_slots: torch.Tensor,
                   buffers: dict[str, torch.Tensor]) -> SparseStep:
        """The SparseStep a CUDA graph of ``key`` reads: every row of the batch is a sparse decode
        row (row b = batch index b) recomputing the stages the key names. context_lens [bs]
        int32 and mask_slots [bs] int64 are views of the graph's static input buffers; buffers
        holds arange64 / arange32 / ones32 of length >= bs and empty none64 / none32."""
        bs = context_lens.shape[0]
        rows, none64, none32 = buffers["arange64"][:bs], buffers["none64"], buffers["none32"]
        return SparseStep(
            decode_rows=rows, decode_q_start=buffers["arange32"][:bs], decode_q_lens=buffers["ones32"][:bs],
            decode_ends=context_lens, decode_slots=mask_slots,
            stage_rows=[[rows if r else none64 for r in group] for group in key.refresh], refresh=key.refresh,
            max_middle=key.capacity, prefill_q_start=none32, prefill_q_lens=none32, prefill_ends=none32,
            prefill_seqs=none64, prefill_seq_rows=none64, prefill_seq_ends=[], prefill_block_seq=none64,
            raw_keys=False, dense_decode_lens=none32, num_dense_decodes=0, dense_prefill_runs=[],
            dynamic_rope=key.dynamic_rope, bank_ok=key.bank_ok)
