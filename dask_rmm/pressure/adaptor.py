"""``SpillOnDemandResourceAdaptor``: the top of a worker's stack under memory pressure: outputs
spilled before an allocation would cross the device limit, and on out-of-memory (then a retry);
an error that still gets through reported (OOM forensics); the last allocation events kept.
Not here: what to spill and how (the ``handler``, ``DevicePressure``). Dask-free.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dask_rmm.allocators.caches import is_drawing_for_cache
from dask_rmm.mr.base import CUDAAllocationError, DeviceMemoryResource, UpstreamResourceAdaptor
from dask_rmm.pressure.device import DevicePressure
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["SpillOnDemandResourceAdaptor"]

#: After a spill for the limit found nothing to spill, allocations skip the limit check this
#: long (the periodic monitor keeps checking), so a full device costs no scan per allocation.
_QUIET_SECONDS = 0.05


class SpillOnDemandResourceAdaptor(UpstreamResourceAdaptor):
    """Spill on a device limit and on out-of-memory, then retry; report OOMs that get through.

    Parameters
    ----------
    upstream_mr : DeviceMemoryResource
        The worker's stack below (statistics, pool, ...).
    handler : DevicePressure
        Decides and performs the spilling and records OOM events.
    task_key : callable, optional
        Returns the running task's key (recorded with each event).
    history : int
        How many allocation events to keep for OOM forensics.

    Notes
    -----
    An allocation made while this thread spills neither spills nor is recorded as an OOM. No
    lock is held while spilling or calling the upstream; of several threads failing at once,
    one spills and retries at a time (``DeviceSpillStore.spill_until``).
    """

    def __init__(
        self,
        upstream_mr: DeviceMemoryResource,
        handler: DevicePressure,
        task_key: Callable[[], Any] | None = None,
        history: int = 64,
    ):
        super().__init__(upstream_mr)
        self.handler = handler
        self._upstream_allocate = upstream_mr.allocate
        self._upstream_deallocate = upstream_mr.deallocate
        self._task_key = task_key or (lambda: None)
        self._events: deque = deque(maxlen=max(int(history), 1))
        self._quiet_until = 0.0
        # Bytes allocated here, lock-free (reset by each measurement): measure near the limit.
        self._estimate = 0
        #: Deallocations so far (lock-free, approximate): a failed allocation waits on it.
        self.deallocations = 0
        #: ``task key -> [current bytes, peak bytes]`` of the tasks memory admission watches:
        #: charged by their allocations, charged back by the frees (on any thread).
        self.task_accounts: dict[Any, list[int]] = {}
        self._task_ptrs: dict[int, tuple[list[int], int]] = {}
        # An account is updated by its task's thread and by frees on any thread.
        self._task_lock = threading.Lock()
        self.resync()

    def resync(self) -> None:
        """Reset the running estimate of the bytes in use to the handler's exact count."""
        try:
            self._estimate = self.handler.current_bytes()
        except Exception:  # a broken counter must not break allocations
            self._estimate = 0

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        h = self.handler
        limit = h.limit
        if limit is not None and self._estimate + nbytes > limit and nbytes:
            if not is_drawing_for_cache():
                self._check_limit(nbytes, limit)
        try:
            ptr = self._upstream_allocate(nbytes, stream)
        except CUDAAllocationError:
            raise  # not out of memory (a broken pool or device): spilling cannot help
        except MemoryError as e:
            if is_drawing_for_cache():
                raise  # a cache growing backs off, or asks to spill through its callback
            ptr = self._allocate_after_oom(nbytes, stream, e)
        self._estimate += nbytes
        key = self._task_key()
        self._events.append((time.time(), "alloc", nbytes, ptr, key))
        if self.task_accounts and key is not None:
            account = self.task_accounts.get(key)
            if account is not None:
                with self._task_lock:
                    account[0] += nbytes
                    account[1] = max(account[1], account[0])
                self._task_ptrs[ptr] = (account, nbytes)
        return ptr

    def _check_limit(self, nbytes: int, limit: int) -> None:
        """The estimate says ``nbytes`` more would cross the limit: measure, and spill."""
        h = self.handler
        if h.busy() or nbytes > limit or h.never_fits(nbytes):
            return  # no spilling brings it under the limit, or makes room for it
        now = time.monotonic()
        if now < self._quiet_until:
            return

        # Measured once this thread may spill: threads crossing together spill the excess once.
        def over() -> int:
            return h.current_bytes() + nbytes - limit

        if over() > 0 and h.spill(over) == 0 and over() > 0:  # nothing left to spill
            self._quiet_until = now + _QUIET_SECONDS
        self.resync()

    def _allocate_after_oom(self, nbytes: int, stream: Stream, error: MemoryError) -> int:
        got = self._room_or_error(nbytes, stream, error)
        if not isinstance(got, MemoryError):
            return got
        # Raised without the frames it passed, and not held by this frame (in its traceback from
        # here on): such a cycle would keep the task's buffers until the collector runs.
        try:
            raise got.with_traceback(None)
        finally:
            got = error = None  # type: ignore[assignment]

    def _room_or_error(self, nbytes: int, stream: Stream, error: MemoryError) -> int | MemoryError:
        h = self.handler
        if h.busy():
            return error
        h.start_arbitration()  # first: a failure recorded below says what was freed for it
        if h.never_fits(nbytes):
            self._record_failure(error, nbytes, 0)
            return error
        # Caches give their free blocks back, then cuDF spills: no outputs while these help.
        for free in (h.release_cached, lambda: h.spill_libraries(nbytes)):
            if free() <= 0:
                continue
            try:
                return self._retry(nbytes, stream)
            except CUDAAllocationError:
                raise
            except MemoryError as e:
                error = e
        spilled = 0
        if h.spill_on_oom:
            key = self._task_key()
            ptr, last, spilled = h.spill_until(
                lambda: self._retry(nbytes, stream), nbytes, in_task=key is not None
            )
            if last is None:
                # spill_until returns a pointer exactly when it returns no error
                assert ptr is not None
                h.avoided_oom()
                return ptr
            error = last
            account = self.task_accounts.get(key)
            h.store.gave_way_here(key, nbytes + (account[0] if account else 0))
        self._record_failure(error, nbytes, spilled)
        return error

    def _retry(self, nbytes: int, stream: Stream) -> int:
        """The upstream allocation again; its failure is not counted again (one request, one
        failed allocation in the statistics)."""
        try:
            return self._upstream_allocate(nbytes, stream)
        except MemoryError:
            stats = self.handler.statistics
            if stats is not None:
                with stats._lock:
                    stats._c.failed -= 1
            raise

    def _record_failure(self, error: MemoryError, nbytes: int, spilled: int) -> None:
        self._events.append((time.time(), "fail", nbytes, 0, self._task_key()))
        with contextlib.suppress(Exception):  # forensics never change the error the caller sees
            self.handler.record_oom(error, nbytes, spilled, self.recent_events())

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        self._upstream_deallocate(ptr, nbytes, stream)
        self._estimate -= nbytes
        self.deallocations += 1
        if self._task_ptrs:
            charged = self._task_ptrs.pop(ptr, None)
            if charged is not None:
                with self._task_lock:
                    charged[0][0] -= charged[1]
        self._events.append((time.time(), "free", nbytes, ptr, None))

    def recent_events(self) -> list[tuple[float, str, int, int, Any]]:
        """The last allocation events, oldest first: ``(unix time, op, nbytes, ptr, task key)``."""
        for _ in range(8):
            with contextlib.suppress(RuntimeError):  # another thread appended while copying
                return list(self._events)
        return []
