"""RMMNumbaManager, the Numba EMM plugin.

Without a GPU the manager runs against a stand-in Numba context on host memory (its
``memalloc`` only builds Numba pointer objects, which never touch CUDA); the GPU tests allocate
real Numba device arrays through each suballocator and adaptor and open an IPC handle in a
second process.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys

import pytest
from conftest import GPU_RESOURCES, make_gpu_resource

pytest.importorskip("numba.cuda")

from numba import cuda  # noqa: E402
from numba.cuda.cudadrv import driver as numba_driver  # noqa: E402

from dask_rmm.allocators import reset_allocators, set_allocators  # noqa: E402
from dask_rmm.allocators.numba import (  # noqa: E402
    RMMNumbaManager,
    reset_numba_allocator,
    set_numba_allocator,
)
from dask_rmm.mr import (  # noqa: E402
    PoolMemoryResource,
    StatisticsResourceAdaptor,
    SystemMemoryResource,
    set_per_device_resource,
)


class _FakeDevice:
    id = 0

    def get_device_identity(self):
        return {"pci_domain_id": 0, "pci_bus_id": 0, "pci_device_id": 0}


class _FakeContext:
    """What RMMNumbaManager uses of a Numba context: ``device.id``."""

    device = _FakeDevice()


@pytest.fixture
def host_manager(monkeypatch):
    # Numba defines its driver logger when the driver initializes, which never happens here.
    if not hasattr(numba_driver, "_logger"):
        monkeypatch.setattr(numba_driver, "_logger", numba_driver.make_logger(), raising=False)
    ctx = _FakeContext()
    mr = StatisticsResourceAdaptor(
        PoolMemoryResource(SystemMemoryResource(), initial_pool_size=1 << 20)
    )
    set_per_device_resource(0, mr)
    mgr = RMMNumbaManager(context=ctx)
    mgr.initialize()
    yield mgr, mr, ctx
    mgr.reset()


def test_interface_version():
    assert RMMNumbaManager(context=None).interface_version == 1


def test_module_exposes_numba_memory_manager():
    import dask_rmm.allocators.numba as hook

    assert hook._numba_memory_manager is RMMNumbaManager


def test_memalloc_on_host_memory(host_manager):
    mgr, mr, _ctx = host_manager
    mem = mgr.memalloc(1000)
    assert isinstance(mem, cuda.MemoryPointer)
    assert mem.size == 1000
    ptr = mem.device_pointer_value
    assert ptr % 256 == 0
    import ctypes

    ctypes.memset(ptr, 7, 1000)
    assert ctypes.string_at(ptr + 999, 1) == b"\x07"
    assert mr.allocation_counts.current_bytes == 1000
    del mem
    gc.collect()
    assert mr.allocation_counts.current_bytes == 0
    assert mr.allocation_counts.total_count == 1


def test_memalloc_zero(host_manager):
    mgr, mr, _ctx = host_manager
    mem = mgr.memalloc(0)
    assert mem.size == 0 and not mem.device_pointer_value
    del mem
    assert mr.allocation_counts.total_count == 0


def test_defer_cleanup_holds_frees(host_manager):
    mgr, mr, _ctx = host_manager
    mem = mgr.memalloc(512)
    with mgr.defer_cleanup():
        del mem
        gc.collect()
        assert mr.allocation_counts.current_bytes == 512
    mgr.deallocations.clear()  # Numba flushes at its next deallocation or clear
    assert mr.allocation_counts.current_bytes == 0


def test_reset_gives_everything_back_once(host_manager):
    mgr, mr, _ctx = host_manager
    a = mgr.memalloc(256)
    b = mgr.memalloc(768)
    assert mr.allocation_counts.current_count == 2
    mgr.reset()
    assert mr.allocation_counts.current_bytes == 0
    del a, b  # finalizers after reset must not free again
    gc.collect()
    assert mr.allocation_counts.current_bytes == 0
    assert mr.allocation_counts.total_count == 2


def test_memalloc_uses_context_device_resource(host_manager, monkeypatch):
    mgr, mr, ctx = host_manager
    other = StatisticsResourceAdaptor(SystemMemoryResource())
    import dask_rmm.mr.registry as registry

    monkeypatch.setattr(registry, "_check_device", lambda d: d)  # a second (pretend) device
    set_per_device_resource(1, other)

    class Device1(_FakeDevice):
        id = 1

    ctx.device = Device1()
    mem = mgr.memalloc(300)
    assert other.allocation_counts.current_bytes == 300
    assert mr.allocation_counts.current_bytes == 0
    del mem
    assert other.allocation_counts.current_bytes == 0


def test_per_thread_default_stream(host_manager, monkeypatch):
    from numba.cuda.core import config

    mgr, _mr, _ctx = host_manager
    seen = []

    class Recording(SystemMemoryResource):
        def allocate(self, nbytes, stream=None):
            seen.append(stream.handle)
            return super().allocate(nbytes, stream)

    set_per_device_resource(0, Recording())
    mem = mgr.memalloc(256)
    monkeypatch.setattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 1)
    mem2 = mgr.memalloc(256)
    assert seen == [0, 2]
    del mem, mem2


def test_set_and_reset_numba_allocator():
    set_numba_allocator()
    set_numba_allocator()  # idempotent
    try:
        assert numba_driver._memory_manager is RMMNumbaManager
    finally:
        reset_numba_allocator()
    # what Numba chooses itself (NUMBA_CUDA_MEMORY_MANAGER unset: its own)
    assert numba_driver._memory_manager is numba_driver.NumbaCUDAMemoryManager


def test_set_allocators_numba():
    assert set_allocators(["numba"]) == ["numba"]
    try:
        assert numba_driver._memory_manager is RMMNumbaManager
    finally:
        reset_allocators(["numba"])
    assert numba_driver._memory_manager is numba_driver.NumbaCUDAMemoryManager


def test_reset_gives_numba_the_manager_its_environment_names(monkeypatch):
    from numba.cuda.core import config

    monkeypatch.setattr(numba_driver, "_memory_manager", numba_driver._memory_manager)  # undone
    monkeypatch.setattr(config, "CUDA_MEMORY_MANAGER", "dask_rmm.allocators.numba")
    set_numba_allocator()
    reset_numba_allocator()
    assert numba_driver._memory_manager is RMMNumbaManager


def test_environment_variable_selects_the_manager():
    code = (
        "from numba.cuda.cudadrv import driver\n"
        "driver._ensure_memory_manager()\n"
        "print(driver._memory_manager.__module__, driver._memory_manager.__name__)\n"
    )
    env = dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="dask_rmm.allocators.numba")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["dask_rmm.allocators.numba", "RMMNumbaManager"]


# --- GPU --------------------------------------------------------------------------------------


@pytest.fixture
def gpu_numba_manager():
    """Numba's current context with RMMNumbaManager as its memory manager."""
    ctx = cuda.current_context()
    original = ctx.memory_manager
    ctx.memory_manager = RMMNumbaManager(context=ctx)
    yield ctx
    ctx.memory_manager.reset()
    ctx.memory_manager = original


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_RESOURCES)
def test_gpu_numba_device_arrays(kind, gpu_numba_manager):
    import numpy as np

    from dask_rmm.mr import set_current_device_resource

    mr = make_gpu_resource(kind)
    set_current_device_resource(mr)
    host = np.arange(1000, dtype=np.float64)
    d = cuda.to_device(host)
    e = cuda.device_array((300, 7), dtype=np.int32)
    # a device-to-device copy writes through the allocation (no kernel: the GPU machine's numba
    # cannot compile against its numpy 2.5, a numba/numpy mismatch unrelated to the allocator)
    e.copy_to_device(cuda.to_device(np.full((300, 7), 5, dtype=np.int32)))
    np.testing.assert_array_equal(d.copy_to_host(), host)
    assert int(e.copy_to_host().sum()) == 5 * 2100
    if hasattr(mr, "allocation_counts"):
        assert mr.allocation_counts.current_bytes >= 8000 + 8400
    del d, e
    gc.collect()
    cuda.synchronize()
    if hasattr(mr, "allocation_counts"):
        assert mr.allocation_counts.current_bytes == 0


