"""Giving pooled memory back: PoolMemoryResource.trim (to its initial size, to a given size,
never a chunk with a live block) and trim_pools / trim_resource over resource chains."""

from __future__ import annotations

import pytest

import dask_rmm
from dask_rmm.mr import CudaAsyncMemoryResource, PoolMemoryResource, StatisticsResourceAdaptor
from dask_rmm.mr.trim import pools_in, trim_pools, trim_resource

MiB = 1 << 20


def _grown(base_resource) -> tuple[PoolMemoryResource, int, int]:
    """A pool of 1 MiB grown by a 4 MiB and an 8 MiB chunk; both blocks live."""
    p = PoolMemoryResource(base_resource, initial_pool_size=MiB)
    a = p.allocate(4 * MiB)
    b = p.allocate(8 * MiB)
    assert sorted(s for _, s in p.memory_layout()[0]) == [MiB, 4 * MiB, 8 * MiB]
    return p, a, b


def test_trim_gives_a_grown_pool_back_down_to_its_initial_size(base_resource):
    p, a, b = _grown(base_resource)
    p.deallocate(a, 4 * MiB)
    p.deallocate(b, 8 * MiB)
    assert p.initial_pool_size == MiB
    assert p.trim() == 12 * MiB
    assert p.pool_size() == MiB and [s for _, s in p.memory_layout()[0]] == [MiB]
    assert p.trim() == 0  # idempotent
    c = p.allocate(2 * MiB)  # and it grows again when asked
    p.deallocate(c, 2 * MiB)


def test_trim_to_a_size_keeps_at_least_that_much_releasing_the_largest_chunks_first(
    base_resource,
):
    p, a, b = _grown(base_resource)
    p.deallocate(a, 4 * MiB)
    p.deallocate(b, 8 * MiB)
    assert p.trim("5MiB") == 8 * MiB
    assert p.pool_size() == 5 * MiB
    assert p.trim(0) == 5 * MiB and p.pool_size() == 0


def test_trim_below_a_chunk_keeps_the_initial_chunk_unless_asked_below_the_initial_size(
    base_resource,
):
    p = PoolMemoryResource(base_resource, initial_pool_size=8 * MiB)
    a = p.allocate(64 * MiB)  # grows by a 64 MiB chunk
    p.deallocate(a, 64 * MiB)
    # above 16 MiB: the grown chunk goes, the initial one stays (the pool ends below 16 MiB)
    assert p.trim("16MiB") == 64 * MiB and p.pool_size() == 8 * MiB
    assert p.trim("4MiB") == 8 * MiB and p.pool_size() == 0


def test_trim_never_touches_a_chunk_holding_a_live_block(base_resource):
    p, a, b = _grown(base_resource)
    p.deallocate(b, 8 * MiB)
    live = p.live_allocations()
    assert p.trim(0) == 8 * MiB + MiB  # the free initial chunk too, the 4 MiB one stays
    assert p.pool_size() == 4 * MiB
    assert p.live_allocations() == live
    p.deallocate(a, 4 * MiB)
    assert p.trim(0) == 4 * MiB


def test_trim_resource_finds_the_pool_under_an_adaptor_and_leaves_statistics_as_they_were(
    base_resource,
):
    pool = PoolMemoryResource(base_resource, initial_pool_size=MiB)
    stats = StatisticsResourceAdaptor(pool)
    # a cudaMallocAsync base is a pool of its own, trimmed after ours
    below = [base_resource] if isinstance(base_resource, CudaAsyncMemoryResource) else []
    assert list(pools_in(stats)) == [pool, *below]
    kept = stats.allocate(1000)
    grown = stats.allocate(16 * MiB)
    stats.deallocate(grown, 16 * MiB)
    before = stats.allocation_counts
    result, *rest = trim_resource(stats)
    assert len(rest) == len(below)
    assert result.released_bytes == 16 * MiB
    assert (result.reserved_before, result.reserved_after) == (17 * MiB, MiB)
    assert result.in_use_bytes >= 1000
    assert stats.allocation_counts == before
    stats.deallocate(kept, 1000)


def test_trim_pools_trims_the_current_resource_of_each_device():
    dask_rmm.reinitialize(pool_allocator=True, initial_pool_size="1MiB", base_resource="system")
    buf = dask_rmm.DeviceBuffer(size=8 * MiB)
    del buf
    results = trim_pools()
    assert [r.released_bytes for r in results[0]] == [8 * MiB]
    assert "released 8.00 MiB, reserved 9.00 MiB -> 1.00 MiB" in str(results[0][0])


def test_trim_refuses_a_size_it_cannot_read_and_changes_nothing(base_resource):
    p, a, b = _grown(base_resource)
    p.deallocate(b, 8 * MiB)
    with pytest.raises(ValueError, match="size"):
        p.trim("a lot")
    assert p.pool_size() == 13 * MiB
    p.deallocate(a, 4 * MiB)


@pytest.mark.gpu
def test_trim_resource_gives_a_cuda_async_pools_free_memory_back_to_the_driver():
    from dask_rmm.mr import CudaAsyncMemoryResource

    r = CudaAsyncMemoryResource(release_threshold=1 << 40)  # it keeps what it had on its own
    kept = r.allocate(MiB)
    ptr = r.allocate(256 * MiB)
    r.deallocate(ptr, 256 * MiB)
    [result] = trim_resource(r, 0)
    assert result.resource == "CudaAsyncMemoryResource"
    assert result.released_bytes >= 256 * MiB
    assert result.reserved_after < result.reserved_before
    assert result.in_use_bytes >= MiB
    r.deallocate(kept, MiB)
