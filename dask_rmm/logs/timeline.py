"""Bytes in use over time from RMM allocation logs, one timeline per worker, and its plot
(matplotlib). Not here: reading logs (``reader``), counts and leaks (``summary``)."""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dask_rmm._output import refuse_input, save_figure
from dask_rmm.logs.reader import Action, format_time, read_logs
from dask_rmm.logs.summary import Summarizer

__all__ = ["Timeline", "in_use_timeline", "plot_logs", "timelines_figure"]


def _halved(pts: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Neighbouring pairs of ``(time, bytes)`` merged into the higher of the two (the upper
    envelope), the last point kept."""
    by_bytes = operator.itemgetter(1)
    merged = [max(pts[i], pts[i + 1], key=by_bytes) for i in range(0, len(pts) - 1, 2)]
    return merged if merged[-1] is pts[-1] else [*merged, pts[-1]]


@dataclass
class Timeline:
    """Bytes in use over time for one source: ``times`` (seconds since midnight) and ``bytes``;
    the exact peak is kept even when the curve is thinned to ``max_points``; ``failures`` are
    where allocations failed."""

    source: str
    times: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    peak_time: float | None = None
    #: (time, bytes in use) of the first ``max_points`` allocate failures
    failures: list[tuple[float, int]] = field(default_factory=list)


def in_use_timeline(
    paths: Sequence[str | os.PathLike] | str | os.PathLike,
    max_points: int = 20000,
    *,
    progress: bool = False,
) -> list[Timeline]:
    """Bytes in use over time, one :class:`Timeline` per source (file or ``Worker`` value).

    Long logs are thinned to about ``max_points`` points per source keeping the upper envelope,
    so memory stays bounded and peaks stay visible. ``progress`` draws click's progress bar on
    stderr.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    sources: dict[str, tuple[Summarizer, list[tuple[float, int]], list[tuple[float, int]]]] = {}
    for e in read_logs(paths, progress="reading logs" if progress else None):
        source = sources.get(e.source)
        if source is None:
            source = sources[e.source] = (Summarizer(e.source), [(e.time, 0)], [])
        summary, points, failures = source
        summary.add(e)
        if e.action is not Action.ALLOCATE_FAILURE:
            points.append((e.time, summary.current))
            if len(points) >= 2 * max(16, max_points):
                points[:] = _halved(points)
        elif len(failures) < max_points:
            failures.append((e.time, summary.current))
    out = []
    for name, (s, points, fails) in sorted(sources.items()):
        times, values = [p[0] for p in points], [p[1] for p in points]
        out.append(Timeline(name, times, values, s.peak, s.peak_event and s.peak_event.time, fails))
    return out


def plot_logs(
    paths: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    title: str | None = None,
    max_points: int = 20000,
    progress: bool = False,
) -> list[Timeline]:
    """Plot bytes in use over time, one line per worker (file), each peak marked; save to
    ``output`` (PNG, SVG or PDF by extension) and return the timelines plotted. Needs matplotlib;
    ``progress`` draws click's progress bar on stderr. ValueError when there are no rows."""
    refuse_input(output, paths)
    timelines = in_use_timeline(paths, max_points=max_points, progress=progress)
    if not timelines:
        raise ValueError("no allocation rows to plot in " + ", ".join(map(str, paths)))
    fig = timelines_figure(timelines, title=title)
    save_figure(fig, output)
    return timelines


def timelines_figure(timelines: Sequence[Timeline], *, title: str | None = None) -> Any:
    """The matplotlib Figure :func:`plot_logs` saves: bytes in use over time per worker, each
    peak marked and labelled, the legend outside the data area."""
    from dask_rmm.plotting.figures import byte_axis, figure, legend_outside
    from dask_rmm.sizes import format_bytes

    fig = figure("plotting allocation logs", figsize=(10, 5), dpi=110, layout="constrained")
    t0 = min(tl.times[0] for tl in timelines if tl.times)
    top = max(tl.peak_bytes for tl in timelines)
    span = max((tl.times[-1] - t0 for tl in timelines if tl.times), default=0.0)
    ax = fig.subplots()
    for tl in timelines:
        xs = [t - t0 for t in tl.times]
        (line,) = ax.step(xs, tl.bytes, where="post", linewidth=1.2, label=tl.source)
        if tl.peak_time is not None:
            peak, color = (tl.peak_time - t0, tl.peak_bytes), line.get_color()
            ax.plot(*peak, marker="v", color=color, markersize=8)
            # A label right of a peak in the right half would run past the axes.
            right_half = peak[0] > 0.5 * span
            ax.annotate(
                f"peak {format_bytes(tl.peak_bytes)}",
                peak,
                textcoords="offset points",
                xytext=(-4 if right_half else 4, 6),
                ha="right" if right_half else "left",
                fontsize=8,
                color=color,
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.8, "lw": 0},
                zorder=4,  # over the other workers' lines
            )
    if fails := [(t - t0, b) for tl in timelines for t, b in tl.failures]:
        label = f"allocate failure ({len(fails)})"
        ax.scatter(*zip(*fails, strict=True), marker="x", color="red", zorder=3, label=label)
    ax.set_xlabel(f"seconds since {format_time(t0)}")
    ax.set_ylabel("bytes in use")
    byte_axis(ax.yaxis, top)
    ax.set_title(title or "RMM allocations: bytes in use")
    ax.set_ylim(bottom=0, top=top * 1.12 if top else 1)
    ax.grid(True, alpha=0.3)
    if len(timelines) > 1 or timelines[0].source:
        legend_outside(ax, fontsize=8)
    return fig
