"""dask_rmm.allocators.torch: the C-callable callbacks PyTorch's pluggable allocator calls, and
(on a GPU host with torch) PyTorch tensors allocated from dask-rmm's resources."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from dask_rmm import _cuda, mr
from dask_rmm.allocators import SUPPORTED_ALLOCATORS
from dask_rmm.allocators import torch as torch_hook

HAS_GPU = _cuda.is_available()


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.fixture
def host_mr():
    previous = mr.get_current_device_resource() if HAS_GPU else None
    res = mr.StatisticsResourceAdaptor(mr.SystemMemoryResource())
    mr.set_current_device_resource(res)
    yield res
    mr.set_current_device_resource(previous)


def _c_functions():
    alloc_addr, free_addr = torch_hook.callback_addresses()
    return torch_hook.ALLOC_FN_TYPE(alloc_addr), torch_hook.FREE_FN_TYPE(free_addr)


def test_torch_is_a_supported_allocator_name():
    assert "torch" in SUPPORTED_ALLOCATORS


def test_allocator_is_none_without_cuda_torch():
    if not _torch_cuda():
        assert torch_hook.rmm_torch_allocator is None
    else:
        from torch.cuda.memory import CUDAPluggableAllocator

        assert isinstance(torch_hook.rmm_torch_allocator, CUDAPluggableAllocator)


def test_callbacks_through_their_c_addresses(host_mr):
    # Called the way PyTorch calls them: through the function pointers, with C types.
    alloc, free = _c_functions()
    ptr = alloc(1000, 0, None)
    assert ptr and ptr % 256 == 0
    assert host_mr.allocation_counts.current_bytes == 1000
    ctypes.memset(ptr, 7, 1000)
    free(ptr, 1000, 0, None)
    assert host_mr.allocation_counts.current_bytes == 0
    assert host_mr.allocation_counts.total_count == 1


def test_failed_allocation_returns_null_and_keeps_the_error(host_mr, caplog):
    alloc, _ = _c_functions()
    limited = mr.LimitingResourceAdaptor(host_mr, allocation_limit=4096)
    mr.set_current_device_resource(limited)
    returned = []
    with caplog.at_level(logging.WARNING, logger="dask_rmm.allocators.torch"):
        # NULL to C, then the calling Python code raises right after the call, on its line
        with pytest.raises(MemoryError) as info:
            returned.append(alloc(1 << 20, 0, None))
    # Raised on the calling line: before its next instruction on Python 3.11; on 3.12 the
    # instruction event of the frame already running comes one instruction later (after the
    # append). Either way the NULL never reaches a second statement (the H200 runs 3.12).
    assert returned in ([], [None])
    assert isinstance(torch_hook.last_allocation_error(), MemoryError)
    assert type(info.value).__name__ == "TorchAllocationError"
    assert "1048576" in str(info.value)
    assert "1048576 bytes" in caplog.text
    assert host_mr.allocation_counts.current_bytes == 0


def test_free_goes_back_to_the_resource_it_came_from(host_mr):
    alloc, free = _c_functions()
    ptr = alloc(512, 0, None)
    other = mr.SystemMemoryResource()
    mr.set_current_device_resource(other)  # replaced while the tensor lives
    free(ptr, 512, 0, None)
    assert host_mr.allocation_counts.current_bytes == 0


def test_bad_free_is_logged_not_raised(host_mr, caplog):
    _, free = _c_functions()
    with caplog.at_level(logging.WARNING, logger="dask_rmm.allocators.torch"):
        free(0x1000, 64, 0, None)  # never allocated: the resource refuses, nothing raises into C
    assert "freeing 0x1000" in caplog.text
    free(None, 0, 0, None)  # NULL is ignored


def test_stream_reaches_the_resource(host_mr):
    seen = []

    def allocate(nbytes, stream):
        seen.append(stream.handle)
        return host_mr.allocate(nbytes, stream)

    def deallocate(ptr, nbytes, stream):
        seen.append(stream.handle)
        host_mr.deallocate(ptr, nbytes, stream)

    mr.set_current_device_resource(mr.CallbackMemoryResource(allocate, deallocate))
    alloc, free = _c_functions()
    ptr = alloc(256, 0, 0x1234)
    free(ptr, 256, 0, 0x1234)
    assert seen == [0x1234, 0x1234]


def test_set_torch_allocator_without_torch_is_import_error():
    if torch_hook.rmm_torch_allocator is not None:
        pytest.skip("torch with CUDA is installed here")
    from dask_rmm.allocators import set_allocators

    with pytest.raises(ImportError, match="torch"):
        set_allocators(["torch"])


# --- PyTorch on a GPU: each scenario in its own process (PyTorch takes one allocator per process,
# before its first CUDA allocation) ------------------------------------------------------------

_SCENARIO = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from dask_rmm import mr
    from dask_rmm.allocators import set_allocators

    stats = mr.StatisticsResourceAdaptor(
        mr.PoolMemoryResource(mr.CudaMemoryResource(), initial_pool_size=1 << 26))
    mr.set_current_device_resource(stats)
    set_allocators(["torch"], exact=["torch"])  # the per-tensor path
    out = {}
    x = torch.ones(1000, device="cuda")
    out["bytes_with_tensor"] = stats.allocation_counts.current_bytes
    out["pointer_in_pool"] = stats.get_upstream().reserved_memory_info().reserved_bytes >= 4000
    out["sum"] = float(x.sum())
    del x
    gc.collect()
    out["bytes_after_free"] = stats.allocation_counts.current_bytes
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        z = y * 2
    torch.cuda.current_stream().wait_stream(s)
    out["second_stream_ok"] = bool((z[-1] == 2 * ((1 << 20) - 1)).item())
    del y, z
    gc.collect()
    torch.cuda.synchronize()
    out["bytes_end"] = stats.allocation_counts.current_bytes
    out["allocations"] = stats.allocation_counts.total_count
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        out["oom"] = "no error"
    except torch.OutOfMemoryError as e:
        out["oom"] = type(e).__name__ if isinstance(e, MemoryError) else "not a MemoryError"
    out["after_oom"] = float(torch.ones(10, device="cuda").sum())
    set_allocators(["torch"], exact=["torch"])  # again: harmless
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.gpu
def test_torch_tensors_come_from_the_current_resource():
    if not _torch_cuda():
        pytest.skip("torch with CUDA is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _SCENARIO], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    out = json.loads(line[len("RESULT") :])
    assert out["bytes_with_tensor"] >= 4000
    assert out["pointer_in_pool"]
    assert out["sum"] == 1000.0
    assert out["bytes_after_free"] == 0
    assert out["second_stream_ok"]
    assert out["bytes_end"] == 0
    assert out["allocations"] >= 3
    assert out["after_oom"] == 10.0
    assert out["oom"] == "TorchAllocationError", out["oom"]


def test_out_of_memory_collects_garbage_and_retries(host_mr):
    alloc, free = _c_functions()
    limited = mr.LimitingResourceAdaptor(host_mr, allocation_limit=4096)
    mr.set_current_device_resource(limited)

    class Holder:
        pass

    garbage = Holder()
    garbage.ptr = alloc(4096, 0, None)
    garbage.cycle = garbage  # only the cyclic collector frees it

    def release(ptr=garbage.ptr):
        free(ptr, 4096, 0, None)

    import weakref

    weakref.finalize(garbage, release)
    del garbage
    ptr = alloc(4096, 0, None)  # full until the cycle is collected
    assert ptr
    free(ptr, 4096, 0, None)
    assert host_mr.allocation_counts.current_bytes == 0


# --- the one-shot "raise in the allocating Python call" hook, driven without torch ------------


class _Profiler(threading.local):
    """Stands in for ``sys``'s per-thread profiler inside the allocator module; ``event`` plays
    what the interpreter would report in the calling Python code (as CPython 3.12+ does, the
    profiler the hook sets stays set after the hook raised)."""

    _getframe = staticmethod(sys._getframe)

    def __init__(self):
        self.func = None
        self.trace = None

    def gettrace(self):
        return self.trace

    def settrace(self, func):
        self.trace = func

    def getprofile(self):
        return self.func

    def setprofile(self, func):
        self.func = func

    def event(self, name="c_return"):
        # The frame is the caller's, a real one: whether the event happened inside a callback
        # (the resource's own code, which must not fire the hook) is read from its stack.
        if self.func is not None:
            self.func(self._getframe(1), name, None)


class _FlakyResource:
    """Refuses allocations of ``refuse`` bytes or more; returns fake pointers otherwise."""

    def __init__(self, refuse):
        self.refuse = refuse
        self.next_ptr = 0x10000

    def allocate(self, nbytes, stream=None):
        if nbytes >= self.refuse:
            raise MemoryError(f"fake pool: {nbytes} bytes do not fit")
        self.next_ptr += 0x1000
        return self.next_ptr

    def deallocate(self, ptr, nbytes, stream=None):
        pass


@pytest.fixture
def profiler(monkeypatch):
    prof = _Profiler()
    monkeypatch.setattr(torch_hook, "sys", prof)
    monkeypatch.setattr(
        torch_hook, "_get_per_device_resource", lambda device: _FlakyResource(refuse=1 << 40)
    )
    yield prof
    torch_hook._disarm()


def test_failed_allocation_raises_once_and_later_allocations_do_not(profiler):
    big = 1 << 50
    # One PyTorch call that asks twice (e.g. a retry) and gets NULL both times: then the
    # caller's next event raises, once, with this allocation's message.
    assert torch_hook.allocate(big, 0, None) is None
    assert torch_hook.allocate(big, 0, None) is None
    with pytest.raises(MemoryError) as info:
        profiler.event("c_return")
    assert type(info.value).__name__ == "TorchAllocationError"
    message = str(info.value)
    assert f"allocating {big} bytes" in message
    assert message.count("rmm_torch_allocator") == 1  # not chained onto an earlier error
    # Nothing stays armed: the next events and a later (successful) allocation never raise.
    profiler.event("return")
    ptr = torch_hook.allocate(40, 0, None)
    assert ptr
    profiler.event("c_return")
    profiler.event("return")
    torch_hook.deallocate(ptr, 40, 0, None)
    assert profiler.getprofile() is None
    assert not torch_hook._armed_threads  # later callbacks take the fast path again


def test_failure_then_success_in_one_call_does_not_raise(profiler):
    assert torch_hook.allocate(1 << 50, 0, None) is None
    assert torch_hook.allocate(64, 0, None)  # PyTorch got memory after all
    profiler.event("c_return")
    assert profiler.getprofile() is None


def test_hook_waits_until_the_callbacks_returned(profiler, monkeypatch):
    # The previous failure's hook must not fire inside the resource's own Python code.
    seen = []

    class Resource(_FlakyResource):
        def allocate(self, nbytes, stream=None):
            profiler.event("return")  # the resource's code returning: inside the callback
            seen.append(nbytes)
            return super().allocate(nbytes, stream)

    monkeypatch.setattr(
        torch_hook, "_get_per_device_resource", lambda device: Resource(refuse=1 << 40)
    )
    assert torch_hook.allocate(1 << 50, 0, None) is None
    with pytest.raises(MemoryError):
        profiler.event("c_return")
    assert torch_hook.allocate(40, 0, None)
    profiler.event("c_return")
    assert seen == [1 << 50, 1 << 50, 40]


def test_free_while_a_failure_is_pending_does_not_fire_inside_the_resource(profiler, monkeypatch):
    # PyTorch may free a block between the failed allocation and its return to Python: the
    # armed hook must not raise inside the resource's deallocate (the free would be lost).
    freed = []

    class Resource(_FlakyResource):
        def deallocate(self, ptr, nbytes, stream=None):
            profiler.event("return")  # the resource's code, inside the free callback
            freed.append(ptr)

    resource = Resource(refuse=1 << 40)
    monkeypatch.setattr(torch_hook, "_get_per_device_resource", lambda device: resource)
    ptr = torch_hook.allocate(64, 0, None)
    assert torch_hook.allocate(1 << 50, 0, None) is None
    torch_hook.deallocate(ptr, 64, 0, None)
    assert freed == [ptr]
    with pytest.raises(MemoryError):
        profiler.event("c_return")  # back in the caller: raised there, once
    profiler.event("c_return")
    assert profiler.getprofile() is None


def test_pending_error_is_per_thread(profiler):
    assert torch_hook.allocate(1 << 50, 0, None) is None
    other = []

    def elsewhere():
        try:
            other.append(torch_hook.allocate(40, 0, None))
            profiler.event("c_return")
        except BaseException as e:  # pragma: no cover - the failure being tested
            other.append(e)

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join()
    assert len(other) == 1 and isinstance(other[0], int)
    with pytest.raises(MemoryError):
        profiler.event("c_return")  # still raised in the thread that failed


def test_real_profiler_is_left_as_it_was_after_a_failure(host_mr):
    alloc, free = _c_functions()
    mr.set_current_device_resource(mr.LimitingResourceAdaptor(host_mr, allocation_limit=4096))
    before = sys.getprofile()
    with pytest.raises(MemoryError):
        list(map(alloc, [1 << 20, 1 << 20], [0, 0], [None, None]))  # two NULLs, one C call
    assert sys.getprofile() is before
    ptr = alloc(64, 0, None)
    assert ptr and len([ptr]) == 1  # later calls and allocations do not raise
    free(ptr, 64, 0, None)
    assert sys.getprofile() is before


def test_raises_on_the_failing_line_not_at_a_later_call(host_mr):
    # The GPU scenario without torch: a failing call followed by a line with no calls, then a
    # later allocation. The error belongs to the first line; the later allocation succeeds.
    alloc, free = _c_functions()
    mr.set_current_device_resource(mr.LimitingResourceAdaptor(host_mr, allocation_limit=4096))
    state = {}
    try:
        alloc(1 << 20, 0, None)
        state["oom"] = "no error"
    except MemoryError as e:
        state["oom"] = type(e).__name__
        state["message"] = str(e)
    ptr = alloc(64, 0, None)
    state["later"] = bool(ptr)
    free(ptr, 64, 0, None)
    assert state["oom"] == "TorchAllocationError"
    assert state["message"].count("rmm_torch_allocator") == 1
    assert state["later"]


class _StandInCache:
    """What PyTorch's cache gives the pool (its reserved bytes, a cap, a release), without
    PyTorch: the routing of its budget between pools runs the same on any host."""

    def __init__(self):
        self.caps: list = []
        self._budgets: dict = {}

    def reserved_bytes(self, device):
        return 0

    def set_cap(self, device, nbytes):
        self.caps.append(nbytes)

    def release(self, device):
        return 0

    def budget(self, device):
        if device not in self._budgets:
            self._budgets[device] = torch_hook._TorchDeviceBudget(self, device)
        return self._budgets[device]


def test_pytorchs_budget_follows_the_current_pool_and_leaves_the_replaced_one(monkeypatch):
    MiB = 1 << 20
    cache = _StandInCache()
    monkeypatch.setattr(torch_hook, "_cache", cache)
    first = mr.PoolMemoryResource(
        mr.SystemMemoryResource(), initial_pool_size=MiB, maximum_pool_size=8 * MiB
    )
    torch_hook.share_torch_budget(0, mr.StatisticsResourceAdaptor(first))  # found down the chain
    assert first.budget_sharers() == (cache.budget(0),) and cache.caps[-1] == 7 * MiB
    second = mr.PoolMemoryResource(
        mr.SystemMemoryResource(), initial_pool_size=MiB, maximum_pool_size=16 * MiB
    )
    torch_hook.share_torch_budget(0, second)  # a re-registration's new stack
    assert first.budget_sharers() == () and second.budget_sharers() == (cache.budget(0),)
    assert cache.caps[-1] == 15 * MiB
    ptr = first.allocate(4 * MiB)  # the replaced pool growing no longer moves the cap
    assert cache.caps[-1] == 15 * MiB
    first.deallocate(ptr, 4 * MiB)
    torch_hook.share_torch_budget(0, mr.SystemMemoryResource())  # no pool: no cap
    assert second.budget_sharers() == () and cache.caps[-1] is None
