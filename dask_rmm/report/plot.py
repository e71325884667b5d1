"""ClusterMemoryReport.plot: memory over time per worker device, and per-task-group peaks, as a
matplotlib figure (Agg backend, imported on first use). The dashboard's SVG is in ``svg.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_rmm._output import atomic_output
from dask_rmm.mr.base import format_bytes
from dask_rmm.report.svg import PALETTE, _byte_step

if TYPE_CHECKING:
    from dask_rmm.report.memory_report import ClusterMemoryReport

__all__ = ["byte_axis", "figure", "legend_outside", "plot_report"]


def figure(what: str, **kwargs: Any):
    """A matplotlib Figure on the Agg canvas (no pyplot state, no display); without matplotlib
    an ImportError saying that ``what`` needs it."""
    try:
        import matplotlib  # noqa: F401  (first: its submodules may be loaded already)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            f"{what} needs matplotlib: pip install matplotlib (or pip install 'dask-rmm[report]')"
        ) from e
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def byte_axis(axis: Any, top: float) -> None:
    """Label ``axis`` in bytes (``format_bytes``), with ticks at round binary sizes up to ``top``."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    axis.set_major_formatter(FuncFormatter(lambda v, _pos: format_bytes(v)))
    if top > 0:
        axis.set_major_locator(MultipleLocator(_byte_step(top)))


def legend_outside(ax: Any, **kwargs: Any) -> Any:
    """``ax``'s legend to the right of its data area, never over a line, a bar or a label in
    it; the figure's layout (constrained or tight) makes room for it."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def plot_report(report: ClusterMemoryReport, path: str | None = None, *, top_task_groups: int = 10):
    """Draw ``report`` (see :meth:`ClusterMemoryReport.plot`); write a PNG to ``path`` if given."""
    fig = figure("ClusterMemoryReport.plot", figsize=(11, 7.5), layout="constrained")
    ax_t, ax_g = fig.subplots(2, 1, height_ratios=[3, 2])

    with_samples = [d for d in report.devices if d.timeline]
    t0 = min((d.timeline[0][0] for d in with_samples), default=0.0)
    for i, d in enumerate(with_samples):
        ts = [s[0] - t0 for s in d.timeline]
        color = PALETTE[i % len(PALETTE)]
        style = "-" if d.status == "running" else "--"
        ax_t.plot(ts, [s[2] for s in d.timeline], style, color=color, lw=1.4, label=d.label)
        ax_t.plot(ts, [s[1] for s in d.timeline], ":", color=color, lw=0.8, alpha=0.7)
    ax_t.set_title(
        "RMM memory over time per worker device (solid: max per interval, dotted: current)"
    )
    ax_t.set_xlabel("seconds since the oldest sample")
    ax_t.set_ylabel("bytes")
    byte_axis(ax_t.yaxis, max((s[2] for d in with_samples for s in d.timeline), default=0))
    ax_t.set_ylim(bottom=0)
    ax_t.grid(alpha=0.3)
    if with_samples:
        legend_outside(ax_t, fontsize=8, ncols=1 + len(with_samples) // 16)
    else:
        ax_t.text(0.5, 0.5, "no samples yet", ha="center", transform=ax_t.transAxes)

    groups = list(report.task_group_peaks().items())[:top_task_groups][::-1]
    labels = sorted({who for _, per in groups for who in per})
    left = [0] * len(groups)
    for i, who in enumerate(labels):
        widths = [per.get(who, 0) for _, per in groups]
        ax_g.barh(
            [g for g, _ in groups], widths, left=left, color=PALETTE[i % len(PALETTE)], label=who
        )
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax_g.set_title("peak bytes per task group, stacked by worker device")
    byte_axis(ax_g.xaxis, max(left, default=0))
    ax_g.grid(axis="x", alpha=0.3)
    if groups:
        legend_outside(ax_g, fontsize=8)
    else:
        ax_g.text(0.5, 0.5, "no task-group attribution", ha="center", transform=ax_g.transAxes)

    t = report.totals
    fig.suptitle(
        f"dask-rmm cluster memory: {t.workers} workers, {format_bytes(t.current_bytes)} used, "
        f"{format_bytes(t.reserved_bytes)} reserved, {t.failed_allocations} failed allocations"
    )
    if path is not None:
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=100)
    return fig
