"""PoolMemoryResource: a stream-ordered, coalescing suballocator over one upstream resource.

Pure bookkeeping on integer addresses; CUDA is only touched for cross-stream ordering (events)
and through the upstream resource. Other suballocators (arena, binning, fixed size) live beside it.

Data structure (chosen for speed in CPython, see bench/alloc.py)
-----------------------------------------------------------------
Free blocks are kept per stream (:meth:`Stream.order_key`). Each stream's free memory is a
TLSF-style segregated fit: sizes (in 256-byte units) map to size classes, 32 exact classes
below 8 KiB and then 16 classes per power of two, so every block in a class at or above a
request's "search class" fits it. Each class is a dict ``ptr -> size`` (``popitem`` is O(1)
and LIFO, deleting an arbitrary block is O(1)), and a ``bytearray`` flags the non-empty classes
so the first candidate class is one C-level ``find`` (an int bitmap was tried: its big-int
shifts and masks cost ~40 ns each). Two more dicts per stream, ``start -> size`` and
``end -> start``, let a freed block merge with both neighbours in O(1). Live blocks are one dict
``ptr -> nbytes`` that also validates every deallocate. Class lookups for sizes below 16 MiB
come from precomputed tables.

In front of that sits a per-stream cache, the fast path: requests below 16 MiB are rounded up
to the floor size of their search class (at most 1/16 more than asked, 3% on average; below
8 KiB only to 256 bytes), so a freed block can be handed back unchanged to any later request
of the same class on the same stream. Freeing such a block only appends it to its class's list
and allocating pops from it: no splitting and no merging, which cut a pair from ~2.0 us to
~0.8 us (bench/alloc.py). Cached blocks are merged into the coalescing lists when the coalescing
path cannot serve a request (before the pool grows), and by ``release()`` and
``reserved_memory_info()``. When the pool is too full for the rounded size, the exact
256-byte-aligned size is tried before giving up, so rounding never causes an out-of-memory.

Threads
-------
The fast path takes no lock. Its only shared-state operations are ``list.pop``/``list.append``
on a cache list and a store or pop on the live-block dict, each atomic (under the GIL, and
per object in free-threaded CPython): a cached block is popped by exactly one caller, and of
two threads freeing one pointer only one pops it from the live table (the other is refused).
Everything else (the coalescing lists, growth, merging the caches) happens under the pool's
one lock; code there empties a cache list one ``pop`` at a time, so blocks appended or taken
meanwhile by lock-free callers are never lost or handed out twice. A lock-free path makes no
container objects, so a finalizer run by the garbage collector can free into the pool at any
point. (Against the locked fast path it replaced: 1.8x -> 0.95x the cost of a plain dict+lock
resource per pair on a CPU host, bench/results/2026-11-30-cpu-alloc.md; 1.07x on the H200,
bench/results/2026-11-30-h200/.)

Instrumentation
---------------
Observers count and attribute allocations through one documented interface, used by
StatisticsResourceAdaptor and AttributionResourceAdaptor: :meth:`PoolMemoryResource.count_allocations`
(an :class:`AllocationCounters` the pool updates) and :meth:`PoolMemoryResource.charge_owners`
(an :class:`OwnerAccounts`: an owner getter called before the lock, a token -> account dict and
an owner callback called under the lock for new tokens). Counting alone keeps the fast path
lock-free: each counted operation appends its size to the counters' journal, folded in by
:meth:`AllocationCounters.settle` (under the lock, by readers, and by the pool every
:data:`JOURNAL_LIMIT` entries). Charging owners takes the lock on the fast path and updates the
accounts inline. :attr:`PoolMemoryResource.instrumentation_lock` is the lock to read under.
:meth:`PoolMemoryResource.live_allocations` (read-only: the table every deallocate is checked
against) is what TrackingResourceAdaptor lists instead of keeping a table of its own, and
:func:`pool_behind` finds the pool behind an adaptor that made the pool's methods its own.
Nothing else reads or writes another object's private state.

Stream order
------------
A block freed on stream A goes to A's free list and is reused on A at once. A block taken from
another stream's list moves to the taking stream B together with the rest of the free block it
was cut from, and B is made to wait for A: an event is recorded on A *at the time of the
take* (this covers everything queued on A before the free, at the cost of maybe also waiting
for later work; it keeps the hot path free of CUDA calls) and B waits on it. When B cannot be
served from any single list, all other streams' free lists are merged into B's (one wait per
stream), so adjacent blocks freed on different streams coalesce before the pool grows.
Memory fresh from upstream at construction belongs to no stream and is taken without a wait.
Without CUDA (host memory on a GPU-less host) there is no stream work to order and no event
is used. A block from another thread's per-thread default stream cannot be recorded on from
this thread, so that case synchronizes the device instead (rare: only under memory pressure).
"""

from __future__ import annotations

import bisect
import gc
import time
from itertools import compress
from typing import Any

from dask_rmm.mr.base import (
    DeviceMemoryResource,
    OutOfMemoryError,
    ReservedMemoryInfo,
    UpstreamResourceAdaptor,
    acquire_contended,
    align_up,
    check_nbytes,
    format_bytes,
    gc_paused_lock,
)
from dask_rmm.sizes import parse_resource_size
from dask_rmm.stream import DEFAULT_STREAM, Stream, as_stream

__all__ = ["AllocationCounters", "OwnerAccounts", "PoolMemoryResource", "pool_behind"]

#: Initial pool size when the upstream is host memory and none is given (no device to take
#: half of): 256 MiB.
DEFAULT_HOST_POOL_SIZE = 256 << 20

_PTDS_HANDLE = 2  # cudaStreamPerThread; its order key differs per thread

# ---------------------------------------------------------------------------------------------
# size classes (sizes in 256-byte units)

_SL_BITS = 4  # 16 classes per power of two
_EXACT = 1 << (_SL_BITS + 1)  # units below this have a class each
_N_CLASSES = 64 << _SL_BITS
_TABLE_UNITS = 1 << 16  # class tables cover sizes below 16 MiB


def _insert_class(u: int) -> int:
    """The class a free block of ``u`` units is filed under (its size's floor class)."""
    if u < _EXACT:
        return u
    shift = u.bit_length() - (_SL_BITS + 1)
    return (shift << _SL_BITS) + (u >> shift)


