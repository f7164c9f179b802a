"""CUDA graphs for decode steps of a fixed list of batch sizes.

Buffers are allocated once at the largest size; graphs are captured largest first into one
memory pool at load (SPEC §8.6). A decode step of B sequences replays the smallest
captured size >= B; rows B.. are padding: slot -1 (the cache write skips it), context length 0
(attention reads nothing), token 0 and the scratch mask-cache slot.

Every graph is captured at load (``capture_planned``: the keys of ``planned_keys``), none on the
request path; a key nobody listed is still captured when first needed, with a warning, and
counted in ``report["on_request"]``. A key is a GraphKey (length bucket, per-layer KV shift, each
attention backend's key); GraphKey() is the dense graph sized for max_seq_len:

- Steps with rows of a registered attention backend (runtime/attention/backend.py) replay the
  graph of the backend's ``graph_key`` of the step (None: the step runs eagerly); the backend
  lists the keys captured at load (``graph_keys``), the per-step rows its graphs read
  (``graph_rows``: their padding values; ``graph_fill`` writes a step's) and builds the meta a
  graph reads from them (``graph_state``, ``graph_meta``). E.g. InfiniteHiP's key is the refresh
  pattern, the candidate capacity and the RoPE mode; its per-step row, each row's mask-cache
  slot (padding rows point at the scratch slot, which nothing reads).
- Decode steps whose step transforms shift per-layer KV (runtime/step_transform.py kv_shift:
  e.g. requests with a UniPrefill drop history, whose full-attention layers hold only their
  kept keys): each global layer's context lengths and compact KV slots are computed inside the
  graph from the per-layer shifts, which travel with the other per-step rows; the transform
  wraps them in its step object (graph_step).
- Short contexts: the dense decode kernel's split count is fixed at capture from the
  block-table width (max_seq_len), which for a few hundred tokens means dozens of idle splits
  and a merge kernel. Decode steps whose contexts are all <= a bucket of DECODE_LEN_BUCKETS
  replay a graph captured with that bound (fewer splits; one and no merge up to 512 tokens;
  plugins/plan_rules.py, which the dense plugin's AOT enumeration reads too).

All graphs share one memory pool and write their logits into one shared buffer.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Hashable

import torch

from infhip.plugins.plan_rules import DECODE_LEN_BUCKETS, len_bucket
from infhip.runtime.forward_context import ForwardContext, KVGroupMetadata, LayerKV, compact_slots, forward_context
from infhip.runtime.linear_state import RecurrentMeta

__all__ = ["DECODE_LEN_BUCKETS", "DecodeGraphs", "GraphKey", "GraphShape", "decode_len_bound", "len_bucket",
           "step_len_bucket"]

log = logging.getLogger("infhip.graphs")


@dataclass(frozen=True)
class GraphKey:
    """Which graph a pure decode step of a batch size replays. GraphKey(): the dense graph sized
    for the block-table width (every context up to max_seq_len)."""

    # (name, key) of each attention backend with rows in the step, in registration order
    backends: tuple[tuple[str, Hashable], ...] = ()
    # the step transform whose per-layer KV shift (StepTransform.kv_shift) the graph carries and
    # computes each full-attention layer's lengths and slots from, None: every layer holds every key
    kv_shift: str | None = None
    len_bucket: int | None = None  # dense rows all <= this bucket (fewer decode splits)

    def of(self, name: str):
        """Backend ``name``'s key, None when the step has no row of it."""
        return dict(self.backends).get(name)


def step_len_bucket(p, table_tokens: int) -> int | None:
    """A StepPlan's short-context bucket (StepPlan.len_bucket, which the eager steps use too)."""
    return p.len_bucket(table_tokens)


def decode_len_bound(p, table_tokens: int) -> int:
    """The bound that sizes dense decode's split count for a StepPlan (StepPlan.decode_len_bound)."""
    return p.decode_len_bound(table_tokens)


