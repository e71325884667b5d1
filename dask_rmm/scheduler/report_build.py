"""Building a report from a snapshot of the plugin's records (taken on the event loop, built in any
thread). Not here: keeping the records (``timeline.py``), rendering (``dask_rmm.report``)."""

from __future__ import annotations

import contextlib
import gc
import html
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlencode

import numpy as np
from dask.utils import natural_sort_key

from dask_rmm.report.memory_report import (
    ClusterMemoryReport,
    ClusterTotals,
    DeviceMemory,
    _int,
    strict_json,
)
from dask_rmm.scheduler.resolution import SAMPLE_DTYPE, downsample
from dask_rmm.wire import device_entries, fragmentation

__all__ = ["SORT_KEYS", "ReportRequest", "Snapshot"]

#: Orders of a report's devices (``sort=``): "worker" by address (running first), the others
#: largest first.
SORT_KEYS = ("worker", "current", "peak", "fragmentation")


@dataclass(frozen=True)
class ReportRequest:
    """What a report shows.

    Parameters
    ----------
    timeline : bool
        Each shown device's timeline (the points the scheduler keeps, or ``width`` buckets).
    last : int, optional
        Only the newest ``last`` points of each timeline.
    top : int, optional
        Only the first ``top`` devices in ``sort`` order (the totals still cover all).
    sort : str, optional
        One of :data:`SORT_KEYS`; default "worker", or "peak" when ``top`` leaves devices out.
    worker : str, optional
        Only devices of workers whose address or name contains this text.
    width : int, optional
        Draw each timeline in this many time buckets, the lowest and highest point of each
        (what a screen of that many pixels can show; peaks survive).
    refresh : int, optional
        For the web page: reload every ``refresh`` seconds.
    """

    timeline: bool = True
    last: int | None = None
    top: int | None = None
    sort: str | None = None
    worker: str | None = None
    width: int | None = None
    refresh: int | None = None

    def __post_init__(self) -> None:
        for name in ("last", "top", "width", "refresh"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"{name} must be an int >= 0 or None, got {value!r}")
        if self.sort is not None and self.sort not in SORT_KEYS:
            raise ValueError(f"sort must be one of {', '.join(SORT_KEYS)}, got {self.sort!r}")
        if self.worker is not None and not isinstance(self.worker, str):
            raise ValueError(f"worker must be a str, got {self.worker!r}")

    @classmethod
    def from_query(cls, query: Mapping[str, Any]) -> ReportRequest:
        """From the ``dask_rmm_report`` handler's keyword arguments (unknown ones raise)."""
        fields = cls.__dataclass_fields__
        if unknown := sorted(set(query) - set(fields)):
            raise TypeError(f"unknown dask_rmm_report arguments {unknown}; known: {list(fields)}")
        return cls(**{k: v for k, v in query.items() if v is not None})


class _Record(NamedTuple):
    """A worker record as the snapshot took it (references to data replaced, never changed)."""

    address: str
    name: str
    status: str
    last_seen: float | None
    error: str | None
    restarts: int
    metrics: dict | None
    earlier_peaks: dict[str, int]
    levels: dict[str, tuple[bytes, ...]]
    rows: dict[str, int]


#: The leading fields of a :class:`_Record`: a worker entry of the report document.
_WORKER = ("address", "name", "status", "last_seen", "error", "restarts")


class _Device:
    """One device's numbers for sorting and totals (no DeviceMemory made for it)."""

    __slots__ = ("rec", "dev", "d", "levels", "running", "current", "peak", "frag")

    def __init__(
        self, rec: _Record, dev: str, d: Mapping[str, Any], levels: tuple | None, peak: int
    ):
        self.rec, self.dev, self.d, self.levels = rec, dev, d, levels
        self.running = rec.status == "running"
        self.current = _int(d.get("current_bytes", 0))
        self.frag = fragmentation(
            _int(d.get("reserved_bytes", 0)),
            _int(d.get("pool_free_bytes", 0)),
            _int(d.get("largest_free_block", 0)),
        )
        # The most this worker name's device held at once since the scheduler first saw it:
        # its heartbeat's peak, every sample it sent, and the peaks of earlier processes.
        self.peak = max(_int(d.get("peak_bytes", 0)), peak, rec.earlier_peaks.get(dev, 0))

    def points(self) -> np.ndarray:
        if not self.levels:
            return np.zeros(0, SAMPLE_DTYPE)
        return np.frombuffer(b"".join(reversed(self.levels)), SAMPLE_DTYPE)


