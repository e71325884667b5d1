"""Where every byte of a worker's device is (issue 35, item 3), on host memory: a library cache
in front of the stack and one beside it (as PyTorch's), the heartbeat's per-library bytes, the
breakdown's arithmetic, the report (text, HTML, JSON, frame) and Prometheus. The same code reads
cudaMemGetInfo and PyTorch on a GPU (tests/allocators/test_allocators_torch.py)."""

from __future__ import annotations

import json

import pytest
from distributed.utils_test import gen_cluster
from library_cache_helpers import HostLibraryCache, HostOutsideCache

from dask_rmm import wire
from dask_rmm.allocators import caches
from dask_rmm.mr.pool import PoolMemoryResource
from dask_rmm.report.memory_report import ClusterMemoryReport
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions
from dask_rmm.worker.metrics import WorkerMetrics, _DeviceSamples
from dask_rmm.worker.stacks import install_stack, uninstall_stack

MiB = 1 << 20


@pytest.fixture
def worker_with_two_libraries():
    """A worker's stack (pool of 16 MiB growing to 64 MiB, host memory) as device 0's
    resource; a cache drawing from it and one beside it sharing its maximum."""
    opts = RMMOptions(base_resource="system", pool_size=16 * MiB, maximum_pool_size=64 * MiB)
    stack = build_stack(opts, 0, task_key=lambda: "work-1", owner_name=lambda k: "work")
    install_stack(stack)
    inside, outside = HostLibraryCache(), HostOutsideCache()
    caches.register_cache(inside)
    caches.register_cache(outside)
    pool = stack.top
    while not isinstance(pool, PoolMemoryResource):
        pool = pool.upstream_mr
    pool.share_budget(outside.budget(0))
    yield stack, inside, outside, pool
    inside.release(0)
    outside.release(0)
    uninstall_stack(stack)


def _heartbeat(stack) -> dict:
    d = WorkerMetrics._device_metrics(_DeviceSamples(stack), 10, [])
    assert "error" not in d, d.get("error")
    return d


def _fill(inside, outside) -> None:
    a = [inside.malloc(n) for n in (MiB, 2 * MiB, 3 * MiB)]
    inside.free(a[1])  # 2 MiB held free in the cache in front of the stack
    b = [outside.malloc(n) for n in (4 * MiB, 5 * MiB)]
    outside.free(b[0])  # 4 MiB held free beside it


