"""FixedSizeMemoryResource: block size, growth by chunks, release, bad input."""

from __future__ import annotations

import pytest
from conftest import make_test_streams

from dask_rmm.mr import FixedSizeMemoryResource


@pytest.fixture
def fixed(base_resource):
    return FixedSizeMemoryResource(base_resource, block_size=4096, blocks_to_preallocate=4)


def test_blocks_and_growth(fixed):
    assert fixed.block_size == fixed.get_block_size() == 4096
    ptrs = [fixed.allocate(n) for n in (1, 4096, 100, 2000, 3000)]  # 5 > 4: a second chunk
    assert len(set(ptrs)) == 5 and all(p % 256 == 0 for p in ptrs)
    assert fixed.reserved_memory_info().reserved_bytes == 8 * 4096
    for p, n in zip(ptrs, (1, 4096, 100, 2000, 3000), strict=True):
        fixed.deallocate(p, n)
    info = fixed.reserved_memory_info()
    assert info.free_bytes == info.reserved_bytes == 8 * 4096
    assert fixed.release() == 8 * 4096


def test_too_large_and_zero(fixed):
    with pytest.raises(ValueError, match="block size"):
        fixed.allocate(4097)
    assert fixed.allocate(0) == 0
    fixed.deallocate(0, 0)


def test_bad_deallocate(fixed):
    p = fixed.allocate(100)
    with pytest.raises(ValueError, match="wrong size"):
        fixed.deallocate(p, 99)
    with pytest.raises(ValueError, match="foreign pointer or double free"):
        fixed.deallocate(p + 4096 * 100, 100)
    fixed.deallocate(p, 100)
    with pytest.raises(ValueError, match="double free"):
        fixed.deallocate(p, 100)


def test_stream_free_lists(fixed):
    # Real streams on a GPU host: s2 taking s1's block records an event on s1 there.
    s1, s2 = make_test_streams(2)
    p = fixed.allocate(10, s1)
    fixed.deallocate(p, 10, s1)
    assert fixed.allocate(10, s1) == p
    q = fixed.allocate(10, s2)
    assert q != p
    fixed.deallocate(p, 10, s1)
    fixed.deallocate(q, 10, s2)


def test_bad_construction(base_resource):
    with pytest.raises(ValueError):
        FixedSizeMemoryResource(base_resource, block_size=0)
    with pytest.raises(TypeError):
        FixedSizeMemoryResource(base_resource, block_size=1.5)


def test_release_keeps_the_chunk_of_a_block_taken_lock_free_meanwhile(base_resource):
    # A lock-free allocation while release() takes the free blocks (made to happen at its first
    # pop from the default stream's list) must keep that block's chunk held.
    fixed = FixedSizeMemoryResource(base_resource, block_size=4096, blocks_to_preallocate=4)
    fixed.deallocate(fixed.allocate(100), 100)  # the default stream gets a list of its own
    taken: list[int] = []

    class Racing(list):
        def pop(self, *args):
            if not taken:
                taken.append(0)
                taken[0] = fixed.allocate(100)  # another thread's fast path
            return super().pop(*args)

    fixed._free[0] = Racing(fixed._free[0])
    assert fixed.release() == 0
    assert fixed.reserved_memory_info().reserved_bytes == 4 * 4096
    fixed.deallocate(taken[0], 100)
    assert fixed.release() == 4 * 4096
