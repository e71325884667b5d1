"""PoolMemoryResource: a stream-ordered, coalescing suballocator growing as RMM's pool does
(design: docs/internals.md, Suballocators)."""

from __future__ import annotations

import bisect
import gc
import threading
from collections.abc import Hashable
from typing import Any, Final

from dask_rmm import _cuda
from dask_rmm.mr.base import (
    SIZE_MAX,
    DeviceMemoryResource,
    OutOfMemoryError,
    ReservedMemoryInfo,
    UpstreamResourceAdaptor,
    check_nbytes,
    deallocate_refused,
)
from dask_rmm.mr.budget import BudgetSharer
from dask_rmm.mr.free_list import FreeList
from dask_rmm.mr.instrumentation import JOURNAL_LIMIT, AllocationCounters, OwnerAccounts
from dask_rmm.mr.locks import ListLock, acquire_contended, gc_paused_lock
from dask_rmm.mr.size_classes import (
    CACHED_LIMIT,
    ROUNDED_BYTES,
    SEARCH_CLASS,
    UNIT_SHIFT,
    search_class,
)
from dask_rmm.mr.stream_order import FRESH_KEY, order_after, stream_ordered, synchronize_streams
from dask_rmm.sizes import align_up, format_bytes, parse_device_bytes
from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_HANDLE, Stream, as_stream

__all__ = ["AllocationCounters", "OwnerAccounts", "PoolMemoryResource", "pool_behind"]

#: The default stream's order key (``DEFAULT_STREAM.order_key()``), used by the fast paths.
DEFAULT_KEY: Final = 0

#: Added in the live table to the size of a block given at its exact size (the pool too full to
#: round it up): above every cached or allocatable size, so only the slow path frees it.
EXACT_TAG: Final = 1 << 64

#: Initial pool size when none is given over host memory (no device to take half of).
DEFAULT_HOST_POOL_SIZE = 256 << 20


def pool_behind(resource: Any) -> PoolMemoryResource | None:
    """The pool whose ``allocate``/``deallocate`` ``resource``'s are: itself, or the
    ``counting_pool``/``tracking_pool`` of an adaptor fused with it; None otherwise."""
    if type(resource) is PoolMemoryResource:
        return resource
    for name in ("counting_pool", "tracking_pool"):
        pool = getattr(resource, name, None)
        if type(pool) is PoolMemoryResource:
            return pool
    return None


