"""Memory admission on the scheduler: a SchedulerPlugin that gives each GPU task its expected
peak as a resource restriction (:data:`~dask_rmm.pressure.admission.RESOURCE`, bytes) from
the peaks workers learn (or its ``gpu_memory`` annotation), and, when a task can go to several
workers, restricts it for that one decision to those whose free budget fits it. Workers run
:mod:`dask_rmm.worker.admission` and tell it their limits, held bytes and peaks as events.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from dask_rmm.pressure.admission import (
    NO_MEMORY,
    RESOURCE,
    UNLIMITED,
    PeakTable,
    annotated_peak,
    task_prefix,
)

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState

__all__ = ["AdmissionScheduler"]

logger = logging.getLogger(__name__)

TOPIC = "dask-rmm-admission"  # dask_rmm.worker.admission.TOPIC (which imports distributed.Worker)


class AdmissionScheduler(SchedulerPlugin):
    """Per-task amounts of the device-memory resource, and placement by free budget."""

    name = "dask-rmm-admission"

    def __init__(self) -> None:
        self.peaks = PeakTable(history=1)  # the expected peak workers last sent, per prefix
        self.held: dict[str, int] = {}  # worker address -> bytes held beside running tasks
        self._on: dict[Hashable, tuple[str, int]] = {}  # processing: key -> (worker, amount)
        self._used: dict[str, int] = {}  # worker -> amounts of the tasks processing there
        self._placing: set[Hashable] = set()  # tasks restricted for their placement only
        self._bad: set[str] = set()
        self.scheduler: Any = None

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    # -- what workers tell ------------------------------------------------------------------------

    def log_event(self, topic: str, msg: Any) -> None:
        if topic != TOPIC or not isinstance(msg, dict) or self.scheduler is None:
            return
        worker = msg.get("worker")
        if "retry" in msg:  # reaches us before the task's error does: distributed retries it
            ts = self.scheduler.tasks.get(msg["retry"])
            if ts is not None and ts.state == "processing":
                ts.retries += 1
            return
        for prefix, nbytes in (msg.get("peaks") or {}).items():
            self.peaks.observe(prefix, nbytes)
        if "limit" not in msg or worker is None:
            return
        new = worker not in self.held
        if msg["limit"] is None:  # admission off on that worker
            self.held.pop(worker, None)
        else:
            self.held[worker] = int(msg.get("held") or 0)
        if new or msg["limit"] is None:  # guard (or free) the tasks waiting for their inputs
            self._apply_to_waiting()

    @property
    def limits(self) -> dict[str, int]:
        """Worker address -> the budget it supplies (workers with admission on): distributed's
        own record, set before a worker's setup returns."""
        supplied = self.scheduler.resources.get(RESOURCE, {}) if self.scheduler else {}
        return {a: int(v) for a, v in supplied.items() if v < UNLIMITED}

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self.held.pop(worker, None)
        self._used.pop(worker, None)

    # -- tasks ------------------------------------------------------------------------------------

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        tasks = self.scheduler.tasks if self.scheduler is not None else {}
        ts = tasks.get(key)
        if start == "processing":
            on = self._on.pop(key, None)
            if on is not None:
                self._used[on[0]] = self._used.get(on[0], 0) - on[1]
        if start == "waiting" and key in self._placing:  # the placement is made: let it go
            self._placing.discard(key)
            if ts is not None:
                ts.worker_restrictions, ts.loose_restrictions = None, False
        if ts is None:
            return
        if finish == "processing" and ts.processing_on is not None:
            amount = (ts.resource_restrictions or {}).get(RESOURCE)
            if amount:
                address = ts.processing_on.address
                self._on[key] = (address, amount)
                self._used[address] = self._used.get(address, 0) + amount
        elif finish == "waiting":
            self._set_amount(ts)
            if not ts.waiting_on:
                self._place(ts)
        elif finish == "memory":
            for dts in ts.dependents:
                if dts.state == "waiting" and not dts.waiting_on:
                    self._set_amount(dts)
                    self._place(dts)

    def _expected(self, ts: TaskState) -> int | None:
        try:
            given = annotated_peak(ts.annotations)
        except ValueError as e:
            if str(e) not in self._bad:
                self._bad.add(str(e))
                logger.warning("dask-rmm: task %r: %s; its peak is learned", ts.key, e)
            given = None
        return given if given is not None else self.peaks.expected(task_prefix(ts.key))

    def _set_amount(self, ts: TaskState) -> None:
        """Give ``ts`` its expected peak, plus its inputs' bytes (on the device beside it while
        it runs, brought back if spilled), as an amount of the resource (none when it needs no
        memory, nothing is known, or no worker has admission); at most the largest budget, so
        that a task needing more than any runs alone rather than never."""
        limits = self.limits
        need = self._expected(ts) if limits else None
        restrictions = dict(ts.resource_restrictions or {})
        if need is None or need <= NO_MEMORY:
            restrictions.pop(RESOURCE, None)
        else:
            need += sum(max(dts.nbytes, 0) for dts in ts.dependencies)  # -1: not in memory yet
            restrictions[RESOURCE] = min(need, max(limits.values()))
        ts.resource_restrictions = restrictions or None

    def _place(self, ts: TaskState) -> None:
        """Restrict ``ts``, for its placement only, to the workers whose free budget fits its
        amount, when some but not all do (else distributed chooses as it would)."""
        need = (ts.resource_restrictions or {}).get(RESOURCE)
        if not need or ts.worker_restrictions or ts.host_restrictions or ts.loose_restrictions:
            return
        running = {ws.address for ws in self.scheduler.running}
        limits = self.limits
        able = [a for a, limit in limits.items() if a in running and limit >= need]
        fits = {a for a in able if self.free(a, limits) >= need}
        if fits and len(fits) < len(able):
            ts.worker_restrictions, ts.loose_restrictions = fits, True
            self._placing.add(ts.key)

    def free(self, address: str, limits: dict[str, int] | None = None) -> int:
        """A worker's free budget: its limit less the bytes it holds beside running tasks and the
        amounts of the tasks processing there."""
        limit = (limits if limits is not None else self.limits).get(address, 0)
        return limit - self.held.get(address, 0) - self._used.get(address, 0)

    def _apply_to_waiting(self) -> None:
        for ts in self.scheduler.tasks.values():
            if ts.state == "waiting":
                self._set_amount(ts)
