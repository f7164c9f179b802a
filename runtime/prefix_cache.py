"""Automatic prefix caching: content-addressed full KV pages (docs/design/prefix_caching.md).

A *full* page (all ``page_size`` positions computed) is named by a chained digest:

    h[-1] = blake2b(salt)                      salt: the engine's plan identity
    h[i]  = blake2b(h[i-1] || tokens of page i)

so ``h[i]`` stands for every token up to the end of page i and the plan that computed them (a
128-bit digest: collisions are not a practical concern). Each KV group has its own pool
(:class:`PagePool`), so the group is part of the name too.

:class:`PagePool` replaces a group's plain free list in the KV manager: pages carry reference
counts (a page shared by several sequences is freed when the last one lets go); a freed page
that has a digest is not returned to the free list but kept, evictable, in LRU order, so a later
request with the same prefix can take it back. Allocation takes a free page first and evicts the
least recently freed cached page only when none is left, so cached pages never cost a running
request a page: they count as free everywhere (``num_free``). A page with a reference is never
evicted.

Offloaded KV (runtime/kv_cache.py): a group with a host pool has a second PagePool over the host
pages (entry -page in a table), with its own digests and LRU, so a document whose pages were
moved to pinned host memory stays cached there between requests. A digest may name a GPU page
and a host page at once (a page offloaded after it was named); a lookup prefers the GPU copy.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from infhip.runtime.page_table import NULL_PAGE, PageTable

_DIGEST = 16


def root_hash(salt: str) -> bytes:
    """The digest that the chain of a prompt's first page extends (the plan identity)."""
    return hashlib.blake2b(salt.encode(), digest_size=_DIGEST).digest()


def extend_chain(chain: list[bytes], root: bytes, tokens: list[int], page_size: int, num_pages: int) -> None:
    """Append to ``chain`` (digests of pages 0..len-1 of ``tokens``) up to ``num_pages`` pages."""
    first = len(chain)
    if num_pages <= first:
        return
    assert len(tokens) >= num_pages * page_size, "only full pages are hashed"
    # one conversion for all new pages (a 1M-token prompt: 62.5K pages of 16 tokens)
    data = memoryview(array("q", tokens[first * page_size:num_pages * page_size]).tobytes())
    step, prev, blake2b = 8 * page_size, chain[-1] if chain else root, hashlib.blake2b
    for off in range(0, len(data), step):
        prev = blake2b(prev + data[off:off + step], digest_size=_DIGEST).digest()
        chain.append(prev)


