"""Automatic prefix caching in the KV manager, without tensors (issue 24,
docs/design/prefix_caching.md): the page pool (refcounts, LRU, eviction, double free and
duplicate content), the sliding-window rule under random traffic, and offloaded pages cached on
the host (shared, evicted LRU, never a held one). The engines' side: tests/test_prefix_caching.py."""

from __future__ import annotations

import random

import pytest

from infhip.runtime.kv_cache import NULL_PAGE, KVCacheManager, KVGroupSpec, OffloadSpec, OutOfPages
from infhip.runtime.prefix_cache import PagePool


def _run(kv: KVCacheManager, seq_id: int, tokens: list[int], chunk: int, start: int = 0) -> None:
    """Compute positions [start, len(tokens)) of seq_id in chunks, naming full pages as the
    scheduler's update() does."""
    while start < len(tokens):
        end = min(len(tokens), start + chunk)
        kv.append(seq_id, start, end)
        kv.register(seq_id, tokens, end)
        start = end


def _idle(kv: KVCacheManager) -> None:
    """No sequence holds a page: every page is free or cached, no reference left."""
    for g, spec in kv.groups.items():
        assert kv.num_free_pages(g) == spec.num_pages - 1, g
        assert kv.held_pages(g) == {}, g


def test_pages_shared_cached_and_evicted_lru():
    kv = KVCacheManager(4, {"global": KVGroupSpec(num_pages=9, window=None)}, max_pages_per_seq=8)
    kv.enable_prefix_caching("plan-a")
    doc = list(range(10, 30))  # 5 full pages
    assert kv.share(1, doc + [7]) == 0  # nothing cached yet
    _run(kv, 1, doc + [7], chunk=6)
    held = kv.block_table(1, "global")
    kv.free(1)
    _idle(kv)
    assert kv.num_cached_pages("global") == 5 and kv.num_free_pages("global") == 8  # cached pages count as free
    # a prompt of exactly the 5 pages reuses 4: its last token is computed for its logits
    assert kv.share(2, doc) == 16 and kv.block_table(2, "global") == held[:4]
    assert kv.share(3, doc[:8] + [99] * 9) == 8  # the longest common page-aligned prefix
    assert [kv.page_refs("global", p) for p in held[:3]] == [2, 2, 1]
    kv.free(3)
    # a different plan (salt) never matches
    other = KVCacheManager(4, {"global": KVGroupSpec(num_pages=9, window=None)}, max_pages_per_seq=8)
    other.enable_prefix_caching("plan-b")
    assert other.cached_prefix(doc)[0] == 0 and kv.cached_prefix(doc)[0] == 4
    # pressure: seq 2 holds 5 pages (4 shared), 2 are free and 1 cached (doc page 4) of 8
    kv.append(2, 16, 20)
    assert kv.num_free_pages("global") == 3 and not kv.can_append(4, 0, 13)
    kv.append(4, 0, 12)  # the 2 free pages first, then the LRU cached page
    assert kv.prefix_cache_evictions == 1 and held[4] in kv.block_table(4, "global")
    assert kv.cached_prefix(doc + [1])[0] == 4 and kv.block_table(2, "global")[:4] == held[:4]
    with pytest.raises(OutOfPages):
        kv.append(4, 12, 16)  # everything left is held by seq 2: never evicted
    kv.free(4)
    kv.free(2)
    _idle(kv)


def test_pool_double_free_and_duplicate_content():
    from infhip.runtime.kv_cache import PageAllocator
    pool = PagePool(PageAllocator(4))
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, b"x")
    pool.register(b, b"x")  # the same content computed twice: the first copy stays cached
    assert pool.lookup(b"x") == a
    pool.free(a)
    pool.free(b)
    assert pool.num_cached == 1 and pool.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        pool.free(b)
    pool.acquire(a)
    with pytest.raises(ValueError, match="not held"):
        pool.register(b, b"y")  # b is free


