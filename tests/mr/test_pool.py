"""PoolMemoryResource: sizes, growth, release, out of memory, bad input, stream order."""

from __future__ import annotations

import threading

import numpy
import pytest
from conftest import make_base_resource, make_test_streams
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_rmm import mr
from dask_rmm.mr import pool as pool_module
from dask_rmm.mr import stream_order
from dask_rmm.mr.pool import PoolMemoryResource
from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream

MiB = 1 << 20


@pytest.fixture
def pool(base_resource):
    return PoolMemoryResource(base_resource, initial_pool_size=4 * MiB, maximum_pool_size=16 * MiB)


def test_initial_size_and_strings(base_resource):
    p = PoolMemoryResource(base_resource, initial_pool_size="2MiB", maximum_pool_size="8 MiB")
    assert p.pool_size() == 2 * MiB
    assert p.maximum_pool_size == 8 * MiB
    assert p.upstream_mr is base_resource and p.get_upstream() is base_resource
    assert "PoolMemoryResource" in repr(p)


def test_default_initial_size_on_host():
    p = PoolMemoryResource(mr.SystemMemoryResource())
    assert p.pool_size() == pool_module.DEFAULT_HOST_POOL_SIZE
    q = PoolMemoryResource(mr.SystemMemoryResource(), maximum_pool_size=MiB)
    assert q.pool_size() == MiB


def test_initial_above_maximum_refused(base_resource):
    with pytest.raises(ValueError, match="exceeds maximum_pool_size"):
        PoolMemoryResource(base_resource, initial_pool_size=4 * MiB, maximum_pool_size=MiB)


def test_zero_size(pool):
    assert pool.allocate(0) == 0
    pool.deallocate(0, 0)
    assert len(pool.live_allocations()) == 0


def test_reuse_and_coalesce(pool):
    a = pool.allocate(1000)
    b = pool.allocate(1000)
    assert a % 256 == 0 and b % 256 == 0 and a != b
    pool.deallocate(a, 1000)
    assert pool.allocate(1000) == a  # freed on the same stream: reused at once
    pool.deallocate(a, 1000)
    pool.deallocate(b, 1000)
    assert [(p, s) for p, s, _ in pool._free_blocks()] == pool.memory_layout()[0]


def test_growth_follows_rmm(base_resource):
    p = PoolMemoryResource(base_resource, initial_pool_size=MiB)
    big = p.allocate(3 * MiB)  # no maximum: grows by max(request, pool size)
    assert p.pool_size() == 4 * MiB
    q = PoolMemoryResource(base_resource, initial_pool_size=MiB, maximum_pool_size=9 * MiB)
    x = q.allocate(2 * MiB)  # with a maximum: max(request, half the room left) = 4 MiB
    assert q.pool_size() == 5 * MiB
    p.deallocate(big, 3 * MiB)
    q.deallocate(x, 2 * MiB)
    assert p.release() == 4 * MiB and p.pool_size() == 0
    assert q.release() == 5 * MiB


def test_growth_backs_off_when_upstream_fails(base_resource):
    class Stingy(mr.DeviceMemoryResource):
        is_host_memory = property(lambda self: base_resource.is_host_memory)

        def allocate(self, nbytes, stream=None):
            if nbytes > 2 * MiB:
                raise mr.OutOfMemoryError("no", requested=nbytes)
            return base_resource.allocate(nbytes)

        def deallocate(self, ptr, nbytes, stream=None):
            base_resource.deallocate(ptr, nbytes)

    p = PoolMemoryResource(Stingy(), initial_pool_size=2 * MiB)
    a = p.allocate(2 * MiB)
    b = p.allocate(2 * MiB)  # grows by 2 MiB
    c = p.allocate(MiB)  # would grow by the pool size (4 MiB): refused, halved to 2 MiB
    assert p.pool_size() == 6 * MiB
    for ptr, n in ((a, 2 * MiB), (b, 2 * MiB), (c, MiB)):
        p.deallocate(ptr, n)
    assert p.release() == 6 * MiB


def test_out_of_memory_fields(pool):
    held = pool.allocate(12 * MiB)  # a second chunk of 12 MiB: the pool is at its maximum
    assert pool.pool_size() == 16 * MiB
    with pytest.raises(MemoryError) as info:
        pool.allocate(5 * MiB)
    e = info.value
    assert isinstance(e, mr.OutOfMemoryError)
    assert e.requested == 5 * MiB and e.maximum_pool_size == 16 * MiB
    assert e.pool_size == 16 * MiB and e.stream == 0
    assert e.free_bytes == 4 * MiB and e.largest_free_block == 4 * MiB
    for word in ("requested 5.00 MiB", "stream 0x0", "maximum 16.00 MiB", "4.00 MiB free",
                 "largest free block 4.00 MiB"):  # fmt: skip
        assert word in str(e)
    pool.deallocate(held, 12 * MiB)


