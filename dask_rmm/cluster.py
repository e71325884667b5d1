"""The scheduler side of cluster memory reports, and ``cluster_report(client)``.

``SchedulerTimelinePlugin`` reads each worker's ``worker.metrics["dask-rmm"]`` (docs/internals.md)
as its heartbeat arrives, keeps a bounded timeline per worker and device, and serves the report
data (scheduler handler ``dask_rmm_report``, the /dask-rmm page, Prometheus gauges). Rendering is
in ``report.py``; the HTTP pages in ``dashboard.py``; the gauges in ``prometheus.py``.
"""

from __future__ import annotations

import inspect
import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from time import time
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.diagnostics.plugin import SchedulerPlugin

from dask_rmm.report import REPORT_VERSION, ClusterMemoryReport

if TYPE_CHECKING:
    from distributed import Client, Scheduler, Worker

__all__ = [
    "METRICS_KEY",
    "PLUGIN_NAME",
    "REPORT_HANDLER",
    "ClusterMemoryReport",
    "SchedulerTimelinePlugin",
    "Timeline",
    "cluster_report",
    "fetch_report_data",
    "install_scheduler_plugin",
    "iter_reports",
]

logger = logging.getLogger(__name__)

#: The scheduler plugin's name (also the key in ``scheduler.plugins``).
PLUGIN_NAME = "dask-rmm-timeline"
#: The key of the worker metrics this plugin reads (version 1 format, docs/internals.md).
METRICS_KEY = "dask-rmm"
#: Scheduler RPC handler returning the report data.
REPORT_HANDLER = "dask_rmm_report"
#: Timeline length when neither the argument nor the config sets one.
DEFAULT_TIMELINE_LENGTH = 3600
#: How many departed workers stay in reports (marked "gone") before the oldest is forgotten.
DEFAULT_KEEP_GONE = 32


class Timeline:
    """A ring buffer of ``(time, current_bytes, max_bytes_in_interval)`` samples.

    Stored in three ``array`` columns (24 bytes a sample, no Python object per sample), so
    64 workers x 3600 samples cost about 5.5 MB on the scheduler.

    Parameters
    ----------
    capacity : int
        The most samples kept; older ones are overwritten.
    """

    __slots__ = ("capacity", "_t", "_cur", "_max", "_head")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"Timeline capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._t = array("d")
        self._cur = array("q")
        self._max = array("q")
        self._head = 0  # oldest sample (next to overwrite) once full

    def __len__(self) -> int:
        return len(self._t)

    def extend(self, samples: Sequence[Sequence[float]]) -> None:
        """Append samples (oldest first), dropping the oldest kept ones beyond ``capacity``.

        A malformed sample raises (IndexError, TypeError, OverflowError) before anything changes.
        """
        ts = array("d", [s[0] for s in samples])
        cs = array("q", [s[1] for s in samples])
        ms = array("q", [s[2] for s in samples])
        cap = self.capacity
        if len(ts) >= cap:
            self._t, self._cur, self._max, self._head = ts[-cap:], cs[-cap:], ms[-cap:], 0
            return
        room = cap - len(self._t)
        if room:
            self._t.extend(ts[:room])
            self._cur.extend(cs[:room])
            self._max.extend(ms[:room])
            if len(ts) <= room:
                return
            ts, cs, ms = ts[room:], cs[room:], ms[room:]
        # Full: overwrite from the head, wrapping around the end.
        h, k = self._head, len(ts)
        first = min(k, cap - h)
        self._t[h : h + first] = ts[:first]
        self._cur[h : h + first] = cs[:first]
        self._max[h : h + first] = ms[:first]
        if k > first:
            rest = k - first
            self._t[:rest] = ts[first:]
            self._cur[:rest] = cs[first:]
            self._max[:rest] = ms[first:]
        self._head = (h + k) % cap

    def to_list(self, last: int | None = None) -> list[list[float | int]]:
        """The samples oldest first as ``[time, current_bytes, max_bytes_in_interval]`` lists.

        Parameters
        ----------
        last : int, optional
            Only the newest ``last`` samples.
        """
        h = self._head
        cols = []
        for col in (self._t, self._cur, self._max):
            values = col.tolist()
            if h:
                values = values[h:] + values[:h]
            if last is not None:
                values = values[-last:] if last > 0 else []
            cols.append(values)
        return [list(s) for s in zip(*cols, strict=True)]

    def peak(self) -> int:
        """The largest ``max_bytes_in_interval`` kept (0 when empty)."""
        return int(max(self._max, default=0))


