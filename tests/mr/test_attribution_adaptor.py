"""AttributionResourceAdaptor: per-owner current/peak bytes, frees charged back, thread safety."""

from __future__ import annotations

import functools
import threading

import pytest

from dask_rmm.mr.attribution_adaptor import (
    UNATTRIBUTED,
    AttributionResourceAdaptor,
    OwnerMemory,
)
from dask_rmm.mr.base import DeviceMemoryResource, OutOfMemoryError
from dask_rmm.stream import DEFAULT_STREAM


class _Owner(threading.local):
    task = None


@pytest.fixture(params=["direct", "fused-pool", "fused-statistics-pool"])
def base_resource(request, base_resource_name):
    """Every test runs on the host's base resources, and again over a pool (directly and through
    a statistics adaptor), where the adaptor fuses with the pool."""
    from conftest import make_base_resource

    from dask_rmm.mr import PoolMemoryResource, StatisticsResourceAdaptor

    r = make_base_resource(base_resource_name)
    if request.param != "direct":
        r = PoolMemoryResource(r, initial_pool_size=32 << 20)
        if request.param == "fused-statistics-pool":
            r = StatisticsResourceAdaptor(r)
    return r


@pytest.fixture
def owner():
    return _Owner()


@pytest.fixture
def mr(base_resource, owner):
    return AttributionResourceAdaptor(
        base_resource,
        functools.partial(getattr, owner, "task", None),
        owner_name=lambda task: task.rsplit("-", 1)[0],
    )


def test_charges_current_and_peak_per_owner(mr, owner):
    owner.task = "load-1"
    a = mr.allocate(1000)
    b = mr.allocate(3000)
    owner.task = "sum-7"
    c = mr.allocate(500)
    assert mr.get_owner_memory("load") == OwnerMemory("load", 4000, 4000)
    assert mr.get_owner_memory("sum") == OwnerMemory("sum", 500, 500)
    mr.deallocate(b, 3000)
    mr.deallocate(a, 1000)
    assert mr.get_owner_memory("load") == OwnerMemory("load", 0, 4000)
    mr.deallocate(c, 500)
    assert [m.to_list() for m in mr.get_attribution()] == [["load", 0, 4000], ["sum", 0, 500]]
    assert mr.get_owner_memory("never") == OwnerMemory("never", 0, 0)


def test_tasks_of_one_prefix_share_a_count(mr, owner):
    ptrs = []
    for i in range(5):
        owner.task = f"chunk-{i}"
        ptrs.append(mr.allocate(256))
    assert mr.get_owner_memory("chunk").current_bytes == 5 * 256
    for p in ptrs:
        mr.deallocate(p, 256)
    assert mr.get_owner_memory("chunk") == OwnerMemory("chunk", 0, 5 * 256)


def test_free_from_another_thread_is_charged_to_the_allocating_owner(mr, owner):
    owner.task = "make-1"
    ptr = mr.allocate(2048)

    def free_elsewhere():
        owner.task = "other-1"  # the thread-local differs on this thread
        mr.deallocate(ptr, 2048)

    t = threading.Thread(target=free_elsewhere)
    t.start()
    t.join()
    assert mr.get_owner_memory("make") == OwnerMemory("make", 0, 2048)
    assert mr.get_owner_memory("other").peak_bytes == 0


def test_no_owner_is_unattributed(mr, owner):
    owner.task = None
    ptr = mr.allocate(100)
    assert mr.get_owner_memory(UNATTRIBUTED).current_bytes == 100
    mr.deallocate(ptr, 100)


def test_zero_bytes_are_not_charged(mr, owner):
    owner.task = "z-1"
    assert mr.allocate(0) == 0
    mr.deallocate(0, 0)
    assert mr.get_attribution() == []


def test_owner_name_errors_never_fail_an_allocation(base_resource, owner):
    def bad_name(task):
        raise RuntimeError("boom")

    mr = AttributionResourceAdaptor(
        base_resource, functools.partial(getattr, owner, "task", None), owner_name=bad_name
    )
    owner.task = "x-1"
    ptr = mr.allocate(512)
    assert mr.get_owner_memory(UNATTRIBUTED).current_bytes == 512
    mr.deallocate(ptr, 512)
    assert mr.get_owner_memory(UNATTRIBUTED).current_bytes == 0


def test_unhashable_owner_keys_are_named_each_time(base_resource):
    owner_key = ["list", "key"]
    mr = AttributionResourceAdaptor(base_resource, lambda: owner_key, owner_name=lambda t: t[0])
    ptr = mr.allocate(256)
    assert mr.get_owner_memory("list").current_bytes == 256
    mr.deallocate(ptr, 256)


class _Refusing(DeviceMemoryResource):
    def allocate(self, nbytes, stream=DEFAULT_STREAM):
        raise OutOfMemoryError("no", requested=nbytes)

    def deallocate(self, ptr, nbytes, stream=DEFAULT_STREAM):
        raise AssertionError("never allocated")


def test_failed_allocations_are_not_charged(owner):
    mr = AttributionResourceAdaptor(_Refusing(), functools.partial(getattr, owner, "task", None))
    owner.task = "big-1"
    with pytest.raises(MemoryError):
        mr.allocate(1 << 20)
    assert mr.get_attribution() == []


def test_refused_free_changes_nothing(mr, owner):
    owner.task = "w-1"
    ptr = mr.allocate(1024)
    with pytest.raises(ValueError):
        mr.deallocate(ptr, 2048)  # wrong size: the base resource refuses
    assert mr.get_owner_memory("w").current_bytes == 1024
    mr.deallocate(ptr, 1024)
    with pytest.raises(ValueError):
        mr.deallocate(ptr, 1024)  # double free
    assert mr.get_owner_memory("w") == OwnerMemory("w", 0, 1024)


