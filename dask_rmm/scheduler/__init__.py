"""The scheduler side of dask-rmm: the timeline plugin (``timeline.py``), its HTTP pages
(``http.py``) and Prometheus metrics (``prometheus.py``), and how to install the plugin.

``dask scheduler --preload dask_rmm.scheduler`` installs it at scheduler start.
"""

from __future__ import annotations

from typing import Any

from distributed import Client, Scheduler, Worker
from distributed.protocol.pickle import dumps

from dask_rmm.scheduler.timeline import SchedulerTimelinePlugin, Timeline
from dask_rmm.wire import PLUGIN_NAME

__all__ = ["SchedulerTimelinePlugin", "Timeline", "dask_setup", "install_scheduler_plugin"]


def install_scheduler_plugin(target: Client | Worker | Scheduler | Any, **options: Any):
    """Install :class:`SchedulerTimelinePlugin` (with ``options``) on the scheduler from
    ``target`` (a Client, Worker, Scheduler, or an rpc to the scheduler), unless one is there.

    ``RMMPlugin.setup`` calls it with its worker and ``cluster_report`` with its client's
    ``scheduler`` rpc, so users never need to; it is idempotent. Returns None for a synchronous
    Client, otherwise an awaitable.
    """
    plugin = SchedulerTimelinePlugin(**options)
    if isinstance(target, Client):
        return target.register_plugin(plugin, name=PLUGIN_NAME)
    if isinstance(target, Scheduler):
        return target.register_scheduler_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    rpc = target.scheduler if isinstance(target, Worker) else target
    return rpc.register_scheduler_plugin(plugin=dumps(plugin), name=PLUGIN_NAME, idempotent=True)


def dask_setup(scheduler: Any) -> None:
    """``dask scheduler --preload dask_rmm.scheduler``: install the plugin at scheduler start."""
    if isinstance(scheduler, Scheduler):
        scheduler.add_plugin(SchedulerTimelinePlugin(), name=PLUGIN_NAME, idempotent=True)
