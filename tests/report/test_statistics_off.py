"""``statistics=False``: no figure reads 0 B while memory is held. With a pool the bytes in use
are derived (reserved minus pool free) and marked so; what is not measured (peaks, allocated
totals, counts, failures, task groups; everything without a pool) says "n/a" in the text and
HTML, is None in the JSON and the DataFrame, is absent from Prometheus, and advice says so."""

from __future__ import annotations

import json

import pytest
from conftest import hold
from distributed import wait
from distributed.utils_test import gen_cluster

from dask_rmm import RMMPlugin
from dask_rmm.client.advice import advise_from_report
from dask_rmm.client.fetch import cluster_report
from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.scheduler import install_scheduler_plugin
from dask_rmm.wire import NOT_MEASURED_WITHOUT_A_POOL, STATISTICS_ONLY, device_entries
from dask_rmm.worker.metrics import METRICS_KEY

MiB = 1 << 20
SETUPS = {"pool": dict(pool_size="256MiB"), "none": {}}


@pytest.mark.parametrize("measured", sorted(SETUPS))
def test_statistics_off_says_what_is_not_measured_everywhere(measured):
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
    async def run(c, s, a):
        await c.register_plugin(
            RMMPlugin(base_resource="system", statistics=False, **SETUPS[measured])
        )
        held = c.map(hold, [50 * MiB] * 2, pure=False)
        await wait(held)
        await install_scheduler_plugin(c)
        await a.heartbeat()
        device = device_entries(a.metrics[METRICS_KEY](a))["0"]
        assert device["measured"] == measured
        if measured == "pool":  # derived honestly: reserved minus pool free
            assert device["current_bytes"] == 100 * MiB
            assert device["reserved_bytes"] - device.get("pool_free_bytes", 0) == 100 * MiB
        report = await cluster_report(c)
        (d,) = report.devices
        assert d.measured == measured and set(STATISTICS_ONLY) <= set(d.unmeasured)
        # the Python objects read None where the JSON has null (they read 0, and no groups)
        assert d.task_groups is None and all(getattr(d, n) is None for n in d.unmeasured)
        t = report.totals
        assert t.peak_bytes is None and t.failed_allocations is None and t.total_bytes is None
        assert all(getattr(t, n) is None for n in t.unmeasured)
        assert (t.current_bytes is None) == (measured == "none")
        assert ("n/a used" in repr(report)) == (measured == "none"), repr(report)

        text = str(report)
        row = next(line for line in text.splitlines() if " running " in line)
        assert "0 B" not in row and "n/a" in row, row
        if measured == "pool":
            assert "100.00 MiB ~" in row
        total_row = next(line for line in text.splitlines() if line.startswith("total ("))
        assert "n/a" in total_row and " 0 B" not in total_row, total_row
        assert "statistics off (statistics=False)" in text
        assert "n/a" in report.to_html() and "statistics off" in report.to_html()

        document = json.loads(report.to_json())
        entry = document["workers"][0]["devices"]["0"]
        for name in STATISTICS_ONLY:
            assert entry[name] is None, name
        assert entry["task_groups"] is None
        assert document["totals"]["peak_bytes"] is None
        assert document["totals"]["unmeasured_devices"] == 1
        for name in NOT_MEASURED_WITHOUT_A_POOL:
            assert (entry[name] is None) == (measured == "none"), name
        again = ClusterMemoryReport.from_dict(document)
        assert again.devices[0].unmeasured == d.unmeasured and "n/a" in str(again)
        assert again.devices[0] == d and again.totals == t
        if pytest.importorskip("matplotlib"):
            title = report.plot().get_suptitle()
            assert "n/a failed allocations" in title, title

        frame = pytest.importorskip("pandas") and report.to_frame()
        assert frame["measured"].tolist() == [measured]
        assert frame["peak_bytes"].isna().all() and frame["total_bytes"].isna().all()

        (advice,) = advise_from_report(report)
        assert any("statistics off" in n for n in advice.notes)

        prometheus = pytest.importorskip("prometheus_client.parser")
        from tornado.httpclient import AsyncHTTPClient

        body = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")
        families = {
            f.name: f
            for f in prometheus.text_string_to_metric_families(body.body.decode())
            if f.name.startswith("dask_rmm")
        }
        mine = {
            name: [x.value for x in f.samples if x.labels.get("worker") == a.address]
            for name, f in families.items()
        }
        assert mine["dask_rmm_peak_bytes"] == [] and mine["dask_rmm_failed_allocations"] == []
        assert "dask_rmm_cluster_peak_bytes" not in families  # the report's "n/a" totals
        assert "dask_rmm_cluster_failed_allocations" not in families
        assert ("dask_rmm_cluster_current_bytes" in families) == (measured == "pool")
        if measured == "pool":
            assert mine["dask_rmm_used_bytes"] == [100 * MiB]
        else:
            assert mine["dask_rmm_used_bytes"] == [] and mine["dask_rmm_reserved_bytes"] == []
        del held

    run()
