"""The Dask layer the way users break it: a worker killed mid-run and restarted by its nanny,
restarts under the same name, commands run twice, bad arguments. Each test is a defect found by
probing, or a probe that must keep passing (host memory, no GPU)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
from conftest import HAS_GPU, hold, local_process_cluster, wait_until
from distributed import Worker, wait
from distributed.utils_test import gen_cluster
from fake_metrics import FakeRMMMetrics

from dask_rmm.client import cluster_report
from dask_rmm.plugin import RMMPlugin
from dask_rmm.scheduler import install_scheduler_plugin

MiB = 1 << 20


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_worker_back_under_its_name_is_one_row(c, s, a):
    """A nanny restart or ``client.restart()`` brings a worker back under its name at a new
    address: the report listed it twice, ``running`` and ``gone``."""
    await install_scheduler_plugin(c)
    for incarnation in range(3):
        async with Worker(s.address, nthreads=1, name="w") as w:
            w.metrics["dask-rmm"] = fake = FakeRMMMetrics(("0",))
            fake["0"].allocate((incarnation + 1) * MiB)
            await w.heartbeat()
            report = await cluster_report(c)
            rows = [d for d in report.devices if d.name == "w"]
            assert [(d.worker, d.status) for d in rows] == [(w.address, "running")]
            assert rows[0].current_bytes == (incarnation + 1) * MiB
        while len(s.workers) > 1:
            await asyncio.sleep(0.01)
    report = await cluster_report(c)
    assert [d.status for d in report.devices if d.name == "w"] == ["gone"]
    assert report.totals.gone_workers == 1


@pytest.mark.slow
def test_a_worker_killed_mid_run_comes_back_as_one_row_and_every_tool_still_works(tmp_path):
    """SIGKILL a worker process while its tasks hold memory: the report, ``dask rmm report``
    and ``dask rmm log summary`` work, and after the nanny's restart the worker is one row."""
    with local_process_cluster() as (cluster, client):
        client.register_plugin(
            RMMPlugin(
                base_resource="cuda" if HAS_GPU else "system",
                pool_size="16MiB",
                log_directory=str(tmp_path),
            )
        )
        info = client.scheduler_info()["workers"]
        victim, name = sorted((a, w["name"]) for a, w in info.items())[0]
        held = client.map(hold, [MiB] * 3, workers=[victim], pure=False)
        wait(held)
        wait_until(
            lambda: any(
                d.worker == victim and d.current_bytes == 3 * MiB
                for d in cluster_report(client).devices
            ),
            what="the victim's held memory in the report",
        )
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)

        def back():
            workers = client.scheduler_info()["workers"]
            new = [a for a, w in workers.items() if w["name"] == name and a != victim]
            if not new:
                return None
            report = cluster_report(client)
            return report if any(d.worker == new[0] for d in report.devices) else None

        report = wait_until(back, 60, "the restarted worker's first dask-rmm heartbeat")
        rows = [d for d in report.devices if d.name == str(name)]
        assert [d.status for d in rows] == ["running"], report
        assert report.totals.gone_workers == 0
        client.cancel(held)
        cli = [sys.executable, "-m", "dask_rmm.cli"]
        out = subprocess.run(
            [*cli, "report", cluster.scheduler_address, "--timeout", "20"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout.count(f"({name})") == 1
        logs = sorted(str(p) for p in tmp_path.iterdir())
        out = subprocess.run(
            [*cli, "log", "summary", *logs], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
