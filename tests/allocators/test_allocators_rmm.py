"""The "rmm" allocator: RMM's CallbackMemoryResource forwarding into dask-rmm's resources.

Without the compiled ``rmm`` (this CI host): the registry entry, the error that names what to
install, and that nothing is half-done. The forwarding logic (stream wrapping, which resource a
free goes to, install/reset bookkeeping, errors, never raising from a free) also runs here
against a stand-in for ``rmm.mr`` that calls the callbacks the way RMM's Cython wrapper does,
over host memory presented as device memory. The GPU tests further down use the real ``rmm``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import sys
import threading
from collections import defaultdict

import pytest
from conftest import local_process_cluster, wait_until

from dask_rmm.allocators import (
    _HOOKS,
    SUPPORTED_ALLOCATORS,
    check_allocators,
    reset_allocators,
    rmm_interop,
    set_allocators,
)
from dask_rmm.mr import (
    PoolMemoryResource,
    StatisticsResourceAdaptor,
    SystemMemoryResource,
    set_per_device_resource,
)
from dask_rmm.mr.base import OutOfMemoryError, UpstreamResourceAdaptor

MiB = 1 << 20


# -- the registry entry and a missing rmm (what CI sees) ----------------------------------------


def test_rmm_is_a_registered_allocator():
    assert "rmm" in SUPPORTED_ALLOCATORS
    module, setter, resetter, requirement = _HOOKS["rmm"]
    assert f"dask_rmm.allocators.{module}" == rmm_interop.__name__
    assert getattr(rmm_interop, setter) is rmm_interop.set_rmm_callback_resource
    assert getattr(rmm_interop, resetter) is rmm_interop.reset_rmm_callback_resource
    assert requirement == rmm_interop.RMM_REQUIREMENT == "rmm-cu13"


needs_no_rmm = pytest.mark.skipif(
    rmm_interop._rmm is not None, reason="the compiled rmm is installed on this host"
)


@needs_no_rmm
def test_missing_rmm_names_the_package_and_changes_nothing():
    cupy = pytest.importorskip("cupy")
    before = cupy.cuda.get_allocator()
    with pytest.raises(ImportError, match=r"'rmm' allocator.*install rmm-cu13") as info:
        set_allocators(["cupy", "rmm"])
    assert info.value.__cause__ is rmm_interop._library_import_error
    assert cupy.cuda.get_allocator() is before  # the CuPy hook was not set
    reset_allocators(["rmm"])  # nothing was set: a no-op, no error


@needs_no_rmm
def test_check_allocators_refuses_a_missing_library_and_sets_nothing():
    # what the worker plugin calls while it builds a setup, before it installs anything
    cupy = pytest.importorskip("cupy")
    before = cupy.cuda.get_allocator()
    with pytest.raises(ImportError, match=r"'rmm' allocator.*install rmm-cu13"):
        check_allocators("cupy,rmm")
    assert cupy.cuda.get_allocator() is before
    assert check_allocators(["CuPy", "cupy"]) == ["cupy"]
    assert cupy.cuda.get_allocator() is before  # checking never sets


@needs_no_rmm
def test_missing_rmm_direct_call_is_a_clear_error():
    with pytest.raises(ImportError, match=r"set_rmm_callback_resource\(\).*rmm-cu13"):
        rmm_interop.set_rmm_callback_resource(cache=False)
    rmm_interop.reset_rmm_callback_resource()
    assert rmm_interop.get_rmm_forwarder(0) is None
    assert rmm_interop._installed == {}


# -- a stand-in for the compiled rmm -------------------------------------------------------------


class _StandInStream:
    """What RMM's callbacks get: a stream object with ``__cuda_stream__``."""

    def __init__(self, handle: int):
        self._handle = handle

    def __cuda_stream__(self):
        return (0, self._handle)


class _StandInCudaMemoryResource:
    pass


class _StandInCallbackMemoryResource:
    """Calls the callbacks as RMM's Cython wrapper does: a MemoryError becomes
    ``rmm::out_of_memory`` (MemoryError again in Python), anything else ``std::runtime_error``
    (RuntimeError); a deallocate callback's exception would be lost in C++, so it fails here.

    ``with_alignment``: the calling convention of RMM after 26.10, ``(stream, nbytes,
    alignment)`` and ``(stream, ptr, nbytes, alignment)``, instead of ``(nbytes, stream)`` and
    ``(ptr, nbytes, stream)``."""

    with_alignment = False

    def __init__(self, allocate_func, deallocate_func):
        self._allocate_func = allocate_func
        self._deallocate_func = deallocate_func

    def allocate(self, nbytes: int, stream: int = 0, alignment: int = 256) -> int:
        try:
            if self.with_alignment:
                return int(self._allocate_func(_StandInStream(stream), nbytes, alignment))
            return int(self._allocate_func(nbytes, _StandInStream(stream)))
        except MemoryError as e:
            raise MemoryError(str(e)) from None
        except BaseException as e:
            raise RuntimeError(str(e)) from None

    def deallocate(self, ptr: int, nbytes: int, stream: int = 0) -> None:
        if self.with_alignment:
            result = self._deallocate_func(_StandInStream(stream), ptr, nbytes, 256)
        else:
            result = self._deallocate_func(ptr, nbytes, _StandInStream(stream))
        assert result is None


