"""Property tests shared by every suballocator (pool, arena, binning, fixed size) over every
base resource this host has: random allocate/free sequences with random sizes and streams.

Invariants: live blocks never overlap, are 256-aligned and lie inside memory the upstream
handed out; a byte pattern written into each block survives every later operation; after
freeing everything the resource holds only what it took from upstream (the pool: exactly its
chunks), and giving it back leaves the upstream with nothing outstanding.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
from conftest import HAS_GPU, make_base_resource, make_test_streams
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dask_rmm import mr
from dask_rmm.mr.base import DeviceMemoryResource
from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream

MiB = 1 << 20


class RecordingResource(DeviceMemoryResource):
    """Passes through to ``inner`` and remembers which ranges are live upstream."""

    def __init__(self, inner):
        super().__init__(device_id=inner.device_id)
        self.inner = inner
        self.ranges: dict[int, int] = {}
        self.calls = 0

    @property
    def is_host_memory(self):
        return self.inner.is_host_memory

    def allocate(self, nbytes, stream=None):
        ptr = self.inner.allocate(nbytes) if stream is None else self.inner.allocate(nbytes, stream)
        self.ranges[ptr] = nbytes
        self.calls += 1
        return ptr

    def deallocate(self, ptr, nbytes, stream=None):
        assert self.ranges.pop(ptr) == nbytes
        self.inner.deallocate(ptr, nbytes) if stream is None else self.inner.deallocate(
            ptr, nbytes, stream
        )

    def contains(self, ptr, size):
        return any(p <= ptr and ptr + size <= p + n for p, n in self.ranges.items())


# -- byte patterns --------------------------------------------------------------------------

PROBE = 64  # bytes checked at each end of a block


def _probe_spots(ptr, size):
    """``(address, length)`` of the bytes checked in a block: its first PROBE bytes and, past
    those, up to PROBE bytes at its end."""
    spots = [(ptr, min(size, PROBE))]
    if size > PROBE:
        spots.append((ptr + size - min(PROBE, size - PROBE), min(PROBE, size - PROBE)))
    return spots


def write_pattern(ptr, size, value, host):
    for p, n in _probe_spots(ptr, size):
        if host:
            ctypes.memset(p, value, n)
        else:
            from dask_rmm import _cuda

            _cuda.memset(p, value, n)


def read_ok(ptr, size, value, host):
    for p, n in _probe_spots(ptr, size):
        if host:
            data = ctypes.string_at(p, n)
        else:
            from dask_rmm import _cuda

            buf = ctypes.create_string_buffer(n)
            _cuda.memcpy(ctypes.addressof(buf), p, n)
            data = buf.raw
        if data != bytes([value]) * n:
            return False
    return True


# -- the resources under test -------------------------------------------------------------

POOL_CHUNK = 8 * MiB
BIN_SIZES = [1 << 10, 1 << 12, 1 << 16]
FIXED_BLOCK = 256 << 10


def make_pool(up):
    return mr.PoolMemoryResource(up, initial_pool_size=POOL_CHUNK, maximum_pool_size=48 * MiB)


def make_pool_empty(up):
    return mr.PoolMemoryResource(up, initial_pool_size=0)


def make_arena(up):
    return mr.ArenaMemoryResource(up, arena_size=48 * MiB)


def make_binning(up):
    b = mr.BinningMemoryResource(up)
    for s in BIN_SIZES:
        b.add_bin(s, mr.FixedSizeMemoryResource(up, block_size=s, blocks_to_preallocate=4))
    return b


def make_fixed(up):
    return mr.FixedSizeMemoryResource(up, block_size=FIXED_BLOCK, blocks_to_preallocate=4)


SUBALLOCATORS = {
    "pool": (make_pool, 6 * MiB),
    "pool-from-empty": (make_pool_empty, 3 * MiB),
    "arena": (make_arena, 3 * MiB),
    "binning": (make_binning, 2 * MiB),
    "fixed_size": (make_fixed, FIXED_BLOCK),
}

BOUNDARIES = [0, 1, 255, 256, 257, 8191, 8192, 8193, MiB - 256, MiB, MiB + 1, POOL_CHUNK,
              POOL_CHUNK - 256, *BIN_SIZES, *(s + 1 for s in BIN_SIZES), FIXED_BLOCK]  # fmt: skip


def streams_for_host():
    """Four streams, one per index ``ops_strategy`` draws (0..3): the default stream, two
    others (real on a GPU host, where suballocators order on them even over host memory) and
    the per-thread default stream."""
    return [DEFAULT_STREAM, *make_test_streams(2), PER_THREAD_DEFAULT_STREAM]


def ops_strategy(max_size):
    size = st.one_of(
        st.sampled_from([b for b in BOUNDARIES if b <= max_size]),
        st.integers(0, max_size),
        st.integers(0, 4096),
    )
    alloc = st.tuples(st.just("alloc"), size, st.integers(0, 3))
    free = st.tuples(st.just("free"), st.integers(0, 10**6), st.integers(0, 3))
    return st.lists(st.one_of(alloc, alloc, free), min_size=1, max_size=40)


def check_live(live, rec, host):
    blocks = sorted((p, max(n, 1)) for p, (n, _, _) in live.items())
    for (p1, n1), (p2, _) in zip(blocks, blocks[1:], strict=False):
        assert p1 + n1 <= p2, f"overlap: {p1:#x}+{n1} > {p2:#x}"
    for p, (n, value, _) in live.items():
        assert p % 256 == 0
        assert rec.contains(p, n), f"{p:#x}+{n} is not inside upstream memory"
        assert read_ok(p, n, value, host), f"pattern of {p:#x}+{n} was overwritten"


def run_sequence(name, base_name, ops):
    make, _ = SUBALLOCATORS[name]
    rec = RecordingResource(make_base_resource(base_name))
    res = make(rec)
    host = rec.is_host_memory
    streams = streams_for_host()
    start_chunks = dict(rec.ranges)
    live = {}  # ptr -> (nbytes, pattern byte, stream)
    used_streams = set()
    for k, (op, arg, si) in enumerate(ops):
        stream = streams[si]
        if op == "alloc":
            try:
                ptr = res.allocate(arg, stream)
            except MemoryError:
                continue
            if arg == 0:
                assert ptr == 0
                continue
            assert ptr not in live
            value = (k * 37 + 11) % 251 + 1
            write_pattern(ptr, arg, value, host)
            live[ptr] = (arg, value, stream)
            used_streams.add(si)
        elif live:
            ptr = sorted(live)[arg % len(live)]
            n, _, _ = live.pop(ptr)
            res.deallocate(ptr, n, stream)
            used_streams.add(si)
        check_live(live, rec, host)
    for ptr, (n, _, s) in list(live.items()):
        res.deallocate(ptr, n, s)
    info = res.reserved_memory_info()
    if info is not None:
        assert info.free_bytes == info.reserved_bytes
    if isinstance(res, mr.PoolMemoryResource):
        assert len(res.live_allocations()) == 0
        assert res.pool_size() == sum(rec.ranges.values())
        if len(used_streams) <= 1:
            # one stream: everything coalesced back into exactly the chunks
            assert [(p, s) for p, s, _ in res._free_blocks()] == res.memory_layout()[0]
        assert res.release() == sum(start_chunks.values()) or res.pool_size() == 0
        assert res.pool_size() == 0 and rec.ranges == {}
    elif isinstance(res, mr.FixedSizeMemoryResource):
        res.release()
        assert rec.ranges == {}
    del res
    import gc

    gc.collect()
    assert rec.ranges == {}, "memory still held upstream after the resource is gone"


@pytest.mark.parametrize("name", sorted(SUBALLOCATORS))
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_sequences(name, base_resource_name, data):
    ops = data.draw(ops_strategy(SUBALLOCATORS[name][1]))
    run_sequence(name, base_resource_name, ops)


@pytest.mark.parametrize("name", sorted(SUBALLOCATORS))
def test_eight_threads(name, base_resource_name):
    """8 threads allocate and free at once: no overlap (patterns survive), nothing leaks."""
    make, max_size = SUBALLOCATORS[name]
    rec = RecordingResource(make_base_resource(base_resource_name))
    res = make(rec)
    host = rec.is_host_memory
    errors = []
    barrier = threading.Barrier(8)

    def work(t):
        import random

        rng = random.Random(t)
        stream = (
            [Stream._from_handle(0), PER_THREAD_DEFAULT_STREAM][t % 2]
            if not HAS_GPU
            else (PER_THREAD_DEFAULT_STREAM)
        )
        mine = []
        barrier.wait()
        try:
            for _ in range(300):
                if mine and (len(mine) > 6 or rng.random() < 0.45):
                    ptr, n, v = mine.pop(rng.randrange(len(mine)))
                    if not read_ok(ptr, n, v, host):
                        errors.append(f"thread {t}: block {ptr:#x}+{n} overwritten")
                    res.deallocate(ptr, n, stream)
                else:
                    n = rng.choice([rng.randint(1, 4096), rng.randint(1, max_size // 8)])
                    try:
                        ptr = res.allocate(n, stream)
                    except MemoryError:
                        continue
                    v = t * 31 % 251 + 1
                    write_pattern(ptr, n, v, host)
                    mine.append((ptr, n, v))
            for ptr, n, v in mine:
                if not read_ok(ptr, n, v, host):
                    errors.append(f"thread {t}: block {ptr:#x}+{n} overwritten")
                res.deallocate(ptr, n, stream)
        except Exception as e:  # reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]
    info = res.reserved_memory_info()
    if info is not None:
        assert info.free_bytes == info.reserved_bytes, "accounting drift"
    if isinstance(res, mr.PoolMemoryResource):
        assert len(res.live_allocations()) == 0
        assert res.pool_size() == sum(rec.ranges.values())
        res.release()
        assert res.pool_size() == 0 and rec.ranges == {}
