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
    with pytest.raises(ValueError, match="not allocated through"):
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
