"""``CallbackMemoryResource``: a resource whose allocate and deallocate are two user functions,
with RMM's signatures. For debugging and experiments; every call goes through Python."""

from __future__ import annotations

import operator
from collections.abc import Callable

from dask_rmm import _cuda
from dask_rmm.mr.base import DeviceMemoryResource
from dask_rmm.stream import DEFAULT_STREAM, Stream, as_stream

__all__ = ["CallbackMemoryResource"]


class CallbackMemoryResource(DeviceMemoryResource):
    """Allocates with ``allocate_func(nbytes, stream) -> int`` and frees with
    ``deallocate_func(ptr, nbytes, stream)``, which own all bookkeeping (a wrong free is
    whatever ``deallocate_func`` makes of it); ``device_id`` defaults to the current device.

    Examples
    --------
    >>> from dask_rmm.mr import CallbackMemoryResource, SystemMemoryResource
    >>> base = SystemMemoryResource()
    >>> sizes = []
    >>> def allocate(nbytes, stream):
    ...     sizes.append(nbytes)
    ...     return base.allocate(nbytes, stream)
    >>> mr = CallbackMemoryResource(allocate, base.deallocate)
    >>> mr.deallocate(mr.allocate(256), 256)
    >>> sizes
    [256]
    """

    def __init__(
        self,
        allocate_func: Callable[[int, Stream], int],
        deallocate_func: Callable[[int, int, Stream], None],
        device_id: int | None = None,
    ):
        if not callable(allocate_func):
            raise TypeError(f"allocate_func must be callable, got {allocate_func!r}")
        if not callable(deallocate_func):
            raise TypeError(f"deallocate_func must be callable, got {deallocate_func!r}")
        super().__init__(device_id=_cuda.current_device() if device_id is None else device_id)
        self._allocate_func = allocate_func
        self._deallocate_func = deallocate_func

    def allocate(self, nbytes: int, stream: Stream = DEFAULT_STREAM) -> int:
        """Call ``allocate_func``. Any exception it raises but MemoryError, RuntimeError,
        KeyboardInterrupt and SystemExit becomes a chained RuntimeError, as RMM's C++ boundary
        turns it into ``std::runtime_error``."""
        try:
            ptr = self._allocate_func(nbytes, as_stream(stream))
        except (MemoryError, RuntimeError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise RuntimeError(str(e)) from e
        try:
            return operator.index(ptr)
        except TypeError:
            raise TypeError(
                f"CallbackMemoryResource: allocate_func returned {ptr!r} "
                f"({type(ptr).__name__}); it must return the pointer as an int"
            ) from None

    def deallocate(self, ptr: int, nbytes: int, stream: Stream = DEFAULT_STREAM) -> None:
        """Call ``deallocate_func``; what it raises passes through."""
        self._deallocate_func(ptr, nbytes, as_stream(stream))
