"""Paged KV bookkeeping: the page allocator and KVCacheManager (no tensors)."""

import random

import pytest

from infhip.runtime.kv_cache import KVCacheManager, KVGroupSpec, OffloadSpec, OutOfPages, PageAllocator


def test_allocator_free_list_invariants():
    a = PageAllocator(5)
    assert a.num_pages == 5 and a.num_free == 4
    pages = [a.allocate() for _ in range(4)]
    assert sorted(pages) == [1, 2, 3, 4]  # page 0 is never handed out
    assert a.num_free == 0
    with pytest.raises(OutOfPages):
        a.allocate()
    a.free(3)
    assert a.num_free == 1 and a.allocate() == 3
    with pytest.raises(ValueError, match="null page"):
        a.free(0)
    with pytest.raises(ValueError, match="does not belong"):
        a.free(5)
    a.free(2)
    with pytest.raises(ValueError, match="double free"):
        a.free(2)
    with pytest.raises(ValueError, match="num_pages must be an int >= 2"):
        PageAllocator(1)


def test_allocator_random_ops_conserve_pages():
    rng = random.Random(0)
    a = PageAllocator(33)
    held: set[int] = set()
    for _ in range(2000):
        if held and (rng.random() < 0.5 or a.num_free == 0):
            p = rng.choice(sorted(held))
            held.remove(p)
            a.free(p)
        else:
            p = a.allocate()
            assert p not in held and p != 0
            held.add(p)
        assert a.num_free + len(held) == 32


def test_group_spec_validation():
    with pytest.raises(ValueError, match="num_pages"):
        KVGroupSpec(num_pages=1, window=None)
    with pytest.raises(ValueError, match="window"):
        KVGroupSpec(num_pages=4, window=0)


