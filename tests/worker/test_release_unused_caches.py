"""``release_unused`` with a library cache in front of the stack (a CuPy-like cache that runs
without CUDA): the cache gives its free blocks back first, then the pool shrinks."""

from __future__ import annotations

from distributed.utils_test import gen_cluster

import dask_rmm
from dask_rmm.plugin import RMMPlugin

MiB = 1 << 20


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_release_unused_has_library_caches_give_their_free_blocks_back_first(c, s, a):
    from library_cache_helpers import HostLibraryCache

    from dask_rmm.allocators.caches import register_cache, unregister_cache

    await c.register_plugin(RMMPlugin(base_resource="system", pool_size="4MiB"))
    cache = HostLibraryCache()
    register_cache(cache)
    try:
        cache.free(cache.malloc(16 * MiB))  # the pool grows; the block stays in the cache
        kept = await dask_rmm.release_unused(c, library_caches=False)
        assert [r.released_bytes for r in kept[a.address]] == [0]
        released = await dask_rmm.release_unused(c)
        [r] = released[a.address]
        assert r.library_cache_bytes == 16 * MiB
        assert r.released_bytes == 16 * MiB and r.reserved_after == 4 * MiB
        assert cache.cached_bytes(0) == 0
    finally:
        unregister_cache(cache)
