"""rmm_cupy_allocator, set_cupy_allocator and set_allocators.

Without a GPU the allocator runs with CuPy's device/stream queries replaced, on host memory
(UnownedMemory and MemoryPointer never touch CUDA when given a device id); the GPU tests
allocate real CuPy arrays through each suballocator and adaptor.
"""

from __future__ import annotations

import ctypes
import gc
import sys

import pytest
from conftest import GPU_RESOURCES, make_gpu_resource

cupy = pytest.importorskip("cupy")

from dask_rmm.allocators import (  # noqa: E402
    SUPPORTED_ALLOCATORS,
    reset_allocators,
    set_allocators,
)
from dask_rmm.allocators import cupy as cupy_hook  # noqa: E402
from dask_rmm.allocators.caches import (  # noqa: E402
    library_caches,
)
from dask_rmm.mr import (  # noqa: E402
    PoolMemoryResource,
    StatisticsResourceAdaptor,
    SystemMemoryResource,
    set_per_device_resource,
)


class _FakeCupyStream:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.fixture
def host_cupy(monkeypatch):
    """CuPy's device and current-stream queries answered without a GPU: device 0, stream 0
    (change ``state["stream"]`` / ``state["device"]`` to switch)."""
    state = {"device": 0, "stream": 0, "asked": []}

    def get_device_id():
        return state["device"]

    def get_current_stream(device_id=-1):
        state["asked"].append(device_id)
        return _FakeCupyStream(state["stream"])

    monkeypatch.setattr(cupy_hook, "_get_device_id", get_device_id)
    monkeypatch.setattr(cupy_hook, "_get_current_stream", get_current_stream)
    return state


@pytest.fixture
def host_stats():
    mr = StatisticsResourceAdaptor(
        PoolMemoryResource(SystemMemoryResource(), initial_pool_size=1 << 20)
    )
    set_per_device_resource(0, mr)
    return mr


def test_allocator_on_host_memory(host_cupy, host_stats):
    mp = cupy_hook.rmm_cupy_allocator(1000)
    assert isinstance(mp, cupy.cuda.MemoryPointer)
    assert mp.device_id == 0 and mp.mem.size == 1000 and mp.ptr % 256 == 0
    assert host_cupy["asked"] == [0]  # the current stream of the device CuPy is on
    ctypes.memset(mp.ptr, 0xAB, 1000)
    assert ctypes.string_at(mp.ptr + 999, 1) == b"\xab"
    stats = host_stats.allocation_counts
    assert (stats.current_bytes, stats.current_count) == (1000, 1)

    view = mp + 256  # a view keeps the allocation alive
    del mp
    gc.collect()
    assert host_stats.allocation_counts.current_bytes == 1000
    del view
    assert host_stats.allocation_counts.current_bytes == 0
    assert host_stats.allocation_counts.total_count == 1


def test_allocator_uses_current_stream_and_frees_on_it(host_cupy, monkeypatch):
    seen = []

    class Recording(SystemMemoryResource):
        def allocate(self, nbytes, stream=None):
            seen.append(("allocate", stream.handle))
            return super().allocate(nbytes, stream)

        def deallocate(self, ptr, nbytes, stream=None):
            seen.append(("deallocate", stream.handle, nbytes))
            super().deallocate(ptr, nbytes, stream)

    set_per_device_resource(0, Recording())
    host_cupy["stream"] = 0x1234
    mp = cupy_hook.rmm_cupy_allocator(300)
    host_cupy["stream"] = 0  # freed on the allocation's stream, not the one current at free
    del mp
    assert seen == [("allocate", 0x1234), ("deallocate", 0x1234, 300)]
    assert cupy_hook._streams[0x1234].handle == 0x1234  # Stream objects are cached


def test_allocation_owner_is_a_device_buffer_as_rmm(host_cupy, host_stats):
    from dask_rmm.device_buffer import DeviceBuffer

    mp = cupy_hook.rmm_cupy_allocator(42)
    owner = mp.mem._owner
    assert isinstance(owner, DeviceBuffer)
    assert (owner.ptr, owner.size, owner.mr) == (mp.ptr, 42, host_stats)
    empty = cupy_hook.rmm_cupy_allocator(0)
    assert isinstance(empty.mem._owner, DeviceBuffer) and empty.mem._owner.size == 0
    del mp, owner, empty
    assert host_stats.allocation_counts.current_bytes == 0


