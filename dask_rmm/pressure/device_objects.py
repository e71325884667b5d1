"""What can be spilled: finding the device allocations a task output holds, and moving it to
host memory and back bit for bit (dtype, shape, strides and order kept).

Handled: :class:`~dask_rmm.DeviceBuffer`, CuPy arrays, Numba device arrays, and tuples, lists
and dicts of them (up to ``MAX_CONTAINER_ITEMS`` items, two levels deep). Anything else is not a
device object and stays where it is. Add a type with :func:`register_device_type`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "MAX_CONTAINER_ITEMS",
    "DeviceAllocation",
    "HostCopy",
    "device_allocations",
    "register_device_type",
    "spill_batch",
    "to_host",
]

#: Containers with more items than this are not looked into (a list of a million floats would
#: otherwise be walked on every store).
MAX_CONTAINER_ITEMS = 64
_MAX_DEPTH = 2


@dataclass(frozen=True)
class DeviceAllocation:
    """One block of device memory an object holds: the device, its address and size.

    ``ptr`` is where the allocation starts when it is known (so that a pool can tell which of
    its blocks would be freed), else where the object's bytes start.
    """

    device: int
    ptr: int
    nbytes: int


class HostCopy:
    """A device object's bytes in host memory, with what is needed to rebuild it.

    ``to_device()`` rebuilds the object on the device from the device's current resource
    (the worker's stack; a DeviceBuffer made with another ``mr`` comes back on the current
    one). Picklable, so that distributed can spill it on to disk.
    """

    __slots__ = ("kind", "device", "data", "meta", "nbytes")

    def __init__(self, kind: str, device: int, data: Any, meta: Any, nbytes: int):
        self.kind = kind
        self.device = device
        self.data = data
        self.meta = meta
        self.nbytes = nbytes

    def to_device(self) -> Any:
        if self.kind not in _REBUILD:  # made in another process: register what can be
            for register in set(_LAZY.values()):
                _register_once(register)
        return _REBUILD[self.kind](self)

    def __sizeof__(self) -> int:
        return self.nbytes + 200

    def __repr__(self) -> str:
        return f"<HostCopy of a {self.kind} ({self.nbytes} bytes) from device {self.device}>"


_batch = threading.local()


@contextlib.contextmanager
def spill_batch() -> Iterator[None]:
    """Copies to host made by this thread inside the block synchronize each device once (CuPy
    and Numba arrays do not say which stream wrote them; victims chosen together are outputs
    nothing references, so the first synchronization covers all)."""
    outer = getattr(_batch, "synchronized", None)
    _batch.synchronized = set() if outer is None else outer
    try:
        yield
    finally:
        _batch.synchronized = outer


def _synchronize(device: int, synchronize: Callable[[], Any]) -> None:
    """``synchronize()`` (the device's), unless already done in this thread's spill batch."""
    done = getattr(_batch, "synchronized", None)
    if done is not None:
        if device in done:
            return
        done.add(device)
    synchronize()


# type -> (allocations(obj) -> list[DeviceAllocation], to_host(obj) -> HostCopy)
_TYPES: dict[type, tuple[Callable[[Any], list], Callable[[Any], HostCopy]]] = {}
_REBUILD: dict[str, Callable[[HostCopy], Any]] = {}
_lazy_done: set[Callable[[], None]] = set()


def register_device_type(
    cls: type,
    allocations: Callable[[Any], list[DeviceAllocation]],
    to_host: Callable[[Any], HostCopy],
    kind: str,
    rebuild: Callable[[HostCopy], Any],
) -> None:
    """Make instances of ``cls`` (exactly that type) spillable.

    ``allocations(obj)`` lists the device memory ``obj`` holds, ``to_host(obj)`` returns a
    :class:`HostCopy` of kind ``kind`` without allocating device memory if it can, and
    ``rebuild(copy)`` makes an equal object on the device.
    """
    _TYPES[cls] = (allocations, to_host)
    _REBUILD[kind] = rebuild


def _register_once(register: Callable[[], None] | None) -> None:
    if register is not None and register not in _lazy_done:
        _lazy_done.add(register)
        register()


def _handlers(cls: type):
    if cls not in _TYPES:
        # Registered on first sight of the library's types: importing this module imports
        # neither CuPy, Numba nor CUDA.
        module = cls.__module__
        _register_once(_LAZY.get(module.partition(".")[0]) or _LAZY.get(module))
    return _TYPES.get(cls)


def device_allocations(obj: Any, _depth: int = 0) -> list[DeviceAllocation] | None:
    """The device allocations ``obj`` holds, or None if it is not a device object (nothing in
    it is spillable)."""
    cls = type(obj)
    if cls is tuple or cls is list or cls is dict:
        if _depth >= _MAX_DEPTH or len(obj) > MAX_CONTAINER_ITEMS or not obj:
            return None
        subs = [device_allocations(x, _depth + 1) for x in (obj.values() if cls is dict else obj)]
        if all(sub is None for sub in subs):
            return None
        return [a for sub in subs if sub is not None for a in sub]
    if cls in (int, float, str, bytes, np.ndarray, type(None), bool):
        return None
    handlers = _handlers(cls)
    return None if handlers is None else handlers[0](obj)


def to_host(obj: Any) -> Any:
    """A host copy of the device object ``obj`` (containers copied item by item).

    The caller keeps ``obj``: its device memory is freed when the last reference goes.
    """
    cls = type(obj)
    if cls is tuple or cls is list:
        return _container_copy(cls.__name__, [to_host(x) for x in obj])
    if cls is dict:
        return _container_copy("dict", {k: to_host(v) for k, v in obj.items()})
    handlers = _handlers(cls)
    return obj if handlers is None else handlers[1](obj)  # a non-device leaf stays as it is


def _container_copy(kind: str, data: Any) -> HostCopy:
    items = data.values() if isinstance(data, dict) else data
    return HostCopy(kind, -1, data, None, sum(x.nbytes for x in items if isinstance(x, HostCopy)))


def _unspill(x: Any) -> Any:
    return x.to_device() if isinstance(x, HostCopy) else x


_REBUILD["tuple"] = lambda c: tuple(_unspill(x) for x in c.data)
_REBUILD["list"] = lambda c: [_unspill(x) for x in c.data]
_REBUILD["dict"] = lambda c: {k: _unspill(v) for k, v in c.data.items()}


# -- DeviceBuffer ------------------------------------------------------------------------------


def _register_device_buffer() -> None:
    from dask_rmm.device_buffer import DeviceBuffer

    def allocations(buf):
        return [DeviceAllocation(buf.mr.device_id, buf.ptr, buf.capacity())] if buf.ptr else []

    def spill(buf):
        data = buf.copy_to_host(stream=buf.stream)
        if not buf.stream.is_default():
            buf.stream.synchronize()
        return HostCopy("DeviceBuffer", buf.mr.device_id, data, None, buf.size)

    def rebuild(copy):
        from dask_rmm.device_buffer import to_device
        from dask_rmm.mr.registry import get_per_device_resource

        return to_device(copy.data, mr=get_per_device_resource(copy.device))

    register_device_type(DeviceBuffer, allocations, spill, "DeviceBuffer", rebuild)


# -- CuPy --------------------------------------------------------------------------------------


def _span(shape, strides, itemsize: int) -> tuple[int, int]:
    """Byte offsets ``[lo, hi)`` of an array's elements relative to its data pointer."""
    if any(n == 0 for n in shape):
        return 0, 0
    lo = sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    hi = itemsize + sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s > 0)
    return lo, hi


