"""The lock-free fast paths (pool, arena, fixed size, tracking): each block goes to exactly one
caller when threads race, and the pool's instrumentation interface (counters, owner accounts)."""

from __future__ import annotations

import threading
import time

import pytest

from dask_rmm import mr
from dask_rmm.mr.pool import AllocationCounters, OwnerAccounts, PoolMemoryResource

MiB = 1 << 20


def _make(kind, up):
    if kind == "pool":
        return PoolMemoryResource(up, initial_pool_size=8 * MiB)
    if kind == "arena":
        return mr.ArenaMemoryResource(up, arena_size=8 * MiB)
    if kind == "fixed":
        return mr.FixedSizeMemoryResource(up, block_size=4096, blocks_to_preallocate=64)
    if kind == "tracking":
        return mr.TrackingResourceAdaptor(PoolMemoryResource(up, initial_pool_size=8 * MiB))
    raise ValueError(kind)


def _race(n_threads, fn):
    barrier = threading.Barrier(n_threads)
    results = [None] * n_threads

    def run(i):
        barrier.wait()
        try:
            results[i] = fn()
        except ValueError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("kind", ["pool", "arena", "fixed", "tracking"])
def test_concurrent_double_free_is_refused_once(kind, base_resource):
    res = _make(kind, base_resource)
    for _ in range(20):
        ptr = res.allocate(1000)
        results = _race(4, lambda ptr=ptr: res.deallocate(ptr, 1000))
        errors = [r for r in results if isinstance(r, ValueError)]
        assert len(errors) == 3, results
        # the block came back exactly once: the next two allocations differ
        a, b = res.allocate(1000), res.allocate(1000)
        assert a != b
        res.deallocate(a, 1000)
        res.deallocate(b, 1000)
    info = res.reserved_memory_info()
    if info is not None and kind != "tracking":
        assert info.free_bytes == info.reserved_bytes


@pytest.mark.parametrize("kind", ["pool", "arena", "fixed"])
def test_racing_allocations_never_share_a_block(kind, base_resource):
    res = _make(kind, base_resource)
    warm = [res.allocate(1000) for _ in range(32)]  # fill the cache of this class
    for p in warm:
        res.deallocate(p, 1000)
    got = _race(8, lambda: [res.allocate(1000) for _ in range(16)])
    ptrs = [p for lst in got for p in lst]
    assert len(set(ptrs)) == len(ptrs) == 128
    for p in ptrs:
        res.deallocate(p, 1000)


def test_pool_counts_through_its_instrumentation_interface(base_resource):
    pool = PoolMemoryResource(base_resource, initial_pool_size=4 * MiB, maximum_pool_size=4 * MiB)
    before = pool.allocate(1000)  # live before counting: its free is not counted
    c = AllocationCounters()
    assert pool.count_allocations(c)
    assert not pool.count_allocations(AllocationCounters())  # one at a time
    a = pool.allocate(3000)
    b = pool.allocate(2 * MiB)  # not from the cache
    with pool.instrumentation_lock:
        assert (c.total_bytes, c.total_count, c.peak_bytes, c.peak_count) == (
            3000 + 2 * MiB, 2, 3000 + 2 * MiB, 2)
    pool.deallocate(a, 3000)
    pool.deallocate(before, 1000)
    with pytest.raises(MemoryError):
        pool.allocate(3 * MiB)
    assert (c.freed_bytes, c.freed_count, c.failed) == (3000, 1, 1)
    pool.deallocate(b, 2 * MiB)
    pool.stop_counting(c)
    pool.deallocate(pool.allocate(100), 100)  # not counted any more
    assert (c.total_count, c.freed_count) == (2, 2)
    assert pool.count_allocations(AllocationCounters())
    with pytest.raises(TypeError, match="AllocationCounters"):
        pool.count_allocations(object())


def test_pool_charges_owner_accounts(base_resource):
    pool = PoolMemoryResource(base_resource, initial_pool_size=4 * MiB)
    local = threading.local()
    opened = []
    accounts: dict = {}

    def open_account(token):
        opened.append(token)
        return accounts.setdefault(token, [0, 0])

    owners = OwnerAccounts(lambda: getattr(local, "owner", None), accounts, open_account)
    assert pool.charge_owners(owners)
    assert not pool.charge_owners(OwnerAccounts(lambda: None, {}, open_account))
    local.owner = "x"
    p = pool.allocate(1000)
    q = pool.allocate(500)
    local.owner = "y"
    r = pool.allocate(20 * MiB)  # the slow path charges too
    pool.deallocate(p, 1000)
    t = threading.Thread(target=pool.deallocate, args=(q, 500))  # freed on another thread
    t.start()
    t.join()
    assert accounts == {"x": [0, 1500], "y": [20 * MiB, 20 * MiB]}
    assert opened == ["x", "y"]  # once per token
    pool.stop_charging(owners)
    pool.deallocate(r, 20 * MiB)
    assert accounts["y"] == [20 * MiB, 20 * MiB]  # detached: nothing charged back
    with pytest.raises(TypeError, match="OwnerAccounts"):
        pool.charge_owners(accounts)


def test_arena_reuses_a_freed_block_on_its_stream_only(base_resource):
    from conftest import make_test_streams

    arena = mr.ArenaMemoryResource(base_resource, arena_size=8 * MiB)
    s1, s2 = make_test_streams(2)
    p = arena.allocate(1000, s1)
    arena.deallocate(p, 1000, s1)
    q = arena.allocate(1000, s2)
    assert q != p  # s1's cached block is not handed to s2 without ordering
    assert arena.allocate(1000, s1) == p
    arena.deallocate(p, 1000, s1)
    arena.deallocate(q, 1000, s2)
    info = arena.reserved_memory_info()
    assert info.free_bytes == info.reserved_bytes


def test_token_lock_behaves_as_a_lock():
    from dask_rmm.mr.pool import TokenLock

    lock = TokenLock()
    assert lock.acquire(False) and lock.locked()
    assert not lock.acquire(False)
    assert not lock.acquire(timeout=0.01)
    got = []
    t = threading.Thread(target=lambda: got.append(lock.acquire()))  # waits for the release
    t.start()
    lock.release()
    t.join()
    assert got == [True] and lock.locked()
    lock.release()
    with pytest.raises(RuntimeError, match="unlocked"):
        lock.release()
    with lock:
        assert lock.locked()
    assert not lock.locked()


def test_token_lock_excludes_threads():
    from dask_rmm.mr.pool import TokenLock

    lock = TokenLock()
    inside = []
    counter = [0]

    def work():
        for _ in range(2000):
            with lock:
                inside.append(1)
                assert len(inside) == 1
                counter[0] += 1
                if counter[0] % 50 == 0:
                    time.sleep(0)  # let other threads run while it is held
                inside.pop()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter[0] == 8000