class _WorkerRecord:
    """What the plugin keeps per worker: its last dask-rmm metrics and one timeline per device."""

    __slots__ = ("address", "name", "status", "metrics", "timelines", "last_seen", "left", "error")

    def __init__(self, address: str, name: str):
        self.address = address
        self.name = name
        self.status = "running"
        self.metrics: dict | None = None
        self.timelines: dict[str, Timeline] = {}
        self.last_seen: float | None = None
        self.left: float | None = None
        self.error: str | None = None


class SchedulerTimelinePlugin(SchedulerPlugin):
    """Keeps every worker's dask-rmm memory samples on the scheduler and serves reports.

    Installed automatically by ``RMMPlugin`` (see :func:`install_scheduler_plugin`); installing
    it twice is a no-op. It adds, once per scheduler: a wrapper around the ``heartbeat_worker``
    handler (the cheapest exact per-heartbeat hook: each heartbeat's samples are read once),
    the ``dask_rmm_report`` handler, the ``/dask-rmm`` and ``/dask-rmm/report.json`` pages and a
    Prometheus collector. All of them find the plugin through ``scheduler.plugins`` at call time,
    so unregistering the plugin turns them off and registering it again turns them back on.

    Parameters
    ----------
    timeline_length : int, optional
        Samples kept per worker and device; default config ``dask-rmm.scheduler.timeline-length``
        (3600), read on the scheduler.
    keep_gone : int
        Departed workers kept in reports (marked "gone"); older ones are forgotten.

    Examples
    --------
    >>> client.register_plugin(SchedulerTimelinePlugin(), idempotent=True)  # doctest: +SKIP
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, timeline_length: int | None = None, keep_gone: int = DEFAULT_KEEP_GONE):
        if timeline_length is not None and (
            isinstance(timeline_length, bool)
            or not isinstance(timeline_length, int)
            or timeline_length < 1
        ):
            raise ValueError(
                f"timeline_length must be a positive int or None, got {timeline_length!r}"
            )
        if isinstance(keep_gone, bool) or not isinstance(keep_gone, int) or keep_gone < 0:
            raise ValueError(f"keep_gone must be a non-negative int, got {keep_gone!r}")
        self.timeline_length = timeline_length
        self.keep_gone = keep_gone
        self.scheduler: Scheduler | None = None
        self._records: dict[str, _WorkerRecord] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()

    def __getstate__(self) -> dict:
        # Only the options travel (client/worker -> scheduler); state is built in start.
        return {"timeline_length": self.timeline_length, "keep_gone": self.keep_gone}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        if self.timeline_length is None:
            self.timeline_length = _configured_timeline_length()
        _install_heartbeat_hook(scheduler)
        _install_report_handler(scheduler)
        try:
            from dask_rmm.dashboard import install_routes

            install_routes(scheduler)
        except Exception:
            logger.exception(
                "dask-rmm: could not add the /dask-rmm pages to the scheduler's HTTP server"
            )
        try:
            from dask_rmm.prometheus import register_plugin

            register_plugin(self)
        except ImportError:
            logger.debug("prometheus_client is not installed; no dask_rmm_ gauges")
        except Exception:
            logger.exception("dask-rmm: could not register the Prometheus collector")
        # Workers already connected: their latest heartbeat becomes the first sample batch.
        for address in list(scheduler.workers):
            self.on_heartbeat(address)

    async def close(self) -> None:
        try:
            from dask_rmm.prometheus import unregister_plugin

            unregister_plugin(self)
        except ImportError:
            pass

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        # Scheduler.add_worker runs heartbeat_worker directly (not through the handler).
        self.on_heartbeat(worker)

    def remove_worker(
        self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any
    ) -> None:
        rec = self._records.get(worker)
        if rec is None or rec.status == "gone":
            return
        rec.status = "gone"
        rec.left = time()
        self._gone[worker] = None
        while len(self._gone) > self.keep_gone:
            old, _ = self._gone.popitem(last=False)
            if self._records.get(old) is not None and self._records[old].status == "gone":
                del self._records[old]

    # -- ingest (runs on every heartbeat: keep it cheap) --------------------------------------

    def on_heartbeat(self, address: str | None) -> None:
        """Take the samples of ``address``'s latest heartbeat (at most once per heartbeat)."""
        scheduler = self.scheduler
        if scheduler is None or address is None:
            return
        ws = scheduler.workers.get(address)
        if ws is None:
            try:
                ws = scheduler.workers.get(scheduler.coerce_address(address))
            except Exception:
                return
            if ws is None:
                return
        m = ws.metrics.get(METRICS_KEY)
        if m is None:
            return
        rec = self._records.get(ws.address)
        if rec is None or rec.status == "gone":
            rec = self._records[ws.address] = _WorkerRecord(ws.address, str(ws.name))
            self._gone.pop(ws.address, None)
        elif m is rec.metrics:
            return  # the same heartbeat seen twice (start + add_worker, say)
        try:
            rec.metrics = m
            rec.last_seen = m.get("time") or time()
            rec.error = None
            timelines = rec.timelines
            for dev, d in m["devices"].items():
                samples = d.get("samples")
                if samples:
                    tl = timelines.get(dev)
                    if tl is None:
                        tl = timelines[dev] = Timeline(
                            self.timeline_length or DEFAULT_TIMELINE_LENGTH
                        )
                    tl.extend(samples)
        except Exception as e:
            # A malformed metrics dict must never break the scheduler's heartbeat handling.
            if rec.error is None:
                logger.warning("dask-rmm: malformed metrics from %s: %r", ws.address, e)
            rec.error = f"malformed dask-rmm metrics: {e!r}"

    # -- queries ------------------------------------------------------------------------------

    def running_devices(self) -> Iterable[tuple[_WorkerRecord, str, dict]]:
        """``(record, device id, device metrics)`` for each running worker's devices."""
        for rec in list(self._records.values()):
            if rec.status != "running" or not rec.metrics:
                continue
            devices = rec.metrics.get("devices")
            if isinstance(devices, dict):
                for dev, d in devices.items():
                    if isinstance(d, dict):
                        yield rec, str(dev), d

    def report_data(self, timeline: bool = True, last: int | None = None) -> dict[str, Any]:
        """The report in the ``ClusterMemoryReport.to_dict()`` format.

        Parameters
        ----------
        timeline : bool
            Include each device's timeline.
        last : int, optional
            Only the newest ``last`` samples of each timeline.
        """
        scheduler = self.scheduler
        workers = []
        for rec in list(self._records.values()):
            devices: dict[str, dict] = {}
            raw = (rec.metrics or {}).get("devices")
            for dev, d in raw.items() if isinstance(raw, dict) else ():
                if not isinstance(d, dict):
                    continue
                entry = {k: v for k, v in d.items() if k != "samples"}
                if timeline:
                    tl = rec.timelines.get(dev)
                    entry["timeline"] = tl.to_list(last) if tl is not None else []
                devices[str(dev)] = entry
            workers.append(
                {
                    "address": rec.address,
                    "name": rec.name,
                    "status": rec.status,
                    "last_seen": rec.last_seen,
                    "left": rec.left,
                    "error": rec.error,
                    "devices": devices,
                }
            )
        without = []
        if scheduler is not None:
            without = [a for a, ws in scheduler.workers.items() if METRICS_KEY not in ws.metrics]
        return {
            "version": REPORT_VERSION,
            "time": time(),
            "scheduler": scheduler.address if scheduler is not None else "",
            "timeline_length": self.timeline_length,
            "workers": workers,
            "workers_without_dask_rmm": without,
        }


