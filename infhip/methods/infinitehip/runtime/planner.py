"""InfiniteHiP's per-step plan (host, once per step): which rows go sparse, which pruning stages
they recompute, and the device tensors every InfiniteHiP layer of the step reads.

A sequence whose context after the step is at least ``dense_threshold`` goes sparse, the others
stay dense. Sparse decode rows get their mask-cache slot and, per *layer group* (the InfiniteHiP
layers sharing a refresh-phase offset, mask_cache.layer_offsets), the first pruning stage they
recompute; sparse prefill chunks are cut into query blocks of ``block_q``. The dense kernels see
the rest: decode rows through context lengths with 0 for the sparse rows (reads nothing),
prefill chunks as runs of consecutive dense chunks. A step of sparse decode rows only, all
refreshing the same stages (every request past its first sparse step: one refresh clock), has a
``graph_key`` (refresh pattern, stage-1 candidate capacity, dynamic RoPE, bank); with the batch
size it selects the CUDA graph that replays the step (runtime/cuda_graphs.py). Other steps run
eagerly. The run side is layer.py; the rules the plugins' AOT enumeration shares (capacity,
RoPE modes, key bank) are infhip/methods/infinitehip/rules.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infhip.methods.infinitehip.knobs import InfiniteHipConfig
from infhip.plugins.infinitehip import plan_query_blocks
from infhip.methods.infinitehip.rules import (candidate_capacity, dynamic_rope_possible, static_rope_possible,
                                              step_dynamic_rope, uses_key_bank)

from .mask_cache import MaskSlots, layer_offsets, refresh_from

__all__ = ["SparseGraphKey", "SparseStepHost", "SparseStep", "SparsePlanner", "candidate_capacity",
           "uses_key_bank", "RAW_KEYS_MIN_BLOCKS"]

if TYPE_CHECKING:
    from infhip.runtime.offload.staging import StagedStep


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
    # (runtime/offload/staging.py); None: prefill reads them in place (or there are none).
    staged: StagedStep | None = None


# Prefill steps with at least this many sparse query blocks prune from un-rotated keys
# (plugins/infinitehip/raw_keys.py) when dynamic RoPE is on: one pass over the keys then saves a
# re-rotation per loaded key in every block. Measured (benchmarks/speed/bench_constants.py, H200,
# Llama-8B shapes, 3k stages): from 32 blocks raw keys are no slower at 192K and 1M keys (0.88x,
# 0.96x of rotating); at 16 blocks they cost 1.19x at 1M; at 128 blocks they save 26-32 %.
RAW_KEYS_MIN_BLOCKS = 32


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
        dynamic = bool(sparse_ends) and step_dynamic_rope(cfg, max(sparse_ends), self.trained_window)
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
        max_len = self.max_seq_len if self.max_seq_len is not None else 1 << 62  # None: no limit
        dynamic = [d for d, possible in ((False, static_rope_possible), (True, dynamic_rope_possible))
                   if possible(cfg, max_len, self.trained_window)]
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
        decode = DecodeTensors(rows=tensor(h.decode_rows, torch.int64), q_start=tensor(h.decode_rows, torch.int32),
                               q_lens=tensor([1] * len(h.decode_rows), torch.int32),
                               ends=tensor(h.decode_ends, torch.int32), slots=tensor(h.decode_slots, torch.int64))
        prefill = dict(
            prefill_q_start=tensor([s + d for s, d in zip(starts.tolist(), shift)], torch.int32),
            prefill_q_lens=tensor(lens.tolist(), torch.int32), prefill_ends=tensor(ends.tolist(), torch.int32),
            prefill_seqs=tensor([h.prefill_seqs[s] for s in seq_of], torch.int64),
            prefill_seq_rows=tensor(h.prefill_seqs, torch.int64),
            prefill_seq_ends=[ctx_lens[b] for b in h.prefill_seqs],
            prefill_block_seq=tensor(seq_of, torch.int64),
            raw_keys=(h.dynamic_rope and (self.offloading or len(seq_of) >= RAW_KEYS_MIN_BLOCKS)
                      and sum(ctx_lens[b] for b in h.prefill_seqs) <= self.raw_keys_max_tokens))
        return sparse_step(h, decode, [views[g * S:(g + 1) * S] for g in range(len(self.group_offsets))],
                           prefill, tensor(h.dense_decode_lens, torch.int32))

    def graph_step(self, key: SparseGraphKey, bs: int, state: "GraphBuffers", ends: torch.Tensor) -> SparseStep:
        """The SparseStep a CUDA graph of ``key`` reads, through the constructor to_device uses:
        every row of the batch is a sparse decode row (row b = batch index b) recomputing the
        stages the key names; ends [bs] int32 and the mask slots (state.slots) are views of the
        graph's static inputs, filled before each replay."""
        h = SparseStepHost(decode_rows=list(range(bs)), decode_ends=[], decode_slots=[], decode_first_stage=[],
                           prefill_seqs=[], dense_decode_lens=[], dense_prefill_runs=[],
                           dynamic_rope=key.dynamic_rope, bank_ok=key.bank_ok, refresh=key.refresh,
                           capacity=key.capacity, graph_key=key)
        rows, none64, none32 = state.arange64[:bs], state.none64, state.none32
        decode = DecodeTensors(rows=rows, q_start=state.arange32[:bs], q_lens=state.ones32[:bs], ends=ends,
                               slots=state.slots[:bs])
        prefill = dict(prefill_q_start=none32, prefill_q_lens=none32, prefill_ends=none32, prefill_seqs=none64,
                       prefill_seq_rows=none64, prefill_seq_ends=[], prefill_block_seq=none64, raw_keys=False)
        return sparse_step(h, decode, [[rows if r else none64 for r in group] for group in key.refresh], prefill,
                           none32)


