"""Memory admission on a Dask worker, through distributed's worker resources: the worker supplies
its device budget as the resource :data:`~dask_rmm.pressure.admission.RESOURCE`, the scheduler
(:mod:`dask_rmm.scheduler.admission`) gives each GPU task its expected peak plus its inputs'
bytes as a restriction, and the state machine keeps a task ``constrained`` until it fits.
Here: peaks learned as tasks finish (sampled every :data:`TICK` and after CuPy's allocations)
and sent to the scheduler; a seceding task's budget given back; a stalled wait ended after
:data:`STALL_SECONDS`; a task failed by PyTorch's own allocator, that gave way to the tasks
beside it, or whose input found no room to come back, run once more after room is made
(unless ``oom_retry`` is off or the task is annotated ``gpu_retry=False``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from dask_rmm.allocators.arbitration import make_room, requested_bytes, runs_again
from dask_rmm.pressure.admission import (
    NO_MEMORY,
    RESOURCE,
    UNLIMITED,
    PeakTable,
    admission_of,
    installed,
    task_prefix,
)
from dask_rmm.worker.metrics import add_periodic, remove_periodic

if TYPE_CHECKING:
    from distributed import Worker

    from dask_rmm.pressure.worker import WorkerPressure

__all__ = [
    "STALL_SECONDS",
    "TOPIC",
    "WorkerAdmission",
    "admission_of",
    "install_admission",
    "remove_admission",
]

logger = logging.getLogger(__name__)

#: The event topic workers tell the scheduler's admission plugin on (their limit, bytes held,
#: changed expected peaks, tasks to run again).
TOPIC = "dask-rmm-admission"
#: Seconds the first waiting task waits while no task starts or finishes before it is admitted
#: anyway (a running task blocked on another task without seceding must not stall the worker).
STALL_SECONDS = 30.0
#: Seconds between two looks (stalls, peaks to send) and its key in ``periodic_callbacks``.
TICK = 0.02
TICK_KEY = "dask-rmm-admission"
#: Held bytes change the scheduler hears of: this fraction of the limit.
_HELD_STEP = 1 / 32
#: Bytes CuPy allocates, from its cache or not, between two samples of the bytes in use: this
#: fraction of the limit, at most ``_MAX_SAMPLE_STEP`` (a peak reached through CuPy's
#: allocations is learned to within it). A sample: ~6 us on a CI runner, CuPy's pool ~1 us.
_SAMPLE_STEP = 1 / 1024
_MAX_SAMPLE_STEP = 64 << 20

#: A task that waited longer than this (seconds) was held back (all pass through constrained).
_HELD = 0.001


class WorkerAdmission:
    """Admission on one worker (see the module doc); ``transition`` is called by the worker's
    :class:`~dask_rmm.plugin.RMMPlugin` for each task it moves."""

    def __init__(self, worker: Worker, pressure: WorkerPressure, retry: bool = True):
        self.worker = worker
        self.pressure = pressure
        #: Whether a task PyTorch's own allocator failed runs once more (``oom_retry``).
        self.retry = retry
        self.limit = sum(dp.admission_limit() for dp in pressure.devices.values())
        self.peaks = PeakTable()
        self._held_sent: int | None = None
        # running tasks: key -> [bytes in use when it started, its largest sampled growth]
        self._growth: dict[Hashable, list[int]] = {}
        self._sampling = threading.Lock()  # samples come from the loop and from tasks' threads
        self._unsampled = 0  # bytes CuPy allocated since the last sample
        self._sample_step = max(1, min(int(self.limit * _SAMPLE_STEP), _MAX_SAMPLE_STEP))
        self._since: dict[Hashable, float] = {}  # waiting tasks: since when
        self._progress = time.monotonic()
        self._retried: set[Hashable] = set()
        self.total_held = 0
        self.wait_seconds = 0.0
        self.longest_wait = 0.0

    # -- the worker's tasks -----------------------------------------------------------------------

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        """Follow task ``key`` from ``start`` to ``finish`` (the worker's state machine)."""
        now = time.monotonic()
        if finish == "constrained":
            self._since[key] = now
            return
        since = self._since.pop(key, None)
        if since is not None and now - since > _HELD:
            self.total_held += 1
            self.wait_seconds += now - since
            self.longest_wait = max(self.longest_wait, now - since)
        if finish == "executing":
            self._progress = now
            self.pressure.task_accounts[key] = [0, 0]
            self._growth[key] = [self._in_use(), 0]
        elif finish == "long-running":
            self._give_back(key)
        elif key in self._growth and start in ("executing", "long-running", "cancelled"):
            self._progress = now
            account = self.pressure.task_accounts.pop(key, None)
            growth = self._growth.pop(key)
            if finish == "memory" and key in self._retried:
                self._retried.discard(key)
                self._count("task_retries_succeeded")
            if finish == "memory" and account is not None:  # a failed task teaches nothing
                share = len(self._growth) + 1  # tasks running beside it grew too
                peak = max(account[1], growth[1], (self._in_use() - growth[0]) // share)
                prefix = task_prefix(key)
                before = self.peaks.expected(prefix)
                expected = self.peaks.observe(prefix, peak)
                if expected != before:  # sent before the task's result: the scheduler knows
                    self.worker.log_event(TOPIC, {"peaks": {prefix: expected}})
            elif finish == "error":
                self._after_error(key, account)

    def _in_use(self) -> int:
        """Bytes in use on the worker's devices, in every library (caches' free blocks not)."""
        return sum(dp.current_bytes() for dp in self.pressure.devices.values())

    def _give_back(self, key: Hashable) -> None:
        """A task left its thread (``secede``, ``worker_client``): its budget goes back, so the
        tasks it waits for can start."""
        state = self.worker.state
        ts = state.tasks.get(key)  # type: ignore[call-overload]
        held = (ts.resource_restrictions or {}).get(RESOURCE) if ts is not None else None
        if not held:
            return
        ts.resource_restrictions = {
            k: v for k, v in ts.resource_restrictions.items() if k != RESOURCE
        }
        state.available_resources[RESOURCE] += held
        self.worker.loop.add_callback(self._poke)

    def _count(self, name: str) -> None:
        """Count once per worker: on its first device, as its admission figures are."""
        for device in self.pressure.devices:
            self.pressure.counters.add(device, name)
            return

    def _after_error(self, key: Hashable, account: list[int] | None) -> None:
        """PyTorch's own device out-of-memory error (not a host one, nor the stack's: retried in
        place), a give-way (``DeviceSpillStore.gave_way``), or an input with no room to come back
        (``.unread``: the task did not start): room is made, the task runs once more (the
        scheduler's ``retries``, asked for on :data:`TOPIC` before the error reaches it)."""
        gave_way = self.pressure.store.gave_way.pop(key, None)  # taken whatever happens next
        ts, pending = self.worker.state.tasks.get(key), self.pressure.store.unread  # type: ignore
        unread = [pending[d.key] for d in getattr(ts, "dependencies", ()) if d.key in pending]
        if ts is None or not self.retry or (ts.annotations or {}).get("gpu_retry", True) is False:
            return
        requested = _device_out_of_memory(ts)
        if requested is None and gave_way is None and not unread:
            return
        if key in self._retried:
            self._retried.discard(key)
            return
        if len(self._retried) > 1024:  # retried elsewhere: never seen again here
            self._retried.clear()
        self._retried.add(key)
        need = max(requested or 0, account[1] if account else 0, sum(unread))
        if gave_way is not None:  # it needs what it held and asked for: it runs when that fits
            prefix = task_prefix(key)
            self.worker.log_event(TOPIC, {"peaks": {prefix: self.peaks.observe(prefix, gave_way)}})
        if gave_way is not None or unread:
            self._charge_running()
        self.worker.log_event(TOPIC, {"retry": key})
        self._count("task_retries")
        logger.warning(
            "dask-rmm: task %r %s: making room and running it once more "
            "(dask.annotate(gpu_retry=False) or oom_retry=False: not)",
            key,
            "gave way to the tasks beside it, all waiting for device memory"
            if gave_way is not None
            else "found no device memory to bring its inputs back to (it had not started)"
            if unread
            else "ran out of device memory in PyTorch's allocator",
        )
        library = "torch" if gave_way is None and not unread else "the stack"
        loop = asyncio.get_running_loop()
        for device in list(self.pressure.devices):  # spilling, empty_cache: not on the loop
            loop.run_in_executor(None, functools.partial(make_room, device, need, library=library))

    def _charge_running(self) -> None:
        """A task gave way: the tasks running without an amount take their expected peak (else
        the most they used so far) from what is left of the budget, so that its run again waits
        ``constrained`` until they end (their amounts come back as any task's do)."""
        state = self.worker.state
        for ts in list(state.executing):
            left = state.available_resources.get(RESOURCE, 0)
            if RESOURCE in (ts.resource_restrictions or {}) or left <= 0:
                continue
            account = self.pressure.task_accounts.get(ts.key)
            used = max(self.peaks.expected(task_prefix(ts.key)) or 0, account[1] if account else 0)
            if (amount := min(used, left)) > NO_MEMORY:
                ts.resource_restrictions = {**(ts.resource_restrictions or {}), RESOURCE: amount}
                state.available_resources[RESOURCE] = left - amount

    # -- every TICK -----------------------------------------------------------------------------

    def tick(self) -> None:
        """Admit a task left waiting while nothing moves; sample running tasks' growth; tell
        the scheduler the bytes held when they changed. Never raises."""
        try:
            self.sample()
            self._unstall()
            self._report()
        except Exception:
            logger.exception("dask-rmm: memory admission's periodic look failed")

    def sample(self) -> None:
        """Read the bytes in use now: each running task's largest growth is at least its share
        of their growth since it started (the tasks running share it). Any thread."""
        self._unsampled = 0
        if not self._growth:
            return
        in_use = self._in_use()
        with self._sampling:
            growths = list(self._growth.values())  # the loop adds and removes tasks meanwhile
            share = len(growths)
            for growth in growths:
                growth[1] = max(growth[1], (in_use - growth[0]) // share)

    def cupy_allocated(self, nbytes: int) -> None:
        """CuPy allocated ``nbytes`` (its cache may have served them, unseen by the stack): a
        sample once the bytes allocated since the last one reach the step, so that a task
        that frees them before the next tick is still learned at its peak (to within the
        step). On every CuPy allocation while tasks run: kept to an addition."""
        if self._growth:
            unsampled = self._unsampled + nbytes
            if unsampled < self._sample_step:
                self._unsampled = unsampled
            else:
                self.sample()

    def watch(self) -> None:
        """Sample after CuPy's allocations (:meth:`cupy_allocated`), when CuPy is imported:
        otherwise its allocations are not the stack's (dask-rmm's CuPy allocators import it)."""
        if "cupy" in sys.modules:
            from dask_rmm.allocators.cupy import watch_cupy_allocations

            watch_cupy_allocations(self, self.cupy_allocated)

    def unwatch(self) -> None:
        if "dask_rmm.allocators.cupy" in sys.modules:
            from dask_rmm.allocators.cupy import unwatch_cupy_allocations

            unwatch_cupy_allocations(self)

    def _unstall(self) -> None:
        state = self.worker.state
        waiting = [ts for ts in state.constrained if RESOURCE in (ts.resource_restrictions or {})]
        if not waiting or time.monotonic() - self._progress < STALL_SECONDS:
            return
        first = min(waiting, key=lambda ts: ts.priority or ())
        available = max(0, int(state.available_resources.get(RESOURCE, 0)))
        holding = [ts.key for ts in state.executing if RESOURCE in (ts.resource_restrictions or {})]
        logger.warning(
            "dask-rmm: task %r waited %.0f s for device memory while %s held it and none "
            "finished (blocked without secede()?): admitted with the %d bytes free",
            first.key, STALL_SECONDS, holding, available,
        )  # fmt: skip
        first.resource_restrictions = {**first.resource_restrictions, RESOURCE: available}
        self._progress = time.monotonic()
        self._poke()

    def _report(self) -> None:
        """Tell the scheduler the limit and the bytes held, once the worker runs (a preload's
        setup comes before its registration) and whenever the held bytes moved."""
        if self.worker.status.name != "running":
            return
        held = max(0, self._in_use() - sum(a[0] for a in self.pressure.task_accounts.values()))
        step = self.limit * _HELD_STEP
        if self._held_sent is None or abs(held - self._held_sent) > step:
            self._held_sent = held
            self.worker.log_event(TOPIC, {"limit": self.limit, "held": held})

    def _poke(self) -> None:
        """Have the worker's state machine look at its waiting tasks again (it does on every
        event; a changed budget is none)."""
        from distributed.core import Status
        from distributed.worker_state_machine import UnpauseEvent

        if self.worker.status == Status.running:
            event = UnpauseEvent(stimulus_id=f"dask-rmm-admission-{time.time()}")
            self.worker.handle_stimulus(event)

    # -- reading ---------------------------------------------------------------------------------

    def metrics(self, top_n: int = 10) -> dict[str, Any]:
        """The heartbeat's admission fields."""
        now = time.monotonic()
        waits = [now - t for t in self._since.values()]
        return {
            "admission_held_tasks": len(waits),
            "admission_total_held": self.total_held + len(waits),  # waiting now: held back
            "admission_wait_seconds": self.wait_seconds + sum(waits),
            "admission_longest_wait_seconds": max([self.longest_wait, *waits]),
            "admission_expected_peaks": [
                list(p) for p in self.peaks.top(top_n) if p[1] > NO_MEMORY
            ],
        }


def _device_out_of_memory(ts: Any) -> int | None:
    """The bytes asked for (0: unknown) if task ``ts`` failed with PyTorch's own device
    out-of-memory error (:func:`~dask_rmm.allocators.arbitration.runs_again`), else None: told
    from its exception as distributed keeps it (pickled), else (a type that did not pickle)
    from the text of its repr (PyTorch's "CUDA out of memory")."""
    from distributed.protocol.pickle import loads

    try:
        error = loads(ts.exception.data)
    except Exception:
        error = None
    text = str(ts.exception_text)
    if isinstance(error, BaseException) and type(error) is not Exception:
        device = runs_again(error)
    else:
        device = text.startswith("OutOfMemoryError(") and "CUDA out of memory" in text
    return (
        requested_bytes(error if isinstance(error, BaseException) else Exception(text))
        if device
        else None
    )


async def install_admission(
    worker: Worker, pressure: WorkerPressure, retry: bool = True
) -> WorkerAdmission:
    """Admission on ``worker`` under its devices' summed limits: the worker supplies its budget
    as a resource, the scheduler gets the plugin that sets tasks' amounts; ``retry``: a task
    PyTorch's own allocator failed runs once more (``oom_retry``)."""
    from distributed.protocol.pickle import dumps

    from dask_rmm.scheduler.admission import AdmissionScheduler

    old = installed.get(worker)
    remove_admission(worker, tell=False)
    admission = installed[worker] = WorkerAdmission(worker, pressure, retry)
    if old is not None:  # a re-registration keeps what was learned
        admission.peaks = old.peaks
    # Of tasks all waiting for memory, one that has not run again yet gives way (the key the
    # adaptors charge and record, ``WorkerPressure.task_key``).
    retried, key_of = admission._retried, pressure.task_key or (lambda: None)
    pressure.store.may_give_way = lambda: key_of() not in retried
    try:
        await worker.scheduler.register_scheduler_plugin(
            plugin=dumps(AdmissionScheduler()), name=AdmissionScheduler.name, idempotent=True
        )
    except Exception as e:  # the worker runs on; tasks get no amounts until a worker installs it
        logger.warning("dask-rmm: memory admission's scheduler plugin not installed: %r", e)
    if worker.status.name == "running":
        await worker.set_resources(**{RESOURCE: admission.limit})
    else:  # a preload, before the worker registers: its registration carries the resource
        worker.state.total_resources[RESOURCE] = admission.limit
        worker.state.available_resources[RESOURCE] = admission.limit
    admission._report()
    try:
        admission.watch()
    except Exception as e:  # peaks then come from the ticks alone
        logger.warning("dask-rmm: memory admission cannot watch CuPy's allocations: %r", e)
    add_periodic(worker, TICK_KEY, admission.tick, TICK)
    admission._poke()
    return admission


def remove_admission(worker: Worker, *, tell: bool = True) -> None:
    """Take admission off ``worker``: it supplies an unlimited budget (waiting tasks start),
    and the scheduler stops giving tasks amounts for it."""
    admission = installed.pop(worker, None)
    if admission is None:
        return
    remove_periodic(worker, TICK_KEY)
    admission.unwatch()
    admission.pressure.store.may_give_way = None
    state = worker.state
    if RESOURCE in state.total_resources:  # at once, as Worker.set_resources does
        state.available_resources[RESOURCE] += UNLIMITED - state.total_resources[RESOURCE]
        state.total_resources[RESOURCE] = UNLIMITED
    if not tell or worker.status.name in ("closing", "closed", "failed"):
        return
    worker.log_event(TOPIC, {"limit": None})

    async def tell_scheduler() -> None:
        if worker not in installed:
            await worker.set_resources(**{RESOURCE: UNLIMITED})

    worker.loop.add_callback(tell_scheduler)
    admission._poke()