def _search_class(u: int) -> int:
    """The first class all of whose blocks are at least ``u`` units."""
    if u < _EXACT:
        return u
    shift = u.bit_length() - (_SL_BITS + 1)
    c = (shift << _SL_BITS) + (u >> shift)
    return c + 1 if u & ((1 << shift) - 1) else c


def _class_floor(c: int) -> int:
    """The smallest size (in units) filed under class ``c``."""
    if c < _EXACT:
        return c
    return ((c & ((1 << _SL_BITS) - 1)) + (1 << _SL_BITS)) << ((c >> _SL_BITS) - 1)


def _class_tables() -> tuple[list[int], list[int], list[int]]:
    """``(_INS, _SRCH, _ROUNDED)`` for every size below _TABLE_UNITS units, built one size class
    at a time (a class is a run of equal entries; ~200 runs instead of 3 x 65536 calls, which
    took ~0.15 s of ``import dask_rmm``). tests/mr/test_pool.py checks them against
    :func:`_insert_class` and :func:`_search_class`."""
    ins: list[int] = []
    srch: list[int] = []
    rounded: list[int] = []
    c = 0
    while (lo := _class_floor(c)) < _TABLE_UNITS:
        nxt = _class_floor(c + 1)
        rest = min(nxt, _TABLE_UNITS) - lo - 1
        ins += [c] * (rest + 1)
        # A size of exactly the floor searches its own class; any larger one the next class.
        srch.append(c)
        srch += [c + 1] * rest
        rounded.append(lo << 8)
        rounded += [nxt << 8] * rest
        c += 1
    return ins, srch, rounded


_INS, _SRCH, _ROUNDED = _class_tables()


#: Requests below this many bytes are rounded up to their search class's floor size (at most
#: 1/16 more, see the module docstring) so that a freed block serves any later request of the
#: same class from the per-stream cache.
_CACHED_LIMIT = (_TABLE_UNITS - 1) << 8
_CLASS_INDEXES = range(_N_CLASSES)
# _ROUNDED[u]: bytes a request of ``u`` units (u below _TABLE_UNITS) is given, its search
# class's floor (built with _INS and _SRCH above).


class _FreeList:
    """The free blocks of one stream: size-class dicts, their non-empty flags, address maps."""

    __slots__ = ("bins", "nonempty", "starts", "ends", "stream", "key", "cache")

    def __init__(self, key: Any, stream: Stream | None):
        # cache[c]: blocks of exactly class c's floor size, freed on this stream and not yet
        # merged with their neighbours (a LIFO list: pop/append are the cheapest operations).
        self.cache: list[list[int]] = [[] for _ in range(_N_CLASSES)]
        # Every class dict exists from the start: creating a dict under the pool's lock could
        # run the garbage collector, whose finalizers may free into this pool on this thread.
        self.bins: list[dict[int, int]] = [{} for _ in range(_N_CLASSES)]
        self.nonempty = bytearray(_N_CLASSES)  # 1 where bins[c] has blocks
        self.starts: dict[int, int] = {}  # start -> size
        self.ends: dict[int, int] = {}  # end -> start
        self.stream = stream  # kept alive so an event can be recorded on it later
        self.key = key


_FRESH = "fresh"  # order key of memory no stream has used yet


def pool_behind(resource: Any) -> PoolMemoryResource | None:
    """The :class:`PoolMemoryResource` whose own ``allocate``/``deallocate`` ``resource``'s
    are: the pool itself, or an adaptor that made the pool's methods its own (a
    StatisticsResourceAdaptor's ``counting_pool``, a TrackingResourceAdaptor's
    ``tracking_pool``); None otherwise. Adaptors above use it to fuse with the pool too."""
    if type(resource) is PoolMemoryResource:
        return resource
    for name in ("counting_pool", "tracking_pool"):
        pool = getattr(resource, name, None)
        if type(pool) is PoolMemoryResource:
            return pool
    return None


def order_after(victims: list[tuple[Any, Stream | None]], stream: Stream) -> None:
    """Make ``stream`` wait for the work queued so far on each victim stream.

    ``victims`` are ``(order key, Stream)`` pairs of the streams whose freed blocks ``stream``
    takes over. An event is recorded on the victim now and ``stream`` waits on it; a victim that
    is another thread's per-thread default stream (not addressable from here), or whose handle
    is no longer valid, is covered by a device synchronization instead. Call only when CUDA is
    available, and outside any resource lock.
    """
    from dask_rmm import _cuda
    from dask_rmm.stream import _own_per_thread_key

    mine = _own_per_thread_key()  # None: every per-thread key is another thread's
    for key, victim in victims:
        if key == _FRESH or victim is None or key == stream.order_key():
            continue
        if isinstance(key, tuple) and key != mine:
            _cuda.device_synchronize()
            continue
        try:
            ev = _cuda.event_create(disable_timing=True)
            try:
                _cuda.event_record(ev, victim.handle)
                _cuda.stream_wait_event(stream.handle, ev)
            finally:
                _cuda.event_destroy(ev)
        except _cuda.CUDAError:
            _cuda.device_synchronize()