def test_top_and_reset_peaks(mr, owner):
    held = []
    for name, size in [("a-1", 256), ("b-1", 4096), ("c-1", 1024)]:
        owner.task = name
        held.append((mr.allocate(size), size))
    assert [m.owner for m in mr.top(2)] == ["b", "c"]
    assert mr.top(0) == []
    ptr, size = held.pop(1)
    mr.deallocate(ptr, size)
    mr.reset_peaks()
    assert mr.get_owner_memory("b") == OwnerMemory("b", 0, 0)
    assert mr.get_owner_memory("c") == OwnerMemory("c", 1024, 1024)
    for ptr, size in held:
        mr.deallocate(ptr, size)


def test_threads_allocating_at_once_keep_exact_counts(mr, owner):
    n_threads, rounds = 8, 300
    barrier = threading.Barrier(n_threads)
    errors = []

    def work(i):
        try:
            owner.task = f"t{i % 2}-{i}"
            barrier.wait()
            live = []
            for r in range(rounds):
                size = 256 * (1 + r % 4)
                live.append((mr.allocate(size), size))
                if len(live) > 3:
                    mr.deallocate(*live.pop(0))
            for p, size in live:
                mr.deallocate(p, size)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for name in ("t0", "t1"):
        m = mr.get_owner_memory(name)
        assert m.current_bytes == 0
        # Four threads per prefix hold at most 4 blocks of at most 1 KiB each at a time.
        assert 0 < m.peak_bytes <= 4 * 4 * 1024


def test_rejects_non_callables(base_resource):
    with pytest.raises(TypeError, match="get_owner"):
        AttributionResourceAdaptor(base_resource, "not callable")
    with pytest.raises(TypeError, match="owner_name"):
        AttributionResourceAdaptor(base_resource, lambda: None, owner_name=3)


def test_delegates_reserved_memory_info_and_host_flag(base_resource):
    mr = AttributionResourceAdaptor(base_resource, lambda: None)
    assert mr.reserved_memory_info() == base_resource.reserved_memory_info()
    assert mr.is_host_memory == base_resource.is_host_memory
    assert mr.get_upstream() is base_resource
    assert "AttributionResourceAdaptor" in repr(mr)


def test_fuses_with_a_pool_under_statistics(owner):
    from conftest import make_base_resource

    from dask_rmm.mr import PoolMemoryResource, StatisticsResourceAdaptor

    pool = PoolMemoryResource(make_base_resource("system"), 1 << 20, 1 << 20)
    before = pool.allocate(256)  # live before attribution: never charged back
    stats = StatisticsResourceAdaptor(pool)
    mr = AttributionResourceAdaptor(stats, functools.partial(getattr, owner, "task", None))
    assert mr.allocate == pool.allocate  # neither layer adds a call
    owner.task = "load-1"
    p = mr.allocate(1000)
    with pytest.raises(MemoryError):
        mr.allocate(1 << 20)  # too big for what is left: charged to nobody
    pool.deallocate(before, 256)
    assert mr.get_owner_memory("load-1") == OwnerMemory("load-1", 1000, 1000)
    assert stats.allocation_counts.current_bytes == 1000 and stats.failed_allocations == 1
    mr.deallocate(p, 1000)
    assert mr.get_owner_memory("load-1").current_bytes == 0
    assert stats.allocation_counts.current_bytes == 0


def test_fused_adaptor_and_pool_form_no_reference_cycle(owner):
    """Dropped without the cycle collector: cyclic garbage finalizes in any order, which let a
    base resource's pool be destroyed before the suballocator above gave its chunks back."""
    import gc
    import weakref

    from conftest import make_base_resource

    from dask_rmm.mr import PoolMemoryResource, StatisticsResourceAdaptor

    gc.collect()
    gc.disable()
    try:
        pool = PoolMemoryResource(make_base_resource("system"), 1 << 20)
        mr = AttributionResourceAdaptor(
            StatisticsResourceAdaptor(pool), functools.partial(getattr, owner, "task", None)
        )
        assert mr.allocate == pool.allocate
        mr.deallocate(mr.allocate(100), 100)
        dead = weakref.ref(pool)
        del pool, mr
        assert dead() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "pool-charged"])
def test_peak_windows_measure_a_block_and_leave_the_peaks_since_made(pooled):
    """A performance report's block needs each task group's peak over the block; the peaks
    since the adaptor was made (the cluster report's) must not change, windows may overlap."""
    import threading

    from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource
    from dask_rmm.mr.attribution_adaptor import AttributionResourceAdaptor

    local = threading.local()
    base = SystemMemoryResource()
    upstream = PoolMemoryResource(base, initial_pool_size=8 << 20) if pooled else base
    mr = AttributionResourceAdaptor(upstream, lambda: getattr(local, "task", None))
    assert (mr.charging_pool is not None) == pooled

    def burst(task: str, nbytes: int) -> None:
        local.task = task
        mr.deallocate(mr.allocate(nbytes), nbytes)

    burst("x", 4096)
    local.task = "held"
    held = mr.allocate(1024)
    outer = mr.open_window()
    burst("x", 512)
    inner = mr.open_window()
    burst("x", 2048)
    burst("y", 256)
    assert mr.close_window(inner) == {"x": 2048, "y": 256, "held": 1024}
    burst("x", 1024)
    assert mr.close_window(outer) == {"x": 2048, "y": 256, "held": 1024}
    peaks = {m.owner: m.peak_bytes for m in mr.get_attribution()}
    assert peaks == {"x": 4096, "y": 256, "held": 1024}
    assert mr.get_owner_memory("x").peak_bytes == 4096
    with pytest.raises(KeyError):
        mr.close_window(outer)
    mr.deallocate(held, 1024)