@dataclass(frozen=True)
class GraphShape:
    """What the graphs' static buffers are sized by (the runner's KV layout)."""

    device: torch.device
    groups: tuple[str, ...]  # KV groups, sorted
    global_layers: tuple[int, ...]  # the full-attention layers (per-layer KV shifts)
    page_size: int
    max_pages_per_seq: int  # block-table width
    table_tokens: int  # tokens a block-table row addresses
    # linear-attention layers' scratch state slot (runtime/linear_state.py), which padding rows
    # use; None: the model has no such layers (no slot row)
    recurrent_scratch: int | None = None


class DecodeGraphs:
    def __init__(self, model, backends: dict, transforms: dict, shape: GraphShape, batch_sizes: list[int],
                 max_steps: int = 1):
        """model: the CausalLM; backends / transforms: the runner's attached attention backends
        and step transforms by name (live dicts: set_backend replaces entries)."""
        self.model, self.backends, self.transforms, self.shape = model, backends, transforms, shape
        self.sizes = sorted(set(batch_sizes))
        max_bs, dev = self.sizes[-1], shape.device
        self.groups = list(shape.groups)
        # The inputs of up to max_steps decode steps travel in one pinned int64 block, one
        # host-to-device copy: per step, rows = input_ids, positions, context_lens, each
        # backend's graph_rows, one KV slot row per group, then per full-attention layer the
        # keys it lacks (a transform's kv_shift). Before each replay the step's rows are
        # copied (on the device) into `rows`, which the graphs read.
        self.global_layers = list(shape.global_layers) if "global" in self.groups else []
        self.backend_rows: dict[str, slice] = {}
        row = 3
        for name, backend in backends.items():
            self.backend_rows[name] = slice(row, row + len(backend.graph_rows))
            row += len(backend.graph_rows)
        self.slot_row = row
        self.shift_row = self.slot_row + len(self.groups)
        # then, with linear-attention layers, one row of recurrent-state slots
        self.recurrent_row = self.shift_row + len(self.global_layers)
        num_rows = self.recurrent_row + (shape.recurrent_scratch is not None)
        self.host_steps = torch.zeros((max_steps, num_rows, max_bs), dtype=torch.int64).pin_memory()
        self.host_steps_np = self.host_steps.numpy()
        self.steps = torch.zeros_like(self.host_steps, device=dev)
        self.rows = torch.zeros((num_rows, max_bs), dtype=torch.int64, device=dev)
        self._pad_rows(self.rows)  # rows never used write nothing (also while capturing)
        self.input_ids, self.positions = self.rows[0], self.rows[1]
        self.slots = {g: self.rows[self.slot_row + i] for i, g in enumerate(self.groups)}
        # The attention kernels want int32 lengths: converted on the device inside the graph.
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.host_tables = torch.zeros((len(self.groups), max_bs, shape.max_pages_per_seq),
                                       dtype=torch.int32).pin_memory()
        self.host_tables_np = self.host_tables.numpy()
        self.tables = {g: torch.zeros(max_bs, shape.max_pages_per_seq, dtype=torch.int32, device=dev)
                       for g in self.groups}
        # per group and row: (the page list last staged there, how many of its entries)
        self._staged = [[(None, 0)] * max_bs for _ in self.groups]
        # every graph, per (batch size, key); all write their logits into one [max_bs, vocab] buffer
        self.graphs: dict[tuple[int, GraphKey], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None
        self.pool = None
        self.arange = torch.arange(max_bs, dtype=torch.int64, device=dev)
        num_global = len(self.global_layers)
        self.layer_slots = torch.full((num_global, max_bs), -1, dtype=torch.int64, device=dev)
        self.layer_ctx = torch.zeros((num_global, max_bs), dtype=torch.int32, device=dev)
        self.layer_shift = torch.zeros((num_global, max_bs), dtype=torch.int32, device=dev)
        # each backend's graph state (its constant buffers, views of its rows)
        self.states = {name: backend.graph_state(max_bs, self.rows[self.backend_rows[name]])
                       for name, backend in backends.items()}
        # captured at load (graphs, seconds, pool bytes) and on the request path (should stay 0)
        self.report = {"graphs": 0, "seconds": 0.0, "pool_bytes": 0, "on_request": 0}

    def _pad_rows(self, rows) -> None:
        """Padding values of a [num_rows, n] block: token 0 at position 0, no context, each
        backend's padding (graph_rows), no KV write."""
        rows[0:3] = 0
        for name, backend in self.backends.items():
            for r, pad in zip(range(self.backend_rows[name].start, self.backend_rows[name].stop), backend.graph_rows):
                rows[r] = pad
        rows[self.slot_row:self.shift_row] = -1
        rows[self.shift_row:self.recurrent_row] = 0
        if self.shape.recurrent_scratch is not None:
            rows[self.recurrent_row] = self.shape.recurrent_scratch

    def _context(self, bs: int, key: GraphKey) -> ForwardContext:
        """The forward context a graph of (bs, key) captures: views of the static buffers."""
        def meta(name, k):
            return lambda ctx: self.backends[name].graph_meta(k, bs, self.states[name], ctx)

        steps = {}
        if key.kv_shift is not None:
            layer_kv = LayerKV(rows={l: i for i, l in enumerate(self.global_layers)},
                               slot_mapping=self.layer_slots[:, :bs], context_lens=self.layer_ctx[:, :bs],
                               context_lens_list=[[0] * bs] * len(self.global_layers),
                               key_shift=self.layer_shift[:, :bs])
            steps[key.kv_shift] = lambda ctx: self.transforms[key.kv_shift].graph_step(layer_kv)
        return ForwardContext.of_step(
            {name: meta(name, k) for name, k in key.backends}, steps,
            positions=self.positions[:bs], context_lens=self.context_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[:bs + 1], num_decodes=bs,
            groups={g: KVGroupMetadata(self.slots[g][:bs], self.tables[g][:bs]) for g in self.slots},
            cu_seqlens_q_list=list(range(bs + 1)), context_lens_list=[0] * bs,
            decode_len_bound=key.len_bucket or self.shape.table_tokens,
            recurrent=None if self.shape.recurrent_scratch is None else RecurrentMeta(self.rows[self.recurrent_row, :bs]))

    def _forward(self, bs: int, kv_shift: str | None = None) -> torch.Tensor:
        self.context_lens[:bs].copy_(self.rows[2, :bs])
        if kv_shift is not None:  # each global layer's compact slots and lengths (padding rows write nothing)
            shift = self.rows[self.shift_row:self.recurrent_row, :bs]  # [Lg, bs]
            slots = compact_slots(self.positions[:bs], self.arange[:bs], shift,
                                  self.tables["global"][:bs].long(), self.shape.page_size)
            self.layer_slots[:, :bs].copy_(torch.where(self.slots["global"][None, :bs] < 0, -1, slots))
            self.layer_ctx[:, :bs].copy_(self.rows[2, :bs][None, :] - shift)
            self.layer_shift[:, :bs].copy_(shift)
        model = self.model
        return model.compute_logits(model(self.input_ids[:bs]))

    def capture(self, keys: list[GraphKey]) -> None:
        """Capture (at load) the graph of every (batch size, key) not captured yet, largest batch
        first into one memory pool; adds to ``report`` (count, seconds, pool bytes)."""
        t0 = time.perf_counter()
        todo = [(bs, key) for key in keys for bs in reversed(self.sizes) if (bs, key) not in self.graphs]
        warmed = set()
        for bs, key in todo:
            # one warm-up per batch size and kind of step (its kernels load outside any capture)
            kind = (bs, tuple((name, self.backends[name].graph_warm_kind(k)) for name, k in key.backends),
                    key.kv_shift, key.len_bucket)
            self._capture(bs, key, warm_up=kind not in warmed)
            warmed.add(kind)
        torch.cuda.synchronize()
        self.report["graphs"] += len(todo)
        self.report["seconds"] += time.perf_counter() - t0
        self.report["pool_bytes"] = _pool_bytes(self.pool)

    def drop(self, keep) -> None:
        """Forget the graphs whose key fails ``keep(key)`` (their memory stays in the pool)."""
        self.graphs = {k: g for k, g in self.graphs.items() if keep(k[1])}

    @torch.inference_mode()
    def _capture(self, bs: int, key: GraphKey, warm_up: bool = True) -> torch.cuda.CUDAGraph:
        """Capture the graph (bs, key) with padding inputs (the warm-up writes no KV and only the
        scratch mask slot); the caller stages the real inputs afterwards."""
        self._pad_rows(self.rows)
        with forward_context(self._context(bs, key)):
            logits = self._forward(bs, key.kv_shift) if warm_up or self.logits is None else None
            if self.logits is None:
                self.logits = torch.empty((self.sizes[-1], logits.shape[1]), dtype=logits.dtype, device=logits.device)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[:bs].copy_(self._forward(bs, key.kv_shift))
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(bs, key)] = graph
        return graph

    def _capture_on_request(self, bs: int, key: GraphKey) -> torch.cuda.CUDAGraph:
        """A key planned_keys did not list at load: captured now, said once."""
        log.warning("capturing a decode graph on the request path (batch %d, key %s): "
                    "DecodeGraphs.planned_keys did not list it", bs, key)
        self.report["on_request"] += 1
        return self._capture(bs, key)

    def planned_keys(self) -> list[GraphKey]:
        """Every key the runner's plan can replay: the dense graph sized for max_seq_len,
        short-context length buckets, per-layer KV shifts (each transform that shifts_kv, e.g.
        token drop on), and each combination of the backends' keys (graph_keys), with the shifts
        where every backend's key allows them (graph_keys(layer_kv=True)). All are captured at
        load, none on the request path."""
        buckets = [b for b in DECODE_LEN_BUCKETS if b < self.shape.table_tokens]
        shifts = [name for name, t in self.transforms.items() if t.shifts_kv] if self.supports_layer_kv else []
        keys = [GraphKey()] + [GraphKey(len_bucket=b) for b in buckets]
        for name in shifts:
            keys += [GraphKey(kv_shift=name, len_bucket=b) for b in buckets + [None]]
        names = list(self.backends)
        with_shift = {name: set(self.backends[name].graph_keys(layer_kv=True)) for name in names}
        for combo in itertools.product(*([None] + self.backends[n].graph_keys() for n in names)):
            if all(k is None for k in combo):
                continue
            backends = tuple((n, k) for n, k in zip(names, combo) if k is not None)
            keys.append(GraphKey(backends=backends))
            if all(k in with_shift[n] for n, k in backends):
                keys += [GraphKey(backends=backends, kv_shift=name) for name in shifts]
        return keys

    def capture_planned(self) -> None:
        self.capture(self.planned_keys())

    @property
    def supports_layer_kv(self) -> bool:
        return bool(self.global_layers)

    def replays(self, p, num_seqs: int) -> bool:
        """Whether StepPlan p (num_seqs sequences) replays a graph: a pure decode step, of a
        captured batch size, whose backends all give it a graph key, and/or with a per-layer KV
        shift (per-layer KV lengths computed in the graph)."""
        if p.num_decodes != num_seqs or num_seqs > self.sizes[-1]:
            return False
        if self._shift(p)[0] is not None and not self.supports_layer_kv:
            return False
        backends = self.backends
        return all(backends[name].graph_key(h) is not None for name, h in p.backends.items())

    def _shift(self, p) -> tuple[str | None, list[list[int]] | None]:
        """(the transform, [global layer][b] keys each layer lacks) of StepPlan p's per-layer KV
        shift (a transform's kv_shift), or (None, None)."""
        transforms = self.transforms
        return next(((name, s) for name, h in p.transforms.items() if (s := transforms[name].kv_shift(h)) is not None),
                    (None, None))

    def key_of(self, p) -> GraphKey:
        """The key of the graph StepPlan p replays."""
        backends = self.backends
        return GraphKey(backends=tuple((name, backends[name].graph_key(h)) for name, h in p.backends.items()),
                        kv_shift=self._shift(p)[0], len_bucket=step_len_bucket(p, self.shape.table_tokens))

    def load(self, plans: list) -> int:
        """Stage the host-planned inputs of len(plans) consecutive decode steps of one batch (step
        j > 0 takes its input tokens from the device, see `replay`); returns the padded batch size."""
        n = len(plans[0].positions)
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        for j, p in enumerate(plans):
            rows = self.host_steps_np[j]
            if j == 0:
                rows[0, :n] = p.input_ids
            rows[1, :n], rows[2, :n] = p.positions, p.ctx_lens
            for name, h in p.backends.items():  # a backend without rows: no graph of the step reads its rows
                self.backends[name].graph_fill(h, rows[self.backend_rows[name]])
            for i, g in enumerate(self.groups):
                rows[self.slot_row + i, :n] = p.slots[g]
            shift = self._shift(p)[1]
            rows[self.shift_row:self.recurrent_row, :n] = shift if shift is not None else 0
            if p.recurrent_slots is not None:
                rows[self.recurrent_row, :n] = p.recurrent_slots
            self._pad_rows(rows[:, n:bs])
        k = len(plans)
        # Whole contiguous blocks (a few KB): a strided pinned copy could be staged through pageable memory.
        self.steps[:k].copy_(self.host_steps[:k], non_blocking=True)
        for i, g in enumerate(self.groups):
            # The last step's tables cover every step (pages were allocated for all of them);
            # entries past a row's length are never read (context_lens bounds the kernel). Only
            # entries new since the row was last staged are written: a 512K-token table has 32K
            # entries, and re-writing them all cost ~1 ms of host time per step. (Entries that
            # were released to 0 keep their old page: they lie before a sliding window and are
            # never read.)
            table_rows, staged = plans[-1].tables[g], self._staged[i]
            for b, r in enumerate(table_rows):
                prev, done = staged[b]
                start = done if prev is r and done <= len(r) else 0
                if start < len(r):
                    self.host_tables_np[i, b, start:len(r)] = r[start:]
                staged[b] = (r, len(r))
            self.tables[g][:n].copy_(self.host_tables[i, :n], non_blocking=True)
        return bs

    def replay(self, step: int, bs: int, n: int, input_ids: torch.Tensor | None = None,
               key: GraphKey = GraphKey()) -> torch.Tensor:
        """Replay staged step `step` (input_ids: the previous step's sampled tokens [n], on the
        device, for step > 0) with the graph of (bs, key); returns logits [n, vocab] (a view of
        the shared buffer: valid until the next replay)."""
        graph = self.graphs.get((bs, key)) or self._capture_on_request(bs, key)
        logits = self.logits
        self._stage(step, bs, n, input_ids)
        graph.replay()
        return logits[:n]

    @torch.inference_mode()
    def run_eagerly(self, step: int, bs: int, n: int, input_ids: torch.Tensor | None = None,
                    key: GraphKey = GraphKey()) -> torch.Tensor:
        """What ``replay`` computes, without a CUDA graph: stages step ``step`` into the same static
        buffers and runs the model eagerly on the context the graph of (bs, key) captures. Its
        tokens equal an eager step's exactly when staging (load, graph_fill, padding) and the
        backends' graph metadata are right: the CPU check of the graph path (tests/_graph_sim.py)."""
        self._stage(step, bs, n, input_ids)
        with forward_context(self._context(bs, key)):
            return self._forward(bs, key.kv_shift)[:n]

    def _stage(self, step: int, bs: int, n: int, input_ids: torch.Tensor | None) -> None:
        self.rows[:, :bs].copy_(self.steps[step, :, :bs])
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids)


def _pool_bytes(pool) -> int:
    """Bytes reserved by the graphs' private memory pool (0 if unknown)."""
    try:
        stats = torch.cuda.memory.memory_snapshot()
    except RuntimeError:
        return 0
    return sum(seg["total_size"] for seg in stats if tuple(seg.get("segment_pool_id", ())) == tuple(pool or ()))
