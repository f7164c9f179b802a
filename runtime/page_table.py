"""One sequence's page table in one KV group, shared by the KV manager (runtime/kv_cache.py) and
its prefix cache (runtime/prefix_cache.py), which adopts cached pages into a new sequence's table."""

from __future__ import annotations

from dataclasses import dataclass, field

NULL_PAGE = 0  # page 0 of every group is reserved: released and not-yet-allocated entries point at it


@dataclass
class PageTable:
    """pages[i] holds positions i*page_size.. . Entries below ``lo`` are released (0); entries from
    ``lo`` on are allocated."""

    pages: list[int] = field(default_factory=list)
    lo: int = 0
    host_hi: int = 0  # offloading: pages [head, host_hi) have been moved (entries < 0; a cached prefix's too)
    num_hashed: int = 0  # prefix caching: logical pages [0, num_hashed) were offered to the cache