@pytest.mark.parametrize("case", ["double", "foreign", "wrong_size", "interior"])
def test_bad_deallocate_leaves_state_intact(pool, case):
    a = pool.allocate(5000)
    b = pool.allocate(700)
    before = (pool._free_blocks(), len(pool.live_allocations()), pool.reserved_memory_info())
    ptr, n = {"double": (a, 5000), "foreign": (0xDEAD00, 5000), "wrong_size": (a, 4999),
              "interior": (a + 256, 256)}[case]  # fmt: skip
    if case == "double":
        pool.deallocate(a, 5000)
        before = (pool._free_blocks(), len(pool.live_allocations()), pool.reserved_memory_info())
    with pytest.raises(ValueError, match="PoolMemoryResource.deallocate"):
        pool.deallocate(ptr, n)
    assert (
        pool._free_blocks(),
        len(pool.live_allocations()),
        pool.reserved_memory_info(),
    ) == before
    if case != "double":
        pool.deallocate(a, 5000)
    pool.deallocate(b, 700)
    assert len(pool.live_allocations()) == 0


def test_bad_arguments(pool):
    for bad in (-1, 1.5, "10", None, True):
        with pytest.raises((TypeError, ValueError)):
            pool.allocate(bad)
    with pytest.raises(TypeError):
        pool.deallocate("0x10", 10)


def test_numpy_style_ints_are_accepted(pool):
    class Index:
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    ptr = pool.allocate(Index(1000))
    assert type(ptr) is int
    pool.deallocate(Index(ptr), 1000)
    assert len(pool.live_allocations()) == 0


def test_streams_keep_their_own_free_lists(pool):
    # Real streams on a GPU host: taking another stream's block records an event on it there.
    s1, s2 = make_test_streams(2)
    a = pool.allocate(1000, s1)
    pool.deallocate(a, 1000, s1)
    keys = {k for _, _, k in pool._free_blocks()}
    assert s1.handle in keys
    assert pool.allocate(1000, s1) == a  # same stream: its own block at once
    b = pool.allocate(1000, s2)
    assert b != a
    pool.deallocate(a, 1000, s1)
    pool.deallocate(b, 1000, s2)
    # Under pressure a stream takes (merges) the other streams' free memory instead of growing.
    size_before = pool.pool_size()
    c = pool.allocate(pool.pool_size() - 256, s2)
    assert pool.pool_size() == size_before
    pool.deallocate(c, pool.pool_size() - 256, s2)


def test_cross_stream_take_waits_on_an_event(pool, monkeypatch):
    """With CUDA (faked here), taking another stream's block records an event on it and makes
    the taking stream wait; the same stream needs nothing."""
    calls = []
    from dask_rmm import _cuda

    monkeypatch.setattr(_cuda, "event_create", lambda **_: 77, raising=False)
    monkeypatch.setattr(_cuda, "event_record", lambda ev, s: calls.append(("record", ev, s)),
                        raising=False)  # fmt: skip
    monkeypatch.setattr(_cuda, "stream_wait_event", lambda s, ev: calls.append(("wait", s, ev)),
                        raising=False)  # fmt: skip
    monkeypatch.setattr(_cuda, "event_destroy", lambda ev: None, raising=False)
    pool._ordered = True
    # Real streams on a GPU host (the event calls are faked, but the pool's other paths, such
    # as release and teardown, may still synchronize the streams it saw).
    s1, s2 = make_test_streams(2)
    whole = pool.allocate(pool.pool_size(), s1)  # the fresh chunk: no wait needed
    assert calls == []
    pool.deallocate(whole, pool.pool_size(), s1)
    x = pool.allocate(1000, s2)
    assert calls == [("record", 77, s1.handle), ("wait", s2.handle, 77)]
    calls.clear()
    pool.deallocate(x, 1000, s2)
    pool.deallocate(pool.allocate(1000, s2), 1000, s2)
    assert calls == []
    pool._ordered = False


def test_per_thread_default_stream_is_one_stream_per_thread(pool):
    a = pool.allocate(1000, PER_THREAD_DEFAULT_STREAM)
    pool.deallocate(a, 1000, PER_THREAD_DEFAULT_STREAM)
    assert {k for _, _, k in pool._free_blocks()} == {PER_THREAD_DEFAULT_STREAM.order_key()}
    other_key = []

    def other():
        other_key.append(PER_THREAD_DEFAULT_STREAM.order_key())
        b = pool.allocate(1000, PER_THREAD_DEFAULT_STREAM)
        pool.deallocate(b, 1000, PER_THREAD_DEFAULT_STREAM)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    # the other thread's per-thread stream is another stream: it took the block over
    assert other_key[0] in {k for _, _, k in pool._free_blocks()}
    assert other_key[0] != PER_THREAD_DEFAULT_STREAM.order_key()


