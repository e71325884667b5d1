"""The cluster memory report as data: :class:`ClusterMemoryReport` and its renderings (text,
HTML, dict, DataFrame; matplotlib figures in :mod:`~dask_rmm.report.plot`). Dask-free, below
the scheduler that builds it. Not here: fetching a report from a cluster, sampling it over a
block of work, performance reports and advice (:mod:`dask_rmm.client`).
"""

from __future__ import annotations

from dask_rmm.report.memory_report import (
    ClusterMemoryReport,
    ClusterTotals,
    DeviceMemory,
    peak_of_sum,
)

__all__ = ["ClusterMemoryReport", "ClusterTotals", "DeviceMemory", "peak_of_sum"]
