"""``DeviceSpillStore``: a worker's data mapping that moves the least recently used task outputs
holding device memory to host memory when told to, and brings them back when read. Host copies
and other values live in the worker's own mapping (distributed's ``SpillBuffer``), whose
spilling to disk applies below unchanged; zict's ``LRU``/``Buffer`` evict by weight alone, where
a victim here must be unreferenced and (with a pool) free a large enough block. Not here:
deciding *when* to spill (``device.py``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Any, NamedTuple

from dask_rmm.pressure.device_objects import HostCopy, device_allocations, spill_batch, to_host
from dask_rmm.pressure.metrics import PressureCounters
from dask_rmm.pressure.victims import Candidate, coalescing_victims, lru_victims
from dask_rmm.sizes import align_up

__all__ = ["DeviceSpillStore"]

logger = logging.getLogger(__name__)

_getrefcount = sys.getrefcount
_probe = {0: object()}
#: References a value held only by a dict has, as seen by ``sys.getrefcount(d[k])``.
_DICT_ONLY_REFS = _getrefcount(_probe[0])
del _probe


#: Rounds in a row whose victims were all referenced by the time they were copied before a
#: spill waits (a value a reader holds stays unspillable for a while).
_FRUITLESS_ROUNDS = 3
#: Seconds between retries while waiting for memory to change.
_WAIT_POLL = 0.002
#: Seconds the other waiters keep waiting after one of them gave way (its task's frees to come).
_GIVE_WAY_SECONDS = 1.0
#: Seconds between two garbage collections by the waiters in that time (one of them collects).
_COLLECT_SECONDS = 0.2


class _Entry(NamedTuple):
    device: int
    nbytes: int
    ptrs: tuple[int, ...]


def _entry(allocs: list | None, device: int, nbytes: int = 0) -> _Entry:
    """The entry of a value with allocations ``allocs`` (``nbytes`` if they add up to 0)."""
    allocs = allocs or []
    return _Entry(device, sum(a.nbytes for a in allocs) or nbytes, tuple(a.ptr for a in allocs))


class DeviceSpillStore(MutableMapping):
    """A ``MutableMapping`` over the worker's mapping ``inner`` that spills device objects.

    Values holding device memory are kept here, least recently used first; :meth:`spill`
    replaces those nothing else references by host copies in ``inner``; reading a spilled key
    brings it back. Other attributes (a ``SpillBuffer``'s ``fast``, ``evict``, ...) are
    ``inner``'s, so distributed's memory monitor keeps working. Thread safe; no lock is held
    while device memory is allocated.

    Parameters
    ----------
    inner : MutableMapping
        The worker's data mapping (empty or not).
    counters : PressureCounters, optional
        Where spill counts and times are added.
    on_store : callable, optional
        ``on_store(device)`` after a device value was stored.
    """

    def __init__(
        self,
        inner: MutableMapping | None = None,
        counters: PressureCounters | None = None,
        on_store: Callable[[int], Any] | None = None,
    ):
        self.inner = {} if inner is None else inner
        self.counters = counters if counters is not None else PressureCounters()
        self.on_store = on_store
        self._lock = threading.Lock()
        self._spill_lock = threading.Lock()
        self._local = threading.local()
        self._device: dict[Hashable, Any] = {}
        self._lru: OrderedDict[Hashable, _Entry] = OrderedDict()
        # key -> (device, device bytes, serial): the serial tells a re-spilled key from the
        # spill an unspill started from.
        self._spilled: dict[Hashable, tuple[int, int, int]] = {}
        self._serial = itertools.count()
        # Host copies of values brought back, oldest first (docs/memory-pressure.md).
        self._clean: OrderedDict[Hashable, HostCopy] = OrderedDict()
        self._clean_bytes = 0
        #: Bytes of host copies kept for values back on the device (0: none kept).
        self.keep_host_copies = 0
        #: Device bytes spilled without a copy (the host copy was kept).
        self.spilled_without_copy = 0
        #: Stores, deletions, spills and reads back so far: a change a waiting spill watches.
        self._mutations = 0
        #: How long :meth:`spill_until` waits for memory to change: retries, seconds.
        self.wait_retries = 100
        self.wait_limit = 5.0
        #: Tasks in the worker's threads (``WorkerPressure.attach``): their frees may still come.
        self.running_tasks: Callable[[], int] | None = None
        self._waiters: dict[int, bool] = {}  # thread waiting in spill_until -> a task's?
        self._give_way_until = self._next_collection = 0.0
        #: Task key -> bytes it held and asked for, of tasks whose allocation gave way while
        #: every running task waited for memory (their failure frees what the others wait for;
        #: memory admission runs them once more), and whether this thread's task may give way.
        self.gave_way: OrderedDict[Hashable, int] = OrderedDict()
        self.may_give_way: Callable[[], bool] | None = None
        #: Key -> bytes of spilled outputs whose last read-back failed (their readers run again).
        self.unread: OrderedDict[Hashable, int] = OrderedDict()
        #: Seconds to wait for another thread's spilling (it may wait for a lock this one holds).
        self.spill_lock_wait = 10.0

    # -- MutableMapping ----------------------------------------------------------------------

    def __setitem__(self, key: Hashable, value: Any) -> None:
        allocs = device_allocations(value)
        if allocs is None:
            with self._lock:
                self._forget(key)
                self.inner[key] = value
                self._mutations += 1
            return
        entry = _entry(allocs, allocs[0].device if allocs else 0)
        with self._lock:
            self._forget(key)
            self._device[key] = value
            self._lru[key] = entry
            self._mutations += 1
        if self.on_store is not None:
            self.on_store(entry.device)

    def __getitem__(self, key: Hashable) -> Any:
        with self._lock:
            value = self._device.get(key)
            if value is not None:
                self._lru.move_to_end(key)
                return value
            value = self.inner[key]
            spilled = self._spilled.get(key)
            if spilled is None or not isinstance(value, HostCopy):
                return value
        return self._unspill(key, value, spilled)

    def __delitem__(self, key: Hashable) -> None:
        with self._lock:
            if key not in self._device and key not in self.inner:
                raise KeyError(key)
            self._mutations += 1
            self._forget(key)

    def clear(self) -> None:
        """Drop everything (not bringing spilled values back, as ``MutableMapping.clear`` would)."""
        with self._lock:
            spilled = list(self._spilled.values())
            self._spilled.clear()
            self._empty_device()
            self.inner.clear()
        for device, nbytes, _serial in spilled:
            self.counters.forgotten(device, nbytes)

    def __contains__(self, key: object) -> bool:
        return key in self._device or key in self.inner

    def __len__(self) -> int:
        return len(self._device) + len(self.inner)

    def __iter__(self) -> Iterator[Hashable]:
        with self._lock:
            return iter([*self._device, *self.inner])

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: SpillBuffer's fast/slow/evict/spilled_total.
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return (
            f"<DeviceSpillStore: {len(self._device)} on device, {len(self._spilled)} spilled, "
            f"inner {type(self.inner).__name__}>"
        )

    def _forget(self, key: Hashable) -> None:
        """Drop ``key`` wherever it is (lock held)."""
        self.unread.pop(key, None)  # a later task of that key's readers is not a read-back's
        if key in self._device:
            del self._device[key]
            del self._lru[key]
            self._drop_clean(key)
        elif key in self.inner:
            del self.inner[key]
            spilled = self._spilled.pop(key, None)
            if spilled is not None:
                self.counters.forgotten(*spilled[:2])

    # -- reading back --------------------------------------------------------------------------

    def _unspill(self, key: Hashable, copy: HostCopy, spilled: tuple[int, int, int]) -> Any:
        device, nbytes, _serial = spilled
        t0 = time.perf_counter()
        # Outside the lock: the allocation may fail and spill other keys first.
        self._local.reading = key
        try:
            value = copy.to_device()
        except MemoryError:
            self._note(self.unread, key, nbytes)
            raise
        finally:
            self._local.reading = None
        with self._lock:
            self.unread.pop(key, None)
            if self._spilled.get(key) == spilled:
                self._device[key] = value
                self._lru[key] = _entry(device_allocations(value), device, nbytes)
                del self._spilled[key]
                del self.inner[key]
                self._mutations += 1
                if copy.nbytes <= self.keep_host_copies:
                    self._clean[key] = copy
                    self._clean_bytes += copy.nbytes
                    while self._clean_bytes > self.keep_host_copies:
                        self._clean_bytes -= self._clean.popitem(last=False)[1].nbytes
            else:  # deleted or replaced meanwhile: hand out what was asked for, store nothing
                return value
        self.counters.unspilled(device, nbytes, time.perf_counter() - t0)
        return value

    def _drop_clean(self, key: Hashable) -> HostCopy | None:
        """Forget the kept host copy of ``key`` (lock held); return it."""
        copy = self._clean.pop(key, None)
        if copy is not None:
            self._clean_bytes -= copy.nbytes
        return copy

    # -- spilling -------------------------------------------------------------------------------

    def reading_on_this_thread(self) -> Hashable | None:
        """The key this thread is bringing back to the device, if any (for OOM reports)."""
        return getattr(self._local, "reading", None)

    def spilling_on_this_thread(self) -> bool:
        """True inside :meth:`spill` on this thread (an allocation it makes must not spill)."""
        return getattr(self._local, "active", False)

    def device_bytes(self, device: int | None = None) -> int:
        """Device bytes held by the stored values (by their allocations' sizes)."""
        with self._lock:
            return sum(e.nbytes for e in self._lru.values() if device is None or e.device == device)

    def adopt(self, other: DeviceSpillStore) -> None:
        """Take over everything ``other`` holds (its inner mapping, device values, spilled
        keys); ``other`` is left empty."""
        with other._lock, self._lock:
            self.inner = other.inner
            self._device.update(other._device)
            self._lru.update(other._lru)
            self._spilled.update(other._spilled)
            other._spilled.clear()
            other._empty_device()
            other.inner = {}
            spilled = list(self._spilled.values())
        for device, nbytes, _serial in spilled:
            self.counters.spilled(device, nbytes, 0.0)

    def take_device_values(self) -> list[tuple[Hashable, Any]]:
        """Remove and return the values kept on the device (teardown moves them to ``inner``)."""
        with self._lock:
            items = list(self._device.items())
            self._empty_device()
        return items

    def _empty_device(self) -> None:
        """Forget the values kept on the device and their kept host copies (lock held)."""
        self._device.clear()
        self._lru.clear()
        self._clean.clear()
        self._clean_bytes = 0

    def spilled_keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._spilled)

    def candidates(self, device: int | None = None) -> list[Candidate]:
        """Spillable values, least recently used first: ``(key, device bytes, block ptrs)``."""
        with self._lock:  # not those a running task or a transfer holds
            stored = self._device
            return [
                (key, e.nbytes, e.ptrs)
                for key, e in self._lru.items()
                if e.nbytes and device in (None, e.device)
                if _getrefcount(stored[key]) <= _DICT_ONLY_REFS
            ]

    def spill(self, need: int | Callable[[], int], *, device: int | None = None) -> int:
        """Move the least recently used spillable device values (of ``device``, or any) adding
        up to ``need`` bytes to host memory; the device bytes they held. ``need`` may be a
        function, called once this thread may spill: what is still needed then, measured."""
        if not self._lock_for_spilling():
            return 0
        try:
            need = need() if callable(need) else need
            if need <= 0:
                return 0
            return self._spill_keys(lru_victims(self.candidates(device), need))
        finally:
            self._local.active = False
            self._spill_lock.release()

    def _lock_for_spilling(self) -> bool:
        """Take the spill lock for this thread, or False (logged) after ``spill_lock_wait``."""
        if self._spill_lock.acquire(timeout=self.spill_lock_wait):
            self._local.active = True
            return True
        logger.warning(
            "dask-rmm: another thread has been spilling for %.0f s; not waiting for it longer "
            "(it may wait for a lock this thread holds, such as a cuDF buffer's)",
            self.spill_lock_wait,
        )
        return False

    def spill_until(
        self,
        attempt: Callable[[], Any],
        request: int,
        *,
        device: int | None = None,
        layout: Callable[[], tuple[list, list, list]] | None = None,
        release: Callable[[], Any] | None = None,
        activity: Callable[[], int] | None = None,
        in_task: bool = False,
    ) -> tuple[Any, MemoryError | None, int]:
        """Call ``attempt()`` (an allocation of ``request`` bytes), spilling before each retry,
        until it succeeds or nothing can be spilled and nothing changes (docs/memory-pressure.md):
        ``(result, None, bytes spilled)`` or ``(None, last MemoryError, spilled)``. ``layout``
        (a pool's): victims whose blocks merge into one of ``request`` bytes, else (``release``:
        the pool may grow) the least recently used, then ``release()``. Then it polls while
        memory (``activity()``: frees) changes or :attr:`running_tasks` run, as the docs say;
        of threads all waiting, one gives up at a time (:meth:`_gives_way`). ``wait_limit`` counts
        from the first wait, or (``in_task``: a task's thread, not the event loop) from the last
        change: a task waits on while the tasks beside it free, store or give way."""
        me = threading.get_ident()
        self._local.gave_way = False
        try:
            spilled = 0
            error: MemoryError | None = None
            started = None
            seen = None
            unchanged = 0
            held: tuple[Hashable, ...] | None = None  # referenced values at the last full scan
            held_at = -1
            quiet = False  # nothing changed at the last poll: no victims to look for either
            while True:
                tried = False
                if not self._lock_for_spilling():  # one more try, without spilling
                    try:
                        return attempt(), None, spilled
                    except MemoryError as e:
                        return None, e, spilled
                try:
                    fruitless = 0
                    while True:
                        try:
                            result = attempt()
                        except MemoryError as e:
                            error = e
                        else:
                            # A kept error's frames would keep the caller's new object alive.
                            error = None
                            return result, None, spilled
                        if quiet:
                            break
                        victims, growing = self._choose(request, device, layout, release)
                        if not victims:
                            break
                        tried = True
                        freed = self._spill_keys(victims)
                        if freed:
                            spilled += freed
                            fruitless = 0
                            if growing and release is not None:
                                release()
                            continue
                        # Every victim was referenced by the time it was copied (a reader, a
                        # profiler holding frames): choose again among the others.
                        fruitless += 1
                        if fruitless >= _FRUITLESS_ROUNDS:
                            break
                finally:
                    self._local.active = False
                    self._spill_lock.release()
                # Nothing could be spilled: wait for frees, mutations or a referenced value let go
                # (all values scanned after a round or a mutation, else those referenced then).
                now = time.monotonic()
                mutations = self._mutations
                if held is None or tried or mutations != held_at:
                    held, held_at = self._referenced(device), mutations
                else:
                    held = self._referenced(device, held)
                state = (activity() if activity is not None else None, mutations, held)
                # A round that found victims saw a change, even if the polled state looks the same.
                quiet = state == seen and not tried
                if started is None or (in_task and not quiet):
                    started = now
                self._waiters[me] = in_task  # the event loop too: its read-back is for a task
                running = self.running_tasks() if self.running_tasks is not None else 0
                # A task beside this one that is not waiting too may still free what this needs.
                unchanged = unchanged + 1 if quiet and running <= sum(self._waiters.values()) else 0
                seen = state
                if unchanged >= self.wait_retries and not self._gives_way(now, in_task):
                    unchanged = 0  # another waiter gave way a moment ago: its frees may come
                    if now >= self._next_collection:
                        # distributed keeps a failed task's error in a cycle with its frames
                        # (``_run_task_simple``), and its buffers with them, until collected
                        self._next_collection = now + _COLLECT_SECONDS
                        gc.collect()
                elif unchanged >= self.wait_retries or now - started >= self.wait_limit:
                    return None, error, spilled
                time.sleep(_WAIT_POLL)
        finally:
            self._waiters.pop(me, None)

    def _gives_way(self, now: float, in_task: bool) -> bool:
        """Whether this waiter gives up now: none while a task gave way a moment ago (its frees
        may come); of tasks, one at a time while others wait (each then noted for
        :meth:`gave_way_here`); the event loop takes no turn (its failure frees nothing)."""
        if not in_task:
            return now >= self._give_way_until and not any(self._waiters.values())
        others = len(self._waiters) > 1
        if others and self.may_give_way is not None and not self.may_give_way():
            return False
        with self._lock:
            if now < self._give_way_until:
                return False
            self._give_way_until = now + _GIVE_WAY_SECONDS
            self._local.gave_way = others
            return True

    def gave_way_here(self, key: Hashable, nbytes: int) -> None:
        """Note task ``key`` (it held and asked for ``nbytes``) if this thread's last
        :meth:`spill_until` gave way to others."""
        if getattr(self._local, "gave_way", False) and key is not None:
            self._local.gave_way = False
            self._note(self.gave_way, key, nbytes)

    def _note(self, keys: OrderedDict, key: Hashable, nbytes: int) -> None:
        """``keys[key] = nbytes``, the oldest of 1024 out (its task runs elsewhere now)."""
        with self._lock:
            keys[key] = nbytes
            if len(keys) > 1024:
                keys.popitem(last=False)

    def _referenced(self, device: int | None, keys: tuple | None = None) -> tuple[Hashable, ...]:
        """Keys of stored device values (of ``device``, or those of ``keys`` still stored) that
        something else references."""
        with self._lock:
            stored = self._device
            if keys is None:
                keys = tuple(
                    k for k, e in self._lru.items() if e.nbytes and device in (None, e.device)
                )
            return tuple(
                k for k in keys if k in stored and _getrefcount(stored[k]) > _DICT_ONLY_REFS
            )

    def _choose(
        self,
        request: int,
        device: int | None,
        layout: Callable[[], tuple[list, list, list]] | None,
        release: Callable[[], Any] | None,
    ) -> tuple[list[Hashable], bool]:
        """``(keys to spill, whether the pool should then release free chunks)``; no keys when
        spilling cannot serve ``request`` now."""
        cands = self.candidates(device)
        if not cands:
            return [], False
        if layout is not None:
            chunks, free, live = layout()
            victims = coalescing_victims(cands, align_up(request), chunks, free, live)
            if victims is None:  # referenced blocks in the way everywhere: grow the pool, if any
                return (lru_victims(cands, request), True) if release is not None else ([], False)
            if victims:
                return victims, False
        # No layout, or it says a free block fits (it did not a moment ago): least recently used.
        return lru_victims(cands, request), False

    @spill_batch()
    def _spill_keys(self, keys: list[Hashable]) -> int:
        freed = 0
        for key in keys:
            with self._lock:
                value = self._device.get(key)
                entry = self._lru.get(key)
                # References: the dict, ``value`` here and getrefcount's argument.
                if value is None or entry is None or _getrefcount(value) > _DICT_ONLY_REFS + 1:
                    continue
                copy = self._clean.get(key)
            t0 = time.perf_counter()
            if copy is None:
                try:
                    copy = to_host(value)
                except Exception as e:  # e.g. out of host memory: this one stays on the device
                    logger.warning("dask-rmm: could not spill %r to host: %r", key, e)
                    continue
            with self._lock:
                if self._device.get(key) is not value or _getrefcount(value) > _DICT_ONLY_REFS + 1:
                    continue  # read (and so referenced) while being copied: keep it
                if self._drop_clean(key) is copy:
                    self.spilled_without_copy += entry.nbytes
                # Into inner first: a reader that takes no lock (``in``) always finds the key.
                self.inner[key] = copy
                self._spilled[key] = (entry.device, entry.nbytes, next(self._serial))
                del self._device[key]
                del self._lru[key]
                self._mutations += 1
            del value  # the last reference: the device memory goes back now
            self.counters.spilled(entry.device, entry.nbytes, time.perf_counter() - t0)
            freed += entry.nbytes
        return freed
