"""``dask_rmm.performance_report``: distributed's ``performance_report`` with a GPU memory
section (titled "Host memory" when the workers' stacks use ``base_resource="system"``) (the cluster's RMM timeline over the block, task-group peaks, OOM events, spills) in the
Summary tab of the same HTML file. Not here: sampling (:mod:`~dask_rmm.client.sampler`), the SVG
(:mod:`~dask_rmm.plotting.svg`).
"""

from __future__ import annotations

import html
import inspect
import time
from collections.abc import Mapping
from typing import Any

import distributed

from dask_rmm.client.sampler import GPUMemorySampler, GPUSamples
from dask_rmm.plotting.svg import timeline_svg
from dask_rmm.report.memory_report import ClusterMemoryReport, DeviceMemory
from dask_rmm.sizes import format_bytes

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
    """Distributed's performance report, plus a GPU memory section, in one self-contained file.

    Use it as distributed's (``with`` or ``async with``); the file is what distributed writes
    (its bokeh plots, needs bokeh), with a section in its Summary tab, drawn as plain HTML and
    inline SVG: the cluster's RMM memory in use over the block (summed over devices, and per device),
    the most in use and reserved at once, the task groups' peaks, the out-of-memory errors
    that reached a task (with their verdict) and the bytes spilled and brought back during the
    block. ``mode`` defaults to ``"inline"`` (bokeh's JavaScript inside the file: it opens
    without network, unlike distributed's default, which loads it from a CDN).

    Parameters
    ----------
    filename, stacklevel, storage_options
        As :class:`distributed.performance_report`.
    mode : str
        Bokeh's resources mode: ``"inline"`` (default) or ``"cdn"``.
    interval : float
        Seconds between two reads of the scheduler's timelines (see
        :meth:`~dask_rmm.client.sampler.GPUMemorySampler.sample`).

    Attributes
    ----------
    sampler : GPUMemorySampler
        What was sampled (label ``"performance report"``), for a look after the block.

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
        self._end: ClusterMemoryReport | None = None
        #: ``{worker: {device: {task group: peak bytes in the block} or None}}`` (None before
        #: the block ended, or when the workers could not say).
        self.block_peaks: dict[str, dict[str, dict[str, int] | None]] | None = None
        self._window = f"performance-report-{id(self):x}-{time.time_ns()}"

    def __enter__(self):
        super().__enter__()  # our __aenter__ on the client's loop; __exit__ is distributed's
        return self

    async def __aenter__(self):
        from distributed import get_client

        client = get_client()  # asynchronous here also for a synchronous client (its loop)
        self._begin = await _fetch(client)
        await _open_windows(client, self._window)
        self._sampling = self.sampler.sample(self.LABEL, client=client, interval=self.interval)
        await self._sampling.__aenter__()
        await super().__aenter__()
        return self

    async def __aexit__(self, exc_type, exc_value, traceback, code=None):
        from distributed import get_client

        if code is None:  # `async with` (distributed's __exit__ passes it): the caller's code
            frame = inspect.currentframe()
            for _ in range(self._level):
                frame = frame.f_back if frame is not None else None
            try:
                code = inspect.getsource(frame) if frame is not None else None
            except (OSError, TypeError):
                code = None
        await self._sampling.__aexit__(exc_type, exc_value, traceback)
        self.block_peaks = await _close_windows(get_client(), self._window)
        self._end = await _fetch(get_client())
        samples = self.sampler.samples[self.LABEL]
        section = gpu_section_html(samples, self._begin, self._end, self.block_peaks)
        # distributed's one door into the page: the Summary tab's HTML holds ``code`` as is, in
        # a <pre>; the section follows it there.
        code = html.escape(code or "<Code not available>") + f"</pre>{section}<pre>"
        await super().__aexit__(exc_type, exc_value, traceback, code=code)


async def _open_windows(client: Any, window: str) -> None:
    """Open the block's task-group peak window on every worker (never fails the block)."""
    from dask_rmm.worker.peak_windows import open_peak_windows

    try:
        await client.run(open_peak_windows, window=window, on_error="ignore")
    except Exception:  # the report then shows the peaks since setup, and says so
        pass