class Snapshot:
    """The plugin's records at one moment (made on the event loop by the plugin); :meth:`build`
    makes the report from it in any thread."""

    def __init__(self, request: ReportRequest, records: list[_Record], total: Any, meta: dict):
        self.request, self.records, self.total, self.meta = request, records, total, meta

    @staticmethod
    def record(r: Any) -> _Record:
        """One worker record as a snapshot keeps it (references to data replaced, never
        changed in place)."""
        return _Record(
            r.address,
            r.name,
            r.status,
            r.last_seen,
            r.error,
            r.restarts,
            r.metrics,
            dict(r.earlier_peaks),
            {dev: tl.parts() for dev, tl in r.timelines.items()},
            dict(r.rows),
        )

    # -- building (any thread) ----------------------------------------------------------------

    def devices(self) -> list[_Device]:
        """Every device of the snapshot, with its numbers (no DeviceMemory made)."""
        out = []
        peaks = self.total.row_peaks if self.total is not None else ()
        for rec in self.records:
            for dev, d in device_entries(rec.metrics).items():
                row = rec.rows.get(dev)
                peak = int(peaks[row]) if row is not None and row < len(peaks) else 0
                out.append(_Device(rec, dev, d, rec.levels.get(dev), peak))
        return out

    def totals(self, devices: list[_Device], peak: int | None) -> ClusterTotals:
        """Totals over the running ``devices``, with the cluster's ``peak``."""
        return ClusterTotals.over([(x.rec.address, x.running, x.d, x.peak) for x in devices], peak)

    def _select(self, devices: list[_Device]) -> tuple[list[_Device], str]:
        req = self.request
        chosen = devices
        if req.worker:
            chosen = [x for x in chosen if req.worker in x.rec.address or req.worker in x.rec.name]
        order = req.sort or ("peak" if req.top is not None and len(chosen) > req.top else "worker")
        if order == "worker":
            chosen = sorted(
                chosen, key=lambda x: (not x.running, natural_sort_key(x.rec.address), x.dev)
            )
        else:
            key = {
                "current": lambda x: x.current,
                "peak": lambda x: x.peak,
                "fragmentation": lambda x: -1.0 if x.frag is None else x.frag,
            }[order]
            chosen = sorted(chosen, key=lambda x: (x.running, key(x)), reverse=True)
        matched = len(chosen)
        if req.top is not None:
            chosen = chosen[: req.top]
        note = ""
        if len(chosen) < len(devices):
            what = f" of workers matching {req.worker!r}" if req.worker else ""
            note = (
                f"showing {len(chosen)} of {matched} devices{what} "
                f"({len(devices)} in the cluster), by {order}; totals cover all"
            )
        return chosen, note

    def _points(self, pts: np.ndarray) -> np.ndarray:
        req = self.request
        if req.last is not None:
            pts = pts[len(pts) - min(req.last, len(pts)) :]
        return downsample(pts, req.width) if req.width else pts

    def _timeline(self, pts: np.ndarray) -> tuple:
        return tuple(map(tuple, self._points(pts).tolist()))

    def build(self, arrays: dict | None = None) -> ClusterMemoryReport:
        """The report (totals over every device; the devices and timelines asked for). With
        ``arrays``, the devices' timelines go there as numpy arrays by ``(worker, device)``
        instead of into the report (millions of small tuples kept at once make the garbage
        collector's full passes, which hold the GIL, long)."""
        devices = self.devices()
        peak, total_timeline = None, ()
        if self.total is not None:
            peak, points = self.total.points()
            peak = peak if len(points) else None
            # The not-yet-final part can hold a point per sample of every device: never more
            # than a device's timeline holds.
            width = self.request.width or max(1, self.meta["timeline_length"] // 2)
            total_timeline = self._timeline(downsample(points, width))
        shown, note = self._select(devices)
        made = []
        for x in shown:
            rec = x.rec
            timeline: tuple = ()
            if self.request.timeline:
                if arrays is None:
                    timeline = self._timeline(x.points())
                else:
                    arrays[rec.address, x.dev] = self._points(x.points())
            worker = dict(zip(_WORKER, rec, strict=False))
            made.append(DeviceMemory.from_worker(worker, x.dev, x.d, timeline).with_peak(x.peak))
        errors = [f"{rec.address}: {rec.error}" for rec in self.records if rec.error]
        return ClusterMemoryReport(
            devices=tuple(made),
            errors=tuple(errors),
            cluster_totals=self.totals(devices, peak),
            total_timeline=total_timeline,
            selection=note,
            **self.meta,
        )

    def export(self, build: Any) -> Any:
        """``build(self)`` with the garbage collector paused and the interpreter switching
        threads more often (see :func:`_building`)."""
        with _building():
            return build(self)

    def render(self, form: str) -> Any:
        """:meth:`build`, as a report ("report"), JSON text ("json") or the web page ("html")."""
        return self.export(lambda snap: snap._render(form))

    def _render(self, form: str) -> Any:
        if form in ("json", "json-pieces", "json-bytes"):
            arrays: dict = {}
            report = self.build(arrays)
            pieces = json_pieces(report.to_dict(timeline=False), arrays)
            if form == "json-pieces":
                return pieces
            text = "".join(pieces)
            return text.encode() if form == "json-bytes" else text
        report = self.build()
        if form == "html":
            return report.to_html(
                full_page=True,
                refresh=self.request.refresh,
                nav=self._nav(),
                json_href="dask-rmm/report.json",
            )
        return report

    def _nav(self) -> str:
        """Links that re-ask the page sorted another way or with more rows (no JavaScript)."""
        req = self.request
        keep = {"worker": req.worker, "refresh": req.refresh, "last": req.last}
        keep["timeline"] = None if req.timeline else 0

        def link(text: str, current: bool, **change: Any) -> str:
            query = {k: v for k, v in {**keep, "sort": req.sort, "top": req.top, **change}.items()}
            href = "dask-rmm?" + urlencode({k: v for k, v in query.items() if v is not None})
            return f"<b>{text}</b>" if current else f'<a href="{html.escape(href)}">{text}</a>'

        sorts = " ".join(link(k, req.sort == k, sort=k) for k in SORT_KEYS)
        tops = " ".join(link(str(n), req.top == n, top=n) for n in (20, 50, 200, 1000))
        # Relative links: they follow the dashboard's --dashboard-prefix. distributed gives
        # plugins no documented way into its dashboard's menu; this page links back to it.
        back = '<a href="status">Dask dashboard</a>'
        return f'<p class="nav">{back} &middot; sort by: {sorts} &middot; rows: {tops}</p>'


#: ``sys.setswitchinterval`` while a report is built (Python's default is 5 ms).
SWITCH_INTERVAL = 0.0005


@contextlib.contextmanager
def _building() -> Iterator[None]:
    """While a report is built (one at a time, in one thread; restored after):

    - no automatic garbage collection: a full pass walks every object of the scheduler (each
      worker's last heartbeat is hundreds of them) holding the GIL, which at 16,000 devices
      stalls the event loop's thread (bench/README.md); building a report makes enough objects
      to start several. What it makes has no cycles: reference counting frees it.
    - the interpreter switching threads every :data:`SWITCH_INTERVAL`: each time the event
      loop's thread gives up the GIL (a select, a socket write, a read of /proc by
      distributed's system monitor) it waits for the building thread to give it back, up to
      the switch interval, so a callback making 20 such calls was late by 100 ms at the
      default 5 ms (bench/README.md).
    """
    was_enabled = gc.isenabled()
    before = sys.getswitchinterval()
    gc.disable()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(before)
        if was_enabled:
            gc.enable()


def json_pieces(doc: dict[str, Any], timelines: Mapping | None = None) -> list[str]:
    """``json.dumps(doc)`` in pieces, one worker a piece (the encoder holds the GIL for a whole
    call: one call for 16,000 devices would stall the event loop's thread for as long), with
    each device's ``timeline`` from ``timelines[worker address, device]`` (numpy points)."""
    timelines = timelines or {}

    def worker(w: dict) -> str:
        found = {}
        for dev, d in w["devices"].items():
            if (pts := timelines.get((w["address"], dev))) is not None:
                d["timeline"] = marker = f"@timeline:{dev}@"
                found[strict_json(marker)] = pts
        text = strict_json(w)
        for marker, pts in found.items():
            text = text.replace(marker, strict_json(pts.tolist()), 1)
        return text

    head = strict_json({k: v for k, v in doc.items() if k != "workers"})
    pieces = [head[:-1] + (", " if head != "{}" else "") + '"workers": [']
    for i, w in enumerate(doc.get("workers") or ()):
        pieces.append(("," if i else "") + worker(w))
    pieces.append("]}")
    return pieces
