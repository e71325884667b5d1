"""``dask_rmm.performance_report``: distributed's ``performance_report`` with a GPU memory
section in its Summary tab. Not here: sampling (:mod:`~dask_rmm.client.sampler`), the SVG
(:mod:`~dask_rmm.plotting.svg`).
"""

from __future__ import annotations

import contextlib
import html
import inspect
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import distributed

from dask_rmm.client.fetch import fetch_report_data
from dask_rmm.client.sampler import GPUMemorySampler, GPUSamples
from dask_rmm.plotting.svg import timeline_svg
from dask_rmm.report.memory_report import ClusterMemoryReport, _clock, _tr
from dask_rmm.sizes import format_bytes
from dask_rmm.wire import to_int
from dask_rmm.worker.peak_windows import close_peak_windows, open_peak_windows

__all__ = ["SECTION_ID", "gpu_section_html", "performance_report"]

#: The ``id`` of the GPU memory section's element in the report file.
SECTION_ID = "dask-rmm-gpu-memory"
#: Memory-pressure counters that grow: the block's share is the end's minus the start's.
SPILL_COUNTERS = (
    "total_spilled_bytes",
    "total_unspilled_bytes",
    "ooms_avoided",
    "oom_count",
    "pauses",
)


class performance_report(distributed.performance_report):
    """Distributed's performance report (``with`` or ``async with``; needs bokeh), plus a GPU
    memory section in its Summary tab, in one self-contained file (docs/gpu-memory-tools.md).

    ``filename``, ``stacklevel`` and ``storage_options`` are distributed's; ``mode`` is bokeh's
    resources mode: ``"inline"`` (the file opens without network) or ``"cdn"``; ``interval``:
    seconds between two reads of the scheduler's timelines. ``sampler`` keeps what was sampled
    (a :class:`~dask_rmm.client.sampler.GPUMemorySampler`, label ``"performance report"``).

    Examples
    --------
    >>> import dask_rmm
    >>> with dask_rmm.performance_report("report.html"):  # doctest: +SKIP
    ...     x.sum().compute()
    """

    LABEL = "performance report"

    def __init__(
        self,
        filename: str = "dask-report.html",
        stacklevel: int = 1,
        mode: str | None = "inline",
        storage_options: dict | None = None,
        *,
        interval: float = 0.5,
    ):
        super().__init__(filename, max(stacklevel, 1), mode, storage_options)
        self._level = max(stacklevel, 1)
        self.interval = interval
        self.sampler = GPUMemorySampler()
        self._sampling: Any = None
        self._begin: ClusterMemoryReport | None = None
        #: ``{worker: {device: {task group: peak bytes in the block} or None}}`` (None before
        #: the block ended, or when the workers could not say).
        self.block_peaks: dict[str, dict[str, dict[str, int] | None]] | None = None
        self._window = f"performance-report-{id(self):x}-{time.time_ns()}"

    def __enter__(self):
        super().__enter__()  # our __aenter__ on the client's loop; __exit__ is distributed's
        return self

    async def __aenter__(self):
        client = distributed.get_client()  # asynchronous here also for a synchronous client
        self._begin = await _fetch(client)
        # never fails the block: the report then shows the peaks since setup, and says so
        with contextlib.suppress(Exception):
            await client.run(open_peak_windows, window=self._window, on_error="ignore")
        self._sampling = self.sampler.sample(self.LABEL, client=client, interval=self.interval)
        await self._sampling.__aenter__()
        await super().__aenter__()
        return self

    async def __aexit__(self, exc_type, exc_value, traceback, code=None):
        if code is None:  # `async with` (distributed's __exit__ passes it): the caller's code
            frame = inspect.currentframe()
            for _ in range(self._level):
                frame = frame and frame.f_back
            with contextlib.suppress(OSError, TypeError):  # TypeError: no frame
                code = inspect.getsource(frame)  # type: ignore[arg-type]
        await self._sampling.__aexit__(exc_type, exc_value, traceback)
        client = distributed.get_client()
        try:
            peaks = await client.run(close_peak_windows, window=self._window, on_error="ignore")
            self.block_peaks = {w: p for w, p in peaks.items() if isinstance(p, dict)}
        except Exception:
            self.block_peaks = None
        samples = self.sampler.samples[self.LABEL]
        section = gpu_section_html(samples, self._begin, await _fetch(client), self.block_peaks)
        # distributed's one door into the page: the Summary tab's HTML holds ``code`` as is, in
        # a <pre>; the section follows it there.
        code = html.escape(code or "<Code not available>") + f"</pre>{section}<pre>"
        await super().__aexit__(exc_type, exc_value, traceback, code=code)


async def _fetch(client: Any) -> ClusterMemoryReport:
    return ClusterMemoryReport.from_dict(await fetch_report_data(client.scheduler, timeline=False))