def _configured_timeline_length() -> int:
    try:
        import dask_rmm.config  # noqa: F401  (registers the dask-rmm defaults, when it exists)
    except ImportError:
        pass
    value = dask.config.get("dask-rmm.scheduler.timeline-length", default=DEFAULT_TIMELINE_LENGTH)
    try:
        value = int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"config dask-rmm.scheduler.timeline-length must be a positive integer, got {value!r}"
        ) from None
    if value < 1:
        raise ValueError(
            f"config dask-rmm.scheduler.timeline-length must be at least 1, got {value}"
        )
    return value


def _current_plugin(scheduler: Scheduler) -> SchedulerTimelinePlugin | None:
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    return plugin if isinstance(plugin, SchedulerTimelinePlugin) else None


def _install_heartbeat_hook(scheduler: Scheduler) -> None:
    """Wrap the scheduler's ``heartbeat_worker`` handler once; the wrapper then feeds whichever
    SchedulerTimelinePlugin is registered (none: it only costs a dict lookup)."""
    original = scheduler.handlers.get("heartbeat_worker")
    if original is None or getattr(original, "_dask_rmm_original", None) is not None:
        return
    plugins = scheduler.plugins

    if inspect.iscoroutinefunction(original):

        async def heartbeat_worker(**kwargs: Any) -> Any:
            result = await original(**kwargs)
            plugin = plugins.get(PLUGIN_NAME)
            if plugin is not None:
                plugin.on_heartbeat(kwargs.get("address"))
            return result

    else:

        def heartbeat_worker(**kwargs: Any) -> Any:  # type: ignore[misc]
            result = original(**kwargs)
            plugin = plugins.get(PLUGIN_NAME)
            if plugin is not None:
                plugin.on_heartbeat(kwargs.get("address"))
            return result

    heartbeat_worker._dask_rmm_original = original  # type: ignore[attr-defined]
    scheduler.handlers["heartbeat_worker"] = heartbeat_worker


