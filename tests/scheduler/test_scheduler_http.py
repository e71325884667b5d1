"""The /dask-rmm page and /dask-rmm/report.json on the scheduler's HTTP server."""

from __future__ import annotations

import asyncio
import json

import pytest
from distributed.utils_test import gen_cluster
from fake_metrics import FakeRMMMetrics
from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.scheduler import install_scheduler_plugin
from dask_rmm.wire import PLUGIN_NAME


async def _get(s, path: str, **kwargs):
    return await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/{path}", **kwargs)


@gen_cluster(client=True)
async def test_page_and_json(c, s, a, b):
    fake = FakeRMMMetrics()
    a.metrics["dask-rmm"] = fake
    await install_scheduler_plugin(c)
    fake["0"].allocate(3 << 20, "matmul")
    await a.heartbeat()
    fake["0"].free(1 << 20, "matmul")
    await a.heartbeat()

    page = await _get(s, "dask-rmm")
    assert page.headers["Content-Type"].startswith("text/html")
    text = page.body.decode()
    assert "<svg" in text and "<polyline" in text
    assert "matmul" in text and "127.0.0.1" in text
    # Self-contained: no scripts and nothing fetched from elsewhere (xmlns is only a name).
    assert "<script" not in text and "src=" not in text and 'href="http' not in text

    r = await _get(s, "dask-rmm/report.json?timeline=1")
    assert r.headers["Content-Type"] == "application/json"
    data = json.loads(r.body)
    report = ClusterMemoryReport.from_dict(data)
    d = report.device(a.address)
    assert (d.current_bytes, d.peak_bytes) == (2 << 20, 3 << 20)
    assert d.timeline_peak == 3 << 20

    # By default every device without its timeline; the cluster's summed timeline is there.
    r = json.loads((await _get(s, "dask-rmm/report.json")).body)
    assert "timeline" not in r["workers"][0]["devices"]["0"]
    assert r["totals"]["peak_bytes"] == 3 << 20 and r["total_timeline"]
    r = await _get(s, "dask-rmm?refresh=5&last=1")
    assert b'http-equiv="refresh" content="5"' in r.body


@gen_cluster(client=True)
async def test_pages_are_read_only_and_validate_arguments(c, s, a, b):
    await install_scheduler_plugin(c)
    with pytest.raises(HTTPClientError) as e:
        await _get(s, "dask-rmm", method="POST", body="")
    assert e.value.code == 405
    with pytest.raises(HTTPClientError) as e:
        await _get(s, "dask-rmm/report.json?last=x")
    assert e.value.code == 400


@gen_cluster(client=True)
async def test_pages_404_when_plugin_unregistered(c, s, a, b):
    await install_scheduler_plugin(c)
    await c.unregister_scheduler_plugin(PLUGIN_NAME)
    with pytest.raises(HTTPClientError) as e:
        await _get(s, "dask-rmm")
    assert e.value.code == 404
    await install_scheduler_plugin(c)
    assert (await _get(s, "dask-rmm")).code == 200


@gen_cluster(client=True)
async def test_routes_added_once(c, s, a, b):
    await install_scheduler_plugin(c)
    n = len(s.http_application.default_router.rules)
    await c.unregister_scheduler_plugin(PLUGIN_NAME)
    await install_scheduler_plugin(c)
    assert len(s.http_application.default_router.rules) == n
    sitemap = json.loads((await _get(s, "sitemap.json")).body)["paths"]
    assert "/dask-rmm" in sitemap and "/dask-rmm/report.json" in sitemap


@gen_cluster(client=True, scheduler_kwargs={"http_prefix": "/prefixed"})
async def test_dashboard_prefix(c, s, a, b):
    await install_scheduler_plugin(c)
    r = await _get(s, "prefixed/dask-rmm")
    assert r.code == 200
    await asyncio.sleep(0)


@gen_cluster(client=True)
async def test_report_json_is_the_cli_json_document(c, s, a, b):
    from dask_rmm.client.fetch import iter_reports

    fake = FakeRMMMetrics()
    a.metrics["dask-rmm"] = fake
    fake["0"].allocate(3 << 20, "matmul")
    fake["0"].free(1 << 20, "matmul")
    await a.heartbeat()
    await install_scheduler_plugin(c)
    http = json.loads((await _get(s, "dask-rmm/report.json")).body)
    async for report in iter_reports(s.address, timeline=False):  # `dask rmm report --json`
        cli = json.loads(report.to_json(timeline=False))
    assert http.pop("time") and cli.pop("time")
    assert http == cli
    assert http["totals"]["current_bytes"] == 2 << 20
    assert http["workers"][0]["devices"]["0"]["fragmentation"] >= 0


