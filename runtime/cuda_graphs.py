"""CUDA graphs for decode steps of a fixed list of batch sizes.

Buffers are allocated once at the largest size; graphs are captured largest first into one
memory pool (SPEC §8.6). A decode step of B sequences replays the smallest captured size >= B;
rows B.. are padding: slot -1 (the cache write skips it), context length 0 (attention reads
nothing) and token 0.
"""

from __future__ import annotations

import bisect

import torch

from infhip.runtime.forward_context import ForwardContext, KVGroupMetadata, forward_context


class DecodeGraphs:
    def __init__(self, runner, batch_sizes: list[int], max_steps: int = 1):
        self.runner = runner
        self.sizes = sorted(set(batch_sizes))
        max_bs, dev = self.sizes[-1], runner.device
        self.groups = list(runner.groups)
        # The inputs of up to max_steps decode steps travel in one pinned int64 block, one
        # host-to-device copy: per step, rows = input_ids, positions, context_lens, then one slot
        # row per KV group. Before each replay the step's rows are copied (on the device) into
        # `rows`, which the graphs read.
        num_rows = 3 + len(self.groups)
        self.host_steps = torch.zeros((max_steps, num_rows, max_bs), dtype=torch.int64).pin_memory()
        self.host_steps_np = self.host_steps.numpy()
        self.steps = torch.zeros_like(self.host_steps, device=dev)
        self.rows = torch.zeros((num_rows, max_bs), dtype=torch.int64, device=dev)
        self.rows[3:] = -1  # slots of rows never used write nothing (also while capturing)
        self.input_ids, self.positions = self.rows[0], self.rows[1]
        self.slots = {g: self.rows[3 + i] for i, g in enumerate(self.groups)}
        # The attention kernels want int32 lengths: converted on the device inside the graph.
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.host_tables = torch.zeros((len(self.groups), max_bs, runner.max_pages_per_seq),
                                       dtype=torch.int32).pin_memory()
        self.host_tables_np = self.host_tables.numpy()
        self.tables = {g: torch.zeros(max_bs, runner.max_pages_per_seq, dtype=torch.int32, device=dev)
                       for g in self.groups}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self._capture_all()

    def _context(self, bs: int) -> ForwardContext:
        return ForwardContext(
            positions=self.positions[:bs], context_lens=self.context_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[:bs + 1], num_decodes=bs,
            groups={g: KVGroupMetadata(self.slots[g][:bs], self.tables[g][:bs]) for g in self.slots},
            cu_seqlens_q_list=list(range(bs + 1)), context_lens_list=[0] * bs)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        model = self.runner.model
        for bs in reversed(self.sizes):
            ctx = self._context(bs)
            with forward_context(ctx):
                self._forward(bs)  # warm-up: compiles the Triton kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.logits[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _forward(self, bs: int) -> torch.Tensor:
        self.context_lens[:bs].copy_(self.rows[2, :bs])
        model = self.runner.model
        return model.compute_logits(model(self.input_ids[:bs]))

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

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
            rows[0:3, n:bs] = 0  # padding rows: token 0 at position 0 with no context
            for i, g in enumerate(self.groups):
                rows[3 + i, :n] = p.slots[g]
                rows[3 + i, n:bs] = -1  # padding writes nothing
        k = len(plans)
        # Whole contiguous blocks (a few KB): a strided pinned copy could be staged through pageable memory.
        self.steps[:k].copy_(self.host_steps[:k], non_blocking=True)
        for i, g in enumerate(self.groups):
            # The last step's tables cover every step (pages were allocated for all of them);
            # entries past a row's length are never read (context_lens bounds the kernel).
            table_rows = plans[-1].tables[g]
            for b, r in enumerate(table_rows):
                self.host_tables_np[i, b, :len(r)] = r
            self.tables[g][:n].copy_(self.host_tables[i, :n], non_blocking=True)
        return bs

    def replay(self, step: int, bs: int, n: int, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay staged step `step` (input_ids: the previous step's sampled tokens [n], on the
        device, for step > 0); returns logits [n, vocab]."""
        self.rows[:, :bs].copy_(self.steps[step, :, :bs])
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