class _StandInMR:
    CallbackMemoryResource = _StandInCallbackMemoryResource

    def __init__(self):
        self.per_device = defaultdict(_StandInCudaMemoryResource)
        self.fail_set = False

    def get_per_device_resource(self, device: int):
        return self.per_device[device]

    def set_per_device_resource(self, device: int, mr) -> None:
        if self.fail_set:
            raise RuntimeError("stand-in: set_per_device_resource failed")
        self.per_device[device] = mr


class _StandInRMM:
    def __init__(self):
        self.mr = _StandInMR()


@pytest.fixture(params=["(nbytes, stream)", "(stream, nbytes, alignment)"])
def fake_rmm(monkeypatch, request):
    monkeypatch.setattr(
        _StandInCallbackMemoryResource, "with_alignment", "alignment" in request.param
    )
    rmm = _StandInRMM()
    monkeypatch.setattr(rmm_interop, "_rmm", rmm)
    monkeypatch.setattr(rmm_interop, "_library_import_error", None)
    monkeypatch.setattr(rmm_interop, "_installed", {})
    monkeypatch.setattr(rmm_interop, "_retired", [])
    return rmm


class _Recording(UpstreamResourceAdaptor):
    """Forwards, recording (call, stream handle) of every call."""

    def __init__(self, upstream):
        super().__init__(upstream)
        self.streams: list[tuple[str, int]] = []

    def allocate(self, nbytes, stream):
        self.streams.append(("allocate", stream.handle))
        return self.upstream_mr.allocate(nbytes, stream)

    def deallocate(self, ptr, nbytes, stream):
        self.streams.append(("deallocate", stream.handle))
        self.upstream_mr.deallocate(ptr, nbytes, stream)


class _AsDeviceMemory(_Recording):
    """Host memory presented as device memory (the stand-in's C++ never touches it), recording
    the stream of every call."""

    @property
    def is_host_memory(self) -> bool:
        return False


def _stack(pool_size: int = 4 * MiB, maximum: int | None = None):
    """(top set on device 0, its statistics adaptor)."""
    stats = StatisticsResourceAdaptor(
        PoolMemoryResource(
            SystemMemoryResource(), initial_pool_size=pool_size, maximum_pool_size=maximum
        )
    )
    top = _AsDeviceMemory(stats)
    set_per_device_resource(0, top)
    return top, stats


def _current(fake_rmm):
    return fake_rmm.mr.get_per_device_resource(0)


# -- forwarding ----------------------------------------------------------------------------------


def test_allocations_land_in_the_dask_rmm_resource_and_come_back(fake_rmm, make_streams):
    (stream,) = make_streams(1)
    top, stats = _stack()
    previous = _current(fake_rmm)
    assert set_allocators(["rmm"], exact=True) == ["rmm"]
    cb = _current(fake_rmm)
    assert isinstance(cb, _StandInCallbackMemoryResource) and cb is not previous
    forwarder = rmm_interop.get_rmm_forwarder(0)
    assert forwarder is not None and forwarder.device == 0

    ptr = cb.allocate(1000, stream.handle)
    assert ptr % 256 == 0
    ctypes.memset(ptr, 0xCD, 1000)  # real memory from the pool
    counts = stats.allocation_counts
    assert (counts.current_bytes, counts.current_count) == (1000, 1)
    assert forwarder.live == {ptr: top}

    cb.deallocate(ptr, 1000, stream.handle)
    assert stats.allocation_counts.current_bytes == 0 and forwarder.live == {}
    assert top.streams == [("allocate", stream.handle), ("deallocate", stream.handle)]

    assert cb.allocate(0, 0) == 0  # nothing asked for: no call into the stack
    cb.deallocate(0, 0, 0)
    assert stats.allocation_counts.total_count == 1 and forwarder.failed_deallocations == 0

    reset_allocators(["rmm"])
    assert _current(fake_rmm) is previous
    assert rmm_interop.get_rmm_forwarder(0) is None


def test_streams_are_wrapped_by_handle_without_owning_them(fake_rmm, make_streams):
    (stream,) = make_streams(1)
    handles = (0, 2, stream.handle)
    top, _ = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    ptrs = [cb.allocate(256, handle) for handle in handles]
    for ptr, handle in zip(ptrs, handles, strict=True):
        cb.deallocate(ptr, 256, handle)
    assert [h for _, h in top.streams] == [*handles, *handles]
    wrapped = rmm_interop.handle_streams[stream.handle]
    assert wrapped.handle == stream.handle and not wrapped._owned
    # A plain int (not RMM's Stream object) is accepted as a handle too.
    forwarder = rmm_interop.get_rmm_forwarder(0)
    ptr = forwarder.allocate(256, stream.handle)
    forwarder.deallocate(ptr, 256, stream.handle)
    assert top.streams[-1] == ("deallocate", stream.handle)