class PagePool:
    """Pages 1..num_pages-1 of one KV group: reference counts, and the content-addressed cache
    of freed full pages (LRU). With nothing ever registered it behaves as a PageAllocator."""

    def __init__(self, alloc, group: str = "", host: bool = False):
        """alloc: the group's PageAllocator (kv_cache.py), whose free list this pool draws on;
        group, host: whose pages these are (a label for readers: the KV group, its host pool)."""
        self._alloc, self.group, self.host = alloc, group, host
        self._refs = [0] * alloc.num_pages
        self._page_of: dict[bytes, int] = {}  # digest -> page (held or cached)
        self._hash_of: dict[int, bytes] = {}  # page -> digest
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with no reference, oldest first
        self.num_evictions = 0

    @property
    def num_pages(self) -> int:
        return self._alloc.num_pages

    @property
    def num_free(self) -> int:
        """Pages a sequence can get now: free ones and cached ones without a reference."""
        return self._alloc.num_free + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Cached pages that no sequence holds (evictable)."""
        return len(self._lru)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def free_page_ids(self) -> list[int]:
        """The pages neither held nor cached (the free list; in no particular order)."""
        return self._alloc.free_page_ids()

    def digest_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    def allocate(self) -> int:
        if self._alloc.num_free:
            page = self._alloc.allocate()
        elif self._lru:
            page, _ = self._lru.popitem(last=False)  # evict the least recently freed
            del self._page_of[self._hash_of.pop(page)]
            self.num_evictions += 1
        else:
            page = self._alloc.allocate()  # raises OutOfPages
        self._refs[page] = 1
        return page

    def free(self, page: int) -> None:
        """Drop one reference; at none the page is cached (it has a digest) or free."""
        if not (isinstance(page, int) and 0 < page < self.num_pages):
            raise ValueError(f"page {page!r} does not belong to this pool (pages 1..{self.num_pages - 1})")
        if self._refs[page] <= 0:
            raise ValueError(f"double free of KV page {page}")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._hash_of:
                self._lru[page] = None
            else:
                self._alloc.free(page)

    # ---- content addressing ----------------------------------------------------------------
    def lookup(self, digest: bytes) -> int | None:
        return self._page_of.get(digest)

    def acquire(self, page: int) -> None:
        """One more reference to a cached page (taken out of the LRU if it had none)."""
        if self._refs[page] == 0:
            del self._lru[page]
        self._refs[page] += 1

    def register(self, page: int, digest: bytes) -> None:
        """Name a held, full page by its digest (no-op if the page or the digest is named already:
        two sequences computed the same page; the first one stays the cached copy)."""
        if self._refs[page] <= 0:
            raise ValueError(f"KV page {page} is not held; only held pages are registered")
        if page not in self._hash_of and digest not in self._page_of:
            self._page_of[digest] = page
            self._hash_of[page] = digest

    def clear(self) -> None:
        """Forget every digest: cached pages return to the free list, held ones stay held."""
        for page in self._lru:
            self._alloc.free(page)
        self._lru.clear()
        self._page_of.clear()
        self._hash_of.clear()


class PrefixCache:
    """The prefix-caching part of a KV manager (runtime/kv_cache.py KVCacheManager holds one):
    which cached pages a new sequence starts with (:meth:`share`), and naming a sequence's pages
    once they are full (:meth:`register`). Off until :meth:`enable`; the LLM turns it on only for
    plans where reuse is exact (docs/design/prefix_caching.md).

    Inputs: the manager's page size and groups, and its pools by group (``gpu``; ``host`` for the
    groups with a host pool), which this object reads and names pages in. It never touches a
    sequence's page tables: share() returns the tables a new sequence starts with, register()
    is handed the sequence's tables, and the manager keeps them."""

    def __init__(self, page_size: int, groups: dict, gpu: dict[str, PagePool], host: dict[str, PagePool]):
        # groups: name -> KVGroupSpec (kv_cache.py, which imports this module); gpu / host: the
        # manager's pools by group (the same objects: pages it hands out are named here)
        self.page_size, self.groups, self._gpu, self._host = page_size, groups, gpu, host
        self.enabled = False
        self._root = b""
        self.granule_pages = 1  # a reused prefix is a multiple of this many pages
        self.cache_decode_pages = True  # name pages that decode steps filled
        self._chains: dict[int, list[bytes]] = {}  # seq_id -> digests of its first pages
        self.queries = 0  # tokens of admitted sequences looked up
        self.hits = 0  # of them, tokens found cached (not recomputed)

    def enable(self, salt: str, granule: int | None = None, cache_decode_pages: bool = True) -> None:
        """Turn reuse on; ``salt`` names the plan (pages computed under another plan never match).
        granule: a reused prefix is a multiple of this many tokens (a multiple of page_size;
        InfiniteHiP: lcm(page_size, block_q), so the suffix's query blocks fall on the grid the
        prefix's chunks used); cache_decode_pages: name pages that decode steps filled (False
        for sparse plans: sparse decode computes a position's K/V otherwise than prefill)."""
        granule = granule or self.page_size
        if granule % self.page_size:
            raise ValueError(f"granule {granule} is not a multiple of page_size {self.page_size}")
        self.enabled, self._root = True, root_hash(salt)
        self.granule_pages, self.cache_decode_pages = granule // self.page_size, cache_decode_pages

    def disable(self) -> None:
        """Turn reuse off and forget every cached page (held pages stay with their sequences)."""
        self.enabled = False
        self.clear()

    def clear(self) -> None:
        """Forget every cached page (GPU and host; held pages stay with their sequences), e.g.
        when the plan's knobs change at runtime."""
        for pool in [*self._gpu.values(), *self._host.values()]:
            pool.clear()
        self._chains.clear()

    def forget(self, seq_id: int) -> None:
        """Drop a freed sequence's digests."""
        self._chains.pop(seq_id, None)

    @property
    def evictions(self) -> int:
        """Cached pages handed out to new content since start (all groups, GPU and host)."""
        return sum(pool.num_evictions for pool in [*self._gpu.values(), *self._host.values()])

    def cached_page(self, group: str, digest: bytes, host: bool = False) -> int | None:
        """The block-table entry of the page of ``group`` that ``digest`` names (held or cached):
        its GPU page, or with ``host`` its host pool's entry (< 0); None if none is named so."""
        if not host:
            return self._gpu[group].lookup(digest)
        h = self._host[group].lookup(digest) if group in self._host else None
        return None if h is None else -h

    def page_digests(self, tokens: list[int], num_pages: int) -> list[bytes]:
        """The digests that name the first ``num_pages`` full pages of ``tokens`` under this
        cache's plan (what register() names them by and cached_prefix() looks up)."""
        chain: list[bytes] = []
        extend_chain(chain, self._root, tokens, self.page_size, num_pages)
        return chain

    def _lookup(self, group: str, digest: bytes, host: bool) -> int | None:
        """Table entry of a cached page: its GPU page (preferred), else with ``host`` its host
        entry (< 0), else None."""
        page = self._gpu[group].lookup(digest)
        if page is None and host and group in self._host:
            h = self._host[group].lookup(digest)
            return None if h is None else -h
        return page

    def _window_start(self, group: str, start: int) -> int:
        """First logical page a chunk starting at ``start`` reads in ``group``."""
        window = self.groups[group].window
        return max(0, start - window + 1) // self.page_size if window else 0

    def cached_prefix(self, tokens: list[int]) -> tuple[int, list[bytes]]:
        """(n, chain): the longest prefix of n full pages (n * page_size <= len(tokens) - 1: the
        last token is always computed, for its logits; n a multiple of the granule) whose pages
        every group can reuse — a full-attention group needs all n pages, a windowed group the
        pages of the window before position n * page_size — and the digests computed on the way.
        Host pages count only for a prefix of at least the group's ``min_context`` (a shorter
        context may still run dense kernels, which do not read host pages)."""
        ps, chain = self.page_size, []
        m = (len(tokens) - 1) // ps
        full = [g for g, spec in self.groups.items() if spec.window is None]
        if full:
            # hash ahead in batches (a long prompt usually hits all the way) and stop at the first miss
            maps = [(self._gpu[g]._page_of, self._host[g]._page_of if g in self._host else {}) for g in full]
            n, batch = 0, 64
            while n < m:
                extend_chain(chain, self._root, tokens, ps, min(m, n + batch))
                if len(maps) == 1:  # one full-attention group (every model but a hybrid's sliding one)
                    gpu, host = maps[0]
                    while n < len(chain) and (chain[n] in gpu or chain[n] in host):
                        n += 1
                while n < len(chain) and all(chain[n] in gpu or chain[n] in host for gpu, host in maps):
                    n += 1
                if n < len(chain):
                    break
                batch *= 2
        else:
            extend_chain(chain, self._root, tokens, ps, m)
            n = m
        for g in full:  # a prefix below min_context: GPU pages only
            off = self.groups[g].offload
            if off is not None and n * ps < off.min_context:
                n = next((j for j in range(n) if self._lookup(g, chain[j], host=False) is None), n)
        step = self.granule_pages
        n -= n % step
        windowed = [g for g, spec in self.groups.items() if spec.window is not None]
        while n and not all(self._gpu[g].lookup(chain[j]) is not None
                            for g in windowed for j in range(self._window_start(g, n * ps), n)):
            n -= step
        return n, chain

    def share(self, seq_id: int, tokens: list[int]) -> tuple[int, dict[str, PageTable]]:
        """The cached pages of the longest reusable prefix of the new sequence ``seq_id`` (all of
        its tokens: ``tokens``), acquired for it: (tokens they hold, the page table it starts
        with per group); (0, {}) for none, or with caching off. The caller keeps the tables and
        frees their pages as its own (they go back to the cache)."""
        if not self.enabled:
            return 0, {}
        n, chain = self.cached_prefix(tokens)
        self._chains[seq_id] = chain
        if not n:
            return 0, {}
        tables = {}
        for g in self.groups:
            lo = self._window_start(g, n * self.page_size)
            pages = [NULL_PAGE] * lo
            gpu, host = self._gpu[g], self._host.get(g)
            for j in range(lo, n):
                page = gpu.lookup(chain[j])
                if page is not None:
                    gpu.acquire(page)
                else:  # cached_prefix checked it is on the host
                    page = host.lookup(chain[j])
                    host.acquire(page)
                    page = -page
                pages.append(page)
            # offloading: logical pages [head, host_hi) are on the host (kv_cache.offload moves on from there)
            host_hi = 0
            if self.groups[g].offload is not None:
                host_hi = -(-self.groups[g].offload.head_tokens // self.page_size)
                while host_hi < n and pages[host_hi] < 0:
                    host_hi += 1
            tables[g] = PageTable(pages=pages, lo=lo, num_hashed=n, host_hi=host_hi)
        return n * self.page_size, tables

    def register(self, seq_id: int, tables: dict[str, PageTable], tokens: list[int], num_computed: int) -> None:
        """Name the pages of ``seq_id`` (its page table per group: ``tables``) that are full now
        that its first ``num_computed`` tokens (of ``tokens``) are computed, so later sequences
        can reuse them."""
        if not self.enabled:
            return
        full = num_computed // self.page_size
        chain = self._chains.setdefault(seq_id, [])
        extend_chain(chain, self._root, tokens, self.page_size, full)
        for g, t in tables.items():
            for i in range(max(t.num_hashed, t.lo), min(full, len(t.pages))):
                page = t.pages[i]  # on the GPU, or already moved to the host (< 0)
                (self._gpu[g] if page > 0 else self._host[g]).register(abs(page), chain[i])
            t.num_hashed = max(t.num_hashed, full)

    def record_admission(self, num_tokens: int, cached: int) -> None:
        self.queries += num_tokens
        self.hits += cached