def test_allocator_zero_bytes(host_cupy, host_stats):
    mp = cupy_hook.rmm_cupy_allocator(0)
    assert mp.ptr == 0 and mp.device_id == 0
    del mp
    assert host_stats.allocation_counts.total_count == 0


def test_allocator_follows_resource_changes(host_cupy):
    first = StatisticsResourceAdaptor(SystemMemoryResource())
    second = StatisticsResourceAdaptor(SystemMemoryResource())
    set_per_device_resource(0, first)
    a = cupy_hook.rmm_cupy_allocator(512)
    set_per_device_resource(0, second)
    b = cupy_hook.rmm_cupy_allocator(256)
    assert first.allocation_counts.current_bytes == 512
    assert second.allocation_counts.current_bytes == 256
    del a, b  # each goes back to the resource it came from
    assert first.allocation_counts.current_bytes == 0
    assert second.allocation_counts.current_bytes == 0


def _holds_blocks(cache) -> bool:
    try:
        return cache.pool.total_bytes() > 0
    except Exception:  # no device here: the pool never held anything
        return False


def test_set_and_reset_cupy_allocator():
    original = cupy.cuda.get_allocator()
    cupy_hook.set_cupy_allocator()
    cupy_hook.set_cupy_allocator()  # idempotent
    try:
        # by default CuPy's own MemoryPool over the resource, listed as a library cache
        cache = cupy_hook.get_cupy_cache()
        assert cupy.cuda.get_allocator() == cache.pool.malloc
        assert cache in library_caches()
        # the exact path on request: the lean allocator; the cache stays listed only while
        # arrays still hold its blocks
        cupy_hook.set_cupy_allocator(cache=False)
        assert cupy.cuda.get_allocator() is cupy_hook.lean_cupy_allocator
        assert (cache in library_caches()) == _holds_blocks(cache)
        cupy_hook.set_cupy_allocator(cache=True)
        assert cupy.cuda.get_allocator() == cache.pool.malloc
    finally:
        cupy_hook.reset_cupy_allocator()
    assert cupy.cuda.get_allocator() is original
    cache = cupy_hook.get_cupy_cache()
    assert (cache in library_caches()) == _holds_blocks(cache)
    cupy_hook.reset_cupy_allocator()  # nothing to reset: no-op
    assert cupy.cuda.get_allocator() is original
    # dask-rmm's exact allocator set by hand counts as ours for the exact path (set is then a
    # no-op); the default (the cache) replaces it, and reset gives it back
    cupy.cuda.set_allocator(cupy_hook.rmm_cupy_allocator)
    try:
        cupy_hook.set_cupy_allocator(cache=False)
        assert cupy.cuda.get_allocator() is cupy_hook.rmm_cupy_allocator
        cupy_hook.set_cupy_allocator()
        assert cupy.cuda.get_allocator() == cupy_hook.get_cupy_cache().pool.malloc
        cupy_hook.reset_cupy_allocator()
        assert cupy.cuda.get_allocator() is cupy_hook.rmm_cupy_allocator
    finally:
        cupy.cuda.set_allocator(original)


def test_set_allocators_cupy():
    original = cupy.cuda.get_allocator()
    assert set_allocators("CuPy", exact=["cupy"]) == ["cupy"]
    try:
        assert cupy.cuda.get_allocator() is cupy_hook.lean_cupy_allocator
    finally:
        reset_allocators(["cupy"])
    assert cupy.cuda.get_allocator() is original


def test_supported_names():
    assert SUPPORTED_ALLOCATORS == ("cupy", "numba", "rmm", "torch")


@pytest.mark.parametrize("names", [["tensorflow"], ["cupy", "torchh"], "cupy,nope"])
def test_unknown_names_list_supported(names):
    original = cupy.cuda.get_allocator()
    with pytest.raises(
        ValueError, match=r"unknown library .* in `allocators`; supported: cupy, numba, rmm, torch"
    ):
        set_allocators(names)
    assert cupy.cuda.get_allocator() is original  # nothing was set


def test_non_string_name():
    with pytest.raises(TypeError, match="must be library names"):
        set_allocators([1])


def test_missing_library_is_a_clear_import_error(monkeypatch):
    import dask_rmm.allocators as allocators

    monkeypatch.setitem(sys.modules, "dask_rmm.allocators.numba", None)  # import fails
    original = cupy.cuda.get_allocator()
    with pytest.raises(ImportError, match="'numba' allocator needs numba.*numba-cuda") as info:
        allocators.set_allocators(["cupy", "numba"])
    assert isinstance(info.value.__cause__, ImportError)
    assert cupy.cuda.get_allocator() is original  # all imported before any is set


