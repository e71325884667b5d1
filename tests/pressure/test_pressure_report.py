"""Memory pressure in the wire schema and the cluster report: the heartbeat's pressure fields and
OOM events survive the report document, sum into the totals, and show in text and HTML."""

from __future__ import annotations

import asyncio
import json

from distributed.utils_test import gen_cluster

from dask_rmm import wire
from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.wire import DeviceSample

MiB = 1 << 20

EVENT = {
    "time": 1764530000.0,
    "device": 0,
    "task_key": "('sum-abc', 3)",
    "task_prefix": "sum",
    "requested": 3 * MiB,
    "resource": "PoolMemoryResource",
    "message": "out of memory",
    "pool_size": 8 * MiB,
    "maximum_pool_size": 8 * MiB,
    "free_bytes": 4 * MiB,
    "largest_free_block": MiB,
    "verdict": "fragmentation",
    "spilled_trying": 0,
    "free_block_histogram": [[MiB, 4, 4 * MiB]],
    "live_bytes_by_prefix": [["sum", 4 * MiB]],
    "recent_events": [[1764529999.0, "alloc", MiB, 4096, "('sum-abc', 3)"]],
    "worker": None,
}


def _device(**pressure):
    d = DeviceSample(resource="PoolMemoryResource", current_bytes=5 * MiB).to_dict()
    d.update(pressure)
    return d


def _report() -> ClusterMemoryReport:
    a = _device(
        spilled_bytes=6 * MiB, spilled_count=3, total_spilled_bytes=10 * MiB,
        total_spilled_count=5, total_unspilled_bytes=4 * MiB, total_unspilled_count=2,
        spill_seconds=0.25, unspill_seconds=0.5, ooms_avoided=2, oom_count=1, pauses=1,
        paused=1, device_memory_limit=6 * MiB, oom_events=[EVENT],
    )  # fmt: skip
    b = _device()
    data = {
        "time": 1764530001.0,
        "scheduler": "tcp://s:1",
        "workers": [
            {"address": "tcp://a:1", "name": "a", "devices": {"0": a}},
            {"address": "tcp://b:1", "name": "b", "devices": {"0": b}},
        ],
    }
    return ClusterMemoryReport.from_dict(data)


def test_pressure_fields_are_exported_gauges_and_counters():
    exported = {name: (field, kind) for field, name, _help, kind in wire.GAUGES}
    assert exported["dask_rmm_spilled_bytes"] == ("spilled_bytes", "gauge")
    assert exported["dask_rmm_oom_events"] == ("oom_count", "counter")
    assert exported["dask_rmm_ooms_avoided"] == ("ooms_avoided", "counter")
    assert exported["dask_rmm_paused"] == ("paused", "gauge")
    sample = DeviceSample.from_dict(_device(spill_seconds="0.5", oom_events=[EVENT, "junk"]))
    assert sample.spill_seconds == 0.5 and sample.oom_events == (EVENT,)


def test_report_document_totals_and_events():
    report = _report()
    d = report.to_dict(timeline=False)
    assert d["oom_events"] == [dict(EVENT, worker="tcp://a:1", device="0")]
    t = d["totals"]
    assert (t["spilled_bytes"], t["total_spilled_bytes"], t["ooms_avoided"]) == (
        6 * MiB,
        10 * MiB,
        2,
    )
    assert (t["oom_count"], t["pauses"], t["paused_devices"]) == (1, 1, 1)
    dev = d["workers"][0]["devices"]["0"]
    assert dev["spilled_bytes"] == 6 * MiB and dev["device_memory_limit"] == 6 * MiB
    again = ClusterMemoryReport.from_dict(json.loads(report.to_json(timeline=False)))
    assert again.to_dict(timeline=False) == d


def test_text_and_html_show_pressure_only_where_it_happened():
    report = _report()
    text = str(report)
    assert "memory pressure:" in text
    assert "a:1" in text and "6.00 MiB spilled now (3)" in text and "(paused)" in text
    assert "('sum-abc', 3): fragmentation, requested 3.00 MiB" in text
    assert text.count("spilled now") == 1  # worker b did nothing: no line
    assert "Memory pressure" in report.to_html()
    quiet = ClusterMemoryReport.from_dict(
        {"workers": [{"address": "tcp://b:1", "devices": {"0": _device()}}]}
    )
    assert "memory pressure" not in str(quiet).lower()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_preload_flags_install_the_pressure_layer(c, s, a):
    from dask_rmm.preload import plugin_from_flags
    from dask_rmm.pressure.store import DeviceSpillStore

    plugin = plugin_from_flags(
        rmm_pool_size="8MiB",
        rmm_maximum_pool_size="8MiB",
        rmm_base_resource="system",
        device_memory_limit="6MiB",
        spill_on_oom=True,
    )
    assert plugin.options.device_memory_limit == 6 * MiB and plugin.options.spill_on_oom
    await c.register_plugin(plugin)
    assert isinstance(a.data, DeviceSpillStore)
    wp = a.plugins["dask-rmm"].worker_pressure
    assert wp.devices[0].limit == 6 * MiB and wp.spill_on_oom
    assert wp.devices[0].capacity == 8 * MiB and wp.pause_fraction == 0.8
    await c.unregister_worker_plugin("dask-rmm")
    while isinstance(a.data, DeviceSpillStore):  # removed on the next loop iteration
        await asyncio.sleep(0.01)
