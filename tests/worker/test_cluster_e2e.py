"""Cluster reports end to end: RMMPlugin on a real LocalCluster (worker processes; host memory
without a GPU, device memory with one): report vs. each worker's statistics, the timeline, the
page, the JSON and /metrics over HTTP, and a worker killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
from conftest import HAS_GPU, hold, local_process_cluster, wait_until
from distributed import wait

from dask_rmm.client.fetch import cluster_report
from dask_rmm.plugin import RMMPlugin

pytestmark = pytest.mark.slow

MiB = 1 << 20


def burst(nbytes):
    """Allocate and free at once: raises the peak, not the current bytes."""
    from dask_rmm import DeviceBuffer

    b = DeviceBuffer(size=nbytes)
    del b
    return nbytes


def _statistics(dask_worker=None) -> dict:
    """What the worker's StatisticsResourceAdaptor and pool say now."""
    from dask_rmm.mr import StatisticsResourceAdaptor
    from dask_rmm.mr.registry import get_per_device_resource

    top = mr = get_per_device_resource(0)
    while not isinstance(mr, StatisticsResourceAdaptor):
        mr = mr.upstream_mr
    info = top.reserved_memory_info()
    return dict(
        mr.allocation_counts.to_dict(),
        failed_allocations=mr.failed_allocations,
        reserved_bytes=info.reserved_bytes,
        pool_free_bytes=info.free_bytes,
        largest_free_block=info.largest_free_block,
    )


async def _beat(dask_worker=None) -> None:
    # Returns once the scheduler has handled this heartbeat (and the plugin has read it).
    await dask_worker.heartbeat()


@pytest.fixture(scope="module")
def cluster():
    options = {"base_resource": "cuda" if HAS_GPU else "system", "pool_size": "64MiB"}
    with local_process_cluster() as (cluster, client):
        client.register_plugin(RMMPlugin(**options))
        held = client.map(
            hold, [1 * MiB, 2 * MiB, 3 * MiB, 4 * MiB], key=[f"hold-{i}" for i in range(4)]
        )
        bursts = client.map(burst, [8 * MiB, 12 * MiB], key=["burst-0", "burst-1"])
        wait(held + bursts)
        yield cluster, client, held


def _url(cluster, path: str) -> str:
    return f"http://127.0.0.1:{cluster.scheduler.http_server.port}/{path}"


def test_report_equals_each_workers_statistics(cluster):
    cluster, client, _ = cluster
    client.run(_beat)
    report = cluster_report(client)
    stats = client.run(_statistics)
    assert sorted(report.workers) == sorted(stats)
    for address, st in stats.items():
        d = report.device(address, 0)
        assert d.status == "running"
        for field in (
            "current_bytes",
            "current_count",
            "peak_bytes",
            "total_bytes",
            "total_count",
            "reserved_bytes",
            "pool_free_bytes",
            "largest_free_block",
            "failed_allocations",
        ):
            assert getattr(d, field) == st[field], (address, field)
        assert 0.0 <= d.fragmentation < 1.0
    assert report.totals.current_bytes == 10 * MiB
    assert report.totals.reserved_bytes == 2 * 64 * MiB
    groups = {g.prefix for d in report.devices for g in d.task_groups}
    assert "hold" in groups and "burst" in groups


def test_timeline_has_samples_and_its_peak_matches_the_workers_peaks(cluster):
    cluster, client, _ = cluster

    def matched():
        client.run(_beat)
        r = cluster_report(client)
        ok = all(len(d.timeline) >= 2 and d.timeline_peak == d.peak_bytes for d in r.devices)
        return r if ok else None

    report = wait_until(matched, what="two samples a device, peaks equal to the workers' peaks")
    peaks = {d.peak_bytes for d in report.devices}
    assert max(peaks) >= 8 * MiB
    for d in report.devices:
        times = [s[0] for s in d.timeline]
        assert times == sorted(times) and len(times) >= 2


def test_page_json_and_prometheus_over_http(cluster):
    from prometheus_client.parser import text_string_to_metric_families

    cluster, client, _ = cluster
    client.run(_beat)
    report = cluster_report(client, timeline=False)

    with urllib.request.urlopen(_url(cluster, "dask-rmm"), timeout=10) as r:
        page = r.read().decode()
    assert r.headers["Content-Type"].startswith("text/html")
    assert "<svg" in page and "hold" in page and "<script" not in page

    with urllib.request.urlopen(_url(cluster, "dask-rmm/report.json?timeline=1"), timeout=10) as r:
        data = json.load(r)
    for w in data["workers"]:
        assert w["devices"]["0"]["current_bytes"] == report.device(w["address"]).current_bytes
        assert w["devices"]["0"]["timeline"]

    with urllib.request.urlopen(_url(cluster, "metrics"), timeout=10) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    used = {s.labels["worker"]: s.value for s in fams["dask_rmm_used_bytes"].samples}
    assert used == {d.worker: d.current_bytes for d in report.devices}
    reserved = {s.labels["worker"]: s.value for s in fams["dask_rmm_reserved_bytes"].samples}
    assert set(reserved.values()) == {64 * MiB}
    assert "dask_scheduler_workers" in fams  # distributed's own collectors are still there


def test_worker_killed_mid_run_is_gone_until_its_nanny_restarts_it(cluster, tmp_path):
    cluster, client, _ = cluster
    client.run(_beat)
    before = cluster_report(client)
    victim = sorted(before.workers)[0]
    pid = client.run(os.getpid, workers=[victim])[victim]
    running = client.submit(time.sleep, 30, workers=[victim], key="sleep-0")
    wait_until(
        lambda: running.status == "pending" and client.processing(workers=[victim])[victim],
        what="task running",
    )
    os.kill(pid, signal.SIGKILL)
    report = wait_until(
        lambda: (lambda r: r if any(d.status == "gone" for d in r.devices) else None)(
            cluster_report(client)
        ),
        what="the killed worker marked gone",
    )
    gone = report.device(victim)
    assert gone.status == "gone"
    assert gone.current_bytes == before.device(victim).current_bytes
    assert report.totals.gone_workers == 1
    assert "gone" in str(report)
    assert "gone" in report._repr_html_()
    report.to_frame()
    report.plot(str(tmp_path / "after-kill.png"))
    assert (tmp_path / "after-kill.png").stat().st_size > 0
    # The nanny starts a new process under the same name: the row goes on from the dead one.
    name = before.device(victim).name
    back = wait_until(
        lambda: (lambda r: r if any(d.name == name and d.restarts for d in r.running) else None)(
            cluster_report(client)
        ),
        what="the restarted worker's row",
    )
    (row,) = [d for d in back.devices if d.name == name]
    assert row.status == "running" and row.restarts == 1 and back.totals.gone_workers == 0
    assert row.peak_bytes >= before.device(victim).peak_bytes
    with urllib.request.urlopen(_url(cluster, "dask-rmm"), timeout=10) as r:
        assert "(1 restart)" in r.read().decode()
    running.cancel()
