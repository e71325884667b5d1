"""StatisticsResourceAdaptor: exact counters after random sequences, the counter stack, failed
allocations, interval peaks, wrong frees and threads."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from conftest import make_base_resource
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_rmm.mr import (
    CallbackMemoryResource,
    LimitingResourceAdaptor,
    PoolMemoryResource,
    StatisticsResourceAdaptor,
    SystemMemoryResource,
)
from dask_rmm.mr.statistics_adaptor import Statistics


@pytest.fixture(params=["direct", "fused-pool"])
def base_resource(request, base_resource_name):
    """Every test runs on the host's base resources, and again over a pool, where the adaptor
    fuses with it (the pool counts under its own lock)."""
    r = make_base_resource(base_resource_name)
    if request.param == "fused-pool":
        r = PoolMemoryResource(r, initial_pool_size=32 << 20)
    return r


FIELDS = (
    "current_bytes",
    "current_count",
    "peak_bytes",
    "peak_count",
    "total_bytes",
    "total_count",
)


class Model:
    """RMM's counter-stack semantics, written plainly."""

    def __init__(self):
        self.frames = [dict.fromkeys(FIELDS, 0)]

    def alloc(self, n):
        f = self.frames[-1]
        f["current_bytes"] += n
        f["current_count"] += 1
        f["total_bytes"] += n
        f["total_count"] += 1
        f["peak_bytes"] = max(f["peak_bytes"], f["current_bytes"])
        f["peak_count"] = max(f["peak_count"], f["current_count"])

    def free(self, n):
        f = self.frames[-1]
        f["current_bytes"] -= n
        f["current_count"] -= 1

    def push(self):
        before = dict(self.frames[-1])
        self.frames.append(dict.fromkeys(FIELDS, 0))
        return before

    def pop(self):
        inner = self.frames.pop()
        outer = self.frames[-1]
        outer["peak_bytes"] = max(outer["peak_bytes"], outer["current_bytes"] + inner["peak_bytes"])
        outer["peak_count"] = max(outer["peak_count"], outer["current_count"] + inner["peak_count"])
        for k in ("current_bytes", "current_count", "total_bytes", "total_count"):
            outer[k] += inner[k]
        return inner


def test_statistics_is_typed_and_indexes_like_a_dict():
    s = Statistics(1, 2, 3, 4, 5, 6)
    assert s["current_bytes"] == 1 and s["total_count"] == 6
    assert tuple(s.keys()) == FIELDS and dict(s.items()) == s.to_dict()
    assert "peak_bytes" in s and "nope" not in s and len(s) == 6
    assert s.get("nope", 7) == 7
    with pytest.raises(KeyError):
        s["nope"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.current_bytes = 3


def test_counts_and_peaks(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    a = mr.allocate(1000)
    b = mr.allocate(24)
    mr.deallocate(a, 1000)
    assert mr.allocation_counts == Statistics(24, 1, 1024, 2, 1024, 2)
    mr.deallocate(b, 24)
    assert mr.allocation_counts == Statistics(0, 0, 1024, 2, 1024, 2)
    assert mr.get_upstream() is base_resource and mr.device_id == base_resource.device_id


def test_zero_byte_allocations_are_not_counted(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    assert mr.allocate(0) == 0
    mr.deallocate(0, 0)
    assert mr.allocation_counts == Statistics(0, 0, 0, 0, 0, 0)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("aaafpo"), st.integers(1, 5000), st.integers(0, 99)), max_size=80
    )
)
def test_random_sequences_match_the_model(base_resource, ops):
    mr = StatisticsResourceAdaptor(base_resource)
    model = Model()
    live: list[tuple[int, int]] = []
    for op, size, pick in ops:
        if op == "a":
            live.append((mr.allocate(size), size))
            model.alloc(size)
        elif op == "f" and live:
            ptr, n = live.pop(pick % len(live))
            mr.deallocate(ptr, n)
            model.free(n)
        elif op == "p":
            assert mr.push_counters().to_dict() == model.push()
        elif op == "o" and len(model.frames) > 1:
            assert mr.pop_counters().to_dict() == model.pop()
        assert mr.allocation_counts.to_dict() == model.frames[-1]
        assert mr.counter_depth == len(model.frames)
        assert mr.current_bytes == sum(n for _, n in live)
    for ptr, n in live:
        mr.deallocate(ptr, n)


