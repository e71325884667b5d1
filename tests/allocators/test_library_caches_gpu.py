"""Library caches on a real device: CuPy's MemoryPool and compiled RMM's pool in front of
dask-rmm's stack. The stack's statistics equal the caches' own counts, the heartbeat splits
bytes in arrays from bytes held free, the stack's limit holds through each cache, and a cache
out of memory gets memory back from the other caches (and from spilling) before it fails."""

from __future__ import annotations

import gc

import pytest
from conftest import local_process_cluster, wait_until

from dask_rmm import wire
from dask_rmm.allocators import rmm_interop
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions
from dask_rmm.worker.metrics import WorkerMetrics, _DeviceSamples
from dask_rmm.worker.stacks import install_stack, uninstall_stack

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def stack_128():
    """A worker's stack on device 0 (attribution > statistics > pool of at most 128 MiB)."""
    opts = RMMOptions(pool_size=128 * MiB, maximum_pool_size=128 * MiB)
    stack = build_stack(opts, 0, task_key=lambda: "work-1", owner_name=lambda k: "work")
    install_stack(stack)
    yield stack
    uninstall_stack(stack)


@pytest.fixture
def cupy_cache(stack_128):
    cupy = pytest.importorskip("cupy")
    from dask_rmm.allocators.cupy import get_cupy_cache, reset_cupy_allocator, set_cupy_allocator

    set_cupy_allocator()
    cache = get_cupy_cache()
    gc.collect()
    cache.release(0)
    # the process's one CuPy cache: no earlier test's array may still hold a block of it
    assert cache.pool.total_bytes() == 0
    try:
        yield cupy, cache, stack_128
    finally:
        reset_cupy_allocator()


def _sample(stack) -> wire.DeviceSample:
    d = WorkerMetrics._device_metrics(_DeviceSamples(stack), 10, [])
    assert "error" not in d, d["error"]
    return wire.DeviceSample.from_dict(d)


def test_gpu_cupy_cache_blocks_are_exactly_the_stacks_allocations(cupy_cache):
    cupy, cache, stack = cupy_cache
    pool = cache.pool
    arrays = [cupy.full(n, 1.0, dtype="float32") for n in (10, 1000, 250_000, 1 << 20, 77)]
    assert stack.statistics.current_bytes == pool.total_bytes() > 0
    sample = _sample(stack)
    assert sample.library_caches == "cupy"
    assert sample.library_cached_bytes == pool.free_bytes()
    assert sample.in_array_bytes == pool.used_bytes()
    del arrays[1::2]  # freed into CuPy's cache: the stack still holds the blocks
    assert stack.statistics.current_bytes == pool.total_bytes()
    sample = _sample(stack)
    assert sample.library_cached_bytes == pool.free_bytes() > 0
    assert sample.in_array_bytes == pool.used_bytes()
    released = cache.release(0)
    assert released > 0 and pool.free_bytes() == 0
    assert stack.statistics.current_bytes == pool.total_bytes() == pool.used_bytes()
    del arrays
    cache.release(0)
    assert stack.statistics.current_bytes == 0


def test_gpu_cupy_cache_out_of_memory_gives_free_blocks_back_and_the_limit_holds(cupy_cache):
    cupy, cache, stack = cupy_cache
    a = cupy.empty(100 * MiB, dtype="u1")
    del a  # 100 MiB cached by CuPy, drawn from the 128 MiB stack
    b = cupy.empty(120 * MiB, dtype="u1")  # larger: the cached block goes back first
    assert cache.pool.total_bytes() == 120 * MiB == stack.statistics.current_bytes
    with pytest.raises(MemoryError, match="out of memory") as info:
        cupy.empty(100 * MiB, dtype="u1")  # over the stack's maximum: the stack's own error
    assert "requested" in str(info.value)
    b[:] = 7
    assert int(b[-1]) == 7


def test_gpu_cupy_cache_serves_streams_in_order(cupy_cache):
    cupy, cache, stack = cupy_cache
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.arange(1 << 20, dtype="float32")
        y = x * 2
        del x
        z = cupy.ones(1 << 20, dtype="float32")  # may reuse x's block on the same stream
        total = float((y + z).sum())
    s.synchronize()
    n = 1 << 20
    assert total == float(n * (n - 1) + n)
    assert stack.statistics.current_bytes == cache.pool.total_bytes()


@pytest.fixture
def rmm_cache(stack_128, monkeypatch):
    rmm = rmm_interop._rmm
    if rmm is None:
        pytest.skip(f"needs the compiled rmm: {rmm_interop._library_import_error}")
    monkeypatch.setattr(rmm_interop, "RMM_CACHE_INITIAL_SIZE", 0)  # the pool starts empty
    before = rmm.mr.get_per_device_resource(0)
    rmm_interop.set_rmm_callback_resource([0])
    try:
        yield rmm, rmm_interop.get_rmm_cache(0), stack_128
    finally:
        rmm_interop.reset_rmm_callback_resource()
        rmm.mr.set_per_device_resource(0, before)