def test_missing_cupy_is_a_clear_import_error(monkeypatch):
    monkeypatch.setattr(cupy_hook, "_library_import_error", ImportError("No module named 'cupy'"))
    with pytest.raises(ImportError, match="'cupy' allocator needs cupy.*cupy-cuda13x") as info:
        set_allocators(["cupy"])
    assert "No module named 'cupy'" in str(info.value.__cause__)


def test_none_and_empty_names():
    assert set_allocators(None) == []
    assert set_allocators([]) == []
    assert set_allocators(" , ") == []


# --- GPU --------------------------------------------------------------------------------------


@pytest.fixture(params=["rmm_cupy_allocator", "lean_cupy_allocator"])
def gpu_cupy_allocator(request):
    original = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(getattr(cupy_hook, request.param))
    yield request.param
    cupy.cuda.set_allocator(original)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_RESOURCES)
def test_gpu_cupy_arrays(kind, gpu_cupy_allocator):
    from dask_rmm.mr import set_current_device_resource

    mr = make_gpu_resource(kind)
    set_current_device_resource(mr)
    a = cupy.arange(1000, dtype=cupy.float64)
    b = cupy.ones((300, 7), dtype=cupy.int32)
    assert float((a * 2).sum()) == 999 * 1000
    assert int(b.sum()) == 2100
    assert isinstance(a.data.mem, cupy.cuda.memory.UnownedMemory)
    if hasattr(mr, "allocation_counts"):
        stats = mr.allocation_counts
        assert stats.current_bytes >= 8000 + 8400
        assert stats.current_count >= 2
    del a, b
    cupy.cuda.get_current_stream().synchronize()
    if hasattr(mr, "allocation_counts"):
        assert mr.allocation_counts.current_bytes == 0


@pytest.mark.gpu
def test_gpu_cupy_non_default_stream(gpu_cupy_allocator):
    from dask_rmm.mr import set_current_device_resource

    mr = make_gpu_resource("statistics(pool)")
    set_current_device_resource(mr)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        a = cupy.full(4096, 3, dtype=cupy.uint8)
        total = int(a.sum())
        assert cupy_hook._streams[s.ptr].handle == s.ptr
        del a
    s.synchronize()
    assert total == 3 * 4096
    assert mr.allocation_counts.current_bytes == 0


@pytest.mark.gpu
def test_gpu_cupy_each_device_uses_its_resource(gpu_cupy_allocator):
    from dask_rmm import _cuda
    from dask_rmm.mr import set_per_device_resource

    n = _cuda.get_device_count()
    if n < 2:
        pytest.skip("needs two CUDA devices")
    resources = []
    for d in range(2):
        with cupy.cuda.Device(d):
            mr = make_gpu_resource("statistics(pool)")
            set_per_device_resource(d, mr)
            resources.append(mr)
    arrays = []
    for d in range(2):
        with cupy.cuda.Device(d):
            arrays.append(cupy.ones(1000 * (d + 1), dtype=cupy.uint8))
            assert arrays[-1].device.id == d
    assert [mr.allocation_counts.current_bytes for mr in resources] == [1000, 2000]
    del arrays
    assert [mr.allocation_counts.current_bytes for mr in resources] == [0, 0]


def test_allocation_keeps_its_cupy_stream_alive(host_cupy):
    import weakref

    base = SystemMemoryResource()  # a pool would keep the stream for its free lists itself
    set_per_device_resource(0, base)

    cs = _FakeCupyStream(0x7000)
    host_cupy["stream"] = cs.ptr
    cupy_hook._streams.pop(cs.ptr, None)

    holder = [cs]
    cupy_hook._get_current_stream, saved = (
        (lambda device_id=-1: holder[0]),
        cupy_hook._get_current_stream,
    )
    try:
        mp = cupy_hook.rmm_cupy_allocator(256)
    finally:
        cupy_hook._get_current_stream = saved
    ref = weakref.ref(cs)
    del cs
    holder.clear()
    cupy_hook._streams.clear()
    # the allocation's owner still holds the CuPy stream it will be freed on
    alive = ref() is not None
    handle = mp.mem._owner.stream.handle
    del mp
    assert alive and handle == 0x7000
    gc.collect()
    assert base.live_allocations == 0
    assert ref() is None


