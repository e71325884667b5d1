"""LimitingResourceAdaptor: exact limit, aligned accounting, no race between threads."""

from __future__ import annotations

import threading

import pytest

from dask_rmm.mr import CallbackMemoryResource, LimitingResourceAdaptor, OutOfMemoryError


def test_limit_and_alignment(base_resource):
    mr = LimitingResourceAdaptor(base_resource, allocation_limit=4096)
    assert mr.get_allocation_limit() == 4096
    a = mr.allocate(1000)  # counts 1024
    assert mr.get_allocated_bytes() == 1024
    b = mr.allocate(3072)
    with pytest.raises(OutOfMemoryError, match="exceeded memory limit") as info:
        mr.allocate(1)
    assert info.value.requested == 1 and info.value.free_bytes == 0
    assert mr.get_allocated_bytes() == 4096
    mr.deallocate(a, 1000)
    c = mr.allocate(1024)
    for p, n in ((b, 3072), (c, 1024)):
        mr.deallocate(p, n)
    assert mr.get_allocated_bytes() == 0


def test_wrong_free_leaves_count(base_resource):
    mr = LimitingResourceAdaptor(base_resource, allocation_limit=1 << 20)
    p = mr.allocate(512)
    with pytest.raises(ValueError):
        mr.deallocate(p, 256)
    assert mr.get_allocated_bytes() == 512
    mr.deallocate(p, 512)
    with pytest.raises(ValueError):
        mr.deallocate(p, 512)
    assert mr.get_allocated_bytes() == 0


def test_upstream_failure_gives_room_back():
    def alloc(n, s):
        raise MemoryError("upstream full")

    mr = LimitingResourceAdaptor(CallbackMemoryResource(alloc, lambda p, n, s: None), 1 << 20)
    with pytest.raises(MemoryError, match="upstream full"):
        mr.allocate(1000)
    assert mr.get_allocated_bytes() == 0


def test_limit_exact_under_8_threads(base_resource):
    limit = 64 * 256
    mr = LimitingResourceAdaptor(base_resource, allocation_limit=limit)
    n_threads = 8
    barrier = threading.Barrier(n_threads)
    got: list[list[int]] = [[] for _ in range(n_threads)]
    refused = [0] * n_threads
    peak = [0]
    lock = threading.Lock()

    def work(i):
        barrier.wait()
        for _ in range(40):
            try:
                got[i].append(mr.allocate(256))
            except MemoryError:
                refused[i] += 1
            with lock:
                peak[0] = max(peak[0], mr.get_allocated_bytes())
            assert mr.get_allocated_bytes() <= limit

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(map(len, got)) == 64  # exactly the limit's worth succeeded
    assert sum(refused) == n_threads * 40 - 64
    assert mr.get_allocated_bytes() == limit and peak[0] <= limit
    for ptrs in got:
        for p in ptrs:
            mr.deallocate(p, 256)
    assert mr.get_allocated_bytes() == 0


@pytest.mark.parametrize("bad, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_limit(base_resource, bad, exc):
    with pytest.raises(exc):
        LimitingResourceAdaptor(base_resource, bad)