class TokenLock:
    """A mutex made of one atomic list operation: ``pop`` takes the token, ``append`` returns it.

    The pool's lock. It behaves as ``threading.Lock`` (``acquire(blocking)``, ``release``,
    ``with``), but its hot-path use costs two argument-free list calls, about a third of
    ``Lock.acquire(False)`` + ``release`` in CPython, whose argument parsing dominates. A waiter
    yields the GIL (``time.sleep(0)``) and retries: the pool holds it for bookkeeping only, so a
    waiter never waits long, and no lock convoy forms (see ``acquire_contended``).
    """

    __slots__ = ("token",)

    def __init__(self):
        self.token = [True]  # empty while held

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        token = self.token
        try:
            token.pop()
            return True
        except IndexError:
            if not blocking:
                return False
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while True:
            time.sleep(0)
            try:
                token.pop()
                return True
            except IndexError:
                if deadline is not None and time.monotonic() >= deadline:
                    return False

    def release(self) -> None:
        if self.token:
            raise RuntimeError("release unlocked lock")
        self.token.append(True)

    def locked(self) -> bool:
        return not self.token

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class AllocationCounters:
    """Allocation counters a :class:`PoolMemoryResource` keeps for an observer.

    Part of the pool's instrumentation interface (:meth:`PoolMemoryResource.count_allocations`).
    Sizes are the sizes callers asked for. Current values are derived: ``current_bytes =
    total_bytes - freed_bytes``.

    The pool does not update the numbers on every call: it appends each counted allocation's
    size, and each counted free's negated size, to :attr:`journal` (one atomic ``list.append``,
    so the pool's cached fast path stays lock-free while counting), and :meth:`settle` folds the
    journal into the numbers in order, peaks included (with NumPy for long journals). Readers hold
    :attr:`PoolMemoryResource.instrumentation_lock` and call :meth:`settle` before reading; the
    pool settles on its own when the journal reaches :data:`JOURNAL_LIMIT` entries.

    Attributes
    ----------
    total_bytes, total_count : int
        Allocations counted, in bytes and in number.
    freed_bytes, freed_count : int
        Frees of counted allocations.
    peak_bytes, peak_count : int
        Largest current value seen; the pool raises them, an observer may lower them.
    interval_peak : int
        Like ``peak_bytes``; an observer resets it to sample short spikes.
    failed : int
        Allocations that raised ``MemoryError``.
    journal : list[int]
        Counted operations not yet folded in: ``+nbytes`` per allocation, ``-nbytes`` per free.
    """

    __slots__ = (
        "total_bytes", "total_count", "freed_bytes", "freed_count", "peak_bytes", "peak_count",
        "interval_peak", "failed", "journal",
    )  # fmt: skip

    def __init__(self):
        self.total_bytes = self.total_count = self.freed_bytes = self.freed_count = 0
        self.peak_bytes = self.peak_count = self.interval_peak = self.failed = 0
        self.journal: list[int] = []

    def settle(self) -> None:
        """Fold :attr:`journal` into the numbers (hold the instrumentation lock).

        Entries appended meanwhile by lock-free callers stay for the next call. The peaks are
        those of the journal's order: each entry is appended while its block is the caller's
        (after an allocation took it, before a free hands it back), so a block is never
        counted twice at once.
        """
        journal = self.journal
        n = len(journal)
        if not n:
            return
        # Making the lists below may run the garbage collector, whose finalizers may free into
        # the pool on this thread, which holds the pool's lock: keep the collector out.
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            entries = journal[:n]
            del journal[:n]  # appends made since the copy are past n: they stay
            current = self.total_bytes - self.freed_bytes
            count = self.total_count - self.freed_count
            if n < _SETTLE_IN_NUMPY:
                peak_bytes, peak_count = current, count
                allocated_bytes = allocated = 0
                for e in entries:
                    current += e
                    if e > 0:
                        allocated_bytes += e
                        allocated += 1
                        count += 1
                        if current > peak_bytes:
                            peak_bytes = current
                        if count > peak_count:
                            peak_count = count
                    else:
                        count -= 1
                net = current - (self.total_bytes - self.freed_bytes)  # the loop's running sum
            else:
                import numpy as np

                sizes = np.array(entries, dtype=np.int64)
                running = np.cumsum(sizes)
                peak_bytes = current + max(int(running.max()), 0)
                taken = sizes > 0
                allocated_bytes = int(sizes[taken].sum())
                allocated = int(np.count_nonzero(taken))
                peak_count = count + max(int(np.cumsum(np.where(taken, 1, -1)).max()), 0)
                net = int(running[-1])
            if peak_bytes > self.peak_bytes:
                self.peak_bytes = peak_bytes
            if peak_bytes > self.interval_peak:
                self.interval_peak = peak_bytes
            if peak_count > self.peak_count:
                self.peak_count = peak_count
            self.total_bytes += allocated_bytes
            self.freed_bytes += allocated_bytes - net
            self.total_count += allocated
            self.freed_count += n - allocated
        finally:
            if paused:
                gc.enable()


#: Journal entries at which an allocation settles the counters itself (bounds the journal's
#: memory and each settle's pause: 4096 entries take ~0.5 ms on the 2-vCPU development host).
JOURNAL_LIMIT = 4096
_SETTLE_IN_NUMPY = 64  # journals at least this long are folded with NumPy (~10x faster)


