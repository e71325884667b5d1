"""Malformed, skewed and oversized dask-rmm heartbeats from one worker (another version, a bug, a
wrong clock, a hand-made client): the scheduler keeps what is valid, shows the rest as that
worker's error, and none of the four readers (the /dask-rmm routes, Prometheus' /metrics,
``cluster_report`` and ``dask rmm report``) fails; memory and work stay bounded."""

from __future__ import annotations

import asyncio
import json
import math
import time
import types

import pytest
from click.testing import CliRunner
from distributed import Worker
from distributed.utils_test import gen_cluster
from fake_metrics import FakeRMMMetrics
from tornado.httpclient import AsyncHTTPClient
from tornado.ioloop import PeriodicCallback

from dask_rmm.cli import main
from dask_rmm.client.fetch import cluster_report
from dask_rmm.report.memory_report import ClusterMemoryReport, strict_json, visible
from dask_rmm.scheduler import SchedulerTimelinePlugin, install_scheduler_plugin
from dask_rmm.scheduler import timeline as timeline_module
from dask_rmm.scheduler.cluster_total import MAX_WAITING_ARRAYS, ClusterTotal
from dask_rmm.scheduler.report_build import ReportRequest
from dask_rmm.scheduler.resolution import Timeline
from dask_rmm.scheduler.validate import MAX_AHEAD, MAX_DEVICES, MAX_SAMPLES
from dask_rmm.wire import METRICS_VERSION, PLUGIN_NAME, device_entries, heartbeat, pack_samples

MiB = 1 << 20


def _strict(text: str | bytes) -> object:
    """json.loads that, like strict parsers, rejects NaN and Infinity."""

    def reject(constant: str) -> None:
        raise ValueError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=reject)


def _device(now: float, **fields: object) -> dict:
    d: dict = {
        "current_bytes": MiB,
        "peak_bytes": 2 * MiB,
        "reserved_bytes": 4 * MiB,
        "samples": pack_samples([[now - 0.1, MiB, MiB], [now, MiB, 2 * MiB]]),
    }
    d.update(fields)
    return d


def _beat(devices: object, **top: object) -> dict:
    """A heartbeat of ``devices``: as a worker packs them when they are a map of maps, else
    ``devices`` as it is beside no other column."""
    if isinstance(devices, dict) and all(isinstance(d, dict) for d in devices.values()):
        return heartbeat("w", time.time(), devices) | top
    return {"version": METRICS_VERSION, "time": time.time(), "worker": "w", "devices": devices,
            **top}  # fmt: skip


def _columns(**columns: object) -> dict:
    """A heartbeat of devices "0" and "1" with ``columns`` replaced."""
    return _beat({"0": _device(time.time()), "1": _device(time.time())}) | columns


def _one(**fields: object) -> dict:
    return _beat({"0": _device(time.time(), **fields)})


def _samples(rows: list) -> dict:
    return _beat({"0": _device(time.time(), samples=rows)})


def _packed_samples(rows: list) -> dict:
    import struct

    blob = b"".join(struct.pack("<dqq", t, c, m) for t, c, m in rows)
    return _beat({"0": _device(time.time(), samples=blob)})