@pytest.mark.parametrize(
    "query, says",
    [
        ("last=abc", "last must be a number of timeline points, a whole number >= 0; got 'abc'"),
        ("last=-5", "last must be a number of timeline points, a whole number >= 0; got '-5'"),
        ("refresh=-1", "refresh must be a number of seconds, a whole number >= 1; got '-1'"),
        ("refresh=soon", "refresh must be a number of seconds"),
        ("top=0", "top must be a number of devices, a whole number >= 1; got '0'"),
        ("sort=size", "sort must be one of worker, current, peak, fragmentation, got 'size'"),
        ("timeline=maybe", "timeline must be 1 or 0"),
        ("lats=5", "unknown query argument(s) lats; this page takes"),
    ],
)
@gen_cluster(client=True, nthreads=[])
async def test_a_wrong_query_argument_is_a_400_that_says_what_was_wrong(c, s, query, says):
    await install_scheduler_plugin(c)
    for path in ("dask-rmm", "dask-rmm/report.json"):
        if path.endswith("json") and query.startswith("refresh"):
            continue  # the JSON takes no refresh: an unknown argument there
        with pytest.raises(HTTPClientError) as e:
            await _get(s, f"{path}?{query}")
        assert e.value.code == 400
        assert says in e.value.response.body.decode(), e.value.response.body


@gen_cluster(client=True)
async def test_page_and_json_select_rows_by_worker_sort_and_top_with_totals_over_all(c, s, a, b):
    fa, fb = FakeRMMMetrics(), FakeRMMMetrics()
    a.metrics["dask-rmm"], b.metrics["dask-rmm"] = fa, fb
    fa["0"].allocate(5 << 20)
    fb["0"].allocate(7 << 20)
    await install_scheduler_plugin(c)
    await asyncio.gather(a.heartbeat(), b.heartbeat())

    top = json.loads((await _get(s, "dask-rmm/report.json?top=1&sort=current")).body)
    assert [w["address"] for w in top["workers"]] == [b.address]
    assert top["totals"]["current_bytes"] == 12 << 20 and top["totals"]["devices"] == 2
    assert top["selection"].startswith("showing 1 of 2 devices")
    port = a.address.rsplit(":", 1)[1]
    only_a = json.loads((await _get(s, f"dask-rmm/report.json?worker={port}")).body)
    assert [w["address"] for w in only_a["workers"]] == [a.address]
    page = (await _get(s, f"dask-rmm?worker={port}&top=1")).body.decode()
    assert "showing 1 of 1 devices of workers matching" in page and b.address not in page
    assert 'href="dask-rmm?worker=' in page and "sort by:" in page


@pytest.mark.parametrize("prefix", ["", "/prefixed"])
@pytest.mark.parametrize("query", ["", "?sort=peak&top=20", "?timeline=0"])
def test_the_page_with_a_trailing_slash_is_the_page(prefix, query):
    @gen_cluster(client=True, scheduler_kwargs={"http_prefix": prefix or None})
    async def run(c, s, a, b):
        fake = FakeRMMMetrics()
        a.metrics["dask-rmm"] = fake
        await install_scheduler_plugin(c)
        fake["0"].allocate(3 << 20, "matmul")
        await a.heartbeat()
        base = prefix.strip("/") + "/" if prefix else ""
        plain = await _get(s, f"{base}dask-rmm{query}")
        slash = await _get(s, f"{base}dask-rmm/{query}")  # follows the redirect
        assert slash.code == 200 and slash.effective_url.endswith(f"/{base}dask-rmm{query}")
        assert b"matmul" in slash.body and slash.body.count(b"<table") == plain.body.count(
            b"<table"
        )
        moved = await _get(s, f"{base}dask-rmm/{query}", follow_redirects=False, raise_error=False)
        assert moved.code == 301 and moved.headers["Location"] == f"/{base}dask-rmm{query}"

    run()


@gen_cluster(client=True, scheduler_kwargs={"http_prefix": "/prefixed"})
async def test_the_page_links_back_to_the_dask_dashboard(c, s, a, b):
    await install_scheduler_plugin(c)
    fake = FakeRMMMetrics()
    a.metrics["dask-rmm"] = fake
    fake["0"].allocate(1 << 20)
    await a.heartbeat()
    from urllib.parse import urljoin

    r = await _get(s, "prefixed/dask-rmm")
    assert '<a href="status">Dask dashboard</a>' in r.body.decode()
    # relative: the dashboard's status page under the same prefix (its Bokeh pages are not
    # served in this test cluster)
    assert urljoin(r.effective_url, "status").endswith(f":{s.http_server.port}/prefixed/status")


def test_a_report_is_built_with_the_interpreter_switching_threads_often():
    import sys

    from dask_rmm.scheduler.report_build import SWITCH_INTERVAL, ReportRequest, Snapshot

    before = sys.getswitchinterval()
    snap = Snapshot(ReportRequest(), [], None, {})
    seen = snap.export(lambda _: sys.getswitchinterval())
    assert seen == pytest.approx(min(before, SWITCH_INTERVAL))
    assert sys.getswitchinterval() == before
