"""Memory pressure on a Dask worker: ``DeviceSpillStore`` in front of its data, the spill adaptor
on each device's stack, a periodic check that spills to the limit and pauses the worker over
its pause fraction; teardown undoes it. Not here: the options and the spilling itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_rmm.allocators import caches
from dask_rmm.pressure.adaptor import SpillOnDemandResourceAdaptor
from dask_rmm.pressure.device import DevicePressure
from dask_rmm.pressure.forensics import OOMEvent
from dask_rmm.pressure.metrics import PressureCounters, PressureMetrics
from dask_rmm.pressure.store import DeviceSpillStore

if TYPE_CHECKING:
    from distributed import Worker

    from dask_rmm.stack.build import DeviceStack

__all__ = ["MONITOR_KEY", "WorkerPressure", "wrap_stacks"]

logger = logging.getLogger(__name__)

#: Key of the pressure check in ``worker.periodic_callbacks``.
MONITOR_KEY = "dask-rmm-pressure"


@dataclass(eq=False, repr=False, kw_only=True)
class WorkerPressure:
    """Device-memory pressure handling for one worker.

    Parameters
    ----------
    spill_on_oom : bool
        Spill and retry when an allocation fails.
    pause_fraction : float or None
        Pause the worker while a device's bytes in use exceed this fraction of its capacity
        (the pool's maximum, else the device's memory). None: never pause.
    monitor_interval : float
        Seconds between checks (spill to the limit, pause and resume).
    task_key : callable, optional
        The running task's key.

    A worker's setup calls ``wp.wrap(stack, capacity=..., limit=...)`` per device (``stack.top``
    is then the adaptor), ``wp.attach(worker)``, and ``wp.detach()`` at teardown.
    """

    spill_on_oom: bool = False
    pause_fraction: float | None = None
    monitor_interval: float = 0.1
    task_key: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        self.counters = PressureCounters()
        self.store = DeviceSpillStore(None, self.counters, on_store=self._on_store)
        self.devices: dict[int, DevicePressure] = {}
        #: The running tasks' accounts that every device's adaptor charges (memory admission).
        self.task_accounts: dict[Any, list[int]] = {}
        self._worker: Any = None
        self._monitor: Any = None
        self._paused_by_us = False
        self._host_pause: Any = None  # distributed's pause fraction, put back on resume

    # -- building -------------------------------------------------------------------------------

    def wrap(
        self, stack: DeviceStack, *, capacity: int, limit: int | None = None
    ) -> SpillOnDemandResourceAdaptor:
        """Put the spill adaptor on top of ``stack`` (its ``top`` and ``pressure`` set) and
        return it; without a statistics layer one is added under it (bytes in use are measured).
        """
        from dask_rmm.mr.statistics_adaptor import StatisticsResourceAdaptor

        top, statistics = stack.top, stack.statistics
        if statistics is None:
            top = statistics = StatisticsResourceAdaptor(top)
        dp = DevicePressure(
            stack.device,
            self.store,
            top,
            capacity,
            statistics=statistics,
            pool=stack.pool,
            attribution=stack.attribution,
            limit=limit,
            spill_on_oom=self.spill_on_oom,
            pause_fraction=self.pause_fraction,
            task_key=self.task_key,
            on_oom=lambda e: logger.warning("dask-rmm: out of device memory: %s", e.summary()),
        )
        self.devices[stack.device] = stack.pressure = dp
        # Host copies kept for values brought back: at most what this device may hold.
        self.store.keep_host_copies += limit if limit is not None else capacity
        stack.top = dp.adaptor = SpillOnDemandResourceAdaptor(top, dp, task_key=self.task_key)
        dp.adaptor.task_accounts = self.task_accounts
        return dp.adaptor

    # -- the worker -----------------------------------------------------------------------------

    def attach(self, worker: Worker) -> None:
        """Put the store in front of ``worker``'s data and start the periodic check."""
        from tornado.ioloop import PeriodicCallback

        inner = worker.data
        if isinstance(inner, DeviceSpillStore):
            # Left by an earlier setup whose spilled outputs did not fit back: take them over.
            self.store.adopt(inner)
        else:
            self.store.inner = inner
        # distributed keeps the one mapping in both places (see Worker.data's docstring).
        worker.memory_manager.data = self.store
        worker.state.data = self.store
        self._worker = worker
        self.store.running_tasks = lambda: len(worker.active_threads)
        if self.spill_on_oom:
            for device, dp in self.devices.items():  # library caches out of memory spill too
                caches.set_oom_handler(device, dp.spill_for_cache)
        if self.monitor_interval and (
            self.pause_fraction is not None
            or any(dp.limit is not None for dp in self.devices.values())
        ):
            monitor = PeriodicCallback(self.check, self.monitor_interval * 1000)
            self._monitor = monitor
            worker.periodic_callbacks[MONITOR_KEY] = monitor
            if worker.status.name in ("running", "paused", "closing_gracefully"):
                monitor.start()

    def detach(self, worker: Worker | None = None) -> None:
        """Undo :meth:`attach` (on its worker by default): spilled values come back to the
        device, the worker's mapping is its own again, a pause this made is lifted. Idempotent."""
        worker = worker if worker is not None else self._worker
        if worker is None:
            return
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.stop()
            if worker.periodic_callbacks.get(MONITOR_KEY) is monitor:
                del worker.periodic_callbacks[MONITOR_KEY]
        self._resume(worker)
        self._worker = self.store.running_tasks = None
        for device, dp in self.devices.items():  # bringing values back must not spill others
            if caches.oom_handler(device) == dp.spill_for_cache:
                caches.set_oom_handler(device, None)
            dp.limit = dp.pause_fraction = None
            dp.spill_on_oom = dp.recording = False
        store = self.store
        store.on_store = None
        if worker.memory_manager.data is not store:
            return
        if worker.status.name in ("closing", "closed", "failed", "closing_gracefully"):
            return  # leaving: spilled outputs stay on host, still readable through the store
        inner = store.inner
        failed = []
        for key in store.spilled_keys():
            try:
                store[key]  # brings it back to the device
            except Exception as e:
                failed.append((key, e))
        if failed:  # the store stays, spilling nothing, so that tasks never see a HostCopy
            logger.warning(
                "dask-rmm: %d spilled outputs do not fit back on the device at teardown (first: "
                "%r: %r); they stay in host memory and come back when a task reads them",
                len(failed),
                *failed[0],
            )
            return
        inner.update(store.take_device_values())
        worker.memory_manager.data = inner
        worker.state.data = inner

    # -- periodic check and pause ---------------------------------------------------------------

    def check(self) -> None:
        """Spill to the limits; pause the worker while a device stays above its pause fraction,
        resume it when all are below. Never raises."""
        worker = self._worker
        try:
            over = any([dp.relieve() for dp in self.devices.values()])  # every device relieved
            if worker is not None:
                (self._pause if over else self._resume)(worker)
        except Exception:
            logger.exception("dask-rmm: memory-pressure check failed")

    def _pause(self, worker: Worker) -> None:
        from distributed.core import Status

        if worker.status == Status.running:
            if not self._paused_by_us:
                logger.warning(
                    "dask-rmm: device memory above %.0f%% of capacity; pausing worker %s",
                    100 * (self.pause_fraction or 0),
                    worker.address,
                )
                for dp in self.devices.values():
                    self.counters.set_paused(dp.device, dp.should_pause())
            worker.status = Status.paused
            self._paused_by_us = True
            # distributed's host-memory monitor would resume it: off until ours ends (no door)
            mm = worker.memory_manager
            if mm.memory_pause_fraction is not False:
                self._host_pause, mm.memory_pause_fraction = mm.memory_pause_fraction, False

    def _resume(self, worker: Worker) -> None:
        from distributed.core import Status

        if not self._paused_by_us:
            return
        self._paused_by_us = False
        if self._host_pause is not None:
            worker.memory_manager.memory_pause_fraction, self._host_pause = self._host_pause, None
        for dp in self.devices.values():
            self.counters.set_paused(dp.device, False)
        if worker.status == Status.paused:
            logger.warning(
                "dask-rmm: device memory back below the pause fraction; resuming %s", worker.address
            )
            worker.status = Status.running

    # -- hooks ----------------------------------------------------------------------------------

    def _on_store(self, device: int) -> None:
        dp = self.devices.get(device)
        if dp is None:
            return
        dp.release_cached_when_full()
        dp.spill_to_limit()

    #: Counters that add up over the worker's life (what is on host *now* is not carried).
    CARRIED_COUNTERS = (
        "total_spilled_bytes", "total_spilled_count", "total_unspilled_bytes",
        "total_unspilled_count", "spill_seconds", "unspill_seconds", "ooms_avoided",
        "oom_count", "pauses",
    )  # fmt: skip

    def carry_history(self, previous: WorkerPressure) -> None:
        """Take over ``previous``'s OOM events and running totals, device by device (a
        re-registration replacing it), so that the OOM count still matches the events listed."""
        for device, dp in self.devices.items():
            old = previous.devices.get(device)
            if old is None:
                continue
            dp.oom_events.extendleft(reversed(old.oom_events))
            before = previous.counters.snapshot(device)
            for name in self.CARRIED_COUNTERS:
                self.counters.add(device, name, getattr(before, name))

    # -- reading --------------------------------------------------------------------------------

    def metrics(self) -> list[PressureMetrics]:
        """Counters per device."""
        return [self.counters.snapshot(d) for d in sorted(self.devices)]

    def oom_events(self) -> list[OOMEvent]:
        """The OOM snapshots kept, oldest first, all devices."""
        events = [e for dp in self.devices.values() for e in dp.oom_events]
        return sorted(events, key=lambda e: e.time)