NOW = time.time()
#: What worker ``a`` sends as ``metrics["dask-rmm"]`` (made at heartbeat time when callable).
MALFORMED = {
    "a list": lambda: [1, 2, 3],
    "a str": lambda: "dask-rmm",
    "an int": lambda: 7,
    "None devices": lambda: _beat(None),
    "devices a list": lambda: _beat([{"current_bytes": 1}]),
    "a device that is a str": lambda: _beat({"0": "full"}),
    "bytes in a device's error": lambda: _one(error=b"\xff\xfe"),
    "an error of a megabyte": lambda: _one(error="x" * (1 << 20)),
    "bytes in an OOM event": lambda: _one(oom_events=[{"time": NOW, "message": b"\xff"}]),
    "an OOM event with a str time and free_bytes": lambda: _one(
        oom_events=[{"time": "noon", "free_bytes": "lots", "verdict": "demand"}]
    ),
    "OOM events with mixed time types": lambda: _one(
        oom_events=[{"time": NOW, "verdict": "demand"}, {"time": [1], "verdict": "demand"}]
    ),
    "an OOM event at time 1e300": lambda: _one(oom_events=[{"time": 1e300, "verdict": "x"}]),
    "an OOM event nested deep": lambda: _one(oom_events=[{"a": {"b": {"c": {"d": {"e": 1}}}}}]),
    "OOM events a str": lambda: _one(oom_events="oops"),
    "one sample at +inf": lambda: _samples([[NOW, 1, 1], [math.inf, 2, 2]]),
    "one sample at NaN": lambda: _samples([[NOW, 1, 1], [math.nan, 2, 2]]),
    "a far-future sample": lambda: _samples([[NOW, 1, 1], [1e18, 2, 2]]),
    "samples an hour ahead": lambda: _samples([[time.time() + 3600, 1, 1]]),
    "samples out of time order": lambda: _samples([[NOW, 1, 1], [NOW - 5, 2, 2]]),
    "sample bytes near 2**63": lambda: _packed_samples([[NOW, 2**63 - 1, 2**63 - 1]]),
    "negative sample bytes": lambda: _packed_samples([[NOW, -(2**63), -1]]),
    "current_bytes near 2**63": lambda: _one(current_bytes=2**63 - 1, peak_bytes=2**63 - 1),
    "current_bytes -(2**63)": lambda: _one(current_bytes=-(2**63)),
    "a float where an int goes": lambda: _one(current_bytes=1.5, reserved_bytes=math.inf),
    "a str where an int goes": lambda: _one(current_bytes="1 GiB"),
    "NaN seconds": lambda: _one(spill_seconds=math.nan, unspill_seconds=math.inf),
    "a list where a str goes": lambda: _one(gpu_name=["H200"], resource={"a": 1}),
    "task groups a str": lambda: _one(task_groups="inc"),
    "malformed task groups": lambda: _one(task_groups=[[1, 2, 3], ["x", "a", 1], ["ok", 1, 2]]),
    "samples a str": lambda: _samples("0123"),
    "samples of 25 bytes": lambda: _beat({"0": _device(NOW, samples=b"x" * 25)}),
    "samples rows of dicts": lambda: _samples([{"t": 1}]),
    "samples rows of str": lambda: _samples([["a", "b", "c"]]),
    "more samples than a heartbeat holds": lambda: _packed_samples(
        [[NOW - 1 + i * 1e-5, i, i] for i in range(MAX_SAMPLES + 1)]
    ),
    "samples as lists (no longer read)": lambda: _samples([[NOW, 1, 1]]),
    "a sample at -1e300": lambda: _samples([[-1e300, 1, 1], [NOW, 1, 1]]),
    "a sample in 1970": lambda: _samples([[1.0, 1, 1], [NOW, 1, 1]]),
    "a heartbeat time of -1e300": lambda: _one() | {"time": -1e300},
    "wire version 999": lambda: _one() | {"version": 999},
    "wire version 2": lambda: _one() | {"version": 2},
    "wire version a str": lambda: _one() | {"version": "3"},
    "wire version 0": lambda: _one() | {"version": 0},
    "device ids 0 and '0'": lambda: _beat({0: _device(NOW), "0": _device(NOW)}),
    "more devices than a worker has": lambda: _beat(
        {str(i): _device(NOW) for i in range(MAX_DEVICES + 5)}
    ),
    "a device id of a kilobyte": lambda: _beat({"d" * 1024: _device(NOW)}),
    "a heartbeat time of NaN": lambda: _one() | {"time": math.nan},
    "a heartbeat time a str": lambda: _one() | {"time": "now"},
    "numbers of 7 bytes": lambda: _columns(numbers=b"x" * 7),
    "numbers a list": lambda: _columns(numbers=[1, 2]),
    "text a str": lambda: _columns(text="text"),
    "text one field short": lambda: _columns(text=["x"] * 11),
    "text of ints": lambda: _columns(text=[1] * 12),
    "samples one device short": lambda: _columns(samples=[b""]),
    "samples a dict": lambda: _columns(samples={"0": b""}),
    "device ids not distinct": lambda: _columns(devices=["0", "0"]),
    "device ids empty": lambda: _columns(devices=["", "1"]),
    "task group counts for one device": lambda: _columns(task_groups=[[1], ["g"], b"x" * 16]),
    "task group counts negative": lambda: _columns(task_groups=[[-1, 2], ["g"], b"x" * 16]),
    "task group counts floats": lambda: _columns(task_groups=[[0.5, 0.5], ["g"], b"x" * 16]),
    "task group numbers short": lambda: _columns(task_groups=[[1, 0], ["g"], b"x" * 15]),
    "task group names of ints": lambda: _columns(task_groups=[[1, 0], [7], b"x" * 16]),
    "task group column a str": lambda: _columns(task_groups="inc"),
    "other fields a list": lambda: _columns(other=[1]),
    "other fields of an unknown device": lambda: _columns(other={"9": {"error": "x"}}),
    "other fields a str": lambda: _columns(other={"0": "x"}),
}


#: Cases within every bound whose wrong types the readers take as they can (a number that is no
#: int as 0, a list of one name as its text): nothing is left out, so no error.
READ_LENIENTLY = {
    "bytes in a device's error", "OOM events a str", "current_bytes near 2**63",
    "current_bytes -(2**63)", "a float where an int goes", "a str where an int goes",
    "NaN seconds", "a list where a str goes", "task groups a str", "malformed task groups",
}  # fmt: skip


async def _readers(c, s, good) -> tuple[ClusterMemoryReport, str]:
    """Every reader answers, and shows the good worker: returns cluster_report's report and
    the CLI's table."""
    http = AsyncHTTPClient()
    base = f"http://127.0.0.1:{s.http_server.port}/"
    page = await http.fetch(base + "dask-rmm")
    assert page.code == 200 and good.address.rsplit("//")[-1] in page.body.decode()
    for path in ("dask-rmm/report.json", "dask-rmm/report.json?timeline=1"):
        doc = _strict((await http.fetch(base + path)).body)
        assert good.address in [w["address"] for w in doc["workers"]]
    metrics = await http.fetch(base + "metrics")
    assert metrics.code == 200 and b"dask_rmm_cluster_current_bytes" in metrics.body

    report = await cluster_report(c)
    assert report.device(good.address).current_bytes == 3 * MiB
    text = str(report)
    report.to_html()
    _strict(report.to_json())
    report.to_frame()

    runner = CliRunner()
    table = await asyncio.to_thread(runner.invoke, main, ["report", s.address])
    assert table.exit_code == 0, table.output
    assert good.address.rsplit("//")[-1] in table.output
    as_json = await asyncio.to_thread(runner.invoke, main, ["report", s.address, "--json"])
    assert as_json.exit_code == 0, as_json.output
    _strict(as_json.output)
    return report, text


