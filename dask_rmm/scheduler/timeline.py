"""The scheduler side of cluster memory reports: ``SchedulerTimelinePlugin`` keeps a bounded
timeline per worker device from the ``WorkerState.metrics[wire.METRICS_KEY]`` each heartbeat
brings, and serves the report document. Not here: HTTP pages (``http.py``), Prometheus
(``prometheus.py``), rendering (``dask_rmm.report``), fetching from a client (``dask_rmm.report.fetch``).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import time
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.wire import METRICS_KEY, PLUGIN_NAME, REPORT_HANDLER

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["PLUGIN_NAME", "REPORT_HANDLER", "SchedulerTimelinePlugin", "Timeline"]

logger = logging.getLogger(__name__)

#: Timeline length when neither the argument nor the config sets one.
DEFAULT_TIMELINE_LENGTH = 3600
#: How many departed workers stay in reports (marked "gone") before the oldest is forgotten.
DEFAULT_KEEP_GONE = 32


class Timeline:
    """The newest ``capacity`` samples ``(time, current_bytes, max_bytes_in_interval)``.

    Stored in three ``array`` columns (24 bytes a sample, no Python object per sample), so
    64 workers x 3600 samples cost about 5.5 MB on the scheduler.
    """

    __slots__ = ("capacity", "_columns")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"Timeline capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        # time (float), current_bytes, max_bytes_in_interval (ints): a sample's three values
        # come in as one sequence of numbers, and array() checks each column's type.
        self._columns: tuple[array[Any], array[Any], array[Any]] = (
            array("d"),
            array("q"),
            array("q"),
        )

    def __len__(self) -> int:
        return len(self._columns[0])

    def extend(self, samples: Sequence[Sequence[float]]) -> None:
        """Append samples (oldest first) newer than the newest kept one (heartbeats overlap),
        dropping the oldest beyond ``capacity``. A malformed sample raises (IndexError,
        TypeError, OverflowError) before anything changes."""
        times = self._columns[0]
        if times:
            samples = [s for s in samples if s[0] > times[-1]]
        new = [array(col.typecode, [s[i] for s in samples]) for i, col in enumerate(self._columns)]
        for col, values in zip(self._columns, new, strict=True):
            col.extend(values)
            del col[: max(0, len(col) - self.capacity)]

    def to_list(self, last: int | None = None) -> list[list[float | int]]:
        """The samples oldest first as ``[time, current_bytes, max_bytes_in_interval]`` lists
        (only the newest ``last`` ones if given)."""
        start = 0 if last is None else max(len(self) - max(last, 0), 0)
        return [list(s) for s in zip(*(c[start:].tolist() for c in self._columns), strict=True)]

    def peak(self) -> int:
        """The largest ``max_bytes_in_interval`` kept (0 when empty)."""
        return int(max(self._columns[2], default=0))


@dataclass(eq=False)
class _WorkerRecord:
    """What the plugin keeps per worker: its last dask-rmm metrics and one timeline per device."""

    address: str
    name: str
    status: str = "running"
    metrics: dict | None = None
    timelines: dict[str, Timeline] = field(default_factory=dict)
    last_seen: float | None = None
    error: str | None = None


class SchedulerTimelinePlugin(SchedulerPlugin):
    """Keeps every worker's dask-rmm memory samples on the scheduler and serves reports.

    Each heartbeat replaces ``WorkerState.metrics``; the plugin reads the dask-rmm entry of each
    new one in ``add_worker``, ``remove_worker`` and a poll every ``poll_interval`` seconds
    (cheaper than a heartbeat: one identity check per worker). Installed by ``RMMPlugin`` and by
    :func:`dask_rmm.cluster_report`; installing it twice is a no-op. It adds, once per scheduler,
    the ``dask_rmm_report`` handler, the ``/dask-rmm`` pages and a Prometheus collector; all of
    them answer "not installed" once the plugin is unregistered.

    Parameters
    ----------
    timeline_length : int, optional
        Samples kept per worker and device; default config ``dask-rmm.scheduler.timeline-length``
        (3600), read on the scheduler.
    keep_gone : int
        Departed workers kept in reports (marked "gone"); older ones are forgotten.
    poll_interval : float
        Seconds between two reads of the workers' metrics (a worker heartbeats every 0.5 s at
        the most often, so 0.1 s misses none).
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(
        self,
        timeline_length: int | None = None,
        keep_gone: int = DEFAULT_KEEP_GONE,
        poll_interval: float = 0.1,
    ):
        if timeline_length is not None:
            _check_int("timeline_length", timeline_length, 1)
        _check_int("keep_gone", keep_gone, 0)
        if not isinstance(poll_interval, (int, float)) or not poll_interval > 0:
            raise ValueError(f"poll_interval must be a positive number, got {poll_interval!r}")
        self.timeline_length = timeline_length
        self.keep_gone = keep_gone
        self.poll_interval = poll_interval
        self.scheduler: Scheduler | None = None
        self._records: dict[str, _WorkerRecord] = {}
        self._poller: PeriodicCallback | None = None
        self._collector: Any = None

    def __getstate__(self) -> dict:
        # Only the options travel (client/worker -> scheduler); state is built in start.
        return {k: getattr(self, k) for k in ("timeline_length", "keep_gone", "poll_interval")}

    def __setstate__(self, state: dict) -> None:
        SchedulerTimelinePlugin.__init__(self, **state)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, scheduler: Scheduler) -> None:
        from dask_rmm.scheduler import http

        self.scheduler = scheduler
        if self.timeline_length is None:
            key = "dask-rmm.scheduler.timeline-length"
            value = dask.config.get(key, default=DEFAULT_TIMELINE_LENGTH)
            _check_int(f"config {key}", value, 1)
            self.timeline_length = value

        def dask_rmm_report(timeline: bool = True, last: int | None = None) -> dict | None:
            """The registered plugin's report document, or None when none is registered."""
            plugin = scheduler.plugins.get(PLUGIN_NAME)
            if not isinstance(plugin, SchedulerTimelinePlugin):
                return None
            return plugin.report_data(timeline=timeline, last=last)

        scheduler.handlers.setdefault(REPORT_HANDLER, dask_rmm_report)
        http.install_routes(scheduler)
        try:  # on prometheus_client's default registry: what /metrics serves
            from dask_rmm.scheduler.prometheus import REGISTRY, DaskRMMCollector

            self._collector = DaskRMMCollector(self)
            REGISTRY.register(self._collector)
        except ImportError:
            logger.debug("prometheus_client is not installed; no dask_rmm_ metrics")
        self._poller = PeriodicCallback(self._poll_tick, self.poll_interval * 1000)
        self._poller.start()
        self._ingest_all()  # not registered yet: register_scheduler_plugin starts, then adds

    async def close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.stop()
        collector, self._collector = self._collector, None
        if collector is not None:
            from dask_rmm.scheduler.prometheus import REGISTRY

            REGISTRY.unregister(collector)

    @property
    def active(self) -> bool:
        """Started and still the scheduler's registered plugin (unregistering does not call
        ``close``: the poll stops itself the first time it finds the plugin gone)."""
        s = self.scheduler
        return s is not None and s.plugins.get(self.name) is self

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is not None:
            self._ingest(ws)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        rec = self._records.get(worker)
        if rec is None or rec.status == "gone":
            return
        rec.status = "gone"
        self._records[worker] = self._records.pop(worker)  # the newest gone comes last
        gone = [a for a, r in self._records.items() if r.status == "gone"]
        for address in gone[: max(0, len(gone) - self.keep_gone)]:
            del self._records[address]

    # -- ingest -------------------------------------------------------------------------------

    def poll(self) -> bool:
        """Read each worker's latest heartbeat metrics that this plugin has not seen yet;
        False (and stop) if the plugin is not registered any more."""
        if not self.active:
            self._stop()
            return False
        self._ingest_all()
        return True

    def _poll_tick(self) -> None:
        self.poll()

    def _ingest_all(self) -> None:
        assert self.scheduler is not None  # set in start, before the first poll
        for ws in list(self.scheduler.workers.values()):
            self._ingest(ws)

    def _ingest(self, ws: WorkerState) -> None:
        m = ws.metrics.get(METRICS_KEY)
        rec = self._records.get(ws.address)
        if m is None:
            # No dask-rmm on this worker (any more): its old numbers must not look current.
            if rec is not None and rec.status == "running":
                del self._records[ws.address]
            return
        if rec is None or rec.status == "gone":
            # A worker back under its name (a nanny restart, ``client.restart()``) continues
            # the departed one: the report keeps one row per name.
            name = str(ws.name)
            for address, old in list(self._records.items()):
                if old.status == "gone" and (old.name == name or address == ws.address):
                    del self._records[address]
            rec = self._records[ws.address] = _WorkerRecord(ws.address, name)
        elif m is rec.metrics:
            return  # this heartbeat was read already
        rec.metrics = m
        try:
            rec.last_seen = float(m.get("time") or time())
            rec.error = None
            for dev, d in m["devices"].items():
                samples = d.get("samples")
                if samples:
                    tl = rec.timelines.get(dev)
                    if tl is None:
                        tl = rec.timelines[dev] = Timeline(self.timeline_length or 1)
                    tl.extend(samples)
        except Exception as e:
            # A malformed metrics dict must never break the scheduler.
            if rec.error is None:
                logger.warning("dask-rmm: malformed metrics from %s: %r", ws.address, e)
            rec.error = f"malformed dask-rmm metrics: {e!r}"

    # -- queries ------------------------------------------------------------------------------

    def report_data(self, timeline: bool = True, last: int | None = None) -> dict[str, Any]:
        """The report document (``ClusterMemoryReport.to_dict()``, served as report.json), with
        each device's timeline (its newest ``last`` samples) if ``timeline``."""
        return self.memory_report(timeline, last).to_dict(timeline=timeline)

    def memory_report(self, timeline: bool = True, last: int | None = None) -> ClusterMemoryReport:
        """The cluster's memory report as a :class:`~dask_rmm.report.ClusterMemoryReport` (what
        :meth:`report_data` serializes; the web page and the Prometheus collector read it as is),
        with each device's timeline (its newest ``last`` samples) if ``timeline``."""
        self.poll()  # heartbeats that arrived since the last tick
        workers = []
        for rec in list(self._records.values()):
            raw = (rec.metrics or {}).get("devices")
            devices = {}
            for dev, d in raw.items() if isinstance(raw, dict) else ():
                tl = rec.timelines.get(dev) if timeline else None
                if isinstance(d, dict):
                    devices[str(dev)] = dict(d, timeline=tl.to_list(last) if tl else [])
            fields = ("address", "name", "status", "last_seen", "error")
            workers.append({**{k: getattr(rec, k) for k in fields}, "devices": devices})
        s = self.scheduler
        data = {
            "time": time(),
            "scheduler": s.address if s is not None else "",
            "timeline_length": self.timeline_length,
            "workers": workers,
            "workers_without_dask_rmm": [
                a for a, ws in (s.workers.items() if s else ()) if METRICS_KEY not in ws.metrics
            ],
        }
        return ClusterMemoryReport.from_dict(data)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r}")
