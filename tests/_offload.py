"""Test helper: move some pages of a paged cache into a host twin (plugins/kv_offload.py).

The moved GPU pages are overwritten with NaN (and their fp8 scales too), so a kernel that reads
an offloaded page from the GPU pool instead of the host twin poisons its output."""

from __future__ import annotations

import numpy as np
import torch

from infhip.plugins.kv_offload import HostKV, host_page


def offload_pages(k_cache, v_cache, block_tables, every: int = 2, k_scale=None, v_scale=None,
                  keep_first: int = 0):
    """Move every ``every``-th page named in block_tables (from logical page keep_first on) to a
    new host twin. Returns (host, tables): tables with those entries < 0. The caches (and scales)
    are modified in place: the moved pages are NaN."""
    tables = block_tables.clone()
    moved = sorted({int(p) for p in block_tables[:, keep_first::every].flatten().tolist() if p > 0})
    host = HostKV.like(k_cache, max(1, len(moved)))  # (like() reads only the shape and dtype)
    for h, page in enumerate(moved):
        host.k[h] = k_cache[page].cpu()
        host.v[h] = v_cache[page].cpu()
        if k_scale is not None:
            host.k_scale[h] = k_scale[page].cpu()
            host.v_scale[h] = v_scale[page].cpu()
            k_scale[page] = float("nan")
            v_scale[page] = float("nan")
        k_cache[page] = float("nan")
        v_cache[page] = float("nan")
        tables[block_tables == page] = host_page(h)
    assert (tables < 0).any(), "the test moved no page"
    return host, tables


def count_moves(llm) -> list[int]:
    """Record the host entries of every page the runtime moves from now on (a live list)."""
    moved: list[int] = []
    real = llm.runner.kv.offload

    def counted(*args):
        src, dst = real(*args)
        moved.extend(dst)
        return src, dst
    llm.runner.kv.offload = counted
    return moved


def poison_host_during_staged_prefill(monkeypatch) -> list[int]:
    """From now on, while a layer's staged prefill runs (runtime/offload/staging.py, between its
    acquire and release), that layer's host pool is NaN, restored after: a kernel that read a
    host page instead of the staged copy would poison the output. Returns the layers acquired
    (a live list)."""
    from infhip.runtime.offload.staging import StagedStep

    saved: dict[int, torch.Tensor] = {}
    calls: list[int] = []
    real_acquire, real_release = StagedStep.acquire, StagedStep.release

    def pool(step, layer):
        host = step.staging.hosts[step.staging.order[layer]]
        return [t for t in (host.k, host.v, host.k_scale, host.v_scale) if t is not None]

    def acquire(self, layer):
        twin = real_acquire(self, layer)  # on CPU the copies are done when it returns
        for t in pool(self, layer):
            saved[id(t)] = t.clone()
            t.fill_(float("nan"))
        calls.append(layer)
        return twin

    def release(self, layer):
        for t in pool(self, layer):
            t.copy_(saved.pop(id(t)))
        real_release(self, layer)

    monkeypatch.setattr(StagedStep, "acquire", acquire)
    monkeypatch.setattr(StagedStep, "release", release)
    return calls
