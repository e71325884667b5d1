"""The memory-resource interface, the upstream-adaptor base, size check and the
out-of-memory error. Nothing here touches CUDA. Not here: the locks (locks.py), concrete
resources (beside it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dask_rmm._cuda import CUDAError
from dask_rmm.stream import DEFAULT_STREAM, Stream, as_stream
from dask_rmm.wire import fragmentation

__all__ = [
    "CUDAAllocationError",
    "DeviceMemoryResource",
    "OutOfMemoryError",
    "ReservedMemoryInfo",
    "UpstreamResourceAdaptor",
]


#: The largest size an allocation can have (CUDA's ``size_t``).
SIZE_MAX = (1 << 64) - 1


def check_nbytes(nbytes: Any, what: str = "nbytes") -> int:
    """Validate an allocation size: an int (bools and floats refused) in ``[0, SIZE_MAX]``."""
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise TypeError(f"{what} must be an int, got {nbytes!r} ({type(nbytes).__name__})")
        nbytes = nbytes.__index__()
    if nbytes < 0:
        raise ValueError(f"{what} must be >= 0, got {nbytes}")
    if nbytes > SIZE_MAX:
        raise ValueError(f"{what} {nbytes} is larger than any allocation can be (2**64 - 1 bytes)")
    return nbytes


def stream_arg(stream: Any) -> Stream:
    """``stream`` as a Stream; None is refused as RMM refuses it (pass ``DEFAULT_STREAM``)."""
    if stream is None:
        raise TypeError(
            "stream argument cannot be None: pass a Stream (dask_rmm.DEFAULT_STREAM for the "
            "default stream)"
        )
    return as_stream(stream)


def deallocate_refused(
    resource: Any,
    name: str,
    ptr: Any,
    nbytes: Any,
    allocated: int | None,
    stream: Any,
    freed: bool = False,
) -> None:
    """The end of ``resource``'s ``deallocate`` when its fast path did not free ``ptr`` (live
    with ``allocated`` bytes, or None; ``freed``: a free block): ``(0, 0)`` does nothing, another
    int type is freed again as an int, any other pointer raises TypeError, the rest ValueError."""
    if ptr == 0 and nbytes == 0:
        return
    if type(ptr) is not int:
        if isinstance(ptr, bool) or not hasattr(ptr, "__index__"):
            raise TypeError(f"{name}.deallocate({ptr!r}, {nbytes!r}): the pointer must be an int")
        return resource.deallocate(ptr.__index__(), nbytes, stream)
    call = f"{name}.deallocate({ptr:#x}, {nbytes!r})"
    if allocated is not None:
        raise ValueError(
            f"{call}: wrong size, the pointer was allocated with {allocated} bytes; "
            "deallocate takes the size passed to allocate"
        )
    if freed:
        raise ValueError(f"{call}: {ptr:#x} is a free block of this resource (double free)")
    raise ValueError(
        f"{call}: not a live allocation of this resource (foreign pointer or double free)"
    )


@dataclass(frozen=True)
class ReservedMemoryInfo:
    """What a pooling resource holds from its upstream: ``reserved_bytes``, of which
    ``free_bytes`` are not handed out, ``largest_free_block`` the largest fitting without growing.
    """

    reserved_bytes: int
    free_bytes: int
    largest_free_block: int

    @property
    def fragmentation(self) -> float | None:
        """:func:`dask_rmm.wire.fragmentation`: ``1 - largest_free_block / free_bytes``, None
        when none of the pool is in use, 0.0 when nothing is free."""
        return fragmentation(self.reserved_bytes, self.free_bytes, self.largest_free_block)


class OutOfMemoryError(MemoryError):
    """A resource could not satisfy an allocation: a :class:`MemoryError` (what RMM raises for
    ``rmm::out_of_memory``) carrying the numbers; it pickles with every attribute and note."""

    def __init__(
        self,
        message: str,
        *,
        requested: int = 0,
        resource: str = "",
        stream: int | None = None,
        pool_size: int | None = None,
        maximum_pool_size: int | None = None,
        free_bytes: int | None = None,
        largest_free_block: int | None = None,
    ):
        super().__init__(message)
        self.requested = requested
        self.resource = resource
        self.stream = stream
        self.pool_size = pool_size
        self.maximum_pool_size = maximum_pool_size
        self.free_bytes = free_bytes
        self.largest_free_block = largest_free_block


class CUDAAllocationError(CUDAError, MemoryError):
    """An allocation failed for a reason other than out-of-memory (an invalid or destroyed pool,
    a device in an error state...): a :class:`MemoryError`, as RMM raises for every failed
    allocation, and a :class:`~dask_rmm.CUDAError` with CUDA's ``error_name`` and the call."""

    @classmethod
    def from_error(cls, error: CUDAError, what: str) -> CUDAAllocationError:
        """Wrap ``error`` with ``what`` was asked (resource, size, stream) in the message."""
        return cls(error.error_name, error.call, f"{what} failed: {error}")


