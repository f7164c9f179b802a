"""The InfiniteHiP attention backend: the per-step plan (host) and the per-layer run (kernels only).

plan (once per step, :class:`SparsePlanner`): a sequence whose context after the step is at
least ``dense_threshold`` goes sparse, the others stay dense. Sparse decode rows get their
mask-cache slot and, per *layer group* (the InfiniteHiP layers sharing a refresh-phase offset,
mask_cache.layer_offsets), the first pruning stage they recompute; sparse prefill chunks are
cut into query blocks of ``block_q``. The dense kernels see the rest: decode rows through
context lengths with 0 for the sparse rows (reads nothing), prefill chunks as runs of
consecutive dense chunks. A step of sparse decode rows only, all refreshing the same stages
(every request past its first sparse step: one refresh clock), has a ``graph_key`` (refresh
pattern, stage-1 candidate capacity, dynamic RoPE); with the batch size it selects the CUDA
graph that replays the step (runtime/cuda_graphs.py). Other steps run eagerly.

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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infhip.config import InfiniteHipConfig
from infhip.plugins._triton_utils import triton_on
from infhip.plugins.infinitehip import (plan_query_blocks, pruning_stage, sparse_decode_attention,
                                        sparse_prefill_attention, unrotate_keys, write_key_bank)
from infhip.runtime.attention.dense import DENSE
from infhip.runtime.mask_cache import MaskCache, MaskSlots, layer_offsets, refresh_from

if TYPE_CHECKING:
    from infhip.runtime.attention.paged_kv import PagedKV
    from infhip.runtime.offload_staging import StagedStep


@dataclass(frozen=True)
class SparseGraphKey:
    """What makes two pure sparse-decode steps replay the same CUDA graph (with the batch size)."""

    refresh: tuple[tuple[bool, ...], ...]  # per layer group, per stage: recomputed this step
    capacity: int  # stage-1 candidate capacity (the planner's graph_capacity)
    dynamic_rope: bool  # some context is past the trained window
    bank_ok: bool  # every row owns a key-bank row


@dataclass
class SparseStepHost:
    """Host lists of one step's InfiniteHiP decisions (built by SparsePlanner.plan)."""

    decode_rows: list[int]  # batch index (= q row) of each sparse decode row
    decode_ends: list[int]  # its context length after the step
    decode_slots: list[int]  # its mask-cache slot
    decode_first_stage: list[tuple[int, ...]]  # per layer group: first stage it recomputes (S: none)
    prefill_seqs: list[int]  # batch index of each sparse prefill chunk
    dense_decode_lens: list[int]  # [num_decodes] context lengths, 0 for the sparse rows
    dense_prefill_runs: list[tuple[int, int]]  # batch ranges [lo, hi) of dense prefill chunks
    dynamic_rope: bool
    bank_ok: bool  # every sparse decode row owns a key-bank row (slot < cfg.key_bank_slots)
    refresh: tuple[tuple[bool, ...], ...]  # per layer group, per stage: does any row recompute it
    capacity: int  # stage-1 candidate capacity (>= every row's middle; a power of two)
    graph_key: SparseGraphKey | None  # set when a CUDA graph can replay the step


@dataclass
class SparseStep:
    """Device view of SparseStepHost, read by every InfiniteHiP layer through the forward context."""

    decode_rows: torch.Tensor  # int64 [Bs]
    decode_q_start: torch.Tensor  # int32 [Bs] (= decode_rows)
    decode_q_lens: torch.Tensor  # int32 [Bs] ones
    decode_ends: torch.Tensor  # int32 [Bs]
    decode_slots: torch.Tensor  # int64 [Bs]
    stage_rows: list[list[torch.Tensor]]  # [group][stage]: int64 indices into [Bs] of rows recomputing it
    refresh: tuple[tuple[bool, ...], ...]  # [group][stage]
    max_middle: int  # stage-1 candidate capacity (implicit walk), >= every row's middle
    prefill_q_start: torch.Tensor  # int32 [NB] query blocks of the sparse prefill chunks
    prefill_q_lens: torch.Tensor  # int32 [NB]
    prefill_ends: torch.Tensor  # int32 [NB]
    prefill_seqs: torch.Tensor  # int64 [NB] batch index of each block
    prefill_seq_rows: torch.Tensor  # int64 [Sp] batch index of each sparse prefill chunk
    prefill_seq_ends: list[int]  # [Sp] its context after the step (host; raw keys' extent)
    prefill_block_seq: torch.Tensor  # int64 [NB] index into prefill_seq_rows of each block
    raw_keys: bool  # prefill prunes from un-rotated keys (SparsePlanner.to_device decides)
    dense_decode_lens: torch.Tensor  # int32 [num_decodes]
    num_dense_decodes: int
    dense_prefill_runs: list[tuple[int, int]]
    dynamic_rope: bool
    bank_ok: bool  # decode may read the key bank (SparseStepHost.bank_ok)
    # Offloaded pages of the sparse prefill chunks copied to the GPU, a layer at a time
    # (runtime/offload_staging.py); None: prefill reads them in place (or there are none).
    staged: StagedStep | None = None


