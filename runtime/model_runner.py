"""ModelRunner: owns the model, the paged KV cache tensors and the CUDA graphs; runs one step.

plan/run split (SPEC §8.5): `prepare` turns the scheduler's chunks into flat tensors and a
`ForwardContext` on the host, once per step; the model's forward only launches kernels. A step
made only of decodes whose batch size has a captured graph copies its inputs into the graph's
static buffers (padding with sentinels: slot -1 writes nothing, context length 0 reads nothing)
and replays it; with InfiniteHiP rows the graph of its refresh pattern, with drop histories
the per-layer-KV graph (runtime/cuda_graphs.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from infhip.runtime import kv_budget
from infhip.runtime.attention.infinitehip import InfiniteHipBackend
from infhip.runtime.attention.sparse_plan import SparseStepHost
from infhip.runtime.attention.paged_kv import PagedKV
from infhip.runtime.cuda_graphs import DECODE_LEN_BUCKETS, DecodeGraphs, GraphKey, len_bucket
from infhip.runtime.engine import KV_DTYPES, LoadedEngine
from infhip.runtime.forward_context import ForwardContext, KVGroupMetadata, LayerKV, compact_slots, forward_context
from infhip.runtime.kv_cache import KVCacheManager
from infhip.runtime.offload.policy import PageMover, offload_spec
from infhip.runtime.offload.staging import PrefillStaging, plan_staging
from infhip.runtime.scheduler import SchedulerOutput
from infhip.runtime.token_drop import DropChunk, DropStats, TokenDropStep, keep_tail, plan_drops


@dataclass
class StepPlan:
    """Host-side inputs of one step, in batch order (decodes first): flat token lists, the prefix
    sums of query rows, and per KV group the cache slot of each new token and each sequence's
    page table."""

    input_ids: list[int]
    positions: list[int]
    cu: list[int]  # [B + 1] query-row prefix sums
    ctx_lens: list[int]  # [B] tokens in the cache after the step
    logits_rows: list[int]  # rows whose logits are sampled
    slots: dict[str, list[int]]
    tables: dict[str, list[list[int]]]  # the cache manager's live page lists (read-only, this step)
    num_decodes: int
    sparse: SparseStepHost | None = None  # InfiniteHiP decisions (engines with such layers)
    drops: list[DropChunk] | None = None  # UniPrefill: the chunks that drop tokens this step
    # Drop histories: [global layer][b] tokens that layer lacks of sequence b's computed ones;
    # None when no sequence of the step has one (every layer then holds every position).
    layer_dropped: list[list[int]] | None = None

    @property
    def has_sparse(self) -> bool:
        s = self.sparse
        return s is not None and bool(s.decode_rows or s.prefill_seqs)


class ModelRunner:
    def __init__(self, engine: LoadedEngine, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, max_decode_steps: int = 1, kv_offload_bytes: int = 0):
        """kv_offload_bytes: host memory for offloaded KV pages (0: none; runtime/offload/policy.py)."""
        self.engine, self.model, self.device = engine, engine.model, engine.device
        cfg, build = engine.config.model, engine.config.build
        self.page_size = build.page_size
        self.max_seq_len = build.max_seq_len
        self.max_pages_per_seq = math.ceil(build.max_seq_len / self.page_size)
        kv_dtype = KV_DTYPES[build.kv_dtype]
        attn_layers = [layer.self_attn for layer in self.model.layers]
        layer_groups = [a.kv_group for a in attn_layers]
        # K and V pages (+ an fp8 cache's float32 scale per token and kv head, plugins/kv_quant.py)
        page_bytes = self.page_size * PagedKV.bytes_per_token(cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        offload = offload_spec(engine.config, kv_offload_bytes, page_bytes, layer_groups.count("global"))
        # staged prefill (runtime/offload/staging.py): two buffers of one sequence's host pages
        staging_pages = min(offload.host_pages, self.max_pages_per_seq) if offload else 0
        budget = kv_cache_memory_bytes or kv_budget.default_budget(
            engine.config, self.device, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization,
            offload is not None, PrefillStaging.bytes_for(staging_pages, page_bytes))
        specs = kv_budget.size_groups(layer_groups, {a.kv_group: a.window for a in attn_layers}, page_bytes,
                                      self.page_size, self.max_seq_len, max_num_seqs, max_num_batched_tokens,
                                      budget, offload)
        self.kv = KVCacheManager(self.page_size, specs, self.max_pages_per_seq)
        for attn in attn_layers:  # + a host twin where the group offloads (plugins/kv_offload.py)
            spec = specs[attn.kv_group]
            attn.kv = PagedKV.allocate(spec.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype,
                                       self.device, host_pages=offload.host_pages if spec.offload is not None else 0)
        self.offload_layers = [a for a in attn_layers if a.kv.host is not None]
        self.staging = PrefillStaging(self.offload_layers, staging_pages, self.device) if offload else None
        self.page_mover = PageMover(self.kv, self.offload_layers, self._tensor)
        self.groups = sorted(specs)

        self.max_num_seqs = max_num_seqs
        self.infinitehip: InfiniteHipBackend | None = None  # the "infinitehip" layers' backend
        self.graphs = None
        self.set_infinitehip(engine.config.plan.infinitehip)

        # UniPrefill token drop (runtime/token_drop.py): anchors are the full-attention layers.
        self.anchors = frozenset(lp.index for lp in engine.config.plan.layers if lp.window is None)
        self.global_layers = sorted(self.anchors)  # the layers that hold compacted KV after a drop
        self.set_token_drop(engine.config.plan.token_drop)
        # Benchmarks only (infhip.eval.common.set_forced_retention): keep this share of the blocks
        # at every anchor instead of top-p; None = top-p (TokenDropConfig.p).
        self.forced_retention: float | None = None
        self.drop_stats = DropStats()  # drop histories of the requests, retention per anchor

        if self.device.type == "cuda" and not enforce_eager:
            sizes = [b for b in build.cuda_graph_batch_sizes if b <= max_num_seqs]
            self.graphs = DecodeGraphs(self, sizes, max_decode_steps)
            self.graphs.capture(self.graph_keys())

    def graph_keys(self) -> list[GraphKey]:
        """Every decode-graph key this runner's plan can replay: the dense graph sized for
        max_seq_len, short-context length buckets, drop histories (token drop), and the
        InfiniteHiP keys (refresh patterns x dynamic RoPE). All are captured at load, none on the
        request path."""
        buckets = [b for b in DECODE_LEN_BUCKETS if b < self.table_tokens]
        drops = self.token_drop is not None and self.graphs is not None and self.graphs.supports_layer_kv
        keys = [GraphKey()] + [GraphKey(len_bucket=b) for b in buckets]
        if drops:
            keys += [GraphKey(layer_kv=True, len_bucket=b) for b in buckets + [None]]
        if self.infinitehip is not None:
            for sparse in self.infinitehip.graph_keys():
                keys.append(GraphKey(sparse=sparse))
                if drops and not sparse.dynamic_rope:  # requests drop tokens only inside the trained window
                    keys.append(GraphKey(sparse=sparse, layer_kv=True))
        return keys

    def set_infinitehip(self, ih) -> None:
        """(Re)configure the InfiniteHiP layers from an InfiniteHipConfig (the engine's, or one
        with runtime knobs changed): a host planner (mask-cache slots, refresh schedule) and, per
        layer, the run side with its mask cache of max_num_seqs slots. Masks cached so far and
        sparse CUDA graphs are dropped: the next sparse decode step recomputes every stage."""
        plan = self.engine.config.plan
        if plan.infinitehip is None:
            if ih is not None:
                raise ValueError("this engine has no InfiniteHiP layers; build it with --preset")
            return
        offload = self.kv.groups["global"].offload if "global" in self.kv.groups else None
        self.kv.clear_prefix_cache()  # pages computed under the old knobs (prefix_caching.md)
        layers = [layer.self_attn for layer in self.model.layers]
        self.infinitehip = InfiniteHipBackend.attach(self.engine.config, ih, layers, self.max_num_seqs, self.device,
                                                     offload)
        if self.graphs is not None:
            self.graphs.drop(lambda key: key.sparse is None)
            self.graphs.capture(self.graph_keys())

    def set_token_drop(self, cfg) -> None:
        """Turn token drop on (a TokenDropConfig) or off (None) from the next step on. With
        InfiniteHiP layers, only requests that stay inside the trained window drop
        (runtime/token_drop.py says why)."""
        if cfg is not None and getattr(self, "offload_layers", None):
            raise ValueError("token drop cannot be turned on while KV pages are offloaded")
        newly_on = cfg is not None and getattr(self, "token_drop", None) is None
        if cfg is not None and self.kv.prefix_caching:  # reuse is not exact with token drop
            self.kv.disable_prefix_caching()  # (docs/design/prefix_caching.md)
        self.token_drop = cfg
        if newly_on and getattr(self, "graphs", None) is not None:
            self.graphs.capture(self.graph_keys())
        self.drop_max_context = (self.engine.config.model.max_position_embeddings
                                 if self.engine.config.plan.infinitehip is not None else None)
        windows = [layer.self_attn.window for layer in self.model.layers]
        self.drop_tail = keep_tail(cfg, windows) if cfg is not None else 0

    # -- plan: host-side, once per step -------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepPlan:
        input_ids, positions, cu, ctx_lens, logits_rows = [], [], [0], [], []
        slots = {g: [] for g in self.groups}
        tables = {g: [] for g in self.groups}
        num_decodes = 0
        for i, ch in enumerate(out.chunks):
            seq = ch.seq
            if ch.num_tokens == 1 and num_decodes == i:
                num_decodes += 1
            if ch.num_tokens == 1 and ch.end == seq.num_tokens:
                input_ids.append(seq.last_token_id)  # decode: no copy of the whole token list
            else:
                input_ids += seq.all_token_ids[ch.start:ch.end]
            positions += range(ch.start, ch.end)
            cu.append(cu[-1] + ch.num_tokens)
            ctx_lens.append(ch.end)
            if ch.needs_logits:
                logits_rows.append(cu[-1] - 1)
            for g in self.groups:
                slots[g] += self.kv.slot_mapping(seq.seq_id, g, ch.start, ch.end)
                tables[g].append(self.kv.page_list(seq.seq_id, g))  # live lists: read within this step
        drops = (plan_drops(out.chunks, self.token_drop, self.drop_tail, self.drop_max_context)
                 if self.token_drop else None)
        for ch in out.chunks:
            if ch.start == 0:  # a prefill from scratch (first or after preemption): no history
                ch.seq.dropped = None
        layer_dropped = None
        if any(ch.seq.dropped is not None for ch in out.chunks):
            layer_dropped = [[ch.seq.dropped[l] if ch.seq.dropped is not None else 0 for ch in out.chunks]
                             for l in self.global_layers]
        return StepPlan(input_ids=input_ids, positions=positions, cu=cu, ctx_lens=ctx_lens,
                        logits_rows=logits_rows, slots=slots, tables=tables, num_decodes=num_decodes,
                        sparse=self._plan_sparse([ch.seq for ch in out.chunks], ctx_lens, num_decodes,
                                                 dense=bool(drops)),
                        drops=drops or None, layer_dropped=layer_dropped)

    def _plan_sparse(self, seqs: list, ctx_lens: list[int], num_decodes: int,
                     dense: bool = False) -> SparseStepHost | None:
        """The step's InfiniteHiP plan; dense=True (a step that drops tokens runs no sparse
        attention): none, and the requests' cached masks are invalidated."""
        if self.infinitehip is None:
            return None
        if dense:
            self.infinitehip.planner.skip(seqs)
            return None
        return self.infinitehip.plan(seqs, ctx_lens, num_decodes)

    def _tensor(self, values, dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _block_tables(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(r) for r in rows))
        padded = [r + [0] * (width - len(r)) for r in rows]
        return self._tensor(padded, torch.int32)

    # -- run ------------------------------------------------------------------------------------
    def _context(self, p: StepPlan) -> ForwardContext:
        sparse = self.infinitehip.to_device(p.sparse, p.cu, p.ctx_lens, self._tensor) if p.has_sparse else None
        if sparse is not None and self.staging is not None and self.staging.enabled and p.sparse.prefill_seqs:
            stage = plan_staging(p.tables["global"], p.sparse.prefill_seqs, self.staging.capacity)
            if stage is not None:
                sparse.staged = self.staging.start(stage, self._block_tables(stage.tables))
        return ForwardContext(
            positions=self._tensor(p.positions, torch.int64),
            context_lens=self._tensor(p.ctx_lens, torch.int32),
            cu_seqlens_q=self._tensor(p.cu, torch.int32),
            num_decodes=p.num_decodes,
            groups={g: KVGroupMetadata(slot_mapping=self._tensor(p.slots[g], torch.int64),
                                       block_tables=self._block_tables(p.tables[g]))
                    for g in self.groups},
            cu_seqlens_q_list=p.cu, context_lens_list=p.ctx_lens,
            sparse=sparse,
            token_drop=TokenDropStep(self.token_drop, p.drops, self.anchors, self.drop_tail,
                                     self.forced_retention) if p.drops else None,
            layer_kv=self._layer_kv(p) if p.layer_dropped is not None else None,
            decode_len_bound=self.decode_len_bound(p) if p.num_decodes else None)

    def decode_len_bound(self, p: StepPlan) -> int:
        """The bound that sizes dense decode's split count: the step's length bucket, else the
        table width — the same for an eager step and the graph that would replay it
        (DecodeGraphs._context), so both split (and round) alike."""
        return self._len_bucket(p) or self.table_tokens

    @property
    def table_tokens(self) -> int:
        """Tokens a block-table row can address (max_seq_len rounded up to whole pages)."""
        return self.max_pages_per_seq * self.page_size

    def _len_bucket(self, p: StepPlan) -> int | None:
        """The short-context bucket of a step's decode rows (None: sparse rows, too long, or a
        bucket no shorter than the block-table width: the start-up graphs are that bound)."""
        if p.has_sparse or not p.num_decodes:
            return None
        bucket = len_bucket(max(p.ctx_lens[:p.num_decodes]))
        return bucket if bucket is not None and bucket < self.table_tokens else None

    def _layer_kv(self, p: StepPlan) -> LayerKV:
        """Per-layer context lengths and compact slots of the global layers (drop histories):
        token at position q of sequence b goes to compact slot q - dropped[l][b] of b's table."""
        dropped = self._tensor(p.layer_dropped, torch.int64)  # [Lg, B]
        lens = torch.tensor(p.cu[1:]) - torch.tensor(p.cu[:-1])
        seq_of_row = self._tensor(torch.repeat_interleave(torch.arange(len(p.ctx_lens)), lens).tolist(), torch.int64)
        slots = compact_slots(self._tensor(p.positions, torch.int64), seq_of_row, dropped,
                              self._block_tables(p.tables["global"]).long(), self.page_size)
        ctx_lens = [[c - d for c, d in zip(p.ctx_lens, row)] for row in p.layer_dropped]
        return LayerKV(rows={l: i for i, l in enumerate(self.global_layers)}, slot_mapping=slots,
                       context_lens=self._tensor(ctx_lens, torch.int32), context_lens_list=ctx_lens)

    def _uses_graph(self, p: StepPlan, num_seqs: int) -> bool:
        """A pure decode step replays a captured graph: the dense graph of its batch size, or a
        graph keyed by its sparse key (InfiniteHiP rows, all sparse and refreshing alike) and/or
        by drop histories (per-layer KV lengths computed in the graph)."""
        if self.graphs is None or p.num_decodes != num_seqs or not self.graphs.fits(num_seqs):
            return False
        if p.layer_dropped is not None and not self.graphs.supports_layer_kv:
            return False
        return not p.has_sparse or p.sparse.graph_key is not None

    def _graph_key(self, p: StepPlan) -> GraphKey:
        return GraphKey(sparse=p.sparse.graph_key if p.has_sparse else None, layer_kv=p.layer_dropped is not None,
                        len_bucket=self._len_bucket(p))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns fp32 logits [num chunks with needs_logits, vocab] in chunk order."""
        p = self.prepare(out)
        if self._uses_graph(p, len(out.chunks)):
            bs = self.graphs.load([p])
            # a decode chunk always samples
            logits = self.graphs.replay(0, bs, len(out.chunks), key=self._graph_key(p))
        else:
            with forward_context(self._context(p)) as ctx:
                hidden = self.model(self._tensor(p.input_ids, torch.int64))
            if ctx.token_drop is not None:
                self.drop_stats.record([ch.seq for ch in out.chunks], ctx.token_drop, len(self.model.layers))
            logits = self.model.compute_logits(hidden[self._tensor(p.logits_rows, torch.int64)])
        self.page_mover.move((ch.seq, ch.end) for ch in out.chunks)
        return logits

    @torch.inference_mode()
    def execute_decode_steps(self, out: SchedulerOutput, num_steps: int, sample) -> list[torch.Tensor]:
        """Run `num_steps` decode steps of the pure-decode batch `out` with no host sync between
        them: step j + 1 feeds on step j's sampled tokens, which stay on the device. The caller
        has allocated KV pages for all steps. `sample(logits [B, V]) -> tokens [B]` (device).
        Returns each step's sampled tokens."""
        plans = [self.prepare(out)]
        starts = [ch.start for ch in out.chunks]
        seqs = [ch.seq for ch in out.chunks]
        for j in range(1, num_steps):  # the same batch, one position further per step
            slots = {g: [self.kv.slot_mapping(ch.seq.seq_id, g, s + j, s + j + 1)[0]
                         for ch, s in zip(out.chunks, starts)] for g in self.groups}
            ctx_lens = [s + j + 1 for s in starts]
            plans.append(dataclasses.replace(plans[0], positions=[s + j for s in starts], ctx_lens=ctx_lens,
                                             slots=slots, sparse=self._plan_sparse(seqs, ctx_lens, len(seqs))))
        n, tokens = len(out.chunks), []
        if all(self._uses_graph(p, n) for p in plans):
            bs = self.graphs.load(plans)
            for j in range(num_steps):
                logits = self.graphs.replay(j, bs, n, tokens[-1] if tokens else None, key=self._graph_key(plans[j]))
                tokens.append(sample(logits))
        else:
            for j, p in enumerate(plans):
                input_ids = tokens[-1] if tokens else self._tensor(p.input_ids, torch.int64)
                with forward_context(self._context(p)):
                    tokens.append(sample(self.model.compute_logits(self.model(input_ids))))
        self.page_mover.move((seq, ctx) for seq, ctx in zip(seqs, plans[-1].ctx_lens))
        return tokens