def test_slots_map_to_pages():
    kv = KVCacheManager(4, {"global": KVGroupSpec(16, None)}, max_pages_per_seq=8)
    kv.append(7, 0, 6)  # positions 0..5 -> 2 pages
    bt = kv.block_table(7, "global")
    assert len(bt) == 2 and 0 not in bt
    assert kv.slot_mapping(7, "global", 0, 6) == [bt[p // 4] * 4 + p % 4 for p in range(6)]
    kv.append(7, 6, 9)  # positions 6..8 -> a third page
    bt = kv.block_table(7, "global")
    assert len(bt) == 3
    assert kv.slot_mapping(7, "global", 5, 9) == [bt[p // 4] * 4 + p % 4 for p in range(5, 9)]
    assert kv.num_free_pages("global") == 15 - 3
    with pytest.raises(ValueError, match="call append"):
        kv.slot_mapping(7, "global", 8, 13)
    with pytest.raises(ValueError, match="beyond the page table"):
        kv.append(7, 9, 33)
    with pytest.raises(ValueError, match="unknown KV group"):
        kv.block_table(7, "sliding")
    # Two sequences never share a slot.
    kv.append(8, 0, 9)
    assert not set(kv.slot_mapping(7, "global", 0, 9)) & set(kv.slot_mapping(8, "global", 0, 9))


def test_all_or_nothing_on_out_of_pages():
    groups = {"global": KVGroupSpec(10, None), "sliding": KVGroupSpec(4, 4)}
    kv = KVCacheManager(2, groups, max_pages_per_seq=64)
    kv.append(1, 0, 6)  # global: 3 pages; sliding: 3 pages (window not yet reached)
    assert kv.num_free_pages("sliding") == 0 and kv.num_free_pages("global") == 6
    assert not kv.can_append(2, 0, 2)  # sliding group is full
    with pytest.raises(OutOfPages, match="sliding"):
        kv.append(2, 0, 2)
    assert kv.num_free_pages("global") == 6  # nothing was taken from the other group
    assert kv.block_table(2, "global") == []
    # Sequence 1 can still grow: the window releases its own old pages first.
    assert kv.can_append(1, 6, 8)
    kv.append(1, 6, 8)
    kv.free(1)
    assert kv.num_free_pages("global") == 9 and kv.num_free_pages("sliding") == 3


def test_windowed_group_releases_and_respects_bound():
    ps, window, chunk = 4, 6, 5
    groups = {"global": KVGroupSpec(200, None), "sliding": KVGroupSpec(200, window)}
    kv = KVCacheManager(ps, groups, max_pages_per_seq=64)
    bound = KVCacheManager.pages_for(window, ps, 256, chunk)
    assert bound == kv.pages_needed("sliding", 256, chunk) == -(-(window - 1 + chunk) // ps) + 1
    assert KVCacheManager.pages_for(None, ps, 256, chunk) == 64
    rng = random.Random(1)
    pos = 0
    while pos < 200:
        n = rng.randint(1, chunk)
        kv.append(0, pos, pos + n)
        assert kv.num_pages_held(0, "sliding") <= bound
        bt = kv.block_table(0, "sliding")
        # Every key the chunk's queries need is on a real page; everything older is 0.
        need_from = max(0, pos - window + 1)
        for i, page in enumerate(bt):
            if (i + 1) * ps <= need_from:
                assert page == 0
            elif i * ps < pos + n:
                assert page != 0
        slots = kv.slot_mapping(0, "sliding", need_from, pos + n)
        assert len(set(slots)) == len(slots)
        pos += n
        assert kv.num_pages_held(0, "global") == -(-pos // ps)
    assert kv.block_table(0, "sliding")[0] == 0
    with pytest.raises(ValueError, match="already released"):
        kv.append(0, 0, 1)
    kv.free(0)
    assert kv.num_free_pages("sliding") == 199 and kv.num_free_pages("global") == 199
    assert kv.block_table(0, "sliding") == []
    kv.free(0)  # idempotent
    kv.append(0, 0, 3)  # a freed sequence starts over
    assert kv.num_pages_held(0, "sliding") == 1


def test_free_returns_everything():
    groups = {"global": KVGroupSpec(64, None), "sliding": KVGroupSpec(64, 8)}
    kv = KVCacheManager(4, groups, max_pages_per_seq=32)
    rng = random.Random(2)
    pos = {}
    for _ in range(300):
        sid = rng.randrange(6)
        if rng.random() < 0.15:
            kv.free(sid)
            pos.pop(sid, None)
            continue
        start = pos.get(sid, 0)
        end = min(start + rng.randint(1, 6), 128)
        if start < end and kv.can_append(sid, start, end):
            kv.append(sid, start, end)
            pos[sid] = end
    for sid in range(6):
        kv.free(sid)
    assert kv.num_free_pages("global") == 63 and kv.num_free_pages("sliding") == 63


# ---- offloading: pages between the head and the tail move to a host pool --------------------

def _offload_manager(host_pages=16, batch_pages=2, gpu_pages=20):
    spec = OffloadSpec(host_pages=host_pages, head_tokens=6, tail_tokens=10, min_context=40, batch_pages=batch_pages)
    return KVCacheManager(4, {"global": KVGroupSpec(gpu_pages, None, offload=spec)}, max_pages_per_seq=64)


def test_offload_moves_middle_pages_to_host_entries():
    kv = _offload_manager()
    kv.append(1, 0, 38)
    assert kv.offload(1, "global", 38) == ([], []), "below min_context nothing moves"
    kv.append(1, 38, 50)
    before = kv.block_table(1, "global")
    table_obj = kv.page_list(1, "global")
    free = kv.num_free_pages("global")
    src, dst = kv.offload(1, "global", 50)
    # head = 2 pages (6 tokens), tail: pages wholly before token 40 -> logical pages 2..9
    assert src == before[2:10] and all(d < 0 for d in dst) and len(set(dst)) == 8
    table = kv.block_table(1, "global")
    assert table[:2] == before[:2] and table[2:10] == dst and table[10:] == before[10:]
    assert kv.page_list(1, "global") is not table_obj, "a new list, so cached uploads re-read it"
    assert kv.num_free_pages("global") == free + 8 and kv.num_free_host_pages("global") == 8
    assert kv.offload(1, "global", 50) == ([], []), "already moved"
    with pytest.raises(ValueError, match="offloaded"):
        kv.slot_mapping(1, "global", 12, 13)
    assert kv.slot_mapping(1, "global", 45, 46) == [before[11] * 4 + 1]
    kv.append(1, 50, 51)
    assert kv.offload(1, "global", 51) == ([], []), "one eligible page is less than a batch of 2"
    kv.free(1)
    assert kv.num_free_pages("global") == 19 and kv.num_free_host_pages("global") == 16


def test_offload_stops_at_a_full_host_pool_and_sizes_gpu_need():
    kv = _offload_manager(host_pages=3)
    kv.append(7, 0, 60)
    src, dst = kv.offload(7, "global", 60)
    assert len(src) == 3 and kv.num_free_host_pages("global") == 0, "as many as the host pool holds"
    assert kv.block_table(7, "global")[5] > 0, "the rest stays on the GPU"
    # GPU pages a growing request holds: all until min_context + a chunk, then head + tail +
    # chunk + batch; host pages: all but the head
    assert kv.pages_needed("global", 1000, max_chunk=8) == max(-(-47 // 4), 2 + -(-18 // 4) + 2 + 1)
    assert kv.pages_needed("global", 20) == 5 and kv.host_pages_needed("global", 1000) == 250 - 2
    with pytest.raises(ValueError, match="full-attention"):
        KVGroupSpec(8, 16, offload=OffloadSpec(1, 0, 0, 0))