async def _close_windows(client: Any, window: str) -> dict | None:
    from dask_rmm.worker.peak_windows import close_peak_windows

    try:
        out = await client.run(close_peak_windows, window=window, on_error="ignore")
    except Exception:
        return None
    return {w: peaks for w, peaks in out.items() if isinstance(peaks, dict)}


async def _fetch(client: Any) -> ClusterMemoryReport:
    from dask_rmm.client.fetch import fetch_report_data

    return ClusterMemoryReport.from_dict(await fetch_report_data(client.scheduler, timeline=False))


# -- the section --------------------------------------------------------------------------------


def gpu_section_html(
    samples: GPUSamples,
    begin: ClusterMemoryReport | None = None,
    end: ClusterMemoryReport | None = None,
    block_peaks: Mapping[str, Mapping[str, Mapping[str, int] | None]] | None = None,
) -> str:
    """The GPU memory section: plain HTML, inline CSS and SVG (no script, nothing fetched).

    ``samples`` is the block's :class:`GPUSamples`; ``begin`` and ``end`` are the cluster
    reports at its start and end (OOM events and spill counters come from them; without them
    those parts say so). ``block_peaks`` (``{worker: {device: {task group: peak}}}``, from
    :mod:`dask_rmm.worker.peak_windows`) are the task groups' peaks over the block; without it
    the table compares the peaks since setup at the start and at the end.
    """
    esc = html.escape
    stop = samples.stop if samples.stop is not None else time.time()
    seconds = stop - samples.start
    lost = samples.workers_lost
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
        "included); the cluster line sums the devices. Dashed: the pools' reserved bytes (cluster), "
        "and devices of workers that left. "
        "Times are the workers' clocks.</p>",
    ]
    parts += (
        _task_groups(begin, end) if block_peaks is None else _block_task_groups(end, block_peaks)
    )
    parts += _oom_events(samples, end)
    parts += _spills(begin, end)
    parts.append("</section>")
    return "".join(parts)


def _memory_kind(begin: ClusterMemoryReport | None, end: ClusterMemoryReport | None) -> str:
    """What the workers' stacks hand out: "GPU memory", "Host memory" (``base_resource=
    "system"``, where ``gpu_name`` is ``"host"``) or both, as the reports of the block say."""
    names = {d.gpu_name == "host" for r in (begin, end) if r is not None for d in r.devices}
    if names == {True}:
        return "Host memory"
    if names == {True, False}:
        return "GPU and host memory"
    return "GPU memory"


def _timeline(samples: GPUSamples) -> str:
    used, used_max = samples.summed("used"), samples.summed("used_max")
    reserved = samples.summed("reserved")
    series: list[tuple[str, str, list]] = []
    if used:
        cluster = [(t, u, m) for (t, u), (_, m) in zip(used, used_max, strict=True)]
        series.append(("cluster in use", "running", cluster))
    if reserved:
        series.append(("cluster reserved", "gone", [(t, r, r) for t, r in reserved]))
    for d in samples.devices.values():
        if d.used:
            series.append((d.label, d.status, list(d.used)))
    return timeline_svg(series)


