"""SchedulerTimelinePlugin and cluster_report, driven by synthetic worker metrics (gen_cluster)."""

from __future__ import annotations

import asyncio
import json
import time

import dask
import pytest
from distributed.utils_test import captured_logger, gen_cluster
from fake_metrics import FakeRMMMetrics

from dask_rmm.client.fetch import cluster_report
from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.scheduler import SchedulerTimelinePlugin, install_scheduler_plugin
from dask_rmm.wire import PLUGIN_NAME, heartbeat


def _attach(*workers, devices=("0",)) -> list[FakeRMMMetrics]:
    fakes = []
    for w in workers:
        fake = FakeRMMMetrics(devices)
        w.metrics["dask-rmm"] = fake
        fakes.append(fake)
    return fakes


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "10"])
def test_plugin_validates_timeline_length(bad):
    with pytest.raises(ValueError, match="timeline_length"):
        SchedulerTimelinePlugin(timeline_length=bad)


def test_plugin_pickles_only_its_options():
    import pickle

    p = SchedulerTimelinePlugin(timeline_length=7, keep_gone=3)
    p._records["x"] = object()
    q = pickle.loads(pickle.dumps(p))
    assert (q.timeline_length, q.keep_gone, q._records) == (7, 3, {})


# -- scheduler plugin --------------------------------------------------------------------------


@gen_cluster(client=True)
async def test_report_equals_worker_statistics_and_timeline(c, s, a, b):
    fa, fb = _attach(a, b)
    await install_scheduler_plugin(c)
    fa["0"].allocate(1000, "inc")
    fa["0"].allocate(3000, "sum")
    fa["0"].free(3000, "sum")
    fb["0"].allocate(512, "inc")
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    fa["0"].allocate(200, "inc")
    await a.heartbeat()

    report = await cluster_report(c)
    assert isinstance(report, ClusterMemoryReport)
    da = report.device(a.address, 0)
    assert (da.current_bytes, da.peak_bytes, da.total_bytes) == (1200, 4000, 4200)
    assert da.pool_free_bytes == fa["0"].reserved - 1200
    assert da.status == "running"
    assert da.timeline_peak == da.peak_bytes == 4000
    assert [s[1] for s in da.timeline] == [1000, 4000, 1000, 1200]
    assert da.task_groups[0] == ("sum", 0, 3000)
    db = report.device(b.address, "0")
    assert (db.current_bytes, db.timeline_peak) == (512, 512)
    t = report.totals
    assert (t.workers, t.devices, t.current_bytes) == (2, 2, 1712)
    # b's 512 came after a's 4000 went back to 1000: the cluster never held 4512 at once.
    assert (t.peak_bytes, t.sum_of_device_peaks) == (4000, 4512)
    assert report.workers_without_dask_rmm == ()


@gen_cluster(client=True)
async def test_install_is_idempotent_and_leaves_the_heartbeat_handler_alone(c, s, a, b):
    original = s.handlers["heartbeat_worker"]
    await install_scheduler_plugin(c)
    plugin = s.plugins[PLUGIN_NAME]
    await install_scheduler_plugin(c)
    await install_scheduler_plugin(a)
    assert s.plugins[PLUGIN_NAME] is plugin
    assert s.handlers["heartbeat_worker"] is original


@gen_cluster(client=True)
async def test_a_heartbeat_the_poll_missed_loses_no_samples(c, s, a, b):
    (fa,) = _attach(a)
    await install_scheduler_plugin(c)
    plugin = s.plugins[PLUGIN_NAME]
    plugin._poller.stop()  # only the explicit polls below read heartbeats
    fa["0"].allocate(10)
    await a.heartbeat()
    plugin.poll()
    fa["0"].allocate(20)
    await a.heartbeat()  # never polled: the next heartbeat repeats its samples
    fa["0"].allocate(30)
    await a.heartbeat()
    plugin.poll()
    report = await cluster_report(c)
    assert [s[1] for s in report.device(a.address).timeline] == [10, 30, 60]


@gen_cluster(client=True)
async def test_cluster_report_installs_the_plugin_when_absent(c, s, a, b):
    (fa,) = _attach(a)
    fa["0"].allocate(4096)
    await a.heartbeat()
    assert PLUGIN_NAME not in s.plugins
    report = await cluster_report(c)
    assert PLUGIN_NAME in s.plugins
    assert report.device(a.address).current_bytes == 4096
    assert report.workers_without_dask_rmm == (b.address,)


@gen_cluster(client=True)
async def test_worker_from_worker_side_install(c, s, a, b):
    # The path RMMPlugin.setup takes: the worker asks the scheduler over its rpc.
    await asyncio.gather(install_scheduler_plugin(a), install_scheduler_plugin(b))
    assert isinstance(s.plugins[PLUGIN_NAME], SchedulerTimelinePlugin)


