"""Arbitration across libraries (host memory, fake library caches holding real blocks of the
stack): one order (caches give back, then outputs spill), recorded per library; out-of-memory
errors of any library told by name; what the caches gave back is in the OOM snapshot; running
tasks' bytes are charged to them by the pressure adaptor."""

from __future__ import annotations

import threading

import pytest
from library_cache_helpers import HostLibraryCache, cached_array_type

from dask_rmm.allocators import arbitration, caches
from dask_rmm.mr.base import OutOfMemoryError
from tests.pressure_helpers import MiB, patterned_buffer, pressure_stack


def _cache(name: str, free_blocks: list[int]) -> HostLibraryCache:
    """A fake library cache named ``name`` holding free blocks drawn from device 0's stack."""
    cache = HostLibraryCache()
    cache.name = name
    caches.register_cache(cache)
    for nbytes in free_blocks:
        cache.free(cache.malloc(nbytes))
    return cache


def test_make_room_empties_every_cache_then_spills_outputs():
    wp, top = pressure_stack(8 * MiB, spill_on_oom=True)
    store = wp.store
    store["a"] = patterned_buffer(2 * MiB, 1)
    store["b"] = patterned_buffer(2 * MiB, 2)
    cupy_like = _cache("cupy", [MiB])
    torch_like = _cache("torch", [2 * MiB])
    caches.set_oom_handler(0, wp.devices[0].spill_for_cache)
    room = arbitration.make_room(0, 2 * MiB, library="torch")
    assert room.released == {"cupy": MiB, "torch": 2 * MiB}
    assert room.spilled == 2 * MiB  # the least recently used output
    assert room.freed == 5 * MiB and room.library == "torch"
    assert cupy_like.cached_bytes(0) == torch_like.cached_bytes(0) == 0
    assert arbitration.recent_rooms() == [room]
    assert room.to_dict()["released"] == {"cupy": MiB, "torch": 2 * MiB}
    assert wp.metrics()[0].spilled_bytes == 2 * MiB


def test_make_room_spills_nothing_without_spill_on_oom():
    wp, top = pressure_stack(8 * MiB, spill_on_oom=False)
    wp.store["a"] = patterned_buffer(2 * MiB, 1)
    _cache("cupy", [MiB])
    room = arbitration.make_room(0, 4 * MiB, library="rmm")
    assert room.released == {"cupy": MiB} and room.spilled == 0
    assert wp.metrics()[0].spilled_bytes == 0


