"""``LimitingResourceAdaptor``: refuses allocations that would take the bytes allocated through
it over a fixed limit. Sizes are counted rounded up to the 256-byte allocation alignment."""

from __future__ import annotations

import threading

from dask_rmm.mr.base import (
    DeviceMemoryResource,
    OutOfMemoryError,
    UpstreamResourceAdaptor,
    check_nbytes,
)
from dask_rmm.sizes import align_up, format_bytes
from dask_rmm.stream import DEFAULT_STREAM, Stream

__all__ = ["LimitingResourceAdaptor"]


class LimitingResourceAdaptor(UpstreamResourceAdaptor):
    """Caps the bytes allocated through it (each allocation rounded up to 256) at
    ``allocation_limit``, reserving an allocation's room before asking the upstream (threads
    racing for the last bytes never together exceed the limit).

    Examples
    --------
    >>> from dask_rmm.mr import LimitingResourceAdaptor, SystemMemoryResource
    >>> mr = LimitingResourceAdaptor(SystemMemoryResource(), allocation_limit=1024)
    >>> p = mr.allocate(1000)
    >>> mr.get_allocated_bytes()
    1024
    >>> mr.deallocate(p, 1000)
    """

    def __init__(self, upstream_mr: DeviceMemoryResource, allocation_limit: int):
        super().__init__(upstream_mr)
        self._limit = check_nbytes(allocation_limit, "allocation_limit")
        self._lock = threading.Lock()
        self._allocated = 0

    def get_allocated_bytes(self) -> int:
        """Bytes allocated through this adaptor, each allocation rounded up to 256."""
        return self._allocated

    def get_allocation_limit(self) -> int:
        """The limit given at construction."""
        return self._limit

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        nbytes = check_nbytes(nbytes)
        size = align_up(nbytes)
        with self._lock:
            allocated = self._allocated
            if allocated + size > self._limit:
                raise OutOfMemoryError(
                    f"LimitingResourceAdaptor: exceeded memory limit (failed to allocate "
                    f"{format_bytes(nbytes)}: {format_bytes(allocated)} of "
                    f"{format_bytes(self._limit)} in use, {format_bytes(self._limit - allocated)} "
                    "left)",
                    requested=nbytes,
                    resource="LimitingResourceAdaptor",
                    stream=getattr(stream, "handle", None),
                    maximum_pool_size=self._limit,
                    free_bytes=self._limit - allocated,
                )
            self._allocated = allocated + size
        try:
            return self._upstream_allocate(nbytes, stream)
        except BaseException:
            with self._lock:
                self._allocated -= size
            raise

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        self._upstream_deallocate(ptr, nbytes, stream)
        if nbytes:
            size = align_up(nbytes)
            with self._lock:
                self._allocated -= size

    def _repr_fields(self) -> str:
        return f"{format_bytes(self._allocated)} of {format_bytes(self._limit)}"
