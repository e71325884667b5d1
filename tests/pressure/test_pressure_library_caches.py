"""Memory pressure with a library cache in front of the stack (no CUDA): cached free blocks are
given back before anything is spilled, the limit counts bytes in arrays (not cached ones), a
cache growing speculatively is refused without spilling, and a cache's own out-of-memory
callback spills with ``spill_on_oom``."""

from __future__ import annotations

import pytest
from distributed import Worker
from distributed.utils_test import gen_cluster
from library_cache_helpers import HostLibraryCache, cached_array_type

from dask_rmm.allocators import caches
from tests.pressure_helpers import MiB, check_buffer, patterned_buffer, pressure_stack


@pytest.fixture
def cache():
    c = HostLibraryCache()
    caches.register_cache(c)
    yield c
    c.release(0)


def _cached_free(cache: HostLibraryCache, sizes: list[int]) -> None:
    """Leave one free block of each size in the cache, one array at a time."""
    for nbytes in sizes:
        cache.free(cache.malloc(nbytes))


def test_out_of_memory_takes_cached_blocks_back_before_spilling(cache):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    store = wp.store
    store["a"] = patterned_buffer(MiB, 1)
    store["b"] = patterned_buffer(MiB, 2)
    _cached_free(cache, [MiB, MiB - 256])  # the pool is full: 2 MiB stored, 2 MiB cached
    big = patterned_buffer(2 * MiB, 3)  # fits once the cache gives its blocks back
    check_buffer(big, 3)
    assert cache.cached_bytes(0) == 0 and cache.releases == 1
    m = wp.metrics()[0]
    assert m.total_spilled_count == 0 and m.oom_count == 0  # nothing spilled, no OOM
    check_buffer(store["a"], 1)
    check_buffer(store["b"], 2)


def test_spilled_arrays_of_a_cache_reach_the_stack_through_the_cache(cache):
    """The values spilled are the cache's arrays: their blocks go back to the cache, which is
    asked to give them back before each retry."""
    with cached_array_type(cache) as CachedArray:
        wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
        for i in range(4):
            wp.store[f"x-{i}"] = CachedArray(MiB)  # the whole pool, in the cache's arrays
        big = patterned_buffer(2 * MiB, 5)  # two arrays spilled, their blocks given back
        check_buffer(big, 5)
        assert 1 <= wp.metrics()[0].total_spilled_count <= 2
        assert cache.releases >= 1


def test_the_limit_counts_bytes_in_arrays_not_cached_ones(cache):
    wp, top = pressure_stack(8 * MiB, limit=3 * MiB, spill_on_oom=True)
    dp = wp.devices[0]
    wp.store["a"] = patterned_buffer(MiB, 1)
    _cached_free(cache, [MiB, MiB + 256, MiB + 512])  # ~4 MiB allocated, 1 MiB in arrays
    assert dp.cached_bytes() == 3 * MiB + 768
    assert dp.current_bytes() == MiB
    extra = patterned_buffer(MiB, 2)  # 2 MiB in arrays: under the limit, nothing spilled
    assert wp.metrics()[0].total_spilled_count == 0
    del extra


@pytest.mark.parametrize("spill_on_oom", [True, False])
def test_at_the_pools_maximum_a_stored_output_has_the_caches_give_free_blocks_back(
    cache, spill_on_oom
):
    """A cache keeping free blocks while the pool cannot grow would carve later small arrays out
    of them (pinning them): each stored output has the caches give them back first."""
    wp, top = pressure_stack(4 * MiB, spill_on_oom=spill_on_oom)
    _cached_free(cache, [MiB, 2 * MiB])
    assert cache.cached_bytes(0) == 3 * MiB
    wp.store["a"] = patterned_buffer(256 << 10, 1)
    assert cache.cached_bytes(0) == 0 and cache.releases == 1
    assert wp.metrics()[0].total_spilled_count == 0  # given back, nothing spilled
    check_buffer(wp.store["a"], 1)