@pytest.mark.parametrize("case", list(MALFORMED))
@gen_cluster(client=True)
async def test_a_malformed_heartbeat_breaks_no_reader_and_is_that_workers_error(c, s, a, b, case):
    fb = FakeRMMMetrics()
    b.metrics["dask-rmm"] = fb
    fb["0"].allocate(3 * MiB)
    make = MALFORMED[case]
    a.metrics["dask-rmm"] = lambda worker: make()
    await install_scheduler_plugin(c)
    plugin = s.plugins[PLUGIN_NAME]
    for _ in range(2):
        await asyncio.gather(a.heartbeat(), b.heartbeat())
    report, text = await _readers(c, s, b)
    if case not in READ_LENIENTLY:
        assert any(e.startswith(a.address) for e in report.errors), report.errors
        assert a.address in text
    # Nothing unbounded was kept: a worker's devices and timelines stay within their limits.
    rec = plugin._records[a.address]
    assert len(rec.timelines) <= MAX_DEVICES
    assert all(len(tl) <= plugin.timeline_length + 2 * MAX_SAMPLES for tl in rec.timelines.values())
    # The worker leaving is fine too (a row that cannot be stopped kept it "running").
    await a.close()
    while a.address in s.workers:
        await asyncio.sleep(0.01)
    report = await cluster_report(c)
    assert all(d.status == "gone" for d in report.devices if d.worker == a.address)
    assert report.totals.current_bytes == 3 * MiB and report.totals.workers == 1


@gen_cluster(client=True)
async def test_an_error_is_logged_once_per_worker_not_every_heartbeat(c, s, a, b):
    from distributed.utils_test import captured_logger

    a.metrics["dask-rmm"] = lambda worker: [1]
    with captured_logger("dask_rmm.scheduler.timeline") as log:
        await install_scheduler_plugin(c)
        for _ in range(5):
            await a.heartbeat()
            s.plugins[PLUGIN_NAME].poll()
    assert log.getvalue().count("not a mapping") == 1, log.getvalue()


@gen_cluster(client=True)
async def test_unknown_fields_within_the_bounds_are_read_without_error(c, s, a, b):
    now = time.time()
    device = _device(now, admission={"queued": 3}, library_bytes={"cupy": 5}, future=[1, 2])
    beat = _beat({"0": device}, admission_policy="fifo", extra={"x": 1})
    a.metrics["dask-rmm"] = lambda worker: beat
    await install_scheduler_plugin(c)
    await a.heartbeat()
    report = await cluster_report(c)
    assert report.errors == ()
    d = report.device(a.address)
    assert (d.current_bytes, d.peak_bytes, len(d.timeline)) == (MiB, 2 * MiB, 2)
    # The scheduler's record keeps them for whoever reads them.
    kept = s.plugins[PLUGIN_NAME]._records[a.address].metrics
    assert kept["admission_policy"] == "fifo"
    assert device_entries(kept)["0"]["admission"] == {"queued": 3}


@gen_cluster(client=True)
async def test_valid_devices_are_kept_beside_malformed_samples_and_fields(c, s, a, b):
    now = time.time()
    beat = _beat({"0": _device(now), "1": _device(now, samples="garbage"),
                  "2": _device(now, current_bytes="x", oom_events="x" * 100_000)})  # fmt: skip
    a.metrics["dask-rmm"] = lambda worker: beat
    await install_scheduler_plugin(c)
    await a.heartbeat()
    report = await cluster_report(c)
    assert report.device(a.address, 0).current_bytes == MiB
    assert report.device(a.address, 1).current_bytes == MiB  # its samples dropped, not its fields
    assert len(report.device(a.address, 1).timeline) == 0
    assert report.device(a.address, 2).current_bytes == 0  # read as 0, the rest kept
    assert report.device(a.address, 2).reserved_bytes == 4 * MiB
    (error,) = report.errors
    assert "device '1': samples are a str, not packed" in error
    assert "device '2': oom_events of 100000 characters cut" in error


# -- text that cannot be spoofed ----------------------------------------------------------------


@gen_cluster(client=True, nthreads=[])
async def test_control_characters_in_a_name_cannot_add_a_row_or_reach_the_terminal(c, s):
    name = "evil\ntcp://10.0.0.1:1 (fake)  0 host  running  1.00 TiB\x1b[2J\x1b]0;x\x07"
    async with Worker(s.address, name=name, nthreads=1) as w:
        w.metrics["dask-rmm"] = lambda worker: _one(error="bad\r\nerror: \x1b[31mred")
        await install_scheduler_plugin(c)
        await w.heartbeat()
        report = await cluster_report(c)
        assert report.device(w.address).name == name  # the data is kept as sent
        text = str(report)
        cli = await asyncio.to_thread(CliRunner().invoke, main, ["report", s.address])
        assert cli.exit_code == 0, cli.output
    for out in (text, cli.output):
        assert "\x1b" not in out and "\x07" not in out and "\r" not in out
        assert "evil\\ntcp://10.0.0.1:1" in out and "\\x1b[2J" in out
        assert not any(line.startswith("tcp://10.0.0.1:1") for line in out.splitlines())
        assert "bad\\r\\nerror: \\x1b[31mred" in out


