"""Library caches in front of the stack, without CUDA: the registry, and that the numbers users
read stay honest through a cache (the stack's statistics equal an independent count of the
cache's draws; the heartbeat splits them into bytes in arrays and bytes held free)."""

from __future__ import annotations

import random
import threading

import pytest
from library_cache_helpers import HostLibraryCache

from dask_rmm import wire
from dask_rmm.allocators import caches
from dask_rmm.stack.build import build_stack
from dask_rmm.stack.options import RMMOptions
from dask_rmm.worker.metrics import WorkerMetrics, _DeviceSamples
from dask_rmm.worker.stacks import install_stack, uninstall_stack

MiB = 1 << 20


class _Fixed:
    def __init__(self, name, cached=0, released=0, fail=False):
        self.name, self._cached, self._released, self._fail = name, cached, released, fail

    def cached_bytes(self, device):
        if self._fail:
            raise RuntimeError("broken")
        return self._cached

    def release(self, device):
        if self._fail:
            raise RuntimeError("broken")
        return self._released


def test_caches_are_listed_once_and_unlisted():
    a, b = _Fixed("cupy", 10, 4), _Fixed("rmm", 5, 0)
    caches.register_cache(a)
    caches.register_cache(a)
    caches.register_cache(b)
    assert caches.library_caches() == [a, b]
    assert caches.cached_bytes(0) == {"cupy": 10, "rmm": 5}
    assert caches.release_cached(0) == 4
    caches.unregister_cache(a)
    caches.unregister_cache(a)  # not listed: nothing
    assert caches.library_caches() == [b]


def test_a_broken_cache_counts_zero_and_never_raises(caplog):
    caches.register_cache(_Fixed("cupy", fail=True))
    caches.register_cache(_Fixed("rmm", 7, 3))
    assert caches.cached_bytes(0) == {"cupy": 0, "rmm": 7}
    assert caches.release_cached(0) == 3
    assert "releasing the cupy cache failed" in caplog.text


def test_drawing_for_a_cache_is_per_thread_and_nests():
    seen = []
    assert not caches.is_drawing_for_cache()
    with caches.drawing_for_cache():
        with caches.drawing_for_cache():
            assert caches.is_drawing_for_cache()
        assert caches.is_drawing_for_cache()
        t = threading.Thread(target=lambda: seen.append(caches.is_drawing_for_cache()))
        t.start()
        t.join()
    assert not caches.is_drawing_for_cache()
    assert seen == [False]


def test_oom_handlers_are_set_per_device_and_removed():
    def handler(n):
        return n

    caches.set_oom_handler(1, handler)
    assert caches.oom_handler(1) is handler and caches.oom_handler(0) is None
    caches.set_oom_handler(1, None)
    assert caches.oom_handler(1) is None


@pytest.fixture
def worker_stack_with_cache():
    """A worker's stack (attribution > statistics > pool of 64 MiB, host memory) as device 0's
    resource, and a library cache drawing from it."""
    opts = RMMOptions(base_resource="system", pool_size=64 * MiB, maximum_pool_size=64 * MiB)
    stack = build_stack(opts, 0, task_key=lambda: "work-1", owner_name=lambda k: "work")
    install_stack(stack)  # as a worker does: the heartbeat checks it is still installed
    cache = HostLibraryCache()
    caches.register_cache(cache)
    yield stack, cache
    cache.release(0)
    uninstall_stack(stack)


def _heartbeat(stack) -> wire.DeviceSample:
    d = WorkerMetrics._device_metrics(_DeviceSamples(stack), 10, [])
    assert "error" not in d, d.get("error")
    return wire.DeviceSample.from_dict(d)