def _install_report_handler(scheduler: Scheduler) -> None:
    if REPORT_HANDLER in scheduler.handlers:
        return

    def dask_rmm_report(timeline: bool = True, last: int | None = None) -> dict | None:
        plugin = _current_plugin(scheduler)
        return None if plugin is None else plugin.report_data(timeline=timeline, last=last)

    scheduler.handlers[REPORT_HANDLER] = dask_rmm_report


# -- installation ------------------------------------------------------------------------------


def install_scheduler_plugin(target: Client | Worker | Scheduler, **options: Any):
    """Install :class:`SchedulerTimelinePlugin` on the scheduler, unless one is there already.

    ``RMMPlugin.setup`` calls this with its worker, so users never need to; it is safe to call
    from every worker and as often as you like (the scheduler keeps the first plugin).

    Parameters
    ----------
    target : Client, Worker or Scheduler
        Where to install from.
    **options
        ``SchedulerTimelinePlugin`` arguments (``timeline_length``, ``keep_gone``).

    Returns
    -------
    None for a synchronous Client; an awaitable for a Worker, a Scheduler or an asynchronous
    Client.

    Examples
    --------
    >>> install_scheduler_plugin(client)  # doctest: +SKIP
    >>> await install_scheduler_plugin(worker)  # in a WorkerPlugin's async setup  # doctest: +SKIP
    """
    from distributed import Client, Scheduler, Worker

    plugin = SchedulerTimelinePlugin(**options)
    if isinstance(target, Client):
        return target.register_plugin(plugin, name=PLUGIN_NAME)
    if isinstance(target, Scheduler):
        return target.register_scheduler_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    if isinstance(target, Worker):
        return _register_over_rpc(target.scheduler, plugin)
    raise TypeError(
        f"install_scheduler_plugin needs a Client, Worker or Scheduler, got {type(target).__name__}"
    )


async def _register_over_rpc(
    scheduler_rpc: Any, plugin: SchedulerTimelinePlugin | None = None
) -> None:
    from distributed.protocol.pickle import dumps

    await scheduler_rpc.register_scheduler_plugin(
        plugin=dumps(plugin or SchedulerTimelinePlugin()), name=PLUGIN_NAME, idempotent=True
    )


