"""ArenaMemoryResource: per-thread/per-stream arenas, large requests, OOM, bad input."""

from __future__ import annotations

import logging
import threading

import pytest
from conftest import make_test_streams

from dask_rmm.mr import ArenaMemoryResource, OutOfMemoryError
from dask_rmm.mr.arena import SUPERBLOCK_SIZE
from dask_rmm.stream import PER_THREAD_DEFAULT_STREAM

MiB = 1 << 20


@pytest.fixture
def arena(base_resource):
    return ArenaMemoryResource(base_resource, arena_size=8 * MiB)


def test_small_and_large(arena):
    assert arena.arena_size() == 8 * MiB
    small = [arena.allocate(1000) for _ in range(10)]
    large = arena.allocate(3 * MiB)  # above a superblock: the global arena serves it
    assert len(set(small)) == 10 and all(p % 256 == 0 for p in small + [large])
    for p in small:
        arena.deallocate(p, 1000)
    arena.deallocate(large, 3 * MiB)
    info = arena.reserved_memory_info()
    assert info.free_bytes == info.reserved_bytes == 8 * MiB


def test_arenas_per_thread_and_stream(arena):
    (s,) = make_test_streams(1)  # real on a GPU host: the arena synchronizes streams there
    a = arena.allocate(1000, s)
    b = arena.allocate(1000, PER_THREAD_DEFAULT_STREAM)
    out = []
    t = threading.Thread(target=lambda: out.append(arena.allocate(1000, PER_THREAD_DEFAULT_STREAM)))
    t.start()
    t.join()
    assert len(arena._arenas) == 3  # one per stream, one per thread's per-thread stream
    arena.deallocate(a, 1000, s)
    arena.deallocate(b, 1000, PER_THREAD_DEFAULT_STREAM)
    arena.deallocate(out[0], 1000, PER_THREAD_DEFAULT_STREAM)  # freed from another thread: fine


def test_out_of_memory_defragments_then_fails(arena, caplog):
    arena.dump_log_on_failure = True
    streams = make_test_streams(8)  # one arena each; real on a GPU host
    ptrs = [arena.allocate(SUPERBLOCK_SIZE // 2, s) for s in streams]
    with caplog.at_level(logging.WARNING, logger="dask_rmm.arena"):
        with pytest.raises(OutOfMemoryError) as info:
            arena.allocate(2 * MiB)
    assert info.value.requested == 2 * MiB and "ran out of memory" in caplog.text
    for s, p in zip(streams, ptrs, strict=True):
        arena.deallocate(p, SUPERBLOCK_SIZE // 2, s)
    p = arena.allocate(7 * MiB)  # empty superblocks went back to the global arena
    arena.deallocate(p, 7 * MiB)


def test_bad_input(arena):
    p = arena.allocate(1000)
    with pytest.raises(ValueError, match="wrong size"):
        arena.deallocate(p, 999)
    with pytest.raises(ValueError, match="foreign pointer"):
        arena.deallocate(p + 256, 1000)
    arena.deallocate(p, 1000)
    with pytest.raises(ValueError, match="double free"):
        arena.deallocate(p, 1000)
    with pytest.raises(ValueError, match="superblock"):
        ArenaMemoryResource(arena.upstream_mr, arena_size=1000)
    assert arena.allocate(0) == 0
    arena.deallocate(0, 0)
