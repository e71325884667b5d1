"""The free blocks of one stream in a pool: a cache by size class before coalescing segregated-fit
lists (docs/internals.md, Suballocators). Not here: streams, growth, locking (pool.py)."""

from __future__ import annotations

from collections.abc import Container, Hashable

from dask_rmm.mr.size_classes import (
    INSERT_CLASS,
    N_CLASSES,
    TABLE_UNITS,
    UNIT_SHIFT,
    drain_cache,
    insert_class,
    search_class,
)
from dask_rmm.stream import Stream

__all__ = ["FreeList"]


class FreeList:
    """The free blocks of the stream of order ``key``, kept alive (None: fresh memory) to order
    work after it later; blocks never merge across ``barriers`` (shared, not copied). Methods
    run under the pool's lock."""

    __slots__ = ("bins", "nonempty", "starts", "ends", "stream", "key", "cache", "barriers")

    def __init__(self, key: Hashable, stream: Stream | None, barriers: Container[int] = ()) -> None:
        self.cache: list[list[int]] = [[] for _ in range(N_CLASSES)]  # a LIFO list per class
        # Every class dict made now: making one under the pool's lock could run the collector.
        self.bins: list[dict[int, int]] = [{} for _ in range(N_CLASSES)]
        self.nonempty = bytearray(N_CLASSES)  # 1 where bins[c] has blocks
        self.starts: dict[int, int] = {}  # start -> size
        self.ends: dict[int, int] = {}  # end -> start
        self.stream = stream
        self.key = key
        self.barriers = barriers

    def take(self, search: int, size: int) -> int:
        """A block of ``size`` bytes (a request of search class ``search``): a cached one, else
        the front of a coalesced block of a class at or above ``search``; 0 when there is none.
        The pool's locked fast path, hence inlined (no calls below 16 MiB)."""
        cached = self.cache[search]
        if cached:
            try:
                return cached.pop()
            except IndexError:  # taken by a lock-free caller meanwhile
                pass
        nonempty = self.nonempty
        c = nonempty.find(1, search)
        if c < 0:
            return 0
        b = self.bins[c]
        ptr, bsize = b.popitem()
        del self.starts[ptr]
        rest = bsize - size
        if not rest:
            del self.ends[ptr + bsize]
            if not b:
                nonempty[c] = 0
            return ptr
        r = ptr + size
        self.starts[r] = rest
        self.ends[r + rest] = r
        u = rest >> UNIT_SHIFT
        rc = INSERT_CLASS[u] if u < TABLE_UNITS else insert_class(u)
        if rc != c:
            if not b:
                nonempty[c] = 0
            b = self.bins[rc]
            nonempty[rc] = 1
        b[r] = rest
        return ptr

    def insert(self, ptr: int, size: int) -> None:
        """File a free block, merging it with free neighbours of this list (not across barriers)."""
        starts = self.starts
        nxt = ptr + size
        ns = starts.get(nxt)
        if ns is not None and nxt not in self.barriers:
            self.remove(nxt, ns)
            size += ns
        prev = self.ends.get(ptr)
        if prev is not None and ptr not in self.barriers:
            ps = starts[prev]
            self.remove(prev, ps)
            ptr = prev
            size += ps
        starts[ptr] = size
        self.ends[ptr + size] = ptr
        u = size >> UNIT_SHIFT
        c = INSERT_CLASS[u] if u < TABLE_UNITS else insert_class(u)
        self.bins[c][ptr] = size
        self.nonempty[c] = 1

    def remove(self, ptr: int, size: int) -> None:
        """Take the free block ``ptr`` of ``size`` bytes out of the coalescing lists."""
        del self.starts[ptr]
        del self.ends[ptr + size]
        u = size >> UNIT_SHIFT
        c = INSERT_CLASS[u] if u < TABLE_UNITS else insert_class(u)
        b = self.bins[c]
        del b[ptr]
        if not b:
            self.nonempty[c] = 0

    def find(self, size: int) -> tuple[int, int] | None:
        """``(ptr, block size)`` of a coalesced block that fits ``size`` bytes, or None: the
        first block of the first non-empty class at or above the request's search class (a good
        fit), else a fitting block of the request's own class."""
        u = size >> UNIT_SHIFT
        search = search_class(u)
        c = self.nonempty.find(1, search)
        if c >= 0:
            return next(iter(self.bins[c].items()))
        own = insert_class(u)
        if own != search and self.nonempty[own]:
            for ptr, bsize in self.bins[own].items():
                if bsize >= size:
                    return ptr, bsize
        return None

    def take_fit(self, size: int) -> int:
        """The front ``size`` bytes of the block :meth:`find` finds, the rest staying free; 0
        when none fits."""
        found = self.find(size)
        if found is None:
            return 0
        ptr, bsize = found
        self.remove(ptr, bsize)
        if bsize > size:
            self.insert(ptr + size, bsize - size)
        return ptr

    def move_all_to(self, dst: FreeList) -> None:
        """Move every coalesced block to ``dst``, merging there."""
        for ptr, size in list(self.starts.items()):
            self.remove(ptr, size)
            dst.insert(ptr, size)

    def flush_cache(self) -> bool:
        """Merge every cached block into the coalescing lists; True when any was cached."""
        flushed = False
        for ptr, size in drain_cache(self.cache):
            self.insert(ptr, size)
            flushed = True
        return flushed

    def holds(self, ptr: int) -> bool:
        """Whether ``ptr`` starts a free block here, cached or coalesced."""
        return ptr in self.starts or any(ptr in cached for cached in self.cache if cached)

    def free_bytes(self) -> tuple[int, int]:
        """``(free bytes, largest free block)`` of the coalescing lists (flush the cache first)."""
        sizes = self.starts.values()
        return (sum(sizes), max(sizes)) if sizes else (0, 0)
