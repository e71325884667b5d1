"""The async resources' fast paths on any host: cuda-python's calls are replaced by
a fake memory pool, so the bookkeeping and error handling around them are checked without a GPU
(the GPU suite runs the same resources on real memory)."""

from __future__ import annotations

import threading

import pytest
from cuda.bindings import runtime

from dask_rmm import _cuda
from dask_rmm.mr import CudaAsyncViewMemoryResource
from dask_rmm.stream import DEFAULT_STREAM, Stream

#: What cuda-python returns: cudaError_t members (named), by name.
_CODES = {e.name: e for e in runtime.cudaError_t}


class FakePool:
    """cuda-python's cudaMallocFromPoolAsync / cudaFreeAsync: ``(err, ptr)`` and ``(err,)``,
    handles given as cuda-python handle objects (recorded as ints)."""

    def __init__(self):
        self.live: dict[int, int] = {}
        self.next = 1 << 30
        self.fail: str | None = None
        self.fail_free = False
        self.calls: list[tuple] = []

    def malloc(self, nbytes, pool, stream):
        self.calls.append(("malloc", nbytes, int(pool), int(stream)))
        if self.fail:
            return (_CODES[self.fail], None)
        ptr = self.next
        self.next += (nbytes + 255) & -256
        self.live[ptr] = nbytes
        return (0, ptr)

    def free(self, ptr, stream):
        self.calls.append(("free", ptr, int(stream)))
        if self.fail_free:
            return (_CODES["cudaErrorInvalidValue"],)
        del self.live[ptr]
        return (0,)


@pytest.fixture
def fake(monkeypatch):
    pool = FakePool()
    monkeypatch.setattr(_cuda, "require_cuda", lambda what: None)
    monkeypatch.setattr(_cuda, "is_available", lambda: True)
    monkeypatch.setattr(_cuda, "get_device", lambda: 0)
    monkeypatch.setattr(_cuda, "get_device_count", lambda: 1)
    monkeypatch.setattr(_cuda, "mem_get_info", lambda: (1 << 30, 1 << 34))
    # The binding functions themselves: the fast paths call them with no wrapper in between.
    real = _cuda._rt()

    class Runtime:
        cudaMallocFromPoolAsync = staticmethod(pool.malloc)
        cudaFreeAsync = staticmethod(pool.free)

        def __getattr__(self, name):
            return getattr(real, name)

    runtime = Runtime()
    monkeypatch.setattr(_cuda, "_rt", lambda: runtime)
    return pool


def test_handle_objects_are_cached_per_int_handle():
    a = _cuda.stream_objects[77]
    assert int(a) == 77 and _cuda.stream_objects[77] is a
    assert int(_cuda.mem_pool_objects[1234]) == 1234


def test_allocate_and_free_in_stream_order(fake):
    mr = CudaAsyncViewMemoryResource(1234)
    s = Stream._from_handle(77)
    p = mr.allocate(1000, s)
    q = mr.allocate(300)
    assert fake.calls[:2] == [("malloc", 1000, 1234, 77), ("malloc", 300, 1234, 0)]
    assert mr.live_allocations == 2
    mr.deallocate(p, 1000, s)
    mr.deallocate(q, 300, DEFAULT_STREAM)
    assert fake.calls[2:] == [("free", p, 77), ("free", q, 0)]
    assert mr.live_allocations == 0 and fake.live == {}
    assert mr.allocate(0) == 0
    mr.deallocate(0, 0)


def test_wrong_frees_are_refused_and_change_nothing(fake):
    mr = CudaAsyncViewMemoryResource(1)
    p = mr.allocate(1000)
    with pytest.raises(ValueError, match="wrong size"):
        mr.deallocate(p, 999)
    with pytest.raises(ValueError, match="foreign pointer"):
        mr.deallocate(p + 256, 1000)
    with pytest.raises(TypeError):
        mr.deallocate(p, 1000, None)  # refused as RMM refuses it; the pointer stays live
    assert mr.live_allocations == 1 and p in fake.live
    mr.deallocate(p, 1000)
    with pytest.raises(ValueError, match="double free"):
        mr.deallocate(p, 1000)


def test_failed_free_keeps_the_pointer(fake):
    mr = CudaAsyncViewMemoryResource(1)
    p = mr.allocate(1000)
    fake.fail_free = True
    with pytest.raises(_cuda.CUDAError):
        mr.deallocate(p, 1000)
    assert mr.live_allocations == 1
    fake.fail_free = False
    mr.deallocate(p, 1000)
    assert mr.live_allocations == 0


def test_out_of_memory_is_a_memory_error_naming_the_request(fake):
    mr = CudaAsyncViewMemoryResource(1)
    fake.fail = "cudaErrorMemoryAllocation"
    with pytest.raises(MemoryError, match="1000 bytes") as info:
        mr.allocate(1000)
    assert info.value.requested == 1000
    fake.fail = "cudaErrorInvalidValue"
    with pytest.raises(MemoryError):  # every failed allocation is a MemoryError (as RMM)
        mr.allocate(1000)
    assert mr.live_allocations == 0


def test_bad_sizes_take_the_checked_path(fake):
    mr = CudaAsyncViewMemoryResource(1)
    for bad, err in ((-1, ValueError), (1.5, TypeError), (True, TypeError), (1 << 64, ValueError)):
        with pytest.raises(err):
            mr.allocate(bad)
    assert fake.calls == []


def test_concurrent_double_free_refused_once(fake):
    mr = CudaAsyncViewMemoryResource(1)
    for _ in range(20):
        p = mr.allocate(512)
        errors = []
        barrier = threading.Barrier(4)

        def free(p=p, barrier=barrier, errors=errors):
            barrier.wait()
            try:
                mr.deallocate(p, 512)
            except ValueError as e:
                errors.append(e)

        threads = [threading.Thread(target=free) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 3
    assert fake.live == {} and mr.live_allocations == 0


def test_several_devices_fast_path_only_on_its_own_device(fake, monkeypatch):
    # dask-cuda makes every device visible (rotated CUDA_VISIBLE_DEVICES): the fast path applies
    # while the resource's device is current, the general path switches devices otherwise.
    state = {"current": 1, "switches": [], "asked": 0}
    monkeypatch.setattr(_cuda, "get_device_count", lambda: 2)

    def get_device():  # the general path's device check (_on_device)
        state["asked"] += 1
        return state["current"]

    monkeypatch.setattr(_cuda, "get_device", get_device)
    monkeypatch.setattr(_cuda._rt(), "cudaGetDevice", lambda: (0, state["current"]), raising=False)

    def set_device(d):
        state["switches"].append(d)
        state["current"] = d

    monkeypatch.setattr(_cuda, "set_device", set_device)
    mr = CudaAsyncViewMemoryResource(5)
    assert mr.device_id == 1
    state["asked"] = 0
    p = mr.allocate(1000)
    mr.deallocate(p, 1000)
    assert state["switches"] == [] and state["asked"] == 0  # fast path, no switch
    state["current"] = 0
    q = mr.allocate(2000)
    assert state["switches"] == [1, 0] and state["current"] == 0  # switched for the call, back
    mr.deallocate(q, 2000)
    assert state["switches"] == [1, 0, 1, 0]
    assert fake.live == {} and mr.live_allocations == 0
