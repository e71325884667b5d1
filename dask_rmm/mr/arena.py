"""ArenaMemoryResource: per-thread and per-stream arenas over one global arena, as RMM's, with
the pool's per-stream cache in front (design: docs/internals.md, Suballocators)."""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Hashable
from itertools import compress
from typing import Any

from dask_rmm import _cuda
from dask_rmm.mr.base import (
    DeviceMemoryResource,
    OutOfMemoryError,
    ReservedMemoryInfo,
    UpstreamResourceAdaptor,
    check_nbytes,
    deallocate_refused,
)
from dask_rmm.mr.free_list import FreeList
from dask_rmm.mr.locks import gc_paused_lock
from dask_rmm.mr.pool import default_pool_size
from dask_rmm.mr.size_classes import (
    CACHED_LIMIT,
    CLASS_INDEXES,
    N_CLASSES,
    ROUNDED_BYTES,
    SEARCH_CLASS,
    UNIT_SHIFT,
    class_floor,
    drain_cache,
)
from dask_rmm.mr.stream_order import stream_ordered
from dask_rmm.sizes import format_bytes, parse_device_bytes
from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_HANDLE, Stream, as_stream

__all__ = ["ArenaMemoryResource"]

logger = logging.getLogger("dask_rmm.arena")

SUPERBLOCK_SIZE = 1 << 20  # RMM's minimum superblock; larger requests go to the global arena


class _Arena:
    """One thread's or stream's superblocks and their free blocks."""

    __slots__ = ("free", "used", "order")

    def __init__(self) -> None:
        # superblock start -> bytes handed out from it (every superblock is SUPERBLOCK_SIZE)
        self.used: dict[int, int] = {}
        self.free = FreeList(None, None, self.used)  # never merged across superblock starts
        self.order: list[int] = []  # superblock starts, ascending