def test_each_free_goes_to_the_resource_that_allocated(fake_rmm):
    first, first_stats = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    a = cb.allocate(MiB, 0)
    second, second_stats = _stack()  # the registry changes (e.g. a re-registered plugin)
    b = cb.allocate(2 * MiB, 0)  # looked up at every allocation
    assert first_stats.allocation_counts.current_bytes == MiB
    assert second_stats.allocation_counts.current_bytes == 2 * MiB
    cb.deallocate(a, MiB, 0)
    cb.deallocate(b, 2 * MiB, 0)
    assert first_stats.allocation_counts.current_bytes == 0
    assert second_stats.allocation_counts.current_bytes == 0
    assert rmm_interop.get_rmm_forwarder(0).failed_deallocations == 0


def test_setting_again_is_idempotent_and_reset_restores_the_original(fake_rmm):
    _stack()
    original = _current(fake_rmm)
    assert rmm_interop.set_rmm_callback_resource(cache=False) == [0]
    cb = _current(fake_rmm)
    assert rmm_interop.set_rmm_callback_resource(cache=False) == [0]
    assert _current(fake_rmm) is cb  # no second callback resource
    rmm_interop.reset_rmm_callback_resource()
    assert _current(fake_rmm) is original
    rmm_interop.reset_rmm_callback_resource()  # twice: nothing left to do
    assert _current(fake_rmm) is original


def test_a_resource_someone_else_set_is_respected(fake_rmm):
    _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    theirs = _StandInCudaMemoryResource()
    fake_rmm.mr.set_per_device_resource(0, theirs)  # e.g. rmm.reinitialize() after ours
    rmm_interop.reset_rmm_callback_resource()
    assert _current(fake_rmm) is theirs  # not clobbered with the resource from before ours

    rmm_interop.set_rmm_callback_resource(cache=False)  # ours again, on top of theirs
    assert isinstance(_current(fake_rmm), _StandInCallbackMemoryResource)
    rmm_interop.reset_rmm_callback_resource()
    assert _current(fake_rmm) is theirs


def test_buffers_outlive_reset_and_free_to_their_resource(fake_rmm):
    _, stats = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    ptr = cb.allocate(3000, 0)
    rmm_interop.reset_rmm_callback_resource()
    # RMM's C++ buffers keep raw pointers to the callbacks: the resource is kept alive.
    assert any(i.callback_resource is cb for i in rmm_interop._retired)
    cb.deallocate(ptr, 3000, 0)
    assert stats.allocation_counts.current_bytes == 0


def test_a_retired_forwarder_does_not_keep_a_stack_alive(fake_rmm):
    import gc
    import weakref

    top, _ = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    cb.deallocate(cb.allocate(4096, 0), 4096, 0)
    rmm_interop.reset_rmm_callback_resource()
    gone = weakref.ref(top)
    set_per_device_resource(0, None)
    del top
    gc.collect()
    assert gone() is None  # the pool (GPU memory on a worker) is released


def test_host_memory_is_refused_and_nothing_changes(fake_rmm):
    set_per_device_resource(0, PoolMemoryResource(SystemMemoryResource(), initial_pool_size=MiB))
    before = _current(fake_rmm)
    with pytest.raises(ValueError, match=r"device 0 .*host memory"):
        rmm_interop.set_rmm_callback_resource(cache=False)
    assert _current(fake_rmm) is before and rmm_interop._installed == {}


def test_a_registry_swapped_to_host_memory_fails_the_allocation_not_the_process(fake_rmm):
    _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    set_per_device_resource(0, SystemMemoryResource())
    with pytest.raises(RuntimeError, match="host memory"):  # std::runtime_error in C++
        cb.allocate(256, 0)


def test_a_failing_install_changes_nothing(fake_rmm):
    _stack()
    before = _current(fake_rmm)
    fake_rmm.mr.fail_set = True
    with pytest.raises(RuntimeError, match="stand-in"):
        rmm_interop.set_rmm_callback_resource(cache=False)
    fake_rmm.mr.fail_set = False
    assert _current(fake_rmm) is before and rmm_interop._installed == {}


def test_an_unknown_device_fails_before_anything_changes(fake_rmm):
    _stack()
    before = _current(fake_rmm)
    with pytest.raises(ValueError, match="device 7 does not exist"):
        rmm_interop.set_rmm_callback_resource([0, 7], cache=False)
    assert _current(fake_rmm) is before and rmm_interop._installed == {}


# -- errors ---------------------------------------------------------------------------------------


def test_pool_out_of_memory_is_a_memory_error_with_the_pools_numbers(fake_rmm):
    _, stats = _stack(pool_size=MiB, maximum=MiB)
    rmm_interop.set_rmm_callback_resource(cache=False)
    forwarder = rmm_interop.get_rmm_forwarder(0)
    with pytest.raises(OutOfMemoryError, match="requested"):  # a MemoryError: rmm::out_of_memory
        forwarder.allocate(2 * MiB, _StandInStream(0))
    with pytest.raises(MemoryError):  # as it reaches Python again through RMM
        _current(fake_rmm).allocate(2 * MiB, 0)
    assert forwarder.live == {} and stats.allocation_counts.current_bytes == 0


