"""Numba allocator: ``RMMNumbaManager``, a Numba External Memory Management (EMM) plugin taking
device memory from the resource of the context's device (host memory stays Numba's).
"""

from __future__ import annotations

import functools
import importlib
import weakref
from typing import Any

from cuda.bindings import driver as cu
from numba import cuda
from numba.cuda import HostOnlyCUDAMemoryManager, IpcHandle, MemoryInfo, MemoryPointer
from numba.cuda.cudadrv.driver import NumbaCUDAMemoryManager

from dask_rmm import _cuda
from dask_rmm.mr.registry import get_per_device_resource
from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream

__all__ = ["RMMNumbaManager", "reset_numba_allocator", "set_numba_allocator"]


def _numba_default_stream() -> Stream:
    """The stream Numba treats as its default one (NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM)."""
    from numba.cuda.core import config

    return PER_THREAD_DEFAULT_STREAM if config.CUDA_PER_THREAD_DEFAULT_STREAM else DEFAULT_STREAM


def _release(record: tuple[Any, int, int, Stream]) -> None:
    """Give one allocation back to its resource (a Numba pending-deallocation destructor)."""
    mr, ptr, nbytes, stream = record
    mr.deallocate(ptr, nbytes, stream)


def _finalize(allocations: dict, deallocations: Any, ptr: int, nbytes: int) -> None:
    """One allocation's finalizer: queue its release with Numba's pending deallocations
    (flushed at once unless cleanup is deferred), unless :meth:`reset` released it already."""
    record = allocations.pop(ptr, None)
    if record is not None:
        deallocations.add_item(_release, record, nbytes)


class RMMNumbaManager(HostOnlyCUDAMemoryManager):
    """Numba EMM plugin (https://nvidia.github.io/numba-cuda/user/external-memory.html):
    device memory from the resource of the context's device, on Numba's default stream (the
    per-thread one with ``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1``), given back to the same
    resource. Pinned, pinning and managed allocations stay Numba's own. Needs a CUDA device:

    >>> from numba import cuda
    >>> from dask_rmm.allocators.numba import RMMNumbaManager
    >>> cuda.set_memory_manager(RMMNumbaManager)  # doctest: +SKIP
    >>> d = cuda.to_device(range(10))  # doctest: +SKIP

    or, before the process starts::

        NUMBA_CUDA_MEMORY_MANAGER=dask_rmm.allocators.numba python script.py
    """

    def initialize(self) -> None:
        """Nothing to do: the resource is looked up at each allocation."""

    def memalloc(self, size: int) -> MemoryPointer:
        """``size`` bytes from the current device resource, freed to it by the pointer's
        finalizer."""
        ctx = self.context
        if size == 0:
            return MemoryPointer(weakref.proxy(ctx), cu.CUdeviceptr(0), 0)
        mr = get_per_device_resource(ctx.device.id)
        stream = _numba_default_stream()
        ptr = mr.allocate(size, stream)
        # ``allocations`` is Numba's per-context table; reset() clears it with the context.
        self.allocations[ptr] = (mr, ptr, size, stream)
        finalizer = functools.partial(_finalize, self.allocations, self.deallocations, ptr, size)
        return MemoryPointer(weakref.proxy(ctx), cu.CUdeviceptr(ptr), size, finalizer=finalizer)

    def get_ipc_handle(self, memory: MemoryPointer) -> IpcHandle:
        """An IPC handle for ``memory``: the handle of the whole upstream allocation (a
        cudaMalloc chunk) holding it plus its offset there (not for cudaMallocAsync or managed
        memory)."""
        ptr = int(memory.handle)
        base, _extent = _cuda.mem_get_address_range(ptr)
        handle = cu.CUipcMemHandle()
        handle.reserved = _cuda.ipc_get_mem_handle(base)
        source_info = self.context.device.get_device_identity()
        return IpcHandle(memory, handle, memory.size, source_info, offset=ptr - base)

    def get_memory_info(self) -> MemoryInfo:
        """``(free, total)`` bytes of the context's device: free device memory plus what a
        pooling resource holds free."""
        free, total = _cuda.mem_get_info()
        info = get_per_device_resource(self.context.device.id).reserved_memory_info()
        if info is not None:
            free += info.free_bytes
        return MemoryInfo(free=free, total=total)

    def reset(self) -> None:
        """Give every allocation of this context back to its resource (the context is being
        reset, so its memory is gone), then let Numba clear its host allocations."""
        records = [r for r in self.allocations.values() if type(r) is tuple]
        for ptr in [r[1] for r in records]:
            self.allocations.pop(ptr, None)
        for record in records:
            try:
                _release(record)
            except Exception:  # a resource torn down first must not stop the context reset
                pass
        super().reset()

    @property
    def interface_version(self) -> int:
        """Version of Numba's EMM plugin interface implemented here."""
        return 1


# NUMBA_CUDA_MEMORY_MANAGER=dask_rmm.allocators.numba looks for this name.
_numba_memory_manager = RMMNumbaManager

_set = False


def set_numba_allocator() -> None:
    """Route Numba's device allocations through the current device resource
    (``numba.cuda.set_memory_manager(RMMNumbaManager)``) in the CUDA contexts Numba creates from
    now on: call it before Numba's first CUDA operation. Idempotent.

    >>> from dask_rmm.allocators.numba import set_numba_allocator
    >>> set_numba_allocator()
    """
    global _set
    if not _set:
        cuda.set_memory_manager(RMMNumbaManager)
        _set = True


def reset_numba_allocator() -> None:
    """Give Numba, for contexts created from now on, the memory manager it chooses itself: the
    one ``NUMBA_CUDA_MEMORY_MANAGER`` names, or its own. (Numba has no public getter, so a
    manager set with ``set_memory_manager`` before :func:`set_numba_allocator` is not
    restored.)"""
    global _set
    if not _set:
        return
    _set = False
    from numba.cuda.core import config

    name = config.CUDA_MEMORY_MANAGER
    if name == "default":
        cuda.set_memory_manager(NumbaCUDAMemoryManager)
    else:  # as Numba loads it: the module's _numba_memory_manager (Numba's EMM docs)
        cuda.set_memory_manager(importlib.import_module(name)._numba_memory_manager)