def test_a_failed_allocation_takes_cache_blocks_back_and_the_snapshot_says_from_where():
    wp, top = pressure_stack(4 * MiB, spill_on_oom=False)
    _cache("torch", [MiB])
    big = patterned_buffer(3 * MiB + MiB // 2, 1)  # fits only once torch's free block is back
    assert big.size == 3 * MiB + MiB // 2
    del big
    _cache("cupy", [MiB])
    held = patterned_buffer(2 * MiB, 3)
    with pytest.raises(MemoryError):
        patterned_buffer(3 * MiB, 2)  # fits the pool, not beside `held`: fails after cupy gave back
    (event,) = wp.oom_events()
    assert event.released_by_library == {"cupy": MiB}
    assert event.to_dict()["released_by_library"] == {"cupy": MiB}
    del held


def test_a_request_that_never_fits_claims_nothing_freed_for_it():
    # A cache gave back for an allocation that then succeeded (no failure recorded); the next
    # failure, a request above the pool's maximum, asks no cache: its record must not carry
    # the earlier release over.
    wp, top = pressure_stack(4 * MiB, spill_on_oom=False)
    _cache("torch", [MiB])
    big = patterned_buffer(3 * MiB + MiB // 2, 1)  # fits only once torch's free block is back
    del big
    with pytest.raises(MemoryError):
        patterned_buffer(8 * MiB, 2)
    (event,) = wp.oom_events()
    assert event.released_by_library == {}


def test_the_pressure_adaptor_charges_each_running_task_its_own_bytes():
    local = threading.local()
    wp, top = pressure_stack(8 * MiB, task_key=lambda: getattr(local, "key", None))
    account = wp.task_accounts["t-1"] = [0, 0]
    local.key = "t-1"
    a = top.allocate(MiB)
    b = top.allocate(2 * MiB)
    top.deallocate(b, 2 * MiB)
    assert account == [MiB, 3 * MiB]
    local.key = "other-1"  # not watched: not charged
    c = top.allocate(MiB)
    assert account == [MiB, 3 * MiB]
    freeing = threading.Thread(target=top.deallocate, args=(a, MiB))  # a free on another thread
    freeing.start()
    freeing.join()
    assert account == [0, 3 * MiB]
    top.deallocate(c, MiB)


@pytest.mark.parametrize(
    "error, nbytes",
    [
        (OutOfMemoryError("pool out of memory", requested=3 * MiB), 3 * MiB),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has"), 2 << 30),
        (RuntimeError("out of memory: tried to allocate 4096 bytes"), 4096),
        (MemoryError(), 0),
    ],
    ids=["dask-rmm", "torch", "bytes", "unknown"],
)
def test_the_requested_bytes_are_read_from_the_error(error, nbytes):
    assert arbitration.requested_bytes(error) == nbytes


def test_arrays_a_spill_frees_into_a_cache_are_given_back_too():
    wp, top = pressure_stack(8 * MiB, spill_on_oom=True)
    cache = _cache("cupy", [])
    with cached_array_type(cache) as CachedArray:
        wp.store["x"] = CachedArray(2 * MiB)
        caches.set_oom_handler(0, wp.devices[0].spill_for_cache)
        room = arbitration.make_room(0, 2 * MiB, library="torch")
        assert room.spilled == 2 * MiB and room.released == {"cupy": 2 * MiB}
        assert cache.cached_bytes(0) == 0


def _error(name: str, module: str, *bases: type) -> BaseException:
    return type(name, bases or (Exception,), {"__module__": module})("CUDA out of memory")


_TORCHS = _error("OutOfMemoryError", "torch", RuntimeError)


@pytest.mark.parametrize(
    "error, again",
    [
        (_TORCHS, True),  # PyTorch's own caching allocator: nothing retried it in place
        # PyTorch through rmm_torch_allocator: the stack made room and retried already
        (_error("TorchAllocationError", "dask_rmm.allocators.torch", type(_TORCHS), MemoryError), False),
        (OutOfMemoryError("pool out of memory"), False),
        (_error("OutOfMemoryError", "cupy.cuda.memory", MemoryError), False),
        (MemoryError("std::bad_alloc: out_of_memory: CUDA error"), False),
        (MemoryError("Unable to allocate 8.00 GiB for an array"), False),
    ],
    ids=["torch", "torch-through-the-stack", "dask-rmm", "cupy", "rmm", "host"],
)  # fmt: skip
def test_only_pytorchs_own_out_of_memory_runs_a_task_again(error, again):
    assert arbitration.runs_again(error) is again


class _BesideTheStack:
    """PyTorch's cache as the pool's budget sharer: its room grows when the pool gives back."""

    name = "torch"
    outside_stack = True

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def cached_bytes(self, device: int) -> int:
        return 0

    def release(self, device: int) -> int:
        return 0

    def make_room(self, device: int, nbytes: int) -> int:
        self.asked.append((device, nbytes))
        return 3 * MiB


def test_room_for_pytorch_includes_the_pools_free_chunks_given_back():
    pressure_stack(8 * MiB, spill_on_oom=True)
    torch_like = _BesideTheStack()
    caches.register_cache(torch_like)
    room = arbitration.make_room(0, 2 * MiB, library="torch")
    assert torch_like.asked == [(0, 2 * MiB)] and room.released == {"pool": 3 * MiB}
    assert arbitration.make_room(0, MiB, library="cupy").released == {}  # not for others
    assert torch_like.asked == [(0, 2 * MiB)]


def test_without_a_pool_it_shares_pytorchs_room_comes_from_the_devices_pools_trimmed():
    """The async resource, or a pool PyTorch shares no maximum with: after the pool grew and
    its arrays were freed, PyTorch's out-of-memory has the pool give that memory back to the
    device, where PyTorch allocates (its own allocator is not touched on this path)."""
    import dask_rmm
    from dask_rmm.allocators.torch import TorchCache

    dask_rmm.reinitialize(pool_allocator=True, initial_pool_size="1MiB", base_resource="system")
    buf = dask_rmm.DeviceBuffer(size=8 * MiB)  # the pool grows
    del buf
    cache = TorchCache.__new__(TorchCache)  # no torch here; no budget shared with a pool
    cache._budgets, cache._totals = {}, {}
    assert cache.make_room(0, 4 * MiB) >= 8 * MiB
    assert dask_rmm.mr.get_current_device_resource().reserved_memory_info().reserved_bytes <= MiB