def wrap_stacks(options: Any, stacks: list, *, task_key: Callable[[], Any] | None = None):
    """The :class:`WorkerPressure` for ``options`` (an ``RMMOptions``) with every stack wrapped
    (nothing on the worker changes until :meth:`WorkerPressure.attach`), or None without
    ``device_memory_limit``, ``spill_on_oom`` and ``memory_admission``. The pause fraction
    applies only with ``device_memory_limit`` or ``spill_on_oom``."""
    import dask.config
    from dask.utils import parse_timedelta

    from dask_rmm import _cuda
    from dask_rmm.sizes import host_total_memory

    spilling = options.device_memory_limit is not None or options.spill_on_oom
    if not spilling and not getattr(options, "memory_admission", False):
        return None
    interval = parse_timedelta(
        dask.config.get("distributed.worker.memory.monitor-interval", "100ms"), default="ms"
    )
    wp = WorkerPressure(
        spill_on_oom=options.spill_on_oom,
        pause_fraction=options.device_pause_fraction if spilling else None,
        monitor_interval=interval or 0.1,
        task_key=task_key,
    )
    for stack in stacks:
        host = stack.host_memory
        total = host_total_memory() if host else _cuda.device_total_memory(stack.device)
        limit = options.resolve_size("device_memory_limit", stack.device, total)
        maximum = stack.maximum_pool_size  # the pool's, or the async resource's limit
        wp.wrap(stack, capacity=total if maximum is None else min(maximum, total), limit=limit)
    return wp