def gpu_section_html(
    samples: GPUSamples,
    begin: ClusterMemoryReport | None = None,
    end: ClusterMemoryReport | None = None,
    block_peaks: Mapping[str, Mapping[str, Mapping[str, int] | None]] | None = None,
) -> str:
    """The GPU memory section, plain HTML, inline CSS and SVG (no script), of the block's
    ``samples``; ``begin`` and ``end`` are the cluster reports at its start and end (OOM events,
    spills), ``block_peaks`` (``{worker: {device: {task group: peak}}}``, from
    :mod:`dask_rmm.worker.peak_windows`) the task groups' peaks over the block."""
    esc, lost = html.escape, samples.workers_lost
    seconds = (samples.stop or time.time()) - samples.start
    parts = [
        f'<section id="{SECTION_ID}" class="dask-rmm-gpu"><style>{_CSS}</style>',
        f"<h2>{esc(_memory_kind(begin, end))} (dask-rmm)</h2>",
        f"<p>{seconds:.1f} s, {len(samples.devices)} worker device(s): at most "
        f"<b>{esc(format_bytes(samples.peak_used))}</b> in use at once "
        f"(time-weighted mean {esc(format_bytes(int(samples.mean_used)))}), at most "
        f"<b>{esc(format_bytes(samples.peak_reserved))}</b> reserved by the pools "
        f"(mean {esc(format_bytes(int(samples.mean_reserved)))})."
        + (f" Workers lost during the block: {esc(', '.join(lost))}." if lost else "")
        + "</p>",
        "<h3>Memory in use over the block</h3>",
        _timeline(samples),
        '<p class="note">Solid: the most in use within each sample interval (short peaks '
        "included); the cluster line sums the devices. Dashed: the pools' reserved bytes "
        "(cluster), and devices of workers that left. Times are the workers' clocks.</p>",
    ]
    parts += [*_task_groups(begin, end, block_peaks), *_oom_events(samples, end)]
    return "".join([*parts, *_spills(begin, end), "</section>"])


def _memory_kind(begin: ClusterMemoryReport | None, end: ClusterMemoryReport | None) -> str:
    """What the workers' stacks hand out, as the block's reports say (``gpu_name`` "host": host)."""
    hosts = {d.gpu_name == "host" for r in (begin, end) if r is not None for d in r.devices}
    return _KINDS.get(frozenset(hosts), "GPU memory")


def _timeline(samples: GPUSamples) -> str:
    used, used_max = samples.summed("used"), samples.summed("used_max")
    reserved = samples.summed("reserved")
    series: list[tuple[str, str, list]] = []
    if used:
        cluster = [(t, u, m) for (t, u), (_, m) in zip(used, used_max, strict=True)]
        series.append(("cluster in use", "running", cluster))
    if reserved:
        series.append(("cluster reserved", "gone", [(t, r, r) for t, r in reserved]))
    series += [(d.label, d.status, list(d.used)) for d in samples.devices.values() if d.used]
    return timeline_svg(series)


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """An HTML table of ``rows`` (cells escaped) under the header ``head``."""
    body = "".join(_tr("td", r) for r in rows)
    return f"<table><thead>{_tr('th', head)}</thead><tbody>{body}</tbody></table>"


def _task_groups(
    begin: ClusterMemoryReport | None,
    end: ClusterMemoryReport | None,
    block_peaks: Mapping[str, Mapping[str, Mapping[str, int] | None]] | None,
    top: int = 15,
) -> list[str]:
    """The task groups' largest peaks on one device: over the block (``block_peaks``, measured
    on the workers from its start), else since setup, marked whether they rose in the block."""
    devices = end.devices if end is not None else ()
    peaks: list[tuple[str, str, int]] = []
    in_block: set[str] | None = None
    if block_peaks is not None:
        out = ["<h3>Task groups: peak bytes held during the block</h3>"]
        labels = {(d.worker, d.device): d.label for d in devices}
        unmeasured = []
        for worker, by_device in sorted(block_peaks.items()):
            for device, groups in sorted(by_device.items()):
                label = labels.get((worker, device), f"{worker}/dev{device}")
                if groups is None:
                    unmeasured.append(label)
                peaks += [(label, prefix, peak) for prefix, peak in (groups or {}).items()]
        note = "Peaks over this block only, measured on each worker from the block's start."
        if unmeasured:
            note += (
                " Not measured over the whole block (the setup was replaced during it): "
                f"{', '.join(unmeasured)}."
            )
    elif end is None:
        return ["<h3>Task groups: peak bytes held</h3>", _NO_END]
    else:
        out = ["<h3>Task groups: peak bytes held</h3>"]
        held = [(d, p, peak) for d in devices for p, _, peak in d.task_groups or ()]
        old = begin.devices if begin is not None else ()
        before = {(d.worker, d.device, p): peak for d in old for p, _, peak in d.task_groups or ()}
        peaks = [(d.label, p, peak) for d, p, peak in held]
        # a group whose peak on some device changed during the block
        in_block = {p for d, p, peak in held if before.get((d.worker, d.device, p)) != peak}
        note = (
            'Peaks are counted since each worker\'s dask-rmm setup; "before it": the peak did not '
            "change during this block."
        )
    if not peaks:
        out.append("<p>No task group held memory (statistics off, or no tasks ran).</p>")
    else:
        by_group: dict[str, tuple[int, list[str]]] = {}
        for label, prefix, peak in peaks:
            most, where = by_group.setdefault(prefix, (0, []))
            where.append(f"{label} {format_bytes(peak)}")
            by_group[prefix] = (max(most, peak), where)
        head = ["task group", "largest peak on one device", "per worker device"]
        if in_block is not None:
            head.insert(2, "peak reached in this block")
        rows = []
        for prefix, (peak, where) in sorted(by_group.items(), key=lambda kv: -kv[1][0])[:top]:
            flag = [] if in_block is None else ["yes" if prefix in in_block else "before it"]
            rows.append((prefix, format_bytes(peak), *flag, "; ".join(where)))
        out.append(_table(head, rows))
    return out + [f'<p class="note">{html.escape(note)}</p>']


