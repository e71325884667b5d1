"""TrackingResourceAdaptor: outstanding allocations, their string form, stacks, wrong frees."""

from __future__ import annotations

import logging
import re

import pytest

from dask_rmm import logger
from dask_rmm.mr import CallbackMemoryResource, TrackingResourceAdaptor


def test_tracks_outstanding(base_resource):
    mr = TrackingResourceAdaptor(base_resource)
    a = mr.allocate(1000)
    b = mr.allocate(10)
    assert mr.get_allocated_bytes() == 1010
    assert mr.get_outstanding_allocations() == {a: 1000, b: 10}
    text = mr.get_outstanding_allocations_str()
    lines = text.splitlines()
    assert lines == [f"{p:#x}: {n} B" for p, n in sorted({a: 1000, b: 10}.items())]
    mr.deallocate(a, 1000)
    mr.deallocate(b, 10)
    assert mr.get_allocated_bytes() == 0
    assert mr.get_outstanding_allocations_str() == ""


def test_capture_stacks(base_resource):
    mr = TrackingResourceAdaptor(base_resource, capture_stacks=True)

    def make_leak():
        return mr.allocate(256)

    p = make_leak()
    text = mr.get_outstanding_allocations_str()
    assert re.match(rf"{p:#x}: 256 B : callstack:\n", text)
    assert "make_leak" in text
    mr.deallocate(p, 256)


def test_wrong_free_raises_before_upstream(base_resource):
    mr = TrackingResourceAdaptor(base_resource)
    p = mr.allocate(512)
    with pytest.raises(ValueError, match="wrong size"):
        mr.deallocate(p, 256)
    with pytest.raises(ValueError, match="not a live allocation"):
        mr.deallocate(p + (1 << 20), 512)
    assert mr.get_outstanding_allocations() == {p: 512}
    mr.deallocate(p, 512)
    with pytest.raises(ValueError, match="double free"):
        mr.deallocate(p, 512)
    assert mr.get_allocated_bytes() == 0


def test_upstream_refusal_restores_record():
    owned = {}

    def alloc(n, s):
        owned[0x10000] = n
        return 0x10000

    def dealloc(p, n, s):
        raise ValueError("upstream refuses")

    mr = TrackingResourceAdaptor(CallbackMemoryResource(alloc, dealloc))
    p = mr.allocate(100)
    with pytest.raises(ValueError, match="upstream refuses"):
        mr.deallocate(p, 100)
    assert mr.get_outstanding_allocations() == {p: 100} and mr.get_allocated_bytes() == 100


def test_log_outstanding_allocations(base_resource, caplog):
    mr = TrackingResourceAdaptor(base_resource)
    p = mr.allocate(300)
    log = logger.get_logger()
    log.propagate = True
    try:
        logger.set_logging_level("debug")
        with caplog.at_level(logging.DEBUG, logger=logger.LOGGER_NAME):
            mr.log_outstanding_allocations()
    finally:
        log.propagate = False
        logger.set_logging_level("info")
    assert f"Outstanding Allocations: {p:#x}: 300 B" in caplog.text
    mr.deallocate(p, 300)


def test_bad_capture_stacks(base_resource):
    with pytest.raises(TypeError):
        TrackingResourceAdaptor(base_resource, capture_stacks="yes")


# --- over a pool: the pool's live table is the adaptor's ------------------------------------------


def _pool(base_resource):
    from dask_rmm.mr import PoolMemoryResource

    return PoolMemoryResource(base_resource, initial_pool_size=1 << 22)


def test_over_a_fresh_pool_the_pool_table_is_read(base_resource):
    pool = _pool(base_resource)
    mr = TrackingResourceAdaptor(pool)
    assert mr.tracking_pool is pool and mr.allocate == pool.allocate
    a = mr.allocate(1000)
    b = mr.allocate(5 << 20)  # above the pool's cached sizes: an exact block
    assert mr.get_outstanding_allocations() == {a: 1000, b: 5 << 20}
    assert mr.get_allocated_bytes() == 1000 + (5 << 20)
    assert mr.get_outstanding_allocations_str().splitlines() == [
        f"{p:#x}: {n} B" for p, n in sorted({a: 1000, b: 5 << 20}.items())
    ]
    c = pool.allocate(300)  # made on the pool directly: listed too (documented)
    assert mr.get_outstanding_allocations()[c] == 300
    with pytest.raises(ValueError, match="wrong size"):
        mr.deallocate(a, 999)
    with pytest.raises(ValueError, match="double free|not a live allocation"):
        mr.deallocate(a + 256, 1000)
    assert mr.get_allocated_bytes() == 1300 + (5 << 20)  # refused frees changed nothing
    for p, n in ((a, 1000), (b, 5 << 20), (c, 300)):
        mr.deallocate(p, n)
    assert mr.get_outstanding_allocations() == {} and mr.get_outstanding_allocations_str() == ""


def test_keeps_its_own_table_when_the_pool_is_in_use_or_stacks_are_captured(base_resource):
    pool = _pool(base_resource)
    assert TrackingResourceAdaptor(pool, capture_stacks=True).tracking_pool is None
    p = pool.allocate(100)
    mr = TrackingResourceAdaptor(pool)  # a live block it did not hand out: not listed
    assert mr.tracking_pool is None
    q = mr.allocate(200)
    assert mr.get_outstanding_allocations() == {q: 200}
    mr.deallocate(q, 200)
    pool.deallocate(p, 100)
    with pytest.raises(AttributeError):
        mr.capture_stacks = True  # fixed at construction, as RMM's constructor argument


def test_statistics_over_a_pool_reading_tracking_adaptor_count_in_the_pool(base_resource):
    from dask_rmm.mr import StatisticsResourceAdaptor

    pool = _pool(base_resource)
    tracking = TrackingResourceAdaptor(pool)
    stats = StatisticsResourceAdaptor(tracking)
    assert stats.counting_pool is pool and stats.allocate == pool.allocate
    p = stats.allocate(4096)
    assert stats.allocation_counts.current_bytes == 4096
    assert tracking.get_outstanding_allocations() == {p: 4096}
    stats.deallocate(p, 4096)
    assert stats.allocation_counts.current_bytes == 0
    assert stats.allocation_counts.total_count == 1