def _window_ok(kv, chain, n) -> bool:
    """The rule restated: full-attention groups have pages 0..n-1 cached, a window W group the
    pages of positions n*ps-W+1 .. n*ps-1."""
    ps = kv.page_size
    for g, spec in kv.groups.items():
        lo = max(0, n * ps - spec.window + 1) // ps if spec.window else 0
        if any(kv.cached_page(g, chain[j]) is None for j in range(lo, n)):
            return False
    return True


def test_sliding_window_rule_random():
    """Hybrid global + window groups under random traffic and evictions: share() takes the longest
    prefix whose pages every group still holds (its window only for a windowed group), installs
    exactly those pages, and the pools balance when idle."""
    rng = random.Random(0)
    kv = KVCacheManager(4, {"global": KVGroupSpec(num_pages=40, window=None),
                            "sliding": KVGroupSpec(num_pages=14, window=9)}, max_pages_per_seq=16)
    kv.enable_prefix_caching("hybrid")
    docs = [[rng.randrange(3, 50) for _ in range(40)] for _ in range(3)]
    for seq_id in range(40):
        tokens = rng.choice(docs)[:rng.randrange(20, 41)] + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))]
        tokens = tokens[:60]
        n, chain = kv.cached_prefix(tokens)
        assert n * 4 <= len(tokens) - 1 and _window_ok(kv, chain, n)
        assert not any(_window_ok(kv, chain, m) for m in range(n + 1, (len(tokens) - 1) // 4 + 1))
        assert kv.share(seq_id, tokens) == 4 * n
        for g in kv.groups:
            table = kv.block_table(seq_id, g)
            assert [p for p in table if p != NULL_PAGE] == [kv.cached_page(g, chain[j]) for j in
                                                           range(len(table) - sum(p != NULL_PAGE for p in table), n)]
        if not kv.can_append(seq_id, 4 * n, len(tokens)):
            kv.free(seq_id)
            continue
        _run(kv, seq_id, tokens, chunk=rng.choice([3, 8, 64]), start=4 * n)
        kv.free(seq_id)
        _idle(kv)
    assert kv.prefix_cache_evictions > 0


def _offload_kv(host_pages: int = 12, gpu_pages: int = 12) -> KVCacheManager:
    """4-token pages; a sequence keeps its first page and its last 4 tokens on the GPU from 12
    tokens on, moving pages a page at a time."""
    off = OffloadSpec(host_pages=host_pages, head_tokens=4, tail_tokens=4, min_context=12, batch_pages=1)
    return KVCacheManager(4, {"global": KVGroupSpec(num_pages=gpu_pages, window=None, offload=off)},
                          max_pages_per_seq=32)


def _run_offloading(kv: KVCacheManager, seq_id: int, tokens: list[int], chunk: int, start: int = 0) -> list:
    """_run, with the runner's step-end move (PageMover) before the pages are named."""
    moves = []
    while start < len(tokens):
        end = min(len(tokens), start + chunk)
        kv.append(seq_id, start, end)
        moves.append(kv.offload(seq_id, "global", end))
        kv.register(seq_id, tokens, end)
        start = end
    return moves


def _flush_gpu_cache(kv: KVCacheManager, seq_id: int = 99) -> None:
    """Evict every cached GPU page (a sequence takes all free pages, then lets them go unnamed)."""
    n = kv.num_free_pages("global")
    kv.append(seq_id, 0, 4 * n)
    kv.free(seq_id)
    assert kv.num_cached_pages("global") == 0


def test_offloaded_pages_stay_cached_on_the_host():
    kv = _offload_kv()
    kv.enable_prefix_caching("plan")
    doc = list(range(10, 42))  # 8 pages
    _run_offloading(kv, 1, doc + [7], chunk=8)
    table = kv.block_table(1, "global")
    assert table[0] > 0 and all(p < 0 for p in table[1:7]) and table[7] > 0  # head, host, tail
    kv.free(1)
    assert kv.num_cached_host_pages("global") == 6 and kv.num_free_host_pages("global") == 12
    # the same document: a page named on the GPU before it moved is still cached there too; a
    # lookup prefers the GPU copy, else the host one
    chain = kv.cached_prefix(doc + [8])[1]
    assert kv.share(2, doc + [8]) == 32
    for j, e in enumerate(kv.block_table(2, "global")):
        assert e == table[j] if e < 0 else kv.page_digest("global", e) == chain[j]
    kv.free(2)
    _flush_gpu_cache(kv)  # now only the host copies are left
    assert kv.cached_prefix(doc + [8])[0] == 0, "page 0 (the head) was on the GPU only"
    _run_offloading(kv, 3, doc[:4] + [7], chunk=8)  # its head page again, on the GPU
    kv.free(3)
    assert kv.share(2, doc + [8]) == 28  # page 7, the tail, was never on the host: evicted
    assert kv.block_table(2, "global") == [kv.block_table(2, "global")[0]] + table[1:7]
    assert [kv.page_refs("global", e) for e in table[1:7]] == [1] * 6
    kv.free(2)
    # a short prefix (below min_context, 12 tokens) takes GPU pages only: the head page
    assert kv.share(4, doc[:10]) == 4 and kv.block_table(4, "global")[0] > 0
    kv.free(4)
    kv.disable_prefix_caching()
    assert kv.num_cached_host_pages("global") == 0 and kv.num_free_host_pages("global") == 12


def test_offload_shares_the_host_copy_of_a_cached_page():
    """A request that got a page from the GPU cache whose content is on the host already (the same
    document moved by an earlier request) moves it by sharing that host page: no copy."""
    kv = _offload_kv()
    kv.enable_prefix_caching("plan")
    doc = list(range(10, 42))
    _run_offloading(kv, 1, doc + [7], chunk=8)
    host = kv.block_table(1, "global")[1:7]
    kv.free(1)
    assert kv.share(2, doc + [8]) == 32
    gpu_middle = [e for e in kv.block_table(2, "global")[1:7] if e > 0]
    assert gpu_middle, "pages named before they moved are cached on the GPU too"
    free_host = kv.num_free_host_pages("global")
    kv.append(2, 32, 36)
    src, dst = kv.offload(2, "global", 36)
    assert not set(src) & set(gpu_middle), "a page whose content is on the host is not copied again"
    assert kv.block_table(2, "global")[1:7] == host  # the same host pages as seq 1's
    # the cached host pages it took leave the LRU (no longer free), plus one new page for page 7
    assert kv.num_free_host_pages("global") == free_host - len(gpu_middle) - len(dst)
    kv.free(2)
    assert kv.held_pages("global") == {}  # GPU and host pages


def test_host_cache_evicted_lru_under_pressure():
    """A small host pool: a second document evicts the first one's cached host pages, but never a
    host page that a running sequence holds; what does not fit stays on the GPU."""
    kv = _offload_kv(host_pages=8, gpu_pages=30)
    kv.enable_prefix_caching("plan")
    docs = [list(range(10 + 40 * i, 42 + 40 * i)) for i in range(3)]
    _run_offloading(kv, 1, docs[0] + [1], chunk=8)
    kv.free(1)
    _run_offloading(kv, 2, docs[1] + [1], chunk=8)  # 6 host pages: the 2 free ones, then 4 evicted
    assert kv.prefix_cache_evictions >= 4 and kv.num_cached_host_pages("global") == 2
    held = [-e for e in kv.block_table(2, "global") if e < 0]
    assert len(held) == 6
    _flush_gpu_cache(kv)
    # doc 0 is freed last page first: its first host pages are the ones still cached
    chain = kv.page_digests(docs[0], 8)
    assert [kv.cached_page("global", d, host=True) is not None for d in chain[1:7]] == [True] * 2 + [False] * 4
    moves = _run_offloading(kv, 3, docs[2] + [1], chunk=8)
    assert sum(len(d) for _, d in moves) == 2  # only the 2 cached host pages could be taken
    assert all(kv.page_refs("global", -h) == 1 for h in held)
    assert sum(e > 0 for e in kv.block_table(3, "global")) == 9 - 2  # the rest stayed on the GPU
    kv.free(2)
    kv.free(3)