def test_statistics_through_a_cache_equal_a_count_of_its_draws(worker_stack_with_cache):
    """Current, peak and total of the stack equal what counting each of the cache's draws and
    give-backs gives, at every step; the heartbeat's in-array and cached bytes equal the
    cache's own. Fails if any of them drifts."""
    stack, cache = worker_stack_with_cache
    rng = random.Random(1234)
    live: list[int] = []
    for step in range(600):
        r = rng.random()
        if r < 0.55 or not live:
            live.append(cache.malloc(rng.choice([100, 256, 4000, 70_000, MiB // 2])))
        elif r < 0.97:
            cache.free(live.pop(rng.randrange(len(live))))
        else:
            cache.release(0)
        counts = stack.statistics.allocation_counts
        assert counts.current_bytes == cache.live_drawn_bytes()
        assert counts.current_count == len(cache.block_sizes)
        assert counts.total_count == cache.draws
        assert counts.total_bytes == cache.drawn_bytes
        assert counts.peak_bytes == cache.peak_drawn_bytes
        if step % 50 == 0:
            sample = _heartbeat(stack)
            assert sample.current_bytes == cache.live_drawn_bytes()
            assert sample.library_cached_bytes == cache.cached_bytes(0)
            assert sample.in_array_bytes == cache.array_bytes()
            assert sample.library_caches == "fakelib"
            # the task that drew a block is charged with it (attribution sees draws only)
            assert sum(g.current_bytes for g in sample.task_groups) == cache.live_drawn_bytes()
    assert cache.draws < 600 * 0.55  # the cache did serve arrays from its free blocks


def test_the_heartbeat_without_a_cache_reports_no_cached_bytes():
    opts = RMMOptions(base_resource="system", pool_size=4 * MiB)
    stack = build_stack(opts, 0)
    install_stack(stack)
    ptr = stack.top.allocate(1000)
    try:
        sample = _heartbeat(stack)
        assert sample.library_cached_bytes == 0 and sample.library_caches == ""
        assert sample.in_array_bytes == sample.current_bytes == 1000
    finally:
        stack.top.deallocate(ptr, 1000)
        uninstall_stack(stack)


def test_a_cache_out_of_memory_gives_its_blocks_back_and_keeps_the_limit(
    worker_stack_with_cache,
):
    stack, cache = worker_stack_with_cache
    blocks = [cache.malloc(8 * MiB) for _ in range(8)]  # the whole 64 MiB pool
    with pytest.raises(MemoryError):
        cache.malloc(MiB)  # nothing cached: the stack's limit holds
    for ptr in blocks[:4]:
        cache.free(ptr)
    big = cache.malloc(16 * MiB)  # needs the cached blocks: given back, then drawn again
    assert cache.releases == 1 and cache.cached_bytes(0) == 0
    assert stack.statistics.current_bytes == 48 * MiB == cache.live_drawn_bytes()
    cache.free(big)
    for ptr in blocks[4:]:
        cache.free(ptr)


def test_wire_keeps_cache_fields_and_old_heartbeats_read_as_no_cache():
    sample = wire.DeviceSample(current_bytes=100, library_cached_bytes=30, library_caches="cupy")
    again = wire.DeviceSample.from_dict(sample.to_dict())
    assert (again.library_cached_bytes, again.library_caches, again.in_array_bytes) == (
        30,
        "cupy",
        70,
    )
    old = wire.DeviceSample.from_dict({"current_bytes": 5})
    assert (old.library_cached_bytes, old.library_caches, old.in_array_bytes) == (0, "", 5)
    assert ("library_cached_bytes", "dask_rmm_library_cached_bytes") in [g[:2] for g in wire.GAUGES]


def test_new_stacks_get_the_arrays_a_cache_makes_after_a_re_registration():
    """Installing new stacks has the caches give their free blocks back to the replaced ones:
    arrays made afterwards are drawn from, and counted by, the new stack."""
    from dask_rmm.worker.stacks import WorkerStack

    opts = RMMOptions(base_resource="system", pool_size=16 * MiB)
    ws = WorkerStack()
    old = build_stack(opts, 0)
    ws.install([old], opts, "first")
    cache = HostLibraryCache()
    caches.register_cache(cache)
    cache.free(cache.malloc(MiB))
    old_statistics = old.statistics  # retiring makes the stack's references weak
    assert old_statistics.current_bytes == MiB and cache.cached_bytes(0) == MiB
    new = build_stack(opts, 0)
    ws.install([new], opts, "second")
    try:
        assert cache.cached_bytes(0) == 0 and old_statistics.current_bytes == 0
        ptr = cache.malloc(MiB)
        assert new.statistics.current_bytes == MiB
        cache.free(ptr)
    finally:
        cache.release(0)
        ws.retire([new])
