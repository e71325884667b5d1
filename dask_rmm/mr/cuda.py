"""Base resources: the only layer that asks CUDA (or the host allocator) for memory.

CudaMemoryResource, ManagedMemoryResource, CudaAsyncMemoryResource(+View), PinnedHostMemoryResource,
SamHeadroomMemoryResource and SystemMemoryResource. Suballocation lives in pool/arena/binning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from dask_rmm.mr.base import (
    ALIGNMENT,
    DeviceMemoryResource,
    OutOfMemoryError,
    align_up,
    check_nbytes,
    format_bytes,
)
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["SystemMemoryResource"]


class _OwnedPointers:
    """The live pointers of a base resource and their sizes, so that foreign pointers,
    double frees and wrong sizes are refused before anything is handed back."""

    __slots__ = ("_sizes", "_lock")

    def __init__(self):
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._sizes[ptr] = nbytes

    def remove(self, owner: object, ptr: int, nbytes: int) -> None:
        """Forget ``ptr`` or raise ValueError (leaving it recorded) when the call is wrong."""
        with self._lock:
            size = self._sizes.get(ptr)
            if size is None:
                raise ValueError(
                    f"{type(owner).__name__}.deallocate({ptr:#x}, {nbytes}): pointer not owned by "
                    "this resource (foreign pointer or double free)"
                )
            if size != nbytes:
                raise ValueError(
                    f"{type(owner).__name__}.deallocate({ptr:#x}, {nbytes}): wrong size, the "
                    f"pointer was allocated with {size} bytes"
                )
            del self._sizes[ptr]

    def __len__(self) -> int:
        return len(self._sizes)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())


def _load_libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.aligned_alloc.restype = ctypes.c_void_p
    libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    libc.free.restype = None
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


_libc = None


class SystemMemoryResource(DeviceMemoryResource):
    """Host memory from the C allocator, 256-byte aligned.

    On a GPU with system-allocated memory support the pointers are usable from the device; on a
    host without a GPU this is the resource every suballocator and adaptor runs on (the CPU test
    path). It is chosen explicitly (``base_resource="system"``), never as a silent fallback.
    """

    def __init__(self, device_id: int | None = None):
        global _libc
        if _libc is None:
            _libc = _load_libc()
        if device_id is None:
            from dask_rmm import _cuda

            device_id = _cuda.get_device() if _cuda.is_available() else 0
        super().__init__(device_id=device_id)
        self._owned = _OwnedPointers()

    @property
    def is_host_memory(self) -> bool:
        return True

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        nbytes = check_nbytes(nbytes)
        if nbytes == 0:
            return 0
        size = align_up(nbytes)
        ptr = _libc.aligned_alloc(ALIGNMENT, size)
        if not ptr:
            raise OutOfMemoryError(
                f"SystemMemoryResource out of memory: requested {format_bytes(nbytes)} "
                f"({nbytes} bytes) of host memory",
                requested=nbytes,
                resource="SystemMemoryResource",
            )
        self._owned.add(ptr, nbytes)
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        if ptr == 0:
            return
        self._owned.remove(self, ptr, nbytes)
        _libc.free(ptr)