def test_the_heartbeat_names_each_librarys_bytes_and_the_parts_add_up(worker_with_two_libraries):
    stack, inside, outside, pool = worker_with_two_libraries
    direct = stack.top.allocate(MiB // 2)  # a DeviceBuffer's worth, through no cache
    _fill(inside, outside)
    d = _heartbeat(stack)
    sample = wire.DeviceSample.from_dict(d)
    shares = {x.library: x for x in sample.libraries}
    assert shares == {
        "fakelib": wire.LibraryShare("fakelib", 4 * MiB, 2 * MiB, False),
        "outsidelib": wire.LibraryShare("outsidelib", 5 * MiB, 4 * MiB, True),
    }
    # the stack's fields count only what was drawn from it
    assert sample.current_bytes == 6 * MiB + MiB // 2
    assert sample.library_cached_bytes == 2 * MiB and sample.library_caches == "fakelib"
    assert sample.library_outside_bytes == 9 * MiB
    assert sample.direct_bytes == MiB // 2
    parts = dict(sample.breakdown())
    assert parts == {
        "fakelib in use": 4 * MiB,
        "fakelib cache free": 2 * MiB,
        "outsidelib in use": 5 * MiB,
        "outsidelib cache free": 4 * MiB,
        "other allocations": MiB // 2,
        "pool free": sample.reserved_bytes - sample.current_bytes,
    }
    # host memory: no device figure, so no "outside dask-rmm" part; the parts are what the
    # stack reserved plus what the library beside it holds
    assert sample.outside_dask_rmm_bytes is None
    assert sum(parts.values()) == sample.reserved_bytes + sample.library_outside_bytes
    # the library beside the stack was given the room the pool leaves
    assert outside.room == 64 * MiB - pool.pool_size()
    stack.top.deallocate(direct, MiB // 2)


def test_with_a_device_figure_the_parts_add_up_to_the_devices_used_memory():
    sample = wire.DeviceSample(
        current_bytes=10 * MiB,
        reserved_bytes=16 * MiB,
        retired_bytes=MiB,
        library_outside_bytes=7 * MiB,
        libraries=(
            wire.LibraryShare("cupy", 6 * MiB, 2 * MiB, False),
            wire.LibraryShare("torch", 5 * MiB, 2 * MiB, True),
        ),
        device_used_bytes=40 * MiB,
        device_total_bytes=80 * MiB,
    )
    parts = dict(sample.breakdown())
    assert parts["other allocations"] == 2 * MiB  # 10 - (6 + 2)
    assert parts["pool free"] == 6 * MiB
    assert parts["retired stacks"] == MiB
    assert parts["outside dask-rmm"] == 40 * MiB - 16 * MiB - 7 * MiB - MiB
    assert sum(parts.values()) == 40 * MiB
    # figures read at slightly different moments never give negative parts
    skew = wire.DeviceSample(
        reserved_bytes=50 * MiB, device_used_bytes=40 * MiB, device_total_bytes=80 * MiB
    )
    assert skew.outside_dask_rmm_bytes == 0


def test_the_wire_keeps_the_libraries_and_older_heartbeats_still_read():
    sample = wire.DeviceSample(
        libraries=(wire.LibraryShare("torch", 3, 4, True),), library_outside_bytes=7
    )
    d = sample.to_dict()
    assert d["libraries"] == [["torch", 3, 4, 1]]
    again = wire.DeviceSample.from_dict(json.loads(json.dumps(d)))
    assert again.libraries == sample.libraries and again.library_outside_bytes == 7
    old = wire.DeviceSample.from_dict({"current_bytes": 5})  # a worker from before the field
    assert old.libraries == () and old.library_outside_bytes == 0
    assert dict(old.breakdown()) == {"other allocations": 5, "pool free": 0}
    broken = wire.DeviceSample.from_dict({"libraries": [["x"], "nonsense", ["torch", "1", 2, 0]]})
    assert broken.libraries == (wire.LibraryShare("torch", 1, 2, False),)
    gauges = [g[1] for g in wire.GAUGES]
    assert "dask_rmm_library_outside_bytes" in gauges and "dask_rmm_device_used_bytes" in gauges


def test_outside_caches_are_not_counted_as_the_stacks_cached_bytes(worker_with_two_libraries):
    _, inside, outside, _ = worker_with_two_libraries
    _fill(inside, outside)
    assert caches.cached_bytes(0) == {"fakelib": 2 * MiB}
    assert caches.outside_in_use_bytes(0) == 5 * MiB
    assert caches.library_bytes(0)["outsidelib"] == caches.LibraryBytes(5 * MiB, 4 * MiB, True)
    assert caches.release_cached(0) == 6 * MiB  # both give their free bytes back
    assert outside.cached_bytes(0) == 0 and inside.cached_bytes(0) == 0


def _report_with(device_fields: dict) -> ClusterMemoryReport:
    dev = wire.DeviceSample(**device_fields).to_dict()
    host = dict(dev, device_used_bytes=0, device_total_bytes=0)
    data = {
        "version": wire.REPORT_VERSION,
        "time": 1700000000.0,
        "scheduler": "tcp://10.0.0.1:8786",
        "workers": [
            {"address": "tcp://10.0.0.10:4000", "name": "gpu", "devices": {"0": dev}},
            {"address": "tcp://10.0.0.11:4000", "name": "cpu", "devices": {"0": host}},
        ],
    }
    return ClusterMemoryReport.from_dict(json.loads(json.dumps(data)))


_FIELDS = {
    "current_bytes": 10 * MiB,
    "reserved_bytes": 16 * MiB,
    "library_cached_bytes": 2 * MiB,
    "library_caches": "cupy",
    "library_outside_bytes": 7 * MiB,
    "libraries": (
        wire.LibraryShare("cupy", 6 * MiB, 2 * MiB, False),
        wire.LibraryShare("torch", 5 * MiB, 2 * MiB, True),
    ),
    "device_used_bytes": 40 * MiB,
    "device_total_bytes": 80 * MiB,
}


def test_the_report_shows_the_breakdown_in_text_html_json_and_frame():
    r = _report_with(_FIELDS)
    text = str(r)
    assert "where the bytes are" in text
    line = [ln for ln in text.splitlines() if ln.startswith("10.0.0.10:4000 (gpu)/dev0:")][-1]
    for part in ("6.00 MiB cupy in use", "5.00 MiB torch in use", "2.00 MiB torch cache free"):
        assert part in line
    assert "17.00 MiB outside dask-rmm = 40.00 MiB used of the device" in line
    cpu = [ln for ln in text.splitlines() if ln.startswith("10.0.0.11:4000 (cpu)/dev0:")][-1]
    assert cpu.endswith("(host memory: no device figure)") and "outside dask-rmm" not in cpu
    page = r.to_html(full_page=True)
    assert "Where the bytes are" in page and page.count("<svg") >= 1
    assert "torch cache free: 2.00 MiB" in page  # a bar segment's tooltip
    again = ClusterMemoryReport.from_dict(json.loads(r.to_json()))
    assert again.device("tcp://10.0.0.10:4000", 0).libraries == _FIELDS["libraries"]
    pd = pytest.importorskip("pandas")
    frame = r.to_frame().set_index("name")
    assert frame.loc["gpu", "torch_in_use_bytes"] == 5 * MiB
    assert frame.loc["gpu", "cupy_cache_free_bytes"] == 2 * MiB
    assert frame.loc["gpu", "outside_dask_rmm_bytes"] == 17 * MiB
    assert pd.isna(frame.loc["cpu", "outside_dask_rmm_bytes"])


def test_a_report_without_libraries_or_device_figures_has_no_breakdown():
    fields = {"current_bytes": MiB, "reserved_bytes": MiB}
    r = _report_with(dict(fields, device_used_bytes=4 * MiB, device_total_bytes=80 * MiB))
    text = str(r)  # the GPU worker has a device figure, even without libraries...
    assert "1.00 MiB other allocations, 0 B pool free, 3.00 MiB outside dask-rmm" in text
    r = ClusterMemoryReport.from_dict(
        {
            "version": wire.REPORT_VERSION,
            "workers": [
                {"address": "tcp://a:1", "devices": {"0": {"current_bytes": 5}}},
            ],
        }
    )
    assert "where the bytes are" not in str(r)  # ...an old host worker says nothing more
    assert "Where the bytes are" not in r.to_html()


@gen_cluster(client=True)
async def test_prometheus_exports_each_librarys_bytes_and_the_memory_outside(c, s, a, b):
    pytest.importorskip("prometheus_client")
    from fake_metrics import FakeRMMMetrics
    from prometheus_client.parser import text_string_to_metric_families
    from tornado.httpclient import AsyncHTTPClient

    from dask_rmm.scheduler import install_scheduler_plugin

    fa = FakeRMMMetrics()
    a.metrics["dask-rmm"] = fa
    fa["0"].allocate(10 * MiB)
    fa["0"].reserved = 16 * MiB
    fa["0"].extra = {
        k: v for k, v in wire.DeviceSample(**_FIELDS).to_dict().items() if k in _FIELDS
    }
    await install_scheduler_plugin(c)
    await a.heartbeat()
    r = await AsyncHTTPClient().fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")
    fams = {f.name: f for f in text_string_to_metric_families(r.body.decode())}
    in_use = {
        (x.labels["library"], x.labels["beside_stack"]): x.value
        for x in fams["dask_rmm_library_in_use_bytes"].samples
    }
    assert in_use == {("cupy", "0"): 6 * MiB, ("torch", "1"): 5 * MiB}
    free = {x.labels["library"]: x.value for x in fams["dask_rmm_library_cache_free_bytes"].samples}
    assert free == {"cupy": 2 * MiB, "torch": 2 * MiB}
    outside = {x.labels["worker"]: x.value for x in fams["dask_rmm_outside_bytes"].samples}
    assert outside == {a.address: 40 * MiB - 16 * MiB - 7 * MiB}
    used = {x.labels["worker"]: x.value for x in fams["dask_rmm_device_used_bytes"].samples}
    assert used[a.address] == 40 * MiB


def test_the_device_memory_limit_counts_the_bytes_in_use_beside_the_stack():
    from tests.pressure_helpers import pressure_stack

    wp, top = pressure_stack(8 * MiB, limit=6 * MiB)
    outside = HostOutsideCache()
    caches.register_cache(outside)
    try:
        device = wp.devices[0]
        ptr = top.allocate(MiB)
        assert device.current_bytes() == MiB
        held = outside.malloc(3 * MiB)
        outside.free(outside.malloc(2 * MiB))  # held free: given back, never counted as in use
        assert device.current_bytes() == 4 * MiB
        assert device.release_cached() == 2 * MiB and outside.cached_bytes(0) == 0
        outside.free(held)
        top.deallocate(ptr, MiB)
    finally:
        outside.release(0)
