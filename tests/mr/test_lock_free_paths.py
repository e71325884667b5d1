"""The lock-free fast paths (pool, arena, fixed size, tracking): each block goes to exactly one
caller when threads race, and the pool's instrumentation interface (counters, owner accounts)."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import pytest

from dask_rmm import mr
from dask_rmm.mr.instrumentation import JOURNAL_LIMIT, AllocationCounters, OwnerAccounts
from dask_rmm.mr.pool import PoolMemoryResource
from dask_rmm.mr.statistics_adaptor import Statistics

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
    assert len(c.journal) == 2  # journaled, not yet folded in
    with pool.instrumentation_lock:
        c.settle()
        assert (c.total_bytes, c.total_count, c.peak_bytes, c.peak_count) == (
            3000 + 2 * MiB,
            2,
            3000 + 2 * MiB,
            2,
        )
    assert c.journal == []
    pool.deallocate(a, 3000)
    pool.deallocate(before, 1000)
    with pytest.raises(MemoryError):
        pool.allocate(3 * MiB)
    with pool.instrumentation_lock:
        c.settle()
    assert (c.freed_bytes, c.freed_count, c.failed) == (3000, 1, 1)
    pool.deallocate(b, 2 * MiB)
    pool.stop_counting(c)
    pool.deallocate(pool.allocate(100), 100)  # not counted any more
    assert (c.total_count, c.freed_count) == (2, 2)
    assert pool.count_allocations(AllocationCounters())
    with pytest.raises(TypeError, match="AllocationCounters"):
        pool.count_allocations(object())


@pytest.mark.parametrize(
    ("ops", "read_every"), [(10, 97), (300, 97), (3 * JOURNAL_LIMIT, 97), (3 * JOURNAL_LIMIT, 5003)]
)
def test_counting_journal_folds_to_a_step_by_step_count(ops, read_every, base_resource):
    """The journal, folded by ``settle`` (in Python for short journals, with NumPy for long
    ones, and by the pool itself at JOURNAL_LIMIT entries), gives the numbers of counting every
    operation as it happens, peaks included; reading in between (which settles) changes none."""
    pool = PoolMemoryResource(base_resource, initial_pool_size=64 * MiB)
    stats = mr.StatisticsResourceAdaptor(pool)
    assert stats.counting_pool is pool
    rng = random.Random(ops + read_every)
    live: list[tuple[int, int]] = []
    cur_b = cur_c = peak_b = peak_c = total_b = total_c = 0
    interval_peak = 0
    for i in range(ops):
        if live and (len(live) > 40 or rng.random() < 0.45):
            ptr, n = live.pop(rng.randrange(len(live)))
            stats.deallocate(ptr, n)
            cur_b -= n
            cur_c -= 1
        else:
            # mostly cached sizes (the lock-free path), some beyond the caches (the locked one)
            n = rng.choice([256, 1000, 4096, 70_000]) if rng.random() < 0.9 else 2 * MiB + i
            live.append((stats.allocate(n), n))
            cur_b += n
            cur_c += 1
            total_b += n
            total_c += 1
            peak_b, peak_c = max(peak_b, cur_b), max(peak_c, cur_c)
            interval_peak = max(interval_peak, cur_b)
        if i % read_every == read_every - 1:
            assert stats.take_interval_peak() == interval_peak
            interval_peak = cur_b
        if i % 1000 == 999:
            assert stats.current_bytes == cur_b
    assert stats.allocation_counts == Statistics(cur_b, cur_c, peak_b, peak_c, total_b, total_c)
    assert len(pool._counters.journal) == 0
    for ptr, n in live:
        stats.deallocate(ptr, n)
    assert stats.allocation_counts == Statistics(0, 0, peak_b, peak_c, total_b, total_c)


def _step_by_step(entries, start):
    """The counters' numbers after ``entries`` (``+n`` an allocation, ``-n`` a free), counted
    one operation at a time from ``start`` = (total/freed bytes, total/freed count, peaks)."""
    total_b, freed_b, total_c, freed_c, peak_b, peak_c = start
    for e in entries:
        if e > 0:
            total_b += e
            total_c += 1
            peak_b = max(peak_b, total_b - freed_b)
            peak_c = max(peak_c, total_c - freed_c)
        else:
            freed_b -= e
            freed_c += 1
    return total_b, freed_b, total_c, freed_c, peak_b, peak_c


def _numbers(c):
    return c.total_bytes, c.freed_bytes, c.total_count, c.freed_count, c.peak_bytes, c.peak_count


@pytest.mark.parametrize("n", [1, 2, 63, 64, 159, 160, 161, 1000, JOURNAL_LIMIT, 3 * JOURNAL_LIMIT])
def test_settle_folds_a_journal_of_any_length_as_a_step_by_step_count(n):
    """Short journals are folded in Python, long ones with NumPy: both give the numbers of
    counting each operation in order, peaks included, from counters that already hold some."""
    rng = random.Random(n)
    live: list[int] = []
    journals = []
    for length in (rng.randrange(1, 300), n):
        entries = []
        for _ in range(length):
            if live and rng.random() < 0.5:
                entries.append(-live.pop(rng.randrange(len(live))))
            else:
                size = int(2 ** rng.uniform(0, 33))  # 1 B .. 8 GiB: beyond 32-bit sums
                live.append(size)
                entries.append(size)
        journals.append(entries)
    c = AllocationCounters()
    want = (0, 0, 0, 0, 0, 0)
    for entries in journals:
        c.journal.extend(entries)
        c.settle()
        want = _step_by_step(entries, want)
        assert _numbers(c) == want
        assert c.interval_peak == want[4]
        assert c.journal == []


def test_a_block_allocated_while_counting_attaches_has_its_free_counted(base_resource):
    """An allocation on the lock-free path that makes its block live just before counting
    attaches (so the block is in the set of blocks live at attach time) and then sees the
    journal is counted, and so is its free; blocks live before are not, and once they are
    all freed the fast path stops checking for them."""
    pool = PoolMemoryResource(base_resource, initial_pool_size=4 * MiB)
    old = pool.allocate(1000)  # live before counting: its free is not counted
    pool.deallocate(pool.allocate(2000), 2000)  # a cached block for the fast path
    counters = AllocationCounters()
    live = pool._live

    class AttachesOnStore(dict):
        def __setitem__(self, ptr, nbytes):
            live[ptr] = nbytes
            pool._live = live  # once
            assert pool.count_allocations(counters)  # between the store and the journal read

    pool._live = AttachesOnStore(live)
    p = pool.allocate(2000)
    assert pool._live is live and p in live
    pool.deallocate(p, 2000)
    pool.deallocate(old, 1000)
    pool.deallocate(pool.allocate(2000), 2000)
    with pool.instrumentation_lock:
        counters.settle()
    assert _numbers(counters) == (4000, 4000, 2, 2, 2000, 1)
    assert pool._settle_at == JOURNAL_LIMIT  # nothing uncounted is left to look for


def test_a_block_freed_while_counting_attaches_is_not_counted(base_resource):
    """A free on the lock-free path whose block leaves the live table just before counting
    attaches (so the block is not among those live at attach time) does not count the free of
    an allocation that was never counted."""
    pool = PoolMemoryResource(base_resource, initial_pool_size=4 * MiB)
    pool.deallocate(pool.allocate(1000), 1000)  # this stream's caches exist
    p = pool.allocate(1000)  # allocated before counting
    counters = AllocationCounters()
    live = pool._live

    class AttachesOnPop(dict):
        def pop(self, ptr, default=None):
            n = live.pop(ptr, default)
            pool._live = live  # once
            assert pool.count_allocations(counters)  # between the pop and anything after
            return n

    pool._live = AttachesOnPop(live)
    pool.deallocate(p, 1000)
    assert pool._live is live and p not in live
    q = pool.allocate(1000)  # counted from here on
    pool.deallocate(q, 1000)
    with pool.instrumentation_lock:
        counters.settle()
    assert _numbers(counters) == (1000, 1000, 1, 1, 1000, 1)


def test_counting_imports_numpy_when_attached_not_under_the_pools_lock():
    """settle() folds long journals with NumPy while holding the pool's lock: the import (which
    takes Python's import locks) must have happened before, when the counters were attached."""
    code = (
        "import sys\n"
        "from dask_rmm.mr import PoolMemoryResource, StatisticsResourceAdaptor, SystemMemoryResource\n"
        "assert 'numpy' not in sys.modules, 'imported by dask_rmm.mr already: nothing to check'\n"
        "stats = StatisticsResourceAdaptor(PoolMemoryResource(SystemMemoryResource(), 1 << 20))\n"
        "print('numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if "nothing to check" in out.stderr:
        pytest.skip("dask_rmm.mr imports NumPy itself")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


def test_stop_counting_detaches_even_when_the_fold_fails(base_resource):
    """A finalizer at interpreter shutdown may detach counters whose fold cannot run (NumPy
    gone): the pool must stop journaling into them all the same."""

    class Unfoldable(AllocationCounters):
        __slots__ = ()

        def settle(self):
            raise RuntimeError("cannot fold now")

    pool = PoolMemoryResource(base_resource, initial_pool_size=4 * MiB)
    c = Unfoldable()
    assert pool.count_allocations(c)
    pool.deallocate(pool.allocate(1000), 1000)
    with pytest.raises(RuntimeError, match="cannot fold"):
        pool.stop_counting(c)
    before = len(c.journal)
    pool.deallocate(pool.allocate(1000), 1000)
    assert len(c.journal) == before  # not counted any more
    assert pool.count_allocations(AllocationCounters())  # and another can attach


def test_settle_keeps_what_was_journaled_while_it_copied():
    """An allocation journaled between settle's copy of the journal and its trim stays for the
    next settle (a lock-free caller does not wait for the reader)."""

    class AppendsDuringCopy(list):
        def __getitem__(self, index):
            copied = super().__getitem__(index)
            self.append(777)  # another thread's allocation, right after the copy
            return copied

    c = AllocationCounters()
    c.journal = AppendsDuringCopy([100, 200, -100])
    c.settle()
    assert (c.total_bytes, c.freed_bytes, c.peak_bytes, c.peak_count) == (300, 100, 300, 2)
    assert list(c.journal) == [777]


def test_counting_from_eight_threads_loses_nothing_while_a_reader_settles(base_resource):
    """Eight threads allocate and free through the lock-free counting path while another thread
    keeps reading (and so settling) the counters: every operation is counted exactly once."""
    stats = mr.StatisticsResourceAdaptor(
        PoolMemoryResource(base_resource, initial_pool_size=64 * MiB)
    )
    pairs, held = 3000, 4
    done = threading.Event()
    seen = []

    def churn():
        mine = []
        for k in range(pairs):
            mine.append(stats.allocate(512 + 256 * (k % 3)))
            if len(mine) == held:
                for j, p in enumerate(mine):
                    stats.deallocate(p, 512 + 256 * ((k - held + 1 + j) % 3))
                mine.clear()
        return mine

    def read():
        while not done.is_set():
            seen.append(stats.allocation_counts.current_count)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        results = _race(8, churn)
    finally:
        done.set()
        reader.join()
    assert results == [[]] * 8
    s = stats.allocation_counts
    assert (s.current_bytes, s.current_count, s.total_count) == (0, 0, 8 * pairs)
    assert held <= s.peak_count <= 8 * held
    assert seen and all(0 <= c <= 8 * held for c in seen)


def test_pool_charges_owner_accounts(base_resource):
    pool = PoolMemoryResource(base_resource, initial_pool_size=4 * MiB)
    local = threading.local()
    opened = []
    accounts: dict = {}

    def open_account(owner_key):
        opened.append(owner_key)
        return accounts.setdefault(owner_key, [0, 0])

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
    assert opened == ["x", "y"]  # once per owner key
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


def test_list_lock_behaves_as_a_lock():
    from dask_rmm.mr.locks import ListLock

    lock = ListLock()
    assert lock.acquire(False) and lock.locked()
    assert not lock.acquire(False)
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


def test_list_lock_excludes_threads():
    from dask_rmm.mr.locks import ListLock

    lock = ListLock()
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
