"""ModelRunner: owns the model, the paged KV cache tensors and the CUDA graphs; runs one step.

plan/run split (SPEC §8.5): `prepare` turns the scheduler's chunks into a StepPlan on the host
(runtime/step_plan.py), once per step, and `_context` uploads it into a ForwardContext; the
model's forward only launches kernels. KV memory is sized and allocated at load by
runtime/kv_budget.py; pages are handed out by the scheduler (KVCacheManager), never here. A step
made only of decodes whose batch size has a captured graph copies its inputs into the graph's
static buffers (padding with sentinels: slot -1 writes nothing, context length 0 reads nothing)
and replays it; keyed by the registered backends' graph keys (runtime/attention/backend.py) and,
with per-layer KV shifts, the transform's (runtime/cuda_graphs.py). The runner names no attention
backend and no step transform: it attaches every registered backend whose knobs the engine's plan
has and every registered transform (runtime/step_transform.py), and loops over them.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from infhip.runtime import kv_budget
from infhip.runtime.attention import AttachEnv, AttentionBackend, Limits, backend_class, backends
from infhip.runtime.cuda_graphs import DecodeGraphs, GraphShape
from infhip.runtime.engine import LoadedEngine
from infhip.runtime.forward_context import ForwardContext, KVGroupMetadata, forward_context, upload, upload_tables
from infhip.runtime.kv_cache import KVCacheManager
from infhip.runtime.linear_state import RecurrentMeta, RecurrentState
from infhip.runtime.offload.policy import PageMover
from infhip.runtime.offload.staging import PrefillStaging
from infhip.runtime.scheduler import SchedulerOutput
from infhip.runtime.step_plan import StepPlan
from infhip.runtime.step_transform import StepTransform, TransformEnv, TransformStep, transforms


class ModelRunner:
    def __init__(self, engine: LoadedEngine, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, max_decode_steps: int = 1, kv_offload_bytes: int = 0):
        """kv_offload_bytes: host memory for offloaded KV pages (0: none; runtime/offload/policy.py)."""
        self.engine, self.model, self.device = engine, engine.model, engine.device
        # Tensor parallelism (runtime/distributed/): rank 0 publishes each step's plan to the
        # other ranks, which run forward_plan / run_decode_plans on it; SINGLE: a no-op.
        self.tp = engine.tp
        if engine.config.build.tp != self.tp.size:
            raise ValueError(f"this engine is tensor-parallel (tp {engine.config.build.tp}): load it with "
                             "LLM(engine), which starts its ranks")
        build = engine.config.build
        self.page_size, self.max_seq_len, self.max_num_seqs = build.page_size, build.max_seq_len, max_num_seqs
        self.max_pages_per_seq = math.ceil(build.max_seq_len / self.page_size)
        self.table_tokens = self.max_pages_per_seq * self.page_size  # tokens a block-table row addresses
        # linear-attention layers (Qwen3-Next) keep a recurrent state per sequence instead of KV
        # pages (runtime/linear_state.py): allocated first, so the KV budget sees it used
        self.recurrent = self._recurrent_state(engine, max_num_seqs)
        attn_layers = self._attention_layers()
        layout = kv_budget.plan_layout(engine, attn_layers, max_num_seqs, max_num_batched_tokens,
                                       kv_cache_memory_bytes, gpu_memory_utilization, kv_offload_bytes,
                                       self.max_pages_per_seq)
        if self.tp.size > 1:  # every rank must hold the page ids rank 0's cache manager hands out
            pages = self.tp.agree_min([layout.specs[g].num_pages for g in sorted(layout.specs)])
            layout.specs = {g: dataclasses.replace(layout.specs[g], num_pages=n)
                            for g, n in zip(sorted(layout.specs), pages)}
        self.kv = KVCacheManager(self.page_size, layout.specs, self.max_pages_per_seq)
        if self.recurrent is not None:
            self.kv.refuse_prefix_caching = (
                "prefix caching is off for this engine: its linear-attention layers keep a recurrent state per "
                "sequence that cached KV pages do not hold, so a reused prefix would be inexact")
        self.offload_layers = kv_budget.allocate_layers(attn_layers, layout, self.page_size, self.device)
        self.staging = (PrefillStaging(self.offload_layers, layout.staging_pages, self.device)
                        if layout.offload else None)
        # KV offloading is chosen at load: without host pools no mover exists and no step plans moves
        self.page_mover = PageMover(self.kv, self.offload_layers, self._tensor) if self.offload_layers else None
        self.groups = sorted(layout.specs)

        # name -> the attached backend of each registered one the engine's plan uses, in
        # registration order (runtime/attention/backend.py)
        self.backends: dict[str, AttentionBackend] = {}
        self.graphs = None
        for cls in backends():
            knobs = cls.knobs_of(engine.config)
            if knobs is not None:
                self.set_backend(cls.name, knobs)

        # name -> every registered step transform (runtime/step_transform.py), attached at load
        # under the engine's knobs; `stepping`: those on the step path, each that has been on (and
        # stays: what it did under earlier knobs must be honoured, token drop's drop histories).
        # One never on is not called per step or per request (docs/design/request_path.md).
        self.transforms: dict[str, StepTransform] = {}
        self.stepping: dict[str, StepTransform] = {}
        for cls in transforms():
            self.transforms[cls.name] = cls.attach(engine.config)
            self.set_transform(cls.name, cls.knobs_of(engine.config))
        # the full-attention layers: those a transform may leave holding fewer keys (per-layer KV)
        self.global_layers = [lp.index for lp in engine.config.plan.layers
                              if lp.window is None and lp.attention != "linear"]
        self.hidden_out: torch.Tensor | None = None  # execute(hidden_rows=...)'s kept hidden states

        if self.device.type == "cuda" and not enforce_eager:
            self.graphs = self.make_graphs([b for b in build.cuda_graph_batch_sizes if b <= max_num_seqs],
                                           max_decode_steps)
            self.graphs.capture_planned()
        self.loaded = True  # from now on set_backend / set_transform reach every TP rank

    def _attention_layers(self) -> list:
        """The attention modules of the layers that have one (not the linear-attention layers)."""
        return [layer.self_attn for layer in self.model.layers if hasattr(layer, "self_attn")]

    def _recurrent_state(self, engine: LoadedEngine, max_num_seqs: int) -> RecurrentState | None:
        """The linear layers' state slots, given to each of those layers; None without any."""
        cfg = engine.config.model
        if cfg.linear_attention is None:
            return None
        state = RecurrentState(cfg, max_num_seqs, self.model.embed_tokens.weight.dtype, self.device)
        for layer in self.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.state = state
        return state

    def make_graphs(self, batch_sizes: list[int], max_steps: int = 1) -> DecodeGraphs:
        """A DecodeGraphs over this runner's model, backends, transforms and KV layout (none captured)."""
        shape = GraphShape(self.device, tuple(self.groups), tuple(self.global_layers), self.page_size,
                           self.max_pages_per_seq, self.table_tokens,
                           self.recurrent.scratch if self.recurrent is not None else None)
        return DecodeGraphs(self.model, self.backends, self.transforms, shape, batch_sizes, max_steps)

    def _mirror(self, kind: str, *args) -> None:
        """Tensor parallelism: a change to a loaded runner (benchmarks re-plan live runners) is
        published to the other ranks, which make it too (runtime/distributed/worker.py)."""
        if getattr(self, "loaded", False):
            self.tp.publish(kind, *args)

    def set_backend(self, name: str, knobs) -> None:
        """(Re)attach the registered backend ``name`` under ``knobs`` (the engine's, or with
        runtime knobs changed): its host planner and per-layer state
        are made anew, so its cached state and CUDA graphs are dropped (the prefix cache too:
        pages computed under the old knobs, prefix_caching.md)."""
        cls = backend_class(name)
        if cls.knobs_of(self.engine.config) is None:
            if knobs is not None:
                raise ValueError(f"this engine has no {name} layers; build it with --preset")
            return
        self._mirror("set_backend", name, knobs)
        offload = self.kv.groups["global"].offload if "global" in self.kv.groups else None
        self.kv.clear_prefix_cache()
        env = AttachEnv(Limits(self.max_num_seqs, offload is not None), self.device, offload, self.staging)
        layers = self._attention_layers()
        self.backends[name] = cls.attach(self.engine.config, knobs, layers, env)
        if self.graphs is not None:
            self.graphs.drop(lambda key: key.of(name) is None)
            self.graphs.capture_planned()

    def set_transform(self, name: str, knobs) -> None:
        """Set the registered step transform ``name``'s knobs (None: off) from the next step on,
        on every TP rank (token drop: ``set_transform("token_drop", TokenDropConfig | None)``). A
        transform that may now shift per-layer KV (``shifts_kv``) turns prefix caching off
        (running requests may hold shared pages and would compact over them,
        docs/design/prefix_caching.md) and gets its decode graphs captured."""
        t = self.transforms.get(name)
        if t is None:
            raise KeyError(f"no step transform {name!r}; registered: {list(self.transforms)}")
        shifted = t.shifts_kv
        t.configure(knobs, TransformEnv(self.engine.config, self.backends, bool(self.offload_layers)))
        self._mirror("set_transform", name, knobs)
        if knobs is not None and name not in self.stepping:  # registration order, as the layer loop calls them
            self.stepping = {n: x for n, x in self.transforms.items() if n in self.stepping or n == name}
        if t.shifts_kv and self.kv.prefix_caching:
            self.kv.disable_prefix_caching()
        if t.shifts_kv and not shifted and self.graphs is not None:
            self.graphs.capture_planned()

    # -- plan: host-side, once per step -------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepPlan:
        p = StepPlan.of_chunks(out.chunks, self.kv, self.groups)
        if self.recurrent is not None:
            p.recurrent_slots = self.recurrent.plan(out.chunks)
        hosts = {name: t.plan(p, out.chunks) for name, t in self.stepping.items()}
        p.transforms = {name: h for name, h in hosts.items() if h is not None}
        dense = any(self.transforms[name].runs_dense(h) for name, h in p.transforms.items())
        p.backends = self._plan_backends(p, [ch.seq for ch in out.chunks], dense=dense)
        return p

    def _plan_backends(self, p: StepPlan, seqs: list, dense: bool = False) -> dict:
        """Each backend's host meta of step p (those with rows in it); dense=True (a step that
        transform runs its layers densely): none, and the backends are told (skip)."""
        if dense:
            for b in self.backends.values():
                b.skip(seqs)
            return {}
        hosts = {name: b.plan(p, seqs) for name, b in self.backends.items()}
        return {name: h for name, h in hosts.items() if h is not None}

    def _tensor(self, values, dtype) -> torch.Tensor:
        return upload(values, dtype, self.device)

    # -- run ------------------------------------------------------------------------------------
    def _context(self, p: StepPlan) -> ForwardContext:
        tables = {g: upload_tables(p.tables[g], self.device) for g in self.groups}

        def meta(name, host):
            return lambda ctx: self.backends[name].upload(host, p)

        def step(name, host):
            return lambda ctx: self.transforms[name].upload(host, p, ctx)

        return ForwardContext.of_step(
            {name: meta(name, h) for name, h in p.backends.items()},
            {name: step(name, h) for name, h in p.transforms.items()},
            positions=self._tensor(p.positions, torch.int64),
            context_lens=self._tensor(p.ctx_lens, torch.int32),
            cu_seqlens_q=self._tensor(p.cu, torch.int32),
            num_decodes=p.num_decodes,
            groups={g: KVGroupMetadata(self._tensor(p.slots[g], torch.int64), tables[g]) for g in self.groups},
            cu_seqlens_q_list=p.cu, context_lens_list=p.ctx_lens,
            decode_len_bound=p.decode_len_bound(self.table_tokens) if p.num_decodes else None,
            recurrent=None if p.recurrent_slots is None else RecurrentMeta(
                self._tensor(p.recurrent_slots, torch.int64), p.recurrent_slots))

    def _uses_graph(self, p: StepPlan, num_seqs: int) -> bool:
        return self.graphs is not None and self.graphs.replays(p, num_seqs)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, hidden_rows: list[int] | None = None) -> torch.Tensor:
        """Run one step; returns fp32 logits [num chunks with needs_logits, vocab] in chunk order.
        hidden_rows: rows of the step's flat token list whose final hidden states are kept in
        ``self.hidden_out`` [len(rows), hidden] (prompt logprobs; eager steps only: rows of a
        prefill chunk of 2+ tokens, which never replays a decode graph)."""
        p = self.prepare(out)
        p.hidden_rows = hidden_rows or None
        logits, steps = self.forward_plan(p)
        for name, step in steps.items():
            self.transforms[name].after_step([ch.seq for ch in out.chunks], step)
        if self.page_mover is not None:
            self.move_pages(*self.page_mover.plan((ch.seq, ch.end) for ch in out.chunks))
        return logits

    @torch.inference_mode()
    def forward_plan(self, p: StepPlan) -> tuple[torch.Tensor | None, dict[str, TransformStep]]:
        """The forward of one planned step, on every TP rank (rank 0 publishes the plan first;
        runtime/distributed/worker.py runs it on the others): (logits as execute returns them,
        None off rank 0 in eager steps; the step's transform steps by name, none in a graph)."""
        if self.tp.size > 1:  # one GPU: no other rank to tell (group.py stays off the step path)
            self.tp.publish("forward_plan", p)
        if self._uses_graph(p, len(p.ctx_lens)):
            bs = self.graphs.load([p])
            # a decode chunk always samples
            return self.graphs.replay(0, bs, len(p.ctx_lens), key=self.graphs.key_of(p)), {}
        with forward_context(self._context(p)) as ctx:
            hidden = self.model(self._tensor(p.input_ids, torch.int64))
        self.hidden_out = hidden[self._tensor(p.hidden_rows, torch.int64)] if p.hidden_rows else None
        if self.tp.rank != 0:  # not the driver (TPGroup.is_driver): the LM head is replicated: only rank 0 needs logits
            return None, ctx.transforms
        return self.model.compute_logits(hidden[self._tensor(p.logits_rows, torch.int64)]), ctx.transforms

    @torch.inference_mode()
    def execute_decode_steps(self, out: SchedulerOutput, num_steps: int, sample) -> list[torch.Tensor]:
        """Run `num_steps` decode steps of the pure-decode batch `out` with no host sync between
        them: step j + 1 feeds on step j's sampled tokens, which stay on the device. The caller
        has allocated KV pages for all steps. `sample(logits [B, V]) -> tokens [B]` (device).
        Returns each step's sampled tokens."""
        plans = [self.prepare(out)]
        seqs = [ch.seq for ch in out.chunks]
        for j in range(1, num_steps):  # the same batch, one position further per step
            p = plans[0].next_decode(j, out.chunks, self.kv)
            p.backends = self._plan_backends(p, seqs)
            plans.append(p)
        tokens = self.run_decode_plans(plans, sample)
        if self.page_mover is not None:
            self.move_pages(*self.page_mover.plan((seq, ctx) for seq, ctx in zip(seqs, plans[-1].ctx_lens)))
        return tokens

    @torch.inference_mode()
    def run_decode_plans(self, plans: list[StepPlan], sample=None) -> list[torch.Tensor]:
        """The forwards of back-to-back decode steps, on every TP rank (as forward_plan). sample:
        rank 0's sampler; None on the other ranks, which take rank 0's tokens (a broadcast)."""
        if self.tp.size > 1:
            self.tp.publish("run_decode_plans", plans)
        n, tokens = len(plans[0].ctx_lens), []

        def take(logits: torch.Tensor) -> torch.Tensor:
            if self.tp.size == 1:
                return sample(logits)
            mine = sample(logits).to(torch.int64) if sample is not None else torch.empty(
                n, dtype=torch.int64, device=self.device)
            return self.tp.broadcast(mine)

        if all(self._uses_graph(p, n) for p in plans):
            bs = self.graphs.load(plans)
            for j in range(len(plans)):
                logits = self.graphs.replay(j, bs, n, tokens[-1] if tokens else None, key=self.graphs.key_of(plans[j]))
                tokens.append(take(logits))
        else:
            for j, p in enumerate(plans):
                input_ids = tokens[-1] if tokens else self._tensor(p.input_ids, torch.int64)
                with forward_context(self._context(p)):
                    tokens.append(take(self.model.compute_logits(self.model(input_ids))))
        return tokens

    def move_pages(self, src: list[int], dst: list[int]) -> None:
        """KV offloading: copy the step's departing pages to the host, on every TP rank."""
        if src:
            if self.tp.size > 1:
                self.tp.publish("move_pages", src, dst)
            self.page_mover.copy(src, dst)
