"""Numba allocator: ``RMMNumbaManager``, a Numba External Memory Management (EMM) plugin.

Device allocations come from the resource of the Numba context's device; pinned and mapped
host memory stay with Numba's own implementation (``HostOnlyCUDAMemoryManager``). Use it with
``numba.cuda.set_memory_manager(RMMNumbaManager)`` or
``NUMBA_CUDA_MEMORY_MANAGER=dask_rmm.allocators.numba``, before Numba creates a CUDA context.
"""

from __future__ import annotations

import weakref
from typing import Any

from numba import cuda
from numba.cuda import HostOnlyCUDAMemoryManager, IpcHandle, MemoryInfo, MemoryPointer
from numba.cuda.cudadrv import driver as _numba_driver

from dask_rmm.stream import DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Stream

__all__ = [
    "RMMNumbaManager",
    "reset_numba_allocator",
    "set_numba_allocator",
]

#: The version of Numba's EMM plugin interface implemented here.
EMM_INTERFACE_VERSION = 1


def _numba_default_stream() -> Stream:
    """The stream Numba treats as its default one (NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM)."""
    from numba.cuda.core import config

    return PER_THREAD_DEFAULT_STREAM if config.CUDA_PER_THREAD_DEFAULT_STREAM else DEFAULT_STREAM


def _release(record: tuple[Any, int, int, Stream]) -> None:
    """Give one allocation back to its resource (a Numba pending-deallocation destructor)."""
    mr, ptr, nbytes, stream = record
    mr.deallocate(ptr, nbytes, stream)


def _make_finalizer(allocations: dict, deallocations: Any, ptr: int, nbytes: int):
    """The finalizer of one allocation: queue its release with Numba's pending deallocations.

    Numba flushes that queue at once unless cleanup is deferred (``defer_cleanup``, e.g. while
    a kernel launch is being prepared). An allocation already released by :meth:`reset` is not
    released again.
    """

    def finalizer() -> None:
        record = allocations.pop(ptr, None)
        if record is not None:
            deallocations.add_item(_release, record, nbytes)

    return finalizer


class RMMNumbaManager(HostOnlyCUDAMemoryManager):
    """Numba EMM plugin that allocates device memory from dask-rmm's current device resource.

    Each allocation comes from :func:`dask_rmm.mr.get_per_device_resource` of the context's
    device, on Numba's default stream (the per-thread default stream when
    ``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1``), and is given back to the same resource when
    Numba frees it. Frees honour :meth:`defer_cleanup`. Pinned (``memhostalloc``), pinning
    (``mempin``) and managed (``memallocmanaged``) allocations use Numba's own implementation.

    See https://nvidia.github.io/numba-cuda/user/external-memory.html for the interface.

    Examples
    --------
    Needs a CUDA device (the doctest run skips these lines):

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
        """Allocate ``size`` bytes of device memory from the current device resource.

        Parameters
        ----------
        size : int
            Bytes to allocate.

        Returns
        -------
        numba.cuda.MemoryPointer
            Owns the allocation; its finalizer gives the memory back to the resource.
        """
        from dask_rmm.mr.registry import get_per_device_resource

        ctx = self.context
        if size == 0:
            return MemoryPointer(weakref.proxy(ctx), _numba_driver.binding.CUdeviceptr(0), 0)
        mr = get_per_device_resource(ctx.device.id)
        stream = _numba_default_stream()
        ptr = mr.allocate(size, stream)
        # ``allocations`` is Numba's per-context table; reset() clears it with the context.
        self.allocations[ptr] = (mr, ptr, size, stream)
        finalizer = _make_finalizer(self.allocations, self.deallocations, ptr, size)
        return MemoryPointer(
            weakref.proxy(ctx),
            _numba_driver.binding.CUdeviceptr(ptr),
            size,
            finalizer=finalizer,
        )

    def get_ipc_handle(self, memory: MemoryPointer) -> IpcHandle:
        """An IPC handle for ``memory``: the handle of the upstream allocation holding it plus
        the offset of ``memory`` inside that allocation.

        Pool blocks are parts of larger upstream allocations (cudaMalloc chunks); a CUDA IPC
        handle can only name a whole allocation, so the importing process opens the chunk and
        Numba adds the offset. Memory from ``cudaMallocAsync`` (CudaAsyncMemoryResource) or
        managed memory cannot be shared this way.

        Parameters
        ----------
        memory : numba.cuda.MemoryPointer
            Device memory returned by :meth:`memalloc` (or a view of it).

        Returns
        -------
        numba.cuda.IpcHandle
        """
        from dask_rmm import _cuda

        ptr = int(memory.handle)
        base, _extent = _cuda.mem_get_address_range(ptr)
        handle = _numba_driver.binding.CUipcMemHandle()
        handle.reserved = _cuda.ipc_get_mem_handle(base)
        source_info = self.context.device.get_device_identity()
        return IpcHandle(memory, handle, memory.size, source_info, offset=ptr - base)

    def get_memory_info(self) -> MemoryInfo:
        """``(free, total)`` bytes of the context's device as allocations through the resource
        see them: free device memory plus what a pooling resource holds free.

        Returns
        -------
        numba.cuda.MemoryInfo
        """
        from dask_rmm import _cuda
        from dask_rmm.mr.registry import get_per_device_resource

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
        """Version of the EMM plugin interface implemented (1)."""
        return EMM_INTERFACE_VERSION


# NUMBA_CUDA_MEMORY_MANAGER=dask_rmm.allocators.numba looks for this name.
_numba_memory_manager = RMMNumbaManager

_previous_managers: list[Any] = []


def set_numba_allocator() -> None:
    """Route Numba's device allocations through the current device resource.

    Calls ``numba.cuda.set_memory_manager(RMMNumbaManager)`` and remembers the previous
    manager for :func:`reset_numba_allocator`. Numba picks its memory manager when it creates a
    CUDA context, so call this before the first Numba CUDA operation in the process.
    Idempotent.

    Examples
    --------
    >>> from dask_rmm.allocators.numba import set_numba_allocator
    >>> set_numba_allocator()
    """
    current = _numba_driver._memory_manager
    if current is RMMNumbaManager:
        return
    cuda.set_memory_manager(RMMNumbaManager)
    _previous_managers.append(current)


def reset_numba_allocator() -> None:
    """Give Numba back the memory manager it had before :func:`set_numba_allocator`
    (for contexts created from now on)."""
    if not _previous_managers:
        return
    previous = _previous_managers.pop()
    if _numba_driver._memory_manager is not RMMNumbaManager:
        _previous_managers.clear()
        return
    if previous is None:
        # Numba had not chosen yet: let it choose again from NUMBA_CUDA_MEMORY_MANAGER.
        _numba_driver._memory_manager = None
    else:
        cuda.set_memory_manager(previous)