class OwnerAccounts:
    """How a :class:`PoolMemoryResource` charges each allocation to an owner.

    Part of the pool's instrumentation interface (:meth:`PoolMemoryResource.charge_owners`).
    An *account* is a list ``[current_bytes, peak_bytes]`` that the pool updates under its
    lock: an allocation adds its size to the account of the owner current on the allocating
    thread, its free (on any thread) subtracts it from that same account.

    Parameters
    ----------
    get_owner : callable
        ``get_owner() -> token``, called on the allocating thread *before* the pool's lock is
        taken (it may run any Python). ``None`` is a token like any other.
    accounts : dict
        ``token -> account``, looked up under the pool's lock on every allocation.
    open_account : callable
        ``open_account(token) -> account``, the owner callback: called under the pool's lock
        (with the garbage collector paused) for a token missing from ``accounts`` or one that
        cannot be hashed. It returns the account to charge and may add it to ``accounts``; it
        must not call into the pool.
    """

    __slots__ = ("get_owner", "accounts", "open_account")

    def __init__(self, get_owner, accounts: dict, open_account):
        self.get_owner = get_owner
        self.accounts = accounts
        self.open_account = open_account


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
    with one, by ``max(request, half of the room left)``; a failed upstream allocation is
    retried with half the size, down to the request. :meth:`release` hands fully free upstream
    chunks back. Thread safe: the cached fast path takes no lock, everything else one lock held
    for bookkeeping only (never across an upstream call); see Threads in the module docstring.
    Free blocks are kept per stream; see the module docstring for stream ordering, and
    Instrumentation for how the statistics and attribution adaptors count through the pool.

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
    ):
        super().__init__(upstream_mr)
        from dask_rmm import _cuda

        # Stream order only matters for device memory: host memory has no queued stream work
        # (and the streams of a host-memory replay or test may be made-up handles).
        self._ordered = _cuda.is_available() and not upstream_mr.is_host_memory
        if maximum_pool_size is not None:
            maximum_pool_size = (
                parse_resource_size(maximum_pool_size, upstream_mr, "maximum_pool_size") or None
            )
        if initial_pool_size is None:
            if upstream_mr.is_host_memory:
                initial_pool_size = DEFAULT_HOST_POOL_SIZE
            else:
                free, _total = _cuda.mem_get_info()
                initial_pool_size = align_up(free // 2)
            if maximum_pool_size is not None:
                initial_pool_size = min(initial_pool_size, maximum_pool_size)
        else:
            initial_pool_size = parse_resource_size(
                initial_pool_size, upstream_mr, "initial_pool_size"
            )
        if maximum_pool_size is not None and initial_pool_size > maximum_pool_size:
            raise ValueError(
                f"initial_pool_size ({format_bytes(initial_pool_size)}) exceeds "
                f"maximum_pool_size ({format_bytes(maximum_pool_size)})"
            )
        self._maximum = maximum_pool_size
        self._initial_pool_size = initial_pool_size
        self._initial_chunk: int | None = None  # what trim() keeps down to the initial size
        self._lock = TokenLock()
        self._token = self._lock.token  # the hot paths take and return it directly
        self._live: dict[int, int] = {}  # ptr -> nbytes as the caller asked
        self._lists: dict[Any, _FreeList] = {}
        self._chunks: dict[int, int] = {}  # upstream chunk start -> size
        self._chunk_starts: set[int] = set()  # blocks never merge across these
        self._pool_size = 0
        self._growing = 0  # bytes being asked of upstream right now (outside the lock)
        # stream key -> that stream's _FreeList.cache, read by the lock-free fast paths
        self._caches: dict[Any, list[list[int]]] = {}
        # Instrumentation (see count_allocations / charge_owners). The fast paths test _owners
        # (charging takes the lock) and _journal (counting appends to it); the slow paths test
        # _instrumented, True when either is attached.
        self._counters: AllocationCounters | None = None
        self._journal: list[int] | None = None  # self._counters.journal, for the fast paths
        self._uncounted: set[int] = set()  # live when counting began: their frees not counted
        self._owners: OwnerAccounts | None = None
        self._owner_of: dict[int, list[int]] = {}  # ptr -> the account it was charged to
        self._instrumented = False
        if initial_pool_size:
            ptr, _ = self._upstream_allocate(initial_pool_size, initial_pool_size, DEFAULT_STREAM)
            self._initial_chunk = ptr
            self._add_chunk(ptr, initial_pool_size)
            self._insert(self._free_list(_FRESH, None), ptr, initial_pool_size)

    # -- public API ------------------------------------------------------------------------

    def pool_size(self) -> int:
        """Bytes the pool currently holds from upstream (free and allocated)."""
        return self._pool_size

    @property
    def maximum_pool_size(self) -> int | None:
        return self._maximum

    @property
    def initial_pool_size(self) -> int:
        """Bytes the pool took from upstream when it was made (what :meth:`trim` keeps)."""
        return self._initial_pool_size

    # -- instrumentation interface ---------------------------------------------------------

    @property
    def instrumentation_lock(self) -> TokenLock:
        """The lock under which the pool updates attached counters and accounts: hold it to
        read them consistently (briefly, and never while calling into the pool)."""
        return self._lock

    def count_allocations(self, counters: AllocationCounters) -> bool:
        """Count every allocation and free made on this pool into ``counters``.

        Blocks live now are not counted when they are freed. One set of counters at a time:
        returns False (and changes nothing) when others are attached already. Counting is
        journaled (see :class:`AllocationCounters`): read the counters under
        :attr:`instrumentation_lock` after calling their ``settle()``.
        """
        if not isinstance(counters, AllocationCounters):
            raise TypeError(f"counters must be AllocationCounters, got {type(counters).__name__}")
        import numpy  # noqa: F401  settle() folds long journals with it: imported here, never under the lock

        with gc_paused_lock(self._lock):
            if self._counters is not None:
                return False
            self._uncounted = set(self._live)
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
                    self._instrumented = self._owners is not None

    def _after_journaled_allocation(self, ptr: int) -> None:
        """After the fast path journaled an allocation: a block live when counting began is
        counted from now on, and a journal of JOURNAL_LIMIT entries is folded in."""
        if self._uncounted:
            self._uncounted.discard(ptr)
        journal = self._journal
        if journal is not None and len(journal) >= JOURNAL_LIMIT:
            with self._lock:  # settle() keeps the garbage collector out
                st = self._counters
                if st is not None:
                    st.settle()

    def charge_owners(self, owners: OwnerAccounts) -> bool:
        """Charge every allocation made on this pool to an owner (see :class:`OwnerAccounts`).

        Blocks live now are never charged back. Returns False (and changes nothing) when
        another :class:`OwnerAccounts` is attached already.
        """
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
        """``{ptr: nbytes}`` of every block allocated from this pool and not yet freed, sizes as
        the callers asked: a snapshot of the table every deallocate is checked against.

        Part of the instrumentation interface (read-only): TrackingResourceAdaptor lists a
        pool's outstanding allocations from it instead of keeping a second table.
        """
        while True:
            try:
                tags = dict(self._live)  # one C-level copy; lock-free callers may change it
            except RuntimeError:  # changed during the copy (free-threaded CPython): again
                continue
            return {ptr: ~tag if tag < 0 else tag for ptr, tag in tags.items()}

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        try:
            key = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == _PTDS_HANDLE:
            key = stream.order_key()
        # The fast path: a block of the request's class cached on this stream. Without
        # instrumentation it takes no lock: list.pop and a dict store are atomic, so each
        # cached block goes to exactly one caller (see Threads in the module notes).
        if type(nbytes) is int and 0 < nbytes <= _CACHED_LIMIT:
            caches = self._caches.get(key)
            if caches is not None:
                cached = caches[_SRCH[(nbytes + 255) >> 8]]
                if cached:
                    if self._owners is None:
                        # Lock-free: list.pop and a dict store are atomic, so each cached block
                        # goes to exactly one caller. Counting (the statistics adaptor) adds one
                        # journal append (AllocationCounters.settle folds it in).
                        try:
                            ptr = cached.pop()
                        except IndexError:  # another thread took the last one
                            pass
                        else:
                            self._live[ptr] = nbytes
                            journal = self._journal
                            if journal is not None:
                                journal.append(nbytes)
                                if self._uncounted or len(journal) >= JOURNAL_LIMIT:
                                    self._after_journaled_allocation(ptr)
                            return ptr
                    else:
                        # Charging owners (the attribution adaptor): the same under the lock,
                        # the owner's account updated inline.
                        owners = self._owners
                        # Outside the lock: a first read of a thread-local may allocate and
                        # so run the GC.
                        try:
                            token = owners.get_owner()
                        except Exception:
                            token = None
                        mutex = self._token
                        try:
                            mutex.pop()
                        except IndexError:
                            acquire_contended(self._lock)
                        try:
                            try:
                                ptr = cached.pop()
                            except IndexError:  # a lock-free caller that started before
                                ptr = 0
                            if ptr:
                                self._live[ptr] = nbytes
                                if self._counters is not None:
                                    self._count_allocation(ptr, nbytes)
                                if self._owners is owners:
                                    try:
                                        account = owners.accounts[token]
                                    except (KeyError, TypeError):
                                        account = self._open_account(owners, token)
                                    t = account[0] + nbytes
                                    account[0] = t
                                    if t > account[1]:
                                        account[1] = t
                                    self._owner_of[ptr] = account
                                return ptr
                        finally:
                            mutex.append(True)
        return self._allocate_locked(nbytes, stream, key)

    def _allocate_locked(self, nbytes: Any, stream: Stream, key: Any) -> int:
        """Everything but the lock-free fast path: validation, the coalescing lists under the
        lock, instrumentation, and (through _allocate_slow) growth."""
        if type(nbytes) is not int or nbytes <= 0:
            nbytes = check_nbytes(nbytes)
            if nbytes == 0:
                return 0
        if nbytes <= _CACHED_LIMIT:
            u = (nbytes + 255) >> 8
            sc = _SRCH[u]
            size = _ROUNDED[u]
        else:
            size = (nbytes + 255) & -256
            sc = _search_class(size >> 8)
        owners = self._owners
        if owners is not None:
            # Outside the lock: a first read of a thread-local may allocate and so run the GC.
            try:
                token = owners.get_owner()
            except Exception:
                token = None
        mutex = self._token
        try:
            mutex.pop()
        except IndexError:
            acquire_contended(self._lock)
        try:
            fl = self._lists.get(key)
            if fl is not None:
                cached = fl.cache[sc]
                ptr = 0
                if cached:
                    try:
                        ptr = cached.pop()
                    except IndexError:  # taken by a lock-free caller meanwhile
                        pass
                if not ptr:
                    nonempty = fl.nonempty
                    c = nonempty.find(1, sc)
                    if c >= 0:
                        bins = fl.bins
                        b = bins[c]
                        ptr, bsize = b.popitem()
                        starts = fl.starts
                        del starts[ptr]
                        rem = bsize - size
                        if rem:
                            r = ptr + size
                            starts[r] = rem
                            fl.ends[r + rem] = r
                            u = rem >> 8
                            if u < _TABLE_UNITS:
                                rc = _INS[u]
                            else:
                                sh = u.bit_length() - 5
                                rc = (sh << 4) + (u >> sh)
                            if rc == c:
                                b[r] = rem
                            else:
                                if not b:
                                    nonempty[c] = 0
                                b = bins[rc]
                                b[r] = rem
                                nonempty[rc] = 1
                        else:
                            del fl.ends[ptr + bsize]
                            if not b:
                                nonempty[c] = 0
                if ptr:
                    self._live[ptr] = nbytes
                    if self._counters is not None:
                        self._count_allocation(ptr, nbytes)
                    if owners is not None and self._owners is owners:
                        self._charge_owner(owners, token, ptr, nbytes)
                    return ptr
        finally:
            mutex.append(True)
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
                if self._counters is not None:
                    self._count_allocation(ptr, nbytes)
                if owners is not None and self._owners is owners:
                    self._charge_owner(owners, token, ptr, nbytes)
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        try:
            key = stream.handle
        except AttributeError:
            stream = as_stream(stream)
            key = stream.handle
        if key == _PTDS_HANDLE:
            key = stream.order_key()
        if self._owners is None:
            # Lock-free fast path: the pop from the live table is atomic, so of two threads
            # freeing one pointer only one gets it. Counting journals the free before the block
            # is handed back, so that its next allocation is journaled after it.
            live = self._live
            n = live.pop(ptr, None)
            if n is not None:
                if n == nbytes and n <= _CACHED_LIMIT and type(ptr) is int:
                    caches = self._caches.get(key)
                    if caches is not None:
                        journal = self._journal
                        if journal is not None:
                            if self._uncounted and ptr in self._uncounted:
                                self._uncounted.discard(ptr)
                            else:
                                journal.append(-n)
                        caches[_SRCH[(n + 255) >> 8]].append(ptr)
                        return
                live[ptr] = n  # the general path below takes it again under the lock
        else:
            # Charging owners: the same under the lock, the owner's account updated inline.
            mutex = self._token
            try:
                mutex.pop()
            except IndexError:
                acquire_contended(self._lock)
            try:
                live = self._live
                n = live.pop(ptr, None)
                if n is not None:
                    if n == nbytes and n <= _CACHED_LIMIT and type(ptr) is int:
                        caches = self._caches.get(key)
                        if caches is not None:
                            st = self._counters
                            if st is not None:
                                if self._uncounted and ptr in self._uncounted:
                                    self._uncounted.discard(ptr)
                                else:
                                    st.journal.append(-n)
                            account = self._owner_of.pop(ptr, None)
                            if account is not None:
                                account[0] -= n
                            caches[_SRCH[(n + 255) >> 8]].append(ptr)
                            return
                    live[ptr] = n
            finally:
                mutex.append(True)
        self._deallocate_locked(ptr, nbytes, stream, key)

    def _deallocate_locked(self, ptr: Any, nbytes: Any, stream: Stream, key: Any) -> None:
        mutex = self._token
        try:
            mutex.pop()
        except IndexError:
            acquire_contended(self._lock)
        try:
            live = self._live
            n = live.pop(ptr, None)
            if n == nbytes and type(ptr) is int:
                fl = self._lists.get(key)
                if fl is None:
                    fl = self._free_list(key, stream)
                if self._instrumented:
                    self._uncount(ptr, n)
                if n <= _CACHED_LIMIT:
                    fl.cache[_SRCH[(n + 255) >> 8]].append(ptr)
                    return
                size = (n + 255) & -256
                starts = fl.starts
                ends = fl.ends
                bins = fl.bins
                nonempty = fl.nonempty
                nxt = ptr + size
                ns = starts.get(nxt)
                if ns is not None and nxt not in self._chunk_starts:
                    del starts[nxt]
                    u = ns >> 8
                    if u < _TABLE_UNITS:
                        c = _INS[u]
                    else:
                        sh = u.bit_length() - 5
                        c = (sh << 4) + (u >> sh)
                    b = bins[c]
                    del b[nxt]
                    if not b:
                        nonempty[c] = 0
                    size += ns
                prev = ends.get(ptr)
                if prev is not None and ptr not in self._chunk_starts:
                    del ends[ptr]
                    ps = starts[prev]
                    u = ps >> 8
                    if u < _TABLE_UNITS:
                        c = _INS[u]
                    else:
                        sh = u.bit_length() - 5
                        c = (sh << 4) + (u >> sh)
                    b = bins[c]
                    del b[prev]
                    if not b:
                        nonempty[c] = 0
                    ptr = prev
                    size += ps
                starts[ptr] = size
                ends[ptr + size] = ptr
                u = size >> 8
                if u < _TABLE_UNITS:
                    c = _INS[u]
                else:
                    sh = u.bit_length() - 5
                    c = (sh << 4) + (u >> sh)
                b = bins[c]
                b[ptr] = size
                nonempty[c] = 1
                return
            if n is not None:
                live[ptr] = n
        finally:
            mutex.append(True)
        self._deallocate_slow(ptr, nbytes, n, stream)

    def release(self) -> int:
        """Give every fully free upstream chunk back to upstream; return the bytes released.

        A chunk counts as free when its free blocks, on whatever streams they were freed,
        cover it; the streams they were freed on are synchronized before it goes back.
        """
        return self.trim(0)

    def trim(self, size: int | str | float | None = None) -> int:
        """Give fully free upstream chunks back while the pool holds more than ``size`` bytes;
        return the bytes released.

        ``size`` defaults to the initial pool size (a pool grown for a peak shrinks back to
        what it took when it was made); ``0`` releases every free chunk, as :meth:`release`.
        Memory goes back whole chunks at a time (one upstream allocation each: the initial one,
        then one per growth), the largest free one first, so the pool can end below ``size`` by
        less than a chunk; the initial chunk only goes when ``size`` is below the initial pool
        size. Live blocks are never touched: a chunk holding one stays.

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
            keep = parse_resource_size(size, self.upstream_mr, "size") or 0
        with gc_paused_lock(self._lock):
            self._flush_caches()
            chunk_starts = sorted(self._chunks)
            per_chunk: dict[int, list[tuple[_FreeList, int, int]]] = {}
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
            streams = set()
            for csize, chunk in sorted(free_chunks, reverse=True):
                if self._pool_size <= keep:
                    break
                if chunk == self._initial_chunk and keep >= self._initial_pool_size:
                    continue
                for fl, ptr, bsize in per_chunk[chunk]:
                    self._remove(fl, ptr, bsize)
                    streams.add(fl)
                del self._chunks[chunk]
                self._chunk_starts.discard(chunk)
                self._pool_size -= csize
                released.append((chunk, csize))
                if chunk == self._initial_chunk:
                    self._initial_chunk = None
        self._synchronize_all(list(streams))
        for start, csize in released:
            self.upstream_mr.deallocate(start, csize, DEFAULT_STREAM)
        return sum(csize for _, csize in released)

    def reserved_memory_info(self) -> ReservedMemoryInfo:
        with gc_paused_lock(self._lock):
            self._flush_caches()
            free = 0
            largest = 0
            for fl in self._lists.values():
                if fl.starts:
                    free += sum(fl.starts.values())
                    largest = max(largest, max(fl.starts.values()))
            return ReservedMemoryInfo(self._pool_size, free, largest)

    def __repr__(self) -> str:
        return (
            f"<PoolMemoryResource pool_size={format_bytes(self._pool_size)} "
            f"maximum={format_bytes(self._maximum)} upstream={self.upstream_mr!r}>"
        )

    def __del__(self):
        # Like RMM's destructor: everything goes back to upstream. Live DeviceBuffers keep the
        # pool alive, so only raw pointers a caller forgot can be outstanding here.
        try:
            if self._ordered:
                # Blocks freed on other streams may still be in use by queued work.
                from dask_rmm import _cuda

                _cuda.device_synchronize()
            chunks = list(self._chunks.items())
            self._chunks.clear()
            for start, size in chunks:
                self.upstream_mr.deallocate(start, size, DEFAULT_STREAM)
        except Exception:
            pass

    # -- test and report helpers -------------------------------------------------------------

    def _free_blocks(self) -> list[tuple[int, int, Any]]:
        """Every free block as ``(ptr, size, stream key)``, by address (after merging the caches)."""
        with gc_paused_lock(self._lock):
            self._flush_caches()
            return sorted(
                (p, s, fl.key) for fl in self._lists.values() for p, s in fl.starts.items()
            )

    def _chunk_list(self) -> list[tuple[int, int]]:
        """The upstream chunks as ``(ptr, size)``, by address."""
        with gc_paused_lock(self._lock):
            return sorted(self._chunks.items())

    def _live_count(self) -> int:
        return len(self._live)

    # -- internals -------------------------------------------------------------------------

    def _free_list(self, key: Any, stream: Stream | None) -> _FreeList:
        fl = self._lists.get(key)
        if fl is None:
            # Made with the lock held (first use of a stream): keep the collector out, see
            # gc_paused_lock.
            paused = gc.isenabled()
            if paused:
                gc.disable()
            try:
                fl = self._lists[key] = _FreeList(key, stream)
                self._caches[key] = fl.cache
            finally:
                if paused:
                    gc.enable()
        return fl

    def _count_allocation(self, ptr: int, nbytes: int) -> None:
        """Count one allocation into the attached counters (lock held)."""
        journal = self._counters.journal
        journal.append(nbytes)
        if len(journal) >= JOURNAL_LIMIT:
            self._counters.settle()
        if self._uncounted:
            # Allocated lock-free while counting began: its free is counted after all.
            self._uncounted.discard(ptr)

    def _charge_owner(self, owners: OwnerAccounts, token: Any, ptr: int, nbytes: int) -> None:
        """Charge one allocation to its owner's account (lock held)."""
        try:
            account = owners.accounts[token]
        except (KeyError, TypeError):
            account = self._open_account(owners, token)
        t = account[0] + nbytes
        account[0] = t
        if t > account[1]:
            account[1] = t
        self._owner_of[ptr] = account

    @staticmethod
    def _open_account(owners: OwnerAccounts, token: Any) -> list[int]:
        """The owner callback, for a token not in ``owners.accounts`` (lock held)."""
        # The callback makes objects: keep the collector out while the lock is held.
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            return owners.open_account(token)
        finally:
            if paused:
                gc.enable()

    def _uncount(self, ptr: int, nbytes: int) -> None:
        """Take a freed block out of the counters and its owner's account (lock held)."""
        st = self._counters
        if st is not None:
            if self._uncounted and ptr in self._uncounted:
                self._uncounted.discard(ptr)
            else:
                st.journal.append(-nbytes)
        if self._owners is not None:
            account = self._owner_of.pop(ptr, None)
            if account is not None:
                account[0] -= nbytes

    def _flush_caches(self) -> bool:
        """Merge every cached block into its stream's coalescing free list (lock held).

        Returns True when anything was cached.
        """
        flushed = False
        insert = self._insert
        for fl in self._lists.values():
            cache = fl.cache
            for c in compress(_CLASS_INDEXES, cache):  # the non-empty classes, found in C
                size = _class_floor(c) << 8
                cached = cache[c]
                # One pop at a time: lock-free callers may pop or append meanwhile, and each
                # block must end up in exactly one place.
                while cached:
                    try:
                        ptr = cached.pop()
                    except IndexError:
                        break
                    insert(fl, ptr, size)
                    flushed = True
        return flushed

    def _add_chunk(self, ptr: int, size: int) -> None:
        self._chunks[ptr] = size
        self._chunk_starts.add(ptr)
        self._pool_size += size

    def _insert(self, fl: _FreeList, ptr: int, size: int) -> None:
        """File a free block, merging with free neighbours of the same list and chunk."""
        starts = fl.starts
        nxt = ptr + size
        ns = starts.get(nxt)
        if ns is not None and nxt not in self._chunk_starts:
            self._remove(fl, nxt, ns)
            size += ns
        prev = fl.ends.get(ptr)
        if prev is not None and ptr not in self._chunk_starts:
            ps = starts[prev]
            self._remove(fl, prev, ps)
            ptr = prev
            size += ps
        starts[ptr] = size
        fl.ends[ptr + size] = ptr
        c = _insert_class(size >> 8)
        b = fl.bins[c]
        b[ptr] = size
        fl.nonempty[c] = 1

    def _remove(self, fl: _FreeList, ptr: int, size: int) -> None:
        del fl.starts[ptr]
        del fl.ends[ptr + size]
        c = _insert_class(size >> 8)
        b = fl.bins[c]
        del b[ptr]
        if not b:
            fl.nonempty[c] = 0

    def _move_all(self, src: _FreeList, dst: _FreeList) -> None:
        for ptr, size in list(src.starts.items()):
            self._remove(src, ptr, size)
            self._insert(dst, ptr, size)

    def _find(self, fl: _FreeList, size: int) -> tuple[int, int] | None:
        """A free block of ``fl`` that fits ``size`` (good fit, then the request's own class)."""
        u = size >> 8
        sc = _search_class(u)
        c = fl.nonempty.find(1, sc)
        if c >= 0:
            return next(iter(fl.bins[c].items()))
        ic = _insert_class(u)
        if ic != sc and fl.nonempty[ic]:
            for ptr, bsize in fl.bins[ic].items():
                if bsize >= size:
                    return ptr, bsize
        return None

    def _carve(self, fl: _FreeList, ptr: int, bsize: int, size: int, tag: int, dst=None) -> int:
        """Hand out ``size`` bytes at the start of free block ``ptr``; the rest goes to ``dst``.
        ``tag`` is recorded in the live table (see :meth:`_allocate_slow`)."""
        self._remove(fl, ptr, bsize)
        if bsize > size:
            self._insert(dst if dst is not None else fl, ptr + size, bsize - size)
        self._live[ptr] = tag
        return ptr

    def _allocate_slow(
        self, nbytes: int, size: int, key: Any, stream: Stream, tag: int | None = None
    ) -> int:
        """Serve a request the fast path could not: own coalesced list, then (after merging
        the caches) other streams' lists, then growth; as a last resort a rounded-up request
        is retried at its exact 256-byte size.

        ``tag`` is what the live table records: ``nbytes`` for a rounded block, ``~nbytes``
        for one of exact size (deallocate's fast path then falls through to the slow one).
        """
        if tag is None:
            tag = nbytes
        waits: list[_FreeList] = []
        with gc_paused_lock(self._lock):
            own = self._free_list(key, stream)
            found = self._find(own, size)
            if found is None and self._flush_caches():
                found = self._find(own, size)
            if found is not None:
                return self._carve(own, *found, size, tag)
            # A fitting block on another stream: take it, the remainder comes along.
            for fl in list(self._lists.values()):
                if fl is own or not fl.starts:
                    continue
                found = self._find(fl, size)
                if found is not None:
                    ptr = self._carve(fl, *found, size, tag, dst=own)
                    waits.append(fl)
                    break
            else:
                # Merge every other stream's free blocks into ours, then try again.
                others = [fl for fl in self._lists.values() if fl is not own and fl.starts]
                ptr = 0
                if others:
                    for fl in others:
                        self._move_all(fl, own)
                    waits.extend(others)
                    found = self._find(own, size)
                    if found is not None:
                        ptr = self._carve(own, *found, size, tag)
        if waits:
            self._wait_for(waits, stream)
        if ptr:
            return ptr
        try:
            return self._grow(nbytes, size, key, stream, tag)
        except OutOfMemoryError:
            exact = (nbytes + 255) & -256
            if exact == size:
                raise
            return self._allocate_slow(nbytes, exact, key, stream, ~nbytes)

    def _size_to_grow(self, size: int) -> int:
        held = self._pool_size + self._growing
        if self._maximum is not None:
            remaining = align_up(max(self._maximum - held, 0))
            return max(size, align_up(remaining // 2)) if size <= remaining else 0
        return max(size, held)

    def _grow(self, nbytes: int, size: int, key: Any, stream: Stream, tag: int) -> int:
        with gc_paused_lock(self._lock):
            try_size = self._size_to_grow(size)
            if not try_size:
                raise self._oom(nbytes, stream, "the maximum pool size leaves no room")
            self._growing += try_size
        try:
            ptr, got = self._upstream_allocate(try_size, size, stream)
        except MemoryError as e:
            with gc_paused_lock(self._lock):
                self._growing -= try_size
                raise self._oom(nbytes, stream, f"upstream could not supply it: {e}") from e
        except BaseException:
            with gc_paused_lock(self._lock):
                self._growing -= try_size
            raise
        with gc_paused_lock(self._lock):
            self._growing -= try_size
            self._add_chunk(ptr, got)
            if got > size:
                self._insert(self._free_list(key, stream), ptr + size, got - size)
            self._live[ptr] = tag
        return ptr

    def _upstream_allocate(self, try_size: int, min_size: int, stream: Stream) -> tuple[int, int]:
        """``(ptr, size)`` of ``try_size`` bytes from upstream, halving on failure down to
        ``min_size`` (RMM's back-off)."""
        while True:
            try:
                return self.upstream_mr.allocate(try_size, stream), try_size
            except MemoryError:
                if try_size <= min_size:
                    raise
                try_size = max(min_size, align_up(try_size // 2))

    def _oom(self, nbytes: int, stream: Stream, reason: str) -> OutOfMemoryError:
        self._flush_caches()  # called with the lock held
        free = 0
        largest = 0
        for fl in self._lists.values():
            if fl.starts:
                free += sum(fl.starts.values())
                largest = max(largest, max(fl.starts.values()))
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

    def _deallocate_slow(self, ptr: Any, nbytes: Any, allocated: int | None, stream) -> None:
        """Zero-size frees, pointers of other int types, and the errors."""
        if ptr == 0 and nbytes == 0:
            return
        if type(ptr) is not int:
            if isinstance(ptr, bool) or not hasattr(ptr, "__index__"):
                raise TypeError(
                    f"PoolMemoryResource.deallocate({ptr!r}, {nbytes!r}): the pointer must be an int"
                )
            return self.deallocate(ptr.__index__(), nbytes, stream)
        call = f"PoolMemoryResource.deallocate({ptr:#x}, {nbytes!r})"
        if allocated is not None and allocated < 0:
            if ~allocated == nbytes:
                self._deallocate_exact(ptr, nbytes, stream)
                return
            allocated = ~allocated
        if allocated is not None:
            raise ValueError(
                f"{call}: wrong size, the pointer was allocated with {allocated} bytes; "
                "deallocate takes the size passed to allocate"
            )
        with gc_paused_lock(self._lock):
            freed = any(
                ptr in fl.starts or any(ptr in cached for cached in fl.cache if cached)
                for fl in self._lists.values()
            )
        where = (
            "a free block of this pool (double free)"
            if freed
            else "not a live allocation of this pool (foreign pointer or double free)"
        )
        raise ValueError(f"{call}: {ptr:#x} is {where}")

    def _deallocate_exact(self, ptr: int, nbytes: int, stream: Stream) -> None:
        """Free a block allocated at its exact size (the pool was too full to round it up)."""
        stream = as_stream(stream)
        key = stream.order_key()
        with gc_paused_lock(self._lock):
            if self._live.get(ptr) != ~nbytes:
                raise ValueError(
                    f"PoolMemoryResource.deallocate({ptr:#x}, {nbytes}): freed concurrently twice"
                )
            del self._live[ptr]
            if self._instrumented:
                self._uncount(ptr, nbytes)
            self._insert(self._free_list(key, stream), ptr, (nbytes + 255) & -256)

    def _wait_for(self, victims: list[_FreeList], stream: Stream) -> None:
        if self._ordered:
            order_after([(fl.key, fl.stream) for fl in victims], stream)

    def _synchronize_all(self, victims: list[_FreeList]) -> None:
        """Wait for every stream blocks were freed on (before memory goes back upstream)."""
        if not self._ordered or not victims:
            return
        from dask_rmm import _cuda

        if any(isinstance(fl.key, tuple) for fl in victims):
            _cuda.device_synchronize()
            return
        for fl in victims:
            if fl.stream is not None:
                try:
                    _cuda.stream_synchronize(fl.stream.handle)
                except _cuda.CUDAError:
                    _cuda.device_synchronize()

    def memory_layout(
        self,
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
        """The pool's address space, read-only: ``(chunks, free blocks, live blocks)``, each a
        list of ``(ptr, size)`` sorted by address.

        Live sizes are what a block occupies (its rounded size), so that within a chunk the
        free and live blocks tile it. Blocks never coalesce across a chunk boundary. For callers
        that decide which live blocks, once freed, would merge into a large enough free block
        (``dask_rmm.pressure``); cached blocks are merged first, as ``reserved_memory_info`` does.
        """
        with gc_paused_lock(self._lock):
            self._flush_caches()
            free: list[tuple[int, int]] = []
            for fl in list(self._lists.values()):
                free.extend(fl.starts.items())  # copied in one C call (the GIL is held)
            live_tags = list(self._live.items())  # likewise, lock-free paths may change it
            chunks = list(self._chunks.items())
        live = []
        for ptr, tag in live_tags:
            n = ~tag if tag < 0 else tag
            if tag >= 0 and n <= _CACHED_LIMIT:
                live.append((ptr, _ROUNDED[(n + 255) >> 8]))
            else:
                live.append((ptr, (n + 255) & -256))
        return sorted(chunks), sorted(free), sorted(live)
