"""Staged prefill over an offloaded KV cache: the host pages a prefill step reads are copied to
the GPU once per layer, one layer ahead of the compute, and the sparse prefill kernels read that
copy instead of the host pool.

Why: a prefill chunk reads the offloaded keys and values many times. Every query block loads its
own selected pages (a 32K chunk has 512 blocks of 64 queries), so reading them in place over
PCIe made a 32K chunk at 1M keys 4x slower than with a resident cache (docs/benchmarks.md).
Copying each page once per layer moves only the context's bytes (2 GiB per layer at 1M tokens,
fp8, Llama-3.1-8B shapes). The copy engine does it while the SMs compute the previous layer.

How: kernels reach a table entry < 0 through an element offset from the GPU cache to the cache's
*twin* (plugins/kv_offload.py). The twin need not be the host pool: a GPU buffer holding copies
of the pages works the same. So a staged step

1. lists the distinct host pages of its sparse prefill chunks, sorted: slot s of a staging buffer
   holds host page H[s], and each run of consecutive host pages becomes one copy;
2. rewrites those chunks' table rows, entry -1 - H[s] -> -1 - s (decode rows keep theirs: decode
   reads the host pool in place and its value bank);
3. for the j-th offloaded layer, copies the runs into buffer j % 2 on a side stream once layer
   j - 1, the buffer's previous reader, has queued its kernels; layer j waits for that copy.

A step whose host pages do not fit a buffer, or fall into more than MAX_RUNS runs, is not staged:
its kernels read the host pool in place (the same results, slower).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infhip.plugins.kv_offload import HostKV, host_page
from infhip.runtime.forward_context import upload_tables

# A copy call per run, tensor (K, V, fp8 scales) and layer: past this many runs a step reads in
# place rather than spend host time on launches. Fresh host pools hand out consecutive pages, so
# one request's pages form a few runs.
MAX_RUNS = 256


@dataclass
class StagePlan:
    """Host side of one staged step."""

    tables: list[list[int]]  # the step's table rows, the staged chunks' host entries renumbered
    runs: list[tuple[int, int, int]]  # (first host page, first slot, pages) per copy
    num_pages: int  # slots used


def plan_staging(tables: list[list[int]], rows: list[int], capacity: int,
                 max_runs: int = MAX_RUNS) -> StagePlan | None:
    """The staging of rows ``rows`` of ``tables`` (block-table entries, < 0 on the host), or None
    when they name no host page, more than ``capacity`` pages, or more than ``max_runs`` runs.

        >>> p = plan_staging([[1, -5, -4, -9, 2], [-7, 3]], rows=[0], capacity=8)
        >>> p.tables, p.runs, p.num_pages
        ([[1, -2, -1, -3, 2], [-7, 3]], [(3, 0, 2), (8, 2, 1)], 3)
    """
    hosts = sorted({host_page(e) for b in rows for e in tables[b] if e < 0})
    if not hosts or len(hosts) > capacity:
        return None
    runs = []
    for slot, h in enumerate(hosts):
        if runs and runs[-1][0] + runs[-1][2] == h:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((h, slot, 1))
        if len(runs) > max_runs:
            return None
    slot_of = {h: s for s, h in enumerate(hosts)}
    staged = set(rows)
    new = [[host_page(slot_of[host_page(e)]) if e < 0 else e for e in row] if b in staged else row
           for b, row in enumerate(tables)]
    return StagePlan(tables=new, runs=runs, num_pages=len(hosts))


class PrefillStaging:
    """Two GPU twins of ``capacity`` pages shared by the offloaded layers (buffer j % 2 serves the
    j-th), and the side stream that fills them. ``enabled = False`` makes every step read in
    place (benchmarks compare the two)."""

    def __init__(self, layers: list, capacity: int, device: torch.device):
        """layers: the attention modules whose cache has a host twin (``kv.host``), in forward order."""
        self.order = {attn.layer_index: j for j, attn in enumerate(layers)}
        self.hosts: list[HostKV] = [attn.kv.host for attn in layers]
        self.capacity, self.device = capacity, device
        h = self.hosts[0]
        self.buffers = [HostKV(*(None if t is None else torch.empty((capacity, *t.shape[1:]), dtype=t.dtype,
                                                                       device=device)
                                 for t in (h.k, h.v, h.k_scale, h.v_scale))) for _ in range(2)]
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.enabled = True
        self.pages_staged = 0  # host pages copied so far (tests, benchmarks)

    @staticmethod
    def bytes_for(capacity: int, page_bytes: int) -> int:
        """Device memory of the two buffers (page_bytes: one page of K, V and scales, one layer)."""
        return 2 * capacity * page_bytes

    def stage(self, tables: list[list[int]], prefill_seqs: list[int]) -> StagedStep | None:
        """The staging of a step's sparse prefill chunks (rows prefill_seqs of the global group's
        page lists), None when disabled, there are none, or they do not fit (plan_staging)."""
        if not self.enabled or not prefill_seqs:
            return None
        plan = plan_staging(tables, prefill_seqs, self.capacity)
        return None if plan is None else self.start(plan, upload_tables(plan.tables, self.device))

    def start(self, plan: StagePlan, tables: torch.Tensor) -> StagedStep:
        """A step's staging (tables: plan.tables on the device). The first layer's copy is queued
        now (it overlaps the embedding and the first projections); each layer that acquires its
        buffer queues the next one's."""
        self.pages_staged += plan.num_pages * len(self.hosts)
        step = StagedStep(self, plan, tables)
        step._copy(0)
        return step