def test_gpu_rmm_cache_counts_each_allocation_and_draws_blocks_from_the_stack(rmm_cache):
    rmm, cache, stack = rmm_cache
    assert rmm.mr.get_per_device_resource(0) is cache.top
    buffers = [rmm.DeviceBuffer(size=n) for n in (MiB, 3 * MiB, 1000, 5 * MiB)]
    counts = cache.statistics()
    assert counts["current_count"] == 4 and counts["total_count"] == 4
    assert counts["current_bytes"] == sum(b.size for b in buffers)
    assert stack.statistics.current_bytes == cache.pool_size() >= counts["current_bytes"]
    sample = _sample(stack)
    assert "rmm" in sample.library_caches.split(",")
    assert sample.library_cached_bytes >= cache.cached_bytes(0)
    assert cache.cached_bytes(0) == cache.pool_size() - counts["current_bytes"]
    del buffers
    counts = cache.statistics()
    assert counts["current_count"] == 0 and counts["peak_count"] == 4
    assert cache.cached_bytes(0) == cache.pool_size()  # RMM's pool keeps its blocks


def test_gpu_rmm_cache_serves_another_stream_and_draws_on_it(rmm_cache):
    from rmm.pylibrmm.stream import Stream as RMMStream

    rmm, cache, stack = rmm_cache
    stream = RMMStream()
    _KEEP_STREAMS.append(stream)  # RMM's pool may order on it after the test
    buf = rmm.DeviceBuffer(size=8 * MiB, stream=stream)  # the pool's first block, drawn on it
    buf.copy_from_host(b"\x05" * (8 * MiB), stream=stream)
    stream.synchronize()
    assert bytes(buf.copy_to_host())[-1] == 5
    assert cache.statistics()["current_bytes"] == 8 * MiB
    del buf
    assert cache.statistics()["current_bytes"] == 0
    assert stack.statistics.current_bytes == cache.pool_size()


#: RMM streams a compiled pool may still order on: kept for the whole session.
_KEEP_STREAMS: list = []


def test_gpu_rmm_cache_respects_the_stacks_maximum(rmm_cache):
    rmm, cache, stack = rmm_cache
    with pytest.raises(MemoryError):
        rmm.DeviceBuffer(size=200 * MiB)
    assert stack.statistics.current_bytes <= 128 * MiB
    b = rmm.DeviceBuffer(size=100 * MiB)  # growth backs off to what fits
    assert b.size == 100 * MiB


def test_gpu_rmm_cache_out_of_memory_takes_cupy_cache_blocks_back(rmm_cache):
    cupy = pytest.importorskip("cupy")
    from dask_rmm.allocators.cupy import get_cupy_cache, reset_cupy_allocator, set_cupy_allocator

    rmm, cache, stack = rmm_cache
    set_cupy_allocator()
    try:
        a = cupy.empty(100 * MiB, dtype="u1")
        del a  # 100 MiB held free by CuPy's pool
        assert get_cupy_cache().pool.free_bytes() == 100 * MiB
        b = rmm.DeviceBuffer(size=64 * MiB)  # RMM's pool must grow: CuPy gives its block back
        assert b.size == 64 * MiB and cache.retries == 1
        assert get_cupy_cache().pool.free_bytes() == 0
        del b
    finally:
        reset_cupy_allocator()


def _worker_view(dask_worker=None) -> dict:
    import cupy

    from dask_rmm.allocators.cupy import get_cupy_cache

    x = cupy.arange(1 << 20, dtype="float64")
    y = (x * 2).sum()
    del x
    pool = get_cupy_cache().pool
    d = wire.device_entries(dask_worker.metrics[wire.METRICS_KEY](dask_worker))["0"]
    return {
        "allocator is the cache": cupy.cuda.get_allocator() == pool.malloc,
        "free": pool.free_bytes(),
        "used": pool.used_bytes(),
        "sum": float(y),
        "heartbeat": d,
    }


@pytest.mark.slow
def test_gpu_plugin_default_puts_cupys_pool_in_front_and_reports_its_bytes():
    pytest.importorskip("cupy")
    from dask_rmm import RMMPlugin

    with local_process_cluster(n_workers=1, threads_per_worker=2) as (_, client):
        client.register_plugin(RMMPlugin(pool_size="256MiB", allocators=["cupy"]))
        (view,) = client.run(_worker_view).values()
        d = view["heartbeat"]
        assert view["allocator is the cache"]
        assert d["library_caches"] == "cupy"
        assert d["library_cached_bytes"] == view["free"] > 0
        assert d["current_bytes"] - d["library_cached_bytes"] == view["used"]

        def report_with_cache_line():
            import dask_rmm

            text = str(dask_rmm.cluster_report(client, timeline=False))
            return text if "held free in the cupy cache" in text else None

        assert "in arrays" in wait_until(report_with_cache_line, timeout=30.0, what="the report")
        client.register_plugin(
            RMMPlugin(pool_size="256MiB", allocators=["cupy"], exact_allocators=["cupy"])
        )
        (view,) = client.run(_worker_view).values()
        assert not view["allocator is the cache"]
        assert "library_caches" not in view["heartbeat"]  # none: left out