def test_other_allocation_errors_name_the_resource_and_the_cause(fake_rmm):
    class Broken(_AsDeviceMemory):
        def allocate(self, nbytes, stream):
            raise ValueError("broken on purpose")

    set_per_device_resource(0, Broken(SystemMemoryResource()))
    rmm_interop.set_rmm_callback_resource(cache=False)
    with pytest.raises(RuntimeError) as info:  # std::runtime_error in C++: only the message
        _current(fake_rmm).allocate(512, 0)
    assert str(info.value) == (
        "dask-rmm's Broken on device 0 could not allocate 512 bytes for RMM: "
        "ValueError: broken on purpose"
    )
    assert rmm_interop.get_rmm_forwarder(0).live == {}


def test_alignments_above_256_bytes_are_refused(fake_rmm, monkeypatch):
    monkeypatch.setattr(_StandInCallbackMemoryResource, "with_alignment", True)
    _, stats = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    for alignment in (1, 64, 256):
        ptr = cb.allocate(1000, 0, alignment)
        assert ptr % 256 == 0
        cb.deallocate(ptr, 1000, 0)
    with pytest.raises(
        RuntimeError, match="aligned to 512: dask-rmm's allocations are aligned to 256"
    ):
        cb.allocate(1000, 0, 512)
    assert stats.allocation_counts.current_bytes == 0


def test_deallocate_never_raises(fake_rmm, caplog):
    _, stats = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    forwarder = rmm_interop.get_rmm_forwarder(0)
    cb = _current(fake_rmm)
    ptr = cb.allocate(1024, 0)
    with caplog.at_level(logging.ERROR, logger=rmm_interop.__name__):
        forwarder.deallocate(ptr, 512, _StandInStream(0))  # wrong size: the pool refuses
        forwarder.deallocate(0xDEAD00, 256, _StandInStream(0))  # never handed out
    assert forwarder.failed_deallocations == 2
    assert "0xdead00" in caplog.text and "never handed out" in caplog.text
    assert stats.allocation_counts.current_bytes == 1024  # the pool kept the block: nothing lost


def test_deallocate_at_interpreter_shutdown_is_a_no_op(fake_rmm):
    _, stats = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    forwarder = rmm_interop.get_rmm_forwarder(0)
    ptr = forwarder.allocate(1024, _StandInStream(0))
    forwarder.deallocate(ptr, 1024, _StandInStream(0), _finalizing=lambda: True)
    assert forwarder.failed_deallocations == 0 and ptr in forwarder.live
    assert stats.allocation_counts.current_bytes == 1024


def test_many_threads_allocate_and_free_through_the_callbacks(fake_rmm, make_streams):
    handles = [s.handle for s in make_streams(8)]
    _, stats = _stack(pool_size=16 * MiB)
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    errors: list[BaseException] = []

    def churn(handle: int) -> None:
        try:
            held = []
            for i in range(300):
                n = 256 * (1 + i % 16)
                held.append((cb.allocate(n, handle), n))
                if len(held) > 8:
                    ptr, n = held.pop(0)
                    cb.deallocate(ptr, n, handle)
            for ptr, n in held:
                cb.deallocate(ptr, n, handle)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
    assert errors == []
    assert stats.allocation_counts.current_bytes == 0
    assert stats.allocation_counts.total_count == 8 * 300
    assert rmm_interop.get_rmm_forwarder(0).live == {}


def _churn_with_cyclic_buffers(make_buffer, allocate_and_free, steps: int = 1500) -> None:
    """Allocate and free while buffers held only by reference cycles die in the garbage
    collector, which then runs as often as it can: a collection that starts while the pool holds
    its lock frees an RMM buffer through the callbacks, which need that lock again. Runs in a
    thread; fails (instead of hanging) if that thread is stuck."""
    import gc

    errors: list[BaseException] = []

    def run():
        try:
            for _ in range(steps):
                cycle: list = [make_buffer()]
                cycle.append(cycle)
                del cycle
                allocate_and_free()
        except BaseException as e:  # reported below
            errors.append(e)

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=120)
    finally:
        gc.set_threshold(*threshold)
    assert not thread.is_alive(), "stuck: a garbage collection inside the pool's lock?"
    assert errors == []
    gc.collect()


class _StandInBuffer:
    """An RMM buffer as the stand-in's C++ would hold it: frees through the resource on death."""

    def __init__(self, resource, nbytes: int):
        self.resource, self.nbytes = resource, nbytes
        self.ptr = resource.allocate(nbytes, 0)

    def __del__(self):
        self.resource.deallocate(self.ptr, self.nbytes, 0)


def test_buffers_freed_by_the_garbage_collector_do_not_deadlock(fake_rmm):
    from dask_rmm.stream import DEFAULT_STREAM

    top, stats = _stack(pool_size=16 * MiB)
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)

    def allocate_and_free():
        top.deallocate(top.allocate(4096, DEFAULT_STREAM), 4096, DEFAULT_STREAM)
        cb.deallocate(cb.allocate(512, 0), 512, 0)

    _churn_with_cyclic_buffers(lambda: _StandInBuffer(cb, 2048), allocate_and_free)
    wait_until(
        lambda: stats.allocation_counts.current_bytes == 0, timeout=30.0, what="the deferred frees"
    )
    assert stats.allocation_counts.total_count == 3 * 1500
    assert rmm_interop.get_rmm_forwarder(0).failed_deallocations == 0