def test_visible_escapes_only_what_does_not_show():
    assert visible("gpu-0 (worker) é 字") == "gpu-0 (worker) é 字"
    assert visible("a\nb\tc\x00\x7f\x9b\u2028\u202e") == "a\\nb\\tc\\x00\\x7f\\x9b\\u2028\\u202e"


def test_report_json_is_strict_with_values_that_are_not_finite():
    data = {"x": math.nan, "y": [math.inf, 1.5], "z": {"w": -math.inf}}
    assert _strict(strict_json(data)) == {"x": None, "y": [None, 1.5], "z": {"w": None}}
    doc = {
        "version": 2,
        "time": 1e9,
        "workers": [
            {"address": "tcp://h:1", "last_seen": math.nan,
             "devices": {"0": {"spill_seconds": math.nan, "timeline": [[math.inf, 1, 1]]}}}
        ],
    }  # fmt: skip
    report = ClusterMemoryReport.from_dict(doc)
    _strict(report.to_json())
    str(report)


# -- a property test: random structures ---------------------------------------------------------


def _fake_scheduler(plugin: SchedulerTimelinePlugin, workers: list) -> None:
    plugin.scheduler = types.SimpleNamespace(
        plugins={PLUGIN_NAME: plugin},
        workers={w.address: w for w in workers},
        address="tcp://scheduler:8786",
    )


def _worker(i: int, metrics: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(address=f"tcp://10.0.0.{i}:1", name=f"w{i}", metrics=metrics)


def _every_reader(plugin: SchedulerTimelinePlugin) -> ClusterMemoryReport:
    from prometheus_client import CollectorRegistry, generate_latest

    from dask_rmm.scheduler.prometheus import DaskRMMCollector

    registry = CollectorRegistry()
    registry.register(DaskRMMCollector(plugin))
    assert b"dask_rmm_devices" in generate_latest(registry)  # /metrics
    reports = []
    for request in (ReportRequest(), ReportRequest(top=1, sort="peak", width=10)):
        snap = plugin.snapshot(request)
        assert "<html>" in snap.render("html")  # /dask-rmm
        doc = _strict(snap.render("json"))  # report.json, then cluster_report / the CLI
        report = ClusterMemoryReport.from_dict(doc)
        str(report)
        _strict(report.to_json())
        report.to_html()
        reports.append(report)
    return reports[0]


def _sums_agree(plugin: SchedulerTimelinePlugin) -> None:
    """Prometheus's families, made from a snapshot, hold the report's totals."""
    from dask_rmm.scheduler.prometheus import snapshot_families

    snap = plugin.snapshot(ReportRequest(timeline=False))
    families = {f.name: f.samples for f in snapshot_families(snap)}
    totals = snap.build().totals
    assert families["dask_rmm_cluster_current_bytes"][0].value == totals.current_bytes
    assert [s.value for s in families["dask_rmm_workers"]] == [
        totals.workers,
        totals.gone_workers,
    ]


def test_random_structures_break_no_reader():
    pytest.importorskip("prometheus_client")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**64), max_value=2**64)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=20)
        | st.binary(max_size=30)
        | st.sampled_from([2**63 - 1, -(2**63), time.time(), time.time() + 3600, 1e300])
    )
    anything = st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
        ),
        max_leaves=20,
    )
    field_names = st.sampled_from(
        ["current_bytes", "peak_bytes", "pool_free_bytes", "largest_free_block", "error",
         "task_groups", "oom_events", "samples", "spill_seconds", "gpu_name", "paused"]
    )  # fmt: skip
    rows = st.lists(
        st.tuples(
            st.floats(allow_nan=True, allow_infinity=True) | st.just(time.time()),
            st.integers(min_value=-(2**63), max_value=2**63 - 1),
            st.integers(min_value=-(2**63), max_value=2**63 - 1),
        ),
        max_size=5,
    )
    device = st.dictionaries(field_names, anything, max_size=6) | st.builds(
        lambda r, extra: {"samples": pack_samples(r), **extra},
        rows,
        st.dictionaries(field_names, anything, max_size=3),
    )
    devices = st.dictionaries(st.text(max_size=3) | st.integers(0, 3), device, max_size=3)
    columns = st.sampled_from(["devices", "numbers", "text", "samples", "task_groups", "other"])
    beat = anything | st.builds(
        lambda v, t, devs: {"version": v, "time": t, "devices": devs},
        st.sampled_from([1, 2, 3, 4, 999, "3", None]),
        st.floats(allow_nan=True) | st.just(time.time()),
        devices | anything,
    )
    beat |= st.builds(heartbeat, st.text(max_size=3), st.just(time.time()), devices)
    beat |= st.builds(
        lambda devs, k, v: heartbeat("w", time.time(), devs) | {k: v}, devices, columns, anything
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(beat, min_size=1, max_size=3))
    def check(beats: list) -> None:
        plugin = SchedulerTimelinePlugin(timeline_length=16)
        plugin._configure()
        good = _worker(0, {"dask-rmm": _one()})
        bad = _worker(1, {})
        _fake_scheduler(plugin, [good, bad])
        for beat in beats:
            bad.metrics = {"dask-rmm": beat}
            plugin.poll()
            report = _every_reader(plugin)
            assert report.device(good.address).current_bytes == MiB
            _sums_agree(plugin)
        del plugin.scheduler.workers[bad.address]
        plugin.remove_worker(plugin.scheduler, bad.address)
        _sums_agree(plugin)
        plugin._stop()

    check()


