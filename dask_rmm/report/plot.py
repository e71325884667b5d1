"""ClusterMemoryReport.plot: memory over time per worker device, and per-task-group peaks, as a
matplotlib figure (Agg backend, imported on first use). The dashboard's SVG is in
``dask_rmm.plotting.svg``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_rmm._output import save_figure
from dask_rmm.plotting.figures import byte_axis, figure, legend_outside
from dask_rmm.plotting.svg import PALETTE
from dask_rmm.sizes import format_bytes

if TYPE_CHECKING:
    from dask_rmm.report.memory_report import ClusterMemoryReport

__all__ = ["plot_report"]


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
    # statistics=False leaves figures out of the totals (None): not measured
    used = "n/a" if t.current_bytes is None else format_bytes(t.current_bytes)
    reserved = "n/a" if t.reserved_bytes is None else format_bytes(t.reserved_bytes)
    failed = "n/a" if t.failed_allocations is None else t.failed_allocations
    fig.suptitle(
        f"dask-rmm cluster memory: {t.workers} workers, {used} used, {reserved} reserved, "
        f"{failed} failed allocations"
    )
    if path is not None:
        save_figure(fig, path, dpi=100)
    return fig
