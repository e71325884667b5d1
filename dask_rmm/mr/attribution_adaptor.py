"""AttributionResourceAdaptor: charges each allocation to an owner (a Dask task prefix) named by
a callable, keeping current and peak bytes per owner. It knows nothing of Dask (the plugin passes
a getter of the running task's key). Not here: overall counters (StatisticsResourceAdaptor)."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from dask_rmm.mr.base import DeviceMemoryResource, UpstreamResourceAdaptor
from dask_rmm.mr.instrumentation import OwnerAccounts
from dask_rmm.mr.locks import Mutex, gc_paused_lock
from dask_rmm.mr.pool import PoolMemoryResource, pool_behind
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["UNATTRIBUTED", "AttributionResourceAdaptor", "OwnerMemory"]

#: The owner charged when the getter returns None (an allocation made outside any task).
UNATTRIBUTED = "(no task)"
# Owners remembered per adaptor (unique task keys would otherwise grow it without bound).
_OWNER_CACHE_SIZE = 4096


@dataclass(frozen=True)
class OwnerMemory:
    """Bytes one owner (task prefix) holds now and has held at most since the adaptor was made."""

    owner: str
    current_bytes: int
    peak_bytes: int

    def to_list(self) -> list:
        """``[owner, current_bytes, peak_bytes]``, the heartbeat's wire form."""
        return [self.owner, self.current_bytes, self.peak_bytes]


def _open_account(
    owner_name: Callable[[Hashable], str],
    by_name: dict[str, list[int]],
    by_owner_key: dict[Hashable, list[int]],
    owner_key: Hashable,
) -> list[int]:
    """The account of an owner key not in ``by_owner_key`` (under the charging lock, collector
    paused). Never raises: an owner that cannot be named is UNATTRIBUTED."""
    try:
        name = UNATTRIBUTED if owner_key is None else str(owner_name(owner_key))
    except Exception:
        name = UNATTRIBUTED
    account = by_name.setdefault(name, [0, 0])
    if len(by_owner_key) >= _OWNER_CACHE_SIZE:
        by_owner_key.clear()
    try:
        by_owner_key[owner_key] = account
    except TypeError:  # an unhashable owner key is named every time
        pass
    return account