@gen_cluster(client=True, nthreads=[("", 1)] * 3)
async def test_worker_that_leaves_is_marked_gone_and_report_renders(c, s, a, b, w3):
    _attach(a, b, w3)[2]["0"].allocate(777)
    await install_scheduler_plugin(c)
    await asyncio.gather(a.heartbeat(), b.heartbeat(), w3.heartbeat())
    await cluster_report(c)  # the plugin has read w3's heartbeat (it polls every 0.1 s)
    await w3.close()
    while w3.address in s.workers:
        await asyncio.sleep(0.01)
    report = await cluster_report(c)
    gone = report.device(w3.address)
    assert gone.status == "gone" and gone.current_bytes == 777
    assert report.totals.gone_workers == 1
    assert report.totals.workers == 2
    assert report.devices[-1].worker == w3.address  # gone ones last
    assert "gone" in str(report) and "gone" in report._repr_html_()
    ClusterMemoryReport.from_dict(json.loads(report.to_json()))


@gen_cluster(client=True, nthreads=[("", 1)] * 4)
async def test_keep_gone_bounds_departed_workers(c, s, *workers):
    _attach(*workers)
    await c.register_plugin(SchedulerTimelinePlugin(keep_gone=1))
    await asyncio.gather(*(w.heartbeat() for w in workers))
    await cluster_report(c)
    for w in workers[2:]:
        await w.close()
    while len(s.workers) > 2:
        await asyncio.sleep(0.01)
    report = await cluster_report(c, timeline=False)
    assert [d.worker for d in report.gone] == [workers[3].address]


class _Arrival:
    """What the plugin reads of a WorkerState: address, name, metrics."""

    def __init__(self, address: str, name: str, t: float):
        from dask_rmm.wire import pack_samples

        self.address, self.name = address, name
        blob = pack_samples([[t, 1 << 20, 1 << 20]])
        self.metrics = {"dask-rmm": heartbeat(name, t, {"0": {"samples": blob}})}


def test_departed_records_kept_continued_and_forgotten_like_a_model():
    """Arrivals and departures in a random order: the gone records are the newest
    ``keep_gone`` departures, a name or address that comes back continues its record, and no
    forgotten record keeps a row of the cluster total (one record per address)."""
    import random
    import time

    rng = random.Random(7)
    plugin = SchedulerTimelinePlugin(keep_gone=3)
    running: dict[str, str] = {}  # address -> name
    gone: list[tuple[str, str]] = []  # (address, name), oldest first: the model
    t = time.time() - 1000
    for _ in range(400):
        t += 1
        address = f"tcp://127.0.0.1:{rng.randrange(12)}"
        if address in running and rng.random() < 0.6:
            plugin.remove_worker(None, address)
            gone.append((address, running.pop(address)))
            del gone[: max(0, len(gone) - 3)]
        elif address not in running:
            name = f"w{rng.randrange(12)}"
            if name in running.values():
                continue
            plugin._ingest(_Arrival(address, name, t))
            running[address] = name
            # The oldest gone record of that name or address is continued here; another
            # one left from this address is forgotten.
            match = next((g for g in gone if g[1] == name or g[0] == address), None)
            gone = [g for g in gone if g != match and g[0] != address]
        records = plugin._records
        assert [(a, r.name) for a, r in records.items() if r.status == "gone"] == gone
        assert {a: r.name for a, r in records.items() if r.status == "running"} == running
        assert all(r.address == a for a, r in records.items())
        assert plugin._total.rows == sum(len(r.rows) for r in records.values())


@gen_cluster(client=True)
async def test_timeline_length_from_config_and_bounded(c, s, a, b):
    (fa,) = _attach(a)
    with dask.config.set({"dask-rmm.scheduler.timeline-length": 5}):
        await install_scheduler_plugin(c)
    for _ in range(12):
        fa["0"].allocate(1)
    await a.heartbeat()
    first_sample = fa["0"].previous_batch[0][0]
    report = await cluster_report(c)
    assert report.timeline_length == 5
    timeline = report.device(a.address).timeline
    # Fewer points than samples, reaching back to the first, the newest and the peak kept.
    assert 2 <= len(timeline) <= 5
    assert timeline[0][0] == first_sample and timeline[-1][1:] == (12, 12)
    assert max(p[2] for p in timeline) == 12
    last = await cluster_report(c, last=2)
    assert last.device(a.address).timeline == timeline[-2:]
    bare = await cluster_report(c, timeline=False)
    assert bare.device(a.address).timeline == ()


@gen_cluster(client=True)
async def test_several_devices_per_worker(c, s, a, b):
    (fa,) = _attach(a, devices=("0", "1"))
    fa["1"].allocate(10)
    await install_scheduler_plugin(c)
    await a.heartbeat()
    report = await cluster_report(c)
    assert [(d.device, d.current_bytes) for d in report.devices] == [("0", 0), ("1", 10)]
    assert report.totals.devices == 2 and report.totals.workers == 1