class _OutsideCache:
    """A cache beside the stack, as PyTorch's: its ``release`` is ``empty_cache``."""

    name = "torch"
    outside_stack = True

    def __init__(self) -> None:
        self.releases = 0

    def cached_bytes(self, device: int) -> int:
        return 4 * MiB

    def in_use_bytes(self, device: int) -> int:
        return 0

    def release(self, device: int) -> int:
        self.releases += 1
        return 0


def test_a_stored_output_leaves_pytorchs_cache_alone(cache):
    """Outputs are stored on the event loop, where PyTorch's ``empty_cache`` (which synchronizes
    the device) must not run: only the caches inside the stack give back there."""
    outside = _OutsideCache()
    caches.register_cache(outside)
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    _cached_free(cache, [MiB, 2 * MiB])
    wp.store["a"] = patterned_buffer(256 << 10, 1)
    assert cache.releases == 1 and outside.releases == 0
    assert caches.release_cached_by_library(0) == {}  # and it is released where asked
    assert outside.releases == 1


def test_with_room_to_grow_the_caches_keep_their_free_blocks(cache):
    """No pressure: a stored output leaves the caches alone (their blocks make them fast)."""
    wp, top = pressure_stack(4 * MiB, maximum=64 * MiB)
    _cached_free(cache, [MiB, 2 * MiB])
    wp.store["a"] = patterned_buffer(256 << 10, 1)
    assert cache.cached_bytes(0) == 3 * MiB and cache.releases == 0


def test_over_the_limit_counting_cached_blocks_the_caches_give_them_back(cache):
    """The pool may grow, but the device's bytes with the caches' free blocks are over
    ``device_memory_limit``: the caches give them back before anything is spilled."""
    wp, top = pressure_stack(4 * MiB, maximum=64 * MiB, limit=2 * MiB)
    _cached_free(cache, [MiB, 2 * MiB])
    wp.store["a"] = patterned_buffer(256 << 10, 1)
    assert cache.cached_bytes(0) == 0 and cache.releases == 1
    assert wp.metrics()[0].total_spilled_count == 0
    check_buffer(wp.store["a"], 1)


def test_values_spilled_to_the_limit_reach_the_pool_not_the_cache(cache):
    """Spilling to ``device_memory_limit`` frees a cache's arrays into the cache: it gives the
    blocks back to the pool at once, where the next large request finds them."""
    with cached_array_type(cache) as CachedArray:
        wp, top = pressure_stack(8 * MiB, maximum=64 * MiB, limit=3 * MiB)
        wp.store["x-0"] = CachedArray(MiB)
        wp.store["x-1"] = CachedArray(MiB)
        wp.store["x-2"] = CachedArray(MiB)
        releases = cache.releases
        extra = patterned_buffer(MiB, 9)  # over the limit: the oldest spilled first
        assert wp.metrics()[0].total_spilled_count >= 1
        assert cache.releases > releases and cache.cached_bytes(0) == 0
        check_buffer(extra, 9)


def test_a_cache_growing_speculatively_is_refused_without_spilling(cache):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    wp.store["a"] = patterned_buffer(2 * MiB, 1)
    with caches.drawing_for_cache(), pytest.raises(MemoryError):
        top.allocate(4 * MiB)
    assert wp.metrics()[0].total_spilled_count == 0
    assert wp.oom_events() == []
    check_buffer(wp.store["a"], 1)


def test_a_caches_out_of_memory_callback_spills_only_with_spill_on_oom(cache):
    for spill_on_oom in (False, True):
        wp, top = pressure_stack(4 * MiB, spill_on_oom=spill_on_oom)
        wp.store["a"] = patterned_buffer(2 * MiB, 1)
        freed = wp.devices[0].spill_for_cache(MiB)
        assert freed == (2 * MiB if spill_on_oom else 0)
        check_buffer(wp.store["a"], 1)  # spilled or not, the value reads back


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_attach_sets_the_caches_oom_handler_and_detach_removes_it(c, s, a: Worker):
    wp, top = pressure_stack(4 * MiB, spill_on_oom=True)
    wp.attach(a)
    try:
        assert caches.oom_handler(0) == wp.devices[0].spill_for_cache
    finally:
        wp.detach(a)
    assert caches.oom_handler(0) is None