def test_every_handle_0_stream_shares_the_default_streams_caches(pool):
    """The fast paths find the default stream's caches by its handle, 0 (pool.DEFAULT_KEY):
    DEFAULT_STREAM, another Stream of handle 0 (as the CuPy allocator makes) and the int 0 are
    one stream, and a block freed on one is reused on the others at once."""
    assert DEFAULT_STREAM.handle == DEFAULT_STREAM.order_key() == pool_module.DEFAULT_KEY == 0
    a = pool.allocate(1000)
    pool.deallocate(a, 1000, Stream(0))
    assert pool.allocate(1000, 0) == a
    pool.deallocate(a, 1000, 0)
    assert pool.allocate(1000, Stream(0)) == a
    pool.deallocate(a, 1000)
    assert {k for _, _, k in pool._free_blocks()} == {0}


def test_release_keeps_chunks_in_use(base_resource):
    p = PoolMemoryResource(base_resource, initial_pool_size=MiB)
    a = p.allocate(1000)
    b = p.allocate(2 * MiB)  # a second chunk
    assert len(p.memory_layout()[0]) == 2
    p.deallocate(b, 2 * MiB)
    assert p.release() == 2 * MiB and p.pool_size() == MiB
    assert len(p.memory_layout()[0]) == 1
    p.deallocate(a, 1000)
    assert p.release() == MiB and p.pool_size() == 0
    c = p.allocate(4096)  # an empty pool grows again
    p.deallocate(c, 4096)


def test_reserved_memory_info(pool):
    a = pool.allocate(MiB)
    info = pool.reserved_memory_info()
    assert info.reserved_bytes == 4 * MiB
    assert info.free_bytes == 3 * MiB and info.largest_free_block == 3 * MiB
    pool.deallocate(a, MiB)


def test_pool_over_a_pool(base_resource):
    outer = PoolMemoryResource(
        PoolMemoryResource(base_resource, initial_pool_size=8 * MiB), initial_pool_size=2 * MiB
    )
    ptrs = [outer.allocate(300 * 1024) for _ in range(10)]
    for p in ptrs:
        outer.deallocate(p, 300 * 1024)
    assert outer.release() > 0


@pytest.mark.gpu
def test_default_initial_size_is_half_the_free_device_memory():
    from dask_rmm import _cuda

    # Other processes (pytest -n 16 on one GPU) allocate and free while this runs: the free
    # memory the pool saw lies between the readings before and after it drew its initial size
    # (the after reading plus what it drew); a device that moved more than 256 MiB meanwhile is
    # measured again.
    for _ in range(5):
        before, _ = _cuda.mem_get_info()
        p = PoolMemoryResource(make_base_resource("cuda"))
        size = p.pool_size()
        after = _cuda.mem_get_info()[0] + size
        p.release()
        if abs(after - before) < 256 * MiB:
            break
    low, high = sorted((before, after))
    assert low // 2 - 64 * MiB < size < high // 2 + 64 * MiB, (size, before, after)


def test_rounded_request_falls_back_to_exact_size_when_full():
    """Small requests are rounded up to their size class; a pool too full for the rounded size
    still serves the exact size, and that block frees and coalesces like any other."""
    from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource

    pool = PoolMemoryResource(SystemMemoryResource(), 1 << 20, 1 << 20)
    small = pool.allocate(256)
    big = pool.allocate((1 << 20) - 512)  # rounds to 1 MiB, which no longer fits
    assert big == small + 256
    with pytest.raises(ValueError, match=f"allocated with {(1 << 20) - 512} bytes"):
        pool.deallocate(big, 1 << 20)
    pool.deallocate(big, (1 << 20) - 512)
    with pytest.raises(ValueError, match="double free"):
        pool.deallocate(big, (1 << 20) - 512)
    pool.deallocate(small, 256)
    assert len(pool.live_allocations()) == 0
    assert [(p, s) for p, s, _ in pool._free_blocks()] == pool.memory_layout()[0]


