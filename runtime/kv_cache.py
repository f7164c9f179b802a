"""Paged KV-cache bookkeeping: which physical page holds which positions of which sequence.

No tensors here. The executor allocates, per layer, a cache ``[num_pages, page_size, Hkv, D]``
for keys and one for values, with ``num_pages`` from the layer's KV group, and reads/writes it
through the block tables and slot mappings computed here.

Page 0 of every group is a reserved *null page*: never handed out, so padding entries of block
tables / slot mappings (and entries of released pages) can point at it harmlessly.

A *KV group* is a set of layers sharing one page table per sequence: Llama has one "global"
group; Gemma-3 has "global" and "sliding" (window W). A query at position p of a windowed group
needs keys p-W+1..p only, so pages whose positions all lie before the window of the next chunk's
first query are released early: such a group holds at most ``pages_for(W, ...)`` pages per
sequence however long it grows.

KV offloading (plugins/kv_offload.py): a full-attention group may have a host pool
(:class:`OffloadSpec`). Once a sequence's context reaches ``min_context`` (the InfiniteHiP
threshold: every later step of it reads its keys through the sparse kernels, which follow
host entries), its pages between the first ``head_tokens`` (sink) and the last ``tail_tokens``
(stream) move to host pages (:meth:`KVCacheManager.offload`); the table names a host page by an
entry < 0 (host page -1 - entry), and the GPU page returns to the free list. So the GPU holds
about head + tail + one chunk per sequence however long it grows, the host the rest. With prefix
caching the host pool is a PagePool too: offloaded pages stay cached on the host after their
sequence ends (docs/design/prefix_caching.md, "Offloaded KV").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from infhip.runtime.page_table import NULL_PAGE, PageTable
from infhip.runtime.prefix_cache import PagePool, PrefixCache


class OutOfPages(RuntimeError):
    """No free page left (transient: the scheduler preempts or waits)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Free list of the pages 1..num_pages-1 of one KV group (page 0 is the null page)."""

    def __init__(self, num_pages: int):
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 2:
            raise ValueError(f"PageAllocator.num_pages must be an int >= 2 (page 0 is reserved), "
                             f"got {num_pages!r}")
        self._num_pages = num_pages
        # A stack: pop() hands out the lowest page first; freed pages are reused first (LIFO).
        self._free = list(range(num_pages - 1, 0, -1))
        self._is_free = bytearray([0] + [1] * (num_pages - 1))

    @property
    def num_pages(self) -> int:
        """All pages, the null page included (the first dimension of the cache tensors)."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_page_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfPages(f"all {self._num_pages - 1} KV pages are in use")
        page = self._free.pop()
        self._is_free[page] = 0
        return page

    def free(self, page: int) -> None:
        if page == NULL_PAGE:
            raise ValueError("page 0 is the reserved null page; it is never allocated or freed")
        if not (isinstance(page, int) and 0 < page < self._num_pages):
            raise ValueError(f"page {page!r} does not belong to this allocator "
                             f"(pages 1..{self._num_pages - 1})")
        if self._is_free[page]:
            raise ValueError(f"double free of KV page {page}")
        self._is_free[page] = 1
        self._free.append(page)


