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
    def __init__(self, runner, batch_sizes: list[int]):
        self.runner = runner
        self.sizes = sorted(set(batch_sizes))
        max_bs, dev = self.sizes[-1], runner.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.slots = {g: torch.full((max_bs,), -1, dtype=torch.int64, device=dev) for g in runner.groups}
        self.tables = {g: torch.zeros(max_bs, runner.max_pages_per_seq, dtype=torch.int32, device=dev)
                       for g in runner.groups}
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
                model.compute_logits(model(self.input_ids[:bs]))  # warm-up: compiles Triton kernels
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.logits[bs] = model.compute_logits(model(self.input_ids[:bs]))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def replay(self, p: dict) -> torch.Tensor:
        """Copy the step's host-planned inputs into the static buffers, replay, return logits [B, V]."""
        n = len(p["input_ids"])
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        pad = bs - n
        self.input_ids[:bs].copy_(torch.tensor(p["input_ids"] + [0] * pad), non_blocking=True)
        self.positions[:bs].copy_(torch.tensor(p["positions"] + [0] * pad), non_blocking=True)
        self.context_lens[:bs].copy_(torch.tensor(p["ctx_lens"] + [0] * pad, dtype=torch.int32),
                                     non_blocking=True)
        for g in self.slots:
            self.slots[g][:bs].copy_(torch.tensor(p["slots"][g] + [-1] * pad), non_blocking=True)
            rows = p["tables"][g]
            width = max(len(r) for r in rows)
            # Entries past a row's length are never read (context_lens bounds the kernel).
            table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
            self.tables[g][:n, :width].copy_(table, non_blocking=True)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
