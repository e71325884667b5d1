"""ClusterMemoryReport: one snapshot of every worker's RMM memory, and its renderings (text,
HTML, JSON, DataFrame, plot). Pure data: fetching it is ``dask_rmm.client.fetch``'s; no CUDA.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
import time as _time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dask.utils import natural_sort_key

from dask_rmm.plotting.svg import breakdown_svg, timeline_svg
from dask_rmm.sizes import format_bytes
from dask_rmm.wire import (
    COUNTERS,
    NOT_MEASURED_WITHOUT_A_POOL,
    REPORT_VERSION,
    DeviceSample,
    to_int,
    unmeasured_fields,
)

__all__ = [
    "ClusterMemoryReport",
    "ClusterTotals",
    "DeviceMemory",
    "peak_of_sum",
    "strict_json",
    "summed_series",
    "visible",
]


@dataclass(frozen=True)
class DeviceMemory(DeviceSample):
    """One worker device's memory, as its last heartbeat reported it (the :class:`DeviceSample`
    fields), with the worker and ``timeline``: ``(time, current_bytes, max_bytes_in_interval)``
    points, oldest first. ``peak_bytes`` and the unmeasured fields (None): docs/reports.md."""

    worker: str = ""
    device: str = "0"
    name: str = ""
    status: str = "running"
    timeline: tuple[tuple[float, int, int], ...] = ()
    last_seen: float | None = None
    restarts: int = 0

    def __post_init__(self) -> None:
        for name in (*self.unmeasured, "task_groups") if self.unmeasured else ():
            object.__setattr__(self, name, None)

    def with_peak(self, peak_bytes: int) -> DeviceMemory:
        """This entry with ``peak_bytes`` replaced."""
        return dataclasses.replace(self, peak_bytes=peak_bytes)

    @property
    def timeline_peak(self) -> int:
        """The largest ``max_bytes_in_interval`` in the timeline (0 without samples)."""
        return max((s[2] for s in self.timeline), default=0)

    @property
    def gpu(self) -> str:
        """The physical device: name and the start of its UUID (``"host"`` on host memory)."""
        uuid = self.gpu_uuid[:12] if self.gpu_uuid else self.pci_bus_id
        return f"{self.gpu_name} {uuid}".strip()

    @property
    def label(self) -> str:
        """``host:port (name)/dev0`` for legends, with ``(gone)`` for departed workers."""
        return _device_label(self)

    def to_dict(self, timeline: bool = True) -> dict[str, Any]:
        """This device's entry in the report document (the wire fields plus ``timeline``)."""
        out = super().to_dict()
        if self.unmeasured:
            out["task_groups"] = None
        if timeline:
            out["timeline"] = [list(s) for s in self.timeline]
        return out

    @classmethod
    def from_worker(
        cls, worker: Mapping[str, Any], device: str, d: Mapping[str, Any], timeline: Any = None
    ) -> DeviceMemory:
        """One device of a report document's ``worker`` entry (``timeline`` None: ``d``'s)."""
        return cls.from_dict(
            d,
            worker=str(worker.get("address", "")),
            device=str(device),
            name=str(worker.get("name", "")),
            status=str(worker.get("status", "running")),
            timeline=_points(d.get("timeline")) if timeline is None else timeline,
            last_seen=worker.get("last_seen"),
            restarts=to_int(worker.get("restarts")),
        )


def _points(points: Any) -> tuple[tuple[float, int, int], ...]:
    """``(time, current_bytes, max_bytes_in_interval)`` points of a document (malformed ones
    left out)."""
    out = []
    for p in points or ():
        try:
            out.append((float(p[0]), to_int(p[1]), to_int(p[2])))
        except (IndexError, TypeError, ValueError):
            continue
    return tuple(out)


