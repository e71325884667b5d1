"""``DeviceBuffer``, an untyped, resizable allocation from a memory resource with RMM's API, and
RMM's pointer copy helpers. Copies on a default stream synchronize it, on another are
asynchronous; host memory (or no GPU) is copied with ``memmove``. Importing this module
registers DeviceBuffer's Dask serializers with distributed (at the end of this file: where
DeviceBuffer lives, as distributed has no lazy door for a type whose module may load first).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

import numpy as np

from dask_rmm import _cuda
from dask_rmm.logger import OneLineFor
from dask_rmm.mr.base import DeviceMemoryResource, check_nbytes, stream_arg
from dask_rmm.mr.registry import get_current_device_resource
from dask_rmm.sizes import format_bytes
from dask_rmm.stream import DEFAULT_STREAM, Stream, as_stream

__all__ = [
    "DeviceBuffer",
    "NoMemoryForDeviceBufferError",
    "copy_device_to_ptr",
    "copy_host_to_ptr",
    "copy_ptr_to_host",
    "to_device",
]

logger = logging.getLogger(__name__)


def _host_bytes(obj: Any, writable: bool, what: str) -> np.ndarray:
    """A C-contiguous host buffer as a flat uint8 array sharing its memory (as RMM's
    ``unsigned char[::1]``)."""
    try:
        arr = np.frombuffer(obj, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{what} must be a C-contiguous bytes-like object: {e}") from None
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} is read-only; copying into it needs a writable buffer")
    return arr


def _address(arr: np.ndarray) -> int:
    return arr.ctypes.data if arr.size else 0


def _copy(dst: int, src: int, nbytes: int, stream: Stream, host: bool) -> None:
    """Copy ``nbytes`` in stream order: synchronous on a default stream, else asynchronous."""
    if nbytes == 0:
        return
    if host or not _cuda.is_available():
        if _cuda.is_available():
            # Earlier work on the stream may still touch this host memory.
            stream.synchronize()
        ctypes.memmove(dst, src, nbytes)
        return
    _cuda.memcpy_async(dst, src, nbytes, stream.handle)
    if stream.is_default():
        stream.synchronize()


def copy_ptr_to_host(db: int, hb: Any, stream: Stream = DEFAULT_STREAM) -> None:
    """Copy ``len(hb)`` bytes from the pointer ``db`` into the writable host buffer ``hb``.

    Examples
    --------
    >>> from dask_rmm.mr import SystemMemoryResource
    >>> buf = DeviceBuffer.to_device(b"abc", mr=SystemMemoryResource())
    >>> hb = bytearray(3)
    >>> copy_ptr_to_host(buf.ptr, hb)
    >>> hb
    bytearray(b'abc')
    """
    stream = stream_arg(stream)
    arr = _host_bytes(hb, True, "hb")
    _copy(_address(arr), check_nbytes(db, "db"), arr.nbytes, stream, False)


def copy_host_to_ptr(hb: Any, db: int, stream: Stream = DEFAULT_STREAM) -> None:
    """Copy all of the host buffer ``hb`` to the pointer ``db``."""
    stream = stream_arg(stream)
    arr = _host_bytes(hb, False, "hb")
    _copy(check_nbytes(db, "db"), _address(arr), arr.nbytes, stream, False)


def copy_device_to_ptr(d_src: int, d_dst: int, count: int, stream: Stream = DEFAULT_STREAM) -> None:
    """Copy ``count`` bytes from pointer ``d_src`` to pointer ``d_dst``."""
    stream = stream_arg(stream)
    count = check_nbytes(count, "count")
    _copy(check_nbytes(d_dst, "d_dst"), check_nbytes(d_src, "d_src"), count, stream, False)


def _free_failed(ptr: int, nbytes: int, error: Exception, what: str = "DeviceBuffer") -> None:
    """Report a free that raised in a finalizer (which must never raise)."""
    try:
        logger.warning("%s: freeing %#x (%d bytes) failed: %r", what, ptr, nbytes, error)
    except Exception:
        pass


class DeviceBuffer:
    """An untyped allocation of ``size`` bytes from a memory resource, as RMM's ``DeviceBuffer``.

    Parameters
    ----------
    ptr : int, optional
        A host or device pointer to copy ``size`` bytes from; None or 0 leaves the memory
        uninitialized.
    size : int
        Bytes to allocate (and to copy from ``ptr``).
    stream : Stream
        The stream the buffer allocates, copies and frees on. Kept alive with the buffer. With
        ``ptr`` and a default stream the constructor synchronizes; otherwise the copy is
        asynchronous.
    mr : DeviceMemoryResource, optional
        Where the memory comes from; default the current device's resource. Kept alive with the
        buffer, so replacing the current resource never invalidates a live buffer.

    Examples
    --------
    >>> from dask_rmm.mr import SystemMemoryResource
    >>> buf = DeviceBuffer.to_device(b"abc", mr=SystemMemoryResource())
    >>> buf.size, bytes(buf)
    (3, b'abc')
    """

    __slots__ = ("_ptr", "_size", "_capacity", "mr", "stream", "__weakref__")

    def __init__(
        self,
        *,
        ptr: int | None = None,
        size: int = 0,
        stream: Stream = DEFAULT_STREAM,
        mr: DeviceMemoryResource | None = None,
    ):
        # The common call, DeviceBuffer(size=n), runs only the cheap checks: it is on every
        # allocation's path (bench/README.md, DeviceBuffer row).
        self._ptr = 0  # what __del__ reads if the allocation below fails
        if type(size) is not int or size < 0:
            size = check_nbytes(size, "size")
        src = 0 if ptr is None else check_nbytes(ptr, "ptr")
        if type(stream) is not Stream:
            stream = stream_arg(stream)
        if mr is None:
            mr = get_current_device_resource()
        elif not isinstance(mr, DeviceMemoryResource):
            raise TypeError(f"mr must be a DeviceMemoryResource, got {type(mr).__name__}")
        self.mr = mr
        self.stream = stream
        self._capacity = self._size = size
        self._ptr = mr.allocate(size, stream)
        if src and size:
            _copy(self._ptr, src, size, stream, mr.is_host_memory)

    @classmethod
    def _adopt(
        cls, ptr: int, nbytes: int, stream: Stream, mr: DeviceMemoryResource
    ) -> DeviceBuffer:
        """A buffer owning ``ptr``, allocated from ``mr`` with ``nbytes`` on ``stream``; no checks
        and no copy (for the CuPy allocator's hot path, whose owner is a DeviceBuffer as RMM's)."""
        self = cls.__new__(cls)
        self._ptr = ptr
        self._size = self._capacity = nbytes
        self.mr = mr
        self.stream = stream
        return self

    # Bound as defaults: at interpreter shutdown a module's globals may be None already.
    def __del__(self, _free_failed=_free_failed, _finalizing=sys.is_finalizing):
        try:
            ptr = self._ptr
        except AttributeError:  # made by __new__ alone
            return
        if ptr:
            if _finalizing():  # the memory goes with the process; the resources may be torn down
                return
            self._ptr = 0
            try:
                self.mr.deallocate(ptr, self._capacity, self.stream)
            except Exception as e:
                _free_failed(ptr, self._capacity, e)

    # --- properties --------------------------------------------------------------------------

    @property
    def ptr(self) -> int:
        """The address of the first byte (0 for an empty buffer)."""
        return self._ptr

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    nbytes = size

    def capacity(self) -> int:
        """Bytes allocated, at least :attr:`size` (see :meth:`reserve`)."""
        return self._capacity

    def __len__(self) -> int:
        return self._size

    __sizeof__ = __len__

    def __bytes__(self) -> bytes:
        return self.tobytes()

    def __repr__(self) -> str:
        return f"<DeviceBuffer size={self._size} ptr={self._ptr:#x} mr={self.mr!r}>"

    @property
    def __cuda_array_interface__(self) -> dict:
        """Version 3 of the CUDA Array Interface, one dimension of bytes; ``stream`` is the
        buffer's (1, the legacy default stream, for handle 0, which the interface reserves)."""
        handle = self.stream.handle
        return {
            "data": (self._ptr, False),
            "shape": (self._size,),
            "strides": None,
            "typestr": "|u1",
            "version": 3,
            "stream": handle if handle else 1,
        }

    # --- copies ------------------------------------------------------------------------------

    @staticmethod
    def to_device(
        b: Any, stream: Stream = DEFAULT_STREAM, mr: DeviceMemoryResource | None = None
    ) -> DeviceBuffer:
        """A new buffer holding a copy of the bytes-like host object ``b``."""
        return to_device(b, stream, mr)

    def copy_to_host(self, ary: Any = None, stream: Stream = DEFAULT_STREAM) -> Any:
        """Copy the buffer into ``ary`` (a writable bytes-like of at least :attr:`size` bytes),
        or into a new ``numpy.uint8`` array when ``ary`` is None, and return it."""
        stream = stream_arg(stream)
        if ary is None:
            ary = np.empty(self._size, dtype=np.uint8)
        arr = _host_bytes(ary, True, "ary")
        if arr.nbytes < self._size:
            raise ValueError(
                f"ary is too small: {arr.nbytes} bytes, the buffer holds {self._size} bytes"
            )
        self._order_before(stream)
        _copy(_address(arr), self._ptr, self._size, stream, self.mr.is_host_memory)
        return ary

    def copy_from_host(self, ary: Any, stream: Stream = DEFAULT_STREAM) -> None:
        """Copy the bytes-like ``ary`` into the start of the buffer."""
        stream = stream_arg(stream)
        arr = _host_bytes(ary, False, "ary")
        if arr.nbytes > self._size:
            raise ValueError(
                f"ary is too large: {arr.nbytes} bytes, the buffer holds {self._size} bytes"
            )
        self._order_before(stream)
        _copy(self._ptr, _address(arr), arr.nbytes, stream, self.mr.is_host_memory)

    def copy_from_device(self, cuda_ary: Any, stream: Stream = DEFAULT_STREAM) -> None:
        """Copy a 1-D contiguous object with ``__cuda_array_interface__`` into the buffer
        (``stream`` first waits for the stream the source names, if any)."""
        stream = stream_arg(stream)
        cai = getattr(cuda_ary, "__cuda_array_interface__", None)
        if cai is None:
            raise ValueError(
                f"expected an object with __cuda_array_interface__, got {type(cuda_ary).__name__}"
            )
        shape = cai["shape"]
        itemsize = np.dtype(cai["typestr"]).itemsize
        if len(shape) > 1:
            raise ValueError(f"only 1-D contiguous arrays can be copied, got shape {shape}")
        strides = cai.get("strides")
        if strides is not None and shape and shape[0] > 1 and strides[0] != itemsize:
            raise ValueError(f"only contiguous arrays can be copied, got strides {strides}")
        nbytes = (shape[0] if shape else 1) * itemsize
        if nbytes > self._size:
            raise ValueError(
                f"cuda_ary is too large: {nbytes} bytes, the buffer holds {self._size} bytes"
            )
        src_stream = cai.get("stream")
        if src_stream and src_stream != stream.handle and _cuda.is_available():
            _cuda.stream_wait_stream(stream.handle, src_stream)
        self._order_before(stream)
        _copy(self._ptr, int(cai["data"][0]), nbytes, stream, self.mr.is_host_memory)

    def tobytes(self, stream: Stream = DEFAULT_STREAM) -> bytes:
        """The buffer's contents as ``bytes``."""
        out = bytearray(self._size)
        self.copy_to_host(out, stream)
        return bytes(out)

    def copy(self) -> DeviceBuffer:
        """A new buffer, from the same resource and on the same stream, with the same bytes."""
        return DeviceBuffer(ptr=self._ptr, size=self._size, stream=self.stream, mr=self.mr)

    __copy__ = copy

    def __reduce__(self):
        # A numpy array, not bytes: with pickle protocol 5 numpy hands its memory out as the one
        # out-of-band PickleBuffer, so no second host copy is made.
        return (to_device, (self.copy_to_host(),))

    def _order_before(self, stream: Stream) -> None:
        """Make a copy on ``stream`` start after the work queued on the buffer's own stream (RMM
        relies on ``Stream()`` being ordered with the legacy default stream; this also covers
        non-blocking streams): on a default stream by synchronizing it, else by an event."""
        own = self.stream
        if own.handle == stream.handle or not self._ptr or not _cuda.is_available():
            return
        if own.handle == 0 and stream.handle == 1 or own.handle == 1 and stream.handle == 0:
            return  # 0 and 1 are both the legacy default stream
        if stream.is_default() and not stream.is_per_thread_default():
            own.synchronize()
            return
        _cuda.stream_wait_stream(stream.handle, own.handle)

    # --- size changes ------------------------------------------------------------------------

    def _reserve(self, new_capacity: int, stream: Stream) -> None:
        """Move the buffer to ``stream``, reallocated to ``new_capacity`` bytes if it needs more."""
        if new_capacity <= self._capacity:
            self.stream = stream
            return
        new_ptr = self.mr.allocate(new_capacity, stream)
        try:
            _copy(new_ptr, self._ptr, min(self._size, new_capacity), stream, self.mr.is_host_memory)
        except BaseException:
            self.mr.deallocate(new_ptr, new_capacity, stream)
            raise
        old_ptr, old_capacity = self._ptr, self._capacity
        self._ptr, self._capacity, self.stream = new_ptr, new_capacity, stream
        if old_ptr:
            # Freed on the copying stream, so in stream order after the copy out of it.
            self.mr.deallocate(old_ptr, old_capacity, stream)

    def reserve(self, new_capacity: int, stream: Stream = DEFAULT_STREAM) -> None:
        """Grow the allocation to at least ``new_capacity`` bytes, keeping :attr:`size` and the
        contents. Does nothing when the capacity is already enough. The buffer moves to ``stream``."""
        self._reserve(check_nbytes(new_capacity, "new_capacity"), stream_arg(stream))

    def resize(self, new_size: int, stream: Stream = DEFAULT_STREAM) -> None:
        """Change :attr:`size`, keeping the first ``min(size, new_size)`` bytes: beyond the
        capacity, reallocated to exactly ``new_size`` bytes. The buffer moves to ``stream``."""
        new_size = check_nbytes(new_size, "new_size")
        self._reserve(new_size, stream_arg(stream))
        self._size = new_size

    def prefetch(self, device: int | None = None, stream: Stream | None = None) -> None:
        """Prefetch managed memory to ``device`` (default the current device; ``-1``, the CPU);
        a no-op for memory that is not managed, and without a GPU."""
        if not self._ptr or not _cuda.is_available():
            return
        if _cuda.pointer_attributes(self._ptr).type != "managed":
            return
        stream = self.stream if stream is None else as_stream(stream)
        device = _cuda.get_device() if device is None else device
        _cuda.mem_prefetch_async(self._ptr, self._size, device, stream.handle)