class ArenaMemoryResource(UpstreamResourceAdaptor):
    """A suballocator that keeps threads and streams apart to limit fragmentation, as RMM's
    ``ArenaMemoryResource``.

    Parameters
    ----------
    upstream_mr : DeviceMemoryResource
        Where the global arena comes from.
    arena_size : int, str or float, optional
        Size of the global arena, taken from upstream at once. Default: half of the device's
        free memory (RMM's default), or 256 MiB when the upstream is host memory.
    dump_log_on_failure : bool
        On out of memory, log the global arena's state (superblocks, free memory, largest free
        block) to the ``dask_rmm.arena`` logger at WARNING level.

    Examples
    --------
    >>> from dask_rmm.mr import ArenaMemoryResource, SystemMemoryResource
    >>> mr = ArenaMemoryResource(SystemMemoryResource(), arena_size="64MiB")
    >>> mr.deallocate(mr.allocate(1000), 1000)
    """

    def __init__(
        self,
        upstream_mr: DeviceMemoryResource,
        arena_size: int | str | float | None = None,
        dump_log_on_failure: bool = False,
    ):
        super().__init__(upstream_mr)
        self._ordered = stream_ordered(upstream_mr)
        if arena_size is None:
            arena_size = default_pool_size(upstream_mr)
        else:
            arena_size = parse_device_bytes(arena_size, upstream_mr, option="arena_size") or 0
        if arena_size < SUPERBLOCK_SIZE:
            raise ValueError(
                f"arena_size ({format_bytes(arena_size)}) is smaller than one superblock (1 MiB)"
            )
        self.dump_log_on_failure = dump_log_on_failure
        self._size = arena_size
        self._base = upstream_mr.allocate(arena_size, DEFAULT_STREAM)
        self._lock = threading.Lock()
        self._global = FreeList(None, None)
        self._global.insert(self._base, arena_size)
        self._arenas: dict[Any, _Arena] = {}
        # stream key -> per-class lists of cached free blocks (class floor size each)
        self._caches: dict[Any, list[list[int]]] = {}
        # ptr -> tag of every live block: nbytes for a block of its class's floor size (those
        # are cached when freed), ~nbytes for one of exact 256-aligned size
        self._live: dict[int, int] = {}
        # ptr -> (arena or None for the global arena, superblock start, size) of every block
        # handed out of an arena and not back in it: live or cached
        self._home: dict[int, tuple[_Arena | None, int, int]] = {}

    def arena_size(self) -> int:
        return self._size

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        try:
            key: Hashable = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == PER_THREAD_HANDLE:
            key = stream.order_key()
        if type(nbytes) is int and 0 < nbytes <= CACHED_LIMIT:
            caches = self._caches.get(key)
            if caches is not None:
                cached = caches[SEARCH_CLASS[(nbytes + 255) >> 8]]
                if cached:
                    try:
                        ptr = cached.pop()
                    except IndexError:  # another thread took the last one
                        pass
                    else:
                        self._live[ptr] = nbytes
                        return ptr
        return self._allocate_slow(nbytes, stream, key)

    def _allocate_slow(self, nbytes: Any, stream: Stream, key: Any) -> int:
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
            if nbytes == 0:
                return 0
        if nbytes <= CACHED_LIMIT:
            size, tag = ROUNDED_BYTES[(nbytes + 255) >> 8], nbytes
        else:
            size, tag = (nbytes + 255) & -256, ~nbytes
        with gc_paused_lock(self._lock):
            if key not in self._caches:
                self._caches[key] = [[] for _ in range(N_CLASSES)]
            ptr = self._try_allocate(size, key, tag)
        if ptr:
            return ptr
        # Out of room: every cached block and empty superblock back to the global arena, again.
        with gc_paused_lock(self._lock):
            stolen = [block for caches in self._caches.values() for block in drain_cache(caches)]
        if self._ordered:
            _cuda.device_synchronize()
        with gc_paused_lock(self._lock):
            for ptr, csize in stolen:
                self._give_back(ptr, csize)
            for arena in self._arenas.values():
                for sb in [sb for sb, used in arena.used.items() if used == 0]:
                    self._return_superblock(arena, sb)
            ptr = self._try_allocate(size, key, tag)
            if not ptr and size != (nbytes + 255) & -256:
                # the rounded size does not fit: the exact one may
                ptr = self._try_allocate((nbytes + 255) & -256, key, ~nbytes)
            if ptr:
                return ptr
            if self.dump_log_on_failure:
                self._dump_memory_log(size)
            free, largest = self._global.free_bytes()
            all_free, all_largest = self._free_and_largest()
            raise OutOfMemoryError(
                f"ArenaMemoryResource out of memory: requested {format_bytes(nbytes)} "
                f"({nbytes} bytes) on stream {stream.handle:#x}; arena {format_bytes(self._size)}, "
                f"{format_bytes(free)} free in the global arena, largest free "
                f"region {format_bytes(largest)}",
                requested=nbytes,
                resource="ArenaMemoryResource",
                stream=stream.handle,
                pool_size=self._size,
                maximum_pool_size=self._size,
                free_bytes=all_free,
                largest_free_block=all_largest,
            )

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        try:
            key: Hashable = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == PER_THREAD_HANDLE:
            key = stream.order_key()
        live = self._live
        n = live.pop(ptr, None)
        if n is not None:
            if n == nbytes and type(ptr) is int:
                caches = self._caches.get(key)
                if caches is not None:
                    # Stream order: the block is handed out again only on this stream.
                    caches[SEARCH_CLASS[(n + 255) >> 8]].append(ptr)
                    return
            live[ptr] = n  # the slow path takes it again under the lock
        self._deallocate_slow(ptr, nbytes, stream, key)

    def _deallocate_slow(self, ptr: Any, nbytes: Any, stream: Stream, key: Any) -> None:
        with gc_paused_lock(self._lock):
            tag = self._live.get(ptr)
            if tag is None or type(ptr) is not int or (tag != nbytes and tag != ~nbytes):
                bad = tag
            else:
                bad = False
                arena, _sb, size = self._home[ptr]
                other = arena is None or self._arenas.get(key) is not arena
        if bad is not False:
            allocated = None if bad is None else (bad if bad >= 0 else ~bad)
            return deallocate_refused(self, "ArenaMemoryResource", ptr, nbytes, allocated, stream)
        if other and self._ordered:
            # Memory goes to the global arena or to another stream's arena, where it can be
            # handed out without ordering: the freeing stream must be done with it first.
            stream.synchronize()
        with gc_paused_lock(self._lock):
            if self._live.pop(ptr, None) is None:  # freed concurrently by another thread
                return deallocate_refused(self, "ArenaMemoryResource", ptr, nbytes, None, stream)
            self._give_back(ptr, size)

    def reserved_memory_info(self) -> ReservedMemoryInfo:
        with gc_paused_lock(self._lock):
            return ReservedMemoryInfo(self._size, *self._free_and_largest())

    def __del__(self):
        try:
            base, self._base = self._base, 0
            if base:
                self.upstream_mr.deallocate(base, self._size, DEFAULT_STREAM)
        except Exception:
            pass

    def _repr_fields(self) -> str:
        return f"arena_size={format_bytes(self._size)}"

    # -- internals (called with the lock held) -------------------------------------------------

    def _try_allocate(self, size: int, key: Any, tag: int) -> int:
        if size > SUPERBLOCK_SIZE:
            ptr = self._global.take_fit(size)
            if ptr:
                self._home[ptr] = (None, ptr, size)
                self._live[ptr] = tag
            return ptr
        arena = self._arenas.get(key)
        if arena is None:
            arena = self._arenas[key] = _Arena()
        ptr = arena.free.take_fit(size)
        if not ptr:
            sb = self._global.take_fit(SUPERBLOCK_SIZE)
            if not sb:
                return 0
            bisect.insort(arena.order, sb)
            arena.used[sb] = 0
            arena.free.insert(sb, SUPERBLOCK_SIZE)
            ptr = arena.free.take_fit(size)
        sb = arena.order[bisect.bisect_right(arena.order, ptr) - 1]
        arena.used[sb] += size
        self._home[ptr] = (arena, sb, size)
        self._live[ptr] = tag
        return ptr

    def _give_back(self, ptr: int, size: int) -> None:
        """Return a block (no longer live nor cached) to its arena or the global arena."""
        arena, sb, size = self._home.pop(ptr)
        if arena is None:
            self._global.insert(ptr, size)
            return
        arena.free.insert(ptr, size)
        used = arena.used[sb] - size
        arena.used[sb] = used
        if used == 0 and len(arena.used) > 1:
            self._return_superblock(arena, sb)

    def _free_and_largest(self) -> tuple[int, int]:
        """Free bytes and the largest free block, of the global arena, the arenas and the caches
        (lock held)."""
        pairs = [self._global.free_bytes(), *(a.free.free_bytes() for a in self._arenas.values())]
        for caches in self._caches.values():
            for c in compress(CLASS_INDEXES, caches):
                size = class_floor(c) << UNIT_SHIFT
                pairs.append((size * len(caches[c]), size))
        return sum(f for f, _ in pairs), max(largest for _, largest in pairs)

    def _return_superblock(self, arena: _Arena, sb: int) -> None:
        arena.order.remove(sb)
        del arena.used[sb]
        arena.free.remove(sb, SUPERBLOCK_SIZE)
        self._global.insert(sb, SUPERBLOCK_SIZE)

    def _dump_memory_log(self, size: int) -> None:
        free, largest = self._global.free_bytes()
        logger.warning(
            "ArenaMemoryResource ran out of memory trying to allocate %s. Global arena: size %s, "
            "%d free regions, %s free, largest free region %s; %d arenas holding %d superblocks",
            format_bytes(size),
            format_bytes(self._size),
            len(self._global.starts),
            format_bytes(free),
            format_bytes(largest),
            len(self._arenas),
            sum(len(a.used) for a in self._arenas.values()),
        )