@pytest.mark.parametrize("stream", [None, "other"])
def test_an_exact_size_block_freed_with_a_made_up_size_is_refused(stream):
    """A block the full pool gave at its exact size is recorded apart from rounded ones; no
    size but the one asked frees it, negative and huge ones included, on the fast path (default
    stream) and the other streams' path alike, and the pool is left unchanged."""
    from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource

    s = Stream(7) if stream else DEFAULT_STREAM
    pool = PoolMemoryResource(SystemMemoryResource(), 1 << 20, 1 << 20)
    pool.deallocate(pool.allocate(256, s), 256, s)  # this stream's caches exist
    small = pool.allocate(256, s)
    n = (1 << 20) - 512  # rounds to 1 MiB, which no longer fits: given at its exact size
    big = pool.allocate(n, s)
    before = (pool._free_blocks(), pool.memory_layout(), pool.live_allocations())
    for wrong in (~n, -n, n + pool_module.EXACT_TAG, 1 << 70, 0, n + 1):
        with pytest.raises(ValueError, match=f"allocated with {n} bytes"):
            pool.deallocate(big, wrong, s)
        assert (pool._free_blocks(), pool.memory_layout(), pool.live_allocations()) == before
    assert pool.live_allocations() == {small: 256, big: n}
    pool.deallocate(big, numpy.int64(n), s)  # the right size as another int type frees it
    pool.deallocate(small, 256, s)
    assert [(p, s) for p, s, _ in pool._free_blocks()] == pool.memory_layout()[0]


def test_cached_blocks_are_reused_on_their_stream_and_merged_before_growing():
    from dask_rmm.mr import PoolMemoryResource, SystemMemoryResource

    pool = PoolMemoryResource(SystemMemoryResource(), 1 << 20, 1 << 20)
    a = pool.allocate(1000)
    pool.deallocate(a, 1000)
    assert pool.allocate(900) == a  # same size class, same stream: the cached block
    pool.deallocate(a, 900)
    pool = PoolMemoryResource(SystemMemoryResource(), 1 << 20, 1 << 20)
    # 256 KiB blocks cached in one class must merge back to serve a 1 MiB request.
    ptrs = [pool.allocate(256 << 10) for _ in range(4)]
    for p in ptrs:
        pool.deallocate(p, 256 << 10)
    whole = pool.allocate(1 << 20)
    assert whole == min(ptrs)
    pool.deallocate(whole, 1 << 20)
    assert pool.pool_size() == 1 << 20


def test_ordering_after_another_threads_per_thread_stream_gives_this_thread_no_key(monkeypatch):
    """A thread that never used its per-thread stream, taking a block another thread freed on
    its own: the device is synchronized, and this thread gets no per-thread key (so no drain
    of a stream it never used when it exits)."""
    from dask_rmm import _cuda
    from dask_rmm import stream as stream_module
    from dask_rmm.stream import Stream

    synced = []
    monkeypatch.setattr(_cuda, "device_synchronize", lambda: synced.append(1))
    seen = []

    def taker():
        other = ("ptds", -1)  # a key no thread has
        stream_order.order_after([(other, PER_THREAD_DEFAULT_STREAM)], Stream._from_handle(0x1234))
        seen.append(stream_module.own_per_thread_key())

    t = threading.Thread(target=taker)
    t.start()
    t.join()
    assert synced == [1] and seen == [None]


# -- sizes out of range ------------------------------------------------------------------------

_HUGE = st.integers(min_value=pool_module.CACHED_LIMIT + 1, max_value=2**70) | st.integers(
    min_value=2**63, max_value=2**70
)


@settings(max_examples=150, deadline=None)
@given(n=_HUGE, counted=st.booleans(), other_stream=st.booleans())
def test_every_huge_size_is_a_clear_error_that_changes_nothing(n, counted, other_stream):
    # A bounded pool: sizes up to 2**64 - 1 are out of memory, larger ones no allocation can
    # be; never another exception (an IndexError once came from the size classes above 2**74).
    pool = PoolMemoryResource(mr.SystemMemoryResource(), 1 << 20, 4 << 20)
    top = mr.StatisticsResourceAdaptor(pool) if counted else pool
    stream = Stream(0x77) if other_stream else DEFAULT_STREAM

    def state():
        return [b[:2] for b in pool._free_blocks()], pool.pool_size(), len(pool.live_allocations())

    before = state()
    if n > 2**64 - 1:
        with pytest.raises(ValueError, match=rf"nbytes {n} is larger than any allocation can be"):
            top.allocate(n, stream)
    else:
        with pytest.raises(mr.OutOfMemoryError, match=rf"\({n} bytes\)"):
            top.allocate(n, stream)
    assert state() == before


@settings(max_examples=50, deadline=None)
@given(n=st.integers(min_value=2**64, max_value=2**80))
def test_a_size_no_allocation_can_have_is_a_value_error_on_an_unbounded_pool(n):
    pool = PoolMemoryResource(mr.SystemMemoryResource(), 1 << 20)
    with pytest.raises(ValueError, match="larger than any allocation can be"):
        pool.allocate(n)
    assert pool.pool_size() == 1 << 20 and len(pool.live_allocations()) == 0
