"""Old module path, kept for ``RMMPlugin`` and ``--preload dask_rmm.cluster``: the scheduler
side is :mod:`dask_rmm.scheduler`, the client side :mod:`dask_rmm.client`."""

from dask_rmm.client import cluster_report
from dask_rmm.report import ClusterMemoryReport
from dask_rmm.scheduler import dask_setup, install_scheduler_plugin
from dask_rmm.wire import PLUGIN_NAME

__all__ = [
    "PLUGIN_NAME",
    "ClusterMemoryReport",
    "cluster_report",
    "dask_setup",
    "install_scheduler_plugin",
]
