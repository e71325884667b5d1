"""Cluster memory reports on the client: :class:`ClusterMemoryReport` and its renderings (text,
HTML, dict, DataFrame; the SVG timeline in :mod:`~dask_rmm.report.svg`, matplotlib figures in
:mod:`~dask_rmm.report.plot`) and fetching one from the scheduler (:func:`cluster_report`, in
:mod:`~dask_rmm.report.fetch`); over a block of work, :mod:`~dask_rmm.report.sampler` and
:mod:`~dask_rmm.report.performance`; sizing advice, :mod:`~dask_rmm.report.advice`.
Importing this package imports no Dask; fetching does.
"""

from __future__ import annotations

from dask_rmm.report.memory_report import (
    ClusterMemoryReport,
    ClusterTotals,
    DeviceMemory,
    peak_of_sum,
)

__all__ = ["ClusterMemoryReport", "ClusterTotals", "DeviceMemory", "cluster_report", "peak_of_sum"]


def __getattr__(name: str):
    if name == "cluster_report":  # imports distributed: on first use only
        from dask_rmm.report.fetch import cluster_report

        return cluster_report
    raise AttributeError(f"module 'dask_rmm.report' has no attribute {name!r}")