def to_device(
    b: Any, stream: Stream = DEFAULT_STREAM, mr: DeviceMemoryResource | None = None
) -> DeviceBuffer:
    """A new :class:`DeviceBuffer` holding a copy of the bytes-like host object ``b``.

    Examples
    --------
    >>> from dask_rmm.mr import SystemMemoryResource
    >>> to_device(b"abc", mr=SystemMemoryResource()).tobytes()
    b'abc'
    """
    arr = _host_bytes(b, False, "b")
    return DeviceBuffer(ptr=_address(arr), size=arr.nbytes, stream=stream, mr=mr)


# -- Dask serialization ---------------------------------------------------------------------


class NoMemoryForDeviceBufferError(_cuda.CUDAUnavailableError):
    """A DeviceBuffer arrived in a process whose current resource needs a GPU it lacks (a
    client without a GPU gathering a result from host-memory workers)."""


def _received(header: dict, frames: list) -> DeviceBuffer:
    """The DeviceBuffer of a received frame: a DeviceBuffer as is; another device frame (a
    comm's receive buffer) or host bytes copied into a new buffer from the current resource."""
    (frame,) = frames
    nbytes = header["size"]
    if not isinstance(frame, DeviceBuffer):
        try:
            mr = get_current_device_resource()
        except _cuda.CUDAUnavailableError as e:
            raise NoMemoryForDeviceBufferError(
                e.error_name,
                e.call,
                f"cannot receive a DeviceBuffer ({format_bytes(nbytes)}): this process has no "
                "usable GPU for its default resource. To receive DeviceBuffers in host memory, "
                'call dask_rmm.reinitialize(base_resource="system") in it first (on a client: '
                "before gathering the result).",
            ) from None
        if hasattr(frame, "__cuda_array_interface__"):
            buf = DeviceBuffer(size=nbytes, mr=mr)
            buf.copy_from_device(frame)
            frame = buf
        else:
            frame = to_device(frame, mr=mr)
    if frame.size != nbytes:
        raise ValueError(f"DeviceBuffer frames hold {frame.size} bytes, the header says {nbytes}")
    return frame


