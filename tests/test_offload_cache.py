"""GPU copies of hot offloaded pages (runtime/offload_cache.py, kv_offload.cached_tables): the LRU
bookkeeping, the table rewrite, and the runtime reading the copies — with the host pages that
have a copy poisoned (NaN) while decode runs, requests still generate the resident run's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infhip.plugins.kv_offload import cached_tables
from infhip.runtime.kv_cache import KVCacheManager, KVGroupSpec, OffloadSpec, OutOfPages
from infhip.runtime.offload_cache import LruPages, survivor_pages

from ._offload import poison_copied_host_pages_during_decode
from .test_kv_offload_runtime import MiB, PAST, SHORT, engines, run, small_batches  # noqa: F401 (fixtures)
from .test_infinitehip_runtime import PROMPTS


# ------------------------------------------------------------------------------- bookkeeping

def test_lru_touches_hits_and_evicts_the_page_needed_longest_ago():
    lru = LruPages(capacity=3, num_host_pages=20)
    ev, adm, slots = lru.admit(np.array([4, 9, 11]))
    assert ev.size == 0 and sorted(adm.tolist()) == [4, 9, 11] and sorted(slots.tolist()) == [0, 1, 2]
    lru.admit(np.array([9]))  # touched: 4 and 11 are now older
    lru.admit(np.array([11]))
    ev, adm, slots = lru.admit(np.array([9, 11, 17]))
    assert ev.tolist() == [4] and adm.tolist() == [17] and slots.tolist() == [int(lru.slot_of[17])]
    assert lru.slot_of[4] == -1 and sorted(lru.page_in.tolist()) == [9, 11, 17]


def test_lru_never_evicts_a_page_needed_now_and_admits_what_fits():
    lru = LruPages(capacity=2, num_host_pages=10)
    lru.admit(np.array([1, 2]))
    ev, adm, _ = lru.admit(np.array([1, 2, 3, 5]))  # 4 needed, 2 slots, both needed now
    assert ev.size == 0 and adm.size == 0
    ev, adm, _ = lru.admit(np.array([2, 3, 5]))  # one slot (1's) is free to go
    assert ev.tolist() == [1] and adm.tolist() == [3] and lru.slot_of[5] == -1


def test_lru_invalidate_frees_slots_for_reuse():
    lru = LruPages(capacity=2, num_host_pages=10)
    lru.admit(np.array([6, 7]))
    assert lru.invalidate(np.array([7, 8])).tolist() == [7]  # 8 had no copy
    ev, adm, slots = lru.admit(np.array([6, 9]))
    assert ev.size == 0 and adm.tolist() == [9] and lru.page_in[slots[0]] == 9
    assert (lru.slot_of >= 0).sum() == 2


def test_survivor_pages_are_the_distinct_pages_of_ascending_positions():
    rng = np.random.default_rng(3)
    pos = np.sort(rng.choice(1000, size=77, replace=False))
    assert survivor_pages(pos, 16).tolist() == sorted(set((pos // 16).tolist()))
    assert survivor_pages(np.zeros(0, dtype=np.int64), 16).size == 0


def test_cached_tables_rewrite_only_host_entries_with_a_copy():
    torch.manual_seed(0)
    tables = torch.randint(-12, 9, (3, 37), dtype=torch.int32)  # odd shape; host pages 0..11, GPU 0..8
    gpu_pages = torch.full((12,), -1, dtype=torch.int32)
    gpu_pages[[0, 5, 11]] = torch.tensor([40, 41, 42], dtype=torch.int32)
    got = cached_tables(tables, gpu_pages)
    for e, g in zip(tables.flatten().tolist(), got.flatten().tolist()):
        want = int(gpu_pages[-1 - e]) if e < 0 and int(gpu_pages[-1 - e]) >= 0 else e
        assert g == want
    assert cached_tables(tables, None) is tables


def test_kv_manager_reserves_pages_and_reports_freed_host_pages():
    spec = OffloadSpec(host_pages=8, head_tokens=16, tail_tokens=16, min_context=32, batch_pages=1)
    kv = KVCacheManager(16, {"global": KVGroupSpec(num_pages=12, window=None, offload=spec)}, 16)
    reserved = kv.reserve("global", 3)
    assert len(set(reserved)) == 3 and 0 not in reserved and kv.num_free_pages("global") == 8
    with pytest.raises(OutOfPages, match="cannot reserve"):
        kv.reserve("global", 9)
    kv.append(1, 0, 96)
    src, dst = kv.offload(1, "global", 96)
    assert src and not set(src) & set(reserved)
    assert kv.pop_freed_host_pages("global") == []
    kv.free(1)
    assert sorted(kv.pop_freed_host_pages("global")) == sorted(-1 - d for d in dst)
    assert kv.pop_freed_host_pages("global") == []


# --------------------------------------------------------------------------------- runtime

@pytest.mark.parametrize("engine", ["3k", "3k-fp8"])
def test_decode_reads_the_gpu_copies_of_hot_host_pages(engines, small_batches, monkeypatch, engine):  # noqa: F811
    """References (the kernels read the rewritten tables like any table: the plugin tests cover
    them). Refresh every step so stages 2-3 and the bank writer run on every decode step."""
    from infhip import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    knobs = dict(PAST, refresh_intervals=[2, 1, 1])
    expected, _ = run(engines[engine], 0, overrides=knobs, params=SHORT)
    poisoned = poison_copied_host_pages_during_decode(monkeypatch)
    llm = LLM(engines[engine], max_num_batched_tokens=48, infinitehip_overrides=knobs,
              kv_offload_bytes=4 * MiB, kv_offload_cache_tokens=1024)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT)]
    stats = llm.runner.page_cache.stats
    assert stats.copied > 0 and stats.hits > 0, stats
    assert sum(poisoned) > 0, "no host page had a copy while decode ran: the test exercised nothing"
    assert got == expected
    # finished requests' host pages lose their copies before the next step
    llm.runner.page_cache.apply(llm.runner.kv)
    assert stats.invalidated > 0
    for a, lru in zip(llm.runner.page_cache.layers, llm.runner.page_cache.lru):
        assert (lru.page_in == -1).all() and bool((a.host_kv.gpu_pages == -1).all())


def test_a_small_cache_evicts_and_generates_the_same_tokens(engines, small_batches, monkeypatch):  # noqa: F811
    """One page of copies per layer for three requests, stage 1 recomputed every step: constant
    eviction, same tokens."""
    from infhip import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    knobs = dict(PAST, refresh_intervals=[1, 1, 1])
    expected, _ = run(engines["3k"], 0, overrides=knobs, params=SHORT)
    llm = LLM(engines["3k"], max_num_batched_tokens=48, infinitehip_overrides=knobs,
              kv_offload_bytes=4 * MiB, kv_offload_cache_tokens=16)
    assert llm.runner.page_cache.capacity == 1
    got = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=SHORT)]
    assert llm.runner.page_cache.stats.evicted > 0
    assert got == expected


def test_cache_size_knob(engines):  # noqa: F811
    from infhip import LLM

    llm = LLM(engines["3k"], infinitehip_overrides=PAST, kv_offload_bytes=4 * MiB, kv_offload_cache_tokens=None)
    k1 = llm.engine.config.plan.infinitehip.stages[0].k
    assert llm.runner.page_cache.capacity == -(-k1 // llm.runner.page_size)  # None: stage 1's survivors
    assert LLM(engines["3k"], infinitehip_overrides=PAST, kv_offload_bytes=4 * MiB).runner.page_cache is None
    assert LLM(engines["3k"], infinitehip_overrides=PAST).runner.page_cache is None  # no offloading
    with pytest.raises(ValueError, match="needs kv_offload_bytes"):
        LLM(engines["3k"], infinitehip_overrides=PAST, kv_offload_cache_tokens=64)
    with pytest.raises(ValueError, match="kv_offload_cache_tokens must be an int >= 0"):
        LLM(engines["3k"], infinitehip_overrides=PAST, kv_offload_bytes=4 * MiB, kv_offload_cache_tokens=-1)
