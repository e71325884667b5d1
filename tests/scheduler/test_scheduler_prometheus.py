"""dask_rmm_* gauges on the scheduler's /metrics, parsed with prometheus_client's parser."""

from __future__ import annotations

import asyncio

import pytest
from distributed.utils_test import gen_cluster

pytest.importorskip("prometheus_client")

from fake_metrics import FakeRMMMetrics  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tornado.httpclient import AsyncHTTPClient  # noqa: E402

from dask_rmm.client.fetch import cluster_report  # noqa: E402
from dask_rmm.scheduler import install_scheduler_plugin  # noqa: E402
from dask_rmm.wire import PLUGIN_NAME  # noqa: E402


async def _families(s) -> dict:
    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")
    text = r.body.decode()
    return {
        f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("dask_rmm")
    }


def _by_worker(family) -> dict:
    return {(s.labels["worker"], s.labels["device"]): s.value for s in family.samples}


@gen_cluster(client=True)
async def test_gauges_match_worker_statistics(c, s, a, b):
    fa, fb = FakeRMMMetrics(), FakeRMMMetrics(("0", "1"))
    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = fa, fb
    fa["0"].allocate(1000)
    fa["0"].allocate(500)
    fa["0"].free(500)
    fa["0"].failures = 2
    fb["1"].allocate(4096)
    await install_scheduler_plugin(c)
    await a.heartbeat()
    await b.heartbeat()

    fams = await _families(s)
    used = _by_worker(fams["dask_rmm_used_bytes"])
    assert used == {(a.address, "0"): 1000, (b.address, "0"): 0, (b.address, "1"): 4096}
    assert _by_worker(fams["dask_rmm_peak_bytes"])[a.address, "0"] == 1500
    assert _by_worker(fams["dask_rmm_reserved_bytes"])[a.address, "0"] == fa["0"].reserved
    assert (
        _by_worker(fams["dask_rmm_largest_free_block_bytes"])[a.address, "0"]
        == fa["0"].reserved - 1000
    )
    assert fams["dask_rmm_failed_allocations"].type == "counter"
    assert _by_worker(fams["dask_rmm_failed_allocations"])[a.address, "0"] == 2
    assert "dask_rmm_pool_free_bytes" in fams and "dask_rmm_fragmentation_ratio" in fams
    workers = {s.labels["status"]: s.value for s in fams["dask_rmm_workers"].samples}
    assert workers == {"running": 2, "gone": 0}


@gen_cluster(client=True)
async def test_no_double_registration_and_unregister(c, s, a, b):
    a.metrics["dask-rmm"] = FakeRMMMetrics()
    await install_scheduler_plugin(c)
    await a.heartbeat()
    await c.unregister_scheduler_plugin(PLUGIN_NAME)
    assert "dask_rmm_used_bytes" not in await _families(s)  # no stale series
    await install_scheduler_plugin(c)
    await install_scheduler_plugin(c)
    fams = await _families(s)
    assert len(fams["dask_rmm_used_bytes"].samples) == 1


@gen_cluster(client=True)
async def test_fragmentation_ratio_is_absent_for_a_pool_with_nothing_in_use(c, s, a, b):
    fa, fb = FakeRMMMetrics(), FakeRMMMetrics()
    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = fa, fb
    fa["0"].largest_free = fb["0"].largest_free = fa["0"].reserved // 2  # two free chunks
    fa["0"].allocate(1000)
    await install_scheduler_plugin(c)
    await a.heartbeat()
    await b.heartbeat()
    frag = _by_worker((await _families(s))["dask_rmm_fragmentation_ratio"])
    assert set(frag) == {(a.address, "0")}  # b's pool is idle: no figure, not 50 %
    assert 0.0 < frag[a.address, "0"] < 1.0


@gen_cluster(client=True, config={"dask-rmm.scheduler.prometheus-device-limit": 1})
async def test_every_device_is_on_dask_rmm_metrics_above_the_limit_with_dcgm_labels(c, s, a, b):
    fa, fb = FakeRMMMetrics(), FakeRMMMetrics(("0", "1"))
    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = fa, fb
    fa["0"].extra.update(gpu_uuid="GPU-1234", gpu_name="NVIDIA H100", pci_bus_id="0000:3B:00.0")
    fa["0"].allocate(1000)
    fb["1"].allocate(4096)
    await install_scheduler_plugin(c)
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    assert "dask_rmm_used_bytes" not in await _families(s)  # 3 devices > the limit of 1
    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/dask-rmm/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
    used = _by_worker(fams["dask_rmm_used_bytes"])
    assert used == {(a.address, "0"): 1000, (b.address, "0"): 0, (b.address, "1"): 4096}
    (labels,) = [
        x.labels for x in fams["dask_rmm_used_bytes"].samples if x.labels["worker"] == a.address
    ]
    assert labels["UUID"] == "GPU-1234" and labels["modelName"] == "NVIDIA H100"
    assert labels["pci_bus_id"] == "0000:3B:00.0" and labels["Hostname"] == "127.0.0.1"
    assert "dask_rmm_cluster_current_bytes" not in fams  # the totals stay on /metrics