@pytest.mark.gpu
def test_gpu_get_memory_info_counts_pool_free_bytes(gpu_numba_manager):
    from dask_rmm import _cuda
    from dask_rmm.mr import set_current_device_resource

    mr = make_gpu_resource("pool")
    set_current_device_resource(mr)
    pool_free = mr.reserved_memory_info().free_bytes
    assert pool_free > 0
    # the suite's other processes allocate and free on this device meanwhile: read it until
    # its free memory is the same before and after the manager's answer
    for _ in range(200):
        before, total = _cuda.mem_get_info()
        info = gpu_numba_manager.get_memory_info()
        if _cuda.mem_get_info()[0] == before:
            break
    assert info.total == total
    assert info.free == before + pool_free


_IPC_CHILD = """
import json, pickle, sys
from numba import cuda
handle = pickle.loads(sys.stdin.buffer.read())
with handle as arr:
    print(json.dumps(arr.copy_to_host().tolist()))
"""


@pytest.mark.gpu
def test_gpu_ipc_handle_read_in_second_process(gpu_numba_manager):
    import numpy as np

    from dask_rmm.mr import set_current_device_resource

    mr = make_gpu_resource("statistics(pool)")
    set_current_device_resource(mr)
    first = cuda.device_array(4096, dtype=np.uint8)  # so the block sits at an offset
    values = np.arange(100, dtype=np.int64) * 3
    d = cuda.to_device(values)
    handle = d.get_ipc_handle()
    assert handle._ipc_handle.offset > 0
    out = subprocess.run(
        [sys.executable, "-c", _IPC_CHILD],
        input=pickle.dumps(handle),
        capture_output=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout.decode()) == values.tolist()
    del first, d