def upstreams(mr: Any) -> Iterator[Any]:
    """``mr`` and its upstreams (``upstream_mr``), outermost first; each once."""
    seen: set[int] = set()
    while mr is not None and id(mr) not in seen:
        seen.add(id(mr))
        yield mr
        mr = getattr(mr, "upstream_mr", None)


class DeviceMemoryResource:
    """Base class of every memory resource.

    A resource hands out 256-byte aligned pointers (Python ints) and takes them back with
    the size they were allocated with. Subclass it in plain Python and override
    :meth:`allocate` and :meth:`deallocate` to make a custom resource.

    Examples
    --------
    >>> class Counting(DeviceMemoryResource):
    ...     def __init__(self, upstream):
    ...         super().__init__(device_id=upstream.device_id)
    ...         self.upstream, self.n = upstream, 0
    ...     def allocate(self, nbytes, stream=DEFAULT_STREAM):
    ...         self.n += 1
    ...         return self.upstream.allocate(nbytes, stream)
    ...     def deallocate(self, ptr, nbytes, stream=DEFAULT_STREAM):
    ...         self.upstream.deallocate(ptr, nbytes, stream)
    """

    #: The CUDA device that was current when the resource was made (0 for host memory on a
    #: host without a GPU).
    device_id: int = 0

    def __init__(self, device_id: int | None = None):
        if device_id is not None:
            self.device_id = device_id

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        """Allocate ``nbytes`` on ``stream`` and return the pointer as an int."""
        raise NotImplementedError(f"{type(self).__name__} does not implement allocate()")

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        """Free ``ptr``, which was allocated with ``nbytes``, in stream order on ``stream``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement deallocate()")

    def reserved_memory_info(self) -> ReservedMemoryInfo | None:
        """What this resource (or the nearest pooling resource below it) holds from upstream;
        ``None`` for resources that do not pool."""
        return None

    @property
    def is_host_memory(self) -> bool:
        """True when the pointers are host memory (SystemMemoryResource and what wraps it)."""
        return False

    def _repr_fields(self) -> str:
        """What ``repr`` shows after the device."""
        return ""

    def __repr__(self) -> str:
        fields = self._repr_fields()
        return f"<{type(self).__name__} device={self.device_id}{' ' * bool(fields)}{fields}>"


class UpstreamResourceAdaptor(DeviceMemoryResource):
    """A resource built on another one, its *upstream*, to which it forwards what it does not
    override. ``upstream_mr`` is kept alive for as long as the adaptor lives."""

    def __init__(self, upstream_mr: DeviceMemoryResource):
        if not isinstance(upstream_mr, DeviceMemoryResource):
            raise TypeError(
                f"upstream_mr must be a DeviceMemoryResource, got {type(upstream_mr).__name__}"
            )
        super().__init__(device_id=upstream_mr.device_id)
        self.upstream_mr = upstream_mr
        # Bound once: the adaptors' hot paths call these without an attribute lookup chain.
        self._upstream_allocate = upstream_mr.allocate
        self._upstream_deallocate = upstream_mr.deallocate

    def _fuse(self, pool: Any, lock: Any = None) -> None:
        """Make ``pool``'s ``allocate``/``deallocate`` this adaptor's own (instance attributes
        shadow the methods: calls skip this layer); readers then take ``lock``, if given."""
        self.allocate = pool.allocate  # type: ignore[method-assign]
        self.deallocate = pool.deallocate  # type: ignore[method-assign]
        if lock is not None:
            self._lock = lock
            self._acquire, self._release = lock.acquire, lock.release

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        return self._upstream_allocate(nbytes, stream)

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        self._upstream_deallocate(ptr, nbytes, stream)

    def get_upstream(self) -> DeviceMemoryResource:
        return self.upstream_mr

    def reserved_memory_info(self) -> ReservedMemoryInfo | None:
        return self.upstream_mr.reserved_memory_info()

    @property
    def is_host_memory(self) -> bool:
        return self.upstream_mr.is_host_memory

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]} upstream={self.upstream_mr!r}>"
