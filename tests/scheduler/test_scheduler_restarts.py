"""What the report keeps when a worker's process or stack is replaced: a nanny restart after
``kill -9``, ``client.restart()``, a re-registration. The row of a worker name continues, with
its history and peak; rows and totals say the same about what "peak" covers."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import dask
from conftest import local_process_cluster
from distributed import wait
from distributed.utils_test import gen_cluster

from dask_rmm import DeviceBuffer
from dask_rmm.client.fetch import cluster_report
from dask_rmm.plugin import RMMPlugin

MiB = 1 << 20


def _wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def _rows(report, name: str) -> list:
    return [d for d in report.devices if d.name == name]


def test_a_killed_or_restarted_worker_keeps_its_history_and_the_total_peak():
    # LocalCluster closes a worker's nanny when, lost-worker-timeout (15 s) after the worker
    # left, no worker of its name is registered: the kill below then client.restart() about 15 s
    # later had it close the nanny of "0" while the restart had it down. The kill is what this
    # test does on purpose, so that check waits past the test.
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "10 minutes"}),
        local_process_cluster(n_workers=2) as (_, client),
    ):
        client.register_plugin(RMMPlugin(base_resource="system"))
        workers = client.scheduler_info()["workers"]
        address = next(a for a, w in workers.items() if str(w["name"]) == "0")
        held = client.submit(DeviceBuffer, size=6 * MiB, workers=[address], pure=False)
        wait(held)  # the buffer stays on the worker
        before = _wait_for(
            lambda: (
                (r := cluster_report(client)).totals.peak_bytes
                and r.totals.peak_bytes >= 6 * MiB
                and r
            ),
            what="the 6 MiB to reach the scheduler",
        )
        (row,) = _rows(before, "0")
        first_point = row.timeline[0][0]

        pid = client.run(os.getpid, workers=[address])[address]
        del held
        os.kill(pid, signal.SIGKILL)  # the nanny starts a new process under the same name
        after = _wait_for(
            lambda: (
                (r := cluster_report(client))
                and [d for d in _rows(r, "0") if d.restarts == 1 and d.status == "running"]
                and r
            ),
            what="the restarted worker's first heartbeat",
        )
        (row,) = _rows(after, "0")
        assert row.worker != address and row.current_bytes == 0
        assert row.peak_bytes == 6 * MiB and row.timeline[0][0] == first_point
        assert after.totals.peak_bytes == before.totals.peak_bytes
        assert after.totals.workers == 2 and after.totals.gone_workers == 0

        client.restart()
        again = _wait_for(
            lambda: (
                (r := cluster_report(client))
                and {d.name: d.restarts for d in r.running} == {"0": 2, "1": 1}
                and r
            ),
            what="both workers back after client.restart()",
        )
        (row,) = _rows(again, "0")
        assert row.peak_bytes == 6 * MiB and row.timeline[0][0] == first_point
        assert again.totals.peak_bytes == before.totals.peak_bytes
        assert "2 restarts" in str(again)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_after_re_registering_rows_and_totals_agree_on_the_peak(c, s, a):
    await c.register_plugin(RMMPlugin(base_resource="system"))
    held = c.submit(DeviceBuffer, size=4 * MiB, pure=False)
    await wait(held)
    # Held until a sample has it (the sampler takes each interval's peak every 100 ms).
    while max((d.timeline_peak for d in (await cluster_report(c)).devices), default=0) < 4 * MiB:
        await a.heartbeat()
        await asyncio.sleep(0.05)
    del held
    while (await cluster_report(c)).device(a.address).current_bytes:
        await a.heartbeat()
        await asyncio.sleep(0.05)
    # A new stack: its own statistics start at 0, the worker's history does not.
    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="8MiB"))
    await a.heartbeat()
    report = await cluster_report(c)
    d = report.device(a.address)
    assert "Pool" in d.resource
    assert d.peak_bytes == report.totals.peak_bytes == 4 * MiB
    text = str(report)
    assert "peak: the most each device held at once since the scheduler first saw its worker" in (
        text
    )


def test_a_re_registration_counts_the_samples_the_worker_sends_again_once():
    """Re-registering RMMPlugin: one heartbeat has no dask-rmm entry, then the worker sends the
    samples it had sent already (its sampler keeps them): the cluster total counts them once
    (it read 8 MiB for one device's 4 MiB), and the device keeps its peak."""
    from test_scheduler_validation import _beat, _device, _fake_scheduler, _worker

    from dask_rmm.scheduler.report_build import ReportRequest
    from dask_rmm.scheduler.timeline import SchedulerTimelinePlugin
    from dask_rmm.wire import pack_samples

    plugin = SchedulerTimelinePlugin(timeline_length=64)
    plugin._configure()
    w = _worker(0, {})
    _fake_scheduler(plugin, [w])
    t = time.time()
    for sample in ([t - 0.5, 0, 0], [t - 0.4, 4 * MiB, 4 * MiB], [t - 0.3, 4 * MiB, 4 * MiB]):
        w.metrics = {"dask-rmm": _beat({"0": _device(sample[0], samples=pack_samples([sample]))})}
        plugin.poll()
    w.metrics = {}  # the old plugin torn down (sent at once, read before the next poll)
    plugin._ingest(w)
    again = pack_samples([sample, [t - 0.1, 0, 0]])
    w.metrics = {"dask-rmm": _beat({"0": _device(t, samples=again, current_bytes=0)})}
    plugin.poll()
    report = plugin.snapshot(ReportRequest()).build()
    assert report.totals.peak_bytes == 4 * MiB
    assert report.device(w.address).peak_bytes == 4 * MiB