class StagedStep:
    """One step's staging, read by the InfiniteHiP layers through SparseStep.staged: a layer's
    prefill calls ``acquire`` (its buffer, once filled) before its kernels and ``release`` after
    queuing them."""

    def __init__(self, staging: PrefillStaging, plan: StagePlan, tables: torch.Tensor):
        self.staging, self.plan, self.tables = staging, plan, tables
        n = len(staging.hosts)
        self.ready: list[torch.cuda.Event | None] = [None] * n  # copy of layer j done
        self.done: list[torch.cuda.Event | None] = [None] * n  # layer j's kernels queued before this
        self.copied: set[int] = set()
        self.start_event = None
        if staging.side is not None:  # the host pages were written by earlier steps' kernels
            self.start_event = torch.cuda.Event()
            self.start_event.record()

    def acquire(self, layer: int) -> HostKV:
        """Layer ``layer``'s staged twin; also queues the next layer's copy."""
        j = self.staging.order[layer]
        self._copy(j)
        if j + 1 < len(self.staging.hosts):
            self._copy(j + 1)
        if self.ready[j] is not None:
            torch.cuda.current_stream().wait_event(self.ready[j])
        return self.staging.buffers[j % 2]

    def release(self, layer: int) -> None:
        j = self.staging.order[layer]
        if self.staging.side is not None:
            self.done[j] = torch.cuda.Event()
            self.done[j].record()

    def _copy(self, j: int) -> None:
        """Queue layer j's copy once (CPU: copy now)."""
        if j in self.copied:
            return
        self.copied.add(j)
        buf, host, side = self.staging.buffers[j % 2], self.staging.hosts[j], self.staging.side
        pairs = [(b, h) for b, h in zip((buf.k, buf.v, buf.k_scale, buf.v_scale),
                                         (host.k, host.v, host.k_scale, host.v_scale)) if b is not None]
        if side is None:
            self._copy_runs(pairs, non_blocking=False)
            return
        # buffer j % 2 was last read by layer j - 2, or by the previous step
        after = self.done[j - 2] if j >= 2 else self.start_event
        if after is None:  # layer j - 2 was not released (not forward order): wait for all so far
            after = torch.cuda.Event()
            after.record()
        side.wait_event(after)
        with torch.cuda.stream(side):
            self._copy_runs(pairs, non_blocking=True)
            self.ready[j] = torch.cuda.Event()
            self.ready[j].record(side)

    def _copy_runs(self, pairs, non_blocking: bool) -> None:
        for h, s, n in self.plan.runs:
            for buf, host in pairs:
                buf[s:s + n].copy_(host[h:h + n], non_blocking=non_blocking)