def test_frees_during_a_collection_are_deferred_to_another_thread(fake_rmm):
    _, stats = _stack()
    rmm_interop.set_rmm_callback_resource(cache=False)
    cb = _current(fake_rmm)
    ptr = cb.allocate(4096, 0)
    freed_by: list[str] = []
    original = rmm_interop.RMMForwarder._free_deferred

    def spy(self, *args):
        freed_by.append(threading.current_thread().name)
        original(self, *args)

    rmm_interop.RMMForwarder._free_deferred = spy
    try:
        rmm_interop._note_collection("start", {})  # as the collector's callback does
        try:
            cb.deallocate(ptr, 4096, 0)
        finally:
            rmm_interop._note_collection("stop", {})
        wait_until(lambda: freed_by, timeout=30.0, what="the deferred free")
    finally:
        rmm_interop.RMMForwarder._free_deferred = original
    assert freed_by == ["dask-rmm deferred RMM frees"]
    wait_until(
        lambda: stats.allocation_counts.current_bytes == 0, timeout=30.0, what="the free to land"
    )
    assert rmm_interop._note_collection in gc.callbacks


# -- GPU: the compiled rmm ----------------------------------------------------------------------
#
# Each test gets a 64 MiB dask-rmm pool (maximum 64 MiB) on device 0 under a statistics adaptor
# and a recording adaptor, and RMM's previous resource back afterwards.

_RMM_STREAMS: list = []  # RMM streams a pool may still order on: kept for the whole session


@pytest.fixture
def real_rmm():
    rmm = rmm_interop._rmm
    if rmm is None:
        pytest.skip(
            f"needs the compiled rmm ({rmm_interop.RMM_REQUIREMENT}): "
            f"{rmm_interop._library_import_error}"
        )
    before = rmm.mr.get_per_device_resource(0)
    yield rmm
    rmm_interop.reset_rmm_callback_resource()
    rmm.mr.set_per_device_resource(0, before)


@pytest.fixture
def gpu_stack(real_rmm):
    """(recording top, statistics, pool) set on device 0; RMM forwarding to it."""
    from dask_rmm.mr import CudaMemoryResource

    pool = PoolMemoryResource(
        CudaMemoryResource(), initial_pool_size=64 * MiB, maximum_pool_size=64 * MiB
    )
    stats = StatisticsResourceAdaptor(pool)
    top = _Recording(stats)
    set_per_device_resource(0, top)
    assert set_allocators("rmm", exact=True) == ["rmm"]
    return top, stats, pool


@pytest.mark.gpu
def test_gpu_device_buffers_land_in_the_pool(real_rmm, gpu_stack):
    top, stats, pool = gpu_stack
    assert isinstance(real_rmm.mr.get_current_device_resource(), real_rmm.mr.CallbackMemoryResource)
    data = bytes(range(256)) * 4096  # 1 MiB
    buf = real_rmm.DeviceBuffer.to_device(data)
    counts = stats.allocation_counts
    assert (counts.current_bytes, counts.current_count) == (MiB, 1)
    assert pool.reserved_memory_info().reserved_bytes == 64 * MiB  # from the pool, not cudaMalloc
    assert buf.ptr in rmm_interop.get_rmm_forwarder(0).live
    assert buf.tobytes() == data

    small = [real_rmm.DeviceBuffer(size=n) for n in (1, 255, 4097)]
    assert stats.allocation_counts.current_bytes == MiB + 1 + 255 + 4097
    del buf, small
    counts = stats.allocation_counts
    assert (counts.current_bytes, counts.total_count) == (0, 4)
    assert rmm_interop.get_rmm_forwarder(0).failed_deallocations == 0


@pytest.mark.gpu
def test_gpu_rmm_cupy_allocator_lands_in_the_pool(real_rmm, gpu_stack):
    cupy = pytest.importorskip("cupy")
    from rmm.allocators.cupy import rmm_cupy_allocator

    top, stats, _ = gpu_stack
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        n = MiB // 8
        a = cupy.arange(n, dtype=cupy.float64)
        assert stats.allocation_counts.current_bytes == MiB
        cupy.cuda.Device().synchronize()  # a non-blocking stream does not wait for the default one
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            b = a * 2
            total = float(b.sum())
        assert total == n * (n - 1)
        assert ("allocate", stream.ptr) in top.streams
        del a, b
        assert stats.allocation_counts.current_bytes == 0
    finally:
        cupy.cuda.set_allocator(previous)


