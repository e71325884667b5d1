"""BinningMemoryResource: routing by size, add_bin, bin_mrs, upstream fallback."""

from __future__ import annotations

import pytest

from dask_rmm.mr import BinningMemoryResource, FixedSizeMemoryResource, PoolMemoryResource


def test_exponent_bins(base_resource):
    b = BinningMemoryResource(base_resource, 10, 12)
    assert b.bin_sizes == [1024, 2048, 4096]
    assert [m.block_size for m in b.bin_mrs] == [1024, 2048, 4096]
    assert all(isinstance(m, FixedSizeMemoryResource) for m in b.bin_mrs)


def test_routing(base_resource):
    b = BinningMemoryResource(base_resource)
    small = FixedSizeMemoryResource(base_resource, block_size=1024, blocks_to_preallocate=2)
    pool = PoolMemoryResource(base_resource, initial_pool_size=1 << 20)
    b.add_bin(1024, small)
    b.add_bin(1 << 16, pool)
    b.add_bin(1024)  # an existing bin is kept, as in RMM
    assert b.bin_mrs == [small, pool]
    p1 = b.allocate(1000)
    p2 = b.allocate(5000)
    p3 = b.allocate(1 << 17)  # larger than every bin: upstream
    assert small.reserved_memory_info().free_bytes == 1024
    assert pool.reserved_memory_info().free_bytes == (1 << 20) - 5120
    b.deallocate(p1, 1000)
    b.deallocate(p2, 5000)
    b.deallocate(p3, 1 << 17)
    info = b.reserved_memory_info()
    assert info.free_bytes == info.reserved_bytes


def test_bad_input(base_resource):
    b = BinningMemoryResource(base_resource, 10, 11)
    p = b.allocate(1000)
    with pytest.raises(ValueError):
        b.deallocate(p, 3000)  # routed to the 4 KiB... upstream: not its pointer
    with pytest.raises(ValueError):
        b.deallocate(p, 1001)
    b.deallocate(p, 1000)
    with pytest.raises(ValueError):
        BinningMemoryResource(base_resource, 12, 10)
    with pytest.raises(TypeError):
        b.add_bin(4096, object())
    assert b.allocate(0) == 0
    b.deallocate(0, 0)
