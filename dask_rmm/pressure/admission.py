"""Memory admission: a task starts only when its expected peak fits under the worker's limit
beside what is held and the expected peaks of the tasks already running. Expected peaks are
learned per task prefix (a high quantile of the peaks observed as tasks finish) or given by the
task (``dask.annotate(gpu_memory="2GiB")``). Dask-free: the policy and its figures; handing tasks
to threads is the worker side's job (:mod:`dask_rmm.worker.admission`).

Rules: a prefix never seen runs alone until its first peak is known; when nothing that needs
memory runs, the first waiting task starts whatever its peak (no deadlock; the usual spill and
out-of-memory path applies to it); tasks whose expected peak is (about) zero never wait; waiting
tasks start in the order they came.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "NO_MEMORY",
    "AdmissionGate",
    "AdmissionMetrics",
    "ExpectedPeaks",
]

#: An expected peak at most this many bytes counts as "needs no device memory": never held back.
NO_MEMORY = 1 << 20
#: The quantile of the observed peaks that is a prefix's expected peak.
QUANTILE = 0.95
#: Observed peaks kept per prefix (the newest).
HISTORY = 64


class ExpectedPeaks:
    """Observed peak bytes per task prefix, and the expected peak: a high quantile of the last
    :data:`HISTORY` observations (nearest rank). Thread safe."""

    def __init__(self, quantile: float = QUANTILE, history: int = HISTORY):
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
        self.quantile = quantile
        self.history = max(int(history), 1)
        self._lock = threading.Lock()
        # Per prefix: the last peaks in the order seen, and the same sorted.
        self._observed: dict[str, tuple[deque[int], list[int]]] = {}
        self._expected: dict[str, int] = {}

    def observe(self, prefix: str, nbytes: int) -> None:
        """Record one finished task's peak."""
        nbytes = max(int(nbytes), 0)
        with self._lock:
            seen = self._observed.get(prefix)
            if seen is None:
                seen = self._observed[prefix] = (deque(), [])
            order, ordered = seen
            if len(order) >= self.history:
                del ordered[bisect.bisect_left(ordered, order.popleft())]
            order.append(nbytes)
            bisect.insort(ordered, nbytes)
            rank = max(math.ceil(self.quantile * len(ordered)), 1)
            self._expected[prefix] = ordered[rank - 1]

    def expected(self, prefix: str) -> int | None:
        """The expected peak of ``prefix`` in bytes; None when no task of it has finished."""
        return self._expected.get(prefix)

    def to_list(self) -> list[tuple[str, int, int]]:
        """``(prefix, expected peak, observations)``, largest expected peak first."""
        with self._lock:
            out = [(p, self._expected[p], len(s[0])) for p, s in self._observed.items()]
        out.sort(key=lambda r: (-r[1], r[0]))
        return out


@dataclass(frozen=True)
class AdmissionMetrics:
    """What admission did on one worker, at one moment."""

    #: Tasks waiting to start now.
    held_tasks: int = 0
    #: Tasks that had to wait, since setup.
    total_held: int = 0
    #: Seconds tasks waited in all, and the longest one wait (finished waits and those going on).
    wait_seconds: float = 0.0
    longest_wait_seconds: float = 0.0
    #: Tasks started, since setup.
    admitted: int = 0
    #: Expected peak per prefix: ``(prefix, bytes, observations)``, largest first.
    expected_peaks: tuple[tuple[str, int, int], ...] = ()
    #: The limit tasks are admitted under, and the bytes held when last checked.
    limit: int = 0

    def to_dict(self) -> dict:
        return {
            "held_tasks": self.held_tasks,
            "total_held": self.total_held,
            "wait_seconds": self.wait_seconds,
            "longest_wait_seconds": self.longest_wait_seconds,
            "admitted": self.admitted,
            "expected_peaks": [list(p) for p in self.expected_peaks],
            "limit": self.limit,
        }


def _nothing() -> None:
    return None