@pytest.mark.gpu
def test_gpu_cupy_and_rmm_together_then_reset(real_rmm):
    cupy = pytest.importorskip("cupy")
    from dask_rmm.allocators.cupy import lean_cupy_allocator as our_cupy_allocator

    before_cupy = cupy.cuda.get_allocator()
    before_rmm = real_rmm.mr.get_per_device_resource(0)
    assert set_allocators("cupy,rmm", exact=True) == ["cupy", "rmm"]
    try:
        assert cupy.cuda.get_allocator() is our_cupy_allocator
        assert isinstance(
            real_rmm.mr.get_per_device_resource(0), real_rmm.mr.CallbackMemoryResource
        )
    finally:
        reset_allocators(["cupy", "rmm"])
    assert cupy.cuda.get_allocator() is before_cupy
    assert real_rmm.mr.get_per_device_resource(0) is before_rmm


@pytest.mark.gpu
def test_gpu_a_second_stream_is_passed_through(real_rmm, gpu_stack):
    from rmm.pylibrmm.stream import Stream as RMMStream

    top, stats, _ = gpu_stack
    stream = RMMStream()
    _RMM_STREAMS.append(stream)
    handle = stream.__cuda_stream__()[1]
    assert handle > 2  # not a default stream
    buf = real_rmm.DeviceBuffer(size=8192, stream=stream)
    buf.copy_from_host(b"\x07" * 8192, stream=stream)
    stream.synchronize()
    del buf
    assert top.streams == [("allocate", handle), ("deallocate", handle)]
    assert rmm_interop.handle_streams[handle]._owned is False  # wrapped, never destroyed by us
    stream.synchronize()  # still a valid stream
    assert stats.allocation_counts.current_bytes == 0


@pytest.mark.gpu
def test_gpu_reset_restores_rmms_resource_and_keeps_live_buffers(real_rmm, gpu_stack):
    top, stats, _ = gpu_stack
    rmm_interop.reset_rmm_callback_resource()
    original = real_rmm.mr.get_per_device_resource(0)
    assert not isinstance(original, real_rmm.mr.CallbackMemoryResource)
    set_allocators(["rmm"], exact=True)
    buf = real_rmm.DeviceBuffer(size=MiB)
    reset_allocators(["rmm"])
    assert real_rmm.mr.get_per_device_resource(0) is original
    other = real_rmm.DeviceBuffer(size=MiB)  # RMM's own resource again: not ours
    assert stats.allocation_counts.current_bytes == MiB
    # The buffer made through the callbacks still grows through them (its C++ side keeps the
    # resource), and frees go back to the dask-rmm pool.
    buf.resize(2 * MiB)
    assert stats.allocation_counts.current_bytes == 2 * MiB
    del buf, other
    assert stats.allocation_counts.current_bytes == 0
    assert all(i.forwarder.failed_deallocations == 0 for i in rmm_interop._retired)


@pytest.mark.gpu
def test_gpu_pool_out_of_memory_is_rmms_out_of_memory(real_rmm, gpu_stack):
    top, stats, _ = gpu_stack
    with pytest.raises(MemoryError, match="PoolMemoryResource out of memory: requested 128"):
        real_rmm.DeviceBuffer(size=128 * MiB)
    assert stats.allocation_counts.current_bytes == 0

    # RMM's FailureCallbackResourceAdaptor catches only rmm::out_of_memory (what cuDF's
    # spilling relies on): its callback running proves the C++ exception type; freeing memory
    # there and retrying succeeds.
    held = [real_rmm.DeviceBuffer(size=48 * MiB)]
    calls: list[int] = []

    def on_out_of_memory(nbytes: int) -> bool:
        calls.append(nbytes)
        if held:
            held.clear()  # "spill": frees through the callbacks, from inside RMM's C++ call
            return True
        return False

    adaptor = real_rmm.mr.FailureCallbackResourceAdaptor(
        real_rmm.mr.get_current_device_resource(), on_out_of_memory
    )
    buf = real_rmm.DeviceBuffer(size=32 * MiB, mr=adaptor)
    assert calls == [32 * MiB] and stats.allocation_counts.current_bytes == 32 * MiB
    with pytest.raises(MemoryError):
        real_rmm.DeviceBuffer(size=128 * MiB, mr=adaptor)
    assert calls == [32 * MiB, 128 * MiB]
    del buf

    class Broken(UpstreamResourceAdaptor):
        def allocate(self, nbytes, stream):
            raise ValueError("broken on purpose")

    set_per_device_resource(0, Broken(top))
    with pytest.raises(
        RuntimeError, match="could not allocate 256 bytes for RMM: ValueError: broken"
    ):
        real_rmm.DeviceBuffer(size=256, mr=adaptor)
    assert calls == [32 * MiB, 128 * MiB]  # not an out_of_memory: no spill callback
    assert stats.allocation_counts.current_bytes == 0


def _run_in_native_thread(fn) -> list:
    """Run ``fn`` on a thread made by pthread_create (no Python thread state until ctypes makes
    one), as a C++ library's worker thread would; returns ``[None]`` or ``[exception]``."""
    libc = ctypes.CDLL(None)
    start_routine = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    result: list = []

    def body(_arg):
        try:
            fn()
        except BaseException as e:  # reported to the caller
            result.append(e)
        else:
            result.append(None)
        return None

    routine = start_routine(body)
    thread = ctypes.c_ulong()
    libc.pthread_create.argtypes = [
        ctypes.POINTER(ctypes.c_ulong),
        ctypes.c_void_p,
        start_routine,
        ctypes.c_void_p,
    ]
    assert libc.pthread_create(ctypes.byref(thread), None, routine, None) == 0
    assert libc.pthread_join(thread, None) == 0  # CDLL calls release the GIL
    return result


