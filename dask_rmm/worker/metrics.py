"""A worker's heartbeat metrics, ``worker.metrics["dask-rmm"]`` (format: ``wire.py``) and
``["rmm"]``, and their sampler. Not here: building the stacks it reads (:mod:`dask_rmm.stack`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from tornado.ioloop import PeriodicCallback

from dask_rmm import _cuda, wire
from dask_rmm.allocators import caches
from dask_rmm.mr.statistics_adaptor import Statistics
from dask_rmm.pressure.admission import admission_of
from dask_rmm.stack.build import DeviceStack
from dask_rmm.wire import METRICS_KEY
from dask_rmm.worker.stacks import replaced_resource_note, worker_stack

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["MAX_SAMPLES", "METRICS_KEY", "SAMPLER_KEY", "WorkerMetrics", "send_metrics"]

logger = logging.getLogger(__name__)

#: Samples kept between two heartbeats at most (a slow heartbeat loses the oldest).
MAX_SAMPLES = 1000
#: Key of the sampler in ``worker.periodic_callbacks``.
SAMPLER_KEY = "dask-rmm-sampler"
#: The wire fields that are the statistics adaptor's counters.
_STAT_FIELDS = tuple(f.name for f in fields(Statistics) if f.name in wire.COUNTERS)
# How old the reserved bytes of the "dask-rmm" metric may be for the "rmm" metric to reuse them.
_RESERVED_REUSE_S = 0.25


@dataclass
class _DeviceSamples:
    """One device's stack and what the metrics keep for it between heartbeats."""

    stack: DeviceStack
    samples: deque = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    last_reserved: tuple[float, int] = (-1e9, 0)  # (monotonic time, reserved bytes)
    previous_batch: list = field(default_factory=list)


#: Per worker: the devices' samples a removed :class:`WorkerMetrics` had not sent, which the
#: next one installed there sends (a registration between two heartbeats loses no peak).
_unsent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def send_metrics(worker: Worker) -> bool:
    """Send ``worker``'s dask-rmm heartbeat entry to the scheduler now and return once it was
    read there (False: not sent, the next heartbeat brings it), so that a report right after
    a change shows it; without one (torn down) the scheduler forgets the worker's numbers.
    Never calls ``Worker.heartbeat``: one beside the periodic heartbeat, while that one
    waits on an awaitable metric (distributed's ``gpu`` one, with NVML), fails distributed's
    spans check and closes the worker. Never raises."""
    metric = worker.metrics.get(METRICS_KEY)
    if worker.status.name != "running":
        return False
    try:
        handler = getattr(worker.scheduler, wire.METRICS_HANDLER)
        entry = None if metric is None else metric(worker)
        return bool(await handler(address=worker.contact_address, metrics=entry))
    except Exception as e:  # a scheduler without dask-rmm's plugin, a closed comm
        logger.debug("dask-rmm: metrics not sent at once (%s); the next heartbeat brings them", e)
        return False


def retired_bytes(retired: Iterable[DeviceStack], device: int) -> int:
    """Bytes still allocated through the ``retired`` stacks of ``device``: stacks a
    re-registration replaced while buffers made through them were alive
    (:attr:`dask_rmm.worker.stacks.WorkerStack.retired`)."""
    return sum(s.live_bytes for s in retired if s.device == device)


@functools.cache
def device_identity(device: int, host_memory: bool) -> dict[str, str]:
    """``gpu_name``, ``gpu_uuid`` and ``pci_bus_id`` of ``device`` (read once per process)."""
    if host_memory:
        return {"gpu_name": "host", "gpu_uuid": "", "pci_bus_id": ""}
    name, uuid, pci = _cuda.device_identity(device)
    return {"gpu_name": name, "gpu_uuid": uuid, "pci_bus_id": pci}


def process_used_bytes(pci_bus_id: str) -> int:
    """Device memory this process uses on the device at ``pci_bus_id``, per the driver (NVML's
    running compute processes); 0 where it cannot tell (no NVML, MIG, a container that hides
    the process's PID, NVML's "not available")."""
    nvml = _cuda.nvml()
    if nvml is None:
        return 0
    try:
        procs = nvml.device_get_compute_running_processes_v3(
            nvml.device_get_handle_by_pci_bus_id_v2(pci_bus_id)
        )
        pids = np.atleast_1d(np.asarray(procs.pid, dtype=np.int64))
        used = np.atleast_1d(np.asarray(procs.used_gpu_memory, dtype=np.uint64))
    except Exception:
        return 0
    mine = used[(pids == os.getpid()) & (used < np.uint64(1 << 62))]
    return int(mine.sum())


def add_periodic(
    worker: Worker, key: str, callback: Callable[[], Any], seconds: float
) -> PeriodicCallback:
    """Run ``callback`` every ``seconds`` as ``worker.periodic_callbacks[key]``: stopped when the
    worker closes, even without a teardown, and started by the worker if added before it starts
    (a preload)."""
    periodic = worker.periodic_callbacks[key] = PeriodicCallback(callback, seconds * 1000)
    if worker.status.name in ("running", "paused", "closing_gracefully"):
        periodic.start()
    return periodic