def _task_groups(
    begin: ClusterMemoryReport | None, end: ClusterMemoryReport | None, top: int = 15
) -> list[str]:
    esc = html.escape
    out = ["<h3>Task groups: peak bytes held</h3>"]
    if end is None:
        return out + ["<p>No report at the end of the block.</p>"]
    before = {
        (d.worker, d.device, prefix): peak
        for d in (begin.devices if begin is not None else ())
        for prefix, _, peak in d.task_groups
    }
    rows: dict[str, dict[str, Any]] = {}
    for d in end.devices:
        for prefix, _current, peak in d.task_groups:
            row = rows.setdefault(prefix, {"peak": 0, "where": [], "block": False})
            row["peak"] = max(row["peak"], peak)
            row["where"].append(f"{d.label} {format_bytes(peak)}")
            row["block"] |= before.get((d.worker, d.device, prefix)) != peak
    if not rows:
        return out + ["<p>No task-group attribution (statistics off, or no tasks ran).</p>"]
    body = "".join(
        f"<tr><td>{esc(prefix)}</td><td>{esc(format_bytes(r['peak']))}</td>"
        f"<td>{'yes' if r['block'] else 'before it'}</td><td>{esc('; '.join(r['where']))}</td></tr>"
        for prefix, r in sorted(rows.items(), key=lambda kv: -kv[1]["peak"])[:top]
    )
    return out + [
        "<table><thead><tr><th>task group</th><th>largest peak on one device</th>"
        "<th>peak reached in this block</th><th>per worker device</th></tr></thead>"
        f"<tbody>{body}</tbody></table>",
        '<p class="note">Peaks are counted since each worker\'s dask-rmm setup; "before it": '
        "the peak did not change during this block.</p>",
    ]


def _block_task_groups(
    end: ClusterMemoryReport | None,
    block_peaks: Mapping[str, Mapping[str, Mapping[str, int] | None]],
    top: int = 15,
) -> list[str]:
    """The task groups' peaks over the block, measured on the workers from its start."""
    esc = html.escape
    out = ["<h3>Task groups: peak bytes held during the block</h3>"]
    labels = {(d.worker, d.device): d.label for d in (end.devices if end is not None else ())}
    rows: dict[str, dict[str, Any]] = {}
    unmeasured = []
    for worker, devices in sorted(block_peaks.items()):
        for device, peaks in sorted(devices.items()):
            label = labels.get((worker, device), f"{worker}/dev{device}")
            if peaks is None:
                unmeasured.append(label)
                continue
            for prefix, peak in peaks.items():
                row = rows.setdefault(prefix, {"peak": 0, "where": []})
                row["peak"] = max(row["peak"], peak)
                row["where"].append(f"{label} {format_bytes(peak)}")
    if rows:
        body = "".join(
            f"<tr><td>{esc(prefix)}</td><td>{esc(format_bytes(r['peak']))}</td>"
            f"<td>{esc('; '.join(r['where']))}</td></tr>"
            for prefix, r in sorted(rows.items(), key=lambda kv: -kv[1]["peak"])[:top]
        )
        out.append(
            "<table><thead><tr><th>task group</th><th>largest peak on one device</th>"
            f"<th>per worker device</th></tr></thead><tbody>{body}</tbody></table>"
        )
    else:
        out.append("<p>No task group held memory during the block (or statistics off).</p>")
    note = "Peaks over this block only, measured on each worker from the block's start."
    if unmeasured:
        note += (
            " Not measured over the whole block (the setup was replaced during it): "
            + ", ".join(unmeasured)
            + "."
        )
    return out + [f'<p class="note">{esc(note)}</p>']


def _oom_events(samples: GPUSamples, end: ClusterMemoryReport | None) -> list[str]:
    esc = html.escape
    out = ["<h3>Out-of-memory errors that reached a task</h3>"]
    events = [e for e in (end.oom_events if end is not None else ()) if _in_block(e, samples)]
    if not events:
        return out + ["<p>None during the block.</p>"]
    body = "".join(
        "<tr>"
        + "".join(
            f"<td>{esc(str(c))}</td>"
            for c in (
                time.strftime("%H:%M:%S", time.localtime(float(e.get("time") or 0))),
                f"{e.get('worker')}/dev{e.get('device')}",
                e.get("task_key") or "(none)",
                e.get("verdict"),
                format_bytes(_int(e.get("requested"))),
                format_bytes(_int(e.get("free_bytes"))),
                format_bytes(_int(e.get("largest_free_block"))),
            )
        )
        + "</tr>"
        for e in events
    )
    return out + [
        "<table><thead><tr><th>time</th><th>worker device</th><th>task</th><th>verdict</th>"
        "<th>requested</th><th>free in pool</th><th>largest free block</th></tr></thead>"
        f"<tbody>{body}</tbody></table>",
        '<p class="note">Verdict "fragmentation": enough memory was free, in pieces too small; '
        '"demand": not enough was free.</p>',
    ]