def _register_cupy() -> None:
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return

    def allocations(arr):
        mem = arr.data.mem
        return [DeviceAllocation(arr.device.id, mem.ptr, mem.size)] if mem.ptr else []

    def spill(arr):
        from dask_rmm import _cuda
        from dask_rmm.device_buffer import copy_ptr_to_host

        lo, hi = _span(arr.shape, arr.strides, arr.itemsize)
        data = np.empty(hi - lo, dtype=np.uint8)
        if hi > lo:
            with cupy.cuda.Device(arr.device.id):
                # Whatever stream wrote the array (CuPy's streams may be non-blocking) is done
                # before the bytes are read; the copy then synchronizes the default stream.
                _synchronize(arr.device.id, _cuda.device_synchronize)
                copy_ptr_to_host(arr.data.ptr + lo, data)
        meta = (arr.shape, arr.strides, arr.dtype.str, -lo)
        return HostCopy("cupy", arr.device.id, data, meta, hi - lo)

    def rebuild(copy):
        from dask_rmm.device_buffer import copy_host_to_ptr
        from dask_rmm.stream import Stream

        shape, strides, dtype, offset = copy.meta
        with cupy.cuda.Device(copy.device):
            mem = cupy.cuda.alloc(max(copy.nbytes, 1))
            if copy.nbytes:
                # On the stream the block was allocated on (CuPy's current one): ordered after
                # the block's previous use; synchronized, as the host bytes go away after.
                stream = Stream(cupy.cuda.get_current_stream())
                copy_host_to_ptr(copy.data, mem.ptr, stream)
                stream.synchronize()
            return cupy.ndarray(shape, dtype=dtype, memptr=mem + offset, strides=strides)

    register_device_type(cupy.ndarray, allocations, spill, "cupy", rebuild)


# -- Numba -------------------------------------------------------------------------------------


def _register_numba() -> None:
    try:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
    except ImportError:
        return

    def allocations(arr):
        cai = arr.__cuda_array_interface__
        lo, hi = _span(arr.shape, arr.strides, arr.dtype.itemsize)
        if hi <= lo:
            return []
        device = arr.gpu_data.context.device.id if hasattr(arr.gpu_data, "context") else 0
        return [DeviceAllocation(device, int(cai["data"][0]) + lo, hi - lo)]

    def spill(arr):
        from numba import cuda

        from dask_rmm.device_buffer import copy_ptr_to_host

        device = arr.gpu_data.context.device.id if hasattr(arr.gpu_data, "context") else 0
        lo, hi = _span(arr.shape, arr.strides, arr.dtype.itemsize)
        if lo < 0:
            raise TypeError("a Numba array with negative strides is not spilled")
        # The bytes the array spans, from its data pointer: a view keeps its strides (numba's
        # to_device only takes contiguous host arrays back).
        data = np.empty(hi, dtype=np.uint8)
        if hi:
            with cuda.gpus[device]:
                _synchronize(device, cuda.synchronize)
                copy_ptr_to_host(int(arr.__cuda_array_interface__["data"][0]), data)
        return HostCopy("numba", device, data, (arr.shape, arr.strides, arr.dtype.str), hi)

    def rebuild(copy):
        from numba import cuda

        shape, strides, dtype = copy.meta
        with cuda.gpus[copy.device]:
            buf = cuda.to_device(copy.data)  # contiguous bytes
            return DeviceNDArray(shape, strides, np.dtype(dtype), gpu_data=buf.gpu_data)

    register_device_type(DeviceNDArray, allocations, spill, "numba", rebuild)


_LAZY: dict[str, Callable[[], None]] = {
    "dask_rmm.device_buffer": _register_device_buffer,
    "cupy": _register_cupy,
    "cupy_backends": _register_cupy,
    "numba": _register_numba,
    "numba_cuda": _register_numba,
}