def test_pop_without_push_raises_and_changes_nothing(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    p = mr.allocate(10)
    with pytest.raises(IndexError, match="push_counters"):
        mr.pop_counters()
    assert mr.allocation_counts == Statistics(10, 1, 10, 1, 10, 1)
    mr.deallocate(p, 10)


def test_push_returns_previous_and_pop_merges_peak(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    outer = mr.allocate(100)
    assert mr.push_counters() == Statistics(100, 1, 100, 1, 100, 1)
    inner = mr.allocate(300)
    mr.deallocate(inner, 300)
    assert mr.pop_counters() == Statistics(0, 0, 300, 1, 300, 1)
    assert mr.allocation_counts == Statistics(100, 1, 400, 2, 400, 2)
    mr.deallocate(outer, 100)


def test_wrong_free_raises_and_leaves_counters(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    p = mr.allocate(512)
    before = mr.allocation_counts
    with pytest.raises(ValueError):
        mr.deallocate(p, 256)  # wrong size: the base resource refuses
    with pytest.raises(ValueError):
        mr.deallocate(p + 4096 * 1024, 512)  # foreign pointer
    assert mr.allocation_counts == before
    mr.deallocate(p, 512)
    with pytest.raises(ValueError):
        mr.deallocate(p, 512)  # double free
    assert mr.allocation_counts == Statistics(0, 0, 512, 1, 512, 1)


def test_failed_allocations_are_counted_and_change_nothing_else(base_resource):
    limited = LimitingResourceAdaptor(base_resource, allocation_limit=1024)
    mr = StatisticsResourceAdaptor(limited)
    p = mr.allocate(1024)
    with pytest.raises(MemoryError):
        mr.allocate(1)
    assert mr.failed_allocations == 1
    assert mr.allocation_counts == Statistics(1024, 1, 1024, 1, 1024, 1)
    mr.deallocate(p, 1024)


def test_take_interval_peak(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    assert mr.take_interval_peak() == 0
    a = mr.allocate(1000)
    b = mr.allocate(500)
    mr.deallocate(b, 500)
    assert mr.take_interval_peak() == 1500
    assert mr.take_interval_peak() == 1000  # restarts at the current value
    mr.push_counters()  # the interval peak is absolute, whatever the frame
    c = mr.allocate(200)
    mr.deallocate(c, 200)
    assert mr.take_interval_peak() == 1200
    d = mr.allocate(300)
    mr.pop_counters()
    assert mr.take_interval_peak() == 1300
    mr.deallocate(d, 300)
    mr.deallocate(a, 1000)
    assert mr.take_interval_peak() == 1300
    assert mr.take_interval_peak() == 0


def test_counts_exact_under_threads(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    n_threads, rounds = 8, 300
    barrier = threading.Barrier(n_threads)

    def work(i):
        barrier.wait()
        for r in range(rounds):
            size = 256 * (1 + (i + r) % 4)
            ptr = mr.allocate(size)
            mr.deallocate(ptr, size)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = mr.allocation_counts
    assert s.current_bytes == 0 and s.current_count == 0
    assert s.total_count == n_threads * rounds
    assert s.total_bytes == sum(
        256 * (1 + (i + r) % 4) for i in range(n_threads) for r in range(rounds)
    )
    assert 1 <= s.peak_count <= n_threads


def test_upstream_exception_other_than_memory_error_passes_through():
    def alloc(nbytes, stream):
        raise RuntimeError("boom")

    mr = StatisticsResourceAdaptor(CallbackMemoryResource(alloc, lambda p, n, s: None))
    with pytest.raises(RuntimeError, match="boom"):
        mr.allocate(10)
    assert mr.failed_allocations == 0  # only out-of-memory counts as a failed allocation
    assert mr.allocation_counts.total_count == 0


def test_fuses_with_a_pool_and_counts_its_out_of_memory():
    pool = PoolMemoryResource(make_base_resource("system"), 1 << 20, 1 << 20)
    mr = StatisticsResourceAdaptor(pool)
    assert mr.allocate == pool.allocate  # no second call layer
    p = mr.allocate(1 << 19)
    with pytest.raises(MemoryError):
        mr.allocate(1 << 20)
    assert mr.failed_allocations == 1
    assert mr.allocation_counts == Statistics(1 << 19, 1, 1 << 19, 1, 1 << 19, 1)
    mr.deallocate(p, 1 << 19)
    assert mr.allocation_counts.current_bytes == 0


def test_fused_adaptor_ignores_frees_of_blocks_live_before_it():
    pool = PoolMemoryResource(make_base_resource("system"), 1 << 20)
    old = pool.allocate(4096)
    mr = StatisticsResourceAdaptor(pool)
    new = mr.allocate(1000)
    pool.deallocate(old, 4096)  # a buffer from before statistics were enabled
    assert mr.allocation_counts == Statistics(1000, 1, 1000, 1, 1000, 1)
    second = StatisticsResourceAdaptor(pool)  # one fused adaptor per pool: this one counts alone
    assert second.allocate != pool.allocate
    q = second.allocate(256)
    assert mr.allocation_counts.total_count == 2  # the fused counters see the pool's traffic
    assert second.allocation_counts == Statistics(256, 1, 256, 1, 256, 1)
    second.deallocate(q, 256)
    mr.deallocate(new, 1000)
    del mr
    import gc

    gc.collect()
    third = StatisticsResourceAdaptor(pool)  # the first one detached when it was collected
    assert third.allocate == pool.allocate


def test_repr_names_counts(base_resource):
    mr = StatisticsResourceAdaptor(base_resource)
    assert "StatisticsResourceAdaptor" in repr(mr) and "current=0" in repr(mr)


def test_rejects_non_resource_upstream():
    with pytest.raises(TypeError):
        StatisticsResourceAdaptor(object())


def test_popping_the_last_counter_pair_is_refused_with_rmms_words():
    mr = StatisticsResourceAdaptor(SystemMemoryResource())
    with pytest.raises(IndexError, match="cannot pop the last counter pair"):
        mr.pop_counters()
    assert mr.allocation_counts == Statistics(0, 0, 0, 0, 0, 0)  # nothing changed


def test_statistics_is_a_read_only_mapping():
    from collections.abc import Mapping

    s = Statistics(1, 2, 3, 4, 5, 6)
    assert isinstance(s, Mapping) and dict(s) == s.to_dict()
    assert list(s.values()) == [1, 2, 3, 4, 5, 6] and hash(s) == hash(Statistics(1, 2, 3, 4, 5, 6))