# -- bounded work with a wrong clock ------------------------------------------------------------


class _Clock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("skew", [3600.0, math.nan, 1e18, MAX_AHEAD / 2])
def test_a_skewed_worker_for_a_simulated_hour_keeps_the_cluster_total_drained(monkeypatch, skew):
    """A heartbeat every 0.5 s for an hour from a good worker and one whose clock is ``skew``
    ahead (NaN, far future; half of MAX_AHEAD is accepted): what waits for the cluster total,
    and the arrays it waits in, stay as small at the end as after the first minute."""
    clock = _Clock(1.7e9)
    monkeypatch.setattr(timeline_module, "time", clock)
    plugin = SchedulerTimelinePlugin(timeline_length=64)
    plugin._configure()
    good, skewed = _worker(0, {}), _worker(1, {})
    _fake_scheduler(plugin, [good, skewed])
    seen = []
    for beat in range(7200):
        clock.now += 0.5
        t = clock.now
        good.metrics = {"dask-rmm": _beat({"0": _device(t, samples=pack_samples(
            [[t - 0.25, beat, beat], [t, beat, beat]]))})}  # fmt: skip
        ahead = t + skew
        skewed.metrics = {"dask-rmm": _beat({"0": _device(t, samples=pack_samples(
            [[ahead - 0.25, beat, beat], [ahead, beat, beat]]))})}  # fmt: skip
        plugin.poll()
        total = plugin._total
        seen.append((len(total._waiting), total.waiting, len(total.timeline)))
    first_minute = max(seen[:120])
    last_half = max(seen[3600:])
    assert last_half[0] <= max(first_minute[0], 9), (first_minute, last_half)
    assert last_half[1] <= first_minute[1] + 4, (first_minute, last_half)
    assert last_half[2] <= 64
    report = plugin.snapshot(ReportRequest()).build()
    accepted = skew < MAX_AHEAD  # otherwise its samples are dropped, its scalars kept
    assert report.total_timeline[-1][1] == 7199 * (2 if accepted else 1)
    assert report.totals.current_bytes == 2 * MiB
    if not accepted:
        assert any(skewed.address in e for e in report.errors), report.errors


def test_the_cluster_total_merges_what_waits_for_a_device_ahead():
    """Past what the scheduler accepts (a device 1000 s ahead, fed to the total directly)."""
    total = ClusterTotal(Timeline(64), max_lag=30.0)
    ahead, behind = total.add_row(), total.add_row()
    now = 1e9
    for i in range(1000):
        now += 0.5
        total.add([ahead], [pack_samples([[now + 1000, i, i]])], [now + 1000])
        total.add([behind], [pack_samples([[now, i, i]])], [now])
        total.advance(now)
        assert len(total._waiting) <= MAX_WAITING_ARRAYS + 1
    assert total.waiting == 1000


def test_an_int64_cluster_sum_saturates_instead_of_wrapping():
    total = ClusterTotal(Timeline(64))
    rows = [total.add_row() for _ in range(4)]
    big = 2**62
    for r in rows:
        total.add([r], [pack_samples([[1e9, big, big]])], [1e9])
    total.advance(1e9 + 100)
    peak, points = total.snapshot().points()
    assert points["c"][-1] > 0 and peak > 0


def test_the_poller_reads_a_share_of_the_workers_a_tick_and_each_twice_a_heartbeat_interval():
    from distributed.scheduler import heartbeat_interval

    plugin = SchedulerTimelinePlugin(timeline_length=16)
    plugin._configure()
    workers = [_worker(i, {"dask-rmm": _beat({})}) for i in range(1000)]
    _fake_scheduler(plugin, workers)
    read: list[str] = []
    original = plugin._read
    plugin._read = lambda ws, now: (read.append(ws.address), original(ws, now))
    # A tick a tenth of a heartbeat interval, at most TOTAL_INTERVAL: fewer, larger batches.
    plugin._poller = PeriodicCallback(lambda: None, plugin.poll_interval * 1000)  # not started
    period = min(heartbeat_interval(1000) / 10, timeline_module.TOTAL_INTERVAL)
    ticks = heartbeat_interval(1000) / 2 / period  # ticks in half an interval
    for _ in range(int(ticks)):
        plugin._tick()
    assert plugin._poller.callback_time == period * 1000 > plugin.poll_interval * 1000
    assert len(read) <= 1000 * 1.1 and set(read) == {w.address for w in workers}
    read.clear()
    plugin._tick()
    assert 0 < len(read) <= 1000 / ticks + 1