def default_pool_size(upstream: DeviceMemoryResource) -> int:
    """RMM's default initial pool size: half of the device's free memory (256 MiB of host
    memory over a host-memory upstream)."""
    if upstream.is_host_memory:
        return DEFAULT_HOST_POOL_SIZE
    return align_up(_cuda.mem_get_info()[0] // 2)


class PoolMemoryResource(UpstreamResourceAdaptor):
    """A coalescing, stream-ordered pool suballocator, as RMM's ``PoolMemoryResource``.

    Parameters
    ----------
    upstream_mr : DeviceMemoryResource
        Where the pool's memory comes from.
    initial_pool_size : int, str or float, optional
        Bytes to take from upstream at once. Default: half of the device's free memory (RMM's
        default), or 256 MiB when the upstream is host memory. Strings such as ``"4GiB"`` and
        fractions of total memory (``0.5``) are accepted; sizes are rounded up to 256 bytes.
    maximum_pool_size : int, str or float, optional
        The pool never holds more than this from upstream. Default: no limit but upstream's.

    Notes
    -----
    The pool grows as RMM's does: without a maximum, by ``max(request, current pool size)``;
    with one, by ``max(request, half of the room left)``, halving a failed upstream request
    down to the request. Thread safe; free blocks are kept per stream.

    Examples
    --------
    >>> from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource
    >>> pool = PoolMemoryResource(SystemMemoryResource(), initial_pool_size="64MiB")
    >>> ptr = pool.allocate(1000)
    >>> pool.deallocate(ptr, 1000)
    >>> pool.pool_size()
    67108864
    """

    def __init__(
        self,
        upstream_mr: DeviceMemoryResource,
        initial_pool_size: int | str | float | None = None,
        maximum_pool_size: int | str | float | None = None,
    ) -> None:
        super().__init__(upstream_mr)
        self._ordered = stream_ordered(upstream_mr)
        maximum: int | None = None
        if maximum_pool_size is not None:
            maximum = parse_device_bytes(maximum_pool_size, upstream_mr, option="maximum_pool_size")
        initial: int
        if initial_pool_size is None:
            initial = default_pool_size(upstream_mr)
            if maximum is not None:
                initial = min(initial, maximum)
        else:
            initial = (
                parse_device_bytes(initial_pool_size, upstream_mr, option="initial_pool_size") or 0
            )
        if maximum is not None and initial > maximum:
            raise ValueError(
                f"initial_pool_size ({format_bytes(initial)}) exceeds "
                f"maximum_pool_size ({format_bytes(maximum)})"
            )
        self._maximum = maximum
        self._initial_pool_size = initial
        self._initial_chunk: int | None = None  # what trim() keeps down to the initial size
        self._lock = ListLock()
        self._unlocked = self._lock.unlocked  # the hot paths take and give it back directly
        self._live: dict[int, int] = {}  # ptr -> nbytes as asked (+ EXACT_TAG: an exact block)
        self._lists: dict[Hashable, FreeList] = {}
        self._chunks: dict[int, int] = {}  # upstream chunk start -> size
        self._chunk_starts: set[int] = set()  # blocks never merge across these
        self._pool_size = 0
        self._growing = 0  # bytes being asked of upstream right now (outside the lock)
        self._releasing = 0  # bytes trimmed off and not yet given back upstream
        self._caches: dict[Hashable, list[list[int]]] = {}  # stream key -> its FreeList.cache
        # Instrumentation (count_allocations / charge_owners); _instrumented: either attached.
        self._counters: AllocationCounters | None = None
        self._journal: list[int] | None = None  # self._counters.journal, for the fast paths
        self._uncounted: set[int] = set()  # live when counting began: their frees not counted
        # The journal length at which the fast path calls _after_journaled_allocation:
        # JOURNAL_LIMIT, or 0 while _uncounted may be non-empty.
        self._settle_at = JOURNAL_LIMIT
        self._owners: OwnerAccounts | None = None
        self._owner_of: dict[int, list[int]] = {}  # ptr -> the account it was charged to
        self._instrumented = False
        self._sharers: tuple[BudgetSharer, ...] = ()  # share_budget; the lock orders rooms
        self._budget_lock = threading.Lock()
        # Made now: the fast paths reach the default stream's caches without a dict lookup.
        self._default_caches = self._free_list(DEFAULT_KEY, DEFAULT_STREAM).cache
        if initial:
            ptr, _ = self._take_upstream(initial, initial, DEFAULT_STREAM)
            self._initial_chunk = ptr
            self._add_chunk(ptr, initial)
            self._free_list(FRESH_KEY, None).insert(ptr, initial)

    # -- public API ------------------------------------------------------------------------

    def pool_size(self) -> int:
        """Bytes the pool currently holds from upstream (free and allocated)."""
        return self._pool_size

    @property
    def maximum_pool_size(self) -> int | None:
        return self._maximum

    def share_budget(self, sharer: BudgetSharer) -> None:
        """Let ``sharer`` (a library cache beside the pool, e.g. PyTorch's) share the maximum
        pool size (:mod:`dask_rmm.mr.budget`); idempotent. Without a maximum it gets no limit."""
        with self._budget_lock:
            if not any(s is sharer for s in self._sharers):
                self._sharers = (*self._sharers, sharer)
        self._refresh_room()

    def stop_sharing(self, sharer: BudgetSharer) -> None:
        """Take ``sharer`` off; it keeps the room it was last given (nothing if not sharing)."""
        with self._budget_lock:
            self._sharers = tuple(s for s in self._sharers if s is not sharer)

    def budget_sharers(self) -> tuple[BudgetSharer, ...]:
        """The library caches sharing the maximum, in the order they joined."""
        return self._sharers

    def give_room(self, nbytes: int) -> int:
        """Give free chunks back until the sharers' room grew by ``nbytes`` (or nothing more is
        free) and tell them; the bytes given back. A sharer's out-of-memory handler calls it."""
        released = self.trim(max(0, self._pool_size - max(0, int(nbytes))))
        self._refresh_room()
        return released

    @property
    def initial_pool_size(self) -> int:
        """Bytes the pool took from upstream when it was made (what :meth:`trim` keeps)."""
        return self._initial_pool_size

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        # The one fast path: a block cached on this stream (docs/internals.md, Threads).
        try:
            key: Hashable = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == 0:  # the default stream (DEFAULT_KEY): its caches are at hand
            caches = self._default_caches
        else:
            if key == PER_THREAD_HANDLE:
                key = stream.order_key()
            found = self._caches.get(key)
            if found is None:
                return self._allocate_locked(nbytes, stream, key)
            caches = found
        if type(nbytes) is not int or nbytes <= 0 or nbytes > CACHED_LIMIT:
            return self._allocate_locked(nbytes, stream, key)
        cached = caches[SEARCH_CLASS[(nbytes + 255) >> 8]]
        if not cached:
            return self._allocate_locked(nbytes, stream, key)
        owners = self._owners
        if owners is not None:
            try:  # outside the lock: a first read of a thread-local may allocate and run the GC
                owner_key = owners.get_owner()
            except Exception:
                owner_key = None
            try:
                self._unlocked.pop()
            except IndexError:
                acquire_contended(self._lock)
        try:
            ptr = cached.pop()
        except IndexError:  # another thread took the last one
            ptr = 0
        else:
            self._live[ptr] = nbytes
            journal = self._journal  # read after the block is live: see count_allocations
            if journal is not None:
                journal.append(nbytes)
            if owners is not None and self._owners is owners:
                self._charge_owner(owners, owner_key, ptr, nbytes)
        finally:
            if owners is not None:
                self._unlocked.append(True)
        if not ptr:
            return self._allocate_locked(nbytes, stream, key)
        if journal is not None and len(journal) >= self._settle_at:
            self._after_journaled_allocation(ptr)
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        # The one fast path: a block below 16 MiB freed with its size, back to this stream's cache.
        try:
            key: Hashable = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == 0:  # the default stream (DEFAULT_KEY)
            caches = self._default_caches
        else:
            if key == PER_THREAD_HANDLE:
                key = stream.order_key()
            found = self._caches.get(key)
            if found is None:  # a first free on this stream
                self._deallocate_locked(ptr, nbytes, stream, key)
                return
            caches = found
        owners = self._owners
        if owners is not None:
            try:
                self._unlocked.pop()
            except IndexError:
                acquire_contended(self._lock)
        try:
            # One of two threads freeing a pointer pops it; journal read first (count_allocations).
            journal = self._journal
            n = self._live.pop(ptr, None)
            if n is not None and n == nbytes and n <= CACHED_LIMIT and type(ptr) is int:
                if journal is not None:
                    if self._uncounted and ptr in self._uncounted:
                        self._uncounted.discard(ptr)
                    else:
                        journal.append(-n)
                if owners is not None and (account := self._owner_of.pop(ptr, None)):
                    account[0] -= n
                caches[SEARCH_CLASS[(n + 255) >> 8]].append(ptr)
                return
            if n is not None:
                self._live[ptr] = n  # the locked path takes it again under the lock
        finally:
            if owners is not None:
                self._unlocked.append(True)
        self._deallocate_locked(ptr, nbytes, stream, key)

    def release(self) -> int:
        """Give every fully free upstream chunk back to upstream; return the bytes released."""
        return self.trim(0)

    def trim(self, size: int | str | float | None = None) -> int:
        """Give fully free upstream chunks back, largest first, while the pool holds more than
        ``size`` bytes (default the initial pool size, whose chunk goes only below it; ``0``:
        every free chunk, as :meth:`release`); the bytes released. Live blocks are never touched.

        Examples
        --------
        >>> from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource
        >>> pool = PoolMemoryResource(SystemMemoryResource(), initial_pool_size="1MiB")
        >>> ptr = pool.allocate(4 << 20)  # the pool grows by a 4 MiB chunk
        >>> pool.deallocate(ptr, 4 << 20)
        >>> pool.trim()  # back to the initial 1 MiB
        4194304
        """
        if size is None:
            keep = self._initial_pool_size
        else:
            keep = parse_device_bytes(size, self.upstream_mr, option="size") or 0
        with gc_paused_lock(self._lock):
            self._flush_caches()
            chunk_starts = sorted(self._chunks)
            per_chunk: dict[int, list[tuple[FreeList, int, int]]] = {}
            for fl in self._lists.values():
                for ptr, bsize in fl.starts.items():
                    chunk = chunk_starts[bisect.bisect_right(chunk_starts, ptr) - 1]
                    per_chunk.setdefault(chunk, []).append((fl, ptr, bsize))
            free_chunks = [
                (self._chunks[c], c)
                for c, blocks in per_chunk.items()
                if sum(b for _, _, b in blocks) == self._chunks[c]
            ]
            released = []
            freed_on: set[FreeList] = set()
            for csize, chunk in sorted(free_chunks, reverse=True):
                if self._pool_size <= keep:
                    break
                if chunk == self._initial_chunk and keep >= self._initial_pool_size:
                    continue
                for fl, ptr, bsize in per_chunk[chunk]:
                    fl.remove(ptr, bsize)
                    freed_on.add(fl)
                del self._chunks[chunk]
                self._chunk_starts.discard(chunk)
                self._pool_size -= csize
                released.append((chunk, csize))
                if chunk == self._initial_chunk:
                    self._initial_chunk = None
            total = sum(csize for _, csize in released)
            self._releasing += total  # the maximum counts them until upstream has them
        if not released:
            return 0
        try:
            if self._ordered:
                synchronize_streams([(fl.key, fl.stream) for fl in freed_on])
            for start, csize in released:
                self.upstream_mr.deallocate(start, csize, DEFAULT_STREAM)
        finally:
            with gc_paused_lock(self._lock):
                self._releasing -= total
        if self._sharers:
            self._refresh_room()
        return total

    def reserved_memory_info(self) -> ReservedMemoryInfo:
        with gc_paused_lock(self._lock):
            free, largest = self._free_and_largest()
            return ReservedMemoryInfo(self._pool_size, free, largest)

    def memory_layout(
        self,
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """The pool's address space: ``(chunks, free blocks, live blocks)``, each a list of
        ``(ptr, size)`` by address, live sizes rounded so that free and live blocks tile each
        chunk (blocks never coalesce across chunks); cached blocks are merged first."""
        with gc_paused_lock(self._lock):
            self._flush_caches()
            free: list[tuple[int, int]] = []
            for fl in list(self._lists.values()):
                free.extend(fl.starts.items())
            live_tags = list(self._live.items())  # one C call: lock-free paths may change it
            chunks = list(self._chunks.items())
        live = []
        for ptr, tag in live_tags:
            n = tag - EXACT_TAG if tag >= EXACT_TAG else tag
            if tag <= CACHED_LIMIT:
                live.append((ptr, ROUNDED_BYTES[(n + 255) >> 8]))
            else:
                live.append((ptr, (n + 255) & -256))
        return sorted(chunks), sorted(free), sorted(live)

    def _repr_fields(self) -> str:
        return f"pool_size={format_bytes(self._pool_size)} maximum={format_bytes(self._maximum)}"

    def __del__(self) -> None:
        # As RMM's destructor: everything goes back (live DeviceBuffers keep the pool alive).
        try:
            if self._ordered:  # blocks freed on other streams may still be in use
                _cuda.device_synchronize()
            chunks = list(self._chunks.items())
            self._chunks.clear()
            for start, size in chunks:
                self.upstream_mr.deallocate(start, size, DEFAULT_STREAM)
        except Exception:
            pass

    # -- instrumentation interface ---------------------------------------------------------

    @property
    def instrumentation_lock(self) -> ListLock:
        """The lock under which the pool updates attached counters and accounts: hold it to
        read them consistently (briefly, and never while calling into the pool)."""
        return self._lock

    def count_allocations(self, counters: AllocationCounters) -> bool:
        """Count every allocation and free made on this pool into ``counters`` (journaled: read
        them under :attr:`instrumentation_lock` after their ``settle()``). Blocks live now are
        not counted when freed. False, and nothing changed, when others are attached already.
        """
        if not isinstance(counters, AllocationCounters):
            raise TypeError(f"counters must be AllocationCounters, got {type(counters).__name__}")
        # settle() folds long journals with NumPy: imported here, never under the lock.
        import numpy  # noqa: F401

        with gc_paused_lock(self._lock):
            if self._counters is not None:
                return False
            # The fast paths read the journal after an allocation made its block live and before
            # a free pops it: a block live here has both or neither journaled; one freed
            # unjournaled is dropped from _uncounted when next allocated (_settle_at set first).
            self._uncounted = set(self._live)
            self._settle_at = 0 if self._uncounted else JOURNAL_LIMIT
            self._counters = counters
            self._journal = counters.journal
            self._instrumented = True
            return True

    def stop_counting(self, counters: AllocationCounters) -> None:
        """Detach ``counters`` (no-op when they are not the attached ones)."""
        with self._lock:  # also runs from finalizers at shutdown
            if self._counters is counters:
                try:
                    counters.settle()
                finally:  # detached even if folding failed (at shutdown NumPy may be gone)
                    self._counters = self._journal = None
                    self._uncounted.clear()
                    self._settle_at = JOURNAL_LIMIT
                    self._instrumented = self._owners is not None

    def charge_owners(self, owners: OwnerAccounts) -> bool:
        """Charge every allocation made on this pool to an owner (:class:`OwnerAccounts`);
        blocks live now are never charged back. False, and nothing changed, when others are
        attached already."""
        if not isinstance(owners, OwnerAccounts):
            raise TypeError(f"owners must be OwnerAccounts, got {type(owners).__name__}")
        with gc_paused_lock(self._lock):
            if self._owners is not None:
                return False
            self._owners = owners
            self._instrumented = True
            return True

    def stop_charging(self, owners: OwnerAccounts) -> None:
        """Detach ``owners`` (no-op when it is not the attached one)."""
        with self._lock:  # makes nothing; also runs from finalizers at shutdown
            if self._owners is owners:
                self._owners = None
                self._owner_of.clear()
                self._instrumented = self._counters is not None

    def live_allocations(self) -> dict[int, int]:
        """``{ptr: nbytes}`` of every live block, sizes as asked: a snapshot of the table every
        deallocate is checked against (what a TrackingResourceAdaptor lists)."""
        while True:
            try:
                tags = dict(self._live)  # one C-level copy; lock-free callers may change it
            except RuntimeError:  # changed during the copy (free-threaded CPython): again
                continue
            return {ptr: tag - EXACT_TAG if tag >= EXACT_TAG else tag for ptr, tag in tags.items()}

    # -- test and report helpers -----------------------------------------------------------

    def _free_blocks(self) -> list[tuple[int, int, Hashable]]:
        """Every free block as ``(ptr, size, stream key)``, by address (caches merged first)."""
        with gc_paused_lock(self._lock):
            self._flush_caches()
            return sorted(
                (p, s, fl.key) for fl in self._lists.values() for p, s in fl.starts.items()
            )

    # -- allocation behind the fast path ---------------------------------------------------

    def _allocate_locked(self, nbytes: Any, stream: Stream, key: Hashable) -> int:
        """Every allocation the fast path does not serve: validation, then (under the lock) the
        stream's own cache and coalescing lists, then :meth:`_allocate_slow`."""
        if type(nbytes) is not int or nbytes <= 0 or nbytes > SIZE_MAX:
            nbytes = check_nbytes(nbytes)
            if nbytes == 0:
                return 0
        if nbytes <= CACHED_LIMIT:
            u = (nbytes + 255) >> 8
            search, size = SEARCH_CLASS[u], ROUNDED_BYTES[u]
        else:
            size = (nbytes + 255) & -256
            search = search_class(size >> UNIT_SHIFT)
        owners = self._owners
        owner_key = None
        if owners is not None:
            try:  # outside the lock, as in allocate
                owner_key = owners.get_owner()
            except Exception:
                owner_key = None
        unlocked = self._unlocked
        try:
            unlocked.pop()
        except IndexError:
            acquire_contended(self._lock)
        try:
            own = self._lists.get(key)
            ptr = own.take(search, size) if own is not None else 0
            if ptr:
                self._live[ptr] = nbytes
                if self._instrumented:
                    self._account(ptr, nbytes, owners, owner_key)
                return ptr
        finally:
            unlocked.append(True)
        try:
            ptr = self._allocate_slow(nbytes, size, key, stream)
        except MemoryError:
            if self._counters is not None:
                with gc_paused_lock(self._lock):
                    if self._counters is not None:
                        self._counters.failed += 1
            raise
        if self._instrumented:
            with gc_paused_lock(self._lock):
                self._account(ptr, nbytes, owners, owner_key)
        return ptr

    def _allocate_slow(
        self, nbytes: int, size: int, key: Hashable, stream: Stream, tag: int | None = None
    ) -> int:
        """Serve a request the stream's own lists could not, as RMM's ``get_block`` goes on:
        the own lists after merging every cache, another stream's block, all streams' blocks
        merged, growth; last, a rounded-up request at its exact size (``tag`` ``nbytes +
        EXACT_TAG`` in the live table instead of ``nbytes``)."""
        if tag is None:
            tag = nbytes
        with gc_paused_lock(self._lock):
            own = self._free_list(key, stream)
            found = own.find(size)
            if found is None and self._flush_caches():
                found = own.find(size)
            if found is not None:
                return self._carve(own, *found, size, tag)
            others = [fl for fl in self._lists.values() if fl is not own and fl.starts]
            ptr, victims = 0, others
            for fl in others:  # a fitting block of another stream, the rest moving to own
                found = fl.find(size)
                if found is not None:
                    ptr, victims = self._carve(fl, *found, size, tag, rest_to=own), [fl]
                    break
            else:  # every other stream's blocks merged into own
                for fl in others:
                    fl.move_all_to(own)
                found = own.find(size) if others else None
                if found is not None:
                    ptr = self._carve(own, *found, size, tag)
        if victims and self._ordered:
            order_after([(fl.key, fl.stream) for fl in victims], stream)
        if ptr:
            return ptr
        try:
            return self._grow(nbytes, size, key, stream, tag)
        except OutOfMemoryError:
            exact = (nbytes + 255) & -256
            if exact == size:
                raise
            return self._allocate_slow(nbytes, exact, key, stream, nbytes + EXACT_TAG)

    def _carve(
        self,
        fl: FreeList,
        ptr: int,
        bsize: int,
        size: int,
        tag: int,
        rest_to: FreeList | None = None,
    ) -> int:
        """Hand out ``size`` bytes at the start of free block ``ptr``; the rest goes back to
        ``rest_to`` (default ``fl``). ``tag`` is recorded in the live table (lock held)."""
        fl.remove(ptr, bsize)
        if bsize > size:
            (rest_to if rest_to is not None else fl).insert(ptr + size, bsize - size)
        self._live[ptr] = tag
        return ptr

    # -- growth ----------------------------------------------------------------------------

    def _size_to_grow(self, size: int, outside: int = 0) -> int:
        held = self._pool_size + self._growing + self._releasing + outside
        if self._maximum is not None:
            remaining = align_up(max(self._maximum - held, 0))
            if size > remaining:
                return 0
            step = remaining // 2
            if self._sharers:
                # Sharing the maximum: grow as without one (by the pool's size), at most by half
                # the room, so that the pool does not take half the budget from a library beside
                # it at its first growth.
                step = min(step, self._pool_size + self._growing)
            return max(size, align_up(step))
        return max(size, held)

    def _grow(self, nbytes: int, size: int, key: Hashable, stream: Stream, tag: int) -> int:
        sharing = bool(self._sharers) and self._maximum is not None
        # Read before the lock (a library call); checked again below, after lowering its room.
        outside = self._sharers_reserved() if sharing else 0
        with gc_paused_lock(self._lock):
            try_size = self._size_to_grow(size, outside)
            if not try_size and sharing and outside:
                try_size = self._size_to_grow(size)  # room the sharers may give back
            if not try_size:
                reason = "the maximum pool size leaves no room"
                if sharing:
                    names = ", ".join(s.name for s in self._sharers)
                    reason += f"; {names} beside the pool hold(s) {format_bytes(outside)} of it"
                raise self._oom(nbytes, stream, reason)
            self._growing += try_size
        if sharing:
            try_size = self._claim_from_sharers(nbytes, size, try_size, stream)
        try:
            ptr, got = self._take_upstream(try_size, size, stream)
        except BaseException as e:
            with gc_paused_lock(self._lock):
                self._growing -= try_size
            if sharing:
                self._refresh_room()
            if not isinstance(e, MemoryError):
                raise
            with gc_paused_lock(self._lock):
                raise self._oom(nbytes, stream, f"upstream could not supply it: {e}") from e
        with gc_paused_lock(self._lock):
            self._growing -= try_size
            self._add_chunk(ptr, got)
            if got > size:
                self._free_list(key, stream).insert(ptr + size, got - size)
            self._live[ptr] = tag
        if sharing and got < try_size:
            self._refresh_room()  # the upstream gave less than was set aside
        return ptr

    def _sharers_reserved(self) -> int:
        return sum(int(s.reserved_bytes()) for s in self._sharers)

    def _refresh_room(self) -> None:
        """Tell the budget's sharers the room the pool leaves them now."""
        with self._budget_lock:
            self._set_rooms()

    def _set_rooms(self) -> None:
        # With the budget lock held. Each sharer's room leaves out what the others hold.
        sharers = self._sharers
        if not sharers:
            return
        if self._maximum is None:
            for s in sharers:
                s.set_room(None)
            return
        room = max(0, self._maximum - self._pool_size - self._growing - self._releasing)
        held = [int(s.reserved_bytes()) for s in sharers] if len(sharers) > 1 else [0]
        for i, s in enumerate(sharers):
            s.set_room(max(0, room - (sum(held) - held[i])))

    def _claim_from_sharers(self, nbytes: int, size: int, try_size: int, stream: Stream) -> int:
        """Before growing by ``try_size`` (set aside in ``_growing``): lower the sharers' room
        first, then count what they hold, so that neither side can pass the maximum. When they
        hold too much: ask them to give free bytes back, then settle for ``size``; the bytes to
        grow by. When even that does not fit, give the set-aside bytes back and raise the
        pool's OutOfMemoryError naming the sharers."""
        assert self._maximum is not None
        with self._budget_lock:
            for attempt in range(3):
                self._set_rooms()
                room = max(0, self._maximum - self._pool_size - self._growing - self._releasing)
                held = self._sharers_reserved()
                if held <= room:
                    return try_size
                if attempt == 0:
                    for s in self._sharers:
                        s.release()
                elif try_size > size:  # settle for the request
                    with gc_paused_lock(self._lock):
                        self._growing -= try_size - size
                    try_size = size
            with gc_paused_lock(self._lock):
                self._growing -= try_size
            self._set_rooms()
        names = ", ".join(s.name for s in self._sharers)
        with gc_paused_lock(self._lock):
            raise self._oom(
                nbytes,
                stream,
                f"{names} beside the pool hold{'s' if len(self._sharers) == 1 else ''} "
                f"{format_bytes(held)} of the maximum, leaving no room to grow by "
                f"{format_bytes(try_size)}",
            )

    def _take_upstream(self, try_size: int, min_size: int, stream: Stream) -> tuple[int, int]:
        """``(ptr, size)`` of ``try_size`` bytes from upstream, halving on failure down to
        ``min_size`` (RMM's back-off)."""
        while True:
            try:
                return self.upstream_mr.allocate(try_size, stream), try_size
            except MemoryError:
                if try_size <= min_size:
                    raise
                try_size = max(min_size, align_up(try_size // 2))

    def _add_chunk(self, ptr: int, size: int) -> None:
        self._chunks[ptr] = size
        self._chunk_starts.add(ptr)
        self._pool_size += size

    def _oom(self, nbytes: int, stream: Stream, reason: str) -> OutOfMemoryError:
        free, largest = self._free_and_largest()  # called with the lock held
        handle = stream.handle
        return OutOfMemoryError(
            f"PoolMemoryResource out of memory: requested {format_bytes(nbytes)} ({nbytes} bytes) "
            f"on stream {handle:#x}; pool {format_bytes(self._pool_size)} of maximum "
            f"{format_bytes(self._maximum)}, {format_bytes(free)} free, largest free block "
            f"{format_bytes(largest)} ({reason})",
            requested=nbytes,
            resource="PoolMemoryResource",
            stream=handle,
            pool_size=self._pool_size,
            maximum_pool_size=self._maximum,
            free_bytes=free,
            largest_free_block=largest,
        )

    # -- deallocation behind the fast path -------------------------------------------------

    def _deallocate_locked(self, ptr: Any, nbytes: Any, stream: Stream, key: Hashable) -> None:
        """Every free the fast path does not take: under the lock, to this stream's cache or
        coalescing lists; anything else to :meth:`_deallocate_slow`."""
        unlocked = self._unlocked
        try:
            unlocked.pop()
        except IndexError:
            acquire_contended(self._lock)
        try:
            n = self._live.pop(ptr, None)
            if n is not None and n == nbytes and n < EXACT_TAG and type(ptr) is int:
                fl = self._free_list(key, stream)
                if self._instrumented:
                    self._uncount(ptr, n)
                if n <= CACHED_LIMIT:
                    fl.cache[SEARCH_CLASS[(n + 255) >> 8]].append(ptr)
                else:
                    fl.insert(ptr, (n + 255) & -256)
                return
            if n is not None:
                self._live[ptr] = n
        finally:
            unlocked.append(True)
        self._deallocate_slow(ptr, nbytes, n, stream)

    def _deallocate_slow(
        self, ptr: Any, nbytes: Any, allocated: int | None, stream: Stream
    ) -> None:
        """Blocks of exact size, and what :func:`deallocate_refused` takes."""
        if allocated is not None and allocated >= EXACT_TAG:
            allocated -= EXACT_TAG
            if allocated == nbytes and type(ptr) is int:  # (nbytes may be another int type)
                self._deallocate_exact(ptr, allocated, stream)
                return
        freed = False
        if allocated is None and type(ptr) is int:
            with gc_paused_lock(self._lock):
                freed = any(fl.holds(ptr) for fl in self._lists.values())
        deallocate_refused(self, "PoolMemoryResource", ptr, nbytes, allocated, stream, freed)

    def _deallocate_exact(self, ptr: int, nbytes: int, stream: Stream) -> None:
        """Free a block allocated at its exact size (the pool was too full to round it up)."""
        stream = as_stream(stream)
        key = stream.order_key()
        with gc_paused_lock(self._lock):
            if self._live.get(ptr) != nbytes + EXACT_TAG:
                raise ValueError(
                    f"PoolMemoryResource.deallocate({ptr:#x}, {nbytes}): freed concurrently twice"
                )
            del self._live[ptr]
            if self._instrumented:
                self._uncount(ptr, nbytes)
            self._free_list(key, stream).insert(ptr, (nbytes + 255) & -256)

    # -- free lists (lock held) ------------------------------------------------------------

    def _free_list(self, key: Hashable, stream: Stream | None) -> FreeList:
        """The free list of the stream ``key``, made on its first use."""
        fl = self._lists.get(key)
        if fl is None:
            # Made with the lock held: keep the collector out, see gc_paused_lock.
            paused = gc.isenabled()
            if paused:
                gc.disable()
            try:
                fl = self._lists[key] = FreeList(key, stream, self._chunk_starts)
                self._caches[key] = fl.cache
            finally:
                if paused:
                    gc.enable()
        return fl

    def _flush_caches(self) -> bool:
        """Merge every cached block into its stream's coalescing lists; True when any was cached."""
        return any([fl.flush_cache() for fl in self._lists.values()])

    def _free_and_largest(self) -> tuple[int, int]:
        """Free bytes and the largest free block over every stream, caches merged first."""
        self._flush_caches()
        pairs = [fl.free_bytes() for fl in self._lists.values()]
        return sum(f for f, _ in pairs), max(largest for _, largest in pairs)

    # -- instrumentation (lock held) -------------------------------------------------------

    def _after_journaled_allocation(self, ptr: int) -> None:
        """After the fast path journaled an allocation: a block live when counting began is
        counted from now on, and a journal of JOURNAL_LIMIT entries is folded in."""
        if self._settle_at < JOURNAL_LIMIT:
            self._uncounted.discard(ptr)
            if not self._uncounted:  # every block live when counting began was freed
                with self._lock:
                    if not self._uncounted:
                        self._settle_at = JOURNAL_LIMIT
        journal = self._journal
        if journal is not None and len(journal) >= JOURNAL_LIMIT:
            with self._lock:  # settle() keeps the garbage collector out
                counters = self._counters
                if counters is not None:
                    counters.settle()

    def _account(self, ptr: int, nbytes: int, owners: OwnerAccounts | None, owner_key: Any) -> None:
        """Count one allocation and charge it to ``owner_key``'s account (lock held)."""
        counters = self._counters
        if counters is not None:
            counters.journal.append(nbytes)
            if len(counters.journal) >= JOURNAL_LIMIT:
                counters.settle()
            self._uncounted.discard(ptr)  # live when counting began: its free counts after all
        if owners is not None and self._owners is owners:
            self._charge_owner(owners, owner_key, ptr, nbytes)

    def _charge_owner(self, owners: OwnerAccounts, owner_key: Any, ptr: int, nbytes: int) -> None:
        """Charge one allocation to the account of ``owner_key`` (lock held)."""
        try:
            account = owners.accounts[owner_key]
        except (KeyError, TypeError):
            paused = gc.isenabled()  # the owner callback makes objects: keep the collector out
            if paused:
                gc.disable()
            try:
                account = owners.open_account(owner_key)
            finally:
                if paused:
                    gc.enable()
        t = account[0] + nbytes
        account[0] = t
        if t > account[1]:
            account[1] = t
        self._owner_of[ptr] = account

    def _uncount(self, ptr: int, nbytes: int) -> None:
        """Take a freed block out of the counters and its owner's account."""
        counters = self._counters
        if counters is not None:
            if self._uncounted and ptr in self._uncounted:
                self._uncounted.discard(ptr)
            else:
                counters.journal.append(-nbytes)
        if self._owners is not None:
            account = self._owner_of.pop(ptr, None)
            if account is not None:
                account[0] -= nbytes