@dataclass
class _Task:
    key: Hashable
    prefix: str
    given: int | None
    start: Callable[[], object] = field(repr=False)
    handle: Any = field(default=None, repr=False)
    since: float = 0.0
    need: int | None = None  # the expected peak it was admitted with (None: unknown)
    account: list[int] = field(default_factory=lambda: [0, 0])


class AdmissionGate:
    """Decide when each task may start.

    Parameters
    ----------
    limit : callable
        ``limit() -> bytes`` the worker's tasks may use (``device_memory_limit``, else the pool's
        maximum, else the device's memory).
    held : callable
        ``held() -> bytes`` in use now (in arrays, held by running tasks and stored outputs).
    accounts : dict, optional
        ``task key -> [current bytes, peak bytes]`` of the running tasks, which the allocation
        path updates (``SpillOnDemandResourceAdaptor.task_accounts``); the gate opens an account
        when a task starts and reads its peak when it finishes.
    peaks : ExpectedPeaks, optional
        What is learned (a new one by default).
    ignore : callable, optional
        ``ignore(key) -> True`` for a running task that no longer counts (one that left its
        thread to wait for other tasks: it must not hold them back).

    Examples
    --------
    >>> started = []
    >>> gate = AdmissionGate(limit=lambda: 100 << 20, held=lambda: 0)
    >>> gate.request("load-1", "load", None, lambda: started.append("load-1"))
    True
    >>> gate.request("load-2", "load", None, lambda: started.append("load-2"))  # runs alone
    False
    >>> gate.finished("load-1", peak=30 << 20)  # learned: 30 MiB; load-2 starts
    >>> started
    ['load-1', 'load-2']
    """

    def __init__(
        self,
        limit: Callable[[], int],
        held: Callable[[], int],
        accounts: dict | None = None,
        peaks: ExpectedPeaks | None = None,
        ignore: Callable[[Hashable], bool] | None = None,
    ):
        self._ignore = ignore
        self._limit = limit
        self._held = held
        self.accounts: dict = accounts if accounts is not None else {}
        self.peaks = peaks if peaks is not None else ExpectedPeaks()
        self._lock = threading.Lock()
        self._waiting: deque[_Task] = deque()
        self._running: dict[Hashable, _Task] = {}
        self._closed = False
        self._total_held = 0
        self._admitted = 0
        self._wait_seconds = 0.0
        self._longest_wait = 0.0
        self._last_limit = 0

    # -- the policy -------------------------------------------------------------------------------

    def _need(self, task: _Task) -> int | None:
        return task.given if task.given is not None else self.peaks.expected(task.prefix)

    @staticmethod
    def _no_memory(need: int | None) -> bool:
        return need is not None and need <= NO_MEMORY

    def _ignored(self, key: Hashable) -> bool:
        if self._ignore is None:
            return False
        try:
            return bool(self._ignore(key))
        except Exception:
            return False

    def _fits(self, need: int | None) -> bool:
        """Whether a task of expected peak ``need`` (None: unknown) may start now (lock held)."""
        using = [
            t
            for t in self._running.values()
            if not self._no_memory(t.need) and not self._ignored(t.key)
        ]
        if not using:
            return True  # at least one task runs, whatever its peak
        if need is None or any(t.need is None for t in using):
            return False  # a prefix never seen runs alone
        try:
            limit = int(self._limit())
            held = int(self._held())
        except Exception:  # a broken counter must not hold tasks back forever
            return True
        self._last_limit = limit
        # What running tasks hold now is in ``held``; what they may still take is not.
        coming = sum(max(0, (t.need or 0) - t.account[0]) for t in using)
        return need <= limit - held - coming

    # -- what the worker side calls ---------------------------------------------------------------

    def request(
        self,
        key: Hashable,
        prefix: str,
        given: int | None,
        start: Callable[[], object],
        handle: Any = None,
    ) -> bool:
        """Task ``key`` (of ``prefix``; ``given``: its annotated peak or None) wants to run:
        ``start()`` is called once it may, now (returns True) or from a later :meth:`finished`
        (returns False). ``start`` must not block. ``handle`` is what :meth:`drop_waiting`
        hands back for it."""
        task = _Task(key, prefix, given, start, handle, since=time.monotonic())
        with self._lock:
            need = self._need(task)
            now = self._closed or self._no_memory(need) or (not self._waiting and self._fits(need))
            if now:
                self._begin(task, need)
            else:
                self._waiting.append(task)
                self._total_held += 1
        if now:
            start()
        return now

    def admit_now(self, key: Hashable, prefix: str, given: int | None) -> bool:
        """Start task ``key`` now if it may without waiting (True: the caller starts it);
        False changes nothing (then :meth:`request` queues it). The fast path of
        :meth:`request`, with nothing to call back."""
        task = _Task(key, prefix, given, _nothing, since=time.monotonic())
        with self._lock:
            need = self._need(task)
            if not (
                self._closed or self._no_memory(need) or (not self._waiting and self._fits(need))
            ):
                return False
            self._begin(task, need)
        return True

    def finished(self, key: Hashable, peak: int | None = None, *, learn: bool = True) -> None:
        """Task ``key`` finished: its peak (read from its account unless given) is learned
        (unless ``learn`` is false: it did not run) and the waiting tasks that now fit start."""
        with self._lock:
            task = self._running.pop(key, None)
            if self.accounts.get(key) is (task.account if task is not None else None):
                self.accounts.pop(key, None)
        if task is not None and learn:
            self.peaks.observe(task.prefix, peak if peak is not None else task.account[1])
        self.pump()

    def pump(self) -> None:
        """Start the waiting tasks that fit now (in order; those needing no memory at once)."""
        while True:
            with self._lock:
                task = self._next()
                if task is None:
                    return
            task.start()

    def _next(self) -> _Task | None:
        """The next waiting task that may start, made running (lock held)."""
        for i, task in enumerate(self._waiting):
            need = self._need(task)
            if self._closed or self._no_memory(need) or (i == 0 and self._fits(need)):
                del self._waiting[i]
                self._begin(task, need)
                return task
        return None

    def _begin(self, task: _Task, need: int | None) -> None:
        task.need = need
        waited = time.monotonic() - task.since
        self._wait_seconds += waited
        self._longest_wait = max(self._longest_wait, waited)
        self._admitted += 1
        self._running[task.key] = task
        self.accounts[task.key] = task.account

    def close(self) -> list[Hashable]:
        """Hold nothing back any more: every waiting task starts now (teardown, with the worker
        still running); the keys started."""
        with self._lock:
            self._closed = True
        keys: list[Hashable] = []
        while True:
            with self._lock:
                task = self._next()
            if task is None:
                return keys
            keys.append(task.key)
            task.start()

    def drop_waiting(self) -> list[Any]:
        """Forget the waiting tasks without starting them (the worker is closing); their
        handles (see :meth:`request`)."""
        with self._lock:
            self._closed = True
            dropped = [t.handle for t in self._waiting]
            self._waiting.clear()
        return dropped

    def withdraw(self, key: Hashable) -> None:
        """Task ``key`` will not run (cancelled while waiting): forget it; others may start."""
        with self._lock:
            kept = [t for t in self._waiting if t.key != key]
            if len(kept) == len(self._waiting):
                return
            self._waiting = deque(kept)
        self.pump()

    # -- reading -----------------------------------------------------------------------------------

    def waiting_keys(self) -> list[Hashable]:
        with self._lock:
            return [t.key for t in self._waiting]

    def running_keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._running)

    def metrics(self) -> AdmissionMetrics:
        now = time.monotonic()
        with self._lock:
            waits = [now - t.since for t in self._waiting]
            if not self._last_limit:
                try:
                    self._last_limit = int(self._limit())
                except Exception:
                    pass
            return AdmissionMetrics(
                held_tasks=len(waits),
                total_held=self._total_held,
                wait_seconds=self._wait_seconds + sum(waits),
                longest_wait_seconds=max([self._longest_wait, *waits]),
                admitted=self._admitted,
                expected_peaks=tuple(self.peaks.to_list()),
                limit=self._last_limit,
            )
