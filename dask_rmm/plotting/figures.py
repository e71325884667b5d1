"""Matplotlib helpers shared by the report's and the allocation logs' plots: an Agg figure with
no pyplot state, byte-labelled axes, a legend outside the data. Not here: what is plotted
(``dask_rmm.report.plot``, ``dask_rmm.logs.timeline``), the dashboard's SVG (``svg.py``)."""

from __future__ import annotations

from typing import Any

from dask_rmm.plotting.svg import byte_step
from dask_rmm.sizes import format_bytes

__all__ = ["byte_axis", "figure", "legend_outside"]


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
        axis.set_major_locator(MultipleLocator(byte_step(top)))


def legend_outside(ax: Any, **kwargs: Any) -> Any:
    """``ax``'s legend to the right of its data area, never over a line, a bar or a label in
    it; the figure's layout (constrained or tight) makes room for it."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)
