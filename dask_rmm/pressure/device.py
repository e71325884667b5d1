"""``DevicePressure``: memory pressure on one device of one worker: the bytes in use, when to
spill (over the limit, on OOM, while paused), the OOM snapshots. Dask-free."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from dask_rmm.allocators import caches
from dask_rmm.mr.base import DeviceMemoryResource, OutOfMemoryError
from dask_rmm.pressure.forensics import OOMEvent, free_block_histogram, oom_verdict
from dask_rmm.pressure.metrics import PressureCounters
from dask_rmm.pressure.store import DeviceSpillStore
from dask_rmm.sizes import align_up

__all__ = ["DevicePressure"]

#: OOM snapshots kept per device.
MAX_OOM_EVENTS = 32
#: Task prefixes listed in a snapshot's live bytes.
TOP_PREFIXES = 20


@dataclass(eq=False, repr=False)
class DevicePressure:
    """Spilling policy and OOM forensics for one device.

    Parameters
    ----------
    device : int
        The device id.
    store : DeviceSpillStore
        The worker's data store (spills values of this device).
    resource : DeviceMemoryResource
        The worker's stack for this device, below the spill adaptor.
    capacity : int
        What the pause fraction is a fraction of: the pool's maximum, else the device's memory.
    statistics, pool, attribution
        The stack's ``StatisticsResourceAdaptor`` (the bytes in use), and optionally its
        ``PoolMemoryResource`` (free-block layouts) and ``AttributionResourceAdaptor``.
    limit : int, optional
        ``device_memory_limit`` in bytes: above it, stored values are spilled.
    spill_on_oom : bool
        Spill and retry when an allocation fails.
    pause_fraction : float or None
        Above ``pause_fraction * capacity`` bytes in use, :meth:`should_pause` is true.
    task_key, on_oom : callable, optional
        The running task's key (for OOM snapshots); ``on_oom(event)`` after each snapshot.
    """

    device: int
    store: DeviceSpillStore
    resource: DeviceMemoryResource
    capacity: int
    _: KW_ONLY
    statistics: Any
    pool: Any = None
    attribution: Any = None
    limit: int | None = None
    spill_on_oom: bool = False
    pause_fraction: float | None = None
    task_key: Callable[[], Any] | None = None
    on_oom: Callable[[OOMEvent], Any] | None = None

    def __post_init__(self) -> None:
        self.oom_events: deque[OOMEvent] = deque(maxlen=MAX_OOM_EVENTS)
        #: The SpillOnDemandResourceAdaptor this policy serves (set by WorkerPressure.wrap).
        self.adaptor: Any = None
        #: False while tearing down: failures then are not a task's (no snapshot is taken).
        self.recording = True
        self.counters: PressureCounters = self.store.counters
        self.counters.set_limit(self.device, self.limit)
        self._local = threading.local()

    # -- what the adaptor asks ------------------------------------------------------------------

    def busy(self) -> bool:
        return self.store.spilling_on_this_thread()

    def never_fits(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` is larger than this device's capacity (the pool's
        maximum, else the device's memory): no spilling can make room for it."""
        return align_up(nbytes) > self.capacity

    def current_bytes(self) -> int:
        """Bytes in use on this device: allocated through the worker's resource, less the free
        bytes that library caches in front of it hold (those are given back, not spilled), plus
        the bytes in the objects of caches beside it (PyTorch's tensors)."""
        stack = max(0, self.statistics.current_bytes - self.cached_bytes())
        return stack + caches.outside_in_use_bytes(self.device)

    def cached_bytes(self) -> int:
        """Free bytes library caches (CuPy's, compiled RMM's pool) hold from this stack."""
        return sum(caches.cached_bytes(self.device).values())

    def release_cached(self) -> int:
        """Have the library caches give their free blocks back to the stack (cheaper than
        spilling, so done first); the bytes given back, noted for this thread's OOM snapshot."""
        return self._noted(caches.release_cached_by_library(self.device))

    def spill_libraries(self, nbytes: int) -> int:
        """Have the libraries that spill their own objects (cuDF) spill ``nbytes`` (after the
        caches, before outputs); the bytes spilled, noted for this thread's OOM snapshot."""
        return self._noted(caches.spill_libraries(nbytes))

    def _noted(self, freed: dict[str, int]) -> int:
        mine = getattr(self._local, "released", None)
        if mine is not None:
            mine.update(freed)  # a Counter: adds
        return sum(freed.values())

    def release_cached_when_full(self) -> int:
        """Have the caches inside the stack give their free blocks back (before small arrays pin
        them) when an output is stored while the pool cannot grow by another eighth of its
        maximum or the bytes in use are over the limit; the bytes given back."""
        maximum = None if self.pool is None else self.pool.maximum_pool_size
        full = maximum is not None and maximum - self.pool.pool_size() < maximum // 8
        if not full and self.limit is not None:
            full = self.statistics.current_bytes > self.limit
        if not full or self.cached_bytes() == 0:
            return 0
        # Not PyTorch's: outside the stack, its empty_cache would block the event loop.
        return sum(caches.release_cached_by_library(self.device, outside=False).values())

    def start_arbitration(self) -> None:
        """An allocation on this thread failed: count what caches give back for it from now."""
        self._local.released = Counter()

    def _take_released(self) -> dict[str, int]:
        released = dict(getattr(self._local, "released", None) or {})
        self._local.released = None
        return released

    def spill_for_cache(self, nbytes: int) -> int:
        """A library cache of this device is out of memory: spill ``nbytes`` with
        ``spill_on_oom``; the bytes spilled."""
        if not self.spill_on_oom or self.busy() or self.never_fits(nbytes):
            return 0
        # The cache asking frees its own blocks when this returns: not from inside its call.
        return self.store.spill(nbytes, device=self.device)

    def spill(self, need: int | Callable[[], int]) -> int:
        """Spill least recently used values of this device adding up to ``need`` bytes (or
        what ``need()`` says once this thread may spill); the caches then give back the blocks
        spilled arrays freed into them, so that the bytes reach the pool."""
        freed = self.store.spill(need, device=self.device)
        if freed and self.cached_bytes():
            caches.release_cached_by_library(self.device)
        return freed

    def spill_until(
        self, attempt: Callable[[], int], request: int, in_task: bool = False
    ) -> tuple[int | None, MemoryError | None, int]:
        """:meth:`DeviceSpillStore.spill_until` for this device, with the pool's layout; a
        request larger than the pool's maximum spills nothing and fails at once."""
        layout = release = None
        pool = self.pool
        if pool is not None:
            maximum = pool.maximum_pool_size
            if maximum is not None and align_up(request) > maximum:
                try:
                    return attempt(), None, 0
                except MemoryError as e:
                    return None, e, 0
            layout = pool.memory_layout
            if maximum is None or maximum - pool.pool_size() >= align_up(request):
                release = pool.release  # could grow but the device is full: give chunks back
        adaptor = self.adaptor

        def attempt_after_release() -> int:
            # Spilled arrays of a library cache free into that cache, not into the stack.
            self.release_cached()
            return attempt()

        return self.store.spill_until(
            attempt_after_release,
            request,
            device=self.device,
            layout=layout,
            release=release,
            activity=None if adaptor is None else lambda: adaptor.deallocations,
            in_task=in_task,
        )

    def avoided_oom(self) -> None:
        self._take_released()
        self.counters.add(self.device, "ooms_avoided")

    def admission_limit(self) -> int:
        """What memory admission admits tasks under: the limit, else the capacity."""
        return self.limit if self.limit is not None else self.capacity

    # -- periodic and store-time checks ---------------------------------------------------------

    def spill_to_limit(self) -> int:
        """Spill until the bytes in use are at most the limit (or nothing more can be spilled)."""
        return 0 if self.limit is None else self._spill_down_to(self.limit)

    def pause_threshold(self) -> int | None:
        return None if self.pause_fraction is None else int(self.pause_fraction * self.capacity)

    def should_pause(self) -> bool:
        threshold = self.pause_threshold()
        return threshold is not None and self.current_bytes() > threshold

    def relieve(self) -> bool:
        """One check: spill to the limit, and while over the pause threshold spill down to it.
        Returns True when the device is still over the pause threshold."""
        if self.adaptor is not None:
            self.adaptor.resync()
        self.spill_to_limit()
        threshold = self.pause_threshold()
        if threshold is None:
            return False
        self._spill_down_to(threshold)
        return self.current_bytes() > threshold

    def _spill_down_to(self, target: int) -> int:
        total = 0
        while self.current_bytes() > target:
            # Measured again once this thread may spill: another may have spilled meanwhile.
            freed = self.spill(lambda: self.current_bytes() - target)
            if freed <= 0:
                break
            total += freed
        return total

    def heartbeat_fields(self, max_events: int = 8, max_recent: int = 16) -> dict[str, Any]:
        """``PressureMetrics.to_dict()`` without ``device``, plus ``oom_events``: the last
        ``max_events`` snapshots as dicts, each with its last ``max_recent`` allocation events."""
        d = self.counters.snapshot(self.device).to_dict()
        del d["device"]
        d["paused"] = int(d["paused"])
        d["device_memory_limit"] = d["device_memory_limit"] or 0
        d["oom_events"] = [e.to_dict() for e in list(self.oom_events)[-max_events:]]
        for e in d["oom_events"]:
            e["recent_events"] = e["recent_events"][-max_recent:]
        return d

    # -- forensics --------------------------------------------------------------------------------

    def record_oom(
        self, error: MemoryError, nbytes: int, spilled: int, events: list
    ) -> OOMEvent | None:
        """Take the snapshot of an OOM that reached the caller and keep it."""
        from dask.utils import key_split

        if not self.recording:
            return None

        pool_size = maximum = free = largest = None
        if isinstance(error, OutOfMemoryError):
            pool_size, maximum = error.pool_size, error.maximum_pool_size
            free, largest = error.free_bytes, error.largest_free_block
        histogram: list = []
        if self.pool is not None:
            _chunks, free_blocks, _live = self.pool.memory_layout()
            histogram = free_block_histogram(s for _, s in free_blocks)
            if free is None:
                info = self.pool.reserved_memory_info()
                pool_size, maximum = info.reserved_bytes, self.pool.maximum_pool_size
                free, largest = info.free_bytes, info.largest_free_block
        by_prefix: list = []
        if self.attribution is not None:
            owners = sorted(self.attribution.get_attribution(), key=lambda o: -o.current_bytes)
            by_prefix = [
                (o.owner, o.current_bytes) for o in owners[:TOP_PREFIXES] if o.current_bytes
            ]
        key = self.task_key() if self.task_key is not None else None
        if key is None:
            # No task on this thread: the event loop bringing a spilled input back.
            reading = self.store.reading_on_this_thread()
            if reading is not None:
                key = f"(reading back {reading!s})"
        event = OOMEvent(
            time=time.time(),
            device=self.device,
            task_key=None if key is None else str(key),
            task_prefix=None if key is None else key_split(key),
            requested=nbytes,
            resource=getattr(error, "resource", "") or type(self.resource).__name__,
            message=str(error),
            pool_size=pool_size,
            maximum_pool_size=maximum,
            free_bytes=free,
            largest_free_block=largest,
            verdict=oom_verdict(nbytes, free, largest),
            spilled_trying=spilled,
            released_by_library=self._take_released(),
            free_block_histogram=histogram,
            live_bytes_by_prefix=by_prefix,
            recent_events=[
                (t, op, n, p, None if k is None else str(k)) for t, op, n, p, k in events
            ],
        )
        self.oom_events.append(event)
        self.counters.add(self.device, "oom_count")
        if self.on_oom is not None:
            self.on_oom(event)
        return event
