"""CUDA streams as seen by memory resources: ``Stream`` (an integer handle; resources key free
lists on :meth:`Stream.order_key`, one per thread for the per-thread default stream),
``CudaStreamFlags``, the default streams and ``CudaStreamPool``."""

from __future__ import annotations

import enum
import itertools
import threading
from typing import Any

from dask_rmm import _cuda

__all__ = [
    "DEFAULT_STREAM",
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "CudaStreamFlags",
    "CudaStreamPool",
    "Stream",
    "as_stream",
]


class CudaStreamFlags(enum.IntEnum):
    """RMM's names for ``cudaStreamDefault`` (``SYNC_DEFAULT``: ordered with the legacy default
    stream) and ``cudaStreamNonBlocking`` (``NON_BLOCKING``: concurrent with it)."""

    SYNC_DEFAULT = 0
    NON_BLOCKING = 1


def _check_flags(flags: Any) -> CudaStreamFlags:
    if isinstance(flags, bool) or not isinstance(flags, int):
        raise TypeError(f"flags must be a CudaStreamFlags, got {flags!r} ({type(flags).__name__})")
    try:
        return CudaStreamFlags(flags)
    except ValueError:
        raise ValueError(
            f"flags must be CudaStreamFlags.SYNC_DEFAULT (0) or NON_BLOCKING (1), got {flags!r}"
        ) from None


# cudaStreamLegacy and cudaStreamPerThread are these fixed handle values in the CUDA runtime.
_LEGACY_HANDLE = 1
#: The handle of the per-thread default stream (``cudaStreamPerThread``): the only handle whose
#: :meth:`Stream.order_key` differs per thread.
PER_THREAD_HANDLE = 2