def dask_setup(scheduler: Any) -> None:
    """``dask scheduler --preload dask_rmm.cluster`` installs the plugin at scheduler start."""
    from distributed import Scheduler

    if isinstance(scheduler, Scheduler):
        scheduler.add_plugin(SchedulerTimelinePlugin(), name=PLUGIN_NAME, idempotent=True)


# -- fetching reports --------------------------------------------------------------------------


async def fetch_report_data(
    scheduler_rpc: Any, *, timeline: bool = True, last: int | None = None
) -> dict:
    """Ask the scheduler for the report data, installing the scheduler plugin if it is absent.

    Parameters
    ----------
    scheduler_rpc
        ``client.scheduler`` or a ``distributed.core.rpc`` to the scheduler.
    """
    data = await scheduler_rpc.dask_rmm_report(timeline=timeline, last=last)
    if data is None:
        # No handler (plugin never installed) or plugin unregistered: install it; the current
        # heartbeats are read at once, so the snapshot is complete (the timeline starts now).
        await _register_over_rpc(scheduler_rpc)
        data = await scheduler_rpc.dask_rmm_report(timeline=timeline, last=last)
    if not isinstance(data, dict) or "workers" not in data:
        raise RuntimeError(f"the scheduler answered the dask-rmm report request with {data!r}")
    return data


def cluster_report(client: Client | None = None, *, timeline: bool = True, last: int | None = None):
    """The cluster's RMM memory now, per worker and device, with the recent timeline.

    Parameters
    ----------
    client : distributed.Client, optional
        Default: the current default client.
    timeline : bool
        Fetch the per-device sample timelines (needed for plots; skip for a quick table).
    last : int, optional
        Only the newest ``last`` samples of each timeline.

    Returns
    -------
    ClusterMemoryReport
        (or an awaitable of one with an asynchronous client)

    Examples
    --------
    >>> from dask_rmm import RMMPlugin, cluster_report
    >>> client.register_plugin(RMMPlugin(pool_size="4GiB"))  # doctest: +SKIP
    >>> report = cluster_report(client)  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    >>> report.to_frame()  # doctest: +SKIP
    >>> report.plot("cluster-memory.png")  # doctest: +SKIP
    """
    if client is None:
        from distributed import default_client

        client = default_client()

    async def _report() -> ClusterMemoryReport:
        data = await fetch_report_data(client.scheduler, timeline=timeline, last=last)
        return ClusterMemoryReport.from_dict(data)

    return client.sync(_report)


async def iter_reports(
    address: str,
    *,
    interval: float | None = None,
    timeout: float = 5.0,
    timeline: bool = True,
    last: int | None = None,
    security: Any = None,
):
    """Reports fetched from the scheduler at ``address`` without a Client (the CLI's path).

    Parameters
    ----------
    address : str
        Scheduler address (``tcp://host:8786`` or ``host:8786``).
    interval : float, optional
        Yield a new report every ``interval`` seconds until the caller stops; once when None.
    timeout : float
        Seconds to wait for the connection (an ``OSError`` names the address after that).
    timeline, last
        As in :func:`cluster_report`.
    security : distributed.Security, optional
        Default: from the dask config (``distributed.comm.tls``).

    Yields
    ------
    ClusterMemoryReport
    """
    import asyncio

    from distributed import Security
    from distributed.core import rpc

    security = security or Security()
    scheduler = rpc(
        address, timeout=timeout, connection_args=security.get_connection_args("client")
    )
    try:
        while True:
            try:
                data = await asyncio.wait_for(
                    fetch_report_data(scheduler, timeline=timeline, last=last), max(30.0, timeout)
                )
            except (OSError, asyncio.TimeoutError) as e:
                raise OSError(
                    f"could not reach the Dask scheduler at {address} within {timeout:g} s: {e}"
                ) from e
            yield ClusterMemoryReport.from_dict(data)
            if interval is None:
                return
            await asyncio.sleep(interval)
    finally:
        await scheduler.close_rpc()