class AttributionResourceAdaptor(UpstreamResourceAdaptor):
    """Charge every allocation to the owner that ``get_owner()`` names at allocation time.

    A free is charged back to the allocation's owner, whichever thread frees it; sizes are as
    asked. Over a :class:`PoolMemoryResource` (maybe through a StatisticsResourceAdaptor it counts
    for) the pool charges, allocations made on it directly too (:attr:`charging_pool`).

    Parameters
    ----------
    get_owner : callable
        Called on the allocating thread, on every allocation (best a C-level call such as
        ``functools.partial(getattr, a_thread_local, "key", None)``); returns a hashable owner
        key (say a Dask task key) or None, which charges :data:`UNATTRIBUTED`.
    owner_name : callable, optional
        Owner key -> the name bytes are charged to (say ``dask.utils.key_split``), called once
        per owner key seen; default ``str``.

    Examples
    --------
    >>> import functools, threading
    >>> from dask_rmm.mr import SystemMemoryResource
    >>> local = threading.local()
    >>> mr = AttributionResourceAdaptor(
    ...     SystemMemoryResource(), functools.partial(getattr, local, "task", None),
    ...     owner_name=lambda task: task.split("-")[0])
    >>> local.task = "load-1"
    >>> ptr = mr.allocate(1024)
    >>> mr.get_owner_memory("load")
    OwnerMemory(owner='load', current_bytes=1024, peak_bytes=1024)
    >>> mr.deallocate(ptr, 1024)
    """

    def __init__(
        self,
        upstream_mr: DeviceMemoryResource,
        get_owner: Callable[[], Hashable | None],
        owner_name: Callable[[Hashable], str] = str,
    ):
        super().__init__(upstream_mr)
        if not callable(get_owner):
            raise TypeError(f"get_owner must be callable, got {type(get_owner).__name__}")
        if not callable(owner_name):
            raise TypeError(f"owner_name must be callable, got {type(owner_name).__name__}")
        self._get_owner = get_owner
        self._owner_name = owner_name
        self._lock: Mutex = threading.Lock()
        self._acquire, self._release = self._lock.acquire, self._lock.release
        # name -> [current_bytes, peak_bytes]; owner key -> the same list (a bounded cache);
        # ptr -> (that list, nbytes).
        self._by_name: dict[str, list[int]] = {}
        self._by_owner_key: dict[Hashable, list[int]] = {}
        self._live: dict[int, tuple[list[int], int]] = {}
        # open_window's token -> peaks, and the peaks since made, folded in whenever a window
        # opens (which resets the accounts' peaks to their current bytes).
        self._windows: dict[int, dict[str, int]] = {}
        self._folded: dict[str, int] = {}
        self._next_window = 0
        self._charging_pool: PoolMemoryResource | None = None
        pool = pool_behind(upstream_mr)
        if pool is not None:
            # The callback holds the tables, not the adaptor: pool and adaptor form no cycle.
            opener = functools.partial(_open_account, owner_name, self._by_name, self._by_owner_key)
            owners = OwnerAccounts(get_owner, self._by_owner_key, opener)
            if pool.charge_owners(owners):
                self._charging_pool = pool
                self._fuse(pool, pool.instrumentation_lock)
                weakref.finalize(self, pool.stop_charging, owners).atexit = False

    @property
    def charging_pool(self) -> PoolMemoryResource | None:
        """The PoolMemoryResource that charges owners for this adaptor (its
        ``allocate``/``deallocate`` are then the pool's), or None."""
        return self._charging_pool

    def _counts_for_current_owner(self) -> list[int]:
        """The current owner's counts, its account opened under the lock with the collector
        paused (its finalizers may free through this adaptor on this thread). Never raises."""
        try:
            owner_key = self._get_owner()
        except Exception:
            owner_key = None
        with gc_paused_lock(self._lock):
            return _open_account(self._owner_name, self._by_name, self._by_owner_key, owner_key)

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        ptr = self._upstream_allocate(nbytes, stream)
        if ptr:
            try:
                counts = self._by_owner_key[self._get_owner()]
            except Exception:
                counts = self._counts_for_current_owner()
            self._live[ptr] = (counts, nbytes)
            # Only int arithmetic under the lock (see _counts_for_current_owner).
            self._acquire()
            current = counts[0] + nbytes
            counts[0] = current
            if current > counts[1]:
                counts[1] = current
            self._release()
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        # Forgotten before the upstream frees it: then another thread may get the address.
        entry = self._live.pop(ptr, None)
        try:
            self._upstream_deallocate(ptr, nbytes, stream)
        except BaseException:
            if entry is not None:
                self._live[ptr] = entry
            raise
        if entry is not None:
            self._acquire()
            entry[0][0] -= entry[1]
            self._release()

    def get_owner_memory(self, name: str) -> OwnerMemory:
        """Current and peak bytes charged to the owner ``name`` (zeros for one never seen)."""
        with self._lock:
            counts = self._by_name.get(name, (0, 0))
            return OwnerMemory(name, counts[0], max(counts[1], self._folded.get(name, 0)))

    def get_attribution(self) -> list[OwnerMemory]:
        """Every owner seen so far, largest peak first."""
        with self._lock:
            folded = self._folded
            out = [
                OwnerMemory(name, c[0], max(c[1], folded.get(name, 0)))
                for name, c in self._by_name.items()
            ]
        out.sort(key=lambda m: (-m.peak_bytes, -m.current_bytes, m.owner))
        return out

    def top(self, n: int) -> list[OwnerMemory]:
        """The ``n`` owners with the largest peaks."""
        return self.get_attribution()[: max(n, 0)]

    def reset_peaks(self) -> None:
        """Set every owner's peak to its current bytes (open windows keep theirs)."""
        with self._lock:
            self._fold(self._windows.values())
            self._folded.clear()
            for counts in self._by_name.values():
                counts[1] = counts[0]

    def _fold(self, into: Iterable[dict[str, int]]) -> None:
        """Raise each peak table of ``into`` to the accounts' peaks (lock held)."""
        tables = list(into)
        for name, counts in self._by_name.items():
            peak = counts[1]
            for table in tables:
                if peak > table.get(name, 0):
                    table[name] = peak

    def open_window(self) -> int:
        """Start measuring each owner's peak from now (a performance report's block); returns
        the token for :meth:`close_window`. Windows may overlap; :meth:`get_attribution` keeps
        reporting the peaks since the adaptor was made. Costs nothing per allocation."""
        with self._lock:
            self._fold([self._folded, *self._windows.values()])
            for counts in self._by_name.values():
                counts[1] = counts[0]
            token = self._next_window
            self._next_window += 1
            self._windows[token] = {name: c[0] for name, c in self._by_name.items() if c[0]}
        return token

    def close_window(self, token: int) -> dict[str, int]:
        """Each owner's peak bytes since :meth:`open_window` returned ``token`` (owners that
        held nothing in the window are left out). KeyError for a token not open."""
        with self._lock:
            table = self._windows.pop(token)
            self._fold([table])
        return {name: peak for name, peak in table.items() if peak > 0}

    def _repr_fields(self) -> str:
        return f"owners={len(self._by_name)}"
