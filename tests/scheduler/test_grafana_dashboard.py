"""The Grafana dashboard (examples/grafana/dask-rmm-dashboard.json) asks only for series the
scheduler exports: checked against wire.GAUGES and against a scrape of a scheduler's /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from distributed.utils_test import gen_cluster

pytest.importorskip("prometheus_client")

from fake_metrics import FakeRMMMetrics  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tornado.httpclient import AsyncHTTPClient  # noqa: E402

from dask_rmm.scheduler import install_scheduler_plugin  # noqa: E402
from dask_rmm.scheduler.prometheus import _CLUSTER  # noqa: E402
from dask_rmm.wire import GAUGES  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "dask-rmm-dashboard.json"
#: What a user of the dashboard must see.
REQUIRED = {
    "dask_rmm_cluster_current_bytes",
    "dask_rmm_cluster_reserved_bytes",
    "dask_rmm_cluster_peak_bytes",
    "dask_rmm_used_bytes",
    "dask_rmm_reserved_bytes",
    "dask_rmm_fragmentation_ratio",
    "dask_rmm_oom_events_total",
    "dask_rmm_spill_bytes_total",
    "dask_rmm_unspill_bytes_total",
    "dask_rmm_spilled_bytes",
}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def _metrics_in(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\bdask_rmm_\w+", e)}


def test_every_series_the_dashboard_asks_for_is_one_wire_gauges_exports():
    exported = {"dask_rmm_fragmentation_ratio", "dask_rmm_workers", "dask_rmm_devices"}
    exported |= {f"dask_rmm_cluster_{field}" for field in (*_CLUSTER, "peak_bytes")}
    exported |= {name + ("_total" if kind == "counter" else "") for _, name, _, kind in GAUGES}
    used = _metrics_in(_queries(_dashboard()))
    assert used <= exported, used - exported
    assert used >= REQUIRED, REQUIRED - used


def test_the_dashboard_is_a_grafana_document_with_a_place_for_each_panel():
    dash = _dashboard()
    assert dash["uid"] == "dask-rmm" and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "worker"]


@gen_cluster(client=True)
async def test_the_dashboards_series_and_labels_are_on_a_schedulers_metrics_page(c, s, a, b):
    fa, fb = FakeRMMMetrics(), FakeRMMMetrics(("0", "1"))
    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = fa, fb
    fa["0"].allocate(1000)
    await install_scheduler_plugin(c)
    await a.heartbeat()
    await b.heartbeat()
    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")
    samples = [
        sample
        for family in text_string_to_metric_families(r.body.decode())
        for sample in family.samples
        if sample.name.startswith("dask_rmm_")
    ]
    served = {sample.name for sample in samples}
    dash = _dashboard()
    used = _metrics_in(_queries(dash))
    assert used <= served, used - served
    labels = {k for sample in samples for k in sample.labels}
    legends = {
        m
        for p in dash["panels"]
        for t in p["targets"]
        for m in re.findall(r"{{(\w+)}}", t["legendFormat"])
    }
    grouped = {
        label
        for e in _queries(dash)
        for by in re.findall(r"by \(([^)]*)\)", e)
        for label in re.split(r"\s*,\s*", by.strip())
    }
    assert legends | grouped | {"worker"} <= labels


#: The one line of a cluster panel drawn from per-device series (there is no cluster total of
#: device capacity); its legend says it stops at the device limit.
PER_DEVICE_IN_CLUSTER_PANELS = {"dask_rmm_device_total_bytes"}


def _cluster_panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["title"].startswith("Cluster")]


def test_cluster_panels_never_sum_per_device_series_that_stop_at_the_device_limit():
    panels = _cluster_panels(_dashboard())
    assert len(panels) >= 4
    for p in panels:
        used = _metrics_in([t["expr"] for t in p["targets"]]) - PER_DEVICE_IN_CLUSTER_PANELS
        assert used and all(
            m.startswith("dask_rmm_cluster_") or m in {"dask_rmm_workers", "dask_rmm_devices"}
            for m in used
        ), (p["title"], used)


@gen_cluster(client=True, config={"dask-rmm.scheduler.prometheus-device-limit": 2})
async def test_cluster_panels_are_served_above_the_device_limit(c, s, a, b):
    # Three devices, a limit of two: the per-device series stop, the cluster panels go on.
    fa, fb = FakeRMMMetrics(), FakeRMMMetrics(("0", "1"))
    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = fa, fb
    fa["0"].allocate(1000)
    fb["1"].allocate(234)
    await install_scheduler_plugin(c)
    await a.heartbeat()
    await b.heartbeat()
    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(r.body.decode())
        for sample in family.samples
        if sample.name.startswith("dask_rmm_") and not sample.labels
    }
    served = {
        sample.name
        for family in text_string_to_metric_families(r.body.decode())
        for sample in family.samples
    }
    assert "dask_rmm_used_bytes" not in served  # over the limit: no per-device series
    for p in _cluster_panels(_dashboard()):
        used = _metrics_in([t["expr"] for t in p["targets"]]) - PER_DEVICE_IN_CLUSTER_PANELS
        assert used <= served, (p["title"], used - served)
    assert values["dask_rmm_cluster_current_bytes"] == 1234
    assert values["dask_rmm_devices"] == 3