def _handle_of(obj: Any) -> int:
    """The integer stream handle of a foreign stream object."""
    if isinstance(obj, (bool, float)):
        raise TypeError(
            f"cannot make a Stream from {obj!r}: expected an int handle or a stream object"
        )
    if isinstance(obj, int):
        if obj < 0:
            raise ValueError(f"stream handle must be >= 0, got {obj}")
        return obj
    if (proto := getattr(obj, "__cuda_stream__", None)) is not None:
        version, handle = proto() if callable(proto) else proto
        if version != 0:
            raise NotImplementedError(
                f"cannot make a Stream from {type(obj).__name__}: CUDA stream protocol "
                f"version: '{version}' is not supported (only version 0)"
            )
        return int(handle)
    # CuPy streams expose .ptr, Numba streams .handle (a ctypes c_void_p or int),
    # cuda-python's CUstream/cudaStream_t convert with int().
    ptr = getattr(obj, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    if (handle := getattr(obj, "handle", None)) is not None:
        value = getattr(handle, "value", handle)
        return int(value or 0)
    try:
        return int(obj)
    except (TypeError, ValueError):
        raise TypeError(
            f"cannot make a Stream from {type(obj).__name__}: expected an int handle, "
            "a Stream, a CuPy/Numba/cuda-python stream or an object with __cuda_stream__"
        ) from None


_this_thread = threading.local()
_ptds_serials = itertools.count(1)  # next() is one C call: atomic


class _DrainAtThreadExit:
    """In a thread's ``threading.local`` once it uses its per-thread default stream: CPython
    releases the locals in the exiting thread, so ``__del__`` drains that stream there (a
    thread exiting with work pending was seen to stall the driver's teardown; docs/internals.md)."""

    __slots__ = ()

    def __del__(self):
        try:
            PER_THREAD_DEFAULT_STREAM.synchronize()
        except Exception:  # a thread's exit, or interpreter shutdown: nothing to report to
            pass


def own_per_thread_key() -> tuple[str, int] | None:
    """This thread's per-thread stream key if it has one yet, else None; makes none."""
    return getattr(_this_thread, "ptds_key", None)


class Stream:
    """A CUDA stream: ``Stream()`` creates and owns one (``flags`` default ``SYNC_DEFAULT``, as
    RMM's); ``Stream(obj)`` wraps an int handle, a CuPy, Numba or cuda-python stream or anything
    with ``__cuda_stream__``, keeping ``obj`` alive and never destroying it. Needs a GPU:

    >>> s = Stream(flags=CudaStreamFlags.NON_BLOCKING)  # doctest: +SKIP
    >>> s.synchronize()  # doctest: +SKIP
    """

    __slots__ = ("handle", "_owner", "_owned", "__weakref__")

    def __init__(self, obj: Any = None, flags: CudaStreamFlags | None = None):
        if obj is None:
            flags = CudaStreamFlags.SYNC_DEFAULT if flags is None else _check_flags(flags)
            self.handle = _cuda.stream_create(flags=int(flags))
            self._owner = None
            self._owned = True
        elif flags is not None:
            raise ValueError(
                "flags may only be specified when obj is None: flags cannot be applied to an "
                f"existing stream ({type(obj).__name__})"
            )
        else:
            self.handle = obj.handle if isinstance(obj, Stream) else _handle_of(obj)
            self._owner = obj
            self._owned = False

    @classmethod
    def _from_handle(cls, handle: int) -> Stream:
        s = cls.__new__(cls)
        s.handle = handle
        s._owner = None
        s._owned = False
        return s

    def is_default(self) -> bool:
        """True for the legacy and per-thread default streams (handles 0, 1 and 2)."""
        return self.handle <= PER_THREAD_HANDLE

    def is_per_thread_default(self) -> bool:
        return self.handle == PER_THREAD_HANDLE

    def order_key(self) -> int | tuple[str, int]:
        """What stream-ordered allocators key free lists on: the handle, or for the per-thread
        default stream the thread's own ``("ptds", n)``, ``n`` a number no other thread of this
        process has had (thread ids are reused while an exited thread's work may still run);
        making it arms :class:`_DrainAtThreadExit`."""
        if self.handle != PER_THREAD_HANDLE:
            return self.handle
        key = own_per_thread_key()
        if key is None:
            _this_thread.drain_at_exit = _DrainAtThreadExit()
            key = _this_thread.ptds_key = ("ptds", next(_ptds_serials))
        return key

    def synchronize(self) -> None:
        """Wait for all work on this stream (a default stream without CUDA: nothing to wait for)."""
        if self.handle <= PER_THREAD_HANDLE and not _cuda.is_available():
            return
        _cuda.stream_synchronize(self.handle)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    @property
    def value(self) -> int:
        return self.handle

    def __int__(self) -> int:
        return self.handle

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.handle == self.handle

    def __hash__(self) -> int:
        return hash(self.handle)

    def __repr__(self) -> str:
        names = {
            0: "DEFAULT_STREAM",
            _LEGACY_HANDLE: "LEGACY_DEFAULT_STREAM",
            PER_THREAD_HANDLE: "PER_THREAD_DEFAULT_STREAM",
        }
        return f"<Stream {names.get(self.handle, hex(self.handle))}>"

    def __del__(self):
        if getattr(self, "_owned", False):
            try:
                _cuda.stream_destroy(self.handle)
            except Exception:
                pass


DEFAULT_STREAM = Stream._from_handle(0)
LEGACY_DEFAULT_STREAM = Stream._from_handle(_LEGACY_HANDLE)
PER_THREAD_DEFAULT_STREAM = Stream._from_handle(PER_THREAD_HANDLE)


#: Stream objects by handle, so that the allocator hooks' hot paths make none (one dict get;
#: :func:`cached_stream` on a miss).
handle_streams: dict[int, Stream] = {}


def cached_stream(handle: int, owner: Any = None) -> Stream:
    """A :class:`Stream` of ``handle``, kept in :data:`handle_streams` (cleared at 1024
    entries). Unless it is a default stream, it keeps ``owner`` (the library's stream object)
    alive, so that an array outliving that object is still freed on a live handle."""
    if len(handle_streams) >= 1024:
        handle_streams.clear()
    stream = handle_streams[handle] = Stream._from_handle(handle)
    if handle > PER_THREAD_HANDLE:
        stream._owner = owner
    return stream


def as_stream(obj: Any) -> Stream:
    """``obj`` as a :class:`Stream` (``None`` means the default stream)."""
    if obj is None:
        return DEFAULT_STREAM
    return obj if isinstance(obj, Stream) else Stream(obj)


class CudaStreamPool:
    """``pool_size`` streams made with ``flags``, handed out round-robin, as RMM's
    ``CudaStreamPool``."""

    def __init__(self, pool_size: int = 16, flags: CudaStreamFlags = CudaStreamFlags.SYNC_DEFAULT):
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"pool_size must be a positive int, got {pool_size!r}")
        flags = _check_flags(flags)
        self._streams = [Stream(flags=flags) for _ in range(pool_size)]
        self._turns = itertools.count()

    def get_stream(self, stream_id: int | None = None) -> Stream:
        """The next stream round-robin, or stream ``stream_id`` (wrapping around the pool size)."""
        if stream_id is None:
            stream_id = next(self._turns)
        return self._streams[stream_id % len(self._streams)]

    def get_pool_size(self) -> int:
        return len(self._streams)