@dataclass
class DecodeTensors:
    """The device tensors of a step's sparse decode rows (SparseStep's decode_* fields)."""

    rows: torch.Tensor
    q_start: torch.Tensor
    q_lens: torch.Tensor
    ends: torch.Tensor
    slots: torch.Tensor


@dataclass
class GraphBuffers:
    """What InfiniteHiP's graphs read besides the common inputs: constant index buffers of
    length max_bs, empty ones, and the per-step row of mask-cache slots."""

    arange64: torch.Tensor
    arange32: torch.Tensor
    ones32: torch.Tensor
    none64: torch.Tensor
    none32: torch.Tensor
    slots: torch.Tensor  # int64 [max_bs] view of the graphs' per-step rows

    @classmethod
    def of(cls, max_bs: int, slots: torch.Tensor) -> "GraphBuffers":
        dev = slots.device
        return cls(arange64=torch.arange(max_bs, dtype=torch.int64, device=dev),
                   arange32=torch.arange(max_bs, dtype=torch.int32, device=dev),
                   ones32=torch.ones(max_bs, dtype=torch.int32, device=dev),
                   none64=torch.zeros(0, dtype=torch.int64, device=dev),
                   none32=torch.zeros(0, dtype=torch.int32, device=dev), slots=slots)


def sparse_step(h: SparseStepHost, decode: DecodeTensors, stage_rows: list[list[torch.Tensor]], prefill: dict,
                dense_decode_lens: torch.Tensor) -> SparseStep:
    """The one constructor of SparseStep (eager steps and CUDA graphs): the host plan's decisions
    with the device tensors of its rows."""
    return SparseStep(
        decode_rows=decode.rows, decode_q_start=decode.q_start, decode_q_lens=decode.q_lens,
        decode_ends=decode.ends, decode_slots=decode.slots, stage_rows=stage_rows, refresh=h.refresh,
        max_middle=h.capacity, **prefill, dense_decode_lens=dense_decode_lens,
        num_dense_decodes=sum(1 for x in h.dense_decode_lens if x), dense_prefill_runs=h.dense_prefill_runs,
        dynamic_rope=h.dynamic_rope, bank_ok=h.bank_ok)
