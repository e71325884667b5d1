"""Base resources: the only layer that asks CUDA (or the host allocator) for memory; the CUDA
calls themselves are in ``dask_rmm._cuda``."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

from dask_rmm import _cuda
from dask_rmm.mr.base import (
    SIZE_MAX,
    CUDAAllocationError,
    DeviceMemoryResource,
    OutOfMemoryError,
    check_nbytes,
    deallocate_refused,
    stream_arg,
)
from dask_rmm.sizes import ALIGNMENT, align_up, format_bytes, host_total_memory, parse_device_bytes
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = [
    "CudaAsyncMemoryResource",
    "CudaAsyncViewMemoryResource",
    "CudaMemoryResource",
    "ManagedMemoryResource",
    "PinnedHostMemoryResource",
    "SamHeadroomMemoryResource",
    "SystemMemoryResource",
]


def _handle(stream: Any) -> int:
    try:
        return stream.handle
    except AttributeError:
        return stream_arg(stream).handle


class _BaseResource(DeviceMemoryResource):
    """Shared machinery of the base resources: ownership (pointer -> size; atomic dict pops and
    stores, no lock), CUDA error mapping, and, with several devices, switching to the resource's
    device for a call. A subclass implements ``_alloc``, and ``_free`` unless ``cudaFree`` frees
    its memory."""

    def __init__(self):
        _cuda.require_cuda(type(self).__name__)
        super().__init__(device_id=_cuda.get_device())
        self._multi_device = _cuda.get_device_count() > 1
        self._owned: dict[int, int] = {}

    _alloc: Callable[[int, int], int]  # (nbytes, stream_handle) -> ptr

    def _free(self, ptr: int, nbytes: int, stream_handle: int) -> None:
        _cuda.free(ptr)

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        """Allocate ``nbytes`` (256-byte aligned) and return the pointer as an int."""
        if type(nbytes) is not int or nbytes < 0 or nbytes > SIZE_MAX:
            nbytes = check_nbytes(nbytes)
        if nbytes == 0:
            return 0
        handle = _handle(stream)
        try:
            if self._multi_device:
                ptr = self._on_device(self._alloc, nbytes, handle)
            else:
                ptr = self._alloc(nbytes, handle)
        except _cuda.CUDAError as e:
            raise self._allocation_error(e, nbytes, handle) from e
        self._owned[ptr] = nbytes
        return ptr

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        """Free ``ptr``, allocated here with ``nbytes``; a wrong call raises ValueError first."""
        if ptr == 0 and nbytes == 0:
            return
        handle = _handle(stream)
        owned = self._owned
        size = owned.pop(ptr, None)
        if size is None or size != nbytes:
            if size is not None:
                owned[ptr] = size
            return deallocate_refused(self, type(self).__name__, ptr, nbytes, size, stream)
        try:
            if self._multi_device:
                self._on_device(self._free, ptr, nbytes, handle)
            else:
                self._free(ptr, nbytes, handle)
        except BaseException:
            self._owned[ptr] = nbytes
            raise

    def _on_device(self, fn, *args):
        with _cuda.on_device(self.device_id):
            return fn(*args)

    def _allocation_error(self, error: _cuda.CUDAError, nbytes: int, stream_handle: int):
        """The MemoryError an allocation that failed with ``error`` raises."""
        if error.error_name == "cudaErrorMemoryAllocation":
            return self._out_of_memory(nbytes, stream_handle)
        if isinstance(error, MemoryError):
            return error
        return CUDAAllocationError.from_error(
            error,
            f"{type(self).__name__}.allocate({nbytes}) on device {self.device_id}, stream "
            f"{stream_handle:#x}",
        )

    def _out_of_memory(self, nbytes: int, stream_handle: int) -> OutOfMemoryError:
        name = type(self).__name__
        try:
            free_bytes = self._on_device(lambda: _cuda.mem_get_info()[0])
        except _cuda.CUDAError:
            free_bytes = None
        return OutOfMemoryError(
            f"{name} out of memory on device {self.device_id}: requested "
            f"{format_bytes(nbytes)} ({nbytes} bytes) on stream {stream_handle:#x}; "
            f"{format_bytes(free_bytes)} free on the device (no pool: pool size and largest free "
            "block do not apply)",
            requested=nbytes,
            resource=name,
            stream=stream_handle,
            free_bytes=free_bytes,
        )

    @property
    def live_allocations(self) -> int:
        """How many pointers this resource has handed out and not taken back."""
        return len(self._owned)


class CudaMemoryResource(_BaseResource):
    """Device memory from ``cudaMalloc``/``cudaFree`` on the device current at construction.

    The stream argument is ignored: ``cudaMalloc`` is not stream ordered and ``cudaFree``
    synchronizes the device.

    Examples
    --------
    Needs a CUDA device (the doctest run skips these lines):

    >>> mr = CudaMemoryResource()  # doctest: +SKIP
    >>> ptr = mr.allocate(1024)  # doctest: +SKIP
    >>> mr.deallocate(ptr, 1024)  # doctest: +SKIP
    """

    def _alloc(self, nbytes: int, stream_handle: int) -> int:
        return _cuda.malloc(nbytes)


class ManagedMemoryResource(_BaseResource):
    """Unified (managed) memory from ``cudaMallocManaged``, which may exceed device memory."""

    def _alloc(self, nbytes: int, stream_handle: int) -> int:
        return _cuda.malloc_managed(nbytes)


class PinnedHostMemoryResource(_BaseResource):
    """Page-locked host memory from ``cudaHostAlloc``, readable by host and device; device
    accessible, so :attr:`is_host_memory` is False (as for RMM's ``pinned_host`` resource)."""

    def _alloc(self, nbytes: int, stream_handle: int) -> int:
        return _cuda.malloc_host(nbytes)

    def _free(self, ptr: int, nbytes: int, stream_handle: int) -> None:
        _cuda.free_host(ptr)


class CudaAsyncViewMemoryResource(_BaseResource):
    """Stream-ordered allocation (``cudaMallocFromPoolAsync``) from an existing memory pool,
    which this resource never destroys.

    Parameters
    ----------
    pool_handle : int
        A ``cudaMemPool_t`` handle (an int, or anything ``int()`` accepts, such as cuda-python's
        ``cudaMemPool_t``), e.g. ``CudaAsyncMemoryResource().pool_handle()`` or
        ``dask_rmm._cuda.device_get_default_mem_pool()``.
    """

    def __init__(self, pool_handle: Any):
        if isinstance(pool_handle, bool):
            raise TypeError(f"pool_handle must be a cudaMemPool_t handle, got {pool_handle!r}")
        try:
            handle = int(pool_handle)
        except (TypeError, ValueError):
            raise TypeError(
                f"pool_handle must be a cudaMemPool_t handle (an int), got {pool_handle!r} "
                f"({type(pool_handle).__name__})"
            ) from None
        if handle == 0:
            raise ValueError("pool_handle must be a memory pool handle, got a null handle (0)")
        super().__init__()
        self._pool = handle
        # The fast paths call cuda-python with cached handle objects (_cuda.HandleObjects).
        self._pool_object = _cuda.mem_pool_objects[handle]
        self._stream_objects = _cuda.stream_objects
        self._malloc_call = _cuda.runtime_function("cudaMallocFromPoolAsync")
        self._free_call = _cuda.runtime_function("cudaFreeAsync")
        self._sizes = self._owned  # the owned-pointer table, one attribute away
        # With several devices, the fast paths apply when this one is current (cudaGetDevice).
        self._get_device_call = _cuda.runtime_function("cudaGetDevice")

    def pool_handle(self) -> int:
        """The ``cudaMemPool_t`` handle allocations come from, as an int."""
        return self._pool

    def _alloc(self, nbytes: int, stream_handle: int) -> int:
        return _cuda.malloc_from_pool_async(nbytes, self._pool, stream_handle)

    def _free(self, ptr: int, nbytes: int, stream_handle: int) -> None:
        _cuda.free_async(ptr, stream_handle)

    # Set by an owning subclass once it is finalized: the last free destroys the pool.
    _finalized = False

    # The fast paths: one cuda-python call with cached handle objects and one dict store or
    # pop; anything unusual takes _BaseResource's general path, with the same errors.
    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        if (
            type(nbytes) is int
            and 0 < nbytes <= SIZE_MAX
            and (not self._multi_device or self._get_device_call()[1] == self.device_id)
        ):
            try:
                handle = stream.handle
            except AttributeError:
                pass
            else:
                err, ptr = self._malloc_call(
                    nbytes, self._pool_object, self._stream_objects[handle]
                )
                if err:
                    try:
                        _cuda.fail(err, "cudaMallocFromPoolAsync")
                    except _cuda.CUDAError as e:
                        raise self._allocation_error(e, nbytes, handle) from e
                self._sizes[ptr] = nbytes
                return ptr
        return super().allocate(nbytes, stream)

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        sizes = self._sizes
        n = sizes.pop(ptr, None)
        if n is not None:
            if n == nbytes and (
                not self._multi_device or self._get_device_call()[1] == self.device_id
            ):
                try:
                    handle = stream.handle
                except AttributeError:
                    sizes[ptr] = n  # not a Stream: the general path converts or refuses it
                else:
                    try:
                        (err,) = self._free_call(ptr, self._stream_objects[handle])
                        if err:
                            _cuda.fail(err, "cudaFreeAsync")
                    except BaseException:
                        sizes[ptr] = n
                        raise
                    if self._finalized and not sizes:
                        self._destroy_pool()
                    return
            else:
                sizes[ptr] = n
        super().deallocate(ptr, nbytes, stream)
        if self._finalized and not sizes:
            self._destroy_pool()

    def _destroy_pool(self) -> None:  # pragma: no cover - only owning subclasses finalize
        pass


_HANDLE_POSIX_FD = 1  # cudaMemHandleTypePosixFileDescriptor
_HANDLE_FABRIC = 8  # cudaMemHandleTypeFabric


def _export_handle_type_supported(handle_type: int, device: int) -> bool:
    """Whether ``device``'s memory pools can export ``handle_type`` (RMM's check: a runtime
    that does not know the attribute counts as "not supported")."""
    try:
        mask = _cuda.get_device_attribute("MemoryPoolSupportedHandleTypes", device)
    except _cuda.CUDAError as e:
        if e.error_name == "cudaErrorInvalidValue":
            return False
        raise
    return (mask & handle_type) == handle_type


class CudaAsyncMemoryResource(CudaAsyncViewMemoryResource):
    """Stream-ordered allocation (``cudaMallocAsync``) from a memory pool this resource owns.

    Parameters
    ----------
    initial_pool_size : int or str, optional
        Prime the pool by allocating and freeing this much on the default stream.
        Ints, size strings (``"4GiB"``) and fractions of device memory (``0.5``) are accepted.
    release_threshold : int or str, optional
        Bytes the pool keeps reserved across synchronizations instead of handing them back to
        the driver; default the device's total memory (as RMM), so the pool only grows.
    enable_ipc : bool
        Make the pool exportable to other processes (POSIX file descriptor handles).
    enable_fabric : bool
        Make the pool's memory exportable as fabric handles (multi-node NVLink). Where the
        device cannot export the handle type asked for, a :class:`CUDAError` (RuntimeError)
        ends in "Requested IPC memory handle type not supported", as RMM's.

    Examples
    --------
    Needs a CUDA device (the doctest run skips these lines):

    >>> mr = CudaAsyncMemoryResource(initial_pool_size="1GiB", release_threshold="2GiB")  # doctest: +SKIP
    >>> mr.pool_handle()  # doctest: +SKIP
    94310741504
    """

    def __init__(
        self,
        initial_pool_size: int | str | None = None,
        release_threshold: int | str | None = None,
        enable_ipc: bool = False,
        enable_fabric: bool = False,
    ):
        for name, flag in (("enable_ipc", enable_ipc), ("enable_fabric", enable_fabric)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if enable_ipc and enable_fabric:
            raise ValueError(
                "CudaAsyncMemoryResource: enable_ipc and enable_fabric together are not "
                "supported (cuda-python's cudaMemPoolProps takes one handle type); choose one"
            )
        handle_type = _HANDLE_POSIX_FD if enable_ipc else _HANDLE_FABRIC if enable_fabric else 0
        _cuda.require_cuda("CudaAsyncMemoryResource")
        device = _cuda.get_device()
        initial = (
            None
            if initial_pool_size is None
            else parse_device_bytes(initial_pool_size, device, 1, option="initial_pool_size") or 0
        )
        threshold = (
            _cuda.device_total_memory(device)
            if release_threshold is None
            else parse_device_bytes(release_threshold, device, 1, option="release_threshold") or 0
        )
        if not _cuda.get_device_attribute("MemoryPoolsSupported", device):
            raise _cuda.CUDAError(
                "cudaErrorNotSupported",
                "CudaAsyncMemoryResource",
                f"CudaAsyncMemoryResource: device {device} does not support cudaMallocAsync "
                "memory pools",
            )
        if handle_type and not _export_handle_type_supported(handle_type, device):
            raise _cuda.CUDAError(
                "cudaErrorNotSupported",
                "CudaAsyncMemoryResource",
                f"CudaAsyncMemoryResource(enable_ipc={enable_ipc}, enable_fabric={enable_fabric})"
                f" on device {device}: the device's memory pools cannot export this handle type"
                " (cudaDevAttrMemoryPoolSupportedHandleTypes); Requested IPC memory handle type"
                " not supported",
            )
        pool = _cuda.mem_pool_create(device, release_threshold=threshold, handle_types=handle_type)
        self._owns_pool = False
        try:
            super().__init__(pool)
        except BaseException:
            _cuda.mem_pool_destroy(pool)
            raise
        self._owns_pool = True
        self._finalized = False
        self._ipc = enable_ipc
        if initial:
            ptr = self.allocate(initial, DEFAULT_STREAM)
            self.deallocate(ptr, initial, DEFAULT_STREAM)

    @property
    def release_threshold(self) -> int:
        """The pool's current release threshold in bytes."""
        return _cuda.mem_pool_get_attribute(self._pool, "ReleaseThreshold")

    def set_release_threshold(self, nbytes: int | str) -> None:
        """Change how much unused memory the pool keeps across synchronizations."""
        _cuda.mem_pool_set_release_threshold(
            self._pool,
            parse_device_bytes(nbytes, self.device_id, 1, option="release_threshold") or 0,
        )

    def trim_to(self, min_bytes_to_keep: int = 0) -> None:
        """Hand unused pool memory back to the driver, keeping at least ``min_bytes_to_keep``."""
        _cuda.mem_pool_trim_to(self._pool, check_nbytes(min_bytes_to_keep, "min_bytes_to_keep"))

    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the driver (``cudaMemPoolAttrReservedMemCurrent``)."""
        return _cuda.mem_pool_get_attribute(self._pool, "ReservedMemCurrent")

    def used_bytes(self) -> int:
        """Bytes handed out and not yet freed (``cudaMemPoolAttrUsedMemCurrent``)."""
        return _cuda.mem_pool_get_attribute(self._pool, "UsedMemCurrent")

    def export_pool_handle(self) -> int:
        """A POSIX file descriptor another process can open the pool with (needs ``enable_ipc``)."""
        if not self._ipc:
            raise ValueError(
                "this CudaAsyncMemoryResource was made with enable_ipc=False; make it with "
                "enable_ipc=True to export its pool"
            )
        return _cuda.mem_pool_export_to_shareable_handle(self._pool, _HANDLE_POSIX_FD)

    def __del__(self):
        # In cyclic garbage a pool over this resource may give its chunks back after this runs:
        # the memory pool is destroyed once nothing allocated from it is live (by the last
        # deallocate if need be), never under live allocations (segfaults in the driver).
        if getattr(self, "_owns_pool", False):
            self._finalized = True
            if not len(self._owned):
                self._destroy_pool()

    def _destroy_pool(self) -> None:
        if self._owns_pool:
            self._owns_pool = False
            try:
                _cuda.mem_pool_destroy(self._pool)
            except Exception:
                pass


class SamHeadroomMemoryResource(_BaseResource):
    """System-allocated memory (SAM, needs HMM or ATS) from the host allocator; of each
    allocation, the part that fits in device memory above ``headroom`` is advised to the GPU.

    Parameters
    ----------
    headroom : int or str
        Device memory to leave free for other CUDA work; ints, ``"2GiB"`` or a fraction.
    """

    def __init__(self, headroom: int | str):
        _cuda.require_cuda("SamHeadroomMemoryResource")
        device = _cuda.get_device()
        self.headroom = parse_device_bytes(headroom, device, 1, option="headroom") or 0
        if not _cuda.get_device_attribute("PageableMemoryAccess", device):
            raise _cuda.CUDAError(
                "cudaErrorNotSupported",
                "SamHeadroomMemoryResource",
                f"SamHeadroomMemoryResource: device {device} cannot access system-allocated "
                "(pageable) memory (cudaDevAttrPageableMemoryAccess is 0; needs HMM or ATS)",
            )
        super().__init__()
        self._system = SystemMemoryResource(device_id=device)

    def _alloc(self, nbytes: int, stream_handle: int) -> int:
        ptr = self._system.allocate(nbytes)
        try:
            free_bytes = _cuda.mem_get_info()[0]
            allocatable = max(free_bytes - self.headroom, 0)
            gpu_part = min(allocatable, nbytes) // ALIGNMENT * ALIGNMENT
            if gpu_part:
                _cuda.mem_advise_preferred_location(ptr, gpu_part, self.device_id)
            if nbytes - gpu_part:
                _cuda.mem_advise_preferred_location(
                    ptr + gpu_part, nbytes - gpu_part, _cuda.CPU_DEVICE_ID
                )
        except BaseException:
            self._system.deallocate(ptr, nbytes)
            raise
        return ptr

    def _free(self, ptr: int, nbytes: int, stream_handle: int) -> None:
        self._system.deallocate(ptr, nbytes)

    def _repr_fields(self) -> str:
        return f"headroom={format_bytes(self.headroom)}"


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.aligned_alloc.restype = ctypes.c_void_p
    libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    libc.free.restype = None
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


class SystemMemoryResource(_BaseResource):
    """Host memory from the C allocator, 256-byte aligned (device-usable with system-allocated
    memory support): what the resources run on without a GPU, chosen explicitly
    (``base_resource="system"``), never as a fallback."""

    def __init__(self, device_id: int | None = None):
        self._libc = _libc()
        if device_id is None:
            device_id = _cuda.current_device()
        elif isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"device_id must be a device id (an int >= 0), got {device_id!r}")
        DeviceMemoryResource.__init__(self, device_id=device_id)
        self._multi_device = False
        self._owned: dict[int, int] = {}
        self._host_total = host_total_memory()

    @property
    def is_host_memory(self) -> bool:
        return True

    def _alloc(self, nbytes: int, stream_handle: int) -> int:
        size = align_up(nbytes)
        # More than the host's physical memory is refused even where the kernel overcommits
        # (malloc then succeeds and the process dies on touching the pages).
        fits = size <= self._host_total
        ptr = self._libc.aligned_alloc(ALIGNMENT, size) if fits else None
        if not ptr:
            raise OutOfMemoryError(
                f"SystemMemoryResource out of memory: requested {format_bytes(nbytes)} "
                f"({nbytes} bytes) of host memory"
                + ("" if fits else f", more than this host's {format_bytes(self._host_total)}"),
                requested=nbytes,
                resource="SystemMemoryResource",
            )
        return ptr

    def _free(self, ptr: int, nbytes: int, stream_handle: int) -> None:
        self._libc.free(ptr.__index__())  # a NumPy integer is not a c_void_p