@dataclass(frozen=True)
class ClusterTotals:
    """Sums over the running workers' devices; ``largest_free_block`` is the largest anywhere.
    ``peak_bytes`` is the peak of the summed timelines (None without them), not
    ``sum_of_device_peaks`` (docs/reports.md, What "peak" covers)."""

    workers: int
    gone_workers: int
    devices: int
    current_bytes: int
    peak_bytes: int | None
    sum_of_device_peaks: int
    total_bytes: int
    reserved_bytes: int
    retired_bytes: int
    pool_free_bytes: int
    largest_free_block: int
    failed_allocations: int
    # memory pressure (dask_rmm.pressure)
    spilled_bytes: int = 0
    spilled_count: int = 0
    total_spilled_bytes: int = 0
    total_unspilled_bytes: int = 0
    ooms_avoided: int = 0
    oom_count: int = 0
    pauses: int = 0
    paused_devices: int = 0
    #: Running devices with ``statistics=False``, and of those the ones without a pool: the
    #: totals that leave them out read None (:attr:`unmeasured`).
    unmeasured_devices: int = 0
    unmeasured_current_devices: int = 0

    def __post_init__(self) -> None:  # what leaves devices out reads None, as in the JSON
        for name in self.unmeasured:
            object.__setattr__(self, name, None)

    @property
    def unmeasured(self) -> tuple[str, ...]:
        """The totals that leave devices out (``statistics=False``): "n/a"."""
        out: tuple[str, ...] = ()
        if self.unmeasured_devices:
            out += ("peak_bytes", "total_bytes", "sum_of_device_peaks", "failed_allocations")
        if self.unmeasured_current_devices:
            out += NOT_MEASURED_WITHOUT_A_POOL
        return out

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClusterTotals | None:
        """Read the ``totals`` of a report document (None when missing or malformed)."""
        given = [f.name for f in dataclasses.fields(cls) if f.name in d]
        try:
            values = {
                k: None if d[k] is None and k == "peak_bytes" else to_int(d[k]) for k in given
            }
            return cls(**{"peak_bytes": None} | values)
        except (TypeError, AttributeError):
            return None

    @classmethod
    def over(
        cls, devices: Iterable[tuple[str, bool, Mapping[str, Any], int]], peak: int | None
    ) -> ClusterTotals:
        """Totals over ``(worker address, running, fields, row peak)`` per device (``fields``:
        a wire entry or a :class:`DeviceMemory`'s ``vars``), with the cluster's ``peak``: one
        definition for the report and the scheduler's snapshot."""
        devices = list(devices)
        run = [(d, p) for _, running, d, p in devices if running]
        return cls(
            workers=len({a for a, running, _, _ in devices if running}),
            gone_workers=len({a for a, running, _, _ in devices if not running}),
            devices=len(run),
            peak_bytes=peak,
            sum_of_device_peaks=sum(p for _, p in run),
            largest_free_block=max((_int(d.get("largest_free_block")) for d, _ in run), default=0),
            paused_devices=sum(bool(_int(d.get("paused"))) for d, _ in run),
            unmeasured_devices=sum(bool(unmeasured_fields(d.get("measured"))) for d, _ in run),
            unmeasured_current_devices=sum(d.get("measured") == "none" for d, _ in run),
            **{k: sum(_int(d.get(k)) for d, _ in run) for k in SUMMED_FIELDS},
        )


#: Device fields summed into the cluster totals: those of a device the totals have too, but
#: the peak (of the summed timelines) and the largest free block (the largest anywhere).
SUMMED_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ClusterTotals)
    if f.name in DeviceSample.__dataclass_fields__
    and f.name not in ("peak_bytes", "largest_free_block")
)


def peak_of_sum(timelines: Iterable[Sequence[Sequence[float]]]) -> int | None:
    """The largest sum over devices of each device's latest ``max_bytes_in_interval`` sample,
    taken at every sample time after every sample of that time (None when there are none)."""
    summed = summed_series([([(s[0], int(s[2])) for s in tl], False) for tl in timelines])
    return int(max(v for _, v in summed)) if summed else None


def summed_series(
    series: Sequence[tuple[Sequence[tuple[float, int]], bool]],
) -> list[tuple[float, int]]:
    """Several devices' ``(time, bytes)`` series summed at every time any of them has a sample.

    A device counts with its latest value from its first sample on; a device whose worker is
    gone (the ``bool`` of its pair) counts 0 after its last sample, its memory went with it.
    """
    events: list[tuple[float, int, int]] = []
    for i, (points, gone) in enumerate(series):
        events += [(t, i, v) for t, v in points]
        if gone and points:  # 0 just after its last sample, so that the last value shows
            events.append((points[-1][0] + 1e-6, i, 0))
    events.sort()
    latest: dict[int, int] = {}
    total = 0
    out: list[tuple[float, int]] = []
    for t, i, v in events:
        total += v - latest.get(i, 0)
        latest[i] = v
        if out and out[-1][0] == t:
            out.pop()
        out.append((t, total))
    return out