# Prefill steps with at least this many sparse query blocks prune from un-rotated keys
# (plugins/infinitehip/raw_keys.py) when dynamic RoPE is on: one pass over the keys then saves a
# re-rotation per loaded key in every block (512 blocks at 1M keys: docs/benchmarks.md; the
# threshold itself is not measured — below it the pass may cost more than it saves).
RAW_KEYS_MIN_BLOCKS = 8


def candidate_capacity(end: int, n_sink: int, n_stream: int) -> int:
    """Stage-1 candidate capacity for contexts up to ``end`` tokens: the middle (neither sink
    nor stream) rounded up to a power of two >= 1024, so that it, and with it the kernels' grid
    and a CUDA graph's key, changes only when the context doubles.

        >>> candidate_capacity(100, 4, 8), candidate_capacity(5000, 256, 1024)
        (1024, 4096)
    """
    middle = max(0, max(min(n_sink, end), end - n_stream) - n_sink)
    return 1 << max(10, (middle - 1).bit_length())


class SparsePlanner:
    """Host side: decides per step which rows go sparse and which stages they recompute."""

    def __init__(self, cfg: InfiniteHipConfig, max_slots: int, trained_window: int, num_sparse_layers: int = 1,
                 raw_keys_max_tokens: int = 0, offloading: bool = False, max_seq_len: int | None = None):
        """offloading: the runner moves KV pages to host memory (runtime/kv_cache.py): every
        dynamic-RoPE prefill step then prunes from the raw-keys scratch, which reads each
        offloaded key over PCIe once, instead of once per query block (a 32K chunk at 1M keys:
        unrotate 48 ms, stages unchanged; docs/benchmarks.md)."""
        self.cfg, self.trained_window = cfg, trained_window
        self.offloading = offloading
        # Raw keys need a [tokens, Hkv, D] scratch per layer call: only steps whose sparse prefill
        # contexts sum to at most this many tokens use them (the runner reserves that memory).
        self.raw_keys_max_tokens = raw_keys_max_tokens
        self.slots = MaskSlots(max_slots)
        self.clock = 0  # steps with sparse decode rows so far: the refresh schedule's time
        offsets = (layer_offsets(num_sparse_layers, cfg.refresh_intervals[0], align=cfg.refresh_intervals[-1])
                   if cfg.stagger_refresh else [0] * num_sparse_layers)
        self.group_offsets = sorted(set(offsets))
        # layer_group[k]: the group of the k-th InfiniteHiP layer (InfiniteHipLayer.group)
        self.layer_group = [self.group_offsets.index(o) for o in offsets]
        # Decode steps a CUDA graph replays score stage 1 over the capacity of the longest context
        # the engine serves, whatever the step's: one graph then serves every context. Chunks past
        # a row's middle score -inf and are never kept (as with today's power-of-two rounding),
        # and stage 1 only runs on its refresh steps, so the larger grid costs little.
        # None: the step's own capacity (tests of the planner alone).
        self.graph_capacity = (candidate_capacity(max_seq_len, cfg.n_sink, cfg.n_stream)
                               if max_seq_len is not None else None)
        self.trained_window_rope_off = cfg.rope_off_in_trained_window
        self.max_seq_len = max_seq_len

    def plan(self, seqs: list, ctx_lens: list[int], num_decodes: int) -> SparseStepHost:
        cfg, n = self.cfg, len(self.cfg.stages)
        rows, ends, slots, firsts, prefill, dense_lens, runs = [], [], [], [], [], [], []
        for b, (seq, end) in enumerate(zip(seqs, ctx_lens)):
            sparse = end >= cfg.dense_threshold
            if b < num_decodes:
                dense_lens.append(0 if sparse else end)
                if sparse:
                    slot, j = self.slots.next_decode(seq)
                    first = tuple(refresh_from(j, self.clock + o, cfg.refresh_intervals) for o in self.group_offsets)
                    rows.append(b), ends.append(end), slots.append(slot), firsts.append(first)
                    continue
            elif sparse:
                prefill.append(b)
            elif runs and runs[-1][1] == b:
                runs[-1] = (runs[-1][0], b + 1)
            else:
                runs.append((b, b + 1))
            self.slots.invalidate(seq.seq_id)  # not a sparse decode step: masks go stale
        self.clock += bool(rows)
        sparse_ends = ends + [ctx_lens[b] for b in prefill]
        dynamic = bool(sparse_ends) and (not cfg.rope_off_in_trained_window
                                         or max(sparse_ends) > self.trained_window)
        refresh = tuple(tuple(any(f[g] <= i for f in firsts) for i in range(n))
                        for g in range(len(self.group_offsets)))
        capacity = candidate_capacity(max(sparse_ends, default=0), cfg.n_sink, cfg.n_stream)
        bank_ok = all(slot < cfg.key_bank_slots for slot in slots)
        # a step some of whose rows own no key-bank row runs eagerly (only with more long requests
        # decoding at once than key_bank_slots): its graphs would double the set captured at load
        graphable = rows and len(rows) == len(seqs) and all(f == firsts[0] for f in firsts) and bank_ok
        if graphable and self.graph_capacity is not None:
            capacity = max(capacity, self.graph_capacity)
        return SparseStepHost(decode_rows=rows, decode_ends=ends, decode_slots=slots,
                              decode_first_stage=firsts, prefill_seqs=prefill,
                              dense_decode_lens=dense_lens,
                              dense_prefill_runs=runs, dynamic_rope=dynamic, bank_ok=bank_ok, refresh=refresh,
                              capacity=capacity,
                              graph_key=SparseGraphKey(refresh, capacity, dynamic, bank_ok) if graphable else None)

    def graph_keys(self) -> list[SparseGraphKey]:
        """Every graph_key a decode step of this planner can have (runtime/cuda_graphs.py
        captures them all at load): the refresh patterns of one cycle of the clock, plus a
        newcomer's full first step, with dynamic RoPE off (sparse inside the trained window) and
        on (past it), where the engine's limits reach them."""
        cfg, n = self.cfg, len(self.cfg.stages)
        patterns = {tuple((True,) * n for _ in self.group_offsets)}
        for clock in range(cfg.refresh_intervals[0]):
            firsts = [refresh_from(1, clock + o, cfg.refresh_intervals) for o in self.group_offsets]
            patterns.add(tuple(tuple(f <= i for i in range(n)) for f in firsts))
        dynamic = []
        if self.trained_window_rope_off and cfg.dense_threshold <= self.trained_window:
            dynamic.append(False)
        if not self.trained_window_rope_off or self.max_seq_len is None or self.max_seq_len > self.trained_window:
            dynamic.append(True)
        return [SparseGraphKey(refresh, self.graph_capacity, d, True) for d in dynamic for refresh in sorted(patterns)]

    def skip(self, seqs: list) -> None:
        """A step that runs no sparse attention (e.g. it drops tokens): every request's cached
        masks go stale."""
        for seq in seqs:
            self.slots.invalidate(seq.seq_id)

    def to_device(self, h: SparseStepHost, cu: list[int], ctx_lens: list[int], tensor) -> SparseStep:
        """Tensors of a host plan; ``tensor(values, dtype)`` puts a list on the device."""
        cfg = self.cfg
        q_lens = [cu[b + 1] - cu[b] for b in h.prefill_seqs]
        starts, lens, ends, seq_of = plan_query_blocks(q_lens, [ctx_lens[b] for b in h.prefill_seqs], cfg.block_q)
        seq_of = seq_of.tolist()  # index into h.prefill_seqs of each block
        # plan_query_blocks numbers rows from 0 over the chunks it is given; shift each block to
        # its chunk's first row in the step's packed q.
        shift = [cu[h.prefill_seqs[s]] - sum(q_lens[:s]) for s in seq_of]
        # every (group, stage) row list in one upload, sliced per group and stage (views)
        S, idx = len(cfg.stages), range(len(h.decode_rows))
        lists = [[r for r in idx if h.decode_first_stage[r][g] <= i]
                 for g in range(len(self.group_offsets)) for i in range(S)]
        flat = tensor([r for rows in lists for r in rows], torch.int64)
        bounds = [0]
        for rows in lists:
            bounds.append(bounds[-1] + len(rows))
        views = [flat[bounds[x]:bounds[x + 1]] for x in range(len(lists))]
        return SparseStep(
            decode_rows=tensor(h.decode_rows, torch.int64), decode_q_start=tensor(h.decode_rows, torch.int32),
            decode_q_lens=tensor([1] * len(h.decode_rows), torch.int32),
            decode_ends=tensor(h.decode_ends, torch.int32), decode_slots=tensor(h.decode_slots, torch.int64),
            stage_rows=[views[g * S:(g + 1) * S] for g in range(len(self.group_offsets))],
            refresh=h.refresh, max_middle=h.capacity,
            prefill_q_start=tensor([s + d for s, d in zip(starts.tolist(), shift)], torch.int32),
            prefill_q_lens=tensor(lens.tolist(), torch.int32), prefill_ends=tensor(ends.tolist(), torch.int32),
            prefill_seqs=tensor([h.prefill_seqs[s] for s in seq_of], torch.int64),
            prefill_seq_rows=tensor(h.prefill_seqs, torch.int64),
            prefill_seq_ends=[ctx_lens[b] for b in h.prefill_seqs],
            prefill_block_seq=tensor(seq_of, torch.int64),
            raw_keys=(h.dynamic_rope and (self.offloading or len(seq_of) >= RAW_KEYS_MIN_BLOCKS)
                      and sum(ctx_lens[b] for b in h.prefill_seqs) <= self.raw_keys_max_tokens),
            dense_decode_lens=tensor(h.dense_decode_lens, torch.int32),
            num_dense_decodes=sum(1 for x in h.dense_decode_lens if x), dense_prefill_runs=h.dense_prefill_runs,
            dynamic_rope=h.dynamic_rope, bank_ok=h.bank_ok)