@gen_cluster(client=True)
async def test_no_dask_rmm_workers(c, s, a, b):
    report = await cluster_report(c)
    assert report.devices == ()
    assert sorted(report.workers_without_dask_rmm) == sorted([a.address, b.address])
    assert "no dask-rmm workers" in str(report)


@gen_cluster(client=True)
async def test_malformed_metrics_never_break_heartbeats(c, s, a, b):
    a.metrics["dask-rmm"] = lambda w: heartbeat("w", time.time(), {"0": {"samples": [[1.0]]}})
    await install_scheduler_plugin(c)
    await a.heartbeat()
    await a.heartbeat()
    assert a.address in s.workers and a.status.name == "running"
    report = await cluster_report(c)
    assert any("not packed" in e for e in report.errors)
    assert len(s.plugins[PLUGIN_NAME]._records[a.address].timelines.get("0") or ()) == 0
    str(report)
    report.to_html()


@gen_cluster(client=True)
async def test_device_error_is_reported(c, s, a, b):
    (fa,) = _attach(a)
    fa["0"].error = "cudaErrorIllegalAddress"
    await install_scheduler_plugin(c)
    await a.heartbeat()
    report = await cluster_report(c)
    assert report.device(a.address).error == "cudaErrorIllegalAddress"
    assert "cudaErrorIllegalAddress" in str(report)


@gen_cluster(client=True)
async def test_unregistered_plugin_stops_recording(c, s, a, b):
    (fa,) = _attach(a)
    await install_scheduler_plugin(c)
    plugin = s.plugins[PLUGIN_NAME]
    await c.unregister_scheduler_plugin(PLUGIN_NAME)
    fa["0"].allocate(5)
    await a.heartbeat()
    assert a.address not in plugin._records


@gen_cluster(client=True)
async def test_worker_whose_metrics_go_leaves_the_report(c, s, a, b):
    # unregister_worker_plugin("dask-rmm") removes the key; old numbers must not stay "running".
    fa, fb = _attach(a, b)
    fa["0"].allocate(123)
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    report = await cluster_report(c)
    assert report.device(a.address).current_bytes == 123
    del a.metrics["dask-rmm"]
    await a.heartbeat()
    report = await cluster_report(c)
    assert a.address not in report.workers and a.address in report.workers_without_dask_rmm
    assert report.totals.workers == 1


@gen_cluster(client=True)
async def test_report_without_dask_rmm_logs_no_scheduler_error(c, s, a, b):
    # Used to call the missing dask_rmm_report handler first: a KeyError traceback on the scheduler.
    with captured_logger("distributed.core") as log:
        report = await cluster_report(c)
    assert "No handler" not in log.getvalue() and "KeyError" not in log.getvalue()
    assert "no dask-rmm workers" in str(report)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_unregistering_rmm_plugin_removes_the_rows(c, s, a):
    from dask_rmm.plugin import RMMPlugin

    await c.register_plugin(RMMPlugin(base_resource="system"))
    await a.heartbeat()
    assert (await cluster_report(c)).device(a.address).status == "running"
    await c.unregister_worker_plugin("dask-rmm")
    await a.heartbeat()
    report = await cluster_report(c)
    assert report.devices == () and report.workers_without_dask_rmm == (a.address,)
    assert "no dask-rmm workers" in str(report)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 6)
async def test_a_report_reads_unread_heartbeats_a_chunk_at_a_time_and_skips_removed_workers(
    c, s, *workers
):
    """A report reads the heartbeats the poller has not read yet a chunk of workers at a time,
    the event loop free in between (at 10,000 workers reading them at once blocked it for half
    a second); a worker removed meanwhile stays gone, it is not read back in as running."""
    from dask_rmm.scheduler import timeline as timeline_module

    fakes = _attach(*workers)
    await install_scheduler_plugin(c)
    plugin = s.plugins[PLUGIN_NAME]
    plugin._poller.stop()  # only the report reads the heartbeats below
    await asyncio.gather(*(w.heartbeat() for w in workers))
    plugin.poll()  # every worker has its record
    for i, (w, fake) in enumerate(zip(workers, fakes, strict=True)):
        fake["0"].allocate(1000 + i)
        await w.heartbeat()  # not read yet
    order = list(s.workers)
    victim = order[-1]  # in the last chunk
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            if ticks == 1:
                asyncio.ensure_future(s.remove_worker(address=victim, stimulus_id="test"))
            await asyncio.sleep(0)

    chunk, timeline_module.SNAPSHOT_CHUNK = timeline_module.SNAPSHOT_CHUNK, 1
    task = asyncio.ensure_future(ticker())
    try:
        await plugin._catch_up()
    finally:
        task.cancel()
        timeline_module.SNAPSHOT_CHUNK = chunk
    assert ticks >= len(order) - 1  # the loop ran between the chunks
    assert victim not in s.workers and plugin._records[victim].status == "gone"
    report = await cluster_report(c)
    for i, w in enumerate(workers):
        if w.address != victim:
            assert report.device(w.address).current_bytes == 1000 + i
