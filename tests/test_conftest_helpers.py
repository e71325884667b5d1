"""The test helpers' own behaviour where it decides what a test run reports."""

from __future__ import annotations

import psutil
from conftest import close_patiently
from distributed import LocalCluster


def test_a_close_timed_out_by_load_closes_the_rest_and_waits_for_the_processes(monkeypatch):
    """When distributed's close gives up (its nanny's 5 s for a worker process to exit passed
    on a loaded host), the scheduler is closed anyway and the worker processes are waited for."""
    cluster = LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
    )
    pids = [w.pid for w in cluster.workers.values()]
    scheduler = cluster.scheduler
    real_close = cluster.close

    asked = []

    def close_like_a_loaded_host(timeout=None):
        asked.append(timeout)
        monkeypatch.setattr(cluster, "close", real_close)
        raise TimeoutError("a nanny's worker process did not exit within 5 s")

    monkeypatch.setattr(cluster, "close", close_like_a_loaded_host)
    try:
        close_patiently(cluster)
        assert asked and asked[0] is not None and asked[0] > 0  # distributed's close is bounded
        assert scheduler.status.name in ("closed", "closing")
        running = [
            p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
        ]
        assert running == []
    finally:
        # The cluster object itself: its scheduler is gone, so no goodbye to it (which would
        # try to connect for 30 s).
        cluster.scheduler_comm = None
        real_close()