# --- lean_cupy_allocator: the same contract but the memory object, on host memory --------------


def test_lean_allocator_counts_and_frees_like_rmm_cupy_allocator(host_cupy, host_stats):
    mp = cupy_hook.lean_cupy_allocator(1000)
    assert isinstance(mp, cupy.cuda.MemoryPointer)
    mem = mp.mem
    assert isinstance(mem, cupy_hook.ResourceMemory)
    assert isinstance(mem, cupy.cuda.memory.UnownedMemory)
    assert (mem.ptr, mem.size, mem.device_id, mem._owner) == (mp.ptr, 1000, 0, None)
    assert mem.resource is host_stats and mem.stream.handle == 0
    assert host_cupy["asked"] == [0]
    ctypes.memset(mp.ptr, 0xCD, 1000)
    stats = host_stats.allocation_counts
    assert (stats.current_bytes, stats.current_count) == (1000, 1)
    view = mp + 512  # a view keeps the allocation alive
    del mp, mem
    gc.collect()
    assert host_stats.allocation_counts.current_bytes == 1000
    del view
    assert host_stats.allocation_counts.current_bytes == 0
    empty = cupy_hook.lean_cupy_allocator(0)
    assert empty.ptr == 0 and empty.device_id == 0
    del empty
    assert host_stats.allocation_counts.total_count == 1


def test_lean_allocator_frees_on_the_allocation_stream_and_resource(host_cupy):
    seen = []

    class Recording(SystemMemoryResource):
        def allocate(self, nbytes, stream=None):
            seen.append(("allocate", self, stream.handle))
            return super().allocate(nbytes, stream)

        def deallocate(self, ptr, nbytes, stream=None):
            seen.append(("deallocate", self, stream.handle, nbytes))
            super().deallocate(ptr, nbytes, stream)

    first, second = Recording(), Recording()
    set_per_device_resource(0, first)
    host_cupy["stream"] = 0x2345
    mp = cupy_hook.lean_cupy_allocator(300)
    host_cupy["stream"] = 0
    set_per_device_resource(0, second)  # freed into the resource it came from
    del mp
    assert seen == [("allocate", first, 0x2345), ("deallocate", first, 0x2345, 300)]
    assert first.live_allocations == 0


def test_lean_allocator_keeps_resource_and_cupy_stream_alive(host_cupy):
    import weakref

    base = SystemMemoryResource()
    set_per_device_resource(0, base)
    cs = _FakeCupyStream(0x7100)
    cupy_hook._streams.pop(cs.ptr, None)
    holder = [cs]
    saved = cupy_hook._get_current_stream
    cupy_hook._get_current_stream = lambda device_id=-1: holder[0]
    try:
        mp = cupy_hook.lean_cupy_allocator(256)
    finally:
        cupy_hook._get_current_stream = saved
    ref, mr_ref = weakref.ref(cs), weakref.ref(base)
    del cs, base
    holder.clear()
    cupy_hook._streams.clear()
    set_per_device_resource(0, SystemMemoryResource())
    gc.collect()
    assert ref() is not None and mr_ref() is not None
    del mp
    gc.collect()
    assert ref() is None and mr_ref() is None


def test_lean_allocator_free_failure_is_logged_not_raised(host_cupy, caplog):
    class Refusing(SystemMemoryResource):
        def deallocate(self, ptr, nbytes, stream=None):
            raise ValueError("refused on purpose")

    mr = Refusing()
    set_per_device_resource(0, mr)
    mp = cupy_hook.lean_cupy_allocator(128)
    ptr = mp.ptr
    with caplog.at_level("WARNING", logger="dask_rmm.device_buffer"):
        del mp
        gc.collect()
    assert f"freeing {ptr:#x} (128 bytes) failed" in caplog.text
    assert "refused on purpose" in caplog.text
    SystemMemoryResource.deallocate(mr, ptr, 128)


# -- watching CuPy's allocations (memory admission) ----------------------------------------------


@pytest.fixture
def unwatched():
    """Every watch a test leaves is taken off, and CuPy's allocator given back."""
    original = cupy.cuda.get_allocator()
    yield original
    for owner in list(cupy_hook._watchers):
        cupy_hook.unwatch_cupy_allocations(owner)
    cupy_hook.reset_cupy_allocator()
    cupy.cuda.set_allocator(original)