# distributed's ``cuda`` family (the buffer itself, with the CUDA array interface's shape and type
# as RMM's serializer sends them: UCX) and ``dask`` family (one host frame, a copy: TCP, spilling).
def _cuda_dumps(buf: DeviceBuffer) -> tuple[dict, list]:
    shape = {"shape": (buf.size,), "typestr": "|u1", "strides": (1,)}
    return {"size": buf.size, **shape}, [buf]


def _dask_dumps(buf: DeviceBuffer) -> tuple[dict, list]:
    return {"size": buf.size}, [memoryview(buf.copy_to_host())]


# Imported here, after DeviceBuffer exists: distributed imports ``rmm`` (diagnostics/rmm.py),
# which tools/rmm_compat's shim serves from this module (tests/test_rmm_compat_tool.py).
from distributed.protocol import (  # noqa: E402
    cuda_deserialize,
    cuda_serialize,
    dask_deserialize,
    dask_serialize,
)

cuda_serialize.register(DeviceBuffer)(_cuda_dumps)
dask_serialize.register(DeviceBuffer)(_dask_dumps)
cuda_deserialize.register(DeviceBuffer)(_received)
dask_deserialize.register(DeviceBuffer)(_received)
# distributed logs every deserialization error with its traceback, then raises it
logging.getLogger("distributed.protocol.core").addFilter(OneLineFor(NoMemoryForDeviceBufferError))
