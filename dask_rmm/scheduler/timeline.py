"""The scheduler side of cluster memory reports: ``SchedulerTimelinePlugin`` keeps each worker
device's timeline and the cluster total from the heartbeats and serves reports. Not here: pages,
Prometheus, resolutions, the total, building and rendering (their own modules)."""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from time import time
from typing import TYPE_CHECKING, Any, NamedTuple

import dask.config
import numpy as np
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import heartbeat_interval
from tornado.ioloop import PeriodicCallback

from dask_rmm.scheduler.cluster_total import ClusterTotal
from dask_rmm.scheduler.report_build import ReportRequest, Snapshot
from dask_rmm.scheduler.resolution import SAMPLE_DTYPE, Timeline, compact_all
from dask_rmm.scheduler.validate import MAX_DEVICES, check_metrics, check_samples
from dask_rmm.wire import (
    METRICS_HANDLER,
    METRICS_KEY,
    PLUGIN_NAME,
    REPORT_HANDLER,
    device_entries,
    to_int,
)

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["PLUGIN_NAME", "REPORT_HANDLER", "SchedulerTimelinePlugin", "Timeline"]

logger = logging.getLogger(__name__)

#: Points kept per worker device when neither the argument nor the config sets one (24 bytes a
#: point: 12 KiB a device).
DEFAULT_TIMELINE_LENGTH = 512
#: Resolutions a timeline keeps when neither the argument nor the config sets them.
DEFAULT_TIMELINE_LEVELS = 3
#: How many departed workers stay in reports (marked "gone") before the oldest is forgotten.
DEFAULT_KEEP_GONE = 32
#: Seconds between two passes that take the samples read into the timelines and the cluster's
#: total, below ``SHARE_ABOVE`` workers and from it (a pass costs about a millisecond however
#: few its samples: bench/README.md, issue 45 item 3); sooner once ``FOLD_BYTES`` of them wait.
TOTAL_INTERVAL, LARGE_TOTAL_INTERVAL, FOLD_BYTES = 0.5, 2.0, 1 << 20
#: Worker records a report's snapshot takes (and reads unread heartbeats of) between two
#: returns to the event loop: at 8 devices a worker, 500 held the loop 40 ms and more
#: (bench/README.md, "Scrapes and pages").
SNAPSHOT_CHUNK = 100
#: Seconds every report, page and scrape shares one snapshot of a cluster of at least
#: ``SHARE_ABOVE`` workers (a smaller one's is shared only while no heartbeat came since): the
#: event loop's cost of a route is then the same whatever the scrape rate.
SNAPSHOT_INTERVAL = 1.0
SHARE_ABOVE = 100
#: Seconds between two log lines about the same worker and kind of problem (``validate.py``'s
#: kinds: "format", "bounds", "time", "clock", and "devices" for a device no longer reported).
LOG_INTERVAL = 60.0


@dataclass(eq=False)
class _WorkerRecord:
    """What the plugin keeps per worker: its last dask-rmm metrics, one timeline and one
    cluster-total row per device. A worker back under the same name (a nanny restart,
    ``client.restart()``) continues the record of the one that left."""

    address: str
    name: str
    status: str = "running"
    #: The last heartbeat's metrics as checked (``validate.check_metrics``): valid data only.
    metrics: dict | None = None
    #: The last heartbeat's metrics as the worker sent them (to see that one is new).
    raw: Any = None
    timelines: dict[str, Timeline] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    last_seen: float | None = None
    error: str | None = None
    #: Processes before this one under the same name.
    restarts: int = 0
    #: Per device: the largest ``peak_bytes`` the processes before this one reported.
    earlier_peaks: dict[str, int] = field(default_factory=dict)
    #: When each kind of problem was last logged (one line a kind per ``LOG_INTERVAL``).
    logged: dict[str, float] = field(default_factory=dict)
    #: Devices the worker stopped reporting (out of the cluster total since), by id.
    vanished: set[str] = field(default_factory=set)
    #: Per device: the newest sample time the cluster total counted for this address before
    #: dask-rmm left the worker and came back (a re-registration): the worker sends those again,
    #: the total counts them once (the device's peak so far goes into ``earlier_peaks``).
    counted: dict[str, float] = field(default_factory=dict)