@pytest.mark.gpu
def test_gpu_threads_and_native_threads_share_the_pool_without_deadlock(real_rmm, gpu_stack):
    from dask_rmm import DeviceBuffer

    _, stats, _ = gpu_stack
    errors: list[BaseException] = []

    def through_rmm():
        for i in range(200):
            b = real_rmm.DeviceBuffer(size=4096 * (1 + i % 8))
            del b

    def direct():  # dask-rmm's own DeviceBuffer on the same pool, no RMM in between
        for i in range(200):
            b = DeviceBuffer(size=4096 * (1 + i % 8))
            del b

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported below
                errors.append(e)

        return run

    threads = [threading.Thread(target=guarded(f)) for f in [through_rmm, direct] * 4]
    for t in threads:
        t.start()
    assert _run_in_native_thread(through_rmm) == [None]
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (deadlock?)"
    assert errors == []
    counts = stats.allocation_counts
    assert counts.current_bytes == 0 and counts.total_count == 9 * 200


@pytest.mark.gpu
def test_gpu_rmm_buffers_in_reference_cycles_do_not_deadlock_the_pool(real_rmm, gpu_stack):
    from dask_rmm import DeviceBuffer

    _, stats, _ = gpu_stack

    def allocate_and_free():
        b = DeviceBuffer(size=4096)  # straight into the pool: its lock, no RMM
        del b
        r = real_rmm.DeviceBuffer(size=512)  # through the callbacks
        del r

    _churn_with_cyclic_buffers(lambda: real_rmm.DeviceBuffer(size=2048), allocate_and_free, 500)
    wait_until(
        lambda: stats.allocation_counts.current_bytes == 0, timeout=30.0, what="the deferred frees"
    )
    assert stats.allocation_counts.total_count == 3 * 500
    assert rmm_interop.get_rmm_forwarder(0).failed_deallocations == 0


_SHUTDOWN_SCRIPT = """
import sys
import cupy, rmm
from rmm.allocators.cupy import rmm_cupy_allocator
from dask_rmm.allocators import set_allocators
from dask_rmm.mr import CudaMemoryResource, PoolMemoryResource, StatisticsResourceAdaptor
from dask_rmm.mr import set_per_device_resource

set_per_device_resource(
    0, StatisticsResourceAdaptor(PoolMemoryResource(CudaMemoryResource(), initial_pool_size=1 << 24))
)
set_allocators(["rmm"], exact=True)
cupy.cuda.set_allocator(rmm_cupy_allocator)
KEEP = [rmm.DeviceBuffer(size=1 << 20) for _ in range(4)]
class Cycle:
    pass
c = Cycle(); c.me = c; c.buf = rmm.DeviceBuffer(size=4096); del c  # freed by the last GC
ARRAY = cupy.ones(1000)
# freed while dask-rmm's own modules are torn down
sys.modules["dask_rmm.allocators.rmm_interop"].__dict__["LATE"] = rmm.DeviceBuffer(size=256)
sys.modules["dask_rmm.mr.pool"].__dict__["LATER"] = rmm.DeviceBuffer(size=512)
print("allocated", flush=True)
"""