def test_a_watch_sees_each_allocation_and_gives_cupy_its_allocator_back(
    host_cupy, host_stats, unwatched
):
    cupy_hook.set_cupy_allocator(cache=False)
    first, second = [], []
    cupy_hook.watch_cupy_allocations("first", first.append)
    assert cupy.cuda.get_allocator() is not cupy_hook.lean_cupy_allocator
    a = cupy.empty(1000, dtype="uint8")  # through cupy.cuda.memory.alloc, as every array
    cupy_hook.watch_cupy_allocations("second", second.append)
    b = cupy.empty(300, dtype="float64")
    assert first == [1000, 2400] and second == [2400]
    assert host_stats.allocation_counts.current_bytes == 3400  # still the lean allocator's
    cupy_hook.unwatch_cupy_allocations("first")
    c = cupy.empty(10, dtype="uint8")
    assert first == [1000, 2400] and second == [2400, 10]
    cupy_hook.unwatch_cupy_allocations("second")
    assert cupy.cuda.get_allocator() is cupy_hook.lean_cupy_allocator
    cupy_hook.unwatch_cupy_allocations("second")  # not watching: nothing
    del a, b, c
    cupy_hook.reset_cupy_allocator()
    assert cupy.cuda.get_allocator() is unwatched


def test_setting_and_resetting_the_allocator_keeps_the_watch(host_cupy, host_stats, unwatched):
    sizes = []
    cupy_hook.watch_cupy_allocations("me", sizes.append)
    cupy_hook.set_cupy_allocator(cache=False)  # switched under the watch
    x = cupy.empty(512, dtype="uint8")
    assert sizes == [512] and host_stats.allocation_counts.current_bytes == 512
    cupy_hook.set_cupy_allocator()  # the cache: what it wraps is the pool's malloc
    assert cupy.cuda.get_allocator().__wrapped__ == cupy_hook.get_cupy_cache().pool.malloc
    from dask_rmm.worker.stacks import cupy_allocator_note

    assert cupy_allocator_note().startswith("CuPy allocates through its own MemoryPool over")
    cupy_hook.reset_cupy_allocator()
    assert cupy.cuda.get_allocator().__wrapped__ is unwatched
    cupy_hook.unwatch_cupy_allocations("me")
    assert cupy.cuda.get_allocator() is unwatched
    del x


def test_a_failing_watcher_never_fails_an_allocation(host_cupy, host_stats, unwatched, caplog):
    def broken(nbytes):
        raise RuntimeError("watcher broke")

    cupy_hook.set_cupy_allocator(cache=False)
    cupy_hook.watch_cupy_allocations("broken", broken)
    with caplog.at_level("WARNING", logger="dask_rmm.allocators.cupy"):
        arrays = [cupy.empty(256, dtype="uint8") for _ in range(3)]
        sizes = []
        cupy_hook.watch_cupy_allocations("other", sizes.append)  # still told
        arrays += [cupy.empty(256, dtype="uint8") for _ in range(2)]
    assert len(arrays) == 5 and host_stats.allocation_counts.current_bytes == 5 * 256
    assert sizes == [256, 256]
    failed = f"dask-rmm: watching a CuPy allocation failed ({broken!r})"
    assert [r.getMessage() for r in caplog.records].count(failed) == 1


def test_an_allocator_set_outside_dask_rmm_while_watched_is_left_in_place(unwatched):
    sizes = []
    cupy_hook.watch_cupy_allocations("me", sizes.append)
    cupy.cuda.set_allocator(None)  # the user's choice (CuPy's raw cudaMalloc)
    theirs = cupy.cuda.get_allocator()
    cupy_hook.unwatch_cupy_allocations("me")
    assert cupy.cuda.get_allocator() is theirs


def test_a_watch_refused_inside_using_allocator_changes_nothing(unwatched):
    with cupy.cuda.using_allocator(cupy_hook.lean_cupy_allocator):
        with pytest.raises(ValueError, match="using_allocator"):  # CuPy's own refusal
            cupy_hook.watch_cupy_allocations("me", print)
    assert not cupy_hook._watchers and cupy.cuda.get_allocator() is unwatched
    cupy_hook.watch_cupy_allocations("me", print)
    with cupy.cuda.using_allocator(cupy_hook.lean_cupy_allocator):
        with pytest.raises(ValueError, match="using_allocator"):
            cupy_hook.watch_cupy_allocations("me", len)
    assert cupy_hook._watchers == {"me": print}