def uses_key_bank(cfg: InfiniteHipConfig, max_seq_len: int, trained_window: int) -> bool:
    """Whether the layers keep a rotated key bank: it serves the streaming attention style, and
    only steps with dynamic RoPE read it, so a runner whose sequences all fit the trained window
    (with ``rope_off_in_trained_window``) does not spend the memory."""
    dynamic_possible = not cfg.rope_off_in_trained_window or max_seq_len > trained_window
    return cfg.key_bank and cfg.attention_rope == "streaming" and dynamic_possible


class InfiniteHipLayer:
    """Run side of one "infinitehip" layer: its stages, RoPE styles and mask cache."""

    def __init__(self, cfg: InfiniteHipConfig, layer: int, max_slots: int, scale: float,
                 inv_freq: torch.Tensor, device: torch.device, group: int = 0,
                 bank_layout: tuple[int, int, torch.dtype] | None = None, value_bank: bool = False):
        """bank_layout: (Hkv, D, dtype) of the KV cache to keep a rotated key bank of
        (uses_key_bank), else None; value_bank: keep the selected values beside it (offloaded
        caches: cached decode steps then read only GPU pages)."""
        assert inv_freq.dtype == torch.float32, "RoPE inv_freq is stored in float32"
        self.cfg, self.scale, self.inv_freq = cfg, scale, inv_freq
        self.layer = layer
        self.group = group  # refresh-phase group (SparsePlanner.layer_group)
        self.stages = cfg.stages_of(layer)
        self.pruning_rope = cfg.pruning_rope_of(layer)
        self.cache = MaskCache(self.stages, max_slots, device, bank=bank_layout, bank_slots=cfg.key_bank_slots,
                               value_bank=value_bank)

    def run(self, q: torch.Tensor, kv: PagedKV, block_tables: torch.Tensor, step: SparseStep, out: torch.Tensor,
            dropped: torch.Tensor | None = None) -> None:
        """Write the sparse rows of out [T, Hq, D]; q [T, Hq, D] is already rotated and this
        step's K/V are in the layer's cache ``kv`` (fp8 scales and host twin included, table
        entries < 0 name host pages). dropped: int32 [B] tokens this layer does not hold of each
        sequence (UniPrefill drop histories, compacted KV), None = all held: the key ranges end
        that much earlier in the layer's cache."""
        k_cache, v_cache, k_scale, v_scale = kv.k, kv.v, kv.k_scale, kv.v_scale
        extra = (k_scale, v_scale, kv.host)
        if step.decode_rows.numel():
            ends = step.decode_ends if dropped is None else step.decode_ends - dropped[step.decode_rows]
            self._decode(q, k_cache, v_cache, block_tables, step, out, ends, *extra)
        if step.prefill_seqs.numel():
            ends = step.prefill_ends if dropped is None else step.prefill_ends - dropped[step.prefill_seqs]
            if step.staged is None:
                self._prefill(q, k_cache, v_cache, block_tables, step, out, ends, *extra)
            else:  # the chunks' host pages, copied to a GPU twin (their tables renumbered)
                twin = step.staged.acquire(self.layer)
                self._prefill(q, k_cache, v_cache, step.staged.tables, step, out, ends, k_scale, v_scale, twin)
                step.staged.release(self.layer)

    def _common(self) -> dict:
        return dict(n_sink=self.cfg.n_sink, n_stream=self.cfg.n_stream, inv_freq=self.inv_freq)

    def _prune_kw(self) -> dict:
        return dict(self._common(), head_normalized=self.cfg.chunk_score == "head_normalized")

    def _decode(self, q, k_cache, v_cache, block_tables, step: SparseStep, out, ends, k_scale, v_scale,
                offload) -> None:
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
            sel, num = pruning_stage(q, k_cache, block_tables[rows], step.decode_q_start[r],
                                     step.decode_q_lens[r], ends[r], *prev,
                                     chunk_size=stage.chunk_size, k=stage.k, block_q=1,
                                     max_candidates=step.max_middle if i == 0 else None,
                                     rope_style=rope, k_scale=k_scale, offload=offload, **prune_kw)
            cache.selected[i][slots], cache.lens[i][slots] = sel, num
            if cache.bank is not None and i == len(self.stages) - 1:
                # the new selection's keys, rotated to their ranks once (read by the cached
                # steps); written with or without dynamic RoPE so the bank is valid when it turns on
                write_key_bank(k_cache, block_tables[rows], ends[r], sel, cache.bank, cache.bank_rows(slots),
                               n_sink=self.cfg.n_sink, inv_freq=self.inv_freq, rope_group=stage.chunk_size,
                               skip_row=cache.scratch_bank_row, k_scale=k_scale, offload=offload,
                               v_cache=v_cache, v_scale=v_scale, value_bank=cache.value_bank)
        rows = step.decode_rows
        selected = cache.selected[-1][step.decode_slots]
        out[rows] = sparse_decode_attention(
            q[rows], k_cache, v_cache, block_tables[rows], ends, selected, scale=self.scale,
            rope_style=self.cfg.attention_rope if step.dynamic_rope else "none",
            rope_group=self.stages[-1].chunk_size, bank=cache.bank if bank else None,
            bank_rows=cache.bank_rows(step.decode_slots) if bank else None, k_scale=k_scale, v_scale=v_scale,
            offload=offload, value_bank=cache.value_bank if bank else None, **kw)

    def _prefill(self, q, k_cache, v_cache, block_tables, step: SparseStep, out, ends, k_scale, v_scale,
                 offload) -> None:
        kw, prune_kw = self._common(), self._prune_kw()
        tables = block_tables[step.prefill_seqs]
        blocks = (step.prefill_q_start, step.prefill_q_lens, ends)
        rope = self.pruning_rope if step.dynamic_rope else "none"
        raw = None  # dynamic RoPE over many blocks: un-rotate each key once, not once per block
        if step.raw_keys and rope != "none" and triton_on(q, k_cache):
            raw = unrotate_keys(k_cache, block_tables[step.prefill_seq_rows], step.prefill_seq_ends,
                                self.inv_freq, step.prefill_block_seq, k_scale=k_scale, dtype=q.dtype,
                                offload=offload)
        sel = num = None
        for i, stage in enumerate(self.stages):
            sel, num = pruning_stage(q, k_cache, tables, *blocks, sel, num, chunk_size=stage.chunk_size,
                                     k=stage.k, block_q=self.cfg.block_q, query_stride=self.cfg.query_strides[i],
                                     max_candidates=step.max_middle if i == 0 else None, rope_style=rope,
                                     raw_keys=raw, k_scale=k_scale, offload=offload, **prune_kw)
        sparse_prefill_attention(q, k_cache, v_cache, tables, *blocks, sel, block_q=self.cfg.block_q,
                                 scale=self.scale, out=out, rope_group=self.stages[-1].chunk_size,
                                 rope_style=self.cfg.attention_rope if step.dynamic_rope else "none",
                                 k_scale=k_scale, v_scale=v_scale, offload=offload, **kw)


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
