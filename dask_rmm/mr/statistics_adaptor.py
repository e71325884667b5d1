"""``StatisticsResourceAdaptor``: current, peak and total bytes and counts of an upstream, with
RMM's stack of counter frames, and its ``Statistics`` snapshot. Not here: module-level helpers
(``enable_statistics``, ``profiler``...: :mod:`dask_rmm.statistics`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import asdict, astuple, dataclass

from dask_rmm.mr.base import DeviceMemoryResource, UpstreamResourceAdaptor
from dask_rmm.mr.instrumentation import JOURNAL_LIMIT, AllocationCounters
from dask_rmm.mr.locks import Mutex
from dask_rmm.mr.pool import PoolMemoryResource, pool_behind
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["Statistics", "StatisticsResourceAdaptor"]


@dataclass(frozen=True)
class Statistics(Mapping):
    """Allocation statistics of one counter frame.

    Bytes are the sizes callers asked for (not rounded up). A read-only mapping too
    (``stats["peak_bytes"]``, ``keys()``, ``get()``), like the dict older RMM versions returned.
    """

    current_bytes: int  #: Bytes allocated and not yet freed.
    current_count: int  #: Allocations not yet freed.
    peak_bytes: int  #: Largest ``current_bytes`` seen.
    peak_count: int  #: Largest ``current_count`` seen.
    total_bytes: int  #: Bytes allocated in all (freed or not).
    total_count: int  #: Number of allocations in all.

    def __getitem__(self, key: str) -> int:
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def to_dict(self) -> dict[str, int]:
        """A plain dict (for wire formats)."""
        return asdict(self)


class StatisticsResourceAdaptor(UpstreamResourceAdaptor):
    """Counts the allocations made through it: current, peak and total bytes and counts.

    As in RMM, :meth:`push_counters`/:meth:`pop_counters` keep a stack of counter frames and
    :attr:`allocation_counts` reads the top one. Zero-byte allocations are not counted. Counters
    change only after the upstream succeeded (an out-of-memory only counts in
    :attr:`failed_allocations`). Over a :class:`PoolMemoryResource` the pool counts, allocations
    made on it directly too (:attr:`counting_pool`; docs/internals.md, Statistics).

    Examples
    --------
    >>> from dask_rmm.mr import StatisticsResourceAdaptor, SystemMemoryResource
    >>> mr = StatisticsResourceAdaptor(SystemMemoryResource())
    >>> p = mr.allocate(1000)
    >>> mr.allocation_counts.current_bytes
    1000
    >>> mr.deallocate(p, 1000)
    >>> mr.allocation_counts["peak_bytes"]
    1000
    """

    def __init__(self, upstream_mr: DeviceMemoryResource):
        super().__init__(upstream_mr)
        self._lock: Mutex = threading.Lock()
        self._acquire, self._release = self._lock.acquire, self._lock.release
        self._c = AllocationCounters()  # the top frame's
        self._frames: list[Statistics] = []  # the outer frames as they were when pushed
        self._base_bytes = 0  # the outer frames' current bytes
        self._counting_pool: PoolMemoryResource | None = None
        pool = pool_behind(upstream_mr)
        if pool is not None and pool.count_allocations(self._c):
            self._counting_pool = pool
            self._fuse(pool, pool.instrumentation_lock)
            weakref.finalize(self, pool.stop_counting, self._c).atexit = False

    @property
    def counting_pool(self) -> PoolMemoryResource | None:
        """The pool that counts for this adaptor (its ``allocate``/``deallocate`` are then the
        pool's), or None when the adaptor counts on its own."""
        return self._counting_pool

    # -- counting on its own: journaled as the pool does (AllocationCounters) ----------------

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        """Allocate from upstream and count it (after the upstream succeeded)."""
        try:
            ptr = self._upstream_allocate(nbytes, stream)
        except MemoryError:
            self._acquire()
            self._c.failed += 1
            self._release()
            raise
        if nbytes:
            journal = self._c.journal
            journal.append(nbytes if type(nbytes) is int else int(nbytes))
            if len(journal) >= JOURNAL_LIMIT:
                self._settle()
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        """Free through upstream; counters change only if the upstream accepted the free."""
        self._upstream_deallocate(ptr, nbytes, stream)
        if nbytes:
            journal = self._c.journal
            journal.append(-nbytes if type(nbytes) is int else -int(nbytes))
            if len(journal) >= JOURNAL_LIMIT:
                self._settle()

    def _settle(self) -> None:
        with self._lock:
            self._c.settle()

    # -- reading --------------------------------------------------------------------------

    def _top_locked(self) -> Statistics:
        self._c.settle()
        return Statistics(
            int(self._c.total_bytes - self._c.freed_bytes),
            self._c.total_count - self._c.freed_count,
            int(self._c.peak_bytes),
            self._c.peak_count,
            int(self._c.total_bytes),
            self._c.total_count,
        )

    @property
    def allocation_counts(self) -> Statistics:
        """The top counter frame as :class:`Statistics`."""
        with self._lock:
            return self._top_locked()

    @property
    def failed_allocations(self) -> int:
        """How many allocations the upstream refused (raised) through this adaptor."""
        return self._c.failed

    @property
    def current_bytes(self) -> int:
        """Bytes currently allocated through this adaptor, across all counter frames."""
        with self._lock:
            self._c.settle()
            return int(self._base_bytes + self._c.total_bytes - self._c.freed_bytes)

    def take_interval_peak(self) -> int:
        """The largest total current bytes since the previous call (or since creation): a
        sampler calling it at a fixed rate sees every short spike between two samples."""
        with self._lock:
            self._c.settle()
            peak = self._base_bytes + self._c.interval_peak
            self._c.interval_peak = self._c.total_bytes - self._c.freed_bytes
            return int(peak)

    # -- frames ---------------------------------------------------------------------------

    def push_counters(self) -> Statistics:
        """Start a new, zeroed counter frame; returns the top frame as it was before the push."""
        with self._lock:
            before = self._top_locked()
            self._frames.append(before)
            self._base_bytes += before.current_bytes
            self._c.interval_peak -= before.current_bytes
            self._c.total_bytes = self._c.total_count = 0
            self._c.freed_bytes = self._c.freed_count = 0
            self._c.peak_bytes = self._c.peak_count = 0
            return before

    def pop_counters(self) -> Statistics:
        """End the top counter frame and fold it into the one below (whose peaks become at least
        its current bytes at push time plus the popped frame's peaks); returns the popped frame.
        IndexError when only the bottom frame is left (nothing was pushed)."""
        with self._lock:
            if not self._frames:
                raise IndexError(
                    "StatisticsResourceAdaptor.pop_counters(): cannot pop the last counter pair "
                    "(call push_counters() first)"
                )
            inner = self._top_locked()  # settles the journal
            outer = self._frames.pop()
            cb, cc, pb, pc, tb, tc = astuple(outer)
            self._base_bytes -= cb
            self._c.interval_peak += cb
            self._c.peak_bytes = max(pb, cb + inner.peak_bytes)
            self._c.peak_count = max(pc, cc + inner.peak_count)
            self._c.total_bytes = tb + inner.total_bytes
            self._c.total_count = tc + inner.total_count
            # current = total - freed must come out as cb + inner.current_*
            self._c.freed_bytes = self._c.total_bytes - (cb + inner.current_bytes)
            self._c.freed_count = self._c.total_count - (cc + inner.current_count)
            return inner

    @property
    def counter_depth(self) -> int:
        """Number of counter frames (1 when nothing has been pushed)."""
        return len(self._frames) + 1

    def _repr_fields(self) -> str:
        s = self.allocation_counts
        return f"current={s.current_bytes} B in {s.current_count}, peak={s.peak_bytes} B"