class SchedulerTimelinePlugin(SchedulerPlugin):
    """Keeps every worker's dask-rmm memory samples on the scheduler and serves reports.

    Each heartbeat replaces ``WorkerState.metrics``; the plugin reads the dask-rmm entry of each
    new one in ``add_worker``, ``remove_worker`` and a poll every ``poll_interval`` seconds
    (cheaper than a heartbeat: one identity check per worker). Installed by ``RMMPlugin`` and by
    :func:`dask_rmm.cluster_report`; installing it twice is a no-op. It adds, once per scheduler,
    the ``dask_rmm_report`` handler, the ``/dask-rmm`` pages and a Prometheus collector; all of
    them answer "not installed" once the plugin is unregistered.

    Memory is bounded: ``timeline_length`` points per worker device (the newest at full
    resolution, older ones merged, the peak always kept), ``keep_gone`` departed workers.

    Parameters
    ----------
    timeline_length : int, optional
        Points kept per worker and device; default config
        ``dask-rmm.scheduler.timeline-length`` (512), read on the scheduler.
    keep_gone : int, optional
        Departed workers kept in reports (marked "gone"); older ones are forgotten. Default
        config ``dask-rmm.scheduler.keep-gone`` (32).
    poll_interval : float
        Least seconds between two reads of the workers' metrics (a worker heartbeats every
        0.5 s at the most often, so 0.1 s misses none); the poller waits a tenth of
        distributed's heartbeat interval when that is longer, up to 0.5 s.
    timeline_levels : int, optional
        Resolutions of each timeline; default config ``dask-rmm.scheduler.timeline-levels``.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(
        self,
        timeline_length: int | None = None,
        keep_gone: int | None = None,
        poll_interval: float = 0.1,
        timeline_levels: int | None = None,
    ):
        if timeline_length is not None:
            _check_int("timeline_length", timeline_length, 2)
        if timeline_levels is not None:
            _check_int("timeline_levels", timeline_levels, 1)
        if keep_gone is not None:
            _check_int("keep_gone", keep_gone, 0)
        if not isinstance(poll_interval, (int, float)) or not poll_interval > 0:
            raise ValueError(f"poll_interval must be a positive number, got {poll_interval!r}")
        self.timeline_length = timeline_length
        self.timeline_levels = timeline_levels
        self.keep_gone = keep_gone
        self.poll_interval = poll_interval
        self.scheduler: Scheduler | None = None
        self._records: dict[str, _WorkerRecord] = {}
        # The departed records (also in _records), oldest first: what a worker's arrival and
        # departure look through (at most keep_gone + 1, not every worker).
        self._gone: dict[str, _WorkerRecord] = {}
        # per address: each device's (newest sample time, peak) when dask-rmm left the worker
        self._counted: dict[str, dict[str, tuple[float, int]]] = {}
        self._poller: PeriodicCallback | None = None
        self._collector: Any = None
        # Sized from the options in start (the config is the scheduler's).
        self._total = ClusterTotal(Timeline(DEFAULT_TIMELINE_LENGTH))
        self._total_due = 0.0
        self._full: list[Timeline] = []  # timelines whose newest level is full
        self._arrived: list = []  # (record, samples) a heartbeat read, not yet taken (_fold)
        self._arriving = 0  # their bytes
        self._order: list[str] | None = None  # the workers' addresses the poller reads in turn
        self._cursor = 0
        self._executor: ThreadPoolExecutor | None = None
        # Heartbeats read and workers gone since start (a snapshot is current while unchanged),
        # the snapshot every route shares, the one being taken, and what Prometheus reads of it.
        self._changes = 0
        self._shared: _Shared | None = None
        self._taking: asyncio.Future | None = None
        self._exports: dict[str, Any] = {}  # per export: (its snapshot, the future making it)
        self._made: dict[str, Any] = {}  # per export: the last one made
        self._refreshing: set[asyncio.Future] = set()

    _OPTIONS = ("timeline_length", "keep_gone", "poll_interval", "timeline_levels")

    def __getstate__(self) -> dict:
        # Only the options travel (client/worker -> scheduler); state is built in start.
        return {k: getattr(self, k) for k in self._OPTIONS}

    def __setstate__(self, state: dict) -> None:
        SchedulerTimelinePlugin.__init__(self, **state)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, scheduler: Scheduler) -> None:
        from dask_rmm.scheduler import http

        self.scheduler = scheduler
        self._configure()

        async def dask_rmm_report(**query: Any) -> bytes | None:
            """The registered plugin's report document as UTF-8 JSON (built and encoded off
            the event loop: the reply is then one bytes frame), or None when none is
            registered."""
            plugin = scheduler.plugins.get(PLUGIN_NAME)
            if not isinstance(plugin, SchedulerTimelinePlugin):
                return None
            request = ReportRequest.from_query(query)
            return await plugin.report_async(request, "json-bytes")

        def dask_rmm_metrics(address: Any = None, metrics: Any = None) -> bool:
            """A worker's dask-rmm heartbeat entry, sent at once after a change (a setup, a
            trim, a flush) by :func:`dask_rmm.worker.metrics.send_metrics`: read as its next
            heartbeat would be (the same checks). False when it was not taken."""
            plugin = scheduler.plugins.get(PLUGIN_NAME)
            ws = scheduler.workers.get(address) if isinstance(address, str) else None
            if not isinstance(plugin, SchedulerTimelinePlugin) or ws is None:
                return False
            ws.metrics = {**ws.metrics, METRICS_KEY: metrics}  # a heartbeat replaces it whole
            plugin._ingest(ws)
            return True

        scheduler.handlers.setdefault(REPORT_HANDLER, dask_rmm_report)
        scheduler.handlers.setdefault(METRICS_HANDLER, dask_rmm_metrics)
        http.install_routes(scheduler)
        try:  # on prometheus_client's default registry: what /metrics serves
            from dask_rmm.scheduler.prometheus import REGISTRY, DaskRMMCollector

            self._collector = DaskRMMCollector(self)
            REGISTRY.register(self._collector)
        except ImportError:
            logger.debug("prometheus_client is not installed; no dask_rmm_ metrics")
        self._poller = PeriodicCallback(self._tick, self.poll_interval * 1000)
        self._poller.start()
        self._ingest_all()  # not registered yet: register_scheduler_plugin starts, then adds

    def _configure(self) -> None:
        """Options not given take the scheduler's config (checked: a bad value raises here)."""
        for attr, key, default, least in (
            ("timeline_length", "timeline-length", DEFAULT_TIMELINE_LENGTH, 2),
            ("timeline_levels", "timeline-levels", DEFAULT_TIMELINE_LEVELS, 1),
            ("keep_gone", "keep-gone", DEFAULT_KEEP_GONE, 0),
        ):
            if getattr(self, attr) is None:
                value = dask.config.get(f"dask-rmm.scheduler.{key}", default=default)
                _check_int(f"config dask-rmm.scheduler.{key}", value, least)
                setattr(self, attr, value)
        if not self._records:
            self._total = ClusterTotal(self._new_timeline())

    def _new_timeline(self) -> Timeline:
        return Timeline(self.timeline_length or 2, levels=self.timeline_levels or 1)

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
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False)

    @property
    def active(self) -> bool:
        """Started and still the scheduler's registered plugin (unregistering does not call
        ``close``: the poll stops itself the first time it finds the plugin gone)."""
        s = self.scheduler
        return s is not None and s.plugins.get(self.name) is self

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        self._order = None
        self._changes += 1
        if (ws := scheduler.workers.get(worker)) is not None:
            self._ingest(ws)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        self._order = None
        self._counted.pop(worker, None)
        rec = self._records.get(worker)
        if rec is None or rec.status == "gone":
            return
        rec.status = "gone"
        self._changes += 1
        self._stop_rows(rec)
        self._records[worker] = self._records.pop(worker)  # the newest gone comes last
        self._gone[worker] = rec
        while len(self._gone) > (self.keep_gone or 0):
            address = next(iter(self._gone))
            del self._gone[address]
            self._forget(self._records.pop(address))

    def _stop_rows(self, rec: _WorkerRecord) -> None:
        self._fold()  # the samples read count before the rows stop
        for row in rec.rows.values():
            self._total.stop(row)

    def _forget(self, rec: _WorkerRecord) -> None:
        self._changes += 1
        for row in rec.rows.values():
            self._total.release(row)
        rec.rows.clear()

    # -- ingest -------------------------------------------------------------------------------

    def poll(self, every: bool = True) -> bool:
        """Read each worker's latest heartbeat metrics that this plugin has not seen yet (with
        ``every=False``, as the poller does, only the next share of the workers); False (and
        stop) if the plugin is not registered any more."""
        if not self.active:
            self._stop()
            return False
        self._ingest_all() if every else self._ingest_share()
        self._advance_total_if_due()
        return True

    def _advance_total_if_due(self) -> None:
        now = time()
        if now >= self._total_due or self._arriving > FOLD_BYTES:  # no long block
            self._total_due = now + (LARGE_TOTAL_INTERVAL if self.large else TOTAL_INTERVAL)
            self._compact(now)
            self._total.advance(now)

    def _compact(self, now: float | None = None) -> None:
        """Take the samples read (:meth:`_fold`), then merge the full timelines."""
        self._fold(now)
        full, self._full = self._full, []
        compact_all(full)

    def _tick(self) -> None:
        self.poll(every=False)

    def _ingest_share(self) -> None:
        """Read the next share of the workers, in turn, each twice a heartbeat interval (a
        heartbeat repeats the previous one's samples: none is lost): a read a heartbeat."""
        s = self.scheduler
        if s is None:
            return
        workers = s.workers
        order = self._order
        if order is None or len(order) != len(workers):
            order = self._order = list(workers)
        n = len(order)
        if not n:
            return
        # A tick every tenth of a heartbeat interval, from poll_interval up to TOTAL_INTERVAL.
        interval = heartbeat_interval(n)
        period = max(self.poll_interval, min(interval / 10, TOTAL_INTERVAL))
        if self._poller is not None and self._poller.callback_time != period * 1000:
            self._poller.callback_time = period * 1000
        share = min(n, math.ceil(n * period * 2 / interval))
        start = self._cursor % n
        chosen = order[start : start + share]
        if len(chosen) < share:
            chosen += order[: share - len(chosen)]
        self._cursor = start + share
        self._ingest(*filter(None, map(workers.get, chosen)), fold=False)

    def _ingest_all(self) -> None:
        if self.scheduler is not None:
            self._ingest(*self.scheduler.workers.values())

    def _ingest(self, *workers: WorkerState, fold: bool = True) -> None:
        """Read these workers' heartbeats, and with ``fold`` take every sample read so far."""
        now = time()
        for ws in workers:
            self._read(ws, now)
        if fold:
            self._fold(now)

    def _read(self, ws: WorkerState, now: float) -> None:
        """Take ``ws``'s latest heartbeat metrics if new: checked (``validate.py``), its
        samples queued (``_arrived``) for one check of a batch, taken at once if rows change."""
        m = ws.metrics.get(METRICS_KEY)
        rec = self._records.get(ws.address)
        if m is None:
            # No dask-rmm on this worker (any more): its old numbers must not look current.
            if rec is not None and rec.status == "running":
                self._stop_rows(rec)
                self._counted[ws.address] = {
                    d: (tl.newest, max(tl.peak(), rec.earlier_peaks.get(d, 0)))
                    for d, tl in rec.timelines.items()
                }
                self._forget(self._records.pop(ws.address))
            return
        if rec is None or rec.status == "gone":
            rec = self._running_record(ws)
            self._order = None
        elif m is rec.raw:
            return  # this heartbeat was read already
        rec.raw = m
        self._changes += 1
        checked = check_metrics(m, now, getattr(ws, "last_seen", None))
        rec.error = None
        if checked.metrics is None:
            # Nothing usable: the worker shows its error, and its old numbers stop counting.
            rec.metrics = None
            self._stop_rows(rec)
        else:
            rec.metrics = checked.metrics
            rec.last_seen = checked.metrics["time"]
            devices = set(checked.metrics["devices"])
            if rec.vanished or not rec.rows.keys() <= devices:
                self._fold(now)
                self._vanish(rec, devices, checked.problems)
            if len(rec.timelines) > MAX_DEVICES:  # device ids that change every heartbeat
                self._fold(now)
                self._drop_devices(rec, devices)
            self._arrived.append((rec, checked.samples))
            self._arriving += sum(map(len, checked.samples.values()))
        if checked.problems:
            self._problem(rec, checked.problems, now)

    def _vanish(self, rec: _WorkerRecord, devices: set, problems: list) -> None:
        """Devices the worker no longer reports leave the cluster total at once (their rows
        stop; a device back later counts again), and the report says so."""
        rec.vanished &= rec.rows.keys() - devices
        for dev, row in rec.rows.items():
            if dev not in devices and dev not in rec.vanished:
                self._total.stop(row)
                rec.vanished.add(dev)
        if rec.vanished:
            ids = ", ".join(map(repr, sorted(rec.vanished)))
            problems.append(("devices", f"device {ids} no longer reported: not in the totals"))

    def _fold(self, now: float | None = None) -> None:
        """Add the samples of every heartbeat read (``_arrived``) that are valid and new (one
        check for all of them) to their devices' timelines and the cluster total."""
        pending, self._arrived, self._arriving = self._arrived, [], 0
        if not pending:
            return
        now = time() if now is None else now
        recs = [rec for rec, samples in pending for _ in samples]
        devs = [dev for _, samples in pending for dev in samples]
        blobs = [blob for _, samples in pending for blob in samples.values()]
        tls = list(map(dict.get, [rec.timelines for rec in recs], devs))
        old = [-math.inf if tl is None else tl.newest for tl in tls]
        checked, lasts_checked, problems = check_samples(blobs, now, old)
        rows, news, lasts = [], [], []
        for i, (rec, dev, tl, new) in enumerate(zip(recs, devs, tls, checked, strict=True)):
            if problems and i in problems:
                kind, text = problems[i]
                self._problem(rec, [(kind, f"device {dev!r}: {text}")], now)
            if not new:
                continue
            if tl is None:
                tl = rec.timelines.get(dev)  # the same device twice in the batch
                if tl is None:
                    tl = rec.timelines[dev] = self._new_timeline()
            if tl.newest == old[i]:  # as checked: appended as it is (merged by the poller)
                tl.push(new, lasts_checked[i])
            elif not (new := tl.extend_packed(new)):  # the same device twice in the batch
                continue
            if tl.overflowing:
                self._full.append(tl)
            if rec.counted and (since := rec.counted.get(dev)) is not None:
                t = np.frombuffer(new, SAMPLE_DTYPE)["t"]
                cut = int(np.searchsorted(t, since, side="right"))
                if cut == len(t):  # in the device's timeline again; counted in the total once
                    continue
                new = new[cut * SAMPLE_DTYPE.itemsize :]
                del rec.counted[dev]
            row = rec.rows.get(dev)
            if row is None:
                row = rec.rows[dev] = self._total.add_row()
            rows.append(row)
            news.append(new)
            lasts.append(tl.newest)
        if rows:
            self._total.add(rows, news, lasts)

    def _problem(self, rec: _WorkerRecord, problems: list[tuple[str, str]], now: float) -> None:
        """Show ``problems`` (``(kind, text)``) as the worker's error; log each kind once per
        worker and ``LOG_INTERVAL``, whatever its text (counts and times change every
        heartbeat)."""
        text = "; ".join(t for _, t in problems)
        rec.error = f"dask-rmm metrics: {text}" if rec.error is None else f"{rec.error}; {text}"
        for kind in dict.fromkeys(k for k, _ in problems):
            if now - rec.logged.get(kind, -math.inf) >= LOG_INTERVAL:
                rec.logged[kind] = now
                lines = "; ".join(t for k, t in problems if k == kind)
                logger.warning("dask-rmm: worker %s: %s", rec.address, lines[:2000])

    def _drop_devices(self, rec: _WorkerRecord, keep: set) -> None:
        for dev in [d for d in rec.timelines if d not in keep]:
            del rec.timelines[dev]
            rec.vanished.discard(dev)
            if (row := rec.rows.pop(dev, None)) is not None:
                self._total.release(row)

    def _running_record(self, ws: WorkerState) -> _WorkerRecord:
        """The record of a worker seen for the first time: a new one, or, for a name that
        left before (a nanny restart, ``client.restart()``), the departed one continued, so
        its history and peak stay in the report."""
        name = str(ws.name)
        for address, old in list(self._gone.items()):
            if old.name == name or address == ws.address:
                del self._records[address], self._gone[address]
                for dev, d in device_entries(old.metrics).items():
                    peak = to_int(d.get("peak_bytes"))
                    old.earlier_peaks[dev] = max(old.earlier_peaks.get(dev, 0), peak)
                old.address, old.name, old.status = ws.address, name, "running"
                old.restarts += 1
                old.metrics = old.raw = None
                old.vanished.clear()
                stale = self._gone.pop(ws.address, None)  # another name that left from here
                if stale is not None:
                    self._forget(self._records.pop(ws.address))
                self._records[ws.address] = old
                return old
        rec = self._records[ws.address] = _WorkerRecord(ws.address, name)
        for dev, (newest, peak) in self._counted.pop(ws.address, {}).items():
            rec.counted[dev], rec.earlier_peaks[dev] = newest, peak
        return rec

    # -- queries ------------------------------------------------------------------------------

    def snapshot(self, request: ReportRequest | None = None) -> Snapshot:
        """What a report needs, taken on the event loop in one pass over the workers (cheap:
        references to data replaced, never changed in place); built (:meth:`Snapshot.build`)
        in any thread."""
        if self.scheduler is not None and self.active:
            self.poll()  # heartbeats that arrived since the last tick
        self._compact()
        return self._take(request or ReportRequest(), list(self._records.values()))

    def _take(self, request: ReportRequest, records: list) -> Snapshot:
        s = self.scheduler
        meta = {  # the report's own fields
            "time": time(),
            "scheduler": s.address if s is not None else "",
            "timeline_length": self.timeline_length or 0,
            "workers_without_dask_rmm": tuple(
                a for a, ws in (s.workers.items() if s else ()) if METRICS_KEY not in ws.metrics
            ),
        }
        rows = [Snapshot.record(r) for r in records]
        return Snapshot(request, rows, self._total.snapshot(), meta)

    async def _catch_up(self) -> None:
        """Read every heartbeat not read yet and compact the timelines they filled, as
        :meth:`poll` does, :data:`SNAPSHOT_CHUNK` workers at a time with the event loop free in
        between (all at once blocked the loop half a second at 10,000 workers)."""
        s = self.scheduler
        if s is None or not self.active:
            return
        workers = list(s.workers.values())
        for start in range(0, len(workers), SNAPSHOT_CHUNK):
            if start:
                await asyncio.sleep(0)
                if not self.active:
                    return
            chunk = workers[start : start + SNAPSHOT_CHUNK]
            # Not those removed while the loop was free.
            self._ingest(*(ws for ws in chunk if s.workers.get(ws.address) is ws))
            self._compact()
        self._advance_total_if_due()

    async def snapshot_async(self, request: ReportRequest) -> Snapshot:
        """:meth:`snapshot` for ``request``, from the snapshot every route shares
        (:meth:`_shared_snapshot`)."""
        shared = await self._shared_snapshot()
        return Snapshot(request, shared.records, shared.total, shared.meta)

    async def _shared_snapshot(self) -> _Shared:
        """The snapshot all routes and scrapes share: the last one while no heartbeat came
        since it (or, from ``SHARE_ABOVE`` workers, for ``SNAPSHOT_INTERVAL`` seconds), else a
        new one, taken once for every caller waiting meanwhile."""
        shared = self._shared
        if shared is not None:
            large = self.large
            if large and time() - shared.taken < SNAPSHOT_INTERVAL:
                return shared
            if not large and self.active:
                self._ingest_all()  # a few workers: what came since, read now
            if shared.changes == self._changes:
                return shared
        if self._taking is None or self._taking.done():
            self._taking = asyncio.ensure_future(self._take_shared())
        return await asyncio.shield(self._taking)

    @property
    def large(self) -> bool:
        """At least ``SHARE_ABOVE`` workers: routes share a snapshot for ``SNAPSHOT_INTERVAL``."""
        return len(self._records) >= SHARE_ABOVE

    async def _take_shared(self) -> _Shared:
        """The unread heartbeats read and the records taken :data:`SNAPSHOT_CHUNK` at a time
        with the event loop free in between (each record is taken whole; heartbeats read in
        between are in the records taken after them)."""
        await self._catch_up()
        self._compact()
        records = list(self._records.values())
        rows = []
        for start in range(0, len(records), SNAPSHOT_CHUNK):
            if start:
                await asyncio.sleep(0)
            rows += [Snapshot.record(r) for r in records[start : start + SNAPSHOT_CHUNK]]
        snap = self._take(ReportRequest(), [])
        self._shared = _Shared(time(), self._changes, rows, snap.total, snap.meta)
        return self._shared

    async def exported(self, what: str, build: Any) -> Any:
        """``build(snapshot)`` of the shared snapshot, made in the report thread once per
        snapshot (callers meanwhile wait for the same one) and kept for every scrape of it
        (``what`` names it)."""
        shared = await self._shared_snapshot()
        kept = self._exports.get(what)
        if kept is None or kept[0] is not shared:
            request = ReportRequest(timeline=False)
            snap = Snapshot(request, shared.records, shared.total, shared.meta)
            made = asyncio.ensure_future(self._in_thread(snap.export, build))
            kept = self._exports[what] = (shared, made)
        value = self._made[what] = await asyncio.shield(kept[1])
        return value

    def exported_now(self, what: str, build: Any) -> Any:
        """What :meth:`exported` last made (None: nothing yet); a newer one is made in the
        background when none is being made and the snapshot it came from is not current."""
        kept, shared = self._exports.get(what), self._shared
        if self.active and (
            kept is None
            or (kept[1].done() and (kept[0] is not shared or shared.changes != self._changes))
        ):
            task = asyncio.ensure_future(self.exported(what, build))
            self._refreshing.add(task)  # asyncio keeps only a weak reference
            task.add_done_callback(self._refreshing.discard)
        return self._made.get(what)

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="dask-rmm-report")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def report_async(self, request: ReportRequest, form: str = "report") -> Any:
        """The report for ``request``, built in a thread so that the event loop only takes
        the snapshot (a chunk of records at a time): ``form`` is "report" (a
        ClusterMemoryReport), "json" (the document as JSON text; "json-bytes" encoded,
        "json-pieces" a list of str, one worker a piece) or "html" (the page;
        ``request.refresh`` sets its reload)."""
        snap = await self.snapshot_async(request)
        return await self._in_thread(snap.render, form)


class _Shared(NamedTuple):
    """The snapshot every route shares: when it was taken, ``_changes`` then, its parts."""

    taken: float
    changes: int
    records: list
    total: Any
    meta: dict


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int of at least {minimum}, got {value!r}")