def _in_block(event: Mapping[str, Any], samples: GPUSamples) -> bool:
    try:
        t = float(event.get("time") or 0)
    except (TypeError, ValueError):
        return False
    stop = samples.stop if samples.stop is not None else time.time()
    return samples.start <= t <= stop + 1.0


def _spills(begin: ClusterMemoryReport | None, end: ClusterMemoryReport | None) -> list[str]:
    esc = html.escape
    out = ["<h3>Spilling during the block</h3>"]
    if end is None:
        return out + ["<p>No report at the end of the block.</p>"]
    start = {(d.worker, d.device): d for d in (begin.devices if begin is not None else ())}
    rows = []
    totals = dict.fromkeys(SPILL_COUNTERS, 0)
    for d in end.devices:
        delta = _delta(start.get((d.worker, d.device)), d)
        for k in SPILL_COUNTERS:
            totals[k] += delta[k]
        rows.append((d.label, delta, d.spilled_bytes))
    totals_line = (
        f"<p>Spilled {esc(format_bytes(totals['total_spilled_bytes']))} to host and brought "
        f"{esc(format_bytes(totals['total_unspilled_bytes']))} back; "
        f"{totals['ooms_avoided']} out-of-memory errors avoided by spilling, "
        f"{totals['oom_count']} not avoided; {totals['pauses']} pauses.</p>"
    )
    if not any(totals.values()):
        return out + [totals_line]
    body = "".join(
        f"<tr><td>{esc(label)}</td><td>{esc(format_bytes(delta['total_spilled_bytes']))}</td>"
        f"<td>{esc(format_bytes(delta['total_unspilled_bytes']))}</td>"
        f"<td>{esc(format_bytes(now))}</td><td>{delta['ooms_avoided']}</td>"
        f"<td>{delta['oom_count']}</td><td>{delta['pauses']}</td></tr>"
        for label, delta, now in rows
    )
    return out + [
        totals_line,
        "<table><thead><tr><th>worker device</th><th>spilled</th><th>brought back</th>"
        "<th>on host at the end</th><th>OOMs avoided</th><th>OOMs</th><th>pauses</th></tr>"
        f"</thead><tbody>{body}</tbody></table>",
    ]


def _delta(before: DeviceMemory | None, after: DeviceMemory) -> dict[str, int]:
    """The block's share of each spill counter (all of it for a device new since the start,
    or one whose counters went down: a restarted worker)."""
    out = {}
    for k in SPILL_COUNTERS:
        a = int(getattr(after, k))
        b = int(getattr(before, k)) if before is not None else 0
        out[k] = a - b if a >= b else a
    return out


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


_CSS = (
    ".dask-rmm-gpu{font-family:system-ui,sans-serif;font-size:13px;margin:12px 16px;"
    "padding:8px 12px;border:1px solid #ddd;border-radius:4px;background:#fff}"
    ".dask-rmm-gpu h2{font-size:18px;margin:4px 0}.dask-rmm-gpu h3{font-size:14px;margin:12px 0 4px}"
    ".dask-rmm-gpu table{border-collapse:collapse}"
    ".dask-rmm-gpu th,.dask-rmm-gpu td{padding:2px 8px;border-bottom:1px solid #eee;text-align:left}"
    ".dask-rmm-gpu thead th{background:#f3f3f3}.dask-rmm-gpu .note{color:#666}"
)
