"""GPU copies of hot offloaded KV pages: an LRU per layer in front of the host pool (paper 000,
"KV Cache Offloading Architecture": the GPU page table over the mask-selection bank; SPEC §4).

Why. With the KV cache offloaded, a decode step's pruning refreshes read keys from host memory in
place (plugins/kv_offload.py). Stage 1 walks every chunk of the context, but stages 2 and 3 and
the value-bank writer read only inside stage 1's survivors (32K of 1M tokens for `3k`) and run
2-8x as often. Measured at 1M tokens, Llama-8B shapes, fp8 (docs/benchmarks.md, "Where offloaded
decode spends its time"): from the host a stage-2 refresh costs ~350 µs per layer and a stage-3
refresh with its bank write ~360 µs, against ~40 µs resident.

What. ``capacity`` GPU pool pages, reserved from the KV manager (the same page ids for every
offloaded layer; each layer keeps its own copies in them), hold copies of host pages, and each
layer's ``HostKV.gpu_pages`` maps host page -> pool page (-1: none); the sparse decode path reads
through kv_offload.cached_tables. After a step in which decode rows recomputed stage 1 of a
layer, their survivors (the layer's MaskCache.selected[0] rows) are copied to the host without a
sync; at the start of the next step (after that step's sampling sync) :meth:`apply` admits the
host pages they lie on: pages with a copy are touched, missing ones take free slots or evict the
least recently needed page not needed now (:class:`LruPages`; a page is copied once two stage-1
refreshes in a row select it: with masks that change completely at every refresh, as random
weights' do, copying the survivors cost 4.2 ms per layer against the 1.9 ms of reads it saved,
measured), and the copies (copy_pages) and map updates are queued on the compute stream ahead
of the step's kernels. Offloaded pages are
never written again, so a copy stays valid until its host page is freed
(KVCacheManager.pop_freed_host_pages: dropped from the map before the next step runs).

Correctness never depends on the cache: a reader that ignores the map finds the host page, and a
page that does not fit stays a (slower) host read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from infhip.plugins.kv_offload import copy_pages


class LruPages:
    """One layer's host page -> slot bookkeeping (host side): ``capacity`` slots, least recently
    needed evicted first. With ``on_repeat`` (the runtime's choice) a page gets a copy only when
    it is needed by two admits in a row: a copy costs more than the reads it saves before the
    next stage-1 refresh unless the page stays selected (a refresh whose survivors are all new,
    as with random weights, then copies almost nothing).

        >>> lru = LruPages(capacity=2, num_host_pages=8)
        >>> [x.tolist() for x in lru.admit(np.array([5, 6]))]     # (evicted, admitted, their slots)
        [[], [5, 6], [0, 1]]
        >>> [x.tolist() for x in lru.admit(np.array([6, 7]))]     # 5 was needed longest ago
        [[5], [7], [0]]
        >>> lru.slot_of[[5, 6, 7]].tolist()
        [-1, 1, 0]
        >>> lru = LruPages(capacity=4, num_host_pages=8, on_repeat=True)
        >>> [lru.admit(np.array(p))[1].tolist() for p in ([1, 2], [2, 3], [2, 3, 4])]
        [[], [2], [3]]
    """

    def __init__(self, capacity: int, num_host_pages: int, on_repeat: bool = False):
        self.capacity, self.on_repeat = capacity, on_repeat
        self.slot_of = np.full(num_host_pages, -1, dtype=np.int64)  # host page -> slot (-1: no copy)
        self.page_in = np.full(capacity, -1, dtype=np.int64)  # slot -> host page (-1: free)
        self.last_used = np.full(capacity, -1, dtype=np.int64)  # admit() tick that last needed it (-1: free)
        self.last_needed = np.full(num_host_pages, -1, dtype=np.int64)  # host page -> last admit() tick needing it
        self.tick = 0

    def admit(self, needed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Give the distinct host pages ``needed`` now a slot each: (evicted host pages, admitted
        host pages, their slots). The caller copies each admitted page into its slot and points
        the map at it, after unmapping the evicted ones. Pages that do not fit (more needed than
        slots) stay without a copy; with ``on_repeat``, so do pages the previous admit did not need."""
        self.tick += 1
        have = self.slot_of[needed]
        self.last_used[have[have >= 0]] = self.tick
        missing = needed[have < 0]
        if self.on_repeat:
            missing = missing[self.last_needed[missing] == self.tick - 1]
        self.last_needed[needed] = self.tick
        missing = missing[:int((self.last_used < self.tick).sum())]  # slots not needed by this admit
        if missing.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        # the missing.size slots needed longest ago (free ones, at -1, first)
        slots = np.argpartition(self.last_used, missing.size - 1)[:missing.size]
        evicted = self.page_in[slots]
        evicted = evicted[evicted >= 0]
        self.slot_of[evicted] = -1
        self.page_in[slots] = missing
        self.slot_of[missing] = slots
        self.last_used[slots] = self.tick
        return evicted, missing, slots

    def invalidate(self, pages: np.ndarray) -> np.ndarray:
        """Forget the copies of the distinct host pages ``pages`` (freed); returns those that had one."""
        slots = self.slot_of[pages]
        had = slots >= 0
        self.page_in[slots[had]] = -1
        self.last_used[slots[had]] = -1
        self.slot_of[pages[had]] = -1
        return pages[had]


def survivor_pages(positions: np.ndarray, page_size: int) -> np.ndarray:
    """Distinct logical pages of ascending token positions (a stage's survivors).

        >>> survivor_pages(np.array([3, 4, 17, 18, 40]), 16).tolist()
        [0, 1, 2]
    """
    pages = positions // page_size
    return pages[np.r_[True, pages[1:] != pages[:-1]]] if pages.size else pages


@dataclass
class _Pending:
    """Stage-1 survivors of one layer's decode rows on their way to the host."""

    layer: int  # index into OffloadPageCache.layers
    seq_ids: list[int]
    selected: torch.Tensor  # int32 [rows, k1] (CPU; filled once ``done``)
    lens: torch.Tensor  # int32 [rows]
    done: torch.cuda.Event | None  # None on CPU (the copy was synchronous)


@dataclass
class CacheStats:
    needed: int = 0  # host pages stage-1 survivors lay on, summed over admits
    hits: int = 0  # of those, pages that already had a copy
    copied: int = 0
    evicted: int = 0
    invalidated: int = 0
    host_s: float = 0.0  # host time in collect and apply

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.needed if self.needed else 0.0


@dataclass
class OffloadPageCache:
    """Runtime side: the reserved pool pages, the layers' maps and LRUs, and the per-step
    collect (after a step's kernels) / apply (before the next step's) cycle."""

    layers: list  # the offloaded attention modules (host_kv, k_cache, v_cache, k_scale, v_scale, sparse)
    pool_pages: list[int]  # reserved GPU pool page of each slot
    page_size: int
    device: torch.device
    lru: list[LruPages] = field(init=False)
    stats: CacheStats = field(default_factory=CacheStats)
    _pending: list[_Pending] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pool = torch.tensor(self.pool_pages, dtype=torch.int32)
        self.lru = []
        for a in self.layers:
            self.lru.append(LruPages(len(self.pool_pages), a.host_kv.num_pages, on_repeat=True))
            a.host_kv.gpu_pages = torch.full((a.host_kv.num_pages,), -1, dtype=torch.int32, device=self.device)

    @property
    def capacity(self) -> int:
        return len(self.pool_pages)

    def collect(self, host_plans: list, seqs: list) -> None:
        """After a step's kernels are queued: for every layer whose stage 1 was recomputed by some
        decode row in ``host_plans`` (the step's SparseStepHost, one per fused decode step; rows
        index ``seqs``), start copying those rows' survivors to the host."""
        t0 = time.perf_counter()
        rows: dict[int, dict[int, int]] = {}  # layer -> {slot: seq_id}
        for h in host_plans:
            if h is None or not h.decode_rows:
                continue
            for k, a in enumerate(self.layers):
                g = a.sparse.group
                for r, b in enumerate(h.decode_rows):
                    if h.decode_first_stage[r][g] == 0:
                        rows.setdefault(k, {})[h.decode_slots[r]] = seqs[b].seq_id
        on_gpu = self.device.type == "cuda"
        for k, slot_seq in rows.items():
            cache = self.layers[k].sparse.cache
            # one row per slot into pinned memory, queued on the stream: no host wait here
            sel = torch.empty((len(slot_seq), cache.selected[0].shape[1]), dtype=torch.int32, pin_memory=on_gpu)
            lens = torch.empty(len(slot_seq), dtype=torch.int32, pin_memory=on_gpu)
            for i, slot in enumerate(slot_seq):
                sel[i].copy_(cache.selected[0][slot], non_blocking=on_gpu)
                lens[i:i + 1].copy_(cache.lens[0][slot:slot + 1], non_blocking=on_gpu)
            done = None
            if on_gpu:
                done = torch.cuda.Event()
                done.record()
            self._pending.append(_Pending(k, list(slot_seq.values()), sel, lens, done))
        self.stats.host_s += time.perf_counter() - t0

    def apply(self, kv) -> None:
        """Before a step's kernels: drop the copies of host pages freed since the last step, then
        admit the pages of the survivors collected after the last step (``kv``: the
        KVCacheManager, for the requests' current tables)."""
        t0 = time.perf_counter()
        freed = kv.pop_freed_host_pages("global")
        if freed:
            pages = np.unique(np.asarray(freed, dtype=np.int64))
            for a, lru in zip(self.layers, self.lru):
                gone = lru.invalidate(pages)
                if gone.size:
                    a.host_kv.gpu_pages[torch.from_numpy(gone).to(self.device)] = -1
                    self.stats.invalidated += int(gone.size)
        pending, self._pending = self._pending, []
        for item in pending:
            if item.done is not None:
                item.done.synchronize()  # normally long done: the step that queued it has sampled
            needed = []
            for seq_id, sel, n in zip(item.seq_ids, item.selected.numpy(), item.lens.tolist()):
                table = kv.page_list(seq_id, "global")  # a list of up to max_seq_len / page_size ints
                logical = survivor_pages(sel[:n].astype(np.int64), self.page_size)
                logical = logical[logical < len(table)].tolist()  # none left if it finished since
                if not logical:
                    continue
                # only the survivors' entries (converting the whole table costs ms at 1M tokens)
                entries = np.array([table[i] for i in logical], dtype=np.int64)
                needed.append(-1 - entries[entries < 0])
            if needed:
                self._admit(item.layer, np.unique(np.concatenate(needed)))
        self.stats.host_s += time.perf_counter() - t0

    def _admit(self, k: int, needed: np.ndarray) -> None:
        a, lru = self.layers[k], self.lru[k]
        self.stats.needed += int(needed.size)
        self.stats.hits += int((lru.slot_of[needed] >= 0).sum())
        evicted, admitted, slots = lru.admit(needed)
        if admitted.size == 0:
            return
        self.stats.copied += int(admitted.size)
        self.stats.evicted += int(evicted.size)
        dst = self._pool[torch.from_numpy(slots)]
        host = torch.from_numpy(admitted)
        index = self._to_device(torch.cat([torch.from_numpy(evicted), host]))
        value = self._to_device(torch.cat([torch.full((evicted.size,), -1, dtype=torch.int32), dst]))
        # stream order: the map changes and the copies land before the next kernel reads either
        a.host_kv.gpu_pages[index] = value
        copy_pages(a.k_cache, a.v_cache, a.k_scale, a.v_scale, self._to_device((-1 - host).to(torch.int32)),
                   self._to_device(dst), a.host_kv)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device without a stream sync (a pageable copy would wait for queued kernels)."""
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t