def remove_periodic(worker: Worker, key: str, callback: Any = None) -> None:
    """Stop ``callback`` (default: the worker's ``key``) and take it off the worker."""
    callback = callback or worker.periodic_callbacks.get(key)
    if callback is not None:
        callback.stop()
        if worker.periodic_callbacks.get(key) is callback:
            del worker.periodic_callbacks[key]


class WorkerMetrics:
    """The heartbeat metrics of one worker's device stacks, and the sampler that feeds them.

    Reports no devices before :meth:`install` and after :meth:`remove`, so that a sampler tick
    or a heartbeat already on its way when the stacks are torn down does nothing.
    """

    def __init__(self) -> None:
        self._devices: list[_DeviceSamples] = []
        self._top_n = 10
        self._sampler: Any = None  # tornado PeriodicCallback while sampling
        self._previous_rmm_metric: Any = None
        self._retired: Callable[[], list[DeviceStack]] = list

    def install(
        self,
        worker: Worker,
        stacks: Iterable[DeviceStack],
        *,
        top_n: int,
        sample_interval: float,
        sampling: bool,
    ) -> None:
        """Publish ``worker.metrics["dask-rmm"]`` and ``["rmm"]`` for ``stacks`` and, with
        ``sampling`` and a positive ``sample_interval`` (seconds), start the sampler."""
        installed = getattr(worker.metrics.get(METRICS_KEY), "__self__", None)
        if isinstance(installed, WorkerMetrics):  # this one again, or a displaced plugin's
            installed.remove(worker)
        self._previous_rmm_metric = worker.metrics.get("rmm")
        owner = worker_stack(worker)
        self._retired = lambda: owner.retired
        self._top_n = top_n
        # Samples the heartbeat has not sent yet go on (with the peaks in them).
        unsent = _unsent.pop(worker, {})
        self._devices = [
            replace(unsent[s.device], stack=s, last_reserved=(-1e9, 0))
            if s.device in unsent
            else _DeviceSamples(s)
            for s in stacks
        ]
        # A new dict, never a change in place: a heartbeat suspended in Worker.get_metrics
        # (at an awaitable metric) is iterating the old one, and a dict that changes size under
        # it raises RuntimeError, which closes the worker.
        worker.metrics = {
            **worker.metrics,
            METRICS_KEY: self.heartbeat_metrics,
            "rmm": self.rmm_metrics,
        }
        if sampling and sample_interval and sample_interval > 0:
            self._sampler = add_periodic(worker, SAMPLER_KEY, self.sample, sample_interval)
        self.sample()

    def remove(self, worker: Worker) -> None:
        """Stop the sampler and take back what :meth:`install` published (idempotent)."""
        sampler, self._sampler = self._sampler, None
        if sampler is not None:  # without one, the worker's SAMPLER_KEY is another's
            remove_periodic(worker, SAMPLER_KEY, sampler)
        if self._devices:  # for the next install on this worker
            _unsent[worker] = {d.stack.device: d for d in self._devices}
        metrics = dict(worker.metrics)  # a new dict, as in install
        if metrics.get(METRICS_KEY) == self.heartbeat_metrics:
            del metrics[METRICS_KEY]
        if metrics.get("rmm") == self.rmm_metrics:
            metrics["rmm"] = self._previous_rmm_metric
            if metrics["rmm"] is None:
                del metrics["rmm"]
        worker.metrics = metrics
        WorkerMetrics.__init__(self)  # nothing installed, as before install

    def sample(self) -> None:
        """Record ``(time, current_bytes, max_bytes_in_interval)`` per device (sampler tick)."""
        now = time.time()
        for device in self._devices:
            stats = device.stack.statistics
            if stats is None:
                continue
            try:
                peak = stats.take_interval_peak()
                device.samples.append([now, stats.current_bytes, peak])
            except Exception:  # a sampler must not die; the metrics report the error
                logger.exception("dask-rmm: sampling device %d failed", device.stack.device)

    def heartbeat_metrics(self, worker: Worker) -> dict[str, Any]:
        """``worker.metrics["dask-rmm"]``: :func:`dask_rmm.wire.heartbeat`. Never raises."""
        name = worker.name if isinstance(worker.name, (str, int)) else str(worker.name)
        devices = {}
        retired = self._retired()  # never raises: live_bytes and close_log catch
        for d in self._devices:
            try:
                devices[str(d.stack.device)] = self._device_metrics(d, self._top_n, retired)
            except Exception as e:  # pragma: no cover - defensive: the heartbeat must go on
                devices[str(d.stack.device)] = {"error": f"{type(e).__name__}: {e}"}
        admission = admission_of(worker)
        if devices and admission is not None:  # per worker: its figures go with the first device
            first = devices[min(devices, key=int)]
            try:
                first.update(admission.metrics(self._top_n))
            except Exception as e:  # pragma: no cover - defensive: the heartbeat must go on
                first["error"] = f"admission: {type(e).__name__}: {e}"
        return wire.heartbeat(name, time.time(), devices)

    @staticmethod
    def _device_metrics(
        device: _DeviceSamples, top_n: int, retired: Sequence[DeviceStack] = ()
    ) -> dict[str, Any]:
        stack = device.stack
        d: dict[str, Any] = {"resource": stack.chain}

        def statistics() -> None:
            stats = stack.statistics
            if stats is not None:
                counts = stats.allocation_counts
                # Not Statistics.to_dict(): dataclasses.asdict costs microseconds per call.
                for name in _STAT_FIELDS:
                    d[name] = int(getattr(counts, name))
                d["failed_allocations"] = int(stats.failed_allocations)
            info = stack.top.reserved_memory_info()
            if info is None:  # nothing pools: what is allocated is what is reserved
                d["reserved_bytes"] = d.get("current_bytes", 0)
            else:
                d["reserved_bytes"] = int(info.reserved_bytes)
                d["pool_free_bytes"] = int(info.free_bytes)
                d["largest_free_block"] = int(info.largest_free_block)
            if stats is None:  # statistics=False: derive what can be, say what cannot
                d["measured"] = "none" if info is None else "pool"
                if info is not None:
                    d["current_bytes"] = max(0, int(info.reserved_bytes - info.free_bytes))
            device.last_reserved = (time.monotonic(), d["reserved_bytes"])
            d["retired_bytes"] = retired_bytes(retired, stack.device)

        def library_caches() -> None:
            shares = caches.library_bytes(stack.device)
            inside = {k: v for k, v in shares.items() if not v.outside_stack}
            d["library_cached_bytes"] = sum(v.cached_bytes for v in inside.values())
            d["library_caches"] = ",".join(sorted(inside))
            d["library_outside_bytes"] = sum(
                v.in_use_bytes + v.cached_bytes for v in shares.values() if v.outside_stack
            )
            d["libraries"] = [
                [name, v.in_use_bytes, v.cached_bytes, int(v.outside_stack)]
                for name, v in sorted(shares.items())
            ]
            if (cudf := caches.spilled_by_libraries().get("cudf")) is not None:
                d["cudf_spilled_bytes"], d["cudf_spillable_bytes"] = cudf

        def device_memory() -> None:
            d.update(device_identity(stack.device, stack.host_memory))
            if not stack.host_memory:  # cudaMemGetInfo; 0 and 0 on host memory
                with _cuda.on_device(stack.device):
                    free, total = _cuda.mem_get_info()
                d["device_used_bytes"], d["device_total_bytes"] = total - free, total
                d["process_used_bytes"] = process_used_bytes(d["pci_bus_id"])

        def current_resource() -> None:
            if (note := replaced_resource_note(stack.device)) is not None:
                errors.append(note)

        def task_groups() -> None:
            if stack.attribution is not None:
                d["task_groups"] = [m.to_list() for m in stack.attribution.top(top_n)]

        def memory_pressure() -> None:
            if stack.pressure is not None:
                d.update(stack.pressure.heartbeat_fields())

        errors = []
        parts = (statistics, library_caches, device_memory, current_resource, task_groups)
        for part in (*parts, memory_pressure):
            try:  # one part failing leaves the others, and the heartbeat, intact
                part()
            except Exception as e:
                errors.append(f"{part.__name__.replace('_', ' ')}: {type(e).__name__}: {e}")
        if errors:
            d["error"] = "; ".join(errors)
        # This heartbeat's samples after the previous heartbeat's: the scheduler reads the
        # heartbeats by polling and keeps only samples newer than its newest, so one heartbeat
        # it did not see loses nothing.
        samples = device.samples
        batch = [samples.popleft() for _ in range(len(samples))]
        d["samples"] = wire.pack_samples(device.previous_batch + batch)
        device.previous_batch = batch
        return d

    def rmm_metrics(self, worker: Worker) -> dict[str, int]:
        """``worker.metrics["rmm"]`` for distributed's RMM dashboard plot. Never raises."""
        used = total = 0
        for device in self._devices:
            stack = device.stack
            try:
                stats = stack.statistics
                if stats is not None:
                    current = stats.current_bytes
                else:  # statistics=False: in use in a pool is its reserved minus free bytes
                    info = stack.top.reserved_memory_info()
                    current = info.reserved_bytes - info.free_bytes if info is not None else 0
                # distributed's plot: what arrays use, not what library caches keep free
                used += max(0, current - sum(caches.cached_bytes(stack.device).values()))
                # The "dask-rmm" metric of this heartbeat has just walked the pool's free lists:
                # reuse its reserved bytes rather than walk them again.
                when, reserved = device.last_reserved
                if time.monotonic() - when > _RESERVED_REUSE_S:
                    info = stack.top.reserved_memory_info()
                    reserved = int(info.reserved_bytes) if info is not None else current
                total += reserved
            except Exception:  # pragma: no cover - defensive
                logger.debug(
                    "dask-rmm: rmm metrics of device %d failed", stack.device, exc_info=True
                )
        return {"rmm-used": int(used), "rmm-total": int(total)}