@pytest.mark.gpu
def test_gpu_interpreter_shutdown_with_live_rmm_buffers_is_quiet(real_rmm, tmp_path):
    import subprocess

    script = tmp_path / "shutdown.py"
    script.write_text(_SHUTDOWN_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert "allocated" in done.stdout
    for bad in ("Traceback", "Exception ignored", "could not free", "terminate called"):
        assert bad not in done.stderr, done.stderr[-3000:]


# -- GPU: a Dask workload ------------------------------------------------------------------------


def rmm_hold(nbytes: int):
    """A task that allocates through the compiled RMM and keeps the buffer (its result)."""
    import rmm

    return rmm.DeviceBuffer(size=nbytes)


def _worker_view(dask_worker=None) -> dict:
    import rmm

    installed = list(rmm_interop._installed.values()) + list(rmm_interop._retired)
    return {
        "rmm_resource": type(rmm.mr.get_current_device_resource()).__name__,
        "failed_deallocations": sum(i.forwarder.failed_deallocations for i in installed),
    }


def _plugin_with_rmm(allocators=("rmm",), **options):
    from dask_rmm.plugin import RMMPlugin

    # A refusal of allocators=["rmm"] is a failure: the option is documented (docs/rapids.md).
    # These tests check the per-allocation path (every RMM allocation through dask-rmm).
    return RMMPlugin(allocators=list(allocators), exact_allocators=True, **options)


def test_the_plugin_takes_allocators_rmm_on_any_host():
    # What the GPU workload tests below build their plugin with, checked where they skip.
    plugin = _plugin_with_rmm(allocators=["cupy", "rmm"], pool_size="64MiB")
    assert plugin.options.allocators == ("cupy", "rmm")
    assert plugin.options.exact_allocators == ("cupy", "rmm", "torch")  # True: every cache


def _check_dask_workload(client, log_directory=None) -> None:
    from distributed import wait

    import dask_rmm

    futures = client.map(rmm_hold, [MiB, 2 * MiB], key=["rmm_hold-1", "rmm_hold-2"])
    wait(futures)

    def report_with(total):
        report = dask_rmm.cluster_report(client, timeline=False)
        return report if report.totals.current_bytes == total else None

    report = wait_until(
        lambda: report_with(3 * MiB), timeout=30.0, what="3 MiB in the cluster report"
    )
    (device,) = report.running
    assert {g.prefix: g.current_bytes for g in device.task_groups} == {"rmm_hold": 3 * MiB}
    assert device.current_count == 2 and device.reserved_bytes == 64 * MiB
    (view,) = client.run(_worker_view).values()
    assert view["rmm_resource"] == "CallbackMemoryResource"

    del futures
    report = wait_until(
        lambda: report_with(0), timeout=30.0, what="the frees in the cluster report"
    )
    (device,) = report.running
    assert {g.prefix: g.peak_bytes for g in device.task_groups}["rmm_hold"] == 3 * MiB
    (view,) = client.run(_worker_view).values()
    assert view["failed_deallocations"] == 0

    if log_directory is not None:
        import csv
        import glob

        def logged_sizes():
            sizes = []
            for path in glob.glob(os.path.join(log_directory, "*.csv")):
                with open(path) as f:
                    sizes += [
                        int(r["Size"]) for r in csv.DictReader(f) if r["Action"] == "allocate"
                    ]
            return sorted(sizes) if len(sizes) >= 2 else None

        assert wait_until(logged_sizes, timeout=30.0, what="the allocation log") == [MiB, 2 * MiB]


@contextlib.contextmanager
def _one_worker_cluster():
    with local_process_cluster(n_workers=1, threads_per_worker=2) as (_, client):
        yield client


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_dask_workload_through_the_plugin_is_reported_per_task_group(real_rmm, tmp_path):
    plugin = _plugin_with_rmm(pool_size="64MiB", log_directory=str(tmp_path))
    with _one_worker_cluster() as client:
        client.register_plugin(plugin)
        _check_dask_workload(client, str(tmp_path))


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_dask_workload_with_set_allocators_on_the_worker(real_rmm):
    from dask_rmm.plugin import RMMPlugin

    with _one_worker_cluster() as client:
        client.register_plugin(RMMPlugin(pool_size="64MiB"))
        client.run(set_allocators, ["rmm"], exact=True)
        _check_dask_workload(client)


def _pretend_rmm_is_missing(dask_worker=None) -> None:
    rmm_interop._rmm = None
    rmm_interop._library_import_error = ImportError("No module named 'rmm' (simulated)")


def _worker_memory_setup(dask_worker=None) -> dict:
    """What a failed registration must leave as it was, in comparable form."""
    import cupy
    import rmm

    from dask_rmm.mr.registry import get_per_device_resource

    return {
        "dask-rmm resource": id(get_per_device_resource(0)),
        "cupy allocator": repr(cupy.cuda.get_allocator()),
        "rmm resource": id(rmm.mr.get_per_device_resource(0)),
        "forwarding": rmm_interop._installed.get(0) is not None,
    }


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_plugin_on_a_worker_without_rmm_fails_and_changes_nothing(real_rmm):
    pytest.importorskip("cupy")
    plugin = _plugin_with_rmm(allocators=["cupy", "rmm"], pool_size="64MiB")
    with _one_worker_cluster() as client:
        client.run(_pretend_rmm_is_missing)
        (before,) = client.run(_worker_memory_setup).values()
        with pytest.raises(Exception, match="rmm-cu13"):
            client.register_plugin(plugin)
        (after,) = client.run(_worker_memory_setup).values()
        assert after == before


def test_installing_rmms_pool_turns_cudfs_spill_on_demand_off(monkeypatch):
    # cuDF's spill on demand would refuse the pool's failure callback (ValueError at cuDF's first
    # buffer); the callback spills cuDF's buffers itself. Real cuDF on the GPU:
    # tests/pressure/test_cudf_spilling_gpu.py.
    monkeypatch.delitem(sys.modules, "cudf", raising=False)
    monkeypatch.setenv("CUDF_SPILL_ON_DEMAND", "on")
    rmm_interop._leave_cudf_spilling_to_the_pool()
    assert os.environ["CUDF_SPILL_ON_DEMAND"] == "off"  # read when cuDF is imported

    class ImportedCudf:
        options: dict = {}

        @classmethod
        def set_option(cls, key, value):
            cls.options[key] = value

    monkeypatch.setitem(sys.modules, "cudf", ImportedCudf)
    rmm_interop._leave_cudf_spilling_to_the_pool()
    assert ImportedCudf.options == {"spill_on_demand": False}