def _oom_events(samples: GPUSamples, end: ClusterMemoryReport | None) -> list[str]:
    out = ["<h3>Out-of-memory errors that reached a task</h3>"]
    stop = (samples.stop or time.time()) + 1.0
    ended = end.oom_events if end is not None else ()
    events = [e for e in ended if samples.start <= to_int(e.get("time"), float) <= stop]
    if not events:
        return out + ["<p>None during the block.</p>"]
    sizes = ("requested", "free_bytes", "largest_free_block")
    rows = [
        (_clock(e.get("time"), "%H:%M:%S"), f"{e.get('worker')}/dev{e.get('device')}")
        + (e.get("task_key") or "(none)", e.get("verdict"))
        + tuple(format_bytes(to_int(e.get(k))) for k in sizes)
        for e in events
    ]
    head = ("time", "worker device", "task", "verdict", "requested", "free in pool")
    return out + [
        _table((*head, "largest free block"), rows),
        '<p class="note">Verdict "fragmentation": enough memory was free, in pieces too small; '
        '"demand": not enough was free.</p>',
    ]


def _spills(begin: ClusterMemoryReport | None, end: ClusterMemoryReport | None) -> list[str]:
    out = ["<h3>Spilling during the block</h3>"]
    if end is None:
        return out + [_NO_END]
    start = {(d.worker, d.device): d for d in (begin.devices if begin is not None else ())}
    rows = []
    totals: Counter[str] = Counter()
    for d in end.devices:
        before = start.get((d.worker, d.device))  # None: 0, all of the block's
        # the block's share: all of it for a device whose counters went down (a restart)
        now = [int(getattr(d, k)) for k in SPILL_COUNTERS]
        then = [int(getattr(before, k, 0)) for k in SPILL_COUNTERS]
        delta = [a - b if a >= b else a for a, b in zip(now, then, strict=True)]
        totals.update(dict(zip(SPILL_COUNTERS, delta, strict=True)))
        spilled, back, *counts = delta
        rows.append((d.label, *map(format_bytes, (spilled, back, d.spilled_bytes)), *counts))
    totals_line = (
        f"<p>Spilled {format_bytes(totals['total_spilled_bytes'])} to host and brought "
        f"{format_bytes(totals['total_unspilled_bytes'])} back; "
        f"{totals['ooms_avoided']} out-of-memory errors avoided by spilling, "
        f"{totals['oom_count']} not avoided; {totals['pauses']} pauses.</p>"
    )
    if not any(totals.values()):
        return out + [totals_line]
    head = ("worker device", "spilled", "brought back", "on host at the end", "OOMs avoided")
    return out + [totals_line, _table((*head, "OOMs", "pauses"), rows)]


_KINDS = {frozenset({True}): "Host memory", frozenset({True, False}): "GPU and host memory"}
_NO_END = "<p>No report at the end of the block.</p>"
_CSS = (
    ".dask-rmm-gpu{font-family:system-ui,sans-serif;font-size:13px;margin:12px 16px;"
    "padding:8px 12px;border:1px solid #ddd;border-radius:4px;background:#fff}"
    ".dask-rmm-gpu h2{font-size:18px;margin:4px 0}.dask-rmm-gpu h3{font-size:14px;margin:12px 0 4px}"
    ".dask-rmm-gpu table{border-collapse:collapse}"
    ".dask-rmm-gpu th,.dask-rmm-gpu td{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}"
    ".dask-rmm-gpu thead th{background:#f3f3f3}.dask-rmm-gpu .note{color:#666}"
)