@dataclass(frozen=True)
class ClusterMemoryReport:
    """Every worker's RMM memory at one moment, with the recent timeline (docs/reports.md).

    Made by :func:`dask_rmm.cluster_report` (or from a ``to_dict()`` with :meth:`from_dict`).
    ``print(report)`` shows a table; Jupyter shows the HTML; :meth:`to_frame`, :meth:`to_json`
    and :meth:`plot` export it.
    """

    devices: tuple[DeviceMemory, ...] = ()
    time: float = field(default_factory=_time.time)
    scheduler: str = ""
    timeline_length: int = 0
    workers_without_dask_rmm: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()
    #: Totals over every device of the cluster (the scheduler's, when ``devices`` is a
    #: selection); None: computed from ``devices``.
    cluster_totals: ClusterTotals | None = None
    #: The cluster's summed timeline ``(time, current_bytes, max_bytes_in_interval)``.
    total_timeline: tuple[tuple[float, int, int], ...] = ()
    #: Which devices the report shows when not all ("" when all).
    selection: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterMemoryReport:
        """Build a report from the scheduler's report data (the ``to_dict()`` format)."""
        if (version := data.get("version", REPORT_VERSION)) != REPORT_VERSION:
            raise ValueError(
                f"cluster report format version {version!r} is not supported "
                f"(this dask-rmm reads version {REPORT_VERSION}); "
                "use the same dask-rmm version on the scheduler and the client"
            )
        devices = []
        errors = [str(e) for e in data.get("errors") or ()]
        for worker in data.get("workers") or ():
            if worker.get("error"):
                errors.append(f"{worker.get('address')}: {worker['error']}")
            for dev, d in sorted((worker.get("devices") or {}).items()):
                devices.append(DeviceMemory.from_worker(worker, dev, d))
        if not data.get("selection"):
            devices.sort(
                key=lambda d: (d.status != "running", natural_sort_key(d.worker), d.device)
            )
        # The scheduler's totals cover every device, also those a selection leaves out.
        totals = data.get("totals") if data.get("totals_cover") == "cluster" else None
        return cls(
            cluster_totals=ClusterTotals.from_dict(totals) if isinstance(totals, dict) else None,
            total_timeline=_points(data.get("total_timeline")),
            selection=str(data.get("selection") or ""),
            devices=tuple(devices),
            time=float(data.get("time") or _time.time()),
            scheduler=str(data.get("scheduler", "")),
            timeline_length=to_int(data.get("timeline_length", 0)),
            workers_without_dask_rmm=tuple(data.get("workers_without_dask_rmm") or ()),
            errors=tuple(errors),
        )

    @property
    def workers(self) -> list[str]:
        """Worker addresses in the report (running first, then gone)."""
        return list(dict.fromkeys(d.worker for d in self.devices))

    @property
    def running(self) -> list[DeviceMemory]:
        return [d for d in self.devices if d.status == "running"]

    @property
    def gone(self) -> list[DeviceMemory]:
        return [d for d in self.devices if d.status != "running"]

    def device(self, worker: str, device: int | str = 0) -> DeviceMemory:
        """The entry for one worker (address or name) and device id."""
        for d in self.devices:
            if (d.worker == worker or d.name == str(worker)) and d.device == str(device):
                return d
        raise KeyError(f"no dask-rmm data for worker {worker!r} device {device!r} in this report")

    @property
    def totals(self) -> ClusterTotals:
        """Cluster totals over running workers (over the whole cluster, when the report shows
        a selection of its devices)."""
        if self.cluster_totals is not None:
            return self.cluster_totals
        devices = [
            (d.worker, d.status == "running", vars(d), d.peak_bytes or 0) for d in self.devices
        ]
        return ClusterTotals.over(devices, peak_of_sum(d.timeline for d in self.running))

    @property
    def oom_events(self) -> list[dict[str, Any]]:
        """Every OOM snapshot the workers still report (``OOMEvent.to_dict()`` plus
        ``worker`` and ``device``), oldest first: the out-of-memory errors that reached a task,
        with their verdict, "fragmentation" or "demand" (docs/memory-pressure.md)."""
        events = [
            dict(e, worker=d.worker, device=d.device) for d in self.devices for e in d.oom_events
        ]
        return sorted(events, key=lambda e: e.get("time") or 0)

    def task_group_peaks(self) -> dict[str, dict[str, int]]:
        """``{prefix: {worker/device label: peak bytes}}``, prefixes by their largest sum first."""
        out: dict[str, dict[str, int]] = {}
        for d in self.devices:
            for prefix, _current, peak in d.task_groups or ():
                out.setdefault(prefix, {})[d.label] = peak
        return dict(sorted(out.items(), key=lambda kv: -sum(kv[1].values())))

    def to_dict(self, timeline: bool = True) -> dict[str, Any]:
        """The report as plain data (the format :meth:`from_dict` reads and the JSON route serves)."""
        workers: dict[str, dict[str, Any]] = {}
        for d in self.devices:
            keys = dict(name=d.name, status=d.status, last_seen=d.last_seen, restarts=d.restarts)
            w = workers.setdefault(d.worker, {"address": d.worker, **keys, "devices": {}})
            w["devices"][d.device] = d.to_dict(timeline=timeline)
        return {
            "version": REPORT_VERSION,
            "time": self.time,
            "scheduler": self.scheduler,
            "timeline_length": self.timeline_length,
            "workers": list(workers.values()),
            "workers_without_dask_rmm": list(self.workers_without_dask_rmm),
            "errors": list(self.errors),
            "totals": self.totals.to_dict(),
            "totals_cover": "devices" if self.cluster_totals is None else "cluster",
            "total_timeline": [list(p) for p in self.total_timeline],
            "selection": self.selection,
            "oom_events": self.oom_events,
        }

    def to_json(self, timeline: bool = True, **kwargs: Any) -> str:
        """:meth:`to_dict` as strict JSON (a number that is not finite, which strict parsers
        reject, is written as null; ``kwargs`` go to :func:`json.dumps`)."""
        return strict_json(self.to_dict(timeline=timeline), **kwargs)

    def to_frame(self):
        """One row per worker device as a :class:`pandas.DataFrame` (needs pandas): the wire's
        counters (None where not measured) and fields, then the breakdown (docs/reports.md)."""
        pd = require_pandas("ClusterMemoryReport.to_frame")
        libraries = sorted({x.library for d in self.devices for x in d.libraries})
        shares = [f"{lib}_{kind}_bytes" for lib in libraries for kind in ("in_use", "cache_free")]
        columns = [*_FRAME_COLUMNS, "direct_bytes", "outside_dask_rmm_bytes"]
        rows = []
        for d in self.devices:
            row = dict.fromkeys(shares, 0) | {k: getattr(d, k) for k in columns}
            for x in d.libraries:
                row[f"{x.library}_in_use_bytes"] = x.in_use_bytes
                row[f"{x.library}_cache_free_bytes"] = x.cached_bytes
            rows.append(row)
        return pd.DataFrame(rows, columns=columns + shares)

    def plot(self, path: str | None = None, *, top_task_groups: int = 10):
        """A matplotlib Figure (Agg backend, no display needed) of memory over time per worker
        device and of the ``top_task_groups`` task groups' peaks; a PNG written to ``path``."""
        from dask_rmm.report.plot import plot_report

        return plot_report(self, path, top_task_groups=top_task_groups)

    def table_rows(self) -> list[list[str]]:
        """The text table's rows, header first (used by ``__str__`` and the CLI)."""

        def memory(x: Any, peak: str, unmeasured: Sequence[str] = ()) -> list[str]:
            # a device, or the totals; "n/a" for what statistics=False does not measure
            def size(name: str) -> str:
                return "n/a" if name in unmeasured else format_bytes(getattr(x, name))

            retired = f" +{format_bytes(x.retired_bytes)} retired" if x.retired_bytes else ""
            current, total, free, largest = map(
                size, ("current_bytes", "total_bytes", "pool_free_bytes", "largest_free_block")
            )
            if getattr(x, "measured", "") == "pool":
                current += " ~"  # derived: the pool's reserved minus its free bytes
            return [current, peak, total, size("reserved_bytes") + retired, free, largest]

        rows = [list(_HEADER)]
        for d in self.devices:
            restarts = f" ({d.restarts} restart{'s' if d.restarts != 1 else ''})"
            status = d.status + (restarts if d.restarts else "")
            off = d.unmeasured
            rows.append(
                [_worker_label(d), f"{d.device} {d.gpu}".strip(), status]
                + memory(d, "n/a" if off else format_bytes(d.peak_bytes), off)
                + [
                    "-" if d.fragmentation is None else f"{d.fragmentation:.0%}",
                    "n/a" if off else str(d.failed_allocations),
                    "n/a (statistics off)" if off else _top_groups(d),
                ]
            )
        t = self.totals
        peak = "-" if t.peak_bytes is None else format_bytes(t.peak_bytes) + " *"
        if "peak_bytes" in t.unmeasured:
            peak = "n/a"
        workers = f"total ({t.workers} worker{'s' if t.workers != 1 else ''})"
        gone = f"{t.gone_workers} gone" if t.gone_workers else ""
        failures = "n/a" if "failed_allocations" in t.unmeasured else str(t.failed_allocations)
        rows.append(
            [workers, str(t.devices), gone] + memory(t, peak, t.unmeasured) + ["", failures, ""]
        )
        return rows

    def __str__(self) -> str:
        # A worker's name or error is data: a newline or escape sequence in it must neither
        # make a row of its own nor reach the terminal (shown escaped instead).
        rows = [[visible(c) for c in r] for r in self.table_rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
        right = {3, 4, 5, 6, 7, 8, 9, 10}

        def fmt(r: list[str]) -> str:
            cells = [
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        when = _clock(self.time, "%Y-%m-%d %H:%M:%S")
        lines = [f"dask-rmm cluster memory report: {self.scheduler or 'scheduler'} at {when}"]
        if not self.devices and not self.totals.devices:
            lines.append("no dask-rmm workers (register dask_rmm.RMMPlugin on the workers)")
        else:
            if self.selection:
                lines.append(self.selection)
            lines += [fmt(rows[0]), rule, *map(fmt, rows[1:-1]), rule, fmt(rows[-1])]
            lines += self._peak_notes()
        notes = self.cache_lines() + self.breakdown_lines()
        notes += self.pressure_lines() + self.admission_lines() + self._notes()
        return "\n".join(lines[:1] + [visible(x) for x in lines[1:]] + [visible(x) for x in notes])

    def cache_lines(self) -> list[str]:
        """One line per device whose memory passes through a library cache: how much of what
        it allocated is in arrays and how much the caches hold free, and what its statistics
        and task groups count then (none without caches)."""
        return _titled(
            "library caches (allocated = in arrays + held free in the caches; counts and task "
            "groups are the caches' blocks, charged to the task that drew them):",
            [
                f"{_place(d)}: {format_bytes(d.in_array_bytes)} in arrays, "
                f"{format_bytes(d.library_cached_bytes)} held free in the {d.library_caches} "
                "cache(s)"
                for d in self.devices
                if d.library_caches
            ],
        )

    def breakdown_lines(self) -> list[str]:
        """Where each running device's bytes are (:meth:`DeviceSample.breakdown`): one line per
        device that reports libraries or a device figure; on host memory it says there is no
        device figure (none when no device says anything beyond the table)."""
        lines = []
        for d in self.running:
            if not d.libraries and d.device_total_bytes <= 0:
                continue
            parts = ", ".join(f"{format_bytes(n)} {part}" for part, n in d.breakdown())
            if d.device_total_bytes > 0:
                end = f" = {format_bytes(d.device_used_bytes)} used of the device"
            else:
                end = " (host memory: no device figure)"
            if d.cudf_spilled_bytes or d.cudf_spillable_bytes:
                end += (
                    f"; cuDF: {format_bytes(d.cudf_spilled_bytes)} spilled, "
                    f"{format_bytes(d.cudf_spillable_bytes)} spillable"
                )
            lines.append(f"{_place(d)}: {parts}{end}")
        title = "where the bytes are (libraries in use and cache free, the pool, outside dask-rmm):"
        return _titled(title, lines)

    def _notes(self) -> list[str]:
        """Workers without dask-rmm, devices without statistics, and the errors, one line each."""
        missing = self.workers_without_dask_rmm
        names = f"{len(missing)} worker(s) without dask-rmm (no dask-rmm metrics): "
        lines = [names + ", ".join(sorted(missing))] if missing else []
        lines += [
            f"{_place(d)}: statistics off (statistics=False): "
            + (
                "current is the pool's reserved minus its free bytes (~); "
                if d.measured == "pool"
                else "nothing is measured without a pool; "
            )
            + "peak, allocated, failures and task groups are not measured (n/a)"
            for d in self.devices
            if d.unmeasured
        ]
        lines += [
            f"error on {d.worker} device {d.device}: {d.error}" for d in self.devices if d.error
        ]
        return lines + [f"error: {e}" for e in self.errors]

    def pressure_lines(self) -> list[str]:
        """Memory pressure, one line per device that spilled, paused or ran out of memory,
        then one per OOM event (none when nothing happened)."""
        lines = [
            f"{_place(d)}: {format_bytes(d.spilled_bytes)} spilled now "
            f"({d.spilled_count}), {format_bytes(d.total_spilled_bytes)} spilled and "
            f"{format_bytes(d.total_unspilled_bytes)} back in "
            f"{d.spill_seconds + d.unspill_seconds:.2f} s, {d.ooms_avoided} OOMs avoided, "
            f"{d.oom_count} OOMs, {d.pauses} pauses{' (paused)' if d.paused else ''}, limit "
            + (format_bytes(d.device_memory_limit) if d.device_memory_limit else "none")
            for d in self.devices
            if d.total_spilled_count or d.pauses or d.oom_count or d.ooms_avoided
        ]
        lines += [
            f"OOM {_clock(e.get('time') or 0, '%H:%M:%S')} {e.get('worker')}/dev{e.get('device')} "
            f"task {e.get('task_key') or '(none)'}: {e.get('verdict')}, requested "
            f"{format_bytes(to_int(e.get('requested')))}, free "
            f"{format_bytes(e.get('free_bytes'))}, largest free block "
            f"{format_bytes(e.get('largest_free_block'))}"
            for e in self.oom_events
        ]
        return _titled("memory pressure:", lines)

    def admission_lines(self) -> list[str]:
        """Memory admission, one line per worker that has held tasks back or learned a peak:
        tasks held back now, since setup, their waits, the largest expected peaks (none
        without admission)."""
        lines = []
        for d in self.devices:
            if d.admission_total_held or d.admission_expected_peaks:
                peaks = ", ".join(
                    f"{p} {format_bytes(n)} ({k})" for p, n, k in d.admission_expected_peaks[:5]
                )
                lines.append(
                    f"{_worker_label(d)}: {d.admission_held_tasks} held back now, "
                    f"{d.admission_total_held} waited in all for {d.admission_wait_seconds:.2f} s "
                    f"(longest {d.admission_longest_wait_seconds:.2f} s), {d.task_retries} tasks "
                    f"run again after OOM; expected peaks (tasks seen): {peaks or 'none yet'}"
                )
        return _titled("memory admission:", lines)

    def __repr__(self) -> str:
        t = self.totals
        return (
            f"<ClusterMemoryReport: {t.workers} workers ({t.gone_workers} gone), {t.devices} devices, "
            f"{_bytes(t.current_bytes)} used, {_bytes(t.reserved_bytes)} reserved>"
        )

    def to_html(
        self,
        *,
        timeline: bool = True,
        full_page: bool = False,
        refresh: int | None = None,
        nav: str = "",
        json_href: str | None = None,
    ) -> str:
        """The report as HTML: the table, then (``timeline``) the timeline as inline SVG.

        ``full_page``: a standalone document (the dashboard page) rather than a fragment, reloading
        every ``refresh`` seconds, with the ``nav`` HTML above the report and a link to the same
        report as JSON at ``json_href`` (None: a page saved elsewhere names the command instead).
        """
        esc = html.escape
        rows = self.table_rows()
        body = ""
        for d, r in zip(self.devices, rows[1:-1], strict=True):
            tip = f'title="{esc(d.worker)} &middot; {esc(d.resource)}"'
            body += _tr("td", r, f' class="{"gone" if d.status != "running" else ""}" {tip}')
        when = _clock(self.time, "%Y-%m-%d %H:%M:%S")
        parts = [
            f'<div class="dask-rmm-report"><style>{_CSS}</style>',
            f"<h3>dask-rmm cluster memory &middot; {esc(self.scheduler)} &middot; {esc(when)}</h3>",
        ]
        if not self.devices and not self.totals.devices:
            parts.append(
                "<p>No dask-rmm workers (register <code>dask_rmm.RMMPlugin</code> on the workers).</p>"
            )
        else:
            if self.selection:
                parts.append(f'<p class="selection">{esc(self.selection)}</p>')
            notes = "<br>".join(esc(n) for n in self._peak_notes())
            parts.append(
                f"<table><thead>{_tr('th', rows[0])}</thead><tbody>{body}</tbody>"
                f"<tfoot>{_tr('th', rows[-1])}</tfoot></table><p>{notes}</p>"
            )
        bars = [
            (d.label, d.breakdown(), d.device_total_bytes)
            for d in self.running
            if d.libraries or d.device_total_bytes > 0
        ][:_SVG_SERIES]
        for title, lines, drawn in (
            ("Where the bytes are", self.breakdown_lines(), breakdown_svg(bars) if bars else ""),
            ("Memory pressure", self.pressure_lines(), ""),
            ("Memory admission", self.admission_lines(), ""),
        ):
            items = "".join(f"<li>{esc(line)}</li>" for line in lines[1:])
            parts += [f"<h4>{title}</h4>{drawn}<ul>{items}</ul>"] if lines else []
        parts += [f'<p class="note">{esc(line)}</p>' for line in self._notes()]
        if timeline and (self.total_timeline or any(d.timeline for d in self.devices)):
            series = [(d.label, d.status, d.timeline) for d in self.devices if d.timeline]
            series = series[:_SVG_SERIES]
            if self.total_timeline:
                n = self.totals.devices
                label = f"total ({n} device{'s' if n != 1 else ''})"
                series.insert(0, (label, "total", self.total_timeline))
            parts.append("<h4>Memory over time (max per sample interval)</h4>")
            parts.append(timeline_svg(series))
        parts.append("</div>")
        fragment = "".join(parts)
        if not full_page:
            return fragment
        meta = f'<meta http-equiv="refresh" content="{int(refresh)}">' if refresh else ""
        if json_href is not None:
            json_foot = f'<a href="{esc(json_href)}">report.json</a>'
        else:
            json_foot = f"<code>dask rmm report {esc(self.scheduler or 'SCHEDULER')} --json</code>"
        return (
            '<!DOCTYPE html><html><head><meta charset="utf-8">'
            f"<title>dask-rmm cluster memory</title>{meta}</head>"
            f'<body style="font-family:system-ui,sans-serif;font-size:13px">{nav}{fragment}'
            f'<p class="foot">JSON: {json_foot}</p></body></html>'
        )

    def _peak_notes(self) -> list[str]:
        t = self.totals
        no_peak = "total peak: needs the timelines (the sum of the device peaks is no cluster peak)"
        notes = [_ROW_PEAK_NOTE, no_peak if t.peak_bytes is None else _PEAK_NOTE]
        if t.peak_bytes is not None and t.peak_bytes > t.sum_of_device_peaks:
            notes.append(
                f"total peak {format_bytes(t.peak_bytes)} is above the sum of the rows' peaks "
                f"({format_bytes(t.sum_of_device_peaks)}): it was reached earlier, by devices "
                "or setups no longer listed (workers that left, a plugin unregistered since)"
            )
        return notes

    def _repr_html_(self) -> str:
        return self.to_html()


_HEADER = (
    "worker", "dev", "status", "current", "peak", "allocated (total)", "reserved", "pool free",
    "largest free", "frag", "failures", "top task groups (peak)",
)  # fmt: skip

_ROW_PEAK_NOTE = (
    "peak: the most each device held at once since the scheduler first saw its worker "
    "(re-registrations and restarts under the same name included)"
)
_PEAK_NOTE = (
    "* total peak: the most all devices held at once over the same time (the peak of the "
    "summed timelines, not the sum of the peaks)"
)
#: Device lines the HTML timeline draws at most (beside the total).
_SVG_SERIES = 10
_FRAME_COLUMNS = (
    "worker", "name", "device", "status", "measured", *COUNTERS, "fragmentation", "resource",
)  # fmt: skip
_FRAME_COLUMNS += ("gpu_name", "gpu_uuid", "pci_bus_id", "error")

_CSS = (
    ".dask-rmm-report{font-family:system-ui,sans-serif;font-size:13px}"
    ".dask-rmm-report table{border-collapse:collapse}"
    ".dask-rmm-report th,.dask-rmm-report td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:right}"
    ".dask-rmm-report th:nth-child(-n+3),.dask-rmm-report td:nth-child(-n+3),"
    ".dask-rmm-report td:last-child,.dask-rmm-report th:last-child{text-align:left}"
    ".dask-rmm-report th,.dask-rmm-report td{white-space:nowrap}"
    ".dask-rmm-report td:last-child{white-space:normal}"
    ".dask-rmm-report thead th{background:#f3f3f3}"
    ".dask-rmm-report tr.gone td{color:#999;font-style:italic}"
    ".dask-rmm-report .note{color:#b00}"
)


#: Characters shown escaped in text output: C0 and C1 controls (newline, ESC...), DEL, and the
#: Unicode line separators and bidirectional overrides that can make text read otherwise.
_INVISIBLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """``text`` with control characters shown as escapes (``"a\\nb"`` for a newline): what
    a worker sends can then never add a line or an escape sequence to a terminal."""
    if _INVISIBLE.search(text) is None:
        return text
    return _INVISIBLE.sub(lambda m: repr(m.group())[1:-1], text)


def strict_json(data: Any, **kwargs: Any) -> str:
    """``json.dumps(data)`` without the bare NaN and Infinity strict parsers reject: a number
    that is not finite is written as null."""
    try:
        return json.dumps(data, allow_nan=False, **kwargs)
    except ValueError:  # json writes them NaN and Infinity, and reads them back as null here
        finite = json.loads(json.dumps(data, **kwargs), parse_constant=lambda _: None)
        return json.dumps(finite, allow_nan=False, **kwargs)


def require_pandas(what: str) -> Any:
    """The pandas module; without it an ImportError saying that ``what`` needs it."""
    try:
        import pandas
    except ImportError as e:
        raise ImportError(f"{what} needs pandas: pip install pandas (or 'dask-rmm[report]')") from e
    return pandas


def _tr(tag: str, cells: Iterable[Any], attributes: str = "") -> str:
    """An HTML table row of ``cells``, escaped, each in a ``tag`` element."""
    inner = "".join(f"<{tag}>{html.escape(str(c))}</{tag}>" for c in cells)
    return f"<tr{attributes}>{inner}</tr>"


def _clock(t: Any, form: str) -> str:
    """The local time ``t`` (unix seconds) in ``form``; "?" when it is no time."""
    try:
        return _time.strftime(form, _time.localtime(float(t)))
    except (TypeError, ValueError, OverflowError, OSError):
        return "?"


def _titled(title: str, lines: list[str]) -> list[str]:
    """``lines`` under ``title``; none without lines."""
    return [title, *lines] if lines else []


def _place(d: Any) -> str:
    """``host:port (name)/dev0``: one device, gone or not."""
    return f"{_worker_label(d)}/dev{d.device}"


def _device_label(d: Any) -> str:
    """:func:`_place`, with ``(gone)`` for departed workers."""
    return _place(d) + (" (gone)" if d.status != "running" else "")


def _worker_label(d: Any) -> str:
    """``host:port``, then the worker's name when it says more than the address."""
    short = d.worker.rsplit("//", 1)[-1]
    if d.name and d.name not in (d.worker, short):
        return f"{short} ({d.name})"
    return short


def _int(value: Any) -> int:
    """:func:`to_int`, faster on what is an int already (16,000 devices a report)."""
    return value if type(value) is int else to_int(value)


def _bytes(n: int | None) -> str:
    """:func:`format_bytes`, "n/a" for a figure not measured (None)."""
    return "n/a" if n is None else format_bytes(n)


def _top_groups(d: DeviceMemory, n: int = 3) -> str:
    groups = sorted(d.task_groups, key=lambda g: -g[2])[:n]
    return ", ".join(f"{prefix} {format_bytes(peak)}" for prefix, _, peak in groups)