@dataclass(frozen=True)
class OffloadSpec:
    """Host pool of a full-attention group: ``host_pages`` pages; a sequence whose context is at
    least ``min_context`` keeps its first ``head_tokens`` and last ``tail_tokens`` tokens' pages on
    the GPU and moves the others, at least ``batch_pages`` at a time (fewer copies and table
    re-uploads; the GPU holds up to batch_pages - 1 pages more per sequence)."""

    host_pages: int
    head_tokens: int
    tail_tokens: int
    min_context: int
    batch_pages: int = 16

    def __post_init__(self) -> None:
        for name in ("host_pages", "batch_pages"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"OffloadSpec.{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("head_tokens", "tail_tokens", "min_context"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"OffloadSpec.{name} must be an int >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class KVGroupSpec:
    num_pages: int  # physical pages, the null page included
    window: int | None  # sliding window (keys p-window+1..p), None = full attention
    offload: OffloadSpec | None = None  # host pool (full attention only)

    def __post_init__(self) -> None:
        if self.offload is not None and self.window is not None:
            raise ValueError("KV offloading is for full-attention groups (window None)")
        if isinstance(self.num_pages, bool) or not isinstance(self.num_pages, int) \
                or self.num_pages < 2:
            raise ValueError(f"KVGroupSpec.num_pages must be an int >= 2, got {self.num_pages!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"KVGroupSpec.window must be None or an int >= 1, got {self.window!r}")


class KVCacheManager:
    """Page tables of every sequence in every group. Pages are reference counted and full pages
    may be shared through the prefix cache (``prefix``, runtime/prefix_cache.py PrefixCache; off
    unless enabled; the methods below under "prefix caching" are its front)."""

    def __init__(self, page_size: int, groups: dict[str, KVGroupSpec], max_pages_per_seq: int):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"KVCacheManager.page_size must be an int >= 1, got {page_size!r}")
        if not groups or not all(isinstance(g, KVGroupSpec) for g in groups.values()):
            raise ValueError("KVCacheManager.groups must be a non-empty dict name -> KVGroupSpec")
        if isinstance(max_pages_per_seq, bool) or not isinstance(max_pages_per_seq, int) \
                or max_pages_per_seq < 1:
            raise ValueError(f"KVCacheManager.max_pages_per_seq must be an int >= 1, "
                             f"got {max_pages_per_seq!r}")
        self.page_size = page_size
        self.groups = dict(groups)
        self.max_pages_per_seq = max_pages_per_seq
        self._alloc = {name: PagePool(PageAllocator(spec.num_pages), name)
                       for name, spec in self.groups.items()}
        # Host pools: host page h is entry -(h + 1), so allocator page p (1..host_pages) is entry -p.
        self._host = {name: PagePool(PageAllocator(spec.offload.host_pages + 1), name, host=True)
                      for name, spec in self.groups.items() if spec.offload is not None}
        self._tables: dict[str, dict[int, PageTable]] = {name: {} for name in self.groups}
        self.prefix = PrefixCache(page_size, self.groups, self._alloc, self._host)

    # ---- sizing -------------------------------------------------------------------------
    @staticmethod
    def pages_for(spec_window: int | None, page_size: int, max_seq_len: int, max_chunk: int,
                  offload: OffloadSpec | None = None) -> int:
        """GPU pages one sequence may hold at once in a group: all of its ceil(len / page_size)
        pages, or for a window W with chunks of <= max_chunk tokens the pages spanning positions
        start-W+1 .. start+chunk-1, at most ceil((W - 1 + max_chunk) / page_size) + 1. With
        offloading: everything until the context reaches min_context (a chunk may end up to
        chunk - 1 tokens past it), then head + tail + one chunk + a batch not yet moved."""
        full = _cdiv(max_seq_len, page_size)
        chunk = min(max_chunk, max_seq_len)
        if offload is not None:
            before = _cdiv(min(max_seq_len, offload.min_context - 1 + chunk), page_size)
            after = (_cdiv(offload.head_tokens, page_size) + _cdiv(offload.tail_tokens + chunk, page_size)
                     + offload.batch_pages + 1)
            return min(full, max(before, after))
        if spec_window is None:
            return full
        return min(full, _cdiv(spec_window - 1 + chunk, page_size) + 1)

    def pages_needed(self, group: str, num_tokens: int, max_chunk: int | None = None) -> int:
        """Pages a sequence growing to ``num_tokens`` tokens in chunks of <= ``max_chunk`` (default:
        all at once) holds at most in ``group``."""
        spec = self._spec(group)
        return self.pages_for(spec.window, self.page_size, num_tokens,
                              num_tokens if max_chunk is None else max_chunk, spec.offload)

    def host_pages_needed(self, group: str, num_tokens: int) -> int:
        """Host pages a sequence of ``num_tokens`` tokens may hold in ``group`` (0 without a host pool)."""
        off = self._spec(group).offload
        return 0 if off is None else max(0, _cdiv(num_tokens, self.page_size) - _cdiv(off.head_tokens, self.page_size))

    def num_free_pages(self, group: str) -> int:
        self._spec(group)
        return self._alloc[group].num_free

    # ---- allocation ---------------------------------------------------------------------
    def _spec(self, group: str) -> KVGroupSpec:
        if group not in self.groups:
            raise ValueError(f"unknown KV group {group!r}; groups are {sorted(self.groups)}")
        return self.groups[group]

    def _plan(self, seq_id: int, start: int, end: int) -> dict[str, tuple[int, int, int]]:
        """Per group (keep_from, num_release, num_new) for computing positions [start, end)."""
        if not 0 <= start < end:
            raise ValueError(f"need 0 <= start < end, got start={start}, end={end}")
        if end > self.max_pages_per_seq * self.page_size:
            raise ValueError(
                f"position {end - 1} of sequence {seq_id} is beyond the page table "
                f"({self.max_pages_per_seq} pages x {self.page_size} = "
                f"{self.max_pages_per_seq * self.page_size} positions); raise max_seq_len")
        plan = {}
        last = (end - 1) // self.page_size  # last logical page the chunk writes
        for name, spec in self.groups.items():
            t = self._tables[name].get(seq_id) or PageTable()
            # First logical page still needed: it holds key start-W+1 of the chunk's first query.
            keep_from = max(0, start - spec.window + 1) // self.page_size if spec.window else 0
            if keep_from < t.lo:
                raise ValueError(
                    f"sequence {seq_id} group {name!r}: positions from {keep_from * self.page_size} "
                    f"were already released (a sequence only moves forward; free it and recompute)")
            # pages released and free again (a page shared with another sequence stays held)
            pool = self._alloc[name]
            num_release = sum(pool.refs(p) == 1 for p in t.pages[t.lo:min(keep_from, len(t.pages))])
            num_new = max(0, last + 1 - max(len(t.pages), keep_from))
            plan[name] = (keep_from, num_release, num_new)
        return plan

    def can_append(self, seq_id: int, start: int, end: int) -> bool:
        """Could ``seq_id`` compute positions [start, end) now, in every group?"""
        plan = self._plan(seq_id, start, end)
        return all(new <= self._alloc[g].num_free + rel for g, (_, rel, new) in plan.items())

    def append(self, seq_id: int, start: int, end: int) -> None:
        """Give ``seq_id`` pages for positions [start, end), first releasing the pages a windowed
        group no longer needs. All-or-nothing: raises OutOfPages and changes nothing if any
        group lacks pages."""
        plan = self._plan(seq_id, start, end)
        for g, (_, rel, new) in plan.items():
            if new > self._alloc[g].num_free + rel:
                raise OutOfPages(f"sequence {seq_id} needs {new} new KV pages in group {g!r} "
                                 f"for positions [{start}, {end}); "
                                 f"{self._alloc[g].num_free + rel} available")
        for g, (keep_from, _, new) in plan.items():
            t = self._tables[g].setdefault(seq_id, PageTable())
            alloc = self._alloc[g]
            for i in range(t.lo, min(keep_from, len(t.pages))):
                alloc.free(t.pages[i])
                t.pages[i] = NULL_PAGE
            if keep_from > len(t.pages):  # never-allocated pages before the window
                t.pages.extend([NULL_PAGE] * (keep_from - len(t.pages)))
            t.lo = max(t.lo, keep_from)
            t.pages.extend(alloc.allocate() for _ in range(new))

    def free(self, seq_id: int) -> None:
        """Release every page of ``seq_id`` (no-op for an unknown id)."""
        self.prefix.forget(seq_id)
        for g, tables in self._tables.items():
            t = tables.pop(seq_id, None)
            if t is not None:
                # last page first: the LRU then evicts a prefix from its end, keeping its start usable
                for page in reversed(t.pages[t.lo:]):
                    if page < 0:
                        self._host[g].free(-page)
                    else:
                        self._alloc[g].free(page)

    # ---- prefix caching (runtime/prefix_cache.py PrefixCache) -------------------------------
    @property
    def prefix_caching(self) -> bool:
        return self.prefix.enabled

    @property
    def granule_pages(self) -> int:
        """A reused prefix is a multiple of this many pages."""
        return self.prefix.granule_pages

    @property
    def cache_decode_pages(self) -> bool:
        """Whether pages that decode steps filled are named for reuse."""
        return self.prefix.cache_decode_pages

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens of admitted sequences looked up."""
        return self.prefix.queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of them, tokens found cached (not recomputed)."""
        return self.prefix.hits

    @property
    def prefix_cache_evictions(self) -> int:
        """Cached pages handed out to new content since start (all groups, GPU and host)."""
        return self.prefix.evictions

    # why this engine cannot reuse prefixes (its model keeps state that pages do not hold), or None
    refuse_prefix_caching: str | None = None

    def enable_prefix_caching(self, salt: str, granule: int | None = None, cache_decode_pages: bool = True) -> None:
        """PrefixCache.enable: reuse on under plan ``salt``, prefixes a multiple of ``granule`` tokens;
        refused (logged once, caching stays off) when ``refuse_prefix_caching`` says why."""
        if self.refuse_prefix_caching is not None:
            logging.getLogger("infhip").warning(self.refuse_prefix_caching)
            return
        self.prefix.enable(salt, granule, cache_decode_pages)

    def disable_prefix_caching(self) -> None:
        """Turn reuse off and forget every cached page (held pages stay with their sequences)."""
        self.prefix.disable()

    def clear_prefix_cache(self) -> None:
        """Forget every cached page (GPU and host; held pages stay with their sequences)."""
        self.prefix.clear()

    def num_cached_pages(self, group: str) -> int:
        """Pages of ``group`` that hold cached content and no sequence (counted as free)."""
        self._spec(group)
        return self._alloc[group].num_cached

    def num_cached_host_pages(self, group: str) -> int:
        """Host pages of ``group`` that hold cached content and no sequence (counted as free)."""
        self._spec(group)
        return self._host[group].num_cached if group in self._host else 0

    def cached_page(self, group: str, digest: bytes, host: bool = False) -> int | None:
        """The block-table entry of the page of ``group`` that ``digest`` names (PrefixCache.cached_page)."""
        self._spec(group)
        return self.prefix.cached_page(group, digest, host)

    def page_digest(self, group: str, entry: int) -> bytes | None:
        """The digest naming the page a block-table entry of ``group`` names (entry > 0: a GPU
        page, < 0: a host page); None: the page is not named."""
        return self._pool_of(group, entry).digest_of(abs(entry))

    def page_digests(self, tokens: list[int], num_pages: int) -> list[bytes]:
        """The digests naming the first ``num_pages`` full pages of ``tokens`` (PrefixCache.page_digests)."""
        return self.prefix.page_digests(tokens, num_pages)

    def cached_prefix(self, tokens: list[int]) -> tuple[int, list[bytes]]:
        """(n, chain): the longest reusable prefix of n full pages (PrefixCache.cached_prefix)."""
        return self.prefix.cached_prefix(tokens)

    def share(self, seq_id: int, tokens: list[int]) -> int:
        """Start the new sequence ``seq_id`` (all of its tokens: ``tokens``) with the cached pages
        of its longest reusable prefix; returns how many tokens they hold (0: none, or caching
        off). Undo with free() (the pages go back to the cache)."""
        if self.prefix.enabled and any(seq_id in tables for tables in self._tables.values()):
            raise ValueError(f"sequence {seq_id} already holds pages; share() is for new sequences")
        num_tokens, tables = self.prefix.share(seq_id, tokens)
        for g, t in tables.items():
            self._tables[g][seq_id] = t
        return num_tokens

    def register(self, seq_id: int, tokens: list[int], num_computed: int) -> None:
        """Name the pages of ``seq_id`` that are full now that its first ``num_computed`` tokens
        (of ``tokens``) are computed, so later sequences can reuse them."""
        if not self.prefix.enabled:
            return
        tables = {g: t for g, by_seq in self._tables.items() if (t := by_seq.get(seq_id)) is not None}
        self.prefix.register(seq_id, tables, tokens, num_computed)

    def record_admission(self, num_tokens: int, cached: int) -> None:
        self.prefix.record_admission(num_tokens, cached)

    # ---- views for the executor ---------------------------------------------------------
    def block_table(self, seq_id: int, group: str) -> list[int]:
        """Physical page of each logical page so far (0 = released / never allocated)."""
        self._spec(group)
        t = self._tables[group].get(seq_id)
        return list(t.pages) if t is not None else []

    def page_list(self, seq_id: int, group: str) -> list[int]:
        """The live page table of block_table (no copy; read it, never modify it). It only grows
        at the end or has entries released to 0 at the front until the sequence is freed; a
        re-admitted sequence, and one whose pages were just offloaded, gets a new list, so (list
        identity, length) tells a reader what changed since it last looked
        (runtime/cuda_graphs.py stages only new entries)."""
        self._spec(group)
        t = self._tables[group].get(seq_id)
        return t.pages if t is not None else []

    # ---- read-outs (tests, debugging): pages by block-table entry, > 0 GPU, < 0 host ----------
    def _pool_of(self, group: str, entry: int) -> PagePool:
        self._spec(group)
        if entry < 0 and group not in self._host:
            raise ValueError(f"KV group {group!r} has no host pool; entry {entry} names none of its pages")
        return self._host[group] if entry < 0 else self._alloc[group]

    def page_refs(self, group: str, entry: int) -> int:
        """How many sequences hold the page a block-table entry of ``group`` names (entry > 0: a
        GPU page; < 0: host page -1 - entry); 0 for a free or cached page."""
        return self._pool_of(group, entry).refs(abs(entry))

    def held_pages(self, group: str) -> dict[int, int]:
        """Every page of ``group`` some sequence holds, by block-table entry (GPU pages, then host
        entries < 0) -> its reference count; {} when no sequence holds a page."""
        self._spec(group)
        pools = [(1, self._alloc[group])] + ([(-1, self._host[group])] if group in self._host else [])
        return {sign * p: pool.refs(p) for sign, pool in pools for p in range(pool.num_pages) if pool.refs(p)}

    def free_page_ids(self, group: str, host: bool = False) -> list[int]:
        """The pages of ``group`` that no sequence holds and the prefix cache does not keep, as
        block-table entries: GPU pages, or with ``host`` the host pool's (entries < 0; host page
        -1 - entry). In no particular order."""
        pool = self._pool_of(group, -1 if host else 1)
        return [-p for p in pool.free_page_ids()] if host else pool.free_page_ids()

    def num_pages_held(self, seq_id: int, group: str) -> int:
        self._spec(group)
        t = self._tables[group].get(seq_id)
        return len(t.pages) - t.lo if t is not None else 0

    def slot_mapping(self, seq_id: int, group: str, start: int, end: int) -> list[int]:
        """Flat cache slot ``page * page_size + offset`` of each position in [start, end)."""
        self._spec(group)
        t = self._tables[group].get(seq_id) or PageTable()
        ps = self.page_size
        if not 0 <= start <= end or (end > start and not (
                t.lo * ps <= start and end <= len(t.pages) * ps)):
            raise ValueError(f"sequence {seq_id} group {group!r} holds pages for positions "
                             f"[{t.lo * ps}, {len(t.pages) * ps}), not all of [{start}, {end}); "
                             f"call append() first")
        slots: list[int] = []
        pos = start
        while pos < end:  # one range per page: fast for long chunks
            i, off = divmod(pos, ps)
            n = min(ps - off, end - pos)
            if t.pages[i] < 0:
                raise ValueError(f"sequence {seq_id} group {group!r}: position {pos} is on an offloaded "
                                 f"(host) page; new tokens are written to GPU pages only")
            base = t.pages[i] * ps
            slots.extend(range(base + off, base + off + n))
            pos += n
        return slots

    # ---- offloading (plugins/kv_offload.py) ---------------------------------------------
    def num_free_host_pages(self, group: str) -> int:
        self._spec(group)
        return self._host[group].num_free if group in self._host else 0

    def offload(self, seq_id: int, group: str, context: int) -> tuple[list[int], list[int]]:
        """Move the pages of ``seq_id`` that the group's OffloadSpec lets go, now that it holds
        ``context`` tokens: returns (GPU pages, host entries), pairwise, for the caller to copy
        *before* any later kernel may reuse the GPU pages (copy_pages, same stream). The table
        becomes a new list (so readers that cache by list identity re-read it) naming the host
        entries; the GPU pages are free (or cached, if named). Nothing moves below min_context,
        while fewer than batch_pages pages are eligible, or beyond the host pool's free pages
        (those stay on the GPU: the pool is full, not an error). Prefix caching: a named page
        whose digest the host pool caches already takes that host page (no copy); a copied one
        is named on the host too; host entries that a shared prefix put in the range are skipped."""
        off = self._spec(group).offload
        t = self._tables[group].get(seq_id)
        if off is None or t is None or context < off.min_context:
            return [], []
        ps = self.page_size
        head = _cdiv(off.head_tokens, ps)
        hi = min(len(t.pages), max(0, context - off.tail_tokens) // ps)  # pages wholly before the tail
        pages = t.pages
        lo = max(t.host_hi, head, t.lo)
        while lo < hi and pages[lo] < 0:  # already on the host (shared from the prefix cache)
            lo += 1
        # GPU pages to move; a prefix-cache hit may leave host pages among them (skipped)
        todo = [i for i in range(lo, hi) if pages[i] > 0]
        if len(todo) < off.batch_pages:
            t.host_hi = max(t.host_hi, lo)
            return [], []
        gpu, host = self._alloc[group], self._host[group]
        pages, src, dst, moved_to = list(pages), [], [], lo
        for i in todo:
            page = pages[i]
            digest = gpu.digest_of(page)
            h = host.lookup(digest) if digest is not None else None
            if h is not None:  # the same content is cached on the host already: share it, no copy
                host.acquire(h)
            elif host.num_free:
                h = host.allocate()  # may evict a cached host page (none of them is held)
                if digest is not None:
                    host.register(h, digest)
                src.append(page)
                dst.append(-h)
            else:  # the host pool is full: the rest stays on the GPU (not an error)
                break
            pages[i] = -h
            gpu.free(page)  # a named page stays cached on the GPU too
            moved_to = i + 1
        t.pages, t.host_hi = pages, moved_to
        return src, dst