def test_the_poller_takes_samples_a_pass_at_a_time_and_every_reader_sees_them(monkeypatch):
    """The poller's reads queue each heartbeat's samples; they reach the timelines and the
    cluster total in one batch a pass (every LARGE_TOTAL_INTERVAL from SHARE_ABOVE workers,
    sooner once FOLD_BYTES wait), and a snapshot sees every sample read."""
    clock = _Clock(1.7e9)
    monkeypatch.setattr(timeline_module, "time", clock)
    plugin = SchedulerTimelinePlugin(timeline_length=64)
    plugin._configure()
    workers = [_worker(i, {}) for i in range(timeline_module.SHARE_ABOVE)]
    _fake_scheduler(plugin, workers)

    def beat(rows: int = 2) -> None:
        clock.now += 0.25
        t = clock.now
        for ws in workers:
            ws.metrics = {"dask-rmm": _beat({"0": _device(t, samples=pack_samples(
                [[t - 0.01 * k, MiB, MiB] for k in range(rows - 1, -1, -1)]))})}  # fmt: skip

    beat()
    plugin.poll()  # the first pass
    rec = plugin._records[workers[0].address]
    assert plugin._arrived == [] and rec.timelines["0"].newest == clock.now
    beat()
    plugin.poll(every=False)  # a tick: read, not taken
    assert plugin.poll_interval < timeline_module.LARGE_TOTAL_INTERVAL
    assert len(plugin._arrived) > 0 and rec.timelines["0"].newest < clock.now
    report = plugin.snapshot(ReportRequest()).build()  # a reader takes what was read
    assert report.device(workers[0].address, "0").timeline[-1][0] == clock.now
    assert plugin._arrived == [] and report.totals.current_bytes == len(workers) * MiB
    beat(rows=(timeline_module.FOLD_BYTES // len(workers)) // 24 + 2)
    plugin.poll()  # more than FOLD_BYTES wait: a pass now, not LARGE_TOTAL_INTERVAL later
    assert plugin._arrived == [] and plugin._arriving == 0
    beat()
    plugin.poll(every=False)
    assert plugin._arrived
    clock.now += timeline_module.LARGE_TOTAL_INTERVAL
    plugin.poll(every=False)
    assert plugin._arrived == []


def test_samples_read_before_a_worker_leaves_count_before_its_rows_stop():
    """Samples queued by the poller when the worker leaves (or stops sending dask-rmm) reach
    its timeline, and the cluster total then counts the device 0 (no row counted again)."""
    plugin = SchedulerTimelinePlugin(timeline_length=64)
    plugin._configure()
    a, b = _worker(0, {}), _worker(1, {})
    _fake_scheduler(plugin, [a, b])
    for ws in (a, b):
        ws.metrics = {"dask-rmm": _one()}
    plugin.poll()
    later = pack_samples([[time.time() + 1, 3 * MiB, 3 * MiB]])
    for ws in (a, b):
        ws.metrics = {"dask-rmm": _one(samples=later)}
    plugin._ingest(a, b, fold=False)  # as a tick reads them
    assert len(plugin._arrived) == 2
    plugin.remove_worker(plugin.scheduler, a.address)
    b.metrics = {}
    plugin.poll()
    assert plugin._arrived == []
    assert b.address not in plugin._records
    assert plugin._records[a.address].timelines["0"].points()["c"][-1] == 3 * MiB
    plugin._total.advance(time.time() + 100)
    peak, points = plugin._total.snapshot().points()
    assert peak == 6 * MiB and points["c"][-1] == 0
    assert not plugin._total._running[: plugin._total._n].any()


@pytest.mark.parametrize("as_lists", [True, False])
def test_a_well_formed_heartbeat_is_kept_as_it_came_also_with_tuples(as_lists):
    """A heartbeat of this version, as distributed's comm delivers it (msgpack: sequences as
    tuples) or as lists, passes the checks whole: its columns are kept, not rebuilt."""
    import msgpack

    from dask_rmm.scheduler.validate import check_metrics
    from dask_rmm.wire import DeviceSample, LibraryShare, TaskGroup

    now = time.time()
    device = DeviceSample(
        current_bytes=MiB,
        reserved_bytes=4 * MiB,
        task_groups=(TaskGroup("work", MiB, 2 * MiB), TaskGroup("load", 0, MiB)),
        libraries=(LibraryShare("cupy", MiB, 0),),
    ).to_dict()
    device["samples"] = pack_samples([[now - 0.1, MiB, MiB], [now, MiB, 2 * MiB]])
    sent = heartbeat("w", now, {"0": device, "1": dict(device)})
    beat = msgpack.unpackb(msgpack.packb(sent, use_bin_type=True), use_list=as_lists)
    checked = check_metrics(beat, now)
    assert checked.problems == []
    columns = ("devices", "numbers", "text", "samples", "task_groups", "libraries")
    assert all(checked.metrics[k] is beat[k] for k in columns)
    assert checked.samples == {d: device["samples"] for d in ("0", "1")}
    entry = DeviceSample.from_dict(device_entries(checked.metrics)["1"])
    assert entry.task_groups == (TaskGroup("work", MiB, 2 * MiB), TaskGroup("load", 0, MiB))
    assert (entry.current_bytes, entry.libraries) == (MiB, (LibraryShare("cupy", MiB, 0),))


@pytest.mark.parametrize(
    "column, value, problem",
    [
        ("text", ["x" * 100_000] * 12, "12 text fields cut to 1024 characters"),
        ("task_groups", [[1, 0], ["g" * 100_000], b"x" * 16], "not 2 devices' rows, at most 64"),
        ("task_groups", [[100_000, 0], ["g"] * 100_000, b"x" * 1_600_000], "task_groups [[100000"),
        ("libraries", [[1, 0], [["nested"]], b"x" * 24], "libraries [[1, 0], [['nested']]"),
        ("task_groups", [[1, 0], ["g"], b"x" * 16, "more"], "not 2 devices' rows"),
        ("samples", ["0" * 48, b""], "device '0': samples are a str"),
        ("samples", [b"0" * 47, b""], "device '0': samples are 47 bytes"),
        ("other", {"0": {f"k{i}": i for i in range(100_000)}}, "100000 fields, the first 128"),
        ("other", {"1": {"paused": list(range(100_000))}}, "paused of 100000 entries, 64 kept"),
    ],
)
def test_a_column_beyond_the_bounds_is_cut_or_dropped_and_named(column, value, problem):
    """Each column is checked a few C calls at a time: text cut, rows beyond the bounds dropped,
    a device's samples or other fields dropped or cut, each named; the rest kept."""
    from dask_rmm.scheduler.validate import check_metrics

    now = time.time()
    checked = check_metrics(_columns(), now)
    assert checked.problems == [] and len(checked.samples) == 2
    checked = check_metrics(_columns(**{column: value}), now)
    assert any(problem in text for _, text in checked.problems), checked.problems
    entries = device_entries(checked.metrics)
    assert entries["1"]["current_bytes"] == MiB
    assert all(len(x) <= 1024 + 3 for x in checked.metrics["text"])
    for d in entries.values():
        assert all(len(v) <= 64 for v in d.values() if isinstance(v, (list, tuple, dict)))


# -- every field bounded at the door --------------------------------------------------------------

HUGE = 100_000


def _huge(now: float) -> dict:
    """A heartbeat of MAX_DEVICES devices with 100,000 entries in each list and map: fields of a
    device, task groups, libraries, expected peaks, OOM events, a map no reader knows, the
    heartbeat's own fields; and a string of 100,000 characters, lists nested 4 deep."""
    device = _device(
        now,
        task_groups=[[f"g{i}", i, i] for i in range(HUGE)],
        libraries=[[f"lib{i}", i, 0, 0] for i in range(HUGE)],
        admission_expected_peaks=[[f"p{i}", i, 1] for i in range(HUGE)],
        oom_events=[{"time": now, "verdict": "demand"} for _ in range(HUGE)],
        future_map={f"k{i}": i for i in range(HUGE)},
        gpu_name="x" * HUGE,
        nested=[[[[i]]] for i in range(10)],
    )
    crowded = _device(now, **{f"extra_{i}": i for i in range(HUGE)})
    devices = {"0": device, "1": crowded} | {f"d{i}": _device(now) for i in range(MAX_DEVICES - 2)}
    return _beat(devices, extra={f"k{i}": i for i in range(HUGE)})


@gen_cluster(client=True, timeout=120)
async def test_100000_entries_in_every_list_and_map_are_cut_counted_and_every_route_answers(
    c, s, a, b
):
    from dask_rmm.scheduler.validate import MAX_ENTRIES, MAX_FIELDS, MAX_OOM_EVENTS, MAX_TEXT

    fb = FakeRMMMetrics()
    b.metrics["dask-rmm"] = fb
    fb["0"].allocate(3 * MiB)
    beat = _huge(time.time())
    a.metrics["dask-rmm"] = lambda worker: beat
    await install_scheduler_plugin(c)
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    report, _ = await _readers(c, s, b)
    kept = s.plugins[PLUGIN_NAME]._records[a.address].metrics
    assert len(kept["devices"]) == MAX_DEVICES and len(kept["other"]) == 2
    d0, d1 = device_entries(kept)["0"], kept["other"]["1"]
    assert {"task_groups", "libraries", "admission_expected_peaks"}.isdisjoint(d0)
    assert len(d0["future_map"]) == MAX_ENTRIES
    assert len(d0["oom_events"]) == MAX_OOM_EVENTS and d0["nested"] == []
    assert len(d0["gpu_name"]) <= MAX_TEXT + 3 and len(d1) == MAX_FIELDS
    (error,) = [e for e in report.errors if e.startswith(a.address)]
    for named in (
        *(f"{k} (({HUGE}, 0, 0, 0, 0, 0, ...), " for k in ("libraries", "task_groups")),
        f"admission_expected_peaks (({HUGE}, 0, 0",
        f"not {MAX_DEVICES} devices' rows, at most {MAX_ENTRIES} a device",
        f"future_map of {HUGE} entries",
        f"{HUGE} OOM events dropped",
        "1 text fields cut to 1024 characters",
        f"device '1': {HUGE - 1} fields, the first {MAX_FIELDS} kept",  # extra_0 is 0: not sent
        f"the heartbeat: extra of {HUGE} entries",
    ):
        assert named in error, (named, error[:3000])
    assert report.device(a.address, 0).current_bytes == MiB  # what is within bounds is kept
    # 100,000 devices: none kept, and said so.
    beat = _beat({str(i): _device(time.time()) for i in range(HUGE)})
    await asyncio.gather(a.heartbeat(), b.heartbeat())
    report, _ = await _readers(c, s, b)
    (error,) = [e for e in report.errors if e.startswith(a.address)]
    assert f"{HUGE} devices, more than a worker has ({MAX_DEVICES}): none kept" in error


# -- clocks and times -------------------------------------------------------------------------------


@pytest.mark.parametrize("skew", [3600.0, -3600.0])
@gen_cluster(client=True)
async def test_a_skewed_clock_is_logged_once_per_interval_either_way(c, s, a, b, skew):
    from distributed.utils_test import captured_logger

    def beat(worker: object) -> dict:
        now = time.time() + skew
        return _beat({"0": _device(now)}) | {"time": now}

    a.metrics["dask-rmm"] = beat
    with captured_logger("dask_rmm.scheduler.timeline") as log:
        await install_scheduler_plugin(c)
        for _ in range(5):
            await a.heartbeat()
            s.plugins[PLUGIN_NAME].poll()
    lines = log.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert ("ahead of" if skew > 0 else "behind") in lines[0] and a.address in lines[0]
    report = await cluster_report(c)
    assert any(e.startswith(a.address) and "clock 3600 s" in e for e in report.errors)


def test_absurd_times_are_dropped_counted_and_stretch_no_chart():
    plugin = SchedulerTimelinePlugin(timeline_length=16)
    plugin._configure()
    now = time.time()
    rows = [
        [-1e300, 1, 1],
        [1.0, 2, 2],
        [now + 10 * 86400, 3, 3],
        [now - 1, MiB, MiB],
        [now, MiB, MiB],
    ]
    w = _worker(
        0, {"dask-rmm": _beat({"0": _device(now, samples=pack_samples(rows))}, time=-1e300)}
    )
    _fake_scheduler(plugin, [w])
    plugin.poll()
    report = _every_reader(plugin)
    (error,) = report.errors
    assert "3 of 5 samples dropped: 3 at no time" in error and "heartbeat time -1e+300" in error
    times = [p[0] for p in report.device(w.address).timeline + report.total_timeline]
    assert times and min(times) >= now - 1 and max(times) <= now
    assert report.device(w.address).last_seen >= now
    plugin._stop()


@pytest.mark.parametrize("column", [1, 2])
@pytest.mark.parametrize("value", [-1, -(2**63), (1 << 50) + 1, 2**63 - 1])
def test_sample_bytes_outside_the_bounds_in_either_column_are_dropped(column, value):
    """Current bytes or ``max_bytes_in_interval`` alone out of ``[0, 2**50]``, in one blob of a
    batch of valid ones: that sample is dropped and named, the others are kept whole."""
    from dask_rmm.scheduler.validate import check_samples

    now = time.time()
    good = [[now - 2, MiB, MiB], [now - 1, 2 * MiB, 2 * MiB]]
    bad = [list(row) for row in good]
    bad[1][column] = value
    blobs = [pack_samples(good), pack_samples(bad), pack_samples(good)]
    news, lasts, problems = check_samples(blobs, now, [-math.inf] * 3)
    assert news == [blobs[0], pack_samples(good[:1]), blobs[2]]
    assert lasts == [now - 1, now - 2, now - 1]
    assert list(problems) == [1] and "1 with bytes outside [0, 2**50]" in problems[1][1]


# -- devices that vanish ------------------------------------------------------------------------------


def test_a_vanished_device_leaves_the_cluster_total_at_once_and_the_report_says_so(monkeypatch):
    clock = _Clock(time.time())
    monkeypatch.setattr(timeline_module, "time", clock)
    plugin = SchedulerTimelinePlugin(timeline_length=64)
    plugin._configure()
    w = _worker(0, {})
    _fake_scheduler(plugin, [w])
    for beat in range(6):
        clock.now += 0.5
        t = clock.now
        ids = ("0", "1") if beat < 3 else ("0",)
        samples = pack_samples([[t - 0.25, MiB, MiB], [t, MiB, MiB]])
        w.metrics = {"dask-rmm": _beat({d: _device(t, samples=samples) for d in ids}, time=t)}
        plugin.poll()
    report = plugin.snapshot(ReportRequest()).build()
    last = report.total_timeline[-1]
    assert last[0] > clock.now - 1 and last[1] == MiB, report.total_timeline[-4:]
    (error,) = report.errors
    assert "device '1' no longer reported: not in the totals" in error
    assert report.totals.devices == 1 and report.totals.current_bytes == MiB
    plugin._stop()


@gen_cluster(client=True)
async def test_another_heartbeat_version_is_one_clear_line(c, s, a, b):
    from distributed.utils_test import captured_logger

    a.metrics["dask-rmm"] = lambda worker: _one() | {"version": METRICS_VERSION - 1}
    with captured_logger("dask_rmm.scheduler.timeline") as log:
        await install_scheduler_plugin(c)
        for _ in range(3):
            await a.heartbeat()
            s.plugins[PLUGIN_NAME].poll()
    (line,) = log.getvalue().splitlines()
    assert f"heartbeat version {METRICS_VERSION - 1}; this scheduler reads version " in line
    assert "run the same dask-rmm on the workers and the scheduler" in line
    report = await cluster_report(c)
    assert [e.split(": ", 1)[0] for e in report.errors] == [a.address]


def test_devices_of_different_field_names_are_packed_into_the_same_columns():
    """A worker's devices may have different fields (memory admission's figures go with the
    first device only): each reads back its own, the others at their default."""
    from dask_rmm.scheduler.validate import check_metrics
    from dask_rmm.wire import DeviceSample

    now = time.time()
    first = DeviceSample(
        current_bytes=MiB, admission_held_tasks=2, admission_expected_peaks=(("inc", MiB, 1),)
    ).to_dict()
    other = DeviceSample(reserved_bytes=MiB, gpu_name="H200").to_dict()
    checked = check_metrics(heartbeat("w", now, {"0": first, "1": other}), now)
    assert checked.problems == []
    entries = {k: DeviceSample.from_dict(d) for k, d in device_entries(checked.metrics).items()}
    assert entries["0"] == DeviceSample.from_dict(first)
    assert entries["1"] == DeviceSample.from_dict(other)
    assert entries["0"].admission_expected_peaks == (("inc", MiB, 1),)
    assert entries["1"].admission_expected_peaks == () and entries["0"].gpu_name == ""