@gen_cluster(client=True)
async def test_every_route_asked_at_once_shares_one_snapshot(c, s, a, b):
    a.metrics["dask-rmm"] = FakeRMMMetrics()
    await install_scheduler_plugin(c)
    await a.heartbeat()
    plugin = s.plugins[PLUGIN_NAME]
    taken = []
    take = plugin._take_shared
    plugin._take_shared = lambda: (taken.append(1), take())[1]
    http = AsyncHTTPClient()
    base = f"http://127.0.0.1:{s.http_server.port}/"
    paths = ["dask-rmm", "dask-rmm/report.json", "dask-rmm/metrics", "dask-rmm?top=1"]
    answers = await asyncio.gather(*(http.fetch(base + p) for p in paths), cluster_report(c))
    assert all(x.code == 200 for x in answers[:-1]) and answers[-1].device(a.address)
    assert len(taken) == 1
    await a.heartbeat()  # a heartbeat read since: the next route takes a new one
    await cluster_report(c)
    assert len(taken) == 2


@gen_cluster(client=True)
async def test_a_large_clusters_scrape_serves_device_series_made_in_the_report_thread(c, s, a, b):
    from dask_rmm.scheduler import timeline

    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = FakeRMMMetrics(), FakeRMMMetrics()
    await install_scheduler_plugin(c)
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    plugin = s.plugins[PLUGIN_NAME]
    old, timeline.SHARE_ABOVE = timeline.SHARE_ABOVE, 0  # two workers count as many
    try:
        first = await _families(s)  # nothing made yet: the totals, and a build started
        assert "dask_rmm_used_bytes" not in first and first["dask_rmm_devices"].samples
        while plugin._made.get("families") is None:
            await asyncio.sleep(0.01)
        used = _by_worker((await _families(s))["dask_rmm_used_bytes"])
        assert set(used) == {(a.address, "0"), (b.address, "0")}
    finally:
        timeline.SHARE_ABOVE = old


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 8)
async def test_every_device_of_a_cluster_above_500_devices_has_its_series(c, s, *workers):
    devices = tuple(str(d) for d in range(64))  # 8 x 64 = 512, above the default limit of 500
    fakes = {}
    for w in workers:
        fakes[w.address] = w.metrics["dask-rmm"] = FakeRMMMetrics(devices)
        for d in devices:
            fakes[w.address][d].allocate(1024 * (1 + int(d)))
    await install_scheduler_plugin(c)
    await asyncio.gather(*(w.heartbeat() for w in workers))
    on_metrics = await _families(s)
    assert on_metrics["dask_rmm_devices"].samples[0].value == 512
    assert "dask_rmm_used_bytes" not in on_metrics  # /metrics: the totals above the limit
    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/dask-rmm/metrics")
    assert "Etag" not in r.headers  # no hash of the whole body on the event loop
    fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
    used = _by_worker(fams["dask_rmm_used_bytes"])
    assert used == {(w.address, d): 1024 * (1 + int(d)) for w in workers for d in devices}
    assert len(_by_worker(fams["dask_rmm_reserved_bytes"])) == 512


@gen_cluster(client=True)
async def test_a_large_clusters_scrape_serves_the_totals_of_the_shared_snapshot(c, s, a, b):
    from dask_rmm.scheduler import timeline

    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = FakeRMMMetrics(), FakeRMMMetrics(("0", "1"))
    a.metrics["dask-rmm"]["0"].allocate(1000)
    b.metrics["dask-rmm"]["1"].allocate(4096)
    await install_scheduler_plugin(c)
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    plugin = s.plugins[PLUGIN_NAME]
    small = await _families(s)
    old, timeline.SHARE_ABOVE = timeline.SHARE_ABOVE, 0  # two workers count as many
    try:
        await _families(s)  # starts the build
        while plugin._made.get("families") is None:
            await asyncio.sleep(0.01)
        large = await _families(s)
    finally:
        timeline.SHARE_ABOVE = old
    assert large["dask_rmm_cluster_current_bytes"].samples[0].value == 5096
    assert set(large) == set(small)  # the device series too (3 devices, below the limit)
    for name in small:
        if name.startswith("dask_rmm_cluster_") or name in ("dask_rmm_workers", "dask_rmm_devices"):
            assert large[name].samples == small[name].samples, name
